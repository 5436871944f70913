"""Trace formats are detected, timestamps normalised, bad input rejected with clear errors."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from tessera.api.traces import load_trace
from tessera.sim.workloads import (
    bursty_arrivals,
    count_tokens,
    gamma_arrivals,
    poisson_arrivals,
    requests_from_trace,
    scale_to_rate,
    set_token_counter,
)


def test_azure_2023_format(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109"
    )
    rows = load_trace(path)
    assert [r.input_tokens for r in rows] == [374, 396]
    assert [r.output_tokens for r in rows] == [44, 109]
    assert rows[0].arrival == 0.0
    assert rows[1].arrival == pytest.approx(4.314579, abs=1e-5)


def test_burstgpt_format(tmp_path):
    path = tmp_path / "burst.csv"
    path.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "10,ChatGPT,100,20,120,Conversation log\n5,GPT-4,50,10,60,Conversation log\n"
    )
    rows = load_trace(path)
    assert [(r.arrival, r.input_tokens, r.model) for r in rows] == [(0.0, 50, "GPT-4"), (5.0, 100, "ChatGPT")]


def test_mooncake_jsonl_gz_in_milliseconds(tmp_path):
    path = tmp_path / "mooncake.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        fh.write(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 3}) + "\n")
        fh.write(json.dumps({"timestamp": 2500, "input_length": 20, "output_length": 4}) + "\n")
    rows = load_trace(path)
    assert [r.arrival for r in rows] == [0.0, 2.5]


def test_generic_with_text_and_class(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text(
        json.dumps({"arrival_s": 1.5, "prompt_tokens": 7, "output_tokens": 2, "prompt": "hi"}) + "\n"
    )
    rows = load_trace(path)
    assert rows[0].prompt == "hi" and rows[0].input_tokens == 7


def test_missing_columns_say_what_is_expected(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("when,input_tokens\n1,2\n")
    with pytest.raises(ValueError, match=r"missing columns: arrival .*output tokens"):
        load_trace(path)


@pytest.mark.parametrize("value", ["-3", "abc", "1.5"])
def test_bad_values_name_the_line(tmp_path, value):
    path = tmp_path / "bad.csv"
    path.write_text(f"arrival_s,input_tokens,output_tokens\n0,1,1\n1,{value},1\n")
    with pytest.raises(ValueError, match=r"bad.csv:3: input_tokens"):
        load_trace(path)


def test_rate_scaling_and_replay(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,input_tokens,output_tokens\n0,5,0\n1,5,2\n2,0,3\n")
    reqs = requests_from_trace(load_trace(path), np.random.default_rng(0), rate=4.0)
    assert [r.arrival for r in reqs] == pytest.approx([0.0, 0.25, 0.5])
    assert [r.target_output_tokens for r in reqs] == [1, 2, 3]
    assert scale_to_rate([0, 10, 20], 0.5)[-1] == pytest.approx(4.0)


def test_arrival_processes_have_the_asked_mean_rate():
    rng = np.random.default_rng(1)
    for arr in (
        poisson_arrivals(20000, 5.0, rng),
        gamma_arrivals(20000, 0.25, 0.8, rng),
        bursty_arrivals(20000, 5.0, rng, multiplier=2.0, fraction=0.35),
    ):
        assert len(arr) == 20000 and arr[0] == 0
        assert (len(arr) - 1) / arr[-1] == pytest.approx(5.0, rel=0.05)
    with pytest.raises(ValueError, match="rate must be > 0"):
        poisson_arrivals(3, 0.0, rng)


def test_token_counter_is_swappable():
    assert count_tokens("one two three four five six seven eight nine ten") == 13
    set_token_counter(len)
    try:
        assert count_tokens("abc") == 3
    finally:
        set_token_counter(None)

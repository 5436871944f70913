"""Trace rows with prompt text (sent as chat, the model choosing its length), the answers shown, and
the side-by-side report of two policies on the same load."""

from __future__ import annotations

import pytest

from tessera.api.traces import TraceRow
from tessera.core.request import Phase, Request, ServiceClass
from tessera.local.load import LoadItem, Outcome, WorkloadError, WorkloadOptions, build_workload
from tessera.local.report import render_answers, render_comparison, summarize_outcomes
from tessera.router.app import ClassInfo

CHAT = ServiceClass("chat", "interactive", ttft_slo_s=1.0)
BATCH = ServiceClass("batch", "batch", deadline_s=10.0)
CLASSES = {"chat": ClassInfo("chat", CHAT), "batch": ClassInfo("batch", BATCH)}


def test_text_prompts_keep_their_length_and_only_the_output_cap_shrinks() -> None:
    rows = [TraceRow(0.0, 40, 64, service_class="chat", prompt="What is the capital of France?"),
            TraceRow(1.0, 500, 64, service_class="batch", prompt="Summarise this long text ..."),
            TraceRow(2.0, 900, 64, service_class="batch")]  # fmt: skip
    w = build_workload(rows, CLASSES, {"m": 512}, WorkloadOptions(max_input_tokens=100))
    got = [(i.prompt_text, i.prompt_tokens, i.max_tokens) for i in w.items]
    assert got == [("What is the capital of France?", 40, 64), ("Summarise this long text ...", 500, 12),
                   (None, 100, 64)]  # fmt: skip
    assert w.clipped == 1
    too_long = [TraceRow(0.0, 512, 8, prompt="x " * 600)]
    with pytest.raises(
        WorkloadError, match="trace request 1: its prompt has 512 tokens, model m's context only 512"
    ):
        build_workload(too_long, CLASSES, {"m": 512}, WorkloadOptions())


def _outcome(index: int, cls: ServiceClass, ttft: float, answer: str, finish: str, n: int = 5) -> Outcome:
    req = Request(id=str(index), arrival=0.0, prompt_tokens=4, max_tokens=n, service_class=cls)
    for k in range(n):
        req.tokens.append(ttft + 0.1 * k)
    req.generated, req.phase, req.finished_at = n, Phase.FINISHED, ttft + 0.1 * (n - 1)
    item = LoadItem(index, 0.0, "m", cls.name, 4, n, f"question {index}?")
    return Outcome(item, req, 200, answer=answer, finish=finish)


def test_answers_show_interactive_whole_answers_first_and_mark_cut_ones() -> None:
    outcomes = [_outcome(0, BATCH, 0.5, "batch answer", "stop"),
                _outcome(1, CHAT, 0.5, "cut   chat\n answer", "length"),
                _outcome(2, CHAT, 0.5, "whole chat answer", "stop")]  # fmt: skip
    text = render_answers(outcomes, 2)
    assert text.splitlines() == [
        "2 of the answers (greedy, as the model wrote them):",
        "  [chat] Q: question 2?",
        "         A: whole chat answer",
        "  [chat] Q: question 1?",
        "         A: cut chat answer [cut at 5 tokens]",
    ]
    assert render_answers([], 3).startswith("no answers to show")


def test_comparison_puts_each_policy_in_a_column() -> None:
    fast = summarize_outcomes(
        [_outcome(0, CHAT, 0.5, "a", "stop"), _outcome(1, BATCH, 2.0, "b", "stop")], 10.0
    )
    slow = summarize_outcomes(
        [_outcome(0, CHAT, 4.0, "a", "stop"), _outcome(1, BATCH, 1.0, "b", "stop")], 10.0
    )
    lines = render_comparison({"qlm": fast, "fcfs": slow}).splitlines()
    assert lines[0].split() == ["same", "load,", "policy", "qlm", "fcfs"]
    rows = {line[:30].strip(): line[30:].split() for line in lines[2:]}
    assert rows["chat (interactive) TTFT p99"] == ["0.50", "s", "4.00", "s"]
    assert rows["chat (interactive) SLO met"] == ["100.0%", "0.0%"]
    assert rows["batch (batch) SLO met"] == ["100.0%", "100.0%"]
    assert rows["all SLO met"] == ["100.0%", "50.0%"]
    assert rows["finished/sent"] == ["2/2", "2/2"]

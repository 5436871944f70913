"""`tessera bench load-shift`'s simulated workers answer the operator as Prometheus would: their counters
sampled at the subqueries' steps and read by the operator's own parser; and the scenario's options are
validated."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tessera.bench.scenarios import BenchConfig
from tessera.bench.scenarios.load_shift import SimulatedWorkers, merge_patch, setup
from tessera.core.request import Request


def test_simulated_workers_count_what_finished_in_each_step_of_the_window() -> None:
    requests = []
    # (arrival, finished at or None, prompt, output)
    for i, (arrival, end, prompt, output) in enumerate(
        [(1, 3, 100, 10), (2, 7, 200, 20), (12, 15, 300, 30), (16, None, 50, 5), (13, 19, 100, 10)]
    ):
        r = Request(
            f"r{i}", arrival, prompt, output, model="s0" if i < 4 else "s1", true_output_tokens=output
        )
        if end is not None:
            r.finished_at, r.generated = float(end), output
        requests.append(r)
    refused = Request("x", 18.0, 10, 1, model="s0")
    alive = SimpleNamespace(profiles={"s0": None, "s1": None}, created_at=0.0, retired_at=None)
    workers = SimulatedWorkers({"s0": "org/s0-8B", "s1": "org/s1-8B"}, requests)
    workers.cluster = SimpleNamespace(rejected=[refused], instances=[alive], retired=[])  # type: ignore[assignment]
    workers.now = 20.0
    loads = workers.loads("ns", "pool", 10.0)  # steps of 2 s: (10, 12], ..., (18, 20]
    assert loads is not None and set(loads) == {"org/s0-8B", "org/s1-8B"}
    s0 = loads["org/s0-8B"]
    assert s0.step_s == 2 and s0.span_s == 10
    assert s0.finished == (0, 0, 1, 0, 0)  # r0 and r1 finished before the window, r3 not yet
    # Arrivals are demand: r2 where it arrived (12, on the first step's end point), r3 though it has not
    # finished (the held gauge grew), the refused request where it was refused.
    assert s0.arrivals == (1, 0, 1, 1, 0)
    assert s0.outstanding == 1  # r3
    assert s0.output_tokens == (0, 0, 30, 0, 0) and s0.prompt_tokens == (0, 0, 300, 0, 0)
    assert s0.e2e_seconds == 3 and s0.rate == pytest.approx(0.3)
    assert s0.mean_prompt_tokens == 300 and s0.mean_output_tokens == 30
    assert loads["org/s1-8B"].finished == (0, 0, 0, 0, 1)
    assert workers.calls[-1][1:] == (10.0, loads)


def test_status_patches_merge_as_the_api_server_merges_them() -> None:
    status = {"a": {"b": 1, "c": 2}, "d": [1, 2]}
    merge_patch(status, {"a": {"b": None, "e": 3}, "d": [3]})
    assert status == {"a": {"c": 2, "e": 3}, "d": [3]}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rates": "4"}, "one value per service"),
        ({"factors": "2,0"}, "factors= must be > 0"),
        ({"shift_minute": 12}, "before the end"),
        ({"gpus": 1}, "whole number >= the services"),
        ({"recovery": 1.5}, "recovery="),
        ({"beta": "0.1,0.2"}, "takes one number"),
        ({"shfit_minute": 2}, "unknown --set options"),
    ],
)
def test_options_are_validated(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        setup(BenchConfig("load-shift", options=options))

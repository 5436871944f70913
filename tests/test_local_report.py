"""Workload building from trace rows and the SLO report over client-side measurements."""

from __future__ import annotations

import pytest

from tessera.api.traces import TraceRow
from tessera.core.request import Phase, Request, ServiceClass
from tessera.local.load import LoadItem, Outcome, Workload, WorkloadError, WorkloadOptions, build_workload
from tessera.local.report import render_report, summarize_outcomes
from tessera.router.app import ClassInfo

CHAT = ServiceClass("chat", "interactive", ttft_slo_s=1.0, itl_slo_s=0.1)
BATCH = ServiceClass("offline", "batch", deadline_s=10.0)
CLASSES = {"chat": ClassInfo("chat", CHAT), "offline": ClassInfo("batch", BATCH)}


def _outcome(cls: ServiceClass, first: float, gap: float, n: int, *, error: str | None = None) -> Outcome:
    req = Request(id="r", arrival=0.0, prompt_tokens=4, max_tokens=n, service_class=cls)
    item = LoadItem(0, 0.0, "m", cls.name, 4, n)
    if error is None:
        for k in range(n):
            req.tokens.append(first + k * gap)
        req.generated, req.phase, req.finished_at = n, Phase.FINISHED, first + (n - 1) * gap
    return Outcome(item, req, 200 if error is None else 503, error)


def test_slo_attainment_by_class_counts_failures_as_misses() -> None:
    outcomes = [
        _outcome(CHAT, 0.5, 0.05, 10),  # met
        _outcome(CHAT, 1.5, 0.05, 10),  # TTFT missed
        _outcome(CHAT, 0.5, 0.2, 10),  # ITL missed
        _outcome(CHAT, 0.0, 0.0, 3, error="HTTP 503"),  # failed: a miss
        _outcome(BATCH, 5.0, 0.1, 20),  # done at 6.9 s: met
        _outcome(BATCH, 9.0, 0.1, 20),  # done at 10.9 s: missed
    ]
    s = summarize_outcomes(outcomes, wall_s=12.0)
    assert (s["requests"], s["finished"], s["failed"]) == (6, 5, 1)
    assert s["slo_attainment_by_class"] == {"chat": 0.25, "offline": 0.5}
    assert s["slo_attainment"] == pytest.approx(2 / 6)
    assert s["by_class"]["chat"]["mean_ttft_s"] == pytest.approx((0.5 + 1.5 + 0.5) / 3)
    assert s["first_error"] == "HTTP 503"
    text = render_report(s)
    assert "25.0%" in text and "50.0%" in text and "failed 1" in text


def test_workload_classes_models_scaling_and_context_fit() -> None:
    rows = [TraceRow(float(i), 100, 50) for i in range(10)] + [
        TraceRow(20.0, 600, 100, service_class="batch")
    ]
    w = build_workload(rows, CLASSES, {"a": 512, "b": 512}, WorkloadOptions(time_scale=2.0, batch_share=0.5))
    assert [i.at for i in w.items[:3]] == [0.0, 0.5, 1.0]
    assert {i.model for i in w.items} == {"a", "b"}
    assert {i.class_name for i in w.items[:10]} == {"chat", "offline"}
    last = w.items[-1]
    assert (last.class_name, last.prompt_tokens, last.max_tokens, w.clipped) == ("offline", 412, 100, 1)
    short = build_workload(rows, CLASSES, {"a": 512}, WorkloadOptions(duration_s=3.0, max_output_tokens=8))
    assert [(i.at, i.max_tokens) for i in short.items] == [(0.0, 8), (1.0, 8), (2.0, 8)]
    assert isinstance(short, Workload)


def test_workload_errors_say_what_to_change() -> None:
    rows = [TraceRow(0.0, 10, 10, service_class="gold")]
    with pytest.raises(WorkloadError, match=r"class 'gold'.*classes: chat, offline"):
        build_workload(rows, CLASSES, {"a": 512}, WorkloadOptions())
    with pytest.raises(WorkloadError, match="--model 'x' is not served"):
        build_workload(rows, CLASSES, {"a": 512}, WorkloadOptions(model="x"))
    with pytest.raises(WorkloadError, match="--batch-share"):
        WorkloadOptions(batch_share=1.5)
    with pytest.raises(WorkloadError, match="--time-scale"):
        WorkloadOptions(time_scale=float("nan"))  # NaN compares false with everything
    with pytest.raises(WorkloadError, match="--duration"):
        WorkloadOptions(duration_s=float("nan"))
    with pytest.raises(WorkloadError, match="no batch class"):
        build_workload(
            [TraceRow(0.0, 1, 1)], {"chat": CLASSES["chat"]}, {"a": 64}, WorkloadOptions(batch_share=1.0)
        )


def test_local_flags_are_checked_by_the_flag_parser(capsys: pytest.CaptureFixture[str]) -> None:
    from tessera.cli import main

    for args, says in (
        (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
        (["--ready-timeout", "0"], "argument --ready-timeout: must be a finite number > 0, got 0"),
        (["--kv-cache-gib", "0"], "argument --kv-cache-gib: must be >= 1, got 0"),
        (["--duration", "nan"], "argument --duration: must be a finite number > 0, got nan"),
    ):
        with pytest.raises(SystemExit) as exited:  # argparse exits 2 on a bad flag, before anything starts
            main(["local", "up", "-f", "examples/quickstart.yaml", *args])
        assert exited.value.code == 2
        assert says in capsys.readouterr().err

"""Local mode compares two policies on the same load without restarting the engines: the demo's spec
on sim workers, real text prompts sent as chat, the policy switched in place between the runs."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from tessera.api import load_documents
from tessera.api.traces import load_trace
from tessera.local.control_plane import LocalEngine, plan_local
from tessera.local.load import WorkloadOptions, build_workload
from tessera.local.runner import LoadSettings, LocalStack, compare_policies
from tessera.router.app import class_infos
from tessera.worker.engines.vllm_process import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


async def test_policy_then_fcfs_on_the_same_load_side_by_side(tmp_path: Path) -> None:
    plan = plan_local(load_documents(EXAMPLES / "demo-real.yaml"), LocalEngine())
    (inst,) = plan.instances
    assert inst.config.scheduling.policy == "qlm" and inst.config.scheduling.batch.max == 4
    # A batch job of 40 long answers fills the 4 slots and the queue at once; people chat meanwhile.
    rows = [{"arrival_s": 0.01 * i, "class": "batch", "prompt": f"Write essay {i} about rivers.",
             "input_tokens": 12, "output_tokens": 150} for i in range(40)]  # fmt: skip
    rows += [{"arrival_s": 0.5 + 0.5 * i, "class": "chat", "prompt": f"Question {i}: why is the sky blue?",
              "input_tokens": 14, "output_tokens": 10} for i in range(6)]  # fmt: skip
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    classes = class_infos(inst.config)
    workload = build_workload(load_trace(trace), classes, {"smollm2": 2048}, WorkloadOptions())
    assert {i.prompt_text is not None for i in workload.items} == {True}
    stack = LocalStack(plan, tmp_path / "run", "127.0.0.1", free_port(), autoscale=False)
    await stack.start(60.0)
    try:
        (worker,) = stack.supervisor.workers
        out = io.StringIO()
        settings = LoadSettings(json_path=tmp_path / "r.json", plot_dir=tmp_path / "plots", live=False,
                                answers=2)  # fmt: skip
        runs = await compare_policies(stack, workload, classes, settings, "qlm", "fcfs", out)
        assert worker.proc is not None and worker.proc.poll() is None  # the same process served both
    finally:
        await stack.stop()
    text = out.getvalue()
    assert list(runs) == ["qlm", "fcfs"]
    for run in runs.values():
        assert (run["requests"], run["finished"], run["failed"]) == (46, 46, 0)
    chat = {name: run["by_class"]["chat"]["p99_ttft_s"] for name, run in runs.items()}
    # Under FCFS the chat requests wait behind the batch job's queue; QLM serves them first.
    assert chat["qlm"] * 2 < chat["fcfs"], chat
    assert (
        runs["qlm"]["by_class"]["chat"]["slo_attainment"] > runs["fcfs"]["by_class"]["chat"]["slo_attainment"]
    )
    assert "policy switched to fcfs in every worker" in text
    assert "chat (interactive) TTFT p99" in text and text.count("policy qlm:") == 1
    assert "2 of the answers" in text and "[chat] Q: Question 0: why is the sky blue?" in text
    report = json.loads((tmp_path / "r.json").read_text())
    assert [r["policy"] for r in report["results"]] == ["qlm", "fcfs"]
    plots = {p.relative_to(tmp_path / "plots").as_posix() for p in (tmp_path / "plots").rglob("*.png")}
    assert {"ttft_by_policy.png", "qlm/ttft_cdf.png", "fcfs/ttft_cdf.png"} <= plots

"""Local mode compares two policies on the same load without restarting the engines: the demo's spec
on sim workers, real text prompts sent as chat, the policy switched in place between the runs."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from tessera.api import load_documents
from tessera.api.traces import load_trace
from tessera.commands import local as local_command
from tessera.local.control_plane import LocalEngine, plan_local
from tessera.local.load import WorkloadOptions, build_workload
from tessera.local.runner import LoadSettings, LocalStack, ask_adapters, compare_policies
from tessera.models.cache import CACHE_ENV, write_manifest
from tessera.models.registry import KNOWN
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


async def test_the_demo_asks_its_adapter_and_its_base_the_same_chat_prompts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo's last part on sim workers: the router lists the base and its adapter, and each of the
    first chat prompts is answered by both, through the router."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "smollm2-lora"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text('{"r": 8}')
    write_manifest(folder, KNOWN["smollm2-lora"], None)
    docs = load_documents(EXAMPLES / "demo-real.yaml")
    plan = plan_local(docs, LocalEngine(), adapter_folders=local_command.adapter_folders(docs))
    classes = class_infos(plan.instances[0].config)
    rows = load_trace(EXAMPLES / "traces" / "demo-real.jsonl")
    options = WorkloadOptions(model="smollm2", max_output_tokens=8)
    workload = build_workload(rows, classes, {"smollm2": 2048}, options)
    stack = LocalStack(plan, tmp_path / "run", "127.0.0.1", free_port(), autoscale=False, batch=False)
    await stack.start(60.0)
    out = io.StringIO()
    try:
        outcomes = await ask_adapters(stack, workload, classes, 2, out)
    finally:
        await stack.stop()
    text = out.getvalue()
    assert "models the router lists (/v1/models): smollm2, smollm2-tessera" in text
    assert [(o.item.model, o.ok) for o in outcomes] == [("smollm2", True), ("smollm2-tessera", True)] * 2
    assert {o.instance for o in outcomes} == {plan.instances[0].name}  # the base's worker serves both
    assert "the same prompts to smollm2, smollm2-tessera" in text and text.count("  Q: ") == 2
    assert text.count("    smollm2-tessera  A: ") == 2

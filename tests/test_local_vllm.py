"""Local mode once with real vLLM on this CPU: the session's shared tiny-model server behind a local
worker and the router (``--engine vllm --vllm-url``; one vLLM server on the machine at a time)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from conftest import TINY_MAX_MODEL_LEN, TINY_MODEL_NAME

from tessera.api import load_documents
from tessera.local.control_plane import LocalEngine, plan_local
from tessera.local.load import LoadItem, Workload
from tessera.local.runner import LoadSettings, LocalStack, run_load
from tessera.router.app import class_infos
from tessera.worker.engines.vllm_process import VLLMServer, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


async def test_local_mode_with_real_vllm(vllm_server: VLLMServer, tmp_path: Path) -> None:
    # The quickstart, serving the tiny model under its served name and context length.
    text = (EXAMPLES / "quickstart.yaml").read_text()
    text = text.replace("meta-llama/Llama-3.1-8B-Instruct", TINY_MODEL_NAME)
    text = text.replace("maxModelLength: 8192", f"maxModelLength: {TINY_MAX_MODEL_LEN}")
    spec = tmp_path / "spec.yaml"
    spec.write_text(text)
    plan = plan_local(load_documents(spec), LocalEngine("vllm", vllm_url=vllm_server.url),
                      max_instances_per_group=1)  # fmt: skip
    stack = LocalStack(plan, tmp_path / "run", "127.0.0.1", free_port())
    await stack.start(60.0)
    try:
        classes = class_infos(plan.instances[0].config)
        items = tuple(
            LoadItem(i, 0.2 * i, TINY_MODEL_NAME, ["chat", "offline"][i % 2], 16 + i, 24) for i in range(6)
        )
        out = io.StringIO()
        settings = LoadSettings(json_path=tmp_path / "r.json", live=False)
        summary = await run_load(stack.endpoint, Workload(items, 0), classes, "X-Tessera-Class", settings,
                                 stack.status, out)  # fmt: skip
    finally:
        await stack.stop()
    assert (summary["requests"], summary["finished"], summary["failed"]) == (6, 6, 0), out.getvalue()
    # Every stream delivered exactly max_tokens tokens (ignore_eos), measured on the client.
    assert summary["output_tokens"] == 6 * 24 and summary["by_class"]["chat"]["finished"] == 3
    report = json.loads((tmp_path / "r.json").read_text())["results"][0]
    assert set(report["slo_attainment_by_class"]) == {"chat", "offline"}
    assert vllm_server.healthy()  # the shared server is left as found

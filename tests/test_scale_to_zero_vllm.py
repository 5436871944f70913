"""Local mode scale to zero once with real vLLM on this CPU: the tiny model served by a vLLM server the
worker launches (``--engine vllm --model DIR``) goes Cold after its idle time (worker and vLLM stopped),
and a held request wakes it (a new worker and a new vLLM server: a process cold start, vLLM on CPU has
no sleep mode) and is served. Its own server, not the session's shared one: the test needs to stop and
start it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from conftest import TINY_MAX_MODEL_LEN

from tessera.api import load_documents
from tessera.local.control_plane import LocalEngine, plan_local
from tessera.local.runner import LocalStack
from tessera.worker.engines.vllm_process import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
READY_S = 600.0  # a vLLM cold start on a busy 2-core machine


async def _unit(client: httpx.AsyncClient) -> dict:  # type: ignore[type-arg]
    status = (await client.get("/router/status")).json()
    return next(iter(status["activation"].values()))  # type: ignore[no-any-return]


async def test_a_cold_vllm_model_is_woken_by_a_held_request_and_serves_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    text = (EXAMPLES / "quickstart.yaml").read_text()
    text = text.replace("maxModelLength: 8192", f"maxModelLength: {TINY_MAX_MODEL_LEN}")
    idle = f"  scaleToZero:\n    afterSeconds: 1\n    holdSeconds: {READY_S:.0f}\n"
    text = text.replace("  defaultClass: chat\n", "  defaultClass: chat\n" + idle)
    spec = tmp_path / "spec.yaml"
    spec.write_text(text)
    engine = LocalEngine("vllm", model_dir=str(tiny_model_dir), dtype="float32", enforce_eager=True)
    plan = plan_local(load_documents(spec), engine, max_instances_per_group=1)
    stack = LocalStack(
        plan, tmp_path / "run", "127.0.0.1", free_port(), autoscale=False, activation_tick_s=0.2
    )
    await stack.start(READY_S)
    model = plan.instances[0].config.models[0].name
    body = {"model": model, "prompt": "hello", "max_tokens": 4}
    try:
        async with httpx.AsyncClient(base_url=stack.endpoint, timeout=READY_S + 60) as client:
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            # Counted from the first answer: on a loaded machine the model may already have slept
            # once before it (more than afterSeconds after the start) and been woken by it.
            first = await _unit(client)
            while (await _unit(client))["state"] != "Cold":
                await asyncio.sleep(0.2)
            assert not stack.supervisor.workers  # the worker and its vLLM server stopped
            assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == [model]
            sent = time.monotonic()
            answer = await client.post("/v1/completions", json=body)
            served_s = time.monotonic() - sent
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] == 4
            unit = await _unit(client)
            slept, woke = unit["sleeps"] - first["sleeps"], unit["wakes"] - first["wakes"]
            assert (unit["state"], slept, woke) == ("Ready", 1, 1)
            # The held request waited the whole cold start: a new process, not a wake from memory.
            assert 1.0 < unit["lastWakeSeconds"] <= served_s
            print(f"\nvLLM cold start on wake {unit['lastWakeSeconds']:.1f} s; held request served in "
                  f"{served_s:.1f} s")  # fmt: skip
    finally:
        await stack.stop()

"""A LoRA adapter LLMService in local mode on real vLLM (CPU): the session's tiny-model server, which
serves LoRA as a base model's server does, behind a local worker and the router. A chat to the
adapter's name through the router (the official ``openai`` client) gets vLLM's own greedy answer for
that adapter while base requests are served beside it, also with every LoRA slot full (a second adapter
asked at once); an unknown name is a 404 naming the models."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest
from conftest import TINY_LORA_RANK, TINY_MAX_LORAS, TINY_MAX_MODEL_LEN, TINY_MODEL_NAME

from tessera.api import load_documents
from tessera.local.control_plane import LocalEngine, plan_local
from tessera.local.runner import LocalStack
from tessera.worker.engines.vllm_process import VLLMServer, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
ADAPTER = "tiny-adapter"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0, "max_tokens": 12}

SPEC = f"""
apiVersion: tessera.dev/v1alpha1
kind: ServingPool
metadata: {{name: lora-pool}}
spec:
  gpu: {{type: H100, perInstance: 1, memory: 80Gi}}
  instances: {{min: 1, max: 1}}
  maxLoraRank: {TINY_LORA_RANK}
  maxLoras: {TINY_MAX_LORAS}
---
apiVersion: tessera.dev/v1alpha1
kind: RequestClass
metadata: {{name: chat}}
spec: {{kind: interactive, slo: {{ttftSeconds: 30}}, match: {{value: chat}}}}
---
apiVersion: tessera.dev/v1alpha1
kind: LLMService
metadata: {{name: base}}
spec:
  model: {{name: {TINY_MODEL_NAME}, maxModelLength: {TINY_MAX_MODEL_LEN}, weightsSize: 1Gi}}
  poolRef: {{name: lora-pool}}
  requestClasses: [{{name: chat}}]
---
apiVersion: tessera.dev/v1alpha1
kind: LLMService
metadata: {{name: adapter}}
spec:
  model:
    name: {ADAPTER}
    adapter: {{base: base, source: SOURCE, rank: {TINY_LORA_RANK}}}
  poolRef: {{name: lora-pool}}
  requestClasses: [{{name: chat}}]
"""


# A second adapter service of the same weights: with both asked, every one of the server's LoRA slots
# (TINY_MAX_LORAS, 2) holds an adapter while base requests run beside them.
SECOND = "tiny-adapter-b"
SECOND_SPEC = f"""
---
apiVersion: tessera.dev/v1alpha1
kind: LLMService
metadata: {{name: adapter-b}}
spec:
  model:
    name: {SECOND}
    adapter: {{base: base, source: SOURCE, rank: {TINY_LORA_RANK}}}
  poolRef: {{name: lora-pool}}
  requestClasses: [{{name: chat}}]
"""


async def _answer(client: openai.AsyncOpenAI, model: str) -> str:
    reply = await client.chat.completions.create(model=model, messages=MESSAGES, **GREEDY)  # type: ignore[arg-type]
    return reply.choices[0].message.content or ""


async def _metrics_once(url: str, series: str) -> str:
    """The worker's /metrics once they show ``series`` (vLLM reports its slots after its first step and
    the worker polls them every stats interval), else the last page."""
    page = ""
    for _ in range(40):
        page = httpx.get(f"{url}/metrics", timeout=10).text
        if series in page:
            break
        await asyncio.sleep(0.5)
    return page


async def test_a_chat_to_the_adapter_gets_vllms_own_adapter_answer_beside_base_requests(
    vllm_server: VLLMServer, tiny_adapter_dir: Path, tmp_path: Path
) -> None:
    spec = tmp_path / "lora.yaml"
    spec.write_text((SPEC + SECOND_SPEC).replace("SOURCE", str(tiny_adapter_dir)))
    plan = plan_local(load_documents(spec), LocalEngine("vllm", vllm_url=vllm_server.url))
    stack = LocalStack(plan, tmp_path / "run", "127.0.0.1", free_port(), autoscale=False, batch=False)
    headers = {stack_header: "chat"} if (stack_header := "X-Tessera-Class") else {}
    await stack.start(120.0)
    try:
        router = openai.AsyncOpenAI(
            base_url=f"{stack.endpoint}/v1", api_key="unused", default_headers=headers
        )
        # the adapters' requests and three of the base's, at the same time through the router
        answers = await asyncio.gather(
            _answer(router, ADAPTER),
            _answer(router, SECOND),
            *(_answer(router, TINY_MODEL_NAME) for _ in range(3)),
        )
        (worker,) = stack.supervisor.workers
        metrics = await _metrics_once(worker.url, f'tessera_lora_slots{{model="{TINY_MODEL_NAME}"}}')
        with pytest.raises(openai.NotFoundError) as unknown:
            await _answer(router, "no-such-adapter")
        listed = {m.id for m in (await router.models.list()).data}
        await router.close()
    finally:
        await stack.stop()
    direct = openai.AsyncOpenAI(base_url=f"{vllm_server.url}/v1", api_key="unused")
    try:
        own_adapter, own_base = await _answer(direct, ADAPTER), await _answer(direct, TINY_MODEL_NAME)
    finally:
        await direct.close()
        # the shared server is left as found
        for name in (ADAPTER, SECOND):
            httpx.post(f"{vllm_server.url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30)
    adapter_answer, second_answer, *base_answers = answers
    assert adapter_answer == own_adapter == second_answer and base_answers == [own_base] * 3
    assert adapter_answer != own_base  # the adapter changes vLLM's greedy answer
    assert "no-such-adapter" in str(unknown.value) and ADAPTER in str(unknown.value)
    assert TINY_MODEL_NAME in str(unknown.value) and listed == {TINY_MODEL_NAME, ADAPTER, SECOND}
    # the worker reports what its engine holds: the adapter resident, the base's slots as vLLM has them
    assert f'tessera_lora_adapter_resident{{base="{TINY_MODEL_NAME}",model="{ADAPTER}"}} 1.0' in metrics
    assert f'tessera_lora_slots{{model="{TINY_MODEL_NAME}"}} {float(TINY_MAX_LORAS)}' in metrics


async def test_the_worker_unloads_and_reloads_an_adapter_in_its_bases_vllm(
    vllm_server: VLLMServer, tiny_adapter_dir: Path, tmp_path: Path
) -> None:
    """The pod scheduler's adapter swap on real vLLM: unloaded, the server no longer serves the adapter
    and the worker reports it gone; loaded again, it answers as before."""
    from tessera.worker.runtime import Worker

    spec = tmp_path / "lora.yaml"
    spec.write_text(SPEC.replace("SOURCE", str(tiny_adapter_dir)))
    plan = plan_local(load_documents(spec), LocalEngine("vllm", vllm_url=vllm_server.url))
    worker = Worker(plan.instances[0].config)
    direct = openai.AsyncOpenAI(base_url=f"{vllm_server.url}/v1", api_key="unused")

    def resident() -> float | None:
        labels = {"model": ADAPTER, "base": TINY_MODEL_NAME}
        return worker.metrics.registry.get_sample_value("tessera_lora_adapter_resident", labels)

    await worker.start()
    try:
        assert resident() == 1
        before = await _answer(direct, ADAPTER)
        await worker.swap_adapter(ADAPTER, False)
        assert resident() == 0
        with pytest.raises(openai.NotFoundError):
            await _answer(direct, ADAPTER)
        await worker.swap_adapter(ADAPTER, False)  # not held: nothing to do, no error
        await worker.swap_adapter(ADAPTER, True)
        assert resident() == 1 and await _answer(direct, ADAPTER) == before
        registry, timed = worker.metrics.registry, {"model": ADAPTER}
        assert registry.get_sample_value("tessera_lora_load_seconds_count", timed) == 2  # timed, both
        assert 0 < (registry.get_sample_value("tessera_lora_load_seconds_sum", timed) or 0) < 60
    finally:
        await worker.stop()
        await direct.close()
        httpx.post(f"{vllm_server.url}/v1/unload_lora_adapter", json={"lora_name": ADAPTER}, timeout=30)

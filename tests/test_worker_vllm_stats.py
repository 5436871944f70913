"""On the real vLLM server (the session's tiny model): the adapter's KV capacity is what vLLM reports
(``num_gpu_blocks`` x ``block_size`` of ``vllm:cache_config_info``), its KV use and running count rise
while requests run, and a worker in front of it hands that capacity to its policies."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from conftest import TINY_MAX_MODEL_LEN, TINY_MODEL_NAME

from tessera.api.worker_config import parse_config
from tessera.worker.engines.base import EngineJob
from tessera.worker.engines.vllm import VLLMEngine
from tessera.worker.engines.vllm_process import VLLMServer
from tessera.worker.runtime import Worker

pytestmark = pytest.mark.integration


def _reported_capacity(url: str) -> int:
    """num_gpu_blocks x block_size as vLLM's own /metrics page states them."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    info = next(ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{"))
    blocks = int(re.search(r'num_gpu_blocks="(\d+)"', info).group(1))  # type: ignore[union-attr]
    block = int(re.search(r'block_size="(\d+)"', info).group(1))  # type: ignore[union-attr]
    return blocks * block


async def _drain(engine: VLLMEngine, job: EngineJob) -> None:
    async for _ in engine.stream(job):
        pass


async def test_vllm_reports_its_kv_capacity_and_rising_use(vllm_server: VLLMServer) -> None:
    engine = VLLMEngine(TINY_MODEL_NAME, vllm_server.url, TINY_MAX_MODEL_LEN, sleep_mode="off")
    await engine.start()
    streams: list[asyncio.Task[None]] = []
    try:
        idle = await engine.stats()
        assert idle is not None
        assert idle.kv_capacity_tokens == _reported_capacity(vllm_server.url) > 0
        sampling = {"temperature": 0, "ignore_eos": True}
        for i in range(8):  # distinct prompts: no prefix shared between them
            prompt = [0, *(((i * 997 + k * 13) % 250) + 3 for k in range(600))]
            streams.append(
                # 1400 tokens (within the 2048 context): running for seconds, longer than vLLM's metrics
                # take to show it even on a loaded machine (300 ran out unseen once in a full run, and
                # four of 1400 once, with two benchmarks beside the suite: eight share the steps longer).
                asyncio.create_task(_drain(engine, EngineJob(f"stats-{i}", prompt, 1400, sampling)))
            )
        busy = idle
        for _ in range(600):
            await asyncio.sleep(0.1)
            stats = await engine.stats()
            assert stats is not None and stats.kv_capacity_tokens == idle.kv_capacity_tokens
            if stats.running >= 2 and stats.kv_used_tokens >= idle.kv_used_tokens + 2 * 600:
                busy = stats
                break
            if all(t.done() for t in streams):  # they ended (or failed) before vLLM showed them running
                break
        ended = [repr(t.exception()) if t.done() and not t.cancelled() else "running" for t in streams]
        assert busy is not idle, (
            f"vLLM never reported two running requests holding their KV: {stats}; {ended}"
        )
        assert busy.kv_used_tokens % busy.block_size == 0
    finally:
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        await engine.close()

    config = parse_config(
        {"models": [{"name": TINY_MODEL_NAME, "url": vllm_server.url, "maxModelLen": TINY_MAX_MODEL_LEN}]}
    )
    worker = Worker(config)
    await worker.start()
    try:
        view = worker.scheduler._view(0.0)
        assert view.kv_capacity_tokens == idle.kv_capacity_tokens != config.models[0].kv_capacity_tokens
        assert view.profile.block_size == idle.block_size
        metrics = worker.metrics.exposition().decode()
        assert f'tessera_engine_stats_fallback{{model="{TINY_MODEL_NAME}"}} 0.0' in metrics
    finally:
        await worker.stop()

"""The worker reads the engine's KV cache and request counts instead of constants: the policies'
InstanceView takes the engine's capacity and block size and never less KV use than the engine
reports; an engine that reports nothing leaves the configured capacity, said once in the log and in
/metrics. vLLM's figures come from its Prometheus page (``parse_vllm_metrics``)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import httpx
import pytest

from tessera.api.worker_config import ProfileSpec, parse_config
from tessera.worker.engines.base import EngineStats
from tessera.worker.engines.sim_realtime import SimEngine, next_token
from tessera.worker.engines.vllm import parse_vllm_metrics
from tessera.worker.runtime import Worker
from tessera.worker.server.app import create_app

CONFIGURED_KV = 65536
# One decode step of 10 ms: a request of 30 tokens runs for about 0.3 s.
PROFILE = ProfileSpec(decode_c0=0.01, decode_c1=0.0, prefill_p0=0.001, prefill_p1=0.0)


def _config(policy: str = "fcfs", batch: int = 4) -> Any:
    return parse_config(
        {
            "models": [
                {
                    "name": "m",
                    "engine": "sim",
                    "maxModelLen": 512,
                    "kvCapacityTokens": CONFIGURED_KV,
                    "profile": PROFILE.to_json(),
                }
            ],
            "classes": {"chat": {"slo": {"ttftSeconds": 60}}},
            "scheduling": {"policy": policy, "batch": {"max": batch}},
            "polling": {"engineStatsSeconds": 0.02},
        }
    )


def _engine(kv_tokens: int) -> SimEngine:
    """A sim engine whose own KV cache holds ``kv_tokens`` (what it reports), whatever the worker's
    configuration says."""
    return SimEngine("m", PROFILE.to_profile("m", kv_tokens), 512)


def _metric(text: str, name: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(f'{name}{{model="m"}}'))
    return float(line.rsplit(" ", 1)[1])


def _expected(prompt: list[int], n: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(next_token(ctx))
    return ctx[len(prompt) :]


async def _serve(worker: Worker, n: int, prompt_len: int, max_tokens: int) -> tuple[list[Any], int, str]:
    """``n`` concurrent completions; (responses, most requests in flight at once, /metrics mid-run)."""
    transport = httpx.ASGITransport(app=create_app(worker, manage_worker=False))
    sched = worker.scheduler
    peak = 0
    async with httpx.AsyncClient(transport=transport, base_url="http://w", timeout=60) as c:
        body = {"model": "m", "prompt": list(range(3, 3 + prompt_len)), "max_tokens": max_tokens,
                "return_token_ids": True}  # fmt: skip
        calls = asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(n)))
        task = asyncio.ensure_future(calls)
        mid = ""
        while not task.done():
            peak = max(peak, len(sched.inflight))
            if sched.slots["m"].stats is not None and sched.slots["m"].stats.kv_used_tokens and not mid:
                mid = (await c.get("/metrics")).text
            await asyncio.sleep(0.005)
        return await task, peak, mid


async def test_the_view_takes_the_engines_capacity_and_usage_rises_while_requests_run() -> None:
    worker = Worker(_config(), engines={"m": _engine(4096)})
    await worker.start()
    try:
        sched = worker.scheduler
        idle = sched._view(0.0)
        assert idle.kv_capacity_tokens == 4096 and idle.kv_used_tokens == 0
        answers, _, mid = await _serve(worker, 3, prompt_len=40, max_tokens=30)
        assert all(a.json()["choices"][0]["token_ids"] == _expected(list(range(3, 43)), 30) for a in answers)
        # three streams of 40-70 tokens: at least three blocks of 16 each while they run
        assert _metric(mid, "tessera_engine_kv_used_tokens") >= 3 * 48
        assert _metric(mid, "tessera_engine_running") >= 1
        assert _metric(mid, "tessera_engine_kv_capacity_tokens") == 4096
        assert _metric(mid, "tessera_engine_stats_fallback") == 0
        await asyncio.sleep(0.1)  # a poll after the end
        assert sched.slots["m"].stats == EngineStats(4096, 0, 16, 0, 0)
    finally:
        await worker.stop()


async def test_the_engines_small_kv_cache_triggers_andes_memory_bound_scheduling() -> None:
    """Four requests of 40 prompt tokens hold 48-64 KV tokens each. On a worker configured with 64k
    tokens QoE runs all four at once; when the engine reports 96 tokens, QoE admits into the free KV
    and its memory trigger preempts down to what fits, and every answer is still exact."""
    peaks = {}
    for kv in (CONFIGURED_KV, 96):
        worker = Worker(_config("qoe"), engines={"m": _engine(kv)})
        await worker.start()
        try:
            answers, peaks[kv], _ = await _serve(worker, 4, prompt_len=40, max_tokens=20)
            assert worker.scheduler._view(0.0).kv_capacity_tokens == kv
        finally:
            await worker.stop()
        assert all(a.json()["choices"][0]["token_ids"] == _expected(list(range(3, 43)), 20) for a in answers)
    assert peaks[CONFIGURED_KV] == 4 and peaks[96] < 4, peaks


class _Silent(SimEngine):
    """An engine that cannot report its KV cache (vLLM without its metrics)."""

    async def stats(self) -> None:
        return None


class _Garbled(SimEngine):
    """An engine whose report cannot be read."""

    async def stats(self) -> None:
        raise ValueError("not a Prometheus page")


@pytest.mark.parametrize("engine", [_Silent, _Garbled])
async def test_an_engine_without_figures_falls_back_to_the_configured_capacity_said_once(
    engine: type[SimEngine], caplog: pytest.LogCaptureFixture
) -> None:
    worker = Worker(_config(), engines={"m": engine("m", PROFILE.to_profile("m", 4096), 512)})
    with caplog.at_level(logging.WARNING, logger="tessera.worker.scheduler"):
        await worker.start()
        try:
            await asyncio.sleep(0.1)  # several polls
            sched = worker.scheduler
            assert sched._view(0.0).kv_capacity_tokens == CONFIGURED_KV
            metrics = worker.metrics.exposition().decode()
        finally:
            await worker.stop()
    said = [r for r in caplog.records if "reports no KV cache figures" in r.getMessage()]
    failed = [r for r in caplog.records if "reading the engine stats" in r.getMessage()]
    assert (
        len(failed) == (engine is _Garbled)
        and len(said) == 1
        and "configured kvCapacityTokens 65536" in said[0].getMessage()
    )
    assert _metric(metrics, "tessera_engine_stats_fallback") == 1
    assert _metric(metrics, "tessera_engine_kv_capacity_tokens") == CONFIGURED_KV


# The series vLLM 0.32 exports that the adapter reads (abridged from a tiny model's /metrics).
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",num_gpu_blocks="40"} 1.0
"""


def test_vllm_metrics_give_capacity_in_blocks_and_use_in_whole_blocks() -> None:
    assert parse_vllm_metrics(VLLM_METRICS, "tiny") == EngineStats(40 * 128, 10 * 128, 128, 3, 2)
    assert parse_vllm_metrics(VLLM_METRICS, "other") is None  # another model's series only
    no_blocks = VLLM_METRICS.replace('num_gpu_blocks="40"', 'num_gpu_blocks="None"')
    assert parse_vllm_metrics(no_blocks, "tiny") is None
    no_usage = "\n".join(ln for ln in VLLM_METRICS.splitlines() if "kv_cache_usage" not in ln)
    assert parse_vllm_metrics(no_usage, "tiny") is None


def test_vllm_metrics_give_the_servers_process_start_time() -> None:
    text = VLLM_METRICS + "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1.7e+09\n"
    assert parse_vllm_metrics(text, "tiny") == EngineStats(40 * 128, 10 * 128, 128, 3, 2, started_at=1.7e9)
    assert parse_vllm_metrics(VLLM_METRICS, "tiny").started_at is None  # type: ignore[union-attr]


class _Restarting(SimEngine):
    """An engine that reports when its process started; ``started`` moves when it restarts."""

    started = 1000.0

    async def stats(self) -> EngineStats | None:
        stats = await super().stats()
        return None if stats is None else dataclasses.replace(stats, started_at=self.started)


async def test_the_engines_start_time_is_exported_and_moves_when_it_restarts() -> None:
    silent = Worker(_config(), engines={"m": _Silent("m", PROFILE.to_profile("m", 4096), 512)})
    before = time.time()
    await silent.start()
    try:  # no start time of its own: when the worker started it
        assert before <= _metric(silent.metrics.exposition().decode(), "tessera_engine_start_time_seconds")
        assert (
            _metric(silent.metrics.exposition().decode(), "tessera_engine_start_time_seconds") <= time.time()
        )
    finally:
        await silent.stop()
    engine = _Restarting("m", PROFILE.to_profile("m", 4096), 512)
    worker = Worker(_config(), engines={"m": engine})
    await worker.start()
    try:
        assert _metric(worker.metrics.exposition().decode(), "tessera_engine_start_time_seconds") == 1000.0
        engine.started = 2000.0
        await asyncio.sleep(0.1)  # several polls
        assert _metric(worker.metrics.exposition().decode(), "tessera_engine_start_time_seconds") == 2000.0
    finally:
        await worker.stop()

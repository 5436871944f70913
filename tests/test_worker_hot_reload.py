"""The worker applies its configuration file's new content while it serves: the file is mounted the
way Kubernetes mounts a ConfigMap (``config.yaml -> ..data/config.yaml``, ``..data -> ..<version>``,
an update swaps ``..data``), and the mtime is kept, so only the content says it changed. A class's
SLO and queue bound change for the next requests while one in flight finishes; an invalid file and
a model-list change are refused (old configuration kept, counted in /metrics, /ready still true)."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tessera.api.worker_config import load_config
from tessera.worker.engines.sim_realtime import next_token
from tessera.worker.runtime import Worker
from tessera.worker.server.app import create_app

MTIME = 1_700_000_000


def _config(chat_ttft_s: float, bulk_max_queued: int, *, policy: str = "fcfs") -> dict[str, Any]:
    return {
        "models": [
            {
                "name": "m",
                "engine": "sim",
                "maxModelLen": 512,
                "defaultClass": "chat",
                "profile": {"decodeC0": 0.005, "decodeC1": 0.0, "prefillP0": 0.001, "prefillP1": 0.0},
            }
        ],
        "classes": {
            "chat": {"slo": {"ttftSeconds": chat_ttft_s}},
            "bulk": {
                "kind": "batch",
                "slo": {"deadlineSeconds": 600},
                "queue": {"maxQueued": bulk_max_queued},
            },
        },
        "scheduling": {"policy": policy, "batch": {"max": 1}},
        "polling": {"configFileSeconds": 0.02},
    }


class ConfigMapDir:
    """A directory laid out as the kubelet lays out a mounted ConfigMap."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.version = 0
        self.path = root / "config.yaml"

    def write(self, content: dict[str, Any] | str) -> None:
        """Publish a new version: a new timestamped folder, then an atomic swap of ``..data``."""
        self.version += 1
        folder = self.root / f"..2026_11_25_{self.version}"
        folder.mkdir()
        text = content if isinstance(content, str) else yaml.safe_dump(content)
        (folder / "config.yaml").write_text(text)
        os.utime(folder / "config.yaml", (MTIME, MTIME))  # the same mtime every version
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(folder.name)
        os.replace(tmp, self.root / "..data")
        if not self.path.is_symlink():
            self.path.symlink_to("..data/config.yaml")


def _expected(prompt: list[int], n: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(next_token(ctx))
    return ctx[len(prompt) :]


def _count(metrics: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    line = next((ln for ln in metrics.splitlines() if ln.startswith(f"{name}{{{want}}} ")), None)
    return float(line.rsplit(" ", 1)[1]) if line else 0.0


async def _until(c: httpx.AsyncClient, result: str, n: float) -> str:
    for _ in range(500):
        metrics = (await c.get("/metrics")).text
        if _count(metrics, "tessera_config_reloads_total", result=result) >= n:
            return metrics
        await asyncio.sleep(0.01)
    raise AssertionError(f"no {result} reload seen")


async def test_a_configmap_update_changes_slo_and_queue_bound_for_the_next_requests(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cm = ConfigMapDir(tmp_path)
    cm.write(_config(chat_ttft_s=60, bulk_max_queued=5))
    worker = Worker(load_config(cm.path), config_path=cm.path)
    await worker.start()
    transport = httpx.ASGITransport(app=create_app(worker, manage_worker=False))
    body = {"model": "m", "prompt": [5, 6], "return_token_ids": True}
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://w", timeout=60) as c:
            first = await c.post("/v1/completions", json={**body, "max_tokens": 2})
            assert first.status_code == 200
            metrics = (await c.get("/metrics")).text
            assert _count(metrics, "tessera_slo_met_total", model="m", **{"class": "chat"}) == 1

            # a long request holds the only slot across the update; it must finish untouched
            long = asyncio.ensure_future(c.post("/v1/completions", json={**body, "max_tokens": 150}))
            while not worker.scheduler.inflight:
                await asyncio.sleep(0.005)
            cm.write(_config(chat_ttft_s=0.001, bulk_max_queued=1, policy="edf"))
            await _until(c, "applied", 1)
            assert worker.config.scheduling.policy == "edf" and not long.done()

            # the chat SLO is now unmeetable: the next chat request counts as missed
            missed = await c.post("/v1/completions", json={**body, "max_tokens": 2})
            assert missed.status_code == 200
            # bulk may queue one: of three at once, two are refused (five were allowed before)
            bulk = {**body, "max_tokens": 2}
            burst = await asyncio.gather(
                *(c.post("/v1/completions", json=bulk, headers={"X-Tessera-Class": "bulk"}) for _ in range(3))
            )
            assert sorted(r.status_code for r in burst) == [200, 429, 429]
            done = await long
            assert done.status_code == 200
            assert done.json()["choices"][0]["token_ids"] == _expected([5, 6], 150)
            metrics = (await c.get("/metrics")).text
            assert _count(metrics, "tessera_slo_missed_total", model="m", **{"class": "chat"}) >= 1

            # an invalid file is refused: counted, logged, the running configuration stays, still ready
            with caplog.at_level(logging.ERROR, logger="tessera.worker.runtime"):
                cm.write(_config(chat_ttft_s=1, bulk_max_queued=1, policy="nope"))
                await _until(c, "invalid", 1)
                broken = _config(chat_ttft_s=1, bulk_max_queued=1)
                broken["models"][0]["maxModelLen"] = 1024  # the engine was built for 512
                cm.write(broken)
                await _until(c, "restart_required", 1)
            assert worker.config.scheduling.policy == "edf"
            assert (await c.get("/ready")).status_code == 200
            messages = [r.getMessage() for r in caplog.records]
            assert any("refused" in m and "unknown policy 'nope'" in m for m in messages)
            assert any("restart the worker pod" in m for m in messages)
            ok = await c.post("/v1/completions", json={**body, "max_tokens": 2})
            assert ok.status_code == 200
    finally:
        await worker.stop()


async def test_a_launched_vllm_bounds_the_batch_size() -> None:
    from tessera.api.worker_config import ConfigError, parse_config

    config = {
        "models": [{"name": "m", "launch": {"modelDir": "/models/tiny", "maxNumSeqs": 8}}],
        "scheduling": {"batch": {"max": 16}},
    }
    with pytest.raises(
        ConfigError, match=r"models\.0\.launch\.maxNumSeqs 8 is below scheduling\.batch\.max 16"
    ):
        parse_config(config)
    config["scheduling"] = {"batch": {"max": 8}}
    assert parse_config(config).models[0].launch.max_num_seqs == 8  # type: ignore[union-attr]

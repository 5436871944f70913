"""Shared pieces of the worker benchmarks: a `tessera worker` child process and a streaming client.

The client is every load generator's (``tessera.local.load.load_client``: the router's upstream
transport, whose cost per stream does not grow with the streams open, as httpx's pool's does). It has
no read timeout, so ``stream_one`` bounds a stream by ``STALL_S`` without a byte."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tessera.api.worker_config import BENCH_TRUE_LENGTH_HEADER
from tessera.local.load import load_client
from tessera.worker.engines.vllm_process import free_port

STALL_S = 600.0  # a stream silent this long (no header, no token) has hung: it fails the run


class WorkerChild:
    """`tessera worker --config FILE` on a free loopback port, until ``stop``."""

    def __init__(
        self,
        config: dict[str, Any],
        tmp: Path,
        *,
        env: dict[str, str] | None = None,
        grace_s: float | None = None,
        ready_timeout_s: float = 120.0,
    ) -> None:
        """Start the worker and wait until ``/ready`` (at most ``ready_timeout_s``); ``env`` is added to
        this process's environment, ``grace_s`` sets the SIGTERM drain (the worker's default when None)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = tmp / f"worker-{self.port}.json"
        path.write_text(json.dumps(config))
        self.log = tmp / f"worker-{self.port}.log"
        cmd = [sys.executable, "-m", "tessera", "worker", "--config", str(path), "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port)]
        if grace_s is not None:
            cmd += ["--grace-seconds", str(grace_s)]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            )
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tessera worker exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"tessera worker not ready:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 20 s."""
        stop_process(self.proc, 20.0)


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``; nothing when it has ended."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass(slots=True)
class StreamStat:
    """What a client saw of one streamed request."""

    sent: float
    first: float
    done: float
    tokens: int
    klass: str
    times: list[float]  # arrival time of every token at the client

    @property
    def ttft(self) -> float:
        """Time to first token."""
        return self.first - self.sent

    @property
    def jct(self) -> float:
        """Time to the last token."""
        return self.done - self.sent


async def stream_one(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    path: str = "/v1/completions",
) -> StreamStat:
    """Send one streaming completion (or chat completion, ``path``); count tokens
    (``return_token_ids``) and time them."""
    sent = time.perf_counter()
    first = 0.0
    tokens = 0
    times: list[float] = []
    payload = {**body, "stream": True, "return_token_ids": True}
    loop = asyncio.get_running_loop()
    async with (
        asyncio.timeout(STALL_S) as silence,
        client.stream("POST", f"{url}{path}", json=payload, headers=headers) as resp,
    ):
        if resp.status_code != 200:
            raise RuntimeError(f"{url} answered {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            silence.reschedule(loop.time() + STALL_S)
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or ()
            for choice in choices:
                n = len(choice.get("token_ids") or ())
                now = time.perf_counter()
                if n and not tokens:
                    first = now
                tokens += n
                times.extend([now] * n)
    klass = (headers or {}).get("X-Tessera-Class", "")
    return StreamStat(sent, first, time.perf_counter(), tokens, klass, times)


async def replay(
    url: str,
    model: str,
    plan: list[tuple[float, list[int] | str, int, str]],
    extra: dict[str, Any] | None = None,
    *,
    true_lengths: bool | Sequence[int] = False,
) -> list[StreamStat]:
    """Send ``(at_s, prompt ids or text, max_tokens, class)`` requests at their times; all streamed.

    ``true_lengths`` adds the benchmark-only true-length header (the worker needs benchHints): True
    sends each request's ``max_tokens``, a sequence the given length of each request (outputs that
    end by themselves, known from an earlier greedy run)."""
    async with load_client() as client:
        start = time.perf_counter()

        async def one(i: int, at: float, prompt: list[int] | str, n: int, klass: str) -> StreamStat:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            body = {"model": model, "prompt": prompt, "max_tokens": n, "ignore_eos": True, **(extra or {})}
            headers = {"X-Tessera-Class": klass} if klass else {}
            if true_lengths is True:
                headers[BENCH_TRUE_LENGTH_HEADER] = str(n)
            elif true_lengths is not False:
                headers[BENCH_TRUE_LENGTH_HEADER] = str(true_lengths[i])
            return await stream_one(client, url, body, headers)

        return list(await asyncio.gather(*(one(i, *p) for i, p in enumerate(plan))))

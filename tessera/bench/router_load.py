"""The load of the router benches and the router they measure: waves and closed loops of streamed chat
requests, each counted as its client saw it (completed, failed with a clear error, lost, refused), and
``tessera router`` as its own restartable process. ``tessera bench router`` (``router_overhead``) and
its control-fault rows on an emulated cluster (``control_faults``) both run them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tessera.local.load import load_client

READY_TIMEOUT_S = 60.0
STREAM_TIMEOUT_S = 120.0  # a stream not ended by then is a hang: counted lost
REFUSED_BACKOFF_S = 0.2  # a client's pause after a refused connection (no router listening)


@dataclass
class Wave:
    """One wave of concurrent streams: what every client saw."""

    ttfts: list[float] = field(default_factory=list)
    tokens: int = 0
    completed: int = 0
    failed: dict[str, int] = field(default_factory=dict)  # reason -> count
    lost: int = 0
    wall_s: float = 0.0
    streaming: int = 0  # streams that received their first token so far
    sent: int = 0
    refused: int = 0  # connection refused: no router listened, nothing was accepted
    lost_by_reason: dict[str, int] = field(default_factory=dict)
    fault_at: float | None = None  # when the fault was injected (perf_counter)
    cpu_s: float = 0.0  # the router's CPU time during the wave (router paths)
    router_killed: bool = False  # the fault kills the router: its broken connections are clear errors
    recovered_at: float | None = None  # when the router that replaced the killed one was ready
    # How the requests the client had sent before the fault ended: completed, failed, lost or refused
    # (refused: not yet written when the router went away; the client found its connection closed).
    across_fault: dict[str, int] = field(default_factory=dict)

    def broken_by_kill(self, sent_at: float) -> bool:
        """Whether a request sent at ``sent_at`` whose connection just broke was broken by the router's
        kill: the router was killed and the request was sent before its replacement was ready."""
        if not self.router_killed or self.fault_at is None:
            return False
        return self.recovered_at is None or sent_at < self.recovered_at

    def lost_one(self, reason: str) -> None:
        """Count a lost request, saying whether it was lost before the fault was injected."""
        self.lost += 1
        _count(self.lost_by_reason, f"{reason} ({'before' if self.fault_at is None else 'after'} the fault)")


def _count(counts: dict[str, int], reason: str) -> None:
    counts[reason] = counts.get(reason, 0) + 1


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str],
                  wave: Wave, start: float) -> bool:  # fmt: skip
    """One streamed request, counted in ``wave``; False when its connection was refused."""
    wave.sent += 1
    sent_at = time.perf_counter()
    outcome = await _outcome(client, url, body, headers, wave, start, sent_at)
    if wave.fault_at is not None and sent_at < wave.fault_at:  # in flight (as the client saw it) at the fault
        _count(wave.across_fault, outcome)
    return outcome != "refused"


async def _outcome(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str],
                   wave: Wave, start: float, sent_at: float) -> str:  # fmt: skip
    """Send one streamed request, count it in ``wave`` and say how it ended: completed, failed,
    lost or refused."""
    first: float | None = None
    done = False
    tokens = 0
    try:
        async with (
            asyncio.timeout(STREAM_TIMEOUT_S),
            client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as resp,
        ):
            if resp.status_code != 200:
                await resp.aread()
                _count(wave.failed, f"http {resp.status_code}")
                return "failed"
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith('data: {"error"'):
                    _count(wave.failed, "error event")
                    return "failed"
                elif line.startswith("data: {") and '"content"' in line:
                    tokens += 1
                    if first is None:
                        first = time.perf_counter()
                        wave.streaming += 1
    except TimeoutError:  # a hang: the load client's transport has no read timeout of its own
        wave.lost_one(f"no end within {STREAM_TIMEOUT_S:g} s")
        return "lost"
    except (httpx.ConnectError, httpx.ConnectTimeout):
        wave.refused += 1
        return "refused"
    except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
        # connected, then no answer or a cut-off one, and no error body: lost, unless the router was killed
        if wave.broken_by_kill(sent_at):
            _count(wave.failed, f"connection broken by the router's kill ({type(exc).__name__})")
            return "failed"
        wave.lost_one(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        return "lost"
    except httpx.HTTPError as exc:  # an answer httpx cannot decode
        wave.lost_one(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        return "lost"
    if not done:
        wave.lost_one("ended without [DONE]")
        return "lost"
    wave.completed += 1
    wave.tokens += tokens
    if first is not None:
        wave.ttfts.append(first - start)
    return "completed"


async def send_wave(urls: list[str], streams: int, model: str, headers: dict[str, str], max_tokens: int,
                during: Any = None) -> Wave:  # fmt: skip
    """``streams`` concurrent streamed requests spread over ``urls`` in turn; ``during`` (a coroutine
    function of the wave) runs alongside, e.g. to inject a fault."""
    wave = Wave()
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "messages": [{"role": "user",
            "content": "Tell me about the sea."}]}  # fmt: skip
    async with load_client() as client:
        start = time.perf_counter()
        tasks = [_stream(client, urls[i % len(urls)], body, headers, wave, start) for i in range(streams)]
        extra = [during(wave)] if during is not None else []
        await asyncio.gather(*tasks, *extra)
        wave.wall_s = time.perf_counter() - start
    return wave


async def closed_loop(url: str, clients: int, model: str, headers: dict[str, str], max_tokens: int,
                       fault: Any) -> Wave:  # fmt: skip
    """``clients`` clients each sending streamed requests one after another until ``fault`` (a
    coroutine function of the wave, which injects the fault and waits) returns; the requests then in
    flight finish."""
    wave = Wave()
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "messages": [{"role": "user",
            "content": "Tell me about the sea."}]}  # fmt: skip
    stop = asyncio.Event()
    async with load_client() as client:

        async def one_client() -> None:
            while not stop.is_set():
                if not await _stream(client, url, body, headers, wave, time.perf_counter()):
                    await asyncio.sleep(REFUSED_BACKOFF_S)

        async def inject() -> None:
            try:
                await fault(wave)
            finally:
                stop.set()

        start = time.perf_counter()
        await asyncio.gather(inject(), *(one_client() for _ in range(clients)))
        wave.wall_s = time.perf_counter() - start
    return wave


class RouterProcess:
    """``tessera router --backends FILE`` as its own process on a fixed loopback port (restartable),
    from the installed package, or from the source tree ``source`` (a baseline)."""

    def __init__(self, backends: Path, port: int, source: Path | None = None) -> None:
        self.backends = backends
        self.port = port
        self.source = source
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the router and wait until it is ready."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tessera", "router", "--backends", str(self.backends), "--port",
             str(self.port), "--host", "127.0.0.1", "--poll-interval", "0.5",
             # the relaying and routing on arrival are measured, as by a baseline's source tree
             *(["--dispatch", "route"] if self.source is None else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            # python -m puts the working directory first on the path: the source tree's package
            cwd=self.source,
        )  # fmt: skip
        _ready(self.url, READY_TIMEOUT_S)

    def cpu_s(self) -> float:
        """The process's CPU time so far (user + system), in seconds."""
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM (the router finishes what is in flight), SIGKILL after ``timeout_s``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        """SIGKILL: the router ends at once, as in a crash."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()


def _ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become ready within {timeout_s:.0f} s")


def wave_row(path: str, streams: int, waves: list[Wave]) -> dict[str, Any]:
    """The row ``path:streams=N`` over ``waves``: TTFT percentiles, tokens/s and every request's fate."""
    ttfts = (
        np.array([t for w in waves for t in w.ttfts]) if any(w.ttfts for w in waves) else np.array([np.nan])
    )
    failed: dict[str, int] = {}
    for w in waves:
        for reason, n in w.failed.items():
            failed[reason] = failed.get(reason, 0) + n
    lost_by_reason: dict[str, int] = {}
    for w in waves:
        for reason, n in w.lost_by_reason.items():
            lost_by_reason[reason] = lost_by_reason.get(reason, 0) + n
    sent = sum(w.sent for w in waves)
    refused = sum(w.refused for w in waves)
    completed = sum(w.completed for w in waves)
    cpu_s = sum(w.cpu_s for w in waves)
    outcomes = ("completed", "failed", "lost", "refused")
    across = {k: sum(w.across_fault.get(k, 0) for w in waves) for k in outcomes}
    return {
        "policy": f"{path}:streams={streams}",
        "requests": sent,
        "accepted": sent - refused,
        "refused": refused,
        "ttft_p50_s": float(np.percentile(ttfts, 50)),
        "ttft_p99_s": float(np.percentile(ttfts, 99)),
        "tokens_per_s": statistics.mean(w.tokens / w.wall_s for w in waves),
        "completed": completed,
        "failed": sum(failed.values()),
        "failed_by_reason": failed,
        "lost": sum(w.lost for w in waves),
        "lost_by_reason": lost_by_reason,
        "router_cpu_ms_per_request": cpu_s * 1000 / completed if path != "direct" and completed else None,
        "in_flight_at_fault": across if waves[0].fault_at is not None else None,
    }


async def until_load(wave: Wave, completed: int = 0, streaming: int = 0) -> None:
    """Until the load is under way: ``completed`` requests completed and ``streaming`` streams received
    their first token, since the load began."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while wave.completed < completed or wave.streaming < streaming:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the load did not get going: {wave.completed} of {completed} requests completed and "
                f"{wave.streaming} of {streaming} streams started in {READY_TIMEOUT_S:.0f} s "
                f"({wave.failed}, {wave.lost_by_reason})"
            )
        await asyncio.sleep(0.005)

"""`tessera bench router`: what the router adds, against sending straight to the workers.

Real parts on loopback: ``workers`` sim-engine worker processes of the quickstart plan and the router
as its own process (``tessera router --backends --dispatch route``: routed on arrival, as direct
requests are spread, not packed by Chiron's dispatch although the quickstart autoscales), as a cluster
runs them. For each level of
concurrent streams, rounds alternate the order of the two paths (direct first, then router first)
on the same workers; each path sends one wave of ``streams`` streamed chat requests at once
(``max_tokens`` tokens each). Direct requests go to the workers in turn.

With ``baseline`` set to a source tree (e.g. ``git worktree add /tmp/before COMMIT``), that tree's
router runs too, as its own process beside this one, and is a third path in every round: a change to
the router is measured against its earlier self in one interleaved sequence, on the same workers and
under the same load from elsewhere. Each round's order is rotated, so every path leads in turn.

Rows (path:streams): client-side TTFT p50/p99 over every round's requests, tokens per second, the
requests completed, failed with an HTTP error or an error event, and lost (no ``[DONE]`` and no
error: a stream cut off, or a connection closed without an answer), and for a router path its CPU
time (user + system, from ``/proc``) per completed request. The checks compare the paths as paired
ratios per round (medians): the router's added TTFT p50 within 10% of direct at the lowest level,
throughput at least 0.95 of direct, nothing lost; with a baseline, its ratios and CPU per request
next to this router's.

With ``faults`` on, a fault run follows, one fault per row, each under load through the router with
``streams`` = the last level, at most 300:

- ``router+router-restarted``: ``streams`` clients send streamed requests back to back (closed loop);
  once as many requests have completed as there are clients, the router is restarted as a pod restart
  does it: SIGTERM (it refuses new connections, answers the requests in flight and those sent on open
  connections for a second, ``tessera.router.protocol``, and exits), then a new router process on the
  same port; the load goes on ``RESTART_AFTER_S`` after the new one is ready. A client whose
  connection is refused while no router listens waits ``REFUSED_BACKOFF_S`` and sends its next one.
- ``router+router-killed``: the same load; once as many requests have completed as there are clients
  and then half of the clients' next streams have received a token, the router is killed (SIGKILL: a
  crash, or a node lost), then a new one started on the same port. Nothing can answer the streams in flight
  with an error event: their connections break. Each of them counts as failed with a clear error when
  the client's HTTP library (httpx) raises a connection error for it (``RemoteProtocolError``: the
  connection closed before the chunked body or the answer ended; ``ReadError``/``WriteError``: it was
  reset), which a client sees as a failed request it can retry; this holds for requests sent before
  the new router was ready and broken after the kill. A stream that ends without ``[DONE]`` and
  without such an error, or a hang, stays lost, as in the other rows.
- ``router+worker-killed``: a wave of ``streams`` streams during which one worker is killed (SIGKILL);
  requests on it fail with a clear error or are retried on the other worker (non-streamed ones).

Each fault row counts requests sent; refused (no router listened: the client's connection was
refused, nothing was accepted); accepted (the rest), of which completed (``[DONE]``), failed with a
clear error (an HTTP error status, or an SSE error event, with an OpenAI error body; in the
router-killed row also the connection errors above) and lost (no ``[DONE]`` and no error: the stream
was cut off or the connection closed without an answer); and how the requests the clients had sent
before the fault ended (``in_flight_at_fault``: refused there means the client had not yet written it
when the router went away, found its kept-alive connection closed and could not reconnect). Goal:
0 lost.

With ``control_faults`` on, two more fault rows run on an emulated cluster (``tessera.bench.control_faults``:
the operator against KMock's Kubernetes emulator, a real Prometheus, the workers started from the
operator's ConfigMaps, a router in front of them), with the same clients and counts (requests of
``control_faults.TOKENS`` tokens):
``router+operator-restarted`` and ``router+prometheus-stopped`` (autoscaling on), each also reporting
whether the operator changed what it should not. They need the ``prometheus`` binary and the ``kmock``
package; the option is refused without them.

Options (``--set``): streams ("100,300,1000"), workers (2), max_tokens (32), rounds (3), faults (true),
control_faults (false), baseline (none: a source tree whose router is measured too).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tessera.api import load_documents
from tessera.bench.runner import option
from tessera.bench.scenarios import BenchConfig, BenchReport, Progress
from tessera.local.control_plane import LocalEngine, plan_local
from tessera.local.load import load_client
from tessera.local.supervisor import Supervisor
from tessera.worker.engines.vllm_process import free_port

DESCRIPTION = "Router overhead: TTFT and throughput through the router vs straight to the workers"
TRACE_REFUSED = (
    "it sends waves of streamed requests through the router and straight to the workers; size them "
    "with --set streams=, max_tokens="
)
QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
READY_TIMEOUT_S = 60.0
RESTART_AFTER_S = 2.0  # load kept on the new router after it is ready
STREAM_TIMEOUT_S = 120.0  # a stream not ended by then is a hang: counted lost
REFUSED_BACKOFF_S = 0.2  # a client's pause after a refused connection (no router listening)
NOT_IN_SCENARIO = (
    "operator restart and Prometheus stop: not run (--set control_faults=true runs them on an emulated "
    "cluster; it needs the prometheus binary and the kmock package)"
)


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


def _parse_levels(text: Any) -> list[int]:
    try:
        levels = [int(x) for x in str(text).split(",")]
    except ValueError as exc:
        raise ValueError(f"--set streams must be integers separated by commas, got {text!r}") from exc
    if not levels or any(n < 1 or n > 5000 for n in levels):
        raise ValueError(f"--set streams must be between 1 and 5000, got {text!r}")
    return levels


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


async def _wave(urls: list[str], streams: int, model: str, headers: dict[str, str], max_tokens: int,
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


def run(config: BenchConfig, progress: Progress) -> BenchReport:
    """Both paths at every level, interleaved rounds; then the fault run."""
    opts = config.options
    levels = _parse_levels(opts.get("streams", "100,300,1000"))
    n_workers = option(opts, "workers", 2, int)
    max_tokens = option(opts, "max_tokens", 32, int)
    rounds = option(opts, "rounds", 3, int)
    faults = option(opts, "faults", True, bool)
    control_faults = option(opts, "control_faults", False, bool)
    baseline = option(opts, "baseline", None, str)
    if baseline is not None and not (Path(baseline) / "tessera" / "__main__.py").is_file():
        raise ValueError(f"--set baseline must be a source tree with tessera/__main__.py, got {baseline!r}")
    if not 1 <= n_workers <= 8 or not 1 <= max_tokens <= 4096 or not 1 <= rounds <= 20:
        raise ValueError("--set workers must be 1-8, max_tokens 1-4096 and rounds 1-20")
    if control_faults:
        from tessera.bench import control_faults as control  # imports KMock's emulator when it runs

        missing = control.unavailable()
        if missing is not None:
            raise ValueError(f"--set control_faults=true needs {missing}")
    plan = plan_local(load_documents(QUICKSTART), LocalEngine(), max_instances_per_group=n_workers)
    instances = plan.instances[:n_workers]
    model = instances[0].config.models[0].name
    headers = {instances[0].config.class_header: "chat"}
    paths = ["direct", "router"] + (["baseline"] if baseline is not None else [])
    progress(0, total=len(levels) * rounds * len(paths) + (3 if faults else 0) + (2 if control_faults else 0))
    rows: list[dict[str, Any]] = []
    rounds_at: dict[int, list[dict[str, Wave]]] = {}  # streams -> each round's wave per path
    fault_rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tessera-bench-router-") as tmp:
        supervisor = Supervisor(Path(tmp) / "run", grace_s=2.0)
        router: RouterProcess | None = None
        routers: dict[str, RouterProcess] = {}
        try:
            supervisor.start_all(list(instances), READY_TIMEOUT_S)
            backends = Path(tmp) / "backends.json"
            backends.write_text(json.dumps({"backends": [w.backend().to_json() for w in supervisor.workers]}))
            router = routers["router"] = RouterProcess(backends, free_port())
            if baseline is not None:
                routers["baseline"] = RouterProcess(backends, free_port(), Path(baseline).resolve())
            for process in routers.values():
                process.start()
            router_url = router.url
            direct = [w.url for w in supervisor.workers]
            for streams in levels:
                for r in range(rounds):
                    got: dict[str, Wave] = {}
                    for path in paths[r % len(paths) :] + paths[: r % len(paths)]:  # each leads in turn
                        process = routers.get(path)
                        urls = direct if process is None else [process.url]
                        cpu_before = process.cpu_s() if process is not None else 0.0
                        got[path] = asyncio.run(_wave(urls, streams, model, headers, max_tokens))
                        if process is not None:
                            got[path].cpu_s = process.cpu_s() - cpu_before
                        progress(1)
                    rounds_at.setdefault(streams, []).append(got)
                for path in paths:
                    rows.append(wave_row(path, streams, [got[path] for got in rounds_at[streams]]))
            if faults:
                streams = min(levels[-1], 300)
                fault_rows.append(_router_restart_run(router, model, headers, max_tokens, streams))
                progress(1)
                fault_rows.append(_router_kill_run(router, model, headers, max_tokens, streams))
                progress(1)
                fault_rows.append(_fault_run(supervisor, router_url, model, headers, max_tokens, streams))
                progress(1)
        finally:
            for process in routers.values():
                process.stop()
            supervisor.stop_all()
    control_checks: list[str] = []
    if control_faults:  # on workers of their own, once the local plan's are gone
        control_rows, control_checks = control.run_rows(min(levels[-1], 300), n_workers, progress)
        fault_rows += control_rows
    checks = _checks(rounds_at, levels)
    for fault in fault_rows:
        rows.append(fault)
        lost = f"{fault['lost']} lost" + (f" {fault['lost_by_reason']}" if fault["lost_by_reason"] else "")
        across = ", ".join(f"{n} {outcome}" for outcome, n in fault["in_flight_at_fault"].items())
        checks.append(f"fault run, {fault['fault']}: {fault['accepted']} accepted, {fault['completed']} "
                      f"completed, {fault['failed']} failed with an error {fault['failed_by_reason']}, "
                      f"{lost}; {fault['refused']} refused while no router listened (not accepted): "
                      f"{'PASS' if fault['lost'] == 0 else 'FAIL'} (goal: 0 lost); of the "
                      f"{sum(fault['in_flight_at_fault'].values())} requests in flight at the fault as the "
                      f"clients saw them: {across}")  # fmt: skip
    checks += control_checks
    if faults and not control_faults:
        checks.append(NOT_IN_SCENARIO)
    cfg = {**config.as_dict(), "streams": levels, "workers": n_workers, "max_tokens": max_tokens,
           "rounds": rounds, "control_faults": control_faults, "baseline": baseline}  # fmt: skip
    return BenchReport("router", cfg, rows, checks)


def _fault_run(supervisor: Supervisor, router_url: str, model: str, headers: dict[str, str],
               max_tokens: int, streams: int) -> dict[str, Any]:  # fmt: skip
    victim = supervisor.workers[-1]

    async def kill_one(wave: Wave) -> None:
        # mid-wave: once a quarter of the streams are receiving tokens (some of them from the victim)
        while wave.streaming < streams // 4:
            await asyncio.sleep(0.01)
        assert victim.proc is not None
        wave.fault_at = time.perf_counter()
        victim.proc.kill()

    wave = asyncio.run(_wave([router_url], streams, model, headers, max_tokens, during=kill_one))
    return {**wave_row("router+worker-killed", streams, [wave]), "fault": "a worker killed mid-wave"}


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


def _router_restart_run(router: RouterProcess, model: str, headers: dict[str, str], max_tokens: int,
                        clients: int) -> dict[str, Any]:  # fmt: skip
    timings: dict[str, float] = {}

    async def restart(wave: Wave) -> None:
        # mid-load: once as many requests completed as there are clients, all of them busy
        await until_load(wave, completed=clients)
        t0 = wave.fault_at = time.perf_counter()
        await asyncio.to_thread(router.stop)  # SIGTERM: the answers in flight finish first
        timings["drain_s"] = time.perf_counter() - t0
        await asyncio.to_thread(router.start)
        timings["down_s"] = time.perf_counter() - t0
        await asyncio.sleep(RESTART_AFTER_S)

    wave = asyncio.run(closed_loop(router.url, clients, model, headers, max_tokens, restart))
    row = wave_row("router+router-restarted", clients, [wave])
    return {**row, "fault": f"the router restarted mid-load (SIGTERM; drained in {timings['drain_s']:.1f} s; "
            f"a new router ready {timings['down_s']:.1f} s after the SIGTERM)",
            "router_drain_s": timings["drain_s"], "router_down_s": timings["down_s"]}  # fmt: skip


def _router_kill_run(router: RouterProcess, model: str, headers: dict[str, str], max_tokens: int,
                     clients: int) -> dict[str, Any]:  # fmt: skip
    timings: dict[str, float] = {}

    async def kill(wave: Wave) -> None:
        # mid-stream: once as many requests completed as there are clients (all busy), and half of the
        # clients' next streams are receiving tokens (the clients start in step: at the first mark,
        # most of their next requests have just been sent)
        await until_load(wave, completed=clients)
        await until_load(wave, streaming=wave.streaming + clients // 2)
        wave.router_killed = True
        t0 = wave.fault_at = time.perf_counter()
        router.kill()
        await asyncio.to_thread(router.start)
        wave.recovered_at = time.perf_counter()
        timings["down_s"] = wave.recovered_at - t0
        await asyncio.sleep(RESTART_AFTER_S)

    wave = asyncio.run(closed_loop(router.url, clients, model, headers, max_tokens, kill))
    row = wave_row("router+router-killed", clients, [wave])
    down = timings["down_s"]
    return {**row, "fault": f"the router killed mid-load (SIGKILL; a new router ready {down:.1f} s after it)",
            "router_down_s": down}  # fmt: skip


def _ratios(rounds: list[dict[str, Wave]], path: str) -> tuple[float, float, float]:
    """``path`` against direct, paired per round (medians): TTFT p50 ratio, throughput ratio, and the
    router's CPU milliseconds per completed request."""
    ttft = [statistics.median(g[path].ttfts) / statistics.median(g["direct"].ttfts)
            for g in rounds if g["direct"].ttfts and g[path].ttfts]  # fmt: skip
    tput = [(g[path].tokens / g[path].wall_s) / (g["direct"].tokens / g["direct"].wall_s)
            for g in rounds if g["direct"].tokens]  # fmt: skip
    cpu = [g[path].cpu_s * 1000 / g[path].completed for g in rounds if g[path].completed]
    return _median(ttft), _median(tput), _median(cpu)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _checks(rounds_at: dict[int, list[dict[str, Wave]]], levels: list[int]) -> list[str]:
    checks = []
    for streams in levels:
        rounds = rounds_at[streams]
        ttft, tput, cpu = _ratios(rounds, "router")
        lost = sum(w.lost for g in rounds for w in g.values())
        line = (f"streams={streams}: router/direct TTFT p50 x{ttft:.2f}, throughput x{tput:.2f}, "
                f"lost {lost}, router CPU {cpu:.2f} ms per request")  # fmt: skip
        if streams == levels[0]:
            ok = ttft <= 1.10 and tput >= 0.95 and lost == 0
            line += f" (targets: TTFT within 10%, throughput >= 0.95, 0 lost): {'PASS' if ok else 'FAIL'}"
        else:
            ok = tput >= 0.95 and lost == 0
            line += f" (targets: throughput >= 0.95, 0 lost): {'PASS' if ok else 'FAIL'}"
        if "baseline" in rounds[0]:
            b_ttft, b_tput, b_cpu = _ratios(rounds, "baseline")
            line += (f"; baseline router/direct TTFT p50 x{b_ttft:.2f}, throughput x{b_tput:.2f}, "
                     f"CPU {b_cpu:.2f} ms per request")  # fmt: skip
        checks.append(line)
    return checks


__all__ = ["DESCRIPTION", "run"]

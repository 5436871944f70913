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
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tessera.api import load_documents
from tessera.bench.router_load import (
    READY_TIMEOUT_S,
    RouterProcess,
    Wave,
    closed_loop,
    send_wave,
    until_load,
    wave_row,
)
from tessera.bench.runner import option
from tessera.bench.scenarios import BenchConfig, BenchReport, Progress
from tessera.local.control_plane import LocalEngine, plan_local
from tessera.local.supervisor import Supervisor
from tessera.worker.engines.vllm_process import free_port

DESCRIPTION = "Router overhead: TTFT and throughput through the router vs straight to the workers"
TRACE_REFUSED = (
    "it sends waves of streamed requests through the router and straight to the workers; size them "
    "with --set streams=, max_tokens="
)
QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
RESTART_AFTER_S = 2.0  # load kept on the new router after it is ready
NOT_IN_SCENARIO = (
    "operator restart and Prometheus stop: not run (--set control_faults=true runs them on an emulated "
    "cluster; it needs the prometheus binary and the kmock package)"
)


def _parse_levels(text: Any) -> list[int]:
    try:
        levels = [int(x) for x in str(text).split(",")]
    except ValueError as exc:
        raise ValueError(f"--set streams must be integers separated by commas, got {text!r}") from exc
    if not levels or any(n < 1 or n > 5000 for n in levels):
        raise ValueError(f"--set streams must be between 1 and 5000, got {text!r}")
    return levels


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
                        got[path] = asyncio.run(send_wave(urls, streams, model, headers, max_tokens))
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

    wave = asyncio.run(send_wave([router_url], streams, model, headers, max_tokens, during=kill_one))
    return {**wave_row("router+worker-killed", streams, [wave]), "fault": "a worker killed mid-wave"}


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

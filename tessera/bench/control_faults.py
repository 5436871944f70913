"""`tessera bench router --set control_faults=true`: the operator restarted and Prometheus stopped, each
mid-load, with the load going through the router to the pool's workers.

The cluster is emulated on loopback (``tessera.bench.cluster``): the operator (kopf and the production
``Controller``) against KMock's Kubernetes emulator, a real Prometheus scraping real ``tessera worker``
processes (sim engine) started, as the pool's pods, on the configuration the operator wrote into the
group's ConfigMap, and ``tessera router --backends`` in front of them. The pool is the quickstart's,
autoscaled by Chiron from Prometheus every ``INTERVAL_S``, 1 to ``workers`` instances. ``workers`` pods
run throughout and the load keeps them all busy, so the autoscaler holds the StatefulSet at ``workers``
replicas: any change of them during a row is the fault's doing. Each request asks for ``TOKENS`` tokens,
whatever the scenario's ``max_tokens``: a pod counts as busy when a request is in flight there at a
scrape, and from 2 instances the autoscaler goes to 1 only when both read idle at two evaluations in a
row. With 4-token requests (tens of ms in a worker) the clients' turn-around between requests, on a
loaded 2-core machine as long as the requests, can make that happen with no fault: the likely cause of
the one 2 -> 1 that CI saw after the Prometheus outage.

Rows, each ``clients`` clients sending streamed requests back to back through the router, counted as the
other fault rows count theirs (``tessera.bench.router_overhead``):

- ``router+operator-restarted``: once the load is under way and the StatefulSet at ``workers``
  replicas, the operator is stopped, none runs for ``OPERATOR_DOWN_S``, then a new one (a fresh
  Controller and kopf, as a restarted pod) starts; the load goes on for ``SETTLE_S``. The row reports the
  replicas before and after, every write to the pool's children the new operator made (none is due: no
  spec changed) and which children changed.
- ``router+prometheus-stopped``: Prometheus is stopped for ``OUTAGE_S``, longer than the scale-down
  cooldown and two autoscaler intervals (an operator that read the missing metrics as an idle group
  would scale down within it), then started again on the same storage; the load goes on for
  ``SETTLE_S``. The row reports the replicas before, during and after the outage, the pool's Scaled
  condition during and after it (``NoMeasurements`` while the autoscaler holds the counts for want of
  measurements) and the events the operator posted meanwhile.

KMock is a development dependency and Prometheus a system package: ``unavailable`` says which is missing,
and the scenario refuses the option then.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tessera.api.worker_config import WorkerConfig
from tessera.bench.harness import WorkerChild
from tessera.bench.router_load import (
    READY_TIMEOUT_S,
    RouterProcess,
    Wave,
    closed_loop,
    until_load,
    wave_row,
)
from tessera.bench.scenarios import Progress
from tessera.operator import status as st
from tessera.worker.engines.vllm_process import free_port

if TYPE_CHECKING:
    from tessera.bench.cluster import Harness, Prometheus, ReplicaLog

NAMESPACE = "bench"
INTERVAL_S = 2.0  # spec.autoscaling.intervalSeconds
COOLDOWN_S = 4.0  # spec.autoscaling.scaleDownCooldownSeconds
TICK_S = 0.25  # how often the pool daemons look whether the autoscaler is due
OPERATOR_DOWN_S = 2.0  # no operator runs for this long
OUTAGE_S = COOLDOWN_S + 2 * INTERVAL_S + 2.0  # Prometheus down for this long
TOKENS = 64  # each request's max_tokens: ~0.4 s in a sim worker, against ms of client turn-around
SETTLE_S = 2 * INTERVAL_S + 1.0  # load kept on after a fault ends: the operator's next evaluations
WRITES = {"POST", "PUT", "PATCH", "DELETE"}
CHILD_COLLECTIONS = ("/statefulsets", "/services", "/configmaps", "/poddisruptionbudgets")
# The load of a row: the router's URL, the model, the request headers, max_tokens and the clients.
_Load = tuple[str, str, dict[str, str], int, int]


def unavailable() -> str | None:
    """What this machine lacks to run the rows (None: nothing)."""
    missing = []
    if shutil.which("prometheus") is None:
        missing.append("the prometheus binary (make sysdeps, or apt-get install prometheus)")
    if importlib.util.find_spec("kmock") is None:
        missing.append("the kmock package (pip install -e '.[dev]')")
    return " and ".join(missing) or None


@dataclass
class _Pool:
    """The emulated cluster's pool under load: its operator, Prometheus and StatefulSet."""

    harness: Harness
    prom: Prometheus
    body: dict[str, Any]  # the ServingPool
    replicas: ReplicaLog
    size: int  # pods running (and the pool's instances.max)

    async def scaled(self) -> dict[str, Any]:
        """The pool's Scaled condition now: status, reason and message."""
        status = ((await self.harness.get(self.body)) or {}).get("status") or {}
        found = next((c for c in status.get("conditions") or [] if c.get("type") == st.SCALED), {})
        return {k: found.get(k) for k in ("status", "reason", "message")}

    def child_writes(self) -> list[str]:
        """Every request the emulator served that wrote a child of the pool, so far."""
        return [
            f"{r.method.value.upper()} {r.url.path}"
            for r in self.harness.emulator
            if r.method.value.upper() in WRITES and any(c in r.url.path for c in CHILD_COLLECTIONS)
        ]

    async def events(self) -> dict[str, str]:
        """Every event posted in the namespace: name -> 'type reason: message'."""
        return {
            e["metadata"]["name"]: f"{e.get('type')} {e.get('reason')}: {e.get('message')}"
            for e in await self.harness.events(NAMESPACE)
        }

    def replicas_between(self, start: float, end: float) -> list[int]:
        """The StatefulSet's replicas in effect at ``start`` and every change seen until ``end``."""
        changes = self.replicas.changes
        at_start = [r for t, r in changes if t <= start][-1:]
        return at_start + [r for t, r in changes if start < t < end]


def run_rows(clients: int, workers: int, progress: Progress) -> tuple[list[dict[str, Any]], list[str]]:
    """Both rows on a fresh emulated cluster; their checks."""
    with tempfile.TemporaryDirectory(prefix="tessera-bench-control-") as tmp:
        rows = asyncio.run(_rows(clients, workers, Path(tmp), progress))
    return rows, [_operator_check(rows[0]), _prometheus_check(rows[1])]


async def _rows(clients: int, size: int, tmp: Path, progress: Progress) -> list[dict[str, Any]]:
    from tessera.bench.cluster import (
        Prometheus,
        ReplicaLog,
        autoscaled_quickstart,
        emulated_cluster,
        placed_group,
        serve_pods,
        until_scraped,
    )
    from tessera.operator.prometheus import PrometheusMetrics

    prom = Prometheus(free_port(), tmp)
    pods: list[WorkerChild] = []
    router: RouterProcess | None = None
    try:
        # Prometheus first: the operator's first passes find it (an unreachable one costs retries).
        await asyncio.to_thread(prom.wait_ready)
        async with emulated_cluster(metrics=PrometheusMetrics(prom.url), tick_seconds=TICK_S) as harness:
            try:
                docs = autoscaled_quickstart(NAMESPACE, size, INTERVAL_S, COOLDOWN_S)
                for doc in docs:
                    await harness.create(doc)
                body = next(d for d in docs if d["kind"] == "ServingPool")
                sts, children = await placed_group(harness, body)
                pods, config = await serve_pods(prom, children, sts, size, tmp)
                await until_scraped(harness, prom, NAMESPACE, sts, size)
                backends = tmp / "backends.json"
                entries = [{"name": f"{sts}-{i}", "url": w.url, "config": config} for i, w in enumerate(pods)]
                backends.write_text(json.dumps({"backends": entries}))
                router = RouterProcess(backends, free_port())
                await asyncio.to_thread(router.start)
                worker = WorkerConfig.model_validate(config)
                load = (router.url, worker.models[0].name, {worker.class_header: "chat"}, TOKENS, clients)
                pool = _Pool(harness, prom, body, ReplicaLog(harness, NAMESPACE, sts), size)
                rows = [await _operator_restart(pool, load)]
                progress(1)
                rows.append(await _prometheus_stop(pool, load))
                progress(1)
                return rows
            finally:
                # The operator before Prometheus: its passes would otherwise retry a stopped Prometheus.
                await harness.stop()
    finally:
        if router is not None:
            await asyncio.to_thread(router.stop)
        await asyncio.gather(*(asyncio.to_thread(w.stop) for w in pods))
        await asyncio.to_thread(prom.stop)


async def _under_load(
    pool: _Pool, name: str, fault: Callable[[Wave, dict[str, Any]], Awaitable[None]], load: _Load
) -> dict[str, Any]:
    """The row ``name``: ``fault`` (a coroutine function of the wave and the record it fills) runs once
    every client has had a request completed and the autoscaler has sized the StatefulSet to the pods
    running (the load keeps them busy); the load ends when it returns."""
    url, model, headers, max_tokens, clients = load
    seen: dict[str, Any] = {}

    async def inject(wave: Wave) -> None:
        await until_load(wave, completed=clients)
        await pool.replicas.wait_for(pool.size, timeout=READY_TIMEOUT_S)
        seen["replicas_before"] = pool.size
        await fault(wave, seen)

    wave = await closed_loop(url, clients, model, headers, max_tokens, inject)
    return {**wave_row(name, clients, [wave]), "operator": seen}


async def _operator_restart(pool: _Pool, load: _Load) -> dict[str, Any]:
    async def restart(wave: Wave, seen: dict[str, Any]) -> None:
        children = await pool.harness.children(NAMESPACE)
        writes = len(pool.child_writes())
        wave.fault_at = time.perf_counter()
        stopped = time.time()
        await pool.harness.stop()
        await asyncio.sleep(OPERATOR_DOWN_S)
        await pool.harness.start()
        started = time.time()
        await pool.replicas.watch_until(started + SETTLE_S)
        after = await pool.harness.children(NAMESPACE)
        keys = children.keys() | after.keys()
        changed = sorted(
            f"{kind}/{name}" for kind, name in keys if children.get((kind, name)) != after.get((kind, name))
        )
        seen.update(
            down_s=started - stopped,
            child_writes=pool.child_writes()[writes:],
            children_changed=changed,
            replicas_seen=pool.replicas_between(stopped, time.time()),
            replicas_after=await pool.replicas.poll(),
        )

    row = await _under_load(pool, "router+operator-restarted", restart, load)
    down = row["operator"]["down_s"]
    fault = (f"the operator restarted mid-load (stopped; a new one started {down:.1f} s later; the load "
             f"went on {SETTLE_S:g} s)")  # fmt: skip
    return {**row, "fault": fault}


async def _prometheus_stop(pool: _Pool, load: _Load) -> dict[str, Any]:
    async def outage(wave: Wave, seen: dict[str, Any]) -> None:
        events = await pool.events()
        wave.fault_at = time.perf_counter()
        await asyncio.to_thread(pool.prom.stop)
        stopped = time.time()
        await pool.replicas.watch_until(stopped + OUTAGE_S)
        during = await pool.scaled()
        back = time.time()
        await asyncio.to_thread(pool.prom.start)
        await asyncio.to_thread(pool.prom.wait_ready)
        ready = time.time()
        await pool.replicas.watch_until(ready + SETTLE_S)
        seen.update(
            outage_s=ready - stopped,
            replicas_during=pool.replicas_between(stopped, back),
            replicas_after=pool.replicas_between(back, time.time()),
            scaled_condition_during=during,
            scaled_condition_after=await pool.scaled(),
            events=[text for name, text in (await pool.events()).items() if name not in events],
        )

    row = await _under_load(pool, "router+prometheus-stopped", outage, load)
    outage = row["operator"]["outage_s"]
    fault = (f"Prometheus stopped mid-load for {outage:.1f} s with autoscaling on (interval {INTERVAL_S:g} "
             f"s, scale-down cooldown {COOLDOWN_S:g} s), then started again")  # fmt: skip
    return {**row, "fault": fault}


def _operator_check(row: dict[str, Any]) -> str:
    seen = row["operator"]
    writes, changed = seen["child_writes"], seen["children_changed"]
    ok = not writes and not changed and set(seen["replicas_seen"]) == {seen["replicas_before"]}
    return (f"operator restarted mid-load: StatefulSet replicas {seen['replicas_before']} before, "
            f"{seen['replicas_seen']} from the stop on; {len(writes)} writes to the pool's children by the "
            f"new operator {writes[:5]}; children changed: {changed or 'none'}: {'PASS' if ok else 'FAIL'} "
            "(goal: nothing rewritten, no instance removed)")  # fmt: skip


def _prometheus_check(row: dict[str, Any]) -> str:
    seen = row["operator"]
    before = seen["replicas_before"]
    ok = set(seen["replicas_during"]) == set(seen["replicas_after"]) == {before}
    during, after = seen["scaled_condition_during"], seen["scaled_condition_after"]
    return (f"Prometheus stopped mid-load: StatefulSet replicas {before} before, {seen['replicas_during']} "
            f"during the {seen['outage_s']:.1f} s outage, {seen['replicas_after']} after; the pool's Scaled "
            f"condition during it: {during['status']} {during['reason']} ({during['message']}), after: "
            f"{after['status']} {after['reason']}; events meanwhile: {seen['events'] or 'none'}: "
            f"{'PASS' if ok else 'FAIL'} (goal: no scaling on missing metrics)")  # fmt: skip


__all__ = ["run_rows", "unavailable"]

"""kopf handlers: thin bindings from Kubernetes events and timers to the Controller.

kopf indexes keep what a pool pass reads (services by ``spec.poolRef``, classes by name, pools by
name, and the pools using each class), so no handler lists objects. LLMService, RequestClass and
ServingPool changes only mark pools; each pool's daemon consumes its marks and runs the passes, so
kopf's one daemon per object is what keeps two passes of a pool from overlapping.

``build_registry`` registers everything into a fresh registry (no import-time side effects), so the CLI
and the tests run the same handlers against whatever cluster their Controller points at.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

import kopf

from tessera.api import GROUP, VERSION
from tessera.control.pool_plan import pool_ref
from tessera.operator.controller import Controller
from tessera.operator.status import CLASSES, POOLS, SERVICES

log = logging.getLogger(__name__)

DEFAULT_TICK_SECONDS = 5.0
# A stopping pool daemon finishes its pass (and, for a deleted pool, the cleanup): kopf waits this long
# before it first looks again, then polls (a deleted pool keeps its finalizer until the daemon is done).
STOP_WAIT_SECONDS = 1.0
STOP_POLL_SECONDS = 0.5
PoolKey = tuple[str, str]  # (namespace, pool name)


def kopf_events(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    """Post a Kubernetes event about ``body`` through kopf's event poster."""
    kopf.event(dict(body), type=type_, reason=reason, message=message[:1024])


def class_refs(body: Mapping[str, Any]) -> list[str]:
    """The RequestClass names an LLMService body lists, read without validation (an invalid service
    still depends on the classes it names)."""
    spec = body.get("spec")
    entries = spec.get("requestClasses") if isinstance(spec, Mapping) else None
    if not isinstance(entries, list):
        return []
    return [e["name"] for e in entries if isinstance(e, Mapping) and isinstance(e.get("name"), str)]


def pool_inputs(
    namespace: str, pool: str, services_by_pool: Mapping[Any, Any], classes_by_name: Mapping[Any, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """What one pass of ``pool`` reads from the indexes: the bodies of the services naming it and of
    the classes those services name."""
    services = [dict(b) for b in services_by_pool.get((namespace, pool), ())]
    named = sorted({c for s in services for c in class_refs(s)})
    classes = [dict(b) for c in named for b in classes_by_name.get((namespace, c), ())]
    return services, classes


class PoolMarks:
    """Pools marked for a pass, each mark waking its pool's daemon.

    Marks are set and taken on kopf's event loop (the handlers that mark are coroutines), so they need
    no lock; any number of marks before the daemon wakes cost one pass.
    """

    def __init__(self) -> None:
        self._events: dict[PoolKey, asyncio.Event] = {}

    def _event(self, key: PoolKey) -> asyncio.Event:
        return self._events.setdefault(key, asyncio.Event())

    def mark(self, namespace: str, pool: str) -> None:
        """Ask for one more pass of a pool."""
        self._event((namespace, pool)).set()

    async def take(self, key: PoolKey, timeout: float, stopped: kopf.DaemonStopped) -> bool:
        """Wait up to ``timeout`` seconds for a mark of the pool (or for its daemon's stop); whether
        there was one. The mark is consumed."""
        event = self._event(key)
        if not event.is_set():
            waits = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(stopped.wait())]
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for wait in waits:
                wait.cancel()
        marked = event.is_set()
        event.clear()
        return marked

    def forget(self, key: PoolKey) -> None:
        """Drop a pool's mark (its daemon has stopped)."""
        self._events.pop(key, None)


def build_registry(
    controller: Controller, tick_seconds: float = DEFAULT_TICK_SECONDS
) -> kopf.OperatorRegistry:
    """A kopf registry with every Tessera handler bound to ``controller``.

    ``tick_seconds`` is how often each pool's daemon looks whether a timed pass is due (the resync, or
    the autoscaler after the pool's ``spec.autoscaling.intervalSeconds``).
    """
    registry = kopf.OperatorRegistry()
    marks = PoolMarks()

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # Keep kopf's bookkeeping in annotations: status belongs to the API models, whose schema
        # would prune kopf's fields anyway.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
        settings.posting.level = logging.INFO

    # -- indexes (a handler gets each as the keyword argument named by its id) -------------------------

    @kopf.index(GROUP, VERSION, POOLS, id="pools_by_name", registry=registry)
    async def pools_by_name(namespace: str, name: str, **_: Any) -> dict[PoolKey, str]:
        return {(namespace, name): name}

    @kopf.index(GROUP, VERSION, SERVICES, id="services_by_pool", registry=registry)
    async def services_by_pool(namespace: str, body: kopf.Body, **_: Any) -> dict[PoolKey, dict[str, Any]]:
        pool = pool_ref(body)
        return {(namespace, pool): dict(body)} if pool else {}

    @kopf.index(GROUP, VERSION, SERVICES, id="services_by_class", registry=registry)
    async def services_by_class(
        namespace: str, name: str, body: kopf.Body, **_: Any
    ) -> dict[tuple[str, str], tuple[str, str | None]]:
        return {(namespace, c): (name, pool_ref(body)) for c in class_refs(body)}

    @kopf.index(GROUP, VERSION, CLASSES, id="classes_by_name", registry=registry)
    async def classes_by_name(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[PoolKey, Any]:
        return {(namespace, name): dict(body)}

    def mark_existing(namespace: str, pools: set[str | None], pools_by_name: kopf.Index) -> set[str]:
        """Mark those of ``pools`` that exist; returns them."""
        existing = {p for p in pools if p and (namespace, p) in pools_by_name}
        for pool in sorted(existing):
            marks.mark(namespace, pool)
        return existing

    # -- ServingPool ----------------------------------------------------------------------------------

    @kopf.daemon(
        GROUP,
        VERSION,
        POOLS,
        registry=registry,
        cancellation_backoff=STOP_WAIT_SECONDS,
        cancellation_polling=STOP_POLL_SECONDS,
    )
    async def pool_loop(
        namespace: str,
        name: str,
        body: kopf.Body,
        stopped: kopf.DaemonStopped,
        services_by_pool: kopf.Index,
        classes_by_name: kopf.Index,
        **_: Any,
    ) -> None:
        key = (namespace, name)
        marks.mark(namespace, name)  # the first pass comes at once (a new pool, or a started operator)
        while True:
            marked = await marks.take(key, tick_seconds, stopped)
            if stopped:
                break
            now = time.time()
            timed = controller.due(namespace, name, now)
            if not (marked or timed):
                continue
            services, classes = pool_inputs(namespace, name, services_by_pool, classes_by_name)
            try:
                await asyncio.to_thread(
                    controller.reconcile_pool, namespace, name, services, classes, now, autoscale=timed
                )
            except Exception:  # the next mark or resync tries again
                log.exception("pass of ServingPool %s/%s failed", namespace, name)
        marks.forget(key)
        if stopped.reason is not None and kopf.DaemonStoppingReason.RESOURCE_DELETED in stopped.reason:
            # Here, not in a deletion handler: kopf runs those while the daemon may still be in a pass.
            uid = str(body.get("metadata", {}).get("uid") or "")
            deleted = await asyncio.to_thread(controller.cleanup_pool, namespace, name, uid)
            kopf.info(dict(body), reason="Deleted", message=f"deleted {deleted} child objects")

    @kopf.on.update(GROUP, VERSION, POOLS, registry=registry)
    async def pool_changed(namespace: str, name: str, **_: Any) -> None:
        marks.mark(namespace, name)

    # -- LLMService -----------------------------------------------------------------------------------

    @kopf.on.create(GROUP, VERSION, SERVICES, registry=registry)
    @kopf.on.update(GROUP, VERSION, SERVICES, registry=registry)
    @kopf.on.resume(GROUP, VERSION, SERVICES, registry=registry)
    async def service_changed(
        namespace: str, body: kopf.Body, old: Any, pools_by_name: kopf.Index, **_: Any
    ) -> None:
        # A changed poolRef re-plans the pool it left too.
        ref = pool_ref(body)
        before = pool_ref(old) if isinstance(old, Mapping) else None
        if ref in mark_existing(namespace, {ref, before}, pools_by_name):
            return
        # No pool to report it: the service reports itself, and its pool's first pass if the pool
        # appeared meanwhile.
        await asyncio.to_thread(controller.reporter.report_unplaced_service, dict(body), time.time())
        mark_existing(namespace, {ref}, pools_by_name)

    @kopf.on.delete(GROUP, VERSION, SERVICES, registry=registry)
    async def service_deleted(
        namespace: str, body: kopf.Body, old: Any, pools_by_name: kopf.Index, **_: Any
    ) -> None:
        before = pool_ref(old) if isinstance(old, Mapping) else None
        mark_existing(namespace, {pool_ref(body), before}, pools_by_name)

    # -- RequestClass ---------------------------------------------------------------------------------

    @kopf.on.create(GROUP, VERSION, CLASSES, registry=registry)
    @kopf.on.update(GROUP, VERSION, CLASSES, registry=registry)
    @kopf.on.resume(GROUP, VERSION, CLASSES, registry=registry)
    @kopf.on.delete(GROUP, VERSION, CLASSES, registry=registry)
    async def class_changed(
        namespace: str,
        name: str,
        body: kopf.Body,
        services_by_class: kopf.Index,
        pools_by_name: kopf.Index,
        **_: Any,
    ) -> None:
        users = list(services_by_class.get((namespace, name), ()))
        used_by = sorted({service for service, _ in users})
        await asyncio.to_thread(controller.reporter.report_class, dict(body), used_by, time.time())
        mark_existing(namespace, {pool for _, pool in users}, pools_by_name)

    return registry

"""kopf handlers: thin bindings from Kubernetes events and timers to the Controller.

``build_registry`` registers everything into a fresh registry (no import-time side effects), so the CLI
and the tests run the same handlers against whatever cluster their Controller points at.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import kopf

from tessera.api import GROUP, VERSION
from tessera.control.pool_plan import pool_ref
from tessera.operator.controller import CLASSES, POOLS, SERVICES, Controller

DEFAULT_TICK_SECONDS = 5.0


def kopf_events(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    """Post a Kubernetes event about ``body`` through kopf's event poster."""
    kopf.event(dict(body), type=type_, reason=reason, message=message[:1024])


def build_registry(
    controller: Controller, tick_seconds: float = DEFAULT_TICK_SECONDS
) -> kopf.OperatorRegistry:
    """A kopf registry with every Tessera handler bound to ``controller``.

    ``tick_seconds`` is the pool timer period; each pool's autoscaler runs on the first tick after its
    own ``spec.autoscaling.intervalSeconds`` has passed.
    """
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # Keep kopf's bookkeeping in annotations: status belongs to the API models, whose schema
        # would prune kopf's fields anyway.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
        settings.posting.level = logging.INFO
        settings.execution.max_workers = 4

    # -- ServingPool ----------------------------------------------------------------------------------

    @kopf.on.create(GROUP, VERSION, POOLS, registry=registry)
    @kopf.on.update(GROUP, VERSION, POOLS, registry=registry)
    @kopf.on.resume(GROUP, VERSION, POOLS, registry=registry)
    def pool_changed(namespace: str, name: str, **_: Any) -> None:
        controller.reconcile_pool(namespace, name, time.time())

    @kopf.timer(GROUP, VERSION, POOLS, interval=tick_seconds, registry=registry)
    def pool_tick(namespace: str, name: str, **_: Any) -> None:
        controller.tick(namespace, name, time.time())

    @kopf.on.delete(GROUP, VERSION, POOLS, registry=registry)
    def pool_deleted(namespace: str, name: str, body: kopf.Body, **_: Any) -> None:
        deleted = controller.cleanup_pool(namespace, name)
        kopf.info(body, reason="Deleted", message=f"deleted {deleted} child objects")

    # -- LLMService -----------------------------------------------------------------------------------

    @kopf.on.create(GROUP, VERSION, SERVICES, registry=registry)
    @kopf.on.update(GROUP, VERSION, SERVICES, registry=registry)
    @kopf.on.resume(GROUP, VERSION, SERVICES, registry=registry)
    def service_changed(namespace: str, body: kopf.Body, **_: Any) -> None:
        controller.reconcile_service(namespace, dict(body), time.time())

    @kopf.on.delete(GROUP, VERSION, SERVICES, registry=registry)
    def service_deleted(namespace: str, body: kopf.Body, old: Any, **_: Any) -> None:
        refs = {pool_ref(dict(body)), pool_ref(old) if isinstance(old, Mapping) else None}
        for pool in sorted(p for p in refs if p):
            controller.reconcile_pool(namespace, pool, time.time())

    # -- RequestClass ---------------------------------------------------------------------------------

    @kopf.on.create(GROUP, VERSION, CLASSES, registry=registry)
    @kopf.on.update(GROUP, VERSION, CLASSES, registry=registry)
    @kopf.on.resume(GROUP, VERSION, CLASSES, registry=registry)
    @kopf.on.delete(GROUP, VERSION, CLASSES, registry=registry)
    def class_changed(namespace: str, body: kopf.Body, **_: Any) -> None:
        controller.reconcile_class(namespace, dict(body), time.time())

    return registry

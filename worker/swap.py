"""Model swapping between the models of one pod (QLM's model-swap LSO, ``Decision.load_model``).

Every model of a pod has its own engine and scheduler. Models whose engine can sleep (vLLM with
sleep mode: CUDA/ROCm, ``--enable-sleep-mode``, ``VLLM_SERVER_DEV_MODE=1``; the sim engine when
configured so) share the accelerator one at a time: exactly one of them is awake (the *active*
model), the others sleep. A scheduler whose policy answers ``Decision.load_model`` (or that holds
work while its model sleeps) asks for its model; the swapper then stops admissions of the active
model, waits until its in-flight requests have drained (QLM: "drain, then swap"), puts it to sleep
and wakes the requested one. Requests are never dropped: waiting ones stay queued across a swap.

Fallback (documented): models whose engine cannot sleep — vLLM 0.32 on CPU has no sleep mode —
stay resident all the time (``active_for`` gives None; the scheduler's view shows their own model,
as a simulated single-model instance does), admissions are never held and load requests are no-ops.
A pod with fewer than two sleep-capable models swaps nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tessera.worker.engines.base import Engine, EngineError
from tessera.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)


class ModelSwapper:
    """Which sleep-capable model of the pod is awake; serialises sleep / wake-up between schedulers."""

    def __init__(self, engines: dict[str, Engine], metrics: WorkerMetrics) -> None:
        self.engines = engines
        self.metrics = metrics
        capable = [name for name, engine in engines.items() if engine.supports_sleep]
        self.swappable: frozenset[str] = frozenset(capable if len(capable) >= 2 else ())
        self.active: str | None = capable[0] if self.swappable else None
        self.pending: str | None = None  # model asked for, loaded once the active one drains
        self.swaps = 0
        self._inflight: dict[str, Callable[[], int]] = {}
        self._wakers: dict[str, Callable[[], None]] = {}
        self._task: asyncio.Task[None] | None = None

    def register(self, model: str, inflight: Callable[[], int], wake: Callable[[], None]) -> None:
        """A scheduler joins: how to read its in-flight count and how to wake its loop."""
        self._inflight[model] = inflight
        self._wakers[model] = wake

    async def start(self) -> None:
        """Put every sleep-capable model but the active one to sleep (they all start awake)."""
        for name in sorted(self.swappable - {self.active}):
            await self.engines[name].sleep()

    @property
    def swapping(self) -> bool:
        """Whether a sleep / wake-up is under way."""
        return self._task is not None and not self._task.done()

    def active_for(self, model: str) -> str | None:
        """The ``active_model`` a policy of ``model`` sees (None: resident, single-model semantics)."""
        return self.active if model in self.swappable else None

    def may_admit(self, model: str) -> bool:
        """Whether ``model``'s scheduler may start requests now."""
        if model not in self.swappable:
            return True
        return model == self.active and self.pending is None and not self.swapping

    def request(self, model: str) -> None:
        """Ask for ``model`` to be loaded (a no-op for resident models and for the active one)."""
        if model not in self.engines:
            raise ValueError(f"a policy asked to load model {model!r}, which this pod does not serve")
        if model not in self.swappable or self.pending is not None:
            return
        if model == self.active and not self.swapping:
            return
        self.pending = model
        self.poke()

    def poke(self) -> None:
        """Start the pending swap once the active model has nothing in flight."""
        if self.pending is None or self.swapping:
            return
        if self.active is not None and self._inflight.get(self.active, lambda: 0)() > 0:
            return  # the active model drains first; its scheduler pokes again when it empties
        self._task = asyncio.create_task(self._swap(self.pending), name=f"swap-to-{self.pending}")

    async def _swap(self, target: str) -> None:
        old = self.active
        try:
            if old is not None and old != target:
                await self.engines[old].sleep()
                self.active = None  # nothing awake until the wake-up succeeds
            await self.engines[target].wake_up()
            self.active = target
            if old != target:
                self.swaps += 1
                self.metrics.swaps.labels(target).inc()
        except EngineError as exc:  # the waiting requests stay queued; the next request retries
            log.warning("model swap %s -> %s failed: %s", old, target, exc)
        finally:
            self.pending = None
            for wake in self._wakers.values():
                wake()

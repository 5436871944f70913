"""The multi-model baselines QLM is compared with: FCFS with per-request model swapping (the paper's
naive baseline) and per-model queues with batched swapping (a stronger simple one).

``SwapFCFS``: one FCFS queue per instance; whenever the next request needs another model, the
instance drains its batch and swaps to that model. ``SwapBatched``: the same queue read per model:
the instance serves the loaded model's requests in arrival order and swaps only when none is left, or
when another model's oldest request has waited ``max_wait_s``; it then drains and swaps to the model
of the oldest waiting request, so each swap is paid for a whole batch of one model's requests. Swaps
cost the same as QLM's (``ModelTiers``); the CPU tier holds recently used models (LRU) under the same
CPU budget, since FCFS has no queue order to prefetch by. Among equal arrival times the higher
class priority (``ServiceClass.priority``) goes first.
"""

from __future__ import annotations

import bisect
from typing import ClassVar

from tessera.core.policies.qlm.lso import ModelTiers, SwapGate, TierCosts
from tessera.core.policy import Decision, InstanceView, Policy
from tessera.core.request import Request


def _entry(req: Request, seq: int) -> tuple[float, int, int, Request]:
    return (req.arrival, -req.service_class.priority, seq, req)


def _order(entry: tuple[float, int, int, Request]) -> tuple[float, int, int]:
    return entry[:3]


class SwapFCFS(Policy):
    """FCFS over one queue, swapping to the model of the next request whenever it differs."""

    name: ClassVar[str] = "fcfs-swap"
    _in_order: ClassVar[bool] = True  # admission stops at the first waiting request of another model

    def __init__(
        self,
        *,
        engine_reinit_s: float = 20.0,
        disk_to_cpu_bytes_per_s: float = 2e9,
        cpu_model_bytes: float = 40e9,
    ) -> None:
        self.tiers = ModelTiers(TierCosts(engine_reinit_s, disk_to_cpu_bytes_per_s, cpu_model_bytes))
        self.gate = SwapGate(self.tiers)
        self._waiting: list[tuple[float, int, int, Request]] = []  # _entry: (arrival, -priority, seq, req)
        self._running: dict[int, Request] = {}
        self._seq = 0
        self._recent: list[str] = []  # models loaded, most recent first

    def __len__(self) -> int:
        return len(self._waiting) + len(self._running)

    def add(self, req: Request, now: float) -> None:
        """Queue in arrival order."""
        self._seq += 1
        bisect.insort(self._waiting, _entry(req, self._seq), key=_order)

    def remove(self, req: Request, now: float) -> None:
        """Forget a finished request."""
        self._running.pop(id(req), None)
        self._waiting = [e for e in self._waiting if e[-1] is not req]

    def schedule(self, view: InstanceView) -> Decision:
        """Keep the batch; admit same-model requests in arrival order up to the first of another model."""
        now_running = {id(r): r for r in view.running}
        for rid, req in list(self._running.items()):
            if rid not in now_running:  # preempted by the engine: back to its FCFS place
                del self._running[rid]
                self._seq += 1
                bisect.insort(self._waiting, _entry(req, self._seq), key=_order)
        for rid, req in now_running.items():
            if rid not in self._running:
                self._running[rid] = req
                self._waiting = [e for e in self._waiting if e[-1] is not req]
        closed = self.gate.closed_until(view.active_model, view.now)
        if closed is not None:
            return Decision(run=[], recheck_at=closed)
        running = list(view.running)
        if not self._waiting:
            return Decision(run=running)
        head = self._head(view)
        engine = view.engine_of(head.model)  # an adapter runs in its base's engine: no swap between them
        if view.active_model is not None and engine != view.active_model:
            if running:
                return Decision(run=running)  # drain, then swap
            self._recent = [engine] + [m for m in self._recent if m != engine]
            self.tiers.plan(self._recent[1:], {m: view.profile.weights_bytes for m in self._recent}, view.now)
            self.gate.issue(engine, view.profile.weights_bytes, view.now)
            return Decision(run=[], load_model=engine)
        run = running
        for *_, req in self._waiting:
            if len(run) >= view.max_batch:
                break
            if view.engine_of(req.model) != engine:
                if self._in_order:
                    break
                continue
            run.append(req)
        return Decision(run=run)

    def _head(self, view: InstanceView) -> Request:
        """The request whose model the instance serves next: the oldest waiting one."""
        return self._waiting[0][-1]


class SwapBatched(SwapFCFS):
    """Per-model FCFS queues; swap when the loaded model has nothing waiting or another model's oldest
    request has waited ``max_wait_s``."""

    name: ClassVar[str] = "fcfs-model-queues"
    _in_order: ClassVar[bool] = False

    def __init__(self, *, max_wait_s: float = 60.0, **tier_costs: float) -> None:
        super().__init__(**tier_costs)
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0 seconds, got {max_wait_s}")
        self.max_wait_s = max_wait_s

    def _head(self, view: InstanceView) -> Request:
        """The loaded model's oldest waiting request, unless another model's oldest has waited too long
        (or the loaded model has none): then the oldest waiting request of all."""
        oldest = self._waiting[0][-1]
        active = view.active_model
        if view.engine_of(oldest.model) == active or view.now - oldest.arrival >= self.max_wait_s:
            return oldest
        return next((e[-1] for e in self._waiting if view.engine_of(e[-1].model) == active), oldest)

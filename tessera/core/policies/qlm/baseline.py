"""The naive multi-model baseline QLM is compared with: FCFS with per-request model swapping.

One FCFS queue per instance; whenever the next request needs another model, the
instance drains its batch and swaps to that model. Swaps cost the same as QLM's
(``ModelTiers``); the CPU tier holds recently used models (LRU) under the same
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
        head = self._waiting[0][-1]
        if view.active_model is not None and head.model != view.active_model:
            if running:
                return Decision(run=running)  # drain, then swap
            self._recent = [head.model] + [m for m in self._recent if m != head.model]
            self.tiers.plan(self._recent[1:], {m: view.profile.weights_bytes for m in self._recent}, view.now)
            self.gate.issue(head.model, view.profile.weights_bytes, view.now)
            return Decision(run=[], load_model=head.model)
        run = running
        for *_, req in self._waiting:
            if req.model != head.model or len(run) >= view.max_batch:
                break
            run.append(req)
        return Decision(run=run)

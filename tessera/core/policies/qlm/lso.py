"""QLM's LLM serving operations that need state of their own (QLM §5; see docs/papers.md).

- ``ModelTiers``: model swapping across GPU / CPU / storage. The engine charges the
  CPU->GPU weight copy (``weights_bytes / host_link``); the policy adds the engine
  re-initialisation ``S0`` and, for a model that is not warm in CPU memory, the
  storage->CPU read. Models later in the VQ are prefetched into CPU memory in VQ
  order while the CPU budget lasts (warm start).
- ``eviction_victims``: which running requests leave the batch so the head group runs
  now (eviction): those of groups behind the head, latest VQ position first, LIFO in a group,
  only as many as the head group needs.

Pulling is the VQ order itself (``QLMPolicy``); load balancing is the router's ``least-wait`` route.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tessera.core.request import Request


@dataclass(frozen=True, slots=True)
class TierCosts:
    """Swap-time model (CHOICEs; docs/papers.md, "QLM: serving operations")."""

    engine_reinit_s: float = 20.0  # S0
    disk_to_cpu_bytes_per_s: float = 2e9
    cpu_model_bytes: float = 40e9  # CPU memory for warm models (half of the paper's 80 GB extra)
    warm_start: bool = True  # False: no CPU tier, every swap is cold (ablation "-model swapping")

    def __post_init__(self) -> None:
        if self.engine_reinit_s < 0 or self.disk_to_cpu_bytes_per_s <= 0 or self.cpu_model_bytes < 0:
            raise ValueError("tier costs need engine_reinit_s >= 0, disk bandwidth > 0, cpu_model_bytes >= 0")


class ModelTiers:
    """Which models are warm (in CPU memory) and what a swap costs beyond the engine's copy."""

    def __init__(self, costs: TierCosts) -> None:
        self.costs = costs
        self._warm: dict[str, float] = {}  # model -> time its CPU copy is complete

    def extra_swap_s(self, model: str, weights_bytes: float, now: float) -> float:
        """Time a swap to ``model`` costs beyond the engine's CPU->GPU copy: S0, plus the storage
        read unless the model is warm (a prefetch in flight counts for what is left of it)."""
        extra = self.costs.engine_reinit_s
        ready = self._warm.get(model)
        if ready is None:
            extra += weights_bytes / self.costs.disk_to_cpu_bytes_per_s
        elif ready > now:
            extra += ready - now
        return extra

    def plan(self, upcoming: Sequence[str], weights_bytes: dict[str, float], now: float) -> None:
        """Keep warm the models of ``upcoming`` (VQ order, active model first) that fit the CPU
        budget; start prefetches for new ones, one after the other over the storage link."""
        if not self.costs.warm_start:
            self._warm.clear()
            return
        keep: dict[str, float] = {}
        used = 0.0
        link_free = max([now, *(t for t in self._warm.values())])
        for model in dict.fromkeys(upcoming):
            size = weights_bytes[model]
            if used + size > self.costs.cpu_model_bytes:
                break
            used += size
            if model in self._warm:
                keep[model] = self._warm[model]
            else:
                link_free += size / self.costs.disk_to_cpu_bytes_per_s
                keep[model] = link_free
        self._warm = keep

    def loaded(self, model: str, now: float) -> None:
        """After a swap the weights are also in CPU memory (they came through it)."""
        if self.costs.warm_start:
            self._warm[model] = min(self._warm.get(model, now), now)


def eviction_victims(
    head_position: int,
    running: Sequence[Request],
    position_of: dict[int, int],
    need_slots: int,
    need_tokens: int,
    free_slots: int,
    free_tokens: int,
) -> list[Request]:
    """Running requests to evict so the head group's waiting requests fit (QLM §5 eviction).

    Only requests of groups behind the head (VQ position > ``head_position``) are
    victims, latest position first and, within a group, the latest admitted first.
    Stops as soon as ``need_slots`` batch slots and ``need_tokens`` KV tokens are free.
    """
    order = sorted(
        ((position_of[id(r)], idx, r) for idx, r in enumerate(running) if position_of[id(r)] > head_position),
        key=lambda e: (e[0], e[1]),
        reverse=True,
    )
    victims = []
    for _, _, req in order:
        if free_slots >= need_slots and free_tokens >= need_tokens:
            break
        victims.append(req)
        free_slots += 1
        free_tokens += req.context_tokens + 1
    return victims


class SwapGate:
    """Charges a swap's extra time (``ModelTiers.extra_swap_s``) after the engine's weight copy:
    the policy keeps the batch empty until then."""

    def __init__(self, tiers: ModelTiers) -> None:
        self.tiers = tiers
        self._issued: tuple[str, float] | None = None
        self._until = float("-inf")

    def issue(self, model: str, weights_bytes: float, now: float) -> None:
        """A swap to ``model`` is being requested from the engine at ``now``."""
        self._issued = (model, self.tiers.extra_swap_s(model, weights_bytes, now))

    def closed_until(self, active_model: str | None, now: float) -> float | None:
        """When the instance may run again, or None if it may run now."""
        if self._issued is not None and active_model == self._issued[0]:
            self._until = now + self._issued[1]  # the engine's copy is done; S0 (+ storage read) now
            self.tiers.loaded(self._issued[0], now)
            self._issued = None
        return self._until if now < self._until else None

"""Scale to zero: when an idle unit sleeps, how long a held request waits, in which order held requests
go, and when a failed wake-up is tried again.

A *unit* is what sleeps and wakes as a whole: the instances of one placement group, with every model
they serve. Pure: every time is passed in (seconds on one monotonic clock); the router's activator
(``tessera.router.activator``) carries the decisions out.

States: ``Ready`` (serving), ``Sleeping`` (being put to sleep; requests that arrive are held),
``Cold`` (asleep: nothing runs; the first request wakes it), ``Waking`` (a wake-up is under way;
requests are held until it ends).

An asleep unit sleeps at a *depth* (``sleep_depth``) that sets what its wake-up costs
(``wake_cost_s``): vLLM sleep level 1 (weights in host memory, no KV; the server keeps its GPU context),
level 2 (weights dropped, the server process kept) or stopped (no process: the wake-up is a cold start).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

from tessera.core.profile import StepProfile

T = TypeVar("T")

# How long a held request of a class without a TTFT SLO (batch) waits for a wake-up.
DEFAULT_HOLD_S = 60.0


class UnitState(StrEnum):
    """Where a unit stands."""

    READY = "Ready"
    SLEEPING = "Sleeping"
    COLD = "Cold"
    WAKING = "Waking"


@dataclass(frozen=True, slots=True)
class IdlePolicy:
    """One service's idle policy (LLMService ``spec.scaleToZero``)."""

    after_s: float  # no request for this long: the service may sleep
    hold_s: float | None = None  # a held request's wait; None: its class's TTFT SLO
    max_held: int = 100  # requests held at most while it wakes


def unit_idle_after(policies: Sequence[IdlePolicy | None]) -> float | None:
    """Seconds without requests after which a unit serving models with ``policies`` sleeps; None when it
    never does: a unit sleeps only when every model on it may, after the longest of their idle times."""
    if not policies or any(p is None for p in policies):
        return None
    return max(p.after_s for p in policies if p is not None)


class SleepDepth(StrEnum):
    """How deep an asleep unit sleeps."""

    LEVEL1 = "level1"  # vLLM sleep level 1: weights offloaded to host memory, KV freed
    LEVEL2 = "level2"  # vLLM sleep level 2: weights and KV dropped, the server process kept
    STOPPED = "stopped"  # the server process ended


def sleep_depth(
    can_sleep: bool, weights_bytes: int, host_free_bytes: float, asleep_s: float, stop_after_s: float | None
) -> SleepDepth:
    """How deep a unit that has been asleep ``asleep_s`` seconds sleeps now. Stopped when its engine has no
    sleep mode or after ``stop_after_s`` asleep (None: never), freeing its host memory and, once nothing
    else runs there, its GPU; else level 1 while its weights fit the host memory left for sleeping
    weights, level 2 when they do not."""
    if not can_sleep or (stop_after_s is not None and asleep_s >= stop_after_s):
        return SleepDepth.STOPPED
    return SleepDepth.LEVEL1 if weights_bytes <= host_free_bytes else SleepDepth.LEVEL2


_WAKE_LEVEL = {SleepDepth.LEVEL1: 1, SleepDepth.LEVEL2: 2, SleepDepth.STOPPED: 0}


def wake_cost_s(depth: SleepDepth, profile: StepProfile) -> float:
    """Seconds a wake-up from ``depth`` takes (``StepProfile.wake_time``: a cold start when stopped)."""
    return profile.wake_time(_WAKE_LEVEL[depth])


def should_sleep(
    state: UnitState, last_activity: float, outstanding: int, held: int, after_s: float | None, now: float
) -> bool:
    """Whether a unit goes to sleep now: it is ready, has a policy, nothing is in flight or held, and no
    request arrived for ``after_s`` seconds."""
    return (
        state is UnitState.READY
        and after_s is not None
        and outstanding == 0
        and held == 0
        and now - last_activity >= after_s
    )


def hold_deadline(arrival: float, hold_s: float | None, ttft_slo_s: float | None) -> float:
    """When a held request stops waiting: ``hold_s`` after arrival, else its class's TTFT SLO, else
    ``DEFAULT_HOLD_S``."""
    wait = hold_s if hold_s is not None else ttft_slo_s if ttft_slo_s is not None else DEFAULT_HOLD_S
    return arrival + wait


def retry_after_s(now: float, wake_started: float | None, expected_wake_s: float | None) -> int:
    """The Retry-After (whole seconds, at least 1) of a request that stopped waiting: what remains of the
    wake-up under way, by the duration of the last one."""
    if wake_started is None or expected_wake_s is None:
        return 1
    return max(1, math.ceil(expected_wake_s - (now - wake_started)))


@dataclass(frozen=True, slots=True)
class Backoff:
    """Retries of a failing wake-up: ``attempts`` tries in all, waiting ``base_s · factor^k`` (at most
    ``max_s``) after the k-th failure (k from 0)."""

    base_s: float = 1.0
    factor: float = 2.0
    max_s: float = 30.0
    attempts: int = 4

    def __post_init__(self) -> None:
        if self.base_s < 0 or self.factor < 1 or self.max_s < 0 or self.attempts < 1:
            raise ValueError(f"invalid backoff {self}: base_s >= 0, factor >= 1, max_s >= 0, attempts >= 1")

    def delay(self, failures: int) -> float | None:
        """Seconds to wait after the ``failures``-th failure (from 1) before the next try; None: give up."""
        if failures >= self.attempts:
            return None
        return min(self.max_s, self.base_s * self.factor ** (failures - 1))


@dataclass(slots=True)
class HoldQueue(Generic[T]):
    """The requests held for one service while it wakes: bounded, released by class priority (higher
    first), then in arrival order."""

    capacity: int
    _held: dict[int, tuple[int, float, int, T]] = field(default_factory=dict)  # id(item) -> sort key, item
    _seq: itertools.count[int] = field(default_factory=itertools.count)

    def __len__(self) -> int:
        return len(self._held)

    def admit(self, item: T, priority: int, arrival: float) -> bool:
        """Hold ``item``; False (not held) when the queue is full."""
        if len(self._held) >= self.capacity:
            return False
        self._held[id(item)] = (-priority, arrival, next(self._seq), item)
        return True

    def remove(self, item: T) -> None:
        """Stop holding ``item`` (it gave up); a no-op when it is not held."""
        self._held.pop(id(item), None)

    def release(self) -> list[T]:
        """Every held item in release order; the queue is empty afterwards."""
        out = [entry[3] for entry in sorted(self._held.values(), key=lambda e: e[:3])]
        self._held.clear()
        return out

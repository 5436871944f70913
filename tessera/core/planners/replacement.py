"""SeaLLM §4.3: the adaptive re-placement interval (Eq. 8), an early boundary on a load shift (our
extension) and the least-churn roll-out of a new plan."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from tessera.core.planners.types import GroupPlan, PlacementPlan


@dataclass(frozen=True, slots=True)
class IntervalSettings:
    """Eq. 8's parameters. Defaults: β = 0.1 (paper), I_0 = 5 min, bounds [1, 30] min (CHOICE)."""

    initial_s: float = 300.0
    min_s: float = 60.0
    max_s: float = 1800.0
    beta: float = 0.1

    def __post_init__(self) -> None:
        if not 0 < self.min_s <= self.initial_s <= self.max_s:
            raise ValueError(
                f"replacement interval needs 0 < min <= initial <= max, got "
                f"min={self.min_s} initial={self.initial_s} max={self.max_s}"
            )
        if not 0 < self.beta < 1:
            raise ValueError(f"beta must be in (0, 1), got {self.beta}")


@dataclass(frozen=True, slots=True)
class IntervalMetrics:
    """Performance of one interval: SLO attainment (0-1) and mean normalized latency."""

    slo_attainment: float
    norm_latency: float


def _rel_err(real: float, est: float) -> float:
    if est == 0:
        return 0.0 if real == 0 else math.inf
    return abs(real - est) / abs(est)


def prediction_error(estimated: IntervalMetrics, measured: IntervalMetrics) -> float:
    """Eq. 8's |M_real − M_est| / M_est for the two metrics the paper names, combined by max (CHOICE)."""
    return max(
        _rel_err(measured.slo_attainment, estimated.slo_attainment),
        _rel_err(measured.norm_latency, estimated.norm_latency),
    )


def next_replacement_interval(
    current_s: float | None,
    estimated: IntervalMetrics | None,
    measured: IntervalMetrics | None,
    settings: IntervalSettings,
) -> float:
    """I_{t+1} from I_t (Eq. 8): ×(1−β) when the estimate missed by more than β, ×(1+β) when by less,
    unchanged on equality; clamped to [min, max]. Without a previous interval or an estimate to compare
    (first plan, or no traffic measured) the interval is I_0, or I_t unchanged."""
    if current_s is None:
        return settings.initial_s
    if current_s <= 0:
        raise ValueError(f"current interval must be > 0, got {current_s}")
    if estimated is None or measured is None:
        return min(settings.max_s, max(settings.min_s, current_s))
    err = prediction_error(estimated, measured)
    if math.isclose(err, settings.beta, rel_tol=1e-9):
        nxt = current_s
    elif err > settings.beta:
        nxt = (1 - settings.beta) * current_s
    else:
        nxt = (1 + settings.beta) * current_s
    return min(settings.max_s, max(settings.min_s, nxt))


# A shift must also stand out of Poisson noise by this many standard deviations, so that a quiet
# service's few requests never move pods (at 4 req/s over 30 s: 120 expected, noise about 11).
SHIFT_Z = 4.0


def shifted_loads(
    planned_rps: Mapping[str, float], measured: Mapping[str, tuple[float, float]], threshold: float
) -> dict[str, tuple[float, float]]:
    """The services whose arrivals depart from the rate their plan was made for by more than
    ``threshold`` of it (relative) and by more than ``SHIFT_Z`` Poisson standard deviations:
    name -> (planned, measured) requests per second. ``measured``: name -> (requests that arrived,
    seconds they were counted over); a planned service with no measurement is not judged. Empty when
    ``threshold`` is 0 (off).

    Why (CHOICE, our extension): Eq. 8 only times boundaries from how well the last estimate held, so a
    shift just after a boundary waits a whole interval; SeaLLM's interval grows while estimates hold,
    which is exactly when a sudden shift is least expected. A service planned for no load that starts
    receiving requests counts once it passes the noise bound."""
    if threshold <= 0:
        return {}
    out = {}
    for name, rate in planned_rps.items():
        if name not in measured:
            continue
        count, span_s = measured[name]
        if span_s <= 0:
            continue
        expected = max(0.0, rate) * span_s
        gap = abs(count - expected)
        if gap > threshold * expected and gap > SHIFT_Z * math.sqrt(max(expected, 1.0)):
            out[name] = (rate, count / span_s)
    return out


def shift_check_due(
    now: float, next_check: float, placed_at: float | None, min_s: float
) -> tuple[bool, float]:
    """The load-shift watch's timing: whether to compare loads at ``now`` (looked at every ``min_s / 2``
    from ``next_check``, and only once the plan in effect, placed at ``placed_at``, is ``min_s`` old:
    a younger plan has not seen a whole window of its own), and when to look next."""
    if now < next_check:
        return False, next_check
    return placed_at is None or now - placed_at >= min_s, now + min_s / 2


@dataclass(frozen=True, slots=True)
class RolloutDiff:
    """How to go from one plan to the next with the least churn.

    ``keep``: groups present in both (same services and TP, hence the same name): their pods stay; only
    their replica counts may change (``scaled``). ``create``/``delete``: groups to start and to stop.
    ``moved_services``: services whose set of hosting groups changed (their requests migrate)."""

    keep: tuple[str, ...]
    scaled: tuple[tuple[str, int, int], ...]  # (group, replicas before, after)
    create: tuple[GroupPlan, ...]
    delete: tuple[str, ...]
    moved_services: tuple[str, ...]

    @property
    def unchanged(self) -> bool:
        """Whether the roll-out changes nothing."""
        return not (self.scaled or self.create or self.delete)


def rollout_diff(previous: PlacementPlan | None, new: PlacementPlan) -> RolloutDiff:
    """The least-churn roll-out from ``previous`` to ``new``: groups are matched by (services, TP)."""
    old = {g.key: g for g in previous.groups} if previous else {}
    cur = {g.key: g for g in new.groups}
    keep = tuple(sorted(cur[k].name for k in cur if k in old))
    scaled = tuple(
        sorted(
            (cur[k].name, old[k].replicas.total, cur[k].replicas.total)
            for k in cur
            if k in old and old[k].replicas.total != cur[k].replicas.total
        )
    )
    create = tuple(sorted((cur[k] for k in cur if k not in old), key=lambda g: g.name))
    delete = tuple(sorted(old[k].name for k in old if k not in cur))
    hosts_old: dict[str, set[tuple]] = {}
    hosts_new: dict[str, set[tuple]] = {}
    for table, groups in ((hosts_old, old), (hosts_new, cur)):
        for k in groups:
            for s in k[0]:
                table.setdefault(s, set()).add(k)
    moved = tuple(
        sorted(
            s for s in set(hosts_old) | set(hosts_new) if hosts_old.get(s, set()) != hosts_new.get(s, set())
        )
    )
    return RolloutDiff(keep=keep, scaled=scaled, create=create, delete=delete, moved_services=moved)

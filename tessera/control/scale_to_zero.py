"""Scale to zero on a cluster: which placement groups sleep (their StatefulSets at zero replicas), and when
they wake.

Who does what (CHOICE):

- The operator puts a group to sleep. It does so when every service on the group has
  ``spec.scaleToZero`` (``tessera.core.activation.unit_idle_after``: after the longest of their idle
  times), the group has been awake at least that long, and over that time its workers ended no request
  and held none at any scrape (``idle_queries``). The workers' own series count what every router
  replica sent, which no single router sees.
- A router's activator asks for the wake-up. It holds the requests for a cold group's models and writes
  the time into each of the group's LLMServices' ``status.wakeRequestedAt`` (the status subresource:
  the router may not change a spec). The operator's passes come every few seconds while a pool has
  such groups (no Prometheus scrape in the way), and the next one restores the replicas the group had
  when it went to sleep, from which Chiron's autoscaler goes on. A request written before the group
  went to sleep does not wake it.
- A waking group is Ready once one of its pods is.

The decisions are kept in the pool's ``status.scaleToZero``, so a restarted operator resumes a wake-up.
Without Prometheus no group sleeps (idleness cannot be measured); wake-ups need none.

Pure: every time is passed in (Unix seconds).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tessera.api.times import parse_time, rfc3339
from tessera.control.metrics_queries import ModelLoad, load_step_s
from tessera.core.activation import UnitState, should_sleep
from tessera.core.planners import ROLES, GroupPlan, PlacementPlan, RoleCounts

# The LLMService status field a router writes (RFC 3339 time) when it holds a request for a cold model.
WAKE_FIELD = "wakeRequestedAt"
ZERO = RoleCounts()


@dataclass(frozen=True, slots=True)
class GroupSleep:
    """One scale-to-zero group's state since ``since``, and its replicas while awake (restored on wake)."""

    group: str
    state: UnitState  # READY, COLD or WAKING (a cold group whose pods still stop reads as Sleeping)
    since: float
    awake: RoleCounts

    def to_status(self) -> dict[str, Any]:
        """The entry of ``status.scaleToZero``."""
        return {
            "group": self.group,
            "state": self.state.value,
            "since": rfc3339(self.since, micro=True),
            "replicas": {r: self.awake.get(r) for r in ROLES},
        }

    @classmethod
    def from_status(cls, entry: Mapping[str, Any]) -> GroupSleep | None:
        """An entry written by ``to_status``; None when it does not read."""
        try:
            since = parse_time(entry["since"])
            state = UnitState(entry["state"])
            awake = RoleCounts(**{r: int((entry.get("replicas") or {}).get(r, 0)) for r in ROLES})
            if since is None or state is UnitState.SLEEPING:
                return None
            return cls(str(entry["group"]), state, float(since), awake)
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True, slots=True)
class SleepStep:
    """The groups' states after one pass, and the events that say what changed."""

    groups: dict[str, GroupSleep]
    events: tuple[tuple[str, str], ...]  # (reason, message)

    def apply(self, plan: PlacementPlan) -> PlacementPlan:
        """``plan`` with each group's replicas as its state wants them: none while cold, those from before
        the sleep while waking."""
        groups = []
        for g in plan.groups:
            sleep = self.groups.get(g.name)
            if sleep is not None and sleep.state is UnitState.COLD:
                g = replace(g, replicas=ZERO)
            elif sleep is not None and sleep.state is UnitState.WAKING:
                g = replace(g, replicas=sleep.awake)
            groups.append(g)
        return replace(plan, groups=tuple(groups))

    def cold(self) -> set[str]:
        """The groups asleep or waking after this pass."""
        return not_awake(self.groups)


def not_awake(sleeps: Mapping[str, GroupSleep]) -> set[str]:
    """The groups of ``sleeps`` that are asleep or waking: no workers to measure or autoscale."""
    return {name for name, s in sleeps.items() if s.state is not UnitState.READY}


def step_sleep(
    groups: Sequence[GroupPlan],
    idle_after: Mapping[str, float | None],
    previous: Mapping[str, GroupSleep],
    idle: Mapping[str, bool | None],
    wake_requested: Mapping[str, float],
    ready: Mapping[str, int],
    min_instances: int,
    now: float,
) -> SleepStep:
    """One pass of scale to zero over a plan's ``groups``.

    ``idle_after``: group -> its idle time (None: never sleeps); ``previous``: the states kept in status;
    ``idle``: group -> whether its workers saw no request over its idle time (None or absent: unknown,
    so it stays awake); ``wake_requested``: group -> the latest wake request of its services;
    ``ready``: group -> ready pods; ``min_instances``: the pool's ``instances.min``, which the awake
    groups' replicas must still reach after a group sleeps."""
    out: dict[str, GroupSleep] = {}
    events: list[tuple[str, str]] = []
    awake_total = sum(
        g.replicas.total
        for g in groups
        if previous.get(g.name) is None or previous[g.name].state is UnitState.READY
    )
    for g in groups:
        after = idle_after.get(g.name)
        if after is None:
            continue
        was = previous.get(g.name) or GroupSleep(g.name, UnitState.READY, now, g.replicas)
        asked = wake_requested.get(g.name, -math.inf)
        if was.state is UnitState.READY:
            # The activator's rule (core ``should_sleep``) over what Prometheus tells: no request for the
            # window (so the last one came before it, or before the group woke), nothing held.
            quiet = idle.get(g.name) is True
            last = max(was.since, now - after) if quiet else now
            sleeps = (
                should_sleep(was.state, last, 0, 0, after, now)
                and g.replicas.total > 0
                and awake_total - g.replicas.total >= min_instances
            )
            if sleeps:
                awake_total -= g.replicas.total
                out[g.name] = GroupSleep(g.name, UnitState.COLD, now, g.replicas)
                events.append(("Slept", f"group {g.name}: no request for {after:.0f} s: scaled to zero "
                                        f"(from {g.replicas.short()})"))  # fmt: skip
            else:
                out[g.name] = replace(was, awake=g.replicas)
        elif was.state is UnitState.COLD and asked > was.since:
            out[g.name] = GroupSleep(g.name, UnitState.WAKING, now, was.awake)
            events.append(
                ("Waking", f"group {g.name}: a request is held for it: back to {was.awake.short()}")
            )
        elif was.state is UnitState.WAKING and ready.get(g.name, 0) > 0:
            out[g.name] = GroupSleep(g.name, UnitState.READY, now, was.awake)
            events.append(
                ("Woken", f"group {g.name}: {now - was.since:.0f} s from the wake request to a ready pod")
            )
        else:
            out[g.name] = was
    return SleepStep(out, tuple(events))


def service_state(
    groups: Sequence[str], sleeps: Mapping[str, GroupSleep], ready: Mapping[str, int]
) -> UnitState:
    """What ``kubectl get llms`` shows of a service on ``groups``: Ready when any of them is awake (or not
    scale-to-zero), else Waking when one wakes, else Sleeping while a cold group's pods still run, else
    Cold."""
    states = [sleeps[g].state if g in sleeps else UnitState.READY for g in groups]
    if not states or UnitState.READY in states:
        return UnitState.READY
    if UnitState.WAKING in states:
        return UnitState.WAKING
    return UnitState.SLEEPING if any(ready.get(g, 0) > 0 for g in groups) else UnitState.COLD


def wake_request(status: Mapping[str, Any] | None) -> float | None:
    """The time of the last wake request in an LLMService's status (``WAKE_FIELD``); None when absent or
    unreadable."""
    text = (status or {}).get(WAKE_FIELD)
    return parse_time(text) if isinstance(text, str) else None


def asleep_loads(
    plan: PlacementPlan | None,
    sleeps: Mapping[str, GroupSleep],
    service_bodies: Sequence[Mapping[str, Any]],
    window_s: float,
) -> dict[str, ModelLoad]:
    """A load of no request over ``window_s`` for each model of a cold or waking group of ``plan``. Its
    workers are gone, so Prometheus has no series for it, and placement would otherwise plan it on its
    declared load: a sleeping service measures nothing, and SeaLLM packs such services together."""
    if plan is None:
        return {}
    models = {
        str(b["metadata"]["name"]): str(((b.get("spec") or {}).get("model") or {}).get("name", ""))
        for b in service_bodies
    }
    asleep = [g for g in plan.groups if g.name in not_awake(sleeps)]
    step = load_step_s(window_s)
    steps = max(1, round(window_s / step))
    zero = (0.0,) * steps
    return {
        models[s]: ModelLoad(models[s], step, window_s, zero, zero, zero, zero, 0.0, 0.0, 0.0)
        for g in asleep
        for s in g.services
        if models.get(s)
    }

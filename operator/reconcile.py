"""Pure diff of desired against observed children: the create / patch / delete actions to apply.

An observed object matches when everything the operator sets is present and equal in it ("desired is
a subset of observed"): fields the API server adds (defaults, status, resourceVersion) never cause a
patch, so a second reconcile after a successful one yields no action.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Verb = Literal["create", "patch", "delete"]
# Apply order: configuration first (pods mount it), then Services, then workloads; deletions last.
_KIND_ORDER = {"ConfigMap": 0, "Service": 1, "PodDisruptionBudget": 2, "StatefulSet": 3}


@dataclass(frozen=True)
class Action:
    """One change to apply to the cluster."""

    verb: Verb
    kind: str
    name: str
    body: Mapping[str, Any] | None = None  # the desired object (create and patch)

    def describe(self) -> str:
        """Human-readable form for events and logs."""
        return f"{self.verb} {self.kind} {self.name}"


def key(obj: Mapping[str, Any]) -> tuple[str, str]:
    """(kind, name) of an object."""
    return obj["kind"], obj["metadata"]["name"]


def contains(observed: Any, desired: Any) -> bool:
    """Whether ``observed`` holds everything in ``desired``.

    Dicts: every desired key is present with a contained value. Lists: same length and element-wise
    containment (the operator owns its lists whole, so order and length matter). Scalars: equal and of
    the same type ("1" is not 1).
    """
    if isinstance(desired, Mapping):
        return isinstance(observed, Mapping) and all(
            k in observed and contains(observed[k], v) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(observed, list)
            and len(observed) == len(desired)
            and all(contains(o, d) for o, d in zip(observed, desired, strict=True))
        )
    return type(observed) is type(desired) and observed == desired


def plan_actions(desired: Iterable[Mapping[str, Any]], observed: Iterable[Mapping[str, Any]]) -> list[Action]:
    """The actions that turn ``observed`` (the children the operator owns now) into ``desired``.

    Objects being deleted (deletionTimestamp set) are left alone; one that is still desired is
    recreated by a later pass once it is gone.
    """
    wanted = {key(d): d for d in desired}
    seen = {key(o): o for o in observed}
    actions: list[Action] = []
    for k, body in wanted.items():
        current = seen.get(k)
        if current is None:
            actions.append(Action("create", k[0], k[1], body))
        elif current.get("metadata", {}).get("deletionTimestamp"):
            continue
        elif not contains(current, body):
            actions.append(Action("patch", k[0], k[1], body))
    for k, current in seen.items():
        if k not in wanted and not current.get("metadata", {}).get("deletionTimestamp"):
            actions.append(Action("delete", k[0], k[1]))

    def rank(a: Action) -> tuple[int, int, str]:
        kind_rank = _KIND_ORDER.get(a.kind, 9)
        # Deletions go workloads first, so pods never run without their configuration.
        return (1, -kind_rank, a.name) if a.verb == "delete" else (0, kind_rank, a.name)

    return sorted(actions, key=rank)

"""Pure diff of desired against observed children: the create / patch / delete actions to apply.

An observed object matches when everything the operator sets is present and equal in it ("desired is
a subset of observed"): fields the API server adds (defaults, status, resourceVersion) never cause a
patch, so a second reconcile after a successful one yields no action.

Labels select the candidates but prove nothing (anyone may copy them): an object is patched only when
its ownerReferences name the uid of the Tessera resource that owns the desired object, and deleted as
stale only when owned by the pool or marked with the pool's uid (``POOL_UID_ANNOTATION``). Any other
object in the way is a ``Conflict``, left untouched.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from tessera.control.children import POOL_UID_ANNOTATION

Verb = Literal["create", "patch", "delete"]
# The event reason of each verb done (a Normal event per child written).
DONE: dict[str, str] = {"create": "Created", "patch": "Patched", "delete": "Deleted"}
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


@dataclass(frozen=True)
class Conflict:
    """An object in the way of a desired child that the operator did not create."""

    kind: str
    name: str
    owner: str  # "<kind> <name>" of the Tessera resource the desired child belongs to
    holders: tuple[str, ...]  # "<kind> <name>" of the object's own owners, if any

    def describe(self, namespace: str) -> str:
        """What to tell the user: which object, who holds it, how to resolve it."""
        held = f"owned by {', '.join(self.holders)}" if self.holders else "not created by Tessera"
        return (
            f"{self.kind} {namespace}/{self.name} already exists and is {held}; the operator leaves it "
            f"alone: rename {self.owner} or delete that {self.kind}"
        )


def owner_uids(obj: Mapping[str, Any]) -> set[str]:
    """The uids an object's ownerReferences name."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return {str(r["uid"]) for r in refs if isinstance(r, Mapping) and r.get("uid")}


def adoptable(observed: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    """Whether the operator may patch ``observed`` into ``desired``: it is owned by the resource that
    owns ``desired``."""
    return bool(owner_uids(observed) & owner_uids(desired))


def pool_owns(obj: Mapping[str, Any], pool_uid: str) -> bool:
    """Whether the pool with ``pool_uid`` may delete ``obj``: the pool owns it or marked it as its own."""
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    return pool_uid in owner_uids(obj) or annotations.get(POOL_UID_ANNOTATION) == pool_uid


def conflict(observed: Mapping[str, Any], desired: Mapping[str, Any]) -> Conflict:
    """The ``Conflict`` of a desired child with the foreign object holding its name."""
    owners = (desired.get("metadata") or {}).get("ownerReferences") or [{}]
    refs = (observed.get("metadata") or {}).get("ownerReferences") or []
    return Conflict(
        str(desired["kind"]),
        str(desired["metadata"]["name"]),
        f"{owners[0].get('kind', '?')} {owners[0].get('name', '?')}",
        tuple(f"{r.get('kind', '?')} {r.get('name', '?')}" for r in refs if isinstance(r, Mapping)),
    )


def claim(
    desired: Iterable[Mapping[str, Any]], observed: Iterable[Mapping[str, Any]], pool_uid: str
) -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]], list[Conflict]]:
    """Split a pool's children by ownership: the desired objects the operator may create or patch, the
    observed ones it may patch or delete, and the conflicts (desired objects whose name a foreign
    object holds). Foreign objects that are not in the way are left out, never deleted."""
    wanted = {key(d): d for d in desired}
    mine: list[Mapping[str, Any]] = []
    conflicts: dict[tuple[str, str], Conflict] = {}
    for obj in observed:
        body = wanted.get(key(obj))
        if body is None:
            if pool_owns(obj, pool_uid):
                mine.append(obj)
        elif adoptable(obj, body):
            mine.append(obj)
        else:
            conflicts[key(obj)] = conflict(obj, body)
    return [d for k, d in wanted.items() if k not in conflicts], mine, list(conflicts.values())


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

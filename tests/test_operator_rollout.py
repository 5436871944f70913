"""A pool places the services it can and reports the others each on its own; a re-placement rolls out
with the least disruption (kept groups untouched, a moved service's old group serving until its new
groups are ready, the churn in an event). The controller over an in-memory cluster."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from test_operator_load_placement import NS, POOL, FakeKube, class_body, pool_body, service_body

from tessera.api.llm_service import LLMServiceStatus
from tessera.api.serving_pool import ServingPoolStatus
from tessera.control.pool_plan import CANNOT_SHARE, POOL_FULL, UNPLACEABLE, desired_pool, retiring_groups
from tessera.core.planners import GroupPlan, PlacementPlan, RoleCounts
from tessera.operator.controller import Controller

T0 = 1_700_000_000.0
Event = tuple[str, str, str, str]  # (object name, type, reason, message)


def controller(kube: FakeKube, events: list[Event]) -> Controller:
    return Controller(kube, lambda body, type_, reason, message: events.append(
        (body["metadata"]["name"], type_, reason, message)
    ))  # fmt: skip


def run_pass(c: Controller, kube: FakeKube, now: float) -> None:
    c.reconcile_pool(NS, POOL, kube.bodies("llmservices"), kube.bodies("requestclasses"), now)


def condition(kube: FakeKube, plural: str, name: str, type_: str) -> dict[str, Any]:
    status = kube.objects[(plural, name)].get("status") or {}
    return next(c for c in status.get("conditions", []) if c["type"] == type_)


def sets(kube: FakeKube) -> dict[str, dict[str, Any]]:
    """The StatefulSets by group name."""
    return {
        c["metadata"]["labels"]["tessera.dev/group"]: c
        for (kind, _), c in kube.children.items()
        if kind == "StatefulSet"
    }


def make_ready(kube: FakeKube) -> None:
    """Every StatefulSet reports all its replicas ready."""
    for sts in sets(kube).values():
        sts["status"] = {"readyReplicas": sts["spec"]["replicas"]}


def service(name: str, model: str | None = None, created: int = 0, **spec: Any) -> dict[str, Any]:
    """An LLMService of ``model`` (default: a's), ``created`` seconds after the first."""
    body = service_body("a" if model else name)
    stamp = f"2026-01-01T00:00:{created:02d}Z"
    body["metadata"].update(name=name, uid=f"svc-{name}", creationTimestamp=stamp)
    if model:
        body["spec"]["model"]["name"] = model
    body["spec"]["model"].update(spec)
    return body


def check_status(kube: FakeKube) -> None:
    """What the operator wrote fits the status models (what the CRD schema keeps)."""
    ServingPoolStatus.model_validate(kube.objects[("servingpools", POOL)]["status"])
    for (plural, _), body in kube.objects.items():
        if plural == "llmservices" and body.get("status"):
            LLMServiceStatus.model_validate(body["status"])


# -- a service the pool cannot place -------------------------------------------------------------------


def test_a_service_that_fits_no_instance_is_reported_alone_and_placed_once_fixed() -> None:
    good, bad = service("good", "org/good-8B"), service("bad", "org/bad-8B", tensorParallelSize=2)
    kube = FakeKube([pool_body(), class_body(), good, bad])
    events: list[Event] = []
    c = controller(kube, events)
    run_pass(c, kube, T0)
    assert [s["services"] for s in kube.objects[("servingpools", POOL)]["status"]["placement"]["groups"]] == [
        ["good"]
    ]
    make_ready(kube)
    run_pass(c, kube, T0 + 1)
    check_status(kube)
    assert condition(kube, "llmservices", "good", "Ready")["status"] == "True"
    placed = condition(kube, "llmservices", "bad", "Placed")
    assert (placed["status"], placed["reason"]) == ("False", UNPLACEABLE)
    assert "needs 2 GPUs per instance" in placed["message"]
    assert condition(kube, "llmservices", "bad", "Invalid")["status"] == "False"  # valid, not placeable
    assert [e[2] for e in events if e[0] == "bad"] == [UNPLACEABLE]  # one event, not one per pass
    pool = condition(kube, "servingpools", POOL, "Placed")
    assert (pool["status"], pool["reason"]) == ("True", "PartiallyPlaced") and "['bad']" in pool["message"]
    assert condition(kube, "servingpools", POOL, "Ready")["status"] == "True"
    unplaced = kube.objects[("servingpools", POOL)]["status"]["placement"]["unplaced"]
    assert [(u["name"], u["reason"]) for u in unplaced] == [("bad", UNPLACEABLE)]

    # A pass that does not re-plan keeps the reason (read back from the pool's status) and writes nothing.
    patches, writes = len(kube.status_patches), len(kube.child_writes)
    run_pass(controller(kube, events), kube, T0 + 2)
    assert (len(kube.status_patches), len(kube.child_writes)) == (patches, writes)

    kube.objects[("llmservices", "bad")]["spec"]["model"]["tensorParallelSize"] = 1
    run_pass(c, kube, T0 + 3)
    assert sorted(s for g in sets(kube).values() for s in _serves(g)) == ["bad", "good"]
    assert condition(kube, "llmservices", "bad", "Placed")["status"] == "True"
    assert condition(kube, "servingpools", POOL, "Placed")["reason"] == "Placed"
    assert kube.objects[("servingpools", POOL)]["status"]["placement"]["unplaced"] == []
    check_status(kube)


def _serves(sts: dict[str, Any]) -> list[str]:
    labels = sts["spec"]["template"]["metadata"]["labels"]
    return [k.split("/", 1)[1] for k in labels if k.startswith("serves.tessera.dev/")]


def test_a_full_pool_leaves_out_the_newest_service() -> None:
    pool = pool_body(strategy="dedicated")
    pool["spec"]["instances"] = {"min": 1, "max": 1}
    decided = desired_pool(
        pool, [service("old", "org/old-8B"), service("new", "org/new-8B", created=1)], [class_body()], None, 0
    )
    assert [g.services for g in decided.plan.groups] == [("old",)]
    assert decided.rejected["new"].reason == POOL_FULL and "['old']" in decided.rejected["new"].message
    assert decided.placement_problem is None and set(decided.services) == {"old"}


def test_services_that_cannot_share_a_group_leave_the_newest_out() -> None:
    # Two classes selected by the same header value are fine in separate pods, not in one.
    pool = pool_body()
    pool["spec"]["instances"] = {"min": 1, "max": 1}
    talk = class_body("talk")
    talk["spec"]["match"] = {"value": "chat"}
    newer = service("newer", "org/newer-8B", created=1)
    newer["spec"]["requestClasses"] = [{"name": "talk"}]
    decided = desired_pool(pool, [service("older", "org/older-8B"), newer], [class_body(), talk], None, 0)
    assert [g.services for g in decided.plan.groups] == [("older",)]
    problem = decided.rejected["newer"]
    assert problem.reason == CANNOT_SHARE and "['older']" in problem.message and "'chat'" in problem.message


def test_a_pool_wide_fault_is_the_pools_not_each_services() -> None:
    pool = pool_body()
    pool["metadata"]["annotations"] = {"tessera.dev/engine": "nope"}
    decided = desired_pool(
        pool, [service("a", "org/a-8B"), service("b", "org/b-8B")], [class_body()], None, 0
    )
    assert decided.rejected == {} and "use 'vllm' or 'sim'" in (decided.placement_problem or "")


# -- least-disruption roll-out -------------------------------------------------------------------------


def rollout_cluster(**placement: Any) -> tuple[FakeKube, Controller, list[Event]]:
    """Two GPUs, three 8B models: a shares one group with b and one with c; all ready."""
    pool = pool_body(**placement)
    pool["spec"]["instances"] = {"min": 1, "max": 2}
    kube = FakeKube([pool, class_body(), *(service(n, f"org/{n}-8B") for n in "abc")])
    events: list[Event] = []
    c = controller(kube, events)
    run_pass(c, kube, T0)
    assert sorted(tuple(_serves(s)) for s in sets(kube).values()) == [("a", "b"), ("a", "c")]
    placed = condition(kube, "servingpools", POOL, "Placed")["message"]
    assert "the estimate assumes SeaLLM's sharing across their models, which the pods do not run" in placed
    make_ready(kube)
    run_pass(c, kube, T0 + 1)
    events.clear()
    return kube, c, events


def test_a_replan_keeps_the_unchanged_group_and_drains_the_old_one_only_once_the_new_one_is_ready() -> None:
    kube, c, events = rollout_cluster()
    before = copy.deepcopy(kube.children)
    groups = {tuple(_serves(s)): g for g, s in sets(kube).items()}
    kept, old = groups[("a", "c")], groups[("a", "b")]
    # b's new revision is three times the size: it no longer fits beside a.
    kube.objects[("llmservices", "b")]["spec"]["model"]["weightsSize"] = "60Gi"
    kube.child_writes.clear()
    run_pass(c, kube, T0 + 10)
    now = {tuple(_serves(s)): g for g, s in sets(kube).items()}
    assert set(now) == {("a", "b"), ("a", "c"), ("b",)}
    new = now[("b",)]
    # The kept group: the same objects, byte for byte, and not a single write.
    for key, obj in before.items():
        if kept in obj["metadata"]["name"]:
            assert kube.children[key] == obj
    assert not [w for w in kube.child_writes if kept in w]
    assert all(("create" in w and new in w) or "Service b" in w for w in kube.child_writes), kube.child_writes
    # The old group serves a and b until b's new group is ready.
    assert all(obj == kube.children[key] for key, obj in before.items() if old in obj["metadata"]["name"])
    status = kube.objects[("servingpools", POOL)]["status"]
    assert [g["name"] for g in status["placement"]["groups"]] == sorted([kept, new])
    (retiring,) = status["placement"]["retiring"]
    assert (retiring["name"], retiring["services"], retiring["waitingFor"]) == (old, ["a", "b"], [new])
    (rollout,) = [m for _, _, reason, m in events if reason == "Rollout"]
    assert f"groups kept ['{kept}'], created ['{new}'], retiring ['{old}']" in rollout
    assert "services moved ['a', 'b']" in rollout and f"{old} serves ['a', 'b'] until ['{new}']" in rollout
    ready = condition(kube, "llmservices", "b", "Ready")
    assert ready["status"] == "True" and "1 in groups of the previous placement" in ready["message"]
    check_status(kube)
    assert c.due(NS, POOL, T0 + 16)  # the handover is polled, not left to the resync

    run_pass(c, kube, T0 + 20)  # still starting: nothing moves
    assert old in sets(kube)
    sts = sets(kube)[new]
    sts["status"] = {"readyReplicas": sts["spec"]["replicas"]}
    run_pass(c, kube, T0 + 25)
    assert set(sets(kube)) == {kept, new}
    assert not [k for k, o in kube.children.items() if old in o["metadata"]["name"]]
    assert ("Retired" in [e[2] for e in events]) and not c.due(NS, POOL, T0 + 31)
    assert kube.objects[("servingpools", POOL)]["status"]["placement"]["retiring"] == []
    for key, obj in before.items():
        if kept in obj["metadata"]["name"]:
            assert kube.children[key] == obj
    check_status(kube)


@pytest.mark.parametrize("timeout", [0, 30])
def test_the_old_group_goes_after_the_handover_timeout_when_the_new_one_never_becomes_ready(
    timeout: int,
) -> None:
    kube, c, events = rollout_cluster(handoverTimeoutSeconds=timeout)
    old = next(g for g, s in sets(kube).items() if _serves(s) == ["a", "b"])
    kube.objects[("llmservices", "b")]["spec"]["model"]["weightsSize"] = "60Gi"
    run_pass(c, kube, T0 + 10)
    assert (old in sets(kube)) == (timeout > 0)
    run_pass(c, kube, T0 + 10 + timeout)
    assert old not in sets(kube)
    if timeout:
        (warning,) = [m for _, kind, reason, m in events if reason == "HandoverTimedOut"]
        assert old in warning and f"({timeout} s)" in warning


def observed_set(group: str, services: list[str], replicas: int, ready: int) -> dict[str, Any]:
    labels = {f"serves.tessera.dev/{s}": "true" for s in services}
    return {
        "kind": "StatefulSet",
        "metadata": {"name": f"p-{group}", "labels": {"tessera.dev/group": group}},
        "spec": {"replicas": replicas, "template": {"metadata": {"labels": labels}}},
        "status": {"readyReplicas": ready},
    }


def test_an_old_group_waits_only_for_the_groups_taking_over_its_services_that_are_still_in_the_pool() -> None:
    plan = PlacementPlan(
        "seallm",
        (
            GroupPlan("g-a", ("a",), 1, RoleCounts(interactive=2)),
            GroupPlan("g-c", ("c",), 1, RoleCounts(interactive=1)),
        ),
    )
    observed = [
        observed_set("g-a", ["a"], 2, 1),  # one of two ready
        observed_set("g-c", ["c"], 1, 1),
        observed_set("g-ab", ["a", "b"], 1, 1),  # a moves to g-a, b left the pool
        observed_set("g-bc", ["b", "c"], 1, 1),  # c's new group is ready
        observed_set("g-b", ["b"], 1, 1),  # nothing of it is in the pool any more
    ]
    found = {r.group: r for r in retiring_groups(plan, observed, {"g-ab": 100.0}, 130.0, 60)}
    assert set(found) == {"g-ab", "g-bc", "g-b"}
    assert found["g-ab"].held and found["g-ab"].waiting_for == ("g-a",) and found["g-ab"].since == 100.0
    assert not found["g-bc"].held and not found["g-b"].held and found["g-b"].since == 130.0
    later = {r.group: r for r in retiring_groups(plan, observed, {"g-ab": 100.0}, 160.0, 60)}
    assert later["g-ab"].timed_out and not later["g-ab"].held

"""Unit tests of the operator's pure parts: child builders, the diff, status bookkeeping, the pool
decision, Prometheus result parsing and the kube adapter's retries."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tessera.api import parse_quantity
from tessera.control.metrics_queries import (
    attainment_from_results,
    group_queries,
    role_of,
    snapshot_from_results,
)
from tessera.control.pool_plan import INVALID_SPEC, Problem, desired_pool, inputs_fingerprint
from tessera.core.planners import GroupPlan, RoleCounts
from tessera.operator.kube import Kube, OwnershipError, backoff_delays
from tessera.operator.reconcile import Action, contains, plan_actions
from tessera.operator.status import append_history, plan_from_status, plan_to_status, set_condition

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example(name: str) -> dict[str, list[dict[str, Any]]]:
    docs = [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]
    for i, doc in enumerate(docs):
        doc["metadata"].update(namespace="ns", uid=f"uid-{i}")
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    return by_kind


def decide(docs: dict[str, list[dict[str, Any]]], **kwargs: Any):
    return desired_pool(
        docs["ServingPool"][0],
        docs["LLMService"],
        docs["RequestClass"],
        kwargs.pop("previous", None),
        0.0,
        **kwargs,
    )


# -- children ---------------------------------------------------------------------------------------


def test_quickstart_children_carry_owner_gpu_requests_scheduling_and_config() -> None:
    docs = example("quickstart.yaml")
    decided = decide(docs)
    kinds = sorted((c["kind"], c["metadata"]["name"]) for c in decided.children)
    group = decided.plan.groups[0].name
    assert kinds == [
        ("ConfigMap", f"h100-pool-{group}-worker"),
        ("PodDisruptionBudget", f"h100-pool-{group}"),
        ("Service", f"h100-pool-{group}"),
        ("Service", "llama-8b"),
        ("StatefulSet", f"h100-pool-{group}"),
    ]
    sts = next(c for c in decided.children if c["kind"] == "StatefulSet")
    assert sts["metadata"]["ownerReferences"][0]["uid"] == docs["ServingPool"][0]["metadata"]["uid"]
    pod = sts["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    vllm = pod["containers"][1]
    assert vllm["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert "--enable-prefix-caching" in vllm["args"] and "--max-model-len" in vllm["args"]
    endpoint = next(c for c in decided.children if c["metadata"]["name"] == "llama-8b")
    assert endpoint["metadata"]["ownerReferences"][0]["uid"] == docs["LLMService"][0]["metadata"]["uid"]
    assert endpoint["spec"]["selector"] == {
        "tessera.dev/pool": "h100-pool",
        "serves.tessera.dev/llama-8b": "true",
    }
    assert sts["spec"]["template"]["metadata"]["labels"]["serves.tessera.dev/llama-8b"] == "true"
    config = next(c for c in decided.children if c["kind"] == "ConfigMap")
    worker = yaml.safe_load(config["data"]["worker.json"])
    assert worker["scheduling"]["policy"] == "qlm"  # auto with a batch class
    assert set(worker["classes"]) == {"chat", "offline"}


def test_child_without_owner_uid_is_refused() -> None:
    docs = example("quickstart.yaml")
    del docs["ServingPool"][0]["metadata"]["uid"]
    decided = decide(docs)
    assert decided.children == [] and "uid" in decided.placement_problem


# -- diff -------------------------------------------------------------------------------------------


def test_contains_ignores_server_fields_but_not_changes() -> None:
    desired = {"spec": {"replicas": 2, "ports": [{"port": 80}]}}
    observed = {"spec": {"replicas": 2, "ports": [{"port": 80, "protocol": "TCP"}]}, "status": {"x": 1}}
    assert contains(observed, desired)
    assert not contains({"spec": {"replicas": 3, "ports": [{"port": 80}]}}, desired)
    assert not contains({"spec": {"replicas": "2", "ports": [{"port": 80}]}}, desired)
    assert not contains({"spec": {"replicas": 2, "ports": [{"port": 80}, {"port": 81}]}}, desired)


def test_plan_actions_creates_patches_deletes_and_second_pass_is_empty() -> None:
    decided = decide(example("quickstart.yaml"))
    first = plan_actions(decided.children, [])
    assert [a.verb for a in first] == ["create"] * 5
    assert first[0].kind == "ConfigMap" and first[-1].kind == "StatefulSet"
    observed = copy.deepcopy(decided.children)
    for obj in observed:
        obj["metadata"]["resourceVersion"] = "7"  # server-set fields do not matter
    assert plan_actions(decided.children, observed) == []
    sts = next(o for o in observed if o["kind"] == "StatefulSet")
    sts["spec"]["replicas"] = 1
    stray = {"kind": "ConfigMap", "metadata": {"name": "old"}}
    actions = plan_actions(decided.children, [*observed, stray])
    assert [(a.verb, a.kind) for a in actions] == [("patch", "StatefulSet"), ("delete", "ConfigMap")]


# -- status -----------------------------------------------------------------------------------------


def test_condition_transition_time_moves_only_on_status_change() -> None:
    conditions = set_condition([], "Ready", False, "NotYet", "0/1", now=100.0)
    same = set_condition(conditions, "Ready", False, "NotYet", "0/1 still", now=200.0)
    assert same[0]["lastTransitionTime"] == conditions[0]["lastTransitionTime"]
    flipped = set_condition(same, "Ready", True, "Ok", "1/1", now=300.0)
    assert (
        flipped[0]["lastTransitionTime"] != same[0]["lastTransitionTime"] and flipped[0]["status"] == "True"
    )


def test_scaling_history_is_capped_oldest_first() -> None:
    history = append_history([{"i": i} for i in range(5)], [{"i": 5}, {"i": 6}], limit=4)
    assert [h["i"] for h in history] == [3, 4, 5, 6]


def test_plan_round_trips_through_status() -> None:
    plan = decide(example("multi-model.yaml")).plan
    assert plan_from_status(plan_to_status(plan, {})).groups == plan.groups
    # each pod keeps its role: a batch pod at ordinal 0 stays batch when an interactive one is added
    group = replace(
        plan.groups[0], replicas=RoleCounts(interactive=1, batch=1), roles=("batch", "interactive")
    )
    scaled = replace(group, replicas=RoleCounts(interactive=2, batch=1))
    assert scaled.roles == ("batch", "interactive", "interactive")
    back = plan_from_status(plan_to_status(replace(plan, groups=(scaled,)), {}))
    assert back is not None and back.groups == (scaled,)
    assert plan_from_status({"strategy": "x", "groups": [{"services": []}]}) is None
    bad = plan_to_status(plan, {})
    bad["groups"][0]["roles"] = ["interactive", "gpu"]
    assert plan_from_status(bad) is None


# -- pool decisions ---------------------------------------------------------------------------------


def test_invalid_pool_is_a_problem_and_nothing_is_built() -> None:
    docs = example("quickstart.yaml")
    docs["ServingPool"][0]["spec"]["instances"] = {"min": 3, "max": 1}
    result = decide(docs)
    assert isinstance(result, Problem) and result.reason == INVALID_SPEC and "min" in result.message


def test_service_with_missing_class_is_rejected_not_placed() -> None:
    docs = example("multi-model.yaml")
    docs["RequestClass"] = [c for c in docs["RequestClass"] if c["metadata"]["name"] != "assistant"]
    decided = decide(docs)
    assert set(decided.rejected) == {"mistral-7b", "qwen-7b"}
    assert {s for g in decided.plan.groups for s in g.services} == {"llama-8b"}


def test_autoscaled_counts_survive_a_replan_within_bounds_and_bounds_win() -> None:
    docs = example("quickstart.yaml")
    plan = decide(docs).plan
    scaled = type(plan)(
        strategy=plan.strategy,
        groups=tuple(
            type(g)(g.name, g.services, g.tp, RoleCounts(interactive=1, mixed=1)) for g in plan.groups
        ),
    )
    kept = decide(docs, previous=scaled).plan
    assert kept.groups[0].replicas == RoleCounts(interactive=1, mixed=1)
    docs["ServingPool"][0]["spec"]["instances"] = {"min": 3, "max": 4}
    assert decide(docs, previous=scaled).plan.groups[0].replicas.total == 3


def test_fingerprint_changes_with_specs_only() -> None:
    docs = example("quickstart.yaml")
    before = inputs_fingerprint(docs["ServingPool"][0], docs["LLMService"], docs["RequestClass"])
    docs["ServingPool"][0]["status"] = {"replicas": 9}
    assert inputs_fingerprint(docs["ServingPool"][0], docs["LLMService"], docs["RequestClass"]) == before
    docs["LLMService"][0]["spec"]["replicas"]["max"] = 3
    assert inputs_fingerprint(docs["ServingPool"][0], docs["LLMService"], docs["RequestClass"]) != before


# -- metrics ----------------------------------------------------------------------------------------


def _sample(value: float, **labels: str) -> dict[str, Any]:
    return {"metric": labels, "value": [0, str(value)]}


def test_roles_follow_pod_ordinals() -> None:
    roles = ("batch", "interactive", "interactive", "mixed")
    assert [role_of(i, roles) for i in range(5)] == ["batch", "interactive", "interactive", "mixed", None]


def test_snapshot_from_prometheus_results() -> None:
    group = GroupPlan("g", ("svc",), 1, RoleCounts(interactive=2, mixed=1, batch=1))
    queries = group_queries("ns", "p", "g", {"chat": "interactive", "offline": "batch"}, "2m")
    assert 'class=~"chat"' in queries["interactive_inflight"] and 'group="g"' in queries["up"]
    results = {
        "up": [
            _sample(1, pod="p-g-0"),
            _sample(1, pod="p-g-1"),
            _sample(0, pod="p-g-2"),
            _sample(1, pod="p-g-3"),
        ],
        # the batch pod's interactive request is not interactive capacity in use
        "interactive_inflight": [_sample(3, pod="p-g-0"), _sample(0, pod="p-g-1"), _sample(1, pod="p-g-3")],
        "interactive_queued": [_sample(2)],
        "batch_queued": [_sample(40, **{"class": "offline"})],
        "batch_running": [_sample(5)],
        "batch_tokens": [_sample(0)],
        "interactive_rate": [_sample(4.5)],
    }
    assert "tessera_ttft_seconds_count{" in queries["interactive_rate"]
    assert 'class=~"chat"' in queries["interactive_rate"]
    snap = snapshot_from_results(results, group, {"offline": 600.0}, now=1000.0)
    assert snap is not None and snap.interactive_arrival_rps == 4.5
    unmeasured = snapshot_from_results({**results, "interactive_rate": []}, group, {}, 0.0)
    assert unmeasured is not None and unmeasured.interactive_arrival_rps is None
    assert snap.ready == RoleCounts(interactive=2, batch=1) and snap.pending == RoleCounts(mixed=1)
    assert snap.instances_with_interactive == 1 and snap.interactive_queued == 2
    assert snap.batch_queue[0].count == 40 and snap.batch_queue[0].deadline == 1600.0
    assert snap.batch_running == 5 and snap.batch_tokens_per_s is None
    assert snapshot_from_results({"up": []}, group, {}, 0.0) is None


def test_what_the_router_holds_counts_as_the_groups_queued_work() -> None:
    group = GroupPlan("g", ("svc",), 1, RoleCounts(interactive=1))
    kinds = {"chat-fast": "interactive", "offline": "batch", "bulk.jobs": "batch"}
    queries = group_queries("ns", "p", "g", kinds, "2m", ("Qwen/Qwen2.5-0.5B-Instruct",))
    # PromQL strings refuse re.escape's \- and \.: the backslashes themselves are escaped
    assert r'model=~"Qwen/Qwen2\\.5\\-0\\.5B\\-Instruct"' in queries["held"]
    assert r'class=~"bulk\\.jobs|chat\\-fast|offline"' in queries["held"]
    assert "tessera_router_chiron_held_requests{" in queries["held"]
    assert group_queries("ns", "p", "g", kinds, "2m")["held"].count('model=~"$^"') == 1
    results = {
        "up": [_sample(1, pod="p-g-0")],
        "interactive_queued": [_sample(2)],
        "batch_queued": [_sample(3, **{"class": "offline"})],
        "held": [
            _sample(40, **{"class": "offline"}),
            _sample(7, **{"class": "bulk.jobs"}),
            _sample(5, **{"class": "chat-fast"}),
        ],
    }
    snap = snapshot_from_results(results, group, {"offline": 600.0, "bulk.jobs": 60.0}, now=1000.0)
    assert snap is not None
    assert sorted((g.count, g.deadline) for g in snap.batch_queue) == [(7, 1060.0), (43, 1600.0)]
    assert snap.interactive_queued == 2 + 5  # the workers' queues and the router's hold


def test_the_batch_components_unsent_lines_are_one_more_group_due_at_their_expiry() -> None:
    group = GroupPlan("g", ("svc",), 1, RoleCounts(interactive=1))
    kinds = {"chat": "interactive", "offline": "batch"}
    queries = group_queries("ns", "p", "g", kinds, "2m", ("m",))
    jobs = 'model=~"m",class=~"offline"'
    assert queries["batch_pending"] == f"sum by (class) (tessera_batch_pending_lines{{{jobs}}})"
    assert queries["batch_pending_left"].endswith(" - time()")
    results = {
        "up": [_sample(1, pod="p-g-0")],
        "held": [_sample(40, **{"class": "offline"})],
        "batch_pending": [_sample(1960, **{"class": "offline"}), _sample(0, **{"class": "chat"})],
        "batch_pending_left": [_sample(215, **{"class": "offline"})],
        "batch_output_mean": [_sample(200)],
        "batch_output_std": [_sample(12)],
    }
    snap = snapshot_from_results(results, group, {"offline": 600.0}, now=1000.0)
    assert snap is not None
    assert sorted((g.count, g.deadline) for g in snap.batch_queue) == [(40, 1600.0), (1960, 1215.0)]
    assert (snap.mean_output_tokens, snap.std_output_tokens) == (200.0, 12.0)
    bare = snapshot_from_results({"up": results["up"]}, group, {"offline": 600.0}, now=1000.0)
    assert bare is not None and bare.mean_output_tokens is None and bare.batch_queue == ()


def test_attainment_from_prometheus_results() -> None:
    rows = attainment_from_results(
        {
            "met": [_sample(9, **{"class": "chat"})],
            "missed": [_sample(1, **{"class": "chat"}), _sample(0, **{"class": "idle"})],
            "p99_ttft": [_sample(0.8, **{"class": "chat"})],
            "itl_sum": [_sample(2.0, **{"class": "chat"})],
            "itl_count": [_sample(40, **{"class": "chat"})],
        }
    )
    assert rows == [
        {"name": "chat", "attainment": 0.9, "requests": 10, "p99TtftSeconds": 0.8, "meanItlSeconds": 0.05}
    ]


# -- kube adapter -----------------------------------------------------------------------------------


def test_backoff_is_exponential_and_capped() -> None:
    assert backoff_delays(6, base_s=0.5, cap_s=3.0) == [0.5, 1.0, 2.0, 3.0, 3.0]


class _Flaky:
    """Raises the given API errors in turn, then succeeds."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = statuses
        self.calls = 0

    def __call__(self, **_: Any) -> Any:
        self.calls += 1
        if self.statuses:
            raise client.ApiException(status=self.statuses.pop(0))
        return type("R", (), {"data": b"{}"})()


@pytest.mark.parametrize("statuses", [[409], [429, 503], [500, 500, 500]])
def test_transient_errors_are_retried(statuses: list[int]) -> None:
    sleeps: list[float] = []
    kube = Kube(client.ApiClient(), attempts=5, sleep=sleeps.append)
    flaky = _Flaky(list(statuses))
    kube.core.patch_namespaced_config_map = flaky
    kube.patch_child("ns", "ConfigMap", "c", {"data": {}})
    assert flaky.calls == len(statuses) + 1 and len(sleeps) == len(statuses)


OURS = {"name": "c", "ownerReferences": [{"kind": "ServingPool", "name": "p", "uid": "u1"}]}


def _reads(obj: dict[str, Any] | None) -> Any:
    """A read call answering ``obj`` (404 when None)."""

    def read(**_: Any) -> Any:
        if obj is None:
            raise client.ApiException(status=404)
        return type("R", (), {"data": json.dumps(obj).encode()})()

    return read


def test_permanent_errors_raise_and_create_conflict_becomes_patch() -> None:
    kube = Kube(client.ApiClient(), attempts=3, sleep=lambda _: None)
    kube.core.patch_namespaced_config_map = _Flaky([422])
    with pytest.raises(client.ApiException):
        kube.patch_child("ns", "ConfigMap", "c", {})
    kube.core.create_namespaced_config_map = _Flaky([409])
    kube.core.read_namespaced_config_map = _reads({"metadata": OURS})
    patched = _Flaky([])
    kube.core.patch_namespaced_config_map = patched
    kube.apply("ns", Action("create", "ConfigMap", "c", {"kind": "ConfigMap", "metadata": OURS}))
    assert patched.calls == 1


def test_create_conflict_with_a_foreign_object_patches_nothing() -> None:
    """A 409 on create is patched only when the existing object is owned by the desired one's owner."""
    kube = Kube(client.ApiClient(), attempts=3, sleep=lambda _: None)
    patched = _Flaky([])
    kube.core.patch_namespaced_service = patched
    body = {"kind": "Service", "metadata": {**OURS, "name": "kubernetes"}}
    for foreign in ({"name": "kubernetes"}, {**OURS, "ownerReferences": [{"kind": "X", "uid": "u2"}]}):
        kube.core.create_namespaced_service = _Flaky([409])
        kube.core.read_namespaced_service = _reads({"metadata": foreign})
        with pytest.raises(OwnershipError) as raised:
            kube.apply("ns", Action("create", "Service", "kubernetes", body))
        assert "Service ns/kubernetes already exists" in raised.value.conflict.describe("ns")
    assert patched.calls == 0


def test_a_child_deleted_between_create_and_patch_is_created() -> None:
    """Another pool's pass may delete an object (a moved service's endpoint) after this one met it."""
    kube = Kube(client.ApiClient(), attempts=3, sleep=lambda _: None)
    created = _Flaky([409])
    kube.core.create_namespaced_service = created
    kube.core.read_namespaced_service = _reads(None)
    kube.core.patch_namespaced_service = _Flaky([404])
    kube.apply("ns", Action("create", "Service", "s", {"kind": "Service", "metadata": {"name": "s"}}))
    assert created.calls == 2


def test_claim_adopts_owned_objects_and_never_touches_foreign_ones() -> None:
    """Labels prove nothing: a stale child is deleted only when the pool owns or marked it, and a
    desired child whose name a foreign object holds is a conflict, neither created nor patched."""
    from tessera.control.children import POOL_UID_ANNOTATION
    from tessera.operator.reconcile import claim

    def obj(kind: str, name: str, uids: list[str], pool_uid: str | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "name": name,
            "ownerReferences": [{"kind": "K", "name": "o", "uid": u} for u in uids],
        }
        if pool_uid:
            meta["annotations"] = {POOL_UID_ANNOTATION: pool_uid}
        return {"kind": kind, "metadata": meta}

    desired = [obj("Service", "kubernetes", ["svc"]), obj("ConfigMap", "p-g0-worker", ["pool"])]
    observed = [
        obj("Service", "kubernetes", []),  # the cluster's own, in the way
        obj("ConfigMap", "p-g0-worker", ["pool"]),  # ours: patched if it differs
        obj("ConfigMap", "labelled", []),  # foreign with our labels: left alone
        obj("Service", "old-endpoint", ["gone-svc"], "pool"),  # a deleted service's endpoint we marked
        obj("Service", "other-pool-endpoint", ["svc2"], "other"),
    ]
    wanted, mine, conflicts = claim(desired, observed, "pool")
    assert [d["metadata"]["name"] for d in wanted] == ["p-g0-worker"]
    assert [o["metadata"]["name"] for o in mine] == ["p-g0-worker", "old-endpoint"]
    assert [(c.kind, c.name) for c in conflicts] == [("Service", "kubernetes")]
    actions = plan_actions(wanted, mine)
    assert [(a.verb, a.name) for a in actions] == [("delete", "old-endpoint")]


async def test_marks_before_a_pool_wakes_cost_one_pass_and_other_pools_are_not_held_up() -> None:
    """A burst of marks for one pool wakes its daemon once; an unmarked pool's wait runs out, and a
    stopping daemon wakes at once."""
    import asyncio

    from tessera.operator.handlers import PoolMarks

    class Stopper:
        def __init__(self) -> None:
            self.flag = asyncio.Event()

        async def wait(self) -> None:
            await self.flag.wait()

    marks, stopped = PoolMarks(), Stopper()
    for _ in range(3):
        marks.mark("ns", "p")
    assert await marks.take(("ns", "p"), 5.0, stopped) is True  # type: ignore[arg-type]
    assert await marks.take(("ns", "p"), 0.05, stopped) is False  # type: ignore[arg-type]
    assert await marks.take(("ns", "other"), 0.05, stopped) is False  # type: ignore[arg-type]
    waiting = asyncio.create_task(marks.take(("ns", "p"), 5.0, stopped))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    marks.mark("ns", "p")
    assert await asyncio.wait_for(waiting, 1.0) is True
    waiting = asyncio.create_task(marks.take(("ns", "p"), 5.0, stopped))  # type: ignore[arg-type]
    stopped.flag.set()
    assert await asyncio.wait_for(waiting, 1.0) is False


def test_pool_inputs_are_the_pools_services_and_the_classes_they_name() -> None:
    from tessera.operator.handlers import class_refs, pool_inputs

    def service(name: str, pool: str, classes: list[str]) -> dict[str, Any]:
        return {
            "metadata": {"name": name},
            "spec": {"poolRef": {"name": pool}, "requestClasses": [{"name": c} for c in classes]},
        }

    by_pool = {("ns", "a"): [service("s1", "a", ["chat", "batch"]), service("s2", "a", ["chat"])]}
    by_name = {("ns", c): [{"metadata": {"name": c}}] for c in ("chat", "batch", "unused")}
    services, classes = pool_inputs("ns", "a", by_pool, by_name)
    assert [s["metadata"]["name"] for s in services] == ["s1", "s2"]
    assert [c["metadata"]["name"] for c in classes] == ["batch", "chat"]
    assert pool_inputs("ns", "b", by_pool, by_name) == ([], [])
    assert class_refs({"spec": {"requestClasses": [{"name": "x"}, "junk", {"name": 3}]}}) == ["x"]
    assert class_refs({"spec": None}) == []


# -- planner inputs -------------------------------------------------------------------------------


def _pool_and_service(gpu: str, model: dict[str, Any]) -> tuple[Any, Any]:
    from tessera.control.pool_plan import parse

    docs = example("quickstart.yaml")
    pool = copy.deepcopy(docs["ServingPool"][0])
    pool["spec"]["gpu"]["type"] = gpu
    service = copy.deepcopy(docs["LLMService"][0])
    service["spec"]["model"] = model
    return parse(pool), parse(service)


@pytest.mark.parametrize(
    ("gpu", "model", "expected"),
    [
        ("H100", {"name": "meta-llama/Llama-3.1-8B-Instruct", "weightsSize": "16Gi"}, "h100-llama3-8b"),
        ("NVIDIA-A100-SXM4-80GB", {"name": "lmsys/vicuna-13b-v1.5"}, "a100-vicuna-13b"),
        ("h100-80gb", {"name": "Qwen/Qwen2.5-7B-Instruct"}, "h100-llama3-8b"),
        ("H100", {"name": "big", "weightsSize": "140G", "tensorParallelSize": 4}, "h100-llama-70b-tp4"),
        ("L4", {"name": "meta-llama/Llama-3.1-8B-Instruct"}, None),  # no L4 profile
        ("H100", {"name": "meta-llama/Llama-3.2-3B-Instruct"}, None),  # no 3B profile
        ("H100", {"name": "my-model"}, None),  # size unknown
    ],
)
def test_planner_inputs_use_the_matching_sim_profile_else_the_fallback(
    gpu: str, model: dict[str, Any], expected: str | None
) -> None:
    from tessera.control.inputs import FALLBACK_PROFILE, named_profile, service_input
    from tessera.core.profiles import PROFILES

    pool, service = _pool_and_service(gpu, model)
    matched = named_profile(pool, service)
    assert (matched.name if matched else None) == expected
    profile = PROFILES[expected or FALLBACK_PROFILE]
    planned = service_input(pool, service)
    assert planned.profile is profile
    assert planned.kv_bytes_per_token == profile.kv_bytes_per_token
    # Weights: the service's own size when given, else the profile's.
    size = service.spec.model.weights_size
    assert planned.weights_bytes == (int(parse_quantity(size)) if size else profile.weights_bytes)


def test_the_placement_status_says_how_each_group_shares_its_accelerator() -> None:
    """One model: single; several on the vLLM engine (sleep mode on GPUs): swapping; several on the sim
    engine, which never sleeps: co-resident. The mode is the one the pods and the estimator run."""
    from tessera.api import ServingPool
    from tessera.core.planners import GroupPlan, PlacementPlan, RoleCounts
    from tessera.operator.status import plan_to_status, sharing_modes

    groups = (
        GroupPlan("g1", ("a",), 1, RoleCounts(mixed=1)),
        GroupPlan("g2", ("b", "c"), 1, RoleCounts(mixed=1)),
    )
    plan = PlacementPlan("seallm", groups)
    spec = {"gpu": {"type": "H100", "memory": "80Gi"}, "instances": {"min": 1, "max": 2}}
    body = {"metadata": {"name": "p"}, "spec": spec}
    vllm = ServingPool.model_validate(body)
    sim = ServingPool.model_validate(
        {**body, "metadata": {"name": "p", "annotations": {"tessera.dev/engine": "sim"}}}
    )
    assert sharing_modes(vllm, plan) == {"g1": "single", "g2": "swapping"}
    assert sharing_modes(sim, plan) == {"g1": "single", "g2": "co-resident"}
    status = plan_to_status(plan, {}, None, sharing_modes(sim, plan))
    assert [g["sharing"] for g in status["groups"]] == ["single", "co-resident"]

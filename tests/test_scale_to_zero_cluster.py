"""Scale to zero on a cluster, piece by piece: the operator's sleep and wake decisions
(``tessera.control.scale_to_zero``), the idleness read from Prometheus, the group ConfigMap that tells the
router, discovery of cold groups and the activator following them."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from tessera.api.loader import load_documents
from tessera.control.children import desired_children, read_group_config_map
from tessera.control.metrics_queries import idle_from_results, idle_queries
from tessera.control.pool_plan import desired_pool
from tessera.control.scale_to_zero import GroupSleep, service_state, step_sleep, wake_request
from tessera.core.activation import IdlePolicy, UnitState
from tessera.core.planners import GroupPlan, RoleCounts
from tessera.router.activator import Activator
from tessera.router.discovery import backends_from_cluster

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TWO = RoleCounts(mixed=2)


def group(name: str = "g", replicas: RoleCounts = TWO) -> GroupPlan:
    return GroupPlan(name=name, services=(name,), tp=1, replicas=replicas)


def step(prev: dict[str, GroupSleep], now: float, **kw: object) -> object:
    args = {"idle_after": {"g": 10.0}, "idle": {}, "wake_requested": {}, "ready": {}, "min_instances": 0}
    args.update(kw)
    return step_sleep([group()], previous=prev, now=now, **args)  # type: ignore[arg-type]


def test_a_group_sleeps_only_when_idle_for_its_whole_idle_time_and_keeps_its_replicas_for_the_wake() -> None:
    first = step({}, 100.0, idle={"g": True})
    assert first.groups["g"] == GroupSleep("g", UnitState.READY, 100.0, TWO)  # awake since now: not yet
    assert step(first.groups, 105.0, idle={"g": True}).groups["g"].state is UnitState.READY
    assert step(first.groups, 110.0, idle={"g": None}).groups["g"].state is UnitState.READY  # unknown
    assert step(first.groups, 110.0, idle={"g": False}).groups["g"].state is UnitState.READY
    slept = step(first.groups, 110.0, idle={"g": True})
    assert slept.groups["g"] == GroupSleep("g", UnitState.COLD, 110.0, TWO)
    assert [r for r, _ in slept.events] == ["Slept"]
    (zero,) = slept.apply(replace_plan([group()])).groups
    assert zero.replicas.total == 0 and slept.cold() == {"g"}
    # A group never sleeps below the pool's instances.min, nor without a policy.
    assert step(first.groups, 110.0, idle={"g": True}, min_instances=1).groups["g"].state is UnitState.READY
    assert step(first.groups, 110.0, idle={"g": True}, idle_after={"g": None}).groups == {}


def test_a_wake_request_after_the_sleep_restores_the_replicas_and_a_ready_pod_ends_the_wake() -> None:
    cold = {"g": GroupSleep("g", UnitState.COLD, 200.0, TWO)}
    assert step(cold, 210.0, wake_requested={"g": 199.0}).groups["g"].state is UnitState.COLD  # older
    waking = step(cold, 210.0, wake_requested={"g": 200.5})
    assert waking.groups["g"] == GroupSleep("g", UnitState.WAKING, 210.0, TWO)
    (restored,) = waking.apply(replace_plan([group(replicas=RoleCounts())])).groups
    assert restored.replicas == TWO
    assert step(waking.groups, 215.0, ready={"g": 0}).groups["g"].state is UnitState.WAKING
    woken = step(waking.groups, 230.0, ready={"g": 1})
    assert woken.groups["g"] == GroupSleep("g", UnitState.READY, 230.0, TWO)
    assert [r for r, _ in woken.events] == ["Woken"]


def test_states_round_trip_through_status_and_the_service_state_reads_its_groups() -> None:
    entry = GroupSleep("g", UnitState.WAKING, 1_700_000_000.25, TWO)
    assert GroupSleep.from_status(entry.to_status()) == entry
    assert GroupSleep.from_status({"group": "g", "state": "Asleep", "since": "x"}) is None
    assert wake_request({"wakeRequestedAt": "2026-11-28T01:00:00.500000Z"}) == 1_795_827_600.5
    assert wake_request({}) is None and wake_request({"wakeRequestedAt": "soon"}) is None
    cold = {"g": GroupSleep("g", UnitState.COLD, 0.0, TWO)}
    assert service_state(["g"], cold, {"g": 1}) is UnitState.SLEEPING  # its pods still stop
    assert service_state(["g"], cold, {}) is UnitState.COLD
    assert service_state(["g", "h"], cold, {}) is UnitState.READY  # served by another group
    assert service_state(["g"], {"g": replace(cold["g"], state=UnitState.WAKING)}, {}) is UnitState.WAKING


def test_idleness_is_unknown_unless_the_workers_were_scraped_now_and_at_the_window_start() -> None:
    queries = idle_queries("ns", "pool", "g", 300)
    assert "offset 300s" in queries["change:tessera_e2e_seconds_count"]
    assert 'group="g"' in queries["held:running"]
    one = [{"value": [0, "1"]}]
    zero = [{"value": [0, "0"]}]
    quiet = {k: zero for k in queries} | {"up:now": one, "up:before": one}
    assert idle_from_results(quiet) is True
    assert idle_from_results(quiet | {"up:before": []}) is None
    assert idle_from_results(quiet | {"change:tessera_e2e_seconds_count": one}) is False  # a first request
    assert idle_from_results(quiet | {"held:queued": one}) is False


def replace_plan(groups: list[GroupPlan]) -> object:
    from tessera.core.planners import PlacementPlan

    return PlacementPlan(strategy="seallm", groups=tuple(groups))


def quickstart(scale_to_zero: bool, replicas: RoleCounts = TWO) -> list[dict]:
    """The quickstart's children as the operator renders them, its service scaling to zero or not."""
    bodies = [d.to_json() for d in load_documents(EXAMPLES / "quickstart.yaml")]
    for b in bodies:
        b["metadata"]["uid"] = "u"
    if scale_to_zero:
        bodies[3]["spec"]["scaleToZero"] = {"afterSeconds": 30, "maxHeld": 5}
    desired = desired_pool(bodies[0], bodies[3:], bodies[1:3], None, 0.0)
    (g,) = desired.plan.groups
    return desired_children(
        desired.pool, [replace(g, replicas=replicas)], desired.services, desired.configs, "ns"
    )


def pod(sts: dict, ip: str) -> dict:
    name = sts["metadata"]["name"]
    refs = [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": name, "uid": "s", "controller": True}]
    return {
        "metadata": {"name": f"{name}-0", "namespace": "ns", "ownerReferences": refs,
                     "labels": sts["spec"]["template"]["metadata"]["labels"]},
        "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }  # fmt: skip


def test_the_group_config_map_tells_the_router_which_models_sleep_and_discovery_finds_cold_groups() -> None:
    children = quickstart(scale_to_zero=True)
    cm = next(c for c in children if c["kind"] == "ConfigMap")
    sts = next(c for c in children if c["kind"] == "StatefulSet")
    read = read_group_config_map(cm)
    assert read is not None
    (model,) = read.sleeping
    assert read.sleeping[model].service == "llama-8b"
    assert read.sleeping[model].policy == IdlePolicy(30.0, None, 5)
    awake = backends_from_cluster([cm], [pod(sts, "10.0.0.1")])
    assert [b.url for b in awake.backends] == ["http://10.0.0.1:8000"]
    (g,) = awake.sleeping
    assert (g.cold, g.ready, g.namespace, list(g.models)) == (False, True, "ns", [model])
    # Scaled to zero: its stopping pod is no backend, and the group is cold.
    zero = quickstart(scale_to_zero=True, replicas=RoleCounts())
    cold_cm = next(c for c in zero if c["kind"] == "ConfigMap")
    cold = backends_from_cluster([cold_cm], [pod(sts, "10.0.0.1")])
    assert cold.backends == [] and [(g.cold, g.ready) for g in cold.sleeping] == [(True, False)]
    # A service without scaleToZero: no sleeping group.
    plain = next(c for c in quickstart(scale_to_zero=False) if c["kind"] == "ConfigMap")
    assert backends_from_cluster([plain], []).sleeping == []


def test_the_activator_follows_the_operator_and_never_sleeps_a_followed_unit_itself() -> None:
    async def run() -> None:
        class NoWake:
            async def sleep(self, unit: str) -> None:
                raise AssertionError("a followed unit is never put to sleep by the router")

            async def wake(self, unit: str) -> None:
                await asyncio.sleep(0)

        clock = [0.0]
        activator = Activator({}, {}, NoWake(), lambda m: 0, clock=lambda: clock[0])
        policy = IdlePolicy(1.0, None, 3)
        activator.follow({"u": ("m",)}, {"m": policy}, cold=set(), serving={"u"})
        clock[0] = 100.0
        activator.tick()
        assert activator.state_of("m") is UnitState.READY
        activator.follow({"u": ("m",)}, {"m": policy}, cold={"u"}, serving=set())
        assert activator.state_of("m") is UnitState.COLD
        await activator.admit("m", None, 0)  # wakes it
        assert activator.state_of("m") is UnitState.READY and activator.units["u"].wakes == 1
        activator.follow({"u": ("m",)}, {"m": policy}, cold={"u"}, serving=set())
        activator.follow({"u": ("m",)}, {"m": policy}, cold=set(), serving={"u"})  # woken by another router
        assert activator.state_of("m") is UnitState.READY
        # Its instances vanish under a request before discovery shows the group cold: held, woken.
        assert activator.lost_instances("m") and activator.state_of("m") is UnitState.COLD
        await activator.admit("m", None, 0)
        assert activator.units["u"].wakes == 2
        assert not activator.lost_instances("other")  # no unit: the request's 503 stands
        activator.follow({}, {}, cold=set(), serving=set())
        assert activator.units == {} and activator.state_of("m") is UnitState.READY

    asyncio.run(run())


def test_seallm_packs_idle_services_onto_one_shared_group_of_one_instance() -> None:
    """Sleeping services measure no load: SeaLLM packs them together, the busy ones get the GPUs."""
    from tessera.control.placement import plan_seallm
    from tessera.core.planners import PoolInput, ServiceInput
    from tessera.core.profiles import PROFILES

    gib = 2**30
    profile = PROFILES["h100-llama3-8b"]
    rates = {"busy1": 3.0, "busy2": 3.0, "idle1": 0.0, "idle2": 0.0}
    services = [ServiceInput(n, 16 * gib, 131072, profile, request_rate=r) for n, r in rates.items()]
    plan = plan_seallm(PoolInput("p", "H100", 80 * gib, 4), services, now=0.0)
    idle = [g for g in plan.groups if set(g.services) & {"idle1", "idle2"}]
    assert [(g.services, g.replicas.total) for g in idle] == [(("idle1", "idle2"), 1)]
    assert sum(g.replicas.total for g in plan.groups if g not in idle) == 3


def test_a_local_unit_whose_instances_vanish_is_not_held() -> None:
    """Local mode's units sleep in the router itself: an instance-less moment there (a restart) is not a
    sleep, and the request's 503 stands."""

    class Never:
        async def sleep(self, unit: str) -> None: ...

        async def wake(self, unit: str) -> None: ...

    activator = Activator({"u": ("m",)}, {"m": IdlePolicy(5.0)}, Never(), lambda m: 0)
    assert not activator.lost_instances("m") and activator.state_of("m") is UnitState.READY


def test_a_sleeping_service_is_planned_on_no_load_not_its_declared_one() -> None:
    """Its workers are gone and Prometheus has no series for it: placement reads zero requests over the
    window (``measured``), where it would otherwise fall back to ``expectedLoad``."""
    from tessera.api import LLMService
    from tessera.control.inputs import service_load
    from tessera.control.scale_to_zero import asleep_loads

    body = next(d for d in load_documents(EXAMPLES / "quickstart.yaml") if d.kind == "LLMService").to_json()
    body["spec"]["expectedLoad"] = {"requestsPerSecond": 5}
    plan = replace_plan([GroupPlan("g", (body["metadata"]["name"],), 1, RoleCounts())])
    model = body["spec"]["model"]["name"]
    cold = {"g": GroupSleep("g", UnitState.COLD, 0.0, TWO)}
    loads = asleep_loads(plan, cold, [body], 300.0)  # type: ignore[arg-type]
    load = service_load(LLMService.model_validate(body), loads[model], 300.0)
    assert (load.rate, load.rate_source) == (0.0, "measured")
    assert asleep_loads(plan, {"g": replace(cold["g"], state=UnitState.READY)}, [body], 300.0) == {}  # type: ignore[arg-type]

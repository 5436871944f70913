"""Local mode's autoscaler: direct scrapes read as the operator's Prometheus queries, and resizing that
keeps role order and stops a leaving worker only once the router has nothing outstanding on it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from prometheus_client import generate_latest

from tessera.api import load_documents
from tessera.batch.metrics import backlog_registry
from tessera.batch.store import BatchStore
from tessera.control.metrics_queries import snapshot_from_results
from tessera.core.chiron import GroupMemory, evaluate_group
from tessera.core.planners import BatchGroup, ChironSettings, RoleCounts
from tessera.local.autoscaler import LocalAutoscaler, effective_counts
from tessera.local.control_plane import LocalEngine, plan_local
from tessera.local.scrape import batch_results, results_from_scrapes
from tessera.local.supervisor import WorkerProcess
from tessera.router.app import RouterState
from tessera.router.backends import Backend
from tessera.router.chiron_hold import ChironHold

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
KINDS = {"chat": "interactive", "offline": "batch"}


def _text(inflight: dict[str, float], queued: dict[str, float], itl_count: float, started: float = 0) -> str:
    lines = ["# TYPE tessera_inflight gauge"]
    lines += [f'tessera_inflight{{model="m",class="{c}"}} {v}' for c, v in inflight.items()]
    lines += ["# TYPE tessera_queue_length gauge"]
    lines += [f'tessera_queue_length{{model="m",class="{c}"}} {v}' for c, v in queued.items()]
    lines += ["# TYPE tessera_itl_seconds histogram",
              f'tessera_itl_seconds_bucket{{model="m",class="offline",le="+Inf"}} {itl_count}',
              f'tessera_itl_seconds_count{{model="m",class="offline"}} {itl_count}',
              'tessera_itl_seconds_sum{model="m",class="offline"} 1.0',
              'tessera_itl_seconds_count{model="m",class="chat"} 999',
              "# TYPE tessera_ttft_seconds histogram",
              f'tessera_ttft_seconds_count{{model="m",class="chat"}} {started}',
              'tessera_ttft_seconds_count{model="m",class="offline"} 777']  # fmt: skip
    return "\n".join(lines) + "\n"


def test_scrapes_read_as_the_operators_queries_give_the_snapshot() -> None:
    plan = plan_local(load_documents(EXAMPLES / "quickstart.yaml"), LocalEngine())
    group = replace(plan.groups[0].group, replicas=RoleCounts(interactive=1, mixed=1, batch=1),
                    roles=("interactive", "mixed", "batch"))  # fmt: skip
    pods = [f"{plan.groups[0].pool}-{group.name}-{i}" for i in range(3)]
    first = {
        pods[0]: _text({"chat": 2, "offline": 0}, {"chat": 1, "offline": 0}, 100, started=10),
        pods[1]: _text({"chat": 0, "offline": 3}, {"chat": 0, "offline": 5}, 50),
        pods[2]: None,  # still starting: counted as pending
    }
    results, counters = results_from_scrapes(first, KINDS, {}, now=10.0)
    snap = snapshot_from_results(results, group, {"offline": 3600.0}, now=10.0)
    assert snap is not None
    assert snap.ready == RoleCounts(interactive=1, mixed=1) and snap.pending == RoleCounts(batch=1)
    assert snap.instances_with_interactive == 1 and snap.interactive_queued == 1
    assert snap.batch_running == 3 and snap.batch_queue == (BatchGroup(count=5, deadline=3610.0),)
    assert snap.batch_tokens_per_s is None and snap.interactive_arrival_rps is None  # rates need 2 scrapes
    # Five seconds later: 100 + 50 batch tokens more, one worker restarted (its counter went down),
    # the chat ITL samples never count as batch tokens.
    later = {
        pods[0]: _text({"chat": 0}, {}, 200, started=40),
        pods[1]: _text({"offline": 1}, {}, 20),
        pods[2]: _text({}, {}, 0),
    }
    results, _ = results_from_scrapes(later, KINDS, counters, now=15.0)
    snap = snapshot_from_results(results, group, {"offline": 3600.0}, now=15.0)
    assert snap is not None and snap.ready == RoleCounts(interactive=1, mixed=1, batch=1)
    assert snap.batch_tokens_per_s == pytest.approx((100 + 20) / 5.0)
    assert snap.batch_instance_tokens_per_s == pytest.approx(24.0)
    assert snap.interactive_arrival_rps == pytest.approx(30 / 5.0)  # chat requests started; not offline's
    assert snap.instances_with_interactive == 0 and snap.batch_queue == ()


def test_the_batch_components_backlog_reaches_the_snapshot_and_launches_just_in_time(
    batch_job_store: Callable[..., BatchStore],
) -> None:
    """The lines the feeder has not sent (1,960 of a 2,000-line job, 20 in flight) are in no queue the
    workers or the router export: only the batch component's gauges show them, with their expiry and
    the output length of the answered lines. With them Chiron's just-in-time rule waits while a batch
    instance launched at the next evaluation still meets the deadline, then launches one at the last
    evaluation that does (1,959 lines x 200 tokens at 2,000 tokens/s after a 15 s load: 210.9 s, so
    at 215 s left and not at 220 s). Without them the 20 lines in flight look like no backlog at all."""
    created, window = 1_000_000, 300
    store = batch_job_store(2000, answered=20, in_flight=20, created=created, window_s=window)
    text = generate_latest(backlog_registry(store)).decode()
    assert 'tessera_batch_pending_lines{class="offline",model="m"} 1960.0' in text
    group = replace(plan_local(load_documents(EXAMPLES / "quickstart.yaml"), LocalEngine()).groups[0].group,
                    replicas=RoleCounts(interactive=1, mixed=1), roles=("interactive", "mixed"))  # fmt: skip
    scrapes = {"p-0": _text({"chat": 0}, {}, 0), "p-1": _text({"offline": 20}, {}, 0)}
    settings = ChironSettings(just_in_time=True, scale_down_evaluations=1000, max_instances=8)
    seen: dict[bool, list[tuple[float, int, str]]] = {True: [], False: []}
    for with_backlog in (True, False):
        memory = GroupMemory()
        for step in range(20):
            now, unix = 50.0 + 5 * step, created + 5.0 * step
            results, _ = results_from_scrapes(scrapes, KINDS, {}, now)
            if with_backlog:
                results |= batch_results(text, ("m",), KINDS, unix, now)
            snap = snapshot_from_results(results, group, {"offline": 3600.0}, now)
            assert snap is not None
            evaluation = evaluate_group(snap, memory, settings, now)
            memory = evaluation.memory
            assert evaluation.decision is not None
            seen[with_backlog].append((created + window - unix, evaluation.decision.desired.batch,
                                       evaluation.reason))  # fmt: skip
    assert all(batch == 0 for _, batch, _ in seen[False])
    launches = [(left, batch) for left, batch, _ in seen[True] if batch]
    assert launches[0] == (215.0, 1)
    # Every evaluation before it waited, from the first: the deadline was known all along.
    waits = [left for left, batch, reason in seen[True] if left > 215.0 and "(just in time): wait" in reason]
    assert waits == [300.0 - 5 * i for i in range(17)]


class _Supervisor:
    """Records launches and stops instead of running processes."""

    def __init__(self, workers: list[WorkerProcess]) -> None:
        self.workers = workers
        self.launched: list[str] = []
        self.stopped: list[str] = []

    def launch(self, instance):  # type: ignore[no-untyped-def]
        worker = WorkerProcess(instance, 9000 + instance.ordinal, Path("c"), Path("l"))
        self.workers.append(worker)
        self.launched.append(instance.name)
        return worker

    def stop(self, workers: list[WorkerProcess]) -> None:
        self.stopped += [w.instance.name for w in workers]

    def backends(self) -> list[Backend]:
        return [w.backend() for w in self.workers]


async def test_resize_keeps_role_order_and_drains_before_stopping() -> None:
    plan = plan_local(load_documents(EXAMPLES / "quickstart.yaml"), LocalEngine(), max_instances_per_group=3)
    (local,) = plan.groups
    assert effective_counts(local, RoleCounts(interactive=2, mixed=2, batch=1)) == RoleCounts(2, 1, 0)
    workers = [WorkerProcess(i, 9000 + i.ordinal, Path("c"), Path("l")) for i in plan.instances]
    supervisor = _Supervisor(workers)
    router = RouterState([w.backend() for w in workers])
    scaler = LocalAutoscaler(plan.groups, supervisor, router, report=lambda _: None)  # type: ignore[arg-type]
    group = scaler.groups[0]
    assert group.replicas == RoleCounts(interactive=3)
    # Grow past the cap: three run, in role order, none launched (the cap is reached).
    scaler._resize(group, effective_counts(local, RoleCounts(interactive=1, mixed=3)))
    assert [w.instance.role for w in supervisor.workers] == ["interactive", "mixed", "mixed"]
    assert [x.role for x in router.loads.values()] == ["interactive", "mixed", "mixed"]
    # Shrink to one while the router has a request outstanding on ordinal 2: it leaves the rotation at
    # once and is stopped only when that request is done; ordinal 1 (idle) stops at once.
    busy = next(x for x in router.loads.values() if x.instance.endswith("-2"))
    busy.outstanding = 1
    scaler._resize(group, RoleCounts(interactive=1))
    assert [w.instance.ordinal for w in supervisor.workers] == [0]
    assert {x.instance for x in router.loads.values()} == {plan.instances[0].name}
    await asyncio.sleep(0.5)
    assert supervisor.stopped == [plan.instances[1].name]
    busy.outstanding = 0
    await asyncio.sleep(0.5)
    assert supervisor.stopped == [plan.instances[1].name, plan.instances[2].name]
    # Grow again: new ordinals start in role order and join the router (not ready until polled).
    scaler._resize(group, RoleCounts(interactive=1, mixed=1, batch=1))
    assert supervisor.launched == [plan.instances[1].name, plan.instances[2].name]
    assert [(x.role, x.healthy) for x in router.loads.values()][1:] == [("mixed", False), ("batch", False)]
    await scaler.close()


async def test_batch_work_the_router_holds_starts_a_batch_instance() -> None:
    """A bulk of batch requests held in the router's batch hold (no batch instance yet) is what the local
    autoscaler reads as the group's batch queue: it gives a batch instance a slot for it."""
    plan = plan_local(load_documents(EXAMPLES / "quickstart.yaml"), LocalEngine(), max_instances_per_group=3)
    (local,) = plan.groups
    workers = [WorkerProcess(i, 9000 + i.ordinal, Path("c"), Path("l")) for i in plan.instances]
    supervisor = _Supervisor(workers)
    router = RouterState([w.backend() for w in workers], hold=ChironHold())
    scaler = LocalAutoscaler(plan.groups, supervisor, router, report=lambda _: None)  # type: ignore[arg-type]
    assert scaler.groups[0].replicas == RoleCounts(interactive=3)  # the cap, all interactive
    model = local.config.models[0].name
    offline = local.config.classes["offline"].to_service_class("offline")
    held = [
        asyncio.create_task(router.hold.wait(model, offline, 0.0, list(router.loads.values()), 1000.0))
        for _ in range(200)
    ]
    await asyncio.sleep(0)
    assert router.hold.held() == {model: {"offline": 200}}
    idle = _text({"chat": 0, "offline": 0}, {}, 0)

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=idle)

    # The first evaluation wants a batch instance, but the cap is full; the second (idle interactive
    # instances twice in a row) retires interactive ones and the batch instance takes a slot.
    interval = scaler.groups[0].scaling.settings.eval_interval_s
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        await scaler.step(client, now=100.0)
        await scaler.step(client, now=100.0 + interval)
    assert scaler.groups[0].replicas.batch >= 1, scaler.actions
    assert [w.instance.role for w in supervisor.workers].count("batch") == scaler.groups[0].replicas.batch
    for task in held:
        task.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    assert router.hold.held() == {}
    await scaler.close()


async def test_the_autoscaler_scrapes_the_batch_components_backlog(
    batch_job_store: Callable[..., BatchStore],
) -> None:
    """Local mode's loop reads the batch component's /metrics (``batch_url``) at each evaluation: a job
    whose unsent lines would miss their expiry without a batch instance gets one, where the same loop
    without the component's backlog sees no batch work at all (nothing in flight, nothing held)."""
    plan = plan_local(load_documents(EXAMPLES / "quickstart.yaml"), LocalEngine(), max_instances_per_group=3)
    created = 1_000_000
    store = batch_job_store(2000, answered=20, in_flight=0, created=created, window_s=300)
    model = plan.groups[0].config.models[0].name
    backlog = generate_latest(backlog_registry(store)).decode().replace('model="m"', f'model="{model}"')
    idle = _text({"chat": 0, "offline": 0}, {}, 0)

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=backlog if request.url.host == "batch" else idle)

    replicas = {}
    for batch_url in ("http://batch", None):
        workers = [WorkerProcess(i, 9000 + i.ordinal, Path("c"), Path("l")) for i in plan.instances]
        supervisor = _Supervisor(workers)
        router = RouterState([w.backend() for w in workers], hold=ChironHold())
        scaler = LocalAutoscaler(plan.groups, supervisor, router, report=lambda _: None,  # type: ignore[arg-type]
                                 batch_url=batch_url, wall_clock=lambda: created + 10.0)  # fmt: skip
        interval = scaler.groups[0].scaling.settings.eval_interval_s
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            await scaler.step(client, now=100.0)
            await scaler.step(client, now=100.0 + interval)
        replicas[batch_url] = scaler.groups[0].replicas
        await scaler.close()
    assert replicas["http://batch"].batch >= 1 and replicas[None].batch == 0, replicas


async def test_interactive_work_the_router_holds_is_evaluated_at_once() -> None:
    """An interactive request held for want of room makes the group's evaluation due before its
    interval, as the simulator's Chiron controller evaluates at once; without one it waits."""
    plan = plan_local(load_documents(EXAMPLES / "quickstart.yaml"), LocalEngine(), max_instances_per_group=3)
    (local,) = plan.groups
    workers = [WorkerProcess(i, 9000 + i.ordinal, Path("c"), Path("l")) for i in plan.instances]
    router = RouterState([w.backend() for w in workers], hold=ChironHold())
    scaler = LocalAutoscaler(plan.groups, _Supervisor(workers), router, report=lambda _: None)  # type: ignore[arg-type]
    group = scaler.groups[0]
    scraped: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        scraped.append(str(request.url))
        return httpx.Response(200, text=_text({"chat": 1}, {}, 0))

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        await scaler.step(client, now=100.0)
        assert scraped and group.memory.last_eval == 100.0
        scraped.clear()
        await scaler.step(client, now=101.0)  # before the interval: nothing held, nothing measured
        assert not scraped
        # no instance has room (the router has not polled any: none is ready): the chat request waits
        chat = local.config.classes["chat"].to_service_class("chat")
        model = local.config.models[0].name
        held = asyncio.create_task(router.hold.wait(model, chat, 101.0, list(router.loads.values()), 1000.0))
        await asyncio.sleep(0)
        assert router.hold.held() == {model: {"chat": 1}}
        await scaler.step(client, now=101.5)
        assert scraped and group.memory.last_eval == 101.5
    assert scaler.period_s <= 0.5
    held.cancel()
    await asyncio.gather(held, return_exceptions=True)
    await scaler.close()

"""The router's Chiron dispatch, the way clients meet it: real sim worker processes of the quickstart (a
Chiron-autoscaled pool) behind the real router on loopback (``router_harness``).

Batch requests wait in the router while no batch instance of their model is ready and one is coming,
whatever their shape (completion as text or token ids, or chat, streamed or not); the hold shows in
``/router/status`` and in ``tessera_router_chiron_held_requests``; the batch instance takes them once it
is ready. Interactive requests pack onto the most loaded interactive instance with room and wait in
the router when none has room, until a request ends. A client that leaves while held leaves the hold;
a full hold refuses with 429; a model with only interactive instances serves its batch work there once
the hold's orphan wait has passed; a model that leaves or stops autoscaling answers what it held.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import pytest
from router_harness import CLASS_HEADER, MODEL, PLAN, RouterUnderTest, serve_router, start_workers

from tessera.core.chiron import chiron_pick
from tessera.core.request import Request, ServiceClass
from tessera.local.supervisor import WorkerProcess
from tessera.router.app import RouterState
from tessera.router.backends import Backend
from tessera.router.chiron_hold import ChironHold, LoadTarget
from tessera.worker.engines.vllm_process import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ORPHAN_S = 1.0  # the hold's orphan wait in the test without batch instances (default: a minute)
BATCH = {CLASS_HEADER: "batch"}  # the offline class's header value
SHAPES = [  # (path, body, streamed)
    ("/v1/completions", {"prompt": "hello there", "max_tokens": 4}, False),
    ("/v1/completions", {"prompt": "hello there", "max_tokens": 4}, True),
    ("/v1/completions", {"prompt": [9906, 1070], "max_tokens": 4}, False),  # token ids
    ("/v1/completions", {"prompt": [9906, 1070], "max_tokens": 4}, True),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, False),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, True),
]


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[WorkerProcess]]:
    supervisor = start_workers(tmp_path_factory.mktemp("router-batch-hold"), 2)
    try:
        assert supervisor.workers[0].instance.config.scheduling.autoscale.enabled  # a Chiron pool
        yield supervisor.workers
    finally:
        supervisor.stop_all()


def _as(worker: WorkerProcess, role: str, url: str = "") -> Backend:
    return worker.backend().model_copy(update={"role": role, "url": url or worker.url})


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens: the instance is starting


def _batch_starting(workers: list[WorkerProcess]) -> list[Backend]:
    """The first worker as an interactive instance, the second as a batch instance still starting."""
    return [_as(workers[0], "interactive"), _as(workers[1], "batch", _dead_url())]


async def _until(check, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def _ask(
    client: httpx.AsyncClient, url: str, path: str, body: dict, stream: bool
) -> tuple[int, str, str]:  # type: ignore[type-arg]
    """(status, the instance that answered, the answer's text) of one request."""
    payload = {"model": MODEL, **body, "stream": stream}
    async with client.stream("POST", f"{url}{path}", json=payload, headers=BATCH) as resp:
        text = (await resp.aread()).decode()
        return resp.status_code, resp.headers.get("x-tessera-instance", ""), text


def _held(router: RouterUnderTest) -> int:
    return sum(router.state.hold.held().get(MODEL, {}).values())


async def test_batch_work_waits_for_the_batch_instance_in_every_shape(workers: list[WorkerProcess]) -> None:
    interactive, batch = workers
    async with serve_router(workers, backends=_batch_starting(workers), poll_interval_s=0.3,
                            hold=ChironHold()) as router:  # fmt: skip
        async with httpx.AsyncClient(timeout=60) as client:
            asks = [asyncio.create_task(_ask(client, router.url, *shape)) for shape in SHAPES]
            await _until(lambda: _held(router) == len(SHAPES))
            # An interactive request is routed at once, to the interactive instance.
            chat = await client.post(f"{router.url}/v1/completions", headers={CLASS_HEADER: "chat"},
                                     json={"model": MODEL, "prompt": "hi", "max_tokens": 2})  # fmt: skip
            assert chat.status_code == 200 and chat.headers["x-tessera-instance"] == interactive.instance.name
            status = (await client.get(f"{router.url}/router/status")).json()
            assert status["held"] == {MODEL: {"offline": len(SHAPES)}}
            held = await router.metric(
                "tessera_router_chiron_held_requests", model=MODEL, **{"class": "offline"}
            )
            assert held == len(SHAPES)
            assert not any(t.done() for t in asks)  # nothing went to the interactive instance meanwhile
            # The batch instance becomes ready: the next poll round releases the hold to it.
            router.state.update([_as(interactive, "interactive"), _as(batch, "batch")])
            answers = await asyncio.wait_for(asyncio.gather(*asks), 30)
        for (path, _, stream), (status_code, instance, text) in zip(SHAPES, answers, strict=True):
            assert status_code == 200, (path, stream, text)
            assert instance == batch.instance.name, (path, stream)
            if stream:
                assert text.rstrip().endswith("data: [DONE]"), text
            else:
                assert json.loads(text)["usage"]["completion_tokens"] == 4
        assert _held(router) == 0 and router.state.hold.reserved == {}
        assert await router.metric("tessera_router_chiron_held_requests") == 0


async def test_a_client_that_leaves_leaves_the_hold_and_a_full_hold_refuses(
    workers: list[WorkerProcess],
) -> None:
    interactive, batch = workers
    async with serve_router(workers, backends=_batch_starting(workers), poll_interval_s=0.3,
                            hold=ChironHold()) as router:  # fmt: skip
        path, body, stream = SHAPES[0]
        async with httpx.AsyncClient(timeout=1.0) as impatient:
            with pytest.raises(httpx.ReadTimeout):
                await _ask(impatient, router.url, path, body, stream)
        await _until(lambda: _held(router) == 0)
        router.state.hold.max_held = 1
        async with httpx.AsyncClient(timeout=60) as client:
            first = asyncio.create_task(_ask(client, router.url, path, body, stream))
            await _until(lambda: _held(router) == 1)
            refused = await client.post(f"{router.url}{path}", json={"model": MODEL, **body}, headers=BATCH)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "30"
            assert refused.json()["error"]["code"] == "hold_full"
            router.state.update([_as(interactive, "interactive"), _as(batch, "batch")])
            status_code, instance, _ = await asyncio.wait_for(first, 30)
        assert status_code == 200 and instance == batch.instance.name


async def test_without_a_batch_or_mixed_instance_interactive_ones_lend_their_room(
    workers: list[WorkerProcess],
) -> None:
    interactive, _ = workers
    only = [_as(interactive, "interactive")]
    async with serve_router([interactive], backends=only, poll_interval_s=0.3, hold=ChironHold()) as router:
        router.state.hold.orphan_wait_s = ORPHAN_S
        # Discovery names a batch pod that is planned and still starting: the hold waits for it.
        router.state.update(only, {MODEL: ["batch"]})
        async with httpx.AsyncClient(timeout=30) as client:
            asks = [asyncio.create_task(_ask(client, router.url, *shape)) for shape in SHAPES]
            await _until(lambda: _held(router) == len(SHAPES))
            await asyncio.sleep(3 * ORPHAN_S)
            assert _held(router) == len(SHAPES)
            # It never comes (the autoscaler took it back): once the orphan wait has passed, and a
            # poll round looked, the interactive instance serves the work.
            router.state.update(only, {})
            answers = await asyncio.wait_for(asyncio.gather(*asks), 30)
        assert [(s, i) for s, i, _ in answers] == [(200, interactive.instance.name)] * len(SHAPES)
        assert _held(router) == 0


async def test_held_work_is_answered_when_its_model_leaves_or_stops_autoscaling(
    workers: list[WorkerProcess],
) -> None:
    interactive = workers[0]
    waiting = _batch_starting(workers)
    async with serve_router(workers, backends=waiting, poll_interval_s=0.3, hold=ChironHold()) as router:
        path, body, stream = SHAPES[2]
        async with httpx.AsyncClient(timeout=30) as client:
            ask = asyncio.create_task(_ask(client, router.url, path, body, stream))
            await _until(lambda: _held(router) == 1)
            # The pool stops autoscaling: the route chooses, as for any request (interactive serves).
            plain = interactive.instance.config.model_copy(deep=True)
            plain.scheduling.autoscale.enabled = False
            router.state.update([_as(interactive, "interactive").model_copy(update={"config": plain})])
            status_code, instance, _ = await asyncio.wait_for(ask, 10)
            assert (status_code, instance) == (200, interactive.instance.name)
            # The model goes away while a request is held: it is answered 404, not left waiting.
            router.state.update(waiting)
            ask = asyncio.create_task(_ask(client, router.url, path, body, stream))
            await _until(lambda: _held(router) == 1)
            router.state.update([])
            status_code, _, text = await asyncio.wait_for(ask, 10)
        assert status_code == 404 and json.loads(text)["error"]["code"] == "model_not_found"
        assert router.state.hold.held() == {}


async def test_interactive_work_packs_onto_the_fullest_instance_and_waits_when_none_has_room(
    workers: list[WorkerProcess],
) -> None:
    first, second = workers
    backends = [_as(first, "interactive"), _as(second, "interactive")]
    # One poll at the start (the instances' batch sizes), then the test sets them: two and one.
    async with serve_router(workers, backends=backends, poll_interval_s=3600, hold=ChironHold()) as router:
        for load in router.state.loads.values():
            load.batch_size = 2 if load.instance == first.instance.name else 1
        chat = {CLASS_HEADER: "chat"}
        body = {"model": MODEL, "prompt": "hello there", "max_tokens": 200, "stream": True}

        async def ask(client: httpx.AsyncClient) -> tuple[int, str]:
            async with client.stream("POST", f"{router.url}/v1/completions", json=body, headers=chat) as resp:
                await resp.aread()
                return resp.status_code, resp.headers.get("x-tessera-instance", "")

        def outstanding() -> dict[str, int]:
            return {x.instance: x.outstanding for x in router.state.loads.values()}

        async with httpx.AsyncClient(timeout=60) as client:
            asks = []
            for n in range(4):
                asks.append(asyncio.create_task(ask(client)))
                await _until(lambda n=n: sum(outstanding().values()) + _held(router) == n + 1)
            # packed: the first instance takes two, the second the third; the fourth waits in the router
            assert outstanding() == {first.instance.name: 2, second.instance.name: 1}
            assert _held(router) == 1
            assert router.state.hold.held() == {MODEL: {"chat": 1}}
            answers = await asyncio.wait_for(asyncio.gather(*asks), 60)
        assert [code for code, _ in answers] == [200] * 4
        assert [i for _, i in answers[:3]] == [first.instance.name, first.instance.name, second.instance.name]
        assert _held(router) == 0 and router.state.hold.reserved == {}


def test_the_dispatch_reads_the_kv_its_engine_reports() -> None:
    """An instance's free KV for Chiron's dispatch: its engine's reported capacity less a mean request's
    context per request there, and at most what the engine last reported free."""
    backend = Backend(name="w0", url="http://w0", role="interactive", config=PLAN.instances[0].config)
    state = RouterState([backend], hold=ChironHold())
    (load,) = state.loads.values()
    load.healthy, load.outstanding = True, 2
    assert LoadTarget(load, (0, 0), 100.0, 0.0).admissible_kv_tokens == load.profile.kv_capacity_tokens - 200
    metrics = (
        f'tessera_batch_size{{model="{MODEL}"}} 8\n'
        f'tessera_engine_kv_capacity_tokens{{model="{MODEL}"}} 10000\n'
        f'tessera_engine_kv_used_tokens{{model="{MODEL}"}} 9000\n'
    )
    state.observe("w0", metrics)
    assert (load.batch_size, load.engine_kv_capacity, load.engine_kv_used) == (8, 10000, 9000)
    target = LoadTarget(load, (0, 0), 100.0, 0.0)
    assert target.admissible_kv_tokens == 1000 and target.kv_capacity == 10000
    chat = ServiceClass("chat", kind="interactive", ttft_slo_s=10.0)
    assert chiron_pick(Request("big", 0.0, 2000, 10, service_class=chat), [target]) is None
    assert chiron_pick(Request("small", 0.0, 500, 10, service_class=chat), [target]) is target

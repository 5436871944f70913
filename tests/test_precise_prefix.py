"""Precise prefix affinity: the engine's own KV events applied per instance (``EngineBlockIndex``), their
msgpack decoding and ZMQ subscriber, the ``precise-prefix`` scorer in isolation, in the simulator, and
with a real vLLM server publishing its events."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import msgspec
import pytest

from tessera.bench.runner import run_one
from tessera.core.prefix import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockIndex,
    token_block_hashes,
)
from tessera.core.profile import StepProfile
from tessera.core.registry import make_policy
from tessera.core.request import Request
from tessera.core.routing import (
    InstanceLoad,
    RouteRequest,
    RouteSpec,
    ScorerSpec,
    build_route,
    make_route,
    uses_engine_blocks,
)
from tessera.router.kv_events import KVEventSubscriber, decode_batch
from tessera.sim.cluster import ClusterConfig, RouteRouter
from tessera.sim.engine import EngineConfig

BS = 4  # block size of the hand-made events
TOKENS = list(range(100, 116))  # four blocks of BS


def _low64(h: bytes) -> int:
    """vLLM's integer form of a block hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, its default)."""
    return int.from_bytes(h, "big") & ((1 << 64) - 1)


def _engine_hashes(tokens: list[int]) -> list[int]:
    return [_low64(h) for h in token_block_hashes(tokens, BS)]


def _stored(tokens: list[int], start: int, end: int, **kw: object) -> BlockStored:
    """The engine stored blocks ``start``..``end`` of ``tokens``' chain, as vLLM reports them."""
    hashes = _engine_hashes(tokens)
    return BlockStored(
        block_hashes=tuple(hashes[start:end]),
        parent_block_hash=hashes[start - 1] if start else None,
        token_ids=tuple(tokens[start * BS : end * BS]),
        block_size=BS,
        **kw,  # type: ignore[arg-type]
    )


def test_stored_blocks_match_the_routers_chain_and_removal_or_clearing_takes_them_away() -> None:
    index = EngineBlockIndex(BS)
    mine = token_block_hashes(TOKENS, BS)
    assert index.matched(mine, ["a"]) == {}  # no feed yet: unknown, not "holds none"
    assert index.apply("a", 0, [_stored(TOKENS, 0, 2, medium="GPU", group_idx=0)]) is None
    assert index.apply("a", 1, [_stored(TOKENS, 2, 3)]) is None  # chained on its parent's engine hash
    assert index.matched(mine, ["a", "b"]) == {"a": 3}
    assert index.matched(token_block_hashes([1, *TOKENS[1:]], BS), ["a"]) == {"a": 0}  # first token differs
    index.apply("a", 2, [BlockRemoved((_engine_hashes(TOKENS)[1],), "GPU")])  # the engine evicted block 1
    assert index.matched(mine, ["a"]) == {"a": 1} and index.blocks("a") == 2
    index.apply(
        "a", 3, [BlockRemoved((_engine_hashes(TOKENS)[0],), "CPU")]
    )  # an offload tier's, not the engine's
    assert index.matched(mine, ["a"]) == {"a": 1}
    index.apply("a", 4, [AllBlocksCleared()])
    assert index.matched(mine, ["a"]) == {"a": 0} and index.tracks("a")
    index.untrack("a")
    assert index.matched(mine, ["a"]) == {}


def test_blocks_that_tokens_alone_cannot_match_are_skipped_and_counted() -> None:
    index = EngineBlockIndex(BS)
    mine = token_block_hashes(TOKENS, BS)
    index.apply("a", 0, [_stored(TOKENS, 0, 2, extra_keys=(None, ("lora-x",)))])  # block 1 under a LoRA
    assert index.matched(mine, ["a"]) == {"a": 1} and index.skipped["a"] == 1
    index.apply("a", 1, [_stored(TOKENS, 3, 4)])  # its parent (block 2) was never seen
    index.apply("a", 2, [_stored(TOKENS, 0, 1, group_idx=1), _stored(TOKENS, 0, 1, medium="CPU")])
    wider = BlockStored((7,), None, tuple(TOKENS[:8]), 8)  # another block size than the index's
    index.apply("a", 3, [wider])
    assert index.matched(mine, ["a"]) == {"a": 1} and index.skipped["a"] == 5


def test_a_restart_or_lost_events_drop_the_instances_blocks() -> None:
    index = EngineBlockIndex(BS)
    mine = token_block_hashes(TOKENS, BS)
    index.apply("a", 7, [_stored(TOKENS, 0, 2)])  # a subscriber may join at any number
    index.apply("b", 0, [_stored(TOKENS, 0, 2)])
    # a restarted engine numbers its batches from 0 again: what it held before is gone, the new batch counts
    assert index.apply("a", 0, [_stored(TOKENS, 0, 1)]) == "restart"
    assert index.matched(mine, ["a", "b"]) == {"a": 1, "b": 2}
    index.apply("a", 1, [_stored(TOKENS, 1, 2)])
    assert index.apply("a", 3, []) == "gap"  # batch 2 was lost: its removals are unknown
    assert index.matched(mine, ["a"]) == {"a": 0}
    assert index.apply("a", 4, [_stored(TOKENS, 0, 2)]) is None
    index.forget("a")  # the router saw a new engine start time
    assert index.matched(mine, ["a", "b"]) == {"a": 0, "b": 2}
    assert index.apply("a", 0, [_stored(TOKENS, 0, 1)]) is None  # the restart was already handled


def test_a_vllm_event_batch_decodes_to_the_same_events_and_malformed_ones_are_refused() -> None:
    kv = pytest.importorskip("vllm.distributed.kv_events")
    batch = kv.KVEventBatch(
        ts=1.5,
        events=[
            kv.BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=TOKENS[:8], block_size=BS,
                           lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, ["x", 1]],
                           group_idx=0),
            kv.BlockRemoved(block_hashes=[b"\x01\x02"], medium="GPU"),
            kv.AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )  # fmt: skip
    events = decode_batch(msgspec.msgpack.encode(batch))
    assert events == [
        BlockStored((11, 12), None, tuple(TOKENS[:8]), BS, (None, ("x", 1)), "GPU", 0),
        BlockRemoved((b"\x01\x02",), "GPU", None),
        AllBlocksCleared(),
    ]
    for bad in (
        b"\xc1",
        msgspec.msgpack.encode({"ts": 1}),
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]]),
    ):
        with pytest.raises(ValueError):
            decode_batch(bad)


def test_the_subscriber_applies_numbered_batches_and_forgets_on_a_restart_or_an_undecodable_one() -> None:
    index = EngineBlockIndex(BS)
    sub = KVEventSubscriber("a", "tcp://127.0.0.1:1", index)
    mine = token_block_hashes(TOKENS, BS)

    def message(seq: int, events: list[dict[str, object]]) -> list[bytes]:
        return [b"kv-events", seq.to_bytes(8, "big"), msgspec.msgpack.encode([1.0, events, 0])]

    first = {"type": "BlockStored", "block_hashes": _engine_hashes(TOKENS)[:2], "parent_block_hash": None,
             "token_ids": TOKENS[:8], "block_size": BS, "medium": "GPU"}  # fmt: skip
    sub.receive(message(5, [first]))
    assert index.matched(mine, ["a"]) == {"a": 2} and sub.batches == 1
    sub.receive(message(0, [{"type": "SomethingNewer"}]))  # an unknown event type is skipped
    assert index.matched(mine, ["a"]) == {"a": 0} and sub.dropped == {"restart": 1}
    sub.receive(message(1, [first]))
    sub.receive([b"kv-events", (2).to_bytes(8, "big"), b"\xc1"])
    assert index.matched(mine, ["a"]) == {"a": 0} and sub.dropped["undecodable"] == 1


PROFILE = StepProfile("m", 0.01, 0.001, 0.0, 0.01, 0.0001, kv_capacity_tokens=100_000)


def _load(name: str, outstanding: int = 0) -> InstanceLoad:
    return InstanceLoad(name, "m", "interactive", PROFILE, 4, outstanding)


def test_the_precise_prefix_scorer_trusts_the_engine_and_falls_back_to_the_estimate_only_when_asked() -> None:
    loads = [_load("a"), _load("b"), _load("c")]
    # the router sent the prompt to a (its estimate), but a's engine evicted it and b's holds it
    req = RouteRequest("m", "interactive", prompt_tokens=512, cached_tokens={"a": 512, "c": 256},
                       engine_cached_tokens={"a": 0, "b": 384})  # fmt: skip
    assert make_route("precise-prefix").pick(req, loads).instance == "b"
    assert make_route("prefix").pick(req, loads).instance == "a"
    only_c_unfed = RouteRequest("m", "interactive", prompt_tokens=512, cached_tokens={"c": 256},
                                engine_cached_tokens={"a": 0, "b": 128})  # fmt: skip
    assert (
        make_route("precise-prefix").pick(only_c_unfed, loads).instance == "c"
    )  # c has no feed: its estimate
    strict = make_route("precise-prefix", **{"precise-prefix": {"fallback": False}})
    assert strict.pick(only_c_unfed, loads).instance == "b"
    spec = RouteSpec(
        filters=("serves-model",), scorers=(ScorerSpec(name="precise-prefix", settings={"x": 1}),)
    )
    with pytest.raises(ValueError, match="bad settings for scorer 'precise-prefix'"):
        build_route("r", spec)
    assert uses_engine_blocks(spec) and not uses_engine_blocks(RouteSpec(filters=("serves-model",)))


def _req(rid: str, at: float, blocks: tuple[int, ...], prompt: int, output: int = 2) -> Request:
    return Request(
        rid, at, prompt, output, true_output_tokens=output, prefix_blocks=blocks, prefix_block_tokens=512
    )


def _run(reqs: list[Request], route: str, caching: bool) -> list[Request]:
    config = ClusterConfig(
        profiles={"default": PROFILE}, instances=2, engine=EngineConfig(prefix_caching=caching)
    )
    done, _ = run_one(reqs, lambda: make_policy("fcfs"), config, router=RouteRouter(route))
    return done


def test_in_the_simulator_precise_prefix_reads_what_each_instance_caches() -> None:
    spaced = [_req(f"r{i}", i * 5.0, (7, 8, 9 + i), 1536) for i in range(6)]
    precise = _run(spaced, "precise-prefix", caching=True)  # the shared prefix stays where it was cached
    assert (
        len({r.instance for r in precise}) == 1 and sum(r.cached_prompt_tokens for r in precise) == 5 * 1024
    )
    # engines that cache nothing, requests that overlap: the router's estimate still piles them onto the
    # instance it sent the prefix to; what the engines hold does not, and the load decides
    overlapping = [_req(f"r{i}", i * 0.001, (7, 8, 9 + i), 1536, output=200) for i in range(6)]
    assert len({r.instance for r in _run(overlapping, "prefix", caching=False)}) == 1
    assert len({r.instance for r in _run(overlapping, "precise-prefix", caching=False)}) == 2


def _router_state(route: str = "precise-prefix"):  # type: ignore[no-untyped-def]
    from tessera.api.worker_config import WorkerConfig
    from tessera.router.app import RouterState
    from tessera.router.backends import Backend, KVEventsSource

    config = WorkerConfig.model_validate({"models": [{"name": "m", "engine": "sim"}]})
    backends = [
        Backend(name=n, url=f"http://{n}", config=config,
                kv_events=[KVEventsSource(model="m", endpoint=f"tcp://127.0.0.1:{port}", block_size=BS)])
        for n, port in (("a", 5001), ("b", 5002))
    ]  # fmt: skip
    state = RouterState(backends, route=route)
    for name in ("a", "b"):
        state.set_health(name, True)
        state.observe(name, 'tessera_engine_start_time_seconds{model="m"} 100.0\n')
    return state


def test_the_router_routes_a_token_prompt_to_the_engine_that_holds_it_until_that_engine_restarts() -> None:
    state = _router_state()
    assert state.feeds == {("a", "m"): "tcp://127.0.0.1:5001", ("b", "m"): "tcp://127.0.0.1:5002"}
    state.engine_blocks["m"].apply("b", 0, [_stored(TOKENS, 0, 3)])
    assert state.pick("m", "interactive", set(), prompt_token_ids=TOKENS).load.instance == "b"
    # no ids: the estimate
    assert state.pick("m", "interactive", set(), "text, no token ids").load.instance == "a"
    rows = {r["instance"]: r for r in state.instance_rows()}
    assert (
        rows["b"]["engineCachedBlocks"] == 3 and rows["a"]["engineCachedBlocks"] is None
    )  # a sent nothing yet
    state.observe("b", 'tessera_engine_start_time_seconds{model="m"} 160.0\n')  # restarted between two polls
    assert state.pick("m", "interactive", set(), prompt_token_ids=TOKENS).load.instance == "a"
    assert (
        _router_state("prefix").pick("m", "interactive", set(), prompt_token_ids=TOKENS).load.instance == "a"
    )


def test_a_backend_names_kv_events_only_for_a_model_it_serves() -> None:
    from tessera.router.backends import BackendsError, parse_backends

    entry = {"name": "a", "url": "http://a", "config": {"models": [{"name": "m", "engine": "sim"}]},
             "kvEvents": [{"model": "other", "endpoint": "tcp://a:5557", "blockSize": 16}]}  # fmt: skip
    with pytest.raises(BackendsError, match="kvEvents names models the backend does not serve: other"):
        parse_backends({"backends": [entry]})


def test_through_the_router_a_publishers_blocks_draw_a_token_prompt_and_its_restart_drops_them() -> None:
    import zmq
    from fastapi.testclient import TestClient

    from tessera.api.worker_config import WorkerConfig
    from tessera.router.app import RouterState, create_router_app
    from tessera.router.backends import Backend, KVEventsSource
    from tessera.worker.engines.vllm_process import free_port

    def worker(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/ready":
            return httpx.Response(200, json={"ready": True})
        if request.url.path == "/metrics":
            return httpx.Response(200, text="")
        return httpx.Response(
            200, json={"choices": [], "usage": {"prompt_tokens": 16, "completion_tokens": 1}}
        )

    port = free_port()
    config = WorkerConfig.model_validate({"models": [{"name": "m", "engine": "sim"}]})
    feed = [KVEventsSource(model="m", endpoint=f"tcp://127.0.0.1:{port}", block_size=BS)]
    backends = [Backend(name="a", url="http://a", config=config),
                Backend(name="b", url="http://b", config=config, kv_events=feed)]  # fmt: skip
    state = RouterState(backends, route="precise-prefix")
    app = create_router_app(state, poll_interval_s=3600.0, transport=httpx.MockTransport(worker))
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    stored = {"type": "BlockStored", "block_hashes": _engine_hashes(TOKENS), "parent_block_hash": None,
              "token_ids": TOKENS, "block_size": BS, "medium": "GPU"}  # fmt: skip

    def publish_until(seq: int, events: list[dict[str, object]], blocks: int, http: TestClient) -> int:
        deadline = time.monotonic() + 10  # a subscription takes a moment to reach the publisher
        while time.monotonic() < deadline:
            pub.send_multipart(
                [b"kv-events", seq.to_bytes(8, "big"), msgspec.msgpack.encode([1.0, events, 0])]
            )
            seq += 1
            rows = {r["instance"]: r for r in http.get("/router/status").json()["instances"]}
            if rows["b"]["engineCachedBlocks"] == blocks:
                return seq
            time.sleep(0.05)
        raise AssertionError(f"the router never saw b hold {blocks} blocks")

    def routed(http: TestClient) -> str:
        answer = http.post("/v1/completions", json={"model": "m", "prompt": TOKENS, "max_tokens": 1})
        assert answer.status_code == 200, answer.text
        return answer.headers["x-tessera-instance"]

    try:
        with TestClient(app) as http:
            publish_until(40, [stored], 4, http)
            assert routed(http) == "b"  # a, first by name, holds nothing its engine reported
            publish_until(0, [], 0, http)  # numbered from 0 again: b's engine restarted, its cache is empty
            assert routed(http) == "a"
    finally:
        pub.close(linger=0)


VLLM_CPU_BLOCK_SIZE = 128  # vLLM's block size on CPUs when none is set


@pytest.mark.integration
def test_after_a_prompt_is_served_the_subscriber_holds_the_blocks_the_router_hashes_for_it(
    vllm_server,
) -> None:  # type: ignore[no-untyped-def]
    endpoint = vllm_server.kv_events_endpoint
    assert endpoint is not None
    index = EngineBlockIndex(VLLM_CPU_BLOCK_SIZE)
    rng = random.Random(22)
    prompt = [rng.randrange(10, 500) for _ in range(2 * VLLM_CPU_BLOCK_SIZE + 44)]  # unseen by other tests
    mine = token_block_hashes(prompt, VLLM_CPU_BLOCK_SIZE)
    seen: list[int] = []  # the engine's own hashes of the blocks it stored

    class Recording(KVEventSubscriber):
        def receive(self, frames):  # type: ignore[no-untyped-def]
            seen.extend(
                h for e in decode_batch(frames[2]) if isinstance(e, BlockStored) for h in e.block_hashes
            )
            super().receive(frames)

    async def scenario() -> None:
        sub = Recording("tiny-0", endpoint, index)
        task = asyncio.create_task(sub.run())
        await asyncio.sleep(1.0)  # a ZMQ subscription made after a publish misses it
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"model": vllm_server.model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            answer = await client.post(f"{vllm_server.url}/v1/completions", json=body)
            assert answer.status_code == 200, answer.text
        deadline = time.monotonic() + 10
        while index.matched(mine, ["tiny-0"]).get("tiny-0", 0) < len(mine) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert len(mine) == 2 and index.matched(mine, ["tiny-0"]) == {"tiny-0": 2}
    assert index.matched(token_block_hashes(prompt[1:], VLLM_CPU_BLOCK_SIZE), ["tiny-0"]) == {"tiny-0": 0}
    # with vLLM's defaults (sha256, no PYTHONHASHSEED) its published hashes are the router's chain, as ints
    assert [_low64(h) for h in mine] == [h for h in seen if h in {_low64(x) for x in mine}]

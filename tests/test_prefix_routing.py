"""Prefix-cache-aware routing: vLLM's block hashes, the prefix index, the cache-aware and prefix
routes, and the router keeping a conversation on the instance that holds its prefix."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_harness import CLASS_HEADER, MODEL, RouterUnderTest, serve_router, start_workers

from tessera.core.prefix import PrefixIndex, text_block_hashes, token_block_hashes
from tessera.core.profile import StepProfile
from tessera.core.routing import InstanceLoad, RouteRequest, make_route, seed_stats
from tessera.router.app import Pick

PROFILE = StepProfile("m", 0.01, 0.001, 0.0, 0.01, 0.001, kv_capacity_tokens=1_000_000)


def test_block_hashes_equal_vllms_for_the_same_tokens() -> None:
    kv = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    from vllm.utils.hashing import sha256

    kv.init_none_hash(sha256)
    tokens = list(range(1000, 1050))
    expected, parent = [], None
    for start in range(0, 48, 16):
        parent = kv.hash_block_tokens(sha256, parent, tokens[start : start + 16], None)
        expected.append(bytes(parent))
    assert token_block_hashes(tokens, 16, seed=kv.get_none_hash_seed()) == expected
    assert len(token_block_hashes(tokens[:47], 16)) == 2  # a partial block has no hash


def test_text_hashes_share_a_prefix_and_the_index_matches_leading_runs_with_lru_eviction() -> None:
    short, longer = "a" * 128, "a" * 128 + "b" * 64
    assert text_block_hashes(longer, 64)[:2] == text_block_hashes(short, 64)
    assert text_block_hashes("b" * 64 + "a" * 128, 64)[1] != text_block_hashes(short, 64)[1]
    index = PrefixIndex(capacity_blocks=3)
    index.record("i1", text_block_hashes(short, 64), now=1.0)
    assert index.matched(text_block_hashes(longer, 64), ["i1", "i2"]) == {"i1": 2, "i2": 0}
    index.record("i1", text_block_hashes("c" * 128, 64), now=2.0)  # 4 blocks > 3: the oldest goes
    assert index.matched(text_block_hashes(short, 64), ["i1"]) == {"i1": 0}
    index.forget("i1")
    assert index.blocks("i1") == 0


def _load(name: str, outstanding: int = 0) -> InstanceLoad:
    return InstanceLoad(name, "m", "interactive", PROFILE, 1, outstanding)


def test_cache_aware_route_weighs_cached_prefill_against_the_wait_and_prefix_route_does_not() -> None:
    stats = seed_stats()
    idle = [_load("a"), _load("b")]
    cached_on_b = {"a": 0, "b": 3000}
    req = RouteRequest("m", "interactive", stats, prompt_tokens=3200, cached_tokens=cached_on_b)
    assert make_route("cache-aware").pick(req, idle).instance == "b"
    assert make_route("least-wait").pick(req, idle).instance == "a"  # blind to the cache: name order
    # b holds the prefix but has a queue far longer than the prefill it saves: cache-aware leaves it
    busy_b = [_load("a"), _load("b", outstanding=40)]
    assert make_route("cache-aware").pick(req, busy_b).instance == "a"
    assert make_route("prefix").pick(req, busy_b).instance == "b"  # piles onto the hot instance


async def _conversation(router: RouterUnderTest, turns: int) -> list[str]:
    """Send a growing conversation turn by turn; the instance that served each turn. After the first
    turn, the instance that served it counts one more request in flight (as if a long one ran there),
    so a rule blind to the cache prefers the other instance."""
    picked: list[str] = []
    pick = router.state.pick

    def recording_pick(*args: Any) -> Pick:
        chosen = pick(*args)
        picked.append(chosen.load.instance)
        return chosen

    router.state.pick = recording_pick  # type: ignore[method-assign]
    messages = [{"role": "system", "content": "You answer briefly. " * 40}]
    async with httpx.AsyncClient(timeout=30) as client:
        for turn in range(turns):
            messages.append({"role": "user", "content": f"question {turn}"})
            body = {"model": MODEL, "messages": messages, "max_tokens": 4}
            resp = await client.post(f"{router.url}/v1/chat/completions", json=body,
                                     headers={CLASS_HEADER: "chat"})  # fmt: skip
            assert resp.status_code == 200, resp.text
            messages.append({"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]})
            if turn == 0:
                next(x for x in router.state.loads.values() if x.instance == picked[0]).outstanding += 1
    return picked


@pytest.mark.integration
async def test_router_keeps_a_conversation_on_the_instance_holding_its_prefix(tmp_path: Path) -> None:
    supervisor = start_workers(tmp_path, 2)
    try:
        async with serve_router(supervisor.workers, route="cache-aware") as router:
            served = await _conversation(router, 4)
            async with httpx.AsyncClient() as client:
                status = (await client.get(f"{router.url}/router/status")).json()
        assert served == [served[0]] * 4, served  # every turn went where the conversation's prefix is
        blocks = {r["instance"]: r["cachedPrefixBlocks"] for r in status["instances"]}
        assert blocks[served[0]] > 0 and sum(blocks.values()) == blocks[served[0]]
        row = next(r for r in status["instances"] if r["instance"] == served[0])
        assert 0 < row["prefixCachedTokens"] < row["prefixPromptTokens"]  # turns 2-4 hit the cache
        last = status["recentDecisions"][-1]
        assert last["chosen"] == served[0] and {c["instance"] for c in last["candidates"]} == set(blocks)
        assert set(last["candidates"][0]["scores"]) == {
            "expected-ttft",
            "role-preference",
            "outstanding",
            "name",
        }
        async with serve_router(supervisor.workers, route="least-wait") as router:
            served = await _conversation(router, 4)
        assert served[1] != served[0]  # the control: blind to the cache, the busier instance is left
    finally:
        supervisor.stop_all()


def test_a_session_sticks_to_its_instance_while_that_has_slo_headroom() -> None:
    stats = seed_stats()
    a, b = _load("a"), _load("b")
    req = RouteRequest("m", "interactive", stats, prompt_tokens=100, ttft_slo_s=1.0, session_instance="b")
    assert make_route("slo-prefix").pick(req, [a, b]).instance == "b"
    assert make_route("cache-aware").pick(req, [a, b]).instance == "a"  # (blind to sessions: name order)
    # a holds the prompt, so its first token would come sooner; b still meets the SLO: the session stays
    cached = RouteRequest("m", "interactive", stats, prompt_tokens=100, cached_tokens={"a": 99},
                          ttft_slo_s=1.0, session_instance="b")  # fmt: skip
    assert make_route("slo-prefix").pick(cached, [a, b]).instance == "b"
    # Without a session the sooner first token wins.
    free = RouteRequest("m", "interactive", stats, prompt_tokens=100, cached_tokens={"a": 99}, ttft_slo_s=1.0)
    assert make_route("slo-prefix").pick(free, [a, b]).instance == "a"
    b.prefill.sent(50_000, 0.0, PROFILE)  # b's backlog: 50 s to first token, over the 1 s SLO
    assert make_route("slo-prefix").pick(req, [a, b]).instance == "a"


def test_combined_leaves_a_busy_cache_holder_within_the_slo_when_another_instance_answers_sooner() -> None:
    """Ranked by cached tokens first, slo-prefix ignored a busy holder until the SLO broke: with an SLO
    far above the TTFTs it was prefix affinity alone."""
    stats = seed_stats()
    holder, idle = _load("holder"), _load("idle")
    holder.prefill.sent(2_000, 0.0, PROFILE)  # 2 s of prefill ahead, within the 10 s SLO
    req = RouteRequest(
        "m", "interactive", stats, prompt_tokens=1_000, cached_tokens={"holder": 900}, ttft_slo_s=10.0
    )
    assert make_route("prefix").pick(req, [holder, idle]).instance == "holder"
    assert make_route("slo-prefix").pick(req, [holder, idle]).instance == "idle"  # 1 s of prefill < 2.1 s
    # 1.5 s later the holder has computed most of its backlog: 0.51 s left + 0.11 s for its missed tokens
    later = RouteRequest("m", "interactive", stats, 1.5, prompt_tokens=1_000, cached_tokens={"holder": 900},
                         ttft_slo_s=10.0)  # fmt: skip
    assert make_route("slo-prefix").pick(later, [holder, idle]).instance == "holder"


@pytest.mark.integration
async def test_router_keeps_a_users_requests_on_one_instance(tmp_path: Path) -> None:
    supervisor = start_workers(tmp_path, 2)
    try:
        async with serve_router(supervisor.workers, route="slo-prefix") as router:
            picked: list[str] = []
            pick = router.state.pick

            def recording_pick(*args: Any) -> Pick:
                chosen = pick(*args)
                picked.append(chosen.load.instance)
                return chosen

            router.state.pick = recording_pick  # type: ignore[method-assign]
            async with httpx.AsyncClient(timeout=30) as client:
                for n, user in enumerate(["ann", "ann", "ann", "bob"]):
                    body = {
                        "model": MODEL,
                        "max_tokens": 2,
                        "user": user,
                        "messages": [{"role": "user", "content": f"unrelated question number {n} " * 5}],
                    }
                    resp = await client.post(f"{router.url}/v1/chat/completions", json=body,
                                             headers={CLASS_HEADER: "chat"})  # fmt: skip
                    assert resp.status_code == 200, resp.text
                    if n == 0:  # ann's instance gets busier: only her session keeps her there
                        next(
                            x for x in router.state.loads.values() if x.instance == picked[0]
                        ).outstanding += 1
        assert picked[:3] == [picked[0]] * 3, picked
        assert picked[3] != picked[0]  # bob has no session yet: the less busy instance
    finally:
        supervisor.stop_all()


def _started(model: str, when: float) -> str:
    return f'tessera_engine_start_time_seconds{{model="{model}"}} {when}\n'


def test_an_engine_whose_start_time_changes_loses_its_prefix_entries_and_sessions() -> None:
    from tessera.api.worker_config import WorkerConfig
    from tessera.router.app import RouterState
    from tessera.router.backends import Backend

    config = WorkerConfig.model_validate({"models": [{"name": "m", "engine": "sim"}]})
    state = RouterState(
        [Backend(name=n, url=f"http://{n}", config=config) for n in ("a", "b")], route="slo-prefix"
    )
    for name in ("a", "b"):
        state.set_health(name, True)
        state.observe(name, _started("m", 100.0))
    state.pick("m", "interactive", set(), "x" * 640, session="ann")
    chosen = state.sessions["ann"]
    other = ({"a", "b"} - {chosen}).pop()
    state.pick("m", "interactive", {chosen}, "y" * 640, session="bob")
    assert state.prefixes["m"].blocks(chosen) == 10 and state.prefixes["m"].blocks(other) == 10
    state.observe(chosen, _started("m", 100.0))  # the same engine: nothing forgotten
    assert state.prefixes["m"].blocks(chosen) == 10
    state.observe(chosen, _started("m", 160.0))  # restarted between two polls, never seen down
    assert state.prefixes["m"].blocks(chosen) == 0 and "ann" not in state.sessions
    assert state.prefixes["m"].blocks(other) == 10 and state.sessions["bob"] == other


@pytest.mark.integration
async def test_router_drops_the_prefix_entries_of_a_worker_that_restarted(tmp_path: Path) -> None:
    from tessera.router.app import poll

    supervisor = start_workers(tmp_path, 2)
    try:
        # Polled once at start only: the restart below happens between two polls, unseen as an outage.
        async with (
            serve_router(supervisor.workers, route="slo-prefix", poll_interval_s=3600) as router,
            httpx.AsyncClient(timeout=30) as client,
        ):
            for user in ("ann", "bob"):
                body = {
                    "model": MODEL,
                    "max_tokens": 2,
                    "user": user,
                    "messages": [{"role": "user", "content": f"{user} asks a long question " * 20}],
                }
                resp = await client.post(f"{router.url}/v1/chat/completions", json=body,
                                         headers={CLASS_HEADER: "chat"})  # fmt: skip
                assert resp.status_code == 200, resp.text
                if user == "ann":  # her instance looks busier: bob goes to the other one
                    next(x for x in router.state.loads.values()
                         if x.instance == router.state.sessions["ann"]).outstanding += 1  # fmt: skip

            async def blocks() -> dict[str, int]:
                rows = (await client.get(f"{router.url}/router/status")).json()["instances"]
                return {r["instance"]: r["cachedPrefixBlocks"] for r in rows}

            ann, bob = router.state.sessions["ann"], router.state.sessions["bob"]
            assert ann != bob
            await poll(router.state, client)  # a poll of unchanged workers forgets nothing
            before = await blocks()
            assert before[ann] > 0 and before[bob] > 0
            old = next(w for w in supervisor.workers if w.instance.name == ann)
            supervisor.stop([old])
            supervisor.wait_ready(supervisor.launch(old.instance), time.monotonic() + 60)
            router.state.update([w.backend() for w in supervisor.workers])  # its new address
            await poll(router.state, client)
            after = await blocks()
        assert router.healthy() == {ann: True, bob: True}  # never out of the rotation
        assert after == {ann: 0, bob: before[bob]}
        assert "ann" not in router.state.sessions and router.state.sessions["bob"] == bob
    finally:
        supervisor.stop_all()


async def test_a_streamed_answers_prompt_stops_counting_as_prefill_ahead_at_its_first_token(
    tmp_path: Path,
) -> None:
    """expected-ttft charges the prefill of the prompts on an instance that have no first token yet: a
    stream that is decoding no longer delays the next request's first token by its prefill."""
    supervisor = start_workers(tmp_path, 1)
    try:
        async with serve_router(supervisor.workers, route="cache-aware") as router:
            load = next(iter(router.state.loads.values()))
            body = {"model": MODEL, "prompt": "tell me a story " * 50, "max_tokens": 400, "ignore_eos": True,
                    "stream": True}  # fmt: skip
            url, headers = f"{router.url}/v1/completions", {CLASS_HEADER: "chat"}
            async with (
                httpx.AsyncClient(timeout=30) as client,
                client.stream("POST", url, json=body, headers=headers) as resp,
            ):
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if '"finish_reason": null' in line:
                        break  # the first token has reached the client
                during = (load.outstanding, load.prefill.tokens)
                row = (await client.get(f"{router.url}/router/status")).json()["instances"][0]
            deadline = time.monotonic() + 10  # the relay ends when the router sees the client leave
            while load.outstanding and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        assert during == (1, 0)
        assert row["outstanding"] == 1 and row["promptTokensBeforeFirstToken"] == 0
        assert (load.outstanding, load.prefill.tokens) == (0, 0)  # nothing left over at the end
    finally:
        supervisor.stop_all()

"""Prefix caching in the simulator, Mooncake traces with block ids, and `tessera bench routing`."""

from __future__ import annotations

import gzip
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tessera.api.traces import load_trace
from tessera.bench.runner import run_one
from tessera.bench.scenarios import BenchConfig, Options
from tessera.bench.scenarios.routing import run
from tessera.core.profile import StepProfile
from tessera.core.registry import make_policy
from tessera.core.request import Request
from tessera.sim.cluster import ClusterConfig, ClusterView, RouteRouter
from tessera.sim.engine import EngineConfig, SimInstance

PROFILE = StepProfile("m", 0.01, 0.001, 0.0, 0.01, 0.0001, kv_capacity_tokens=100_000)


def _write(path: Path, rows: list[dict]) -> Path:
    with gzip.open(path, "wt") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def test_mooncake_rows_keep_their_block_ids_and_bad_ones_are_refused_with_the_line(tmp_path: Path) -> None:
    good = [{"timestamp": 0, "input_length": 1000, "output_length": 3, "hash_ids": [0, 1]},
            {"timestamp": 50, "input_length": 600, "output_length": 2, "hash_ids": [0, 2]}]  # fmt: skip
    rows = load_trace(_write(tmp_path / "ok.jsonl.gz", good))
    assert rows[0].hash_ids == (0, 1) and rows[1].arrival == pytest.approx(0.05)
    bad = [{**good[0], "hash_ids": [0, "x"]}]
    with pytest.raises(ValueError, match=r"bad\.jsonl\.gz:1: hash_ids must be a list of non-negative"):
        load_trace(_write(tmp_path / "bad.jsonl.gz", bad))
    short = [{**good[0], "hash_ids": [0]}]
    with pytest.raises(ValueError, match=r":1: hash_ids has 1 ids but input_length 1000 makes 2 blocks"):
        load_trace(_write(tmp_path / "short.jsonl.gz", short))
    backwards = [good[1], good[0]]
    with pytest.raises(ValueError, match=r":2: timestamp 0 is before the previous row's"):
        load_trace(_write(tmp_path / "back.jsonl.gz", backwards))


def _req(rid: str, at: float, blocks: tuple[int, ...], prompt: int) -> Request:
    return Request(rid, at, prompt, 2, true_output_tokens=2, prefix_blocks=blocks, prefix_block_tokens=512)


def test_the_simulators_prefix_cache_skips_the_cached_prefill_only_when_on() -> None:
    reqs = [_req("a", 0.0, (1, 2, 3), 1536), _req("b", 10.0, (1, 2, 4), 1536), _req("c", 20.0, (9,), 512)]
    runs = {}
    for on in (False, True):
        config = ClusterConfig(profiles={"default": PROFILE}, instances=1,
                               engine=EngineConfig(prefix_caching=on))  # fmt: skip
        done, _ = run_one(reqs, lambda: make_policy("fcfs"), config)
        runs[on] = {r.id: r for r in done}
    assert [runs[True][x].cached_prompt_tokens for x in "abc"] == [0, 1024, 0]
    assert all(r.cached_prompt_tokens == 0 for r in runs[False].values())
    ttft = {on: runs[on]["b"].first_token_at - 10.0 for on in runs}  # type: ignore[operator]
    assert ttft[True] == pytest.approx(ttft[False] - 1024 * PROFILE.prefill_p1)


def test_cache_aware_routing_in_the_simulator_sends_a_shared_prefix_where_it_is_cached() -> None:
    config = ClusterConfig(
        profiles={"default": PROFILE}, instances=2, engine=EngineConfig(prefix_caching=True)
    )
    reqs = [_req(f"r{i}", i * 5.0, (7, 8, 9 + i), 1536) for i in range(6)]
    done, _ = run_one(reqs, lambda: make_policy("fcfs"), config, router=RouteRouter("cache-aware"))
    assert len({r.instance for r in done}) == 1 and sum(r.cached_prompt_tokens for r in done) == 5 * 1024
    done, _ = run_one(reqs, lambda: make_policy("fcfs"), config, router=RouteRouter("round-robin"))
    assert len({r.instance for r in done}) == 2


def test_bench_routing_rows_and_checks_on_the_mooncake_trace() -> None:
    config = BenchConfig("routing", options=Options({"requests": 300, "loads": "0.8"}))
    report = run(config, lambda *a, **k: None)
    names = [r["policy"] for r in report.results]
    rows = ("round-robin", "least-loaded", "wait", "prefix", "precise-prefix", "cache-aware", "combined")
    assert names == [f"{n}:load=0.8" for n in rows]
    by = {r["policy"].split(":")[0]: r for r in report.results}
    assert by["prefix"]["cache_hit_rate"] > by["round-robin"]["cache_hit_rate"]
    assert by["precise-prefix"]["cache_hit_rate"] > by["round-robin"]["cache_hit_rate"]
    assert by["combined"]["prefill_tokens"] < by["round-robin"]["prefill_tokens"]
    assert np.isfinite(by["combined"]["p99_ttft_s"])
    # judged against the four baselines, reported against cache-aware and precise-prefix
    assert len([c for c in report.checks if c.startswith("combined vs ")]) == 6
    assert [c for c in report.checks if c.startswith("precise-prefix vs prefix:load=0.8: SLO ")]
    # every route against least-loaded on throughput and TTFT p99 (default tolerance 10%)
    against = [c for c in report.checks if " vs least-loaded:load=0.8: throughput " in c]
    assert len(against) == 6 and all("p99_ttft" in c and c.endswith(("PASS", "FAIL")) for c in against)


def test_slo_headroom_keeps_the_instances_that_meet_the_ttft_slo_and_slo_prefix_ranks_them_by_ttft() -> None:
    from tessera.core.routing import InstanceLoad, RouteRequest, make_route, seed_stats, slo_headroom

    hot = InstanceLoad("hot", "m", "interactive", PROFILE, 4, outstanding=1)
    hot.prefill.sent(30_000, 0.0, PROFILE)
    cold = InstanceLoad("cold", "m", "interactive", PROFILE, 4)
    stats = seed_stats()
    req = RouteRequest(
        "m", "interactive", stats, prompt_tokens=2000, cached_tokens={"hot": 1900}, ttft_slo_s=1.0
    )
    assert slo_headroom(req, [hot, cold]) == [cold]  # 30k tokens of backlog: 3 s > 1 s on "hot"
    assert make_route("slo-prefix").pick(req, [hot, cold]).instance == "cold"
    assert make_route("prefix").pick(req, [hot, cold]).instance == "hot"
    relaxed = RouteRequest(
        "m", "interactive", stats, prompt_tokens=2000, cached_tokens={"hot": 1900}, ttft_slo_s=10.0
    )
    # both meet a 10 s SLO; cold's first token comes sooner (0.21 s of prefill against 3.02 s)
    assert make_route("slo-prefix").pick(relaxed, [hot, cold]).instance == "cold"
    warm = InstanceLoad("warm", "m", "interactive", PROFILE, 4, outstanding=1)
    warm.prefill.sent(1_000, 0.0, PROFILE)  # 0.11 s ahead + 0.02 s for the 100 missed tokens < 0.21 s
    assert (
        make_route("slo-prefix").pick(replace(relaxed, cached_tokens={"warm": 1900}), [warm, cold]).instance
        == "warm"
    )


def test_the_simulators_expected_ttft_tracks_the_ttft_on_a_prefix_sharing_trace() -> None:
    """The prefill ahead of a request counts what the instance will compute (cache hits excluded) and
    what is left of it (a prefill under way has done part): the expected time to the first token at the
    chosen instance is the simulated TTFT give or take a decode step. Counting whole prompts until their
    first token overshot it by up to seconds on the Mooncake trace."""
    from tessera.bench.runner import cluster_config_from, trace_requests
    from tessera.bench.scenarios._common import saturation_rate, with_rate
    from tessera.bench.scenarios.routing import MOONCAKE
    from tessera.core.routing import InstanceLoad, RouteRequest, WaitSettings, ttft_scorer

    expected_ttft = ttft_scorer(WaitSettings())

    class Recording(RouteRouter):
        def __init__(self) -> None:
            super().__init__("slo-prefix")
            self.expected: dict[str, float] = {}
            rule, record = self.rule, self.expected

            class Wrapped:
                def pick(self, req: RouteRequest, loads: list[InstanceLoad]) -> InstanceLoad:
                    chosen = rule.pick(req, loads)
                    record[current[0]] = expected_ttft(req, chosen)
                    return chosen

            self.rule = Wrapped()  # type: ignore[assignment]

        def route(self, req: Request, view: ClusterView) -> SimInstance:
            current[0] = req.id
            return super().route(req, view)

    current = [""]
    base = trace_requests(BenchConfig("routing"), MOONCAKE, 400)
    plain = cluster_config_from({}, instances=4)
    config = replace(plain, engine=replace(plain.engine, prefix_caching=True))
    reqs = with_rate(base, 0.9 * saturation_rate(base, plain))
    router = Recording()
    done, _ = run_one(reqs, lambda: make_policy("fcfs"), config, router=router)
    error = np.array([router.expected[r.id] - (r.first_token_at - r.arrival) for r in done])
    assert len(error) == 400 and np.percentile(np.abs(error), 95) < 0.05, np.percentile(error, [5, 50, 95])


def test_chat_sessions_of_real_prompts_share_their_history_as_vllm_block_hashes() -> None:
    from tessera.bench.chat_sessions import CHAT_BLOCK_TOKENS, sim_chat_requests

    reqs = sim_chat_requests(8, turns=4, seed=0)
    first, second = (r for r in reqs if r.id in ("s0-0", "s0-1"))
    assert second.prompt_text.startswith(first.prompt_text) and second.prompt_tokens > first.prompt_tokens
    full = first.prompt_tokens // CHAT_BLOCK_TOKENS
    assert len(first.prefix_blocks) == full > 0 and first.prefix_block_tokens == CHAT_BLOCK_TOKENS
    # the next turn extends the conversation: its chain starts with every full block of the first
    # turn's prompt, then parts (the answer and the next question follow)
    assert second.prefix_blocks[:full] == first.prefix_blocks and len(second.prefix_blocks) > full
    other = next(r for r in reqs if r.id == "s1-0")
    assert other.prefix_blocks[0] != first.prefix_blocks[0]


def test_bench_routing_on_chat_sessions_reuses_the_history() -> None:
    config = BenchConfig("routing", options=Options({"workload": "chat", "requests": 200, "loads": "0.8"}))
    report = run(config, lambda *a, **k: None)
    assert report.config["workload"] == "chat"
    by = {r["policy"].split(":")[0]: r for r in report.results}
    assert by["combined"]["cache_hit_rate"] > by["round-robin"]["cache_hit_rate"] > 0
    with pytest.raises(ValueError, match="workload= must be 'mooncake' or 'chat'"):
        run(BenchConfig("routing", options=Options({"workload": "sharegpt"})), lambda *a, **k: None)

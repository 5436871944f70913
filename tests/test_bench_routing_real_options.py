"""``tessera bench routing --set engine=vllm``: its options, refused before any vLLM starts when bad, and
the backends file and worker configuration it gives the router (no vLLM here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.bench.real_routing import (
    COMPARISONS,
    backends_document,
    parse_options,
    reuse_ceiling,
    worker_config,
)
from tessera.bench.scenarios import BenchConfig
from tessera.bench.scenarios.routing import run
from tessera.core.routing import ROUTES
from tessera.router.backends import parse_backends


def test_the_default_comparison_is_still_combined_against_round_robin_on_vllms_own_cache() -> None:
    o = parse_options({})
    assert o.compare == "combined"
    assert o.comparison.rows == {"combined": "slo-prefix", "round-robin": "round-robin"}
    assert (o.sessions, o.rounds, o.kv_blocks) == (4, 2, None)


def test_compare_precise_runs_precise_against_approximate_on_an_evicting_cache() -> None:
    o = parse_options({"compare": "precise"})
    assert o.comparison.rows == {
        "precise-prefix": "precise-prefix",
        "prefix": "prefix",
        "round-robin": "round-robin",
    }
    assert o.comparison.pairs[0] == ("precise-prefix", "prefix")
    assert (o.sessions, o.rounds, o.kv_blocks) == (12, 3, 17)
    # options given win over the comparison's defaults
    o = parse_options({"compare": "precise", "sessions": "6", "rounds": "5", "kv_blocks": "20"})
    assert (o.sessions, o.rounds, o.kv_blocks) == (6, 5, 20)


def test_every_row_of_every_comparison_is_a_route_of_the_router() -> None:
    for comparison in COMPARISONS.values():
        assert set(comparison.rows.values()) <= set(ROUTES)
        assert all(a in comparison.rows and b in comparison.rows for a, b in comparison.pairs)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"compare": "exact"}, "compare= must be one of combined, precise, got 'exact'"),
        ({"compare": "precise", "kv_blocks": "16"}, "kv_blocks must be >= 17"),
        ({"kv_blocks": "lots"}, "kv_blocks"),
        ({"compare": "precise", "rounds": "0"}, "rounds, max_tokens and batch must be >= 1"),
        ({"ttft_slo": "0"}, "ttft_slo > 0"),
    ],
)
def test_bad_options_are_refused_with_the_option_named(options: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_options(options)


def test_the_routing_scenario_refuses_a_bad_comparison_before_starting_vllm() -> None:
    # no vLLM on this path: the refusal comes from the options, not from a failed start
    with pytest.raises(ValueError, match="compare="):
        run(BenchConfig("routing", options={"engine": "vllm", "compare": "nope"}), lambda *a, **k: None)


def test_the_hit_rate_ceiling_reuses_the_full_blocks_of_each_previous_turn() -> None:
    # turns of 100, 300, 700 tokens: turn 2 reuses 0 blocks of 100, turn 3 two 128-token blocks of 300
    assert reuse_ceiling({"a": [100, 300, 700]}) == pytest.approx(256 / 1100)
    assert reuse_ceiling({"a": [200], "b": [130, 140]}) == pytest.approx(128 / 470)
    assert reuse_ceiling({}) == 0.0


def test_a_small_cache_is_told_to_the_workers_and_the_routers_approximate_index(tmp_path: Path) -> None:
    tokenizer = tmp_path / "smollm2"
    configs = [worker_config(f"http://127.0.0.1:{p}", tokenizer, {}, 3.0, 4, 17) for p in (8001, 8002)]
    doc = backends_document(["http://127.0.0.1:9001", "http://127.0.0.1:9002"], configs,
                            ["tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"])  # fmt: skip
    backends = parse_backends(doc)
    # one of the 17 blocks is vLLM's null block, never filled
    assert [b.config.models[0].kv_capacity_tokens for b in backends] == [2048, 2048]
    assert [[s.endpoint for s in b.kv_events] for b in backends] == [
        ["tcp://127.0.0.1:5557"],
        ["tcp://127.0.0.1:5558"],
    ]
    # vLLM's own cache (no kv_blocks): the configuration's default capacity, and no feeds without events
    own_cache = worker_config("http://127.0.0.1:8001", tokenizer, {}, 3.0, 4, None)
    plain = backends_document(["http://127.0.0.1:9001"], [own_cache], [None])
    (backend,) = parse_backends(plain)
    assert backend.kv_events == [] and backend.config.models[0].kv_capacity_tokens == 65536

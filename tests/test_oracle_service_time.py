"""The oracle bounds order by true service time in the step profile, not by output tokens alone.

On prompt-heavy traces (Mooncake: prompts of 12k tokens on average, answers of 190, the two
negatively correlated) the prefill is most of what a request costs the instance; ordering by output
length there ran the longest prompts first, and SRTF displaced running requests for arrivals whose
prefill alone outlasted the displaced requests' whole remaining decode.
"""

from __future__ import annotations

import numpy as np
import pytest

from tessera.core import InstanceView, Phase, Request
from tessera.core.profiles import load_profile
from tessera.core.registry import make_policy
from tessera.core.slo import jct
from tessera.sim.cluster import Cluster, ClusterConfig
from tessera.sim.engine import EngineConfig
from tessera.sim.workloads import copy_requests

PROFILE = load_profile("a100-llama3-8b")


def _view(running: list[Request], max_batch: int = 1) -> InstanceView:
    used = sum(r.prompt_tokens + r.generated for r in running)
    return InstanceView(10.0, "i0", running, max_batch, PROFILE.kv_capacity_tokens, used, PROFILE)


def test_service_time_is_exec_time_alone_and_a_share_of_the_step_in_a_full_batch() -> None:
    assert PROFILE.service_time(3000, 200, 1) == pytest.approx(PROFILE.exec_time(3000, 200))
    # Eight requests of 1000 context tokens each: their shares of one decode step are the step.
    share = PROFILE.service_time(1000, 1, 8, prefill=False)
    assert 8 * share == pytest.approx(PROFILE.decode_step(8, 8 * 1000))


def test_sjf_oracle_runs_the_shorter_job_not_the_shorter_answer() -> None:
    # 30,000 prompt tokens and 10 to answer: a 2.6 s prefill. 100 prompt tokens and 200 to answer: 1.6 s.
    long_prompt = Request("prompt", 0.0, 30_000, 1000, true_output_tokens=10)
    long_answer = Request("answer", 1.0, 100, 1000, true_output_tokens=200)
    sjf = make_policy("sjf-oracle")
    for r in (long_prompt, long_answer):
        sjf.add(r, 1.0)
    assert [r.id for r in sjf.schedule(_view([])).run] == ["answer"]


def test_srtf_oracle_keeps_a_request_whose_remaining_decode_is_shorter_than_the_arrivals_prefill() -> None:
    srtf = make_policy("srtf-oracle")
    running = Request("running", 0.0, 100, 1000, true_output_tokens=250)
    srtf.add(running, 0.0)
    assert [r.id for r in srtf.schedule(_view([])).run] == ["running"]
    running.phase, running.kv_resident, running.generated = Phase.RUNNING, True, 50  # 200 left: 1.6 s
    arrival = Request("arrival", 5.0, 30_000, 1000, true_output_tokens=10)  # fewer tokens, 2.6 s of work
    srtf.add(arrival, 5.0)
    assert [r.id for r in srtf.schedule(_view([running])).run] == ["running"]
    # Displaced with its KV dropped, the same request would re-prefill its context: it is keyed so.
    keyed = srtf.key(running, 5.0)[0]
    running.kv_resident = False
    rekeyed = keyed + PROFILE.prefill(150) - PROFILE.decode_step(1, 150)  # the first token from the prefill
    assert srtf.key(running, 5.0)[0] == pytest.approx(rekeyed)


def _prompt_heavy(seed: int, n: int = 160) -> list[Request]:
    """Half short answers to long prompts, half longer answers to short prompts, in random order."""
    rng = np.random.default_rng(seed)
    heavy = rng.random(n) < 0.5
    prompts = np.where(heavy, rng.integers(10_000, 30_000, n), rng.integers(50, 500, n))
    outputs = np.where(heavy, rng.integers(1, 20, n), rng.integers(50, 300, n))
    arrivals = np.cumsum(rng.exponential(1 / 0.9, n))  # about the instance's capacity at batch 8
    return [
        Request(f"r{i}", float(t), int(p), 1000, true_output_tokens=int(o))
        for i, (t, p, o) in enumerate(zip(arrivals, prompts, outputs, strict=True))
    ]


@pytest.mark.parametrize("seed", [0, 1])
def test_oracles_bound_fcfs_on_a_prompt_heavy_workload(seed: int) -> None:
    config = ClusterConfig({"default": PROFILE}, 1, EngineConfig(max_batch=8))
    base = _prompt_heavy(seed)
    mean = {}
    for policy in ("fcfs", "sjf-oracle", "srtf-oracle"):
        reqs = copy_requests(base)
        Cluster(config, lambda p=policy: make_policy(p)).run(reqs)
        mean[policy] = float(np.mean([jct(r) for r in reqs]))
    assert mean["sjf-oracle"] <= mean["fcfs"], mean
    assert mean["srtf-oracle"] <= mean["fcfs"], mean

"""The simulator's side of ``real-sharing``: the same requests on a co-resident instance of the two
models (``tessera.sim.coresident``), under the same policies and batch bound, with step profiles fitted
on the same servers (``tessera.bench.measure``)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np

from tessera.core.policies.seallm import DoublingBudget, ServiceStats
from tessera.core.profile import StepProfile
from tessera.core.registry import make_policy
from tessera.core.request import Request

Plan = Sequence[tuple[float, str, list[int], int]]  # (arrival s, model, prompt ids, output tokens)


def simulated_run(
    profiles: dict[str, StepProfile], plan: Plan, policy: str, batch: int, slo_scale: float
) -> dict[str, tuple[float, float]]:
    """Mean normalized latency and SLO attainment (``JCT <= slo_scale`` x the request's isolated time on
    its profile) of ``plan`` on one co-resident instance, for both services ("all") and each model."""
    from tessera.sim.cluster import Cluster, ClusterConfig
    from tessera.sim.engine import EngineConfig

    isolated = {m: statistics.mean(p.exec_time(len(r[2]), r[3]) for r in plan if r[1] == m)
                for m, p in profiles.items()}  # fmt: skip
    if policy == "seallm":
        stats = {m: ServiceStats(isolated[m], starvation_s=0.5 * slo_scale * isolated[m]) for m in profiles}
        chosen = DoublingBudget(stats)
    else:
        chosen = make_policy(policy)
    # As the worker's engines run: vLLM V1 (mixed prefill), preemption by abort (no swap space), each
    # engine's --max-num-seqs at the batch bound.
    config = EngineConfig(max_batch=batch, chunked_prefill=True, swap_space_tokens=0, co_resident=True,
                          max_running=batch)  # fmt: skip
    reqs = [
        Request(f"r{i}", at, len(prompt), n, model=model, true_output_tokens=n)
        for i, (at, model, prompt, n) in enumerate(plan)
    ]
    Cluster(ClusterConfig(dict(profiles), 1, config), lambda: chosen).run(reqs)
    out: dict[str, tuple[float, float]] = {}
    for name, mine in [("all", reqs), *((m, [r for r in reqs if r.model == m]) for m in profiles)]:
        norm = [(r.finished_at - r.arrival) / isolated[r.model] for r in mine]
        met = [(r.finished_at - r.arrival) <= slo_scale * isolated[r.model] for r in mine]
        out[name] = (float(np.mean(norm)), float(np.mean(met)))
    return out


def simulated_ratios(
    profiles: dict[str, StepProfile], plans: Sequence[Plan], batch: int, slo_scale: float
) -> dict[str, float]:
    """The median over ``plans`` of fcfs's mean normalized latency over seallm's, for both services
    ("all") and each model."""
    ratios: dict[str, list[float]] = {}
    for plan in plans:
        fcfs = simulated_run(profiles, plan, "fcfs", batch, slo_scale)
        seallm = simulated_run(profiles, plan, "seallm", batch, slo_scale)
        for name in fcfs:
            ratios.setdefault(name, []).append(fcfs[name][0] / seallm[name][0])
    return {name: statistics.median(values) for name, values in ratios.items()}

"""Scenario ``real-policy``: scheduling policies through the worker on real vLLM, next to the
simulator on the same requests.

One vLLM server on the offline tiny model; for each policy a `tessera worker` with that policy and a
small batch bound (``batch``, default 4) so that requests queue. The random-weight model's output
length is set exactly by ``max_tokens`` with ``ignore_eos``, so every length is known. Two workloads,
the same for every policy (seeded):

- ``mixed``: ``requests`` (60) held-out AlpacaEval prompts (text, cut to ``prompt_chars``) whose output
  length is their reference response's length in tokens / 2, clipped to 4..400 (mixed: a long
  tail), Poisson arrivals at ``load`` (1.3) x the simulator's capacity for these requests; rows
  ``POLICY:mixed``. Target: ISRTF mean JCT below FCFS.
- ``burst``: ``burst`` (40) requests at once (other AlpacaEval prompts, cut to 64 characters),
  64-160 tokens, interactive class with reading speed
  20 tokens/s and T* 1 s; rows ``POLICY:burst`` with the average Andes QoE computed from the token
  arrival times the client saw. Target: QoE policy above FCFS.

Each policy has its own worker; ``rounds`` (3) rounds run every policy on both workloads in turn,
so the 2-core machine's drifting load hits all policies alike. Rows are per-field medians over the
rounds; the checks give the median of the per-round (paired) ratios to FCFS and list each round's.

Policies: ``fcfs``, ``isrtf`` (the ELIS predictor ``predictor``: ``text`` when its trained artifact is
installed, else the ``running-mean`` fallback; the row says which), ``srtf-oracle`` (ISRTF with the
true length: the bench sends it in the benchmark-only ``X-Tessera-True-Output-Tokens`` header, which
the worker accepts only with ``scheduling.benchHints``), ``qoe``.

Known cost the simulator does not charge: the text predictor (static-embedding encoder and head,
about 10 ms per batch of 16 on this 2-core CPU; `tessera predictor eval --latency`) runs on a thread
of the worker before each decision, so tokens keep streaming meanwhile, but it takes CPU from vLLM on
the same two cores and delays the decision.

The simulator side: a step profile fitted on the same server (``tessera profile``'s measurement),
then every policy through ``tessera.sim`` on the same requests with the same batch bound; rows
``POLICY:WORKLOAD:sim``. The check lines put the real ratio to FCFS next to the simulated one.
Options (``--set``): requests, load, batch, burst, prompt_chars, predictor, policies, rounds, sim (1/0).
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from tessera.bench.machine import MachineWatch
from tessera.bench.runner import SHARED_DATA, option
from tessera.bench.scenarios import BenchConfig, BenchReport, Progress

DESCRIPTION = "policies through the worker on real vLLM (tiny model) vs the simulator: JCT and burst QoE"
TRACE_REFUSED = (
    "it sends held-out AlpacaEval prompts (mixed) and bursts to real workers; size them with "
    "--set requests=, burst= and --load"
)
READING_TPS = 20.0
TTFT_TARGET_S = 1.0
BUDGET_TOKENS = 2048  # vLLM --max-num-batched-tokens, and the simulator's token budget
ALPACA_TEXT = SHARED_DATA / "alpacaeval_responses_text.jsonl.gz"
WINDOW_TOKENS = 50  # ELIS' window: ISRTF and the oracle re-rank every 50 tokens


def _default_predictor() -> str:
    from tessera.predictor.train import DEFAULT_ARTIFACT_DIR, META_FILE

    return "text" if (DEFAULT_ARTIFACT_DIR / META_FILE).exists() else "running-mean"


def _mixed(seed: int, n: int, prompt_chars: int, counter: Any) -> list[dict[str, Any]]:
    """Prompt text, prompt tokens (tiny tokenizer, with BOS) and output length of ``n`` requests."""
    from tessera.predictor.dataset import load_pairs, sample_rows
    from tessera.predictor.tokens import token_counter

    pairs = load_pairs(ALPACA_TEXT)
    if len(pairs) < n:
        raise ValueError(f"--set requests={n}: {ALPACA_TEXT} has only {len(pairs)} rows")
    rows = sample_rows(pairs, n, seed)
    random.Random(seed).shuffle(rows)
    reference = token_counter(None)
    out = []
    for pair in rows:
        text = pair.prompt[:prompt_chars]
        length = int(np.clip(round(reference.count(pair.response) / 2), 4, 400))
        out.append({"text": text, "prompt_tokens": counter.count(text) + 1, "out": length,
                    "response": pair.response})  # fmt: skip
    return out


def _qoe(stat: Any) -> float:
    from tessera.core.qoe import QoEParams, qoe_from_delivery

    params = QoEParams(stat.sent, TTFT_TARGET_S, READING_TPS)
    return float(qoe_from_delivery(np.array(stat.times), params))


def _row(name: str, stats: list[Any]) -> dict[str, Any]:
    jcts = np.array([s.jct for s in stats])
    qoes = np.array([_qoe(s) for s in stats])
    return {
        "policy": name,
        "requests": len(stats),
        "mean_jct_s": float(jcts.mean()),
        "p99_jct_s": float(np.percentile(jcts, 99)),
        "mean_ttft_s": float(np.mean([s.ttft for s in stats])),
        "avg_qoe": float(qoes.mean()),
        "qoe_ge_095_share": float(np.mean(qoes >= 0.95)),
        "output_tokens": int(sum(s.tokens for s in stats)),
    }


def _worker_config(url: str, policy: str, batch: int, predictor: str) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    if policy == "isrtf":
        settings = {"predictor": predictor, "window_tokens": WINDOW_TOKENS}
    elif policy == "srtf-oracle":
        settings = {"recheck_tokens": WINDOW_TOKENS}
    return {
        "models": [{"name": "tiny", "url": url, "maxModelLen": 1024, "defaultClass": "chat"}],
        "classes": {
            "chat": {
                "slo": {"ttftSeconds": TTFT_TARGET_S},
                "qoe": {"readingSpeedTokensPerSecond": READING_TPS, "ttftTargetSeconds": TTFT_TARGET_S},
            },
            "batch": {"kind": "batch", "slo": {"deadlineSeconds": 600}},
        },
        "scheduling": {
            "policy": policy,
            "settings": settings,
            "batch": {"min": 1, "max": batch},
            "benchHints": True,  # the oracle row's true-length header; never in production
        },
    }


def _sim_requests(plans: dict[str, list[Any]], rows: dict[str, list[dict[str, Any]]]) -> dict[str, list[Any]]:
    from tessera.core.request import Request, ServiceClass

    chat = ServiceClass(
        "chat", ttft_slo_s=TTFT_TARGET_S, reading_speed_tps=READING_TPS, ttft_target_s=TTFT_TARGET_S
    )
    batch = ServiceClass("batch", "batch", deadline_s=600)
    out: dict[str, list[Any]] = {}
    for workload, plan in plans.items():
        reqs = []
        for i, (at, prompt, n, klass) in enumerate(plan):
            row = rows[workload][i]
            cls = chat if klass == "chat" else batch
            reqs.append(Request(
                f"{workload}{i}", at, row["prompt_tokens"], n, service_class=cls, true_output_tokens=n,
                prompt_text=prompt, response_text=row["response"],
            ))  # fmt: skip
        out[workload] = reqs
    return out


def _sim_policy(name: str, predictor: Any) -> Any:
    from tessera.core.registry import make_policy

    # The worker preempts by aborting the vLLM stream and resubmitting prompt + generated ids
    # (recompute), so the simulator prices preemption the same way, not with the KV kept.
    if name == "isrtf":
        from tessera.core.policies.isrtf import ISRTF

        # the predictor object is a bench variant, not a setting: built directly
        return ISRTF(predictor=predictor, window_tokens=WINDOW_TOKENS, preempt_mode="recompute")
    if name == "srtf-oracle":
        return make_policy("srtf-oracle", recheck_tokens=WINDOW_TOKENS, preempt_mode="recompute")
    return make_policy(name)


def _fit_cluster(server: Any, model_dir: Path, batch: int) -> Any:
    from tessera.bench.measure import measure_and_fit
    from tessera.bench.scenarios.fidelity import _kv_bytes_per_token
    from tessera.sim.cluster import ClusterConfig
    from tessera.sim.engine import EngineConfig

    vocab = min(1000, int(json.loads((model_dir / "config.json").read_text())["vocab_size"]))
    kv_tokens = (1 << 30) // _kv_bytes_per_token(model_dir)
    profile, _ = measure_and_fit(
        server.url, server.model_name, "tiny-cpu", kv_tokens, 16, vocab, batch, server.max_model_len
    )
    engine = EngineConfig(max_batch=batch, chunked_prefill=True, token_budget=BUDGET_TOKENS)
    return ClusterConfig({"default": profile}, 1, engine)


def run(config: BenchConfig, progress: Progress) -> BenchReport:
    """Every policy on the same two workloads through the worker, then through the simulator."""
    from tessera.bench.harness import WorkerChild, replay
    from tessera.bench.runner import run_one
    from tessera.bench.scenarios._common import saturation_rate
    from tessera.bench.scenarios.elis import _predictor
    from tessera.core.registry import policy_class
    from tessera.models.tiny import build_tiny_model
    from tessera.predictor.tokens import TokenCounter
    from tessera.worker.engines.vllm_process import VLLMServer

    opts = config.options
    requests = option(opts, "requests", 60, int)
    load = config.load if config.load is not None else option(opts, "load", 1.3, float)
    batch = option(opts, "batch", 4, int)
    burst = option(opts, "burst", 40, int)
    prompt_chars = option(opts, "prompt_chars", 400, int)
    predictor_kind = str(option(opts, "predictor", _default_predictor(), str))
    with_sim = bool(option(opts, "sim", 1, int))
    names = [p for p in str(option(opts, "policies", "fcfs,isrtf,srtf-oracle,qoe", str)).split(",") if p]
    rounds = option(opts, "rounds", 3, int)
    if min(requests, burst, batch, prompt_chars, rounds) < 1 or load <= 0:
        raise ValueError(
            "--set requests, burst, batch, prompt_chars and rounds must be >= 1, and the load > 0"
        )
    if config.rate is not None and config.rate <= 0:
        raise ValueError(f"--rate must be > 0, got {config.rate}")
    checks: list[str] = [f"isrtf predictor: {predictor_kind}"]
    usable = []
    for name in names:
        try:
            policy_class(name)
            usable.append(name)
        except ValueError as exc:
            checks.append(f"{name}: not measured ({exc})")
    rng = random.Random(config.seed)
    results: list[dict[str, Any]] = []
    per_round: dict[str, list[dict[str, Any]]] = {}  # "POLICY:WORKLOAD" -> its row in each round
    progress(0, total=3 + 2 * len(usable) * rounds)
    with tempfile.TemporaryDirectory(prefix="tessera-real-policy-") as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny")
        counter = TokenCounter.from_path(model_dir)
        rows = _mixed(config.seed, requests + burst, prompt_chars, counter)
        mixed, extra = rows[:requests], rows[requests:]
        for m in extra:  # burst prompts are short
            m["prompt_tokens"] = counter.count(m["text"][:64]) + 1
        server = VLLMServer(
            model_dir, served_model_name="tiny", max_model_len=1024, max_num_seqs=64,
            extra_args=["--max-num-batched-tokens", str(BUDGET_TOKENS)],
        )  # fmt: skip
        with server, MachineWatch() as watch:
            progress(1)
            cluster = _fit_cluster(server, model_dir, batch)
            progress(1)
            probe = _sim_requests(
                {"mixed": [(0.0, m["text"], m["out"], "batch") for m in mixed]}, {"mixed": mixed}
            )
            capacity = saturation_rate(probe["mixed"], cluster)
            rate = config.rate if config.rate is not None else load * capacity
            t, plan_mixed = 0.0, []
            for m in mixed:
                t += rng.expovariate(rate)
                plan_mixed.append((t, m["text"], m["out"], "batch"))
            plan_burst = [(0.0, m["text"][:64], rng.randint(64, 160), "chat") for m in extra]
            plans = {"mixed": plan_mixed, "burst": plan_burst}
            workers: dict[str, Any] = {}
            try:
                for name in usable:
                    workers[name] = WorkerChild(
                        _worker_config(server.url, name, batch, predictor_kind), Path(tmp)
                    )
                # Rounds interleave the policies, so the machine's drifting load hits them alike;
                # each round's ratio to FCFS is paired (same minutes of the machine).
                for _ in range(rounds):
                    for name in usable:
                        for workload, plan in plans.items():
                            hints = name == "srtf-oracle"
                            mark = watch.span()
                            stats = asyncio.run(replay(workers[name].url, "tiny", plan, true_lengths=hints))
                            row = _row(f"{name}:{workload}", stats)
                            row["stalled_s"] = watch.stalls(mark).total_s  # the machine stopped us
                            per_round.setdefault(f"{name}:{workload}", []).append(row)
                            progress(1)
            finally:
                for worker in workers.values():
                    worker.stop()
            results += [_median_row(name, rows_) for name, rows_ in per_round.items()]
    if with_sim:
        predictor = _predictor(predictor_kind) if "isrtf" in usable else None
        for workload, reqs in _sim_requests(plans, {"mixed": mixed, "burst": extra}).items():
            for name in usable:
                _, metrics = run_one(reqs, lambda n=name: _sim_policy(n, predictor), cluster)
                results.append({"policy": f"{name}:{workload}:sim", **metrics})
        progress(1)
    checks += _ratio_checks(results, per_round, usable, with_sim)
    checks.append(
        f"{watch.describe_load()} during the real runs (profile fit included); "
        f"stalls of the bench process: {watch.stalls().describe()}"
    )
    cfg = {
        **config.as_dict(), "requests": requests, "load": load, "rate": rate, "sim_capacity_rps": capacity,
        "batch": batch, "burst": burst, "prompt_chars": prompt_chars, "predictor": predictor_kind,
        "rounds": rounds,
        "window_tokens": WINDOW_TOKENS, "profile": cluster.profiles["default"].name,
    }  # fmt: skip
    return BenchReport("real-policy", cfg, results, checks)


def _median_row(name: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-field medians of one policy's rows over the rounds."""
    out: dict[str, Any] = {"policy": name, "rounds": len(rows)}
    for key, value in rows[0].items():
        if key != "policy":
            out[key] = float(np.median([r[key] for r in rows])) if isinstance(value, float) else value
    return out


def _sim_ratio(sim: dict[str, dict[str, Any]], name: str, workload: str, key: str) -> float:
    return float(sim[f"{name}:{workload}:sim"][key]) / max(float(sim[f"fcfs:{workload}:sim"][key]), 1e-9)


def _ratio_checks(
    results: list[dict[str, Any]],
    per_round: dict[str, list[dict[str, Any]]],
    usable: list[str],
    with_sim: bool,
) -> list[str]:
    """Real: the median over rounds of each round's paired ratio to FCFS (per-round ratios listed);
    simulated: the one deterministic ratio."""
    sim = {r["policy"]: r for r in results if r["policy"].endswith(":sim")}
    lines = []
    if "fcfs:mixed" not in per_round:
        return lines
    for name in usable:
        if name == "fcfs":
            continue
        jcts = [
            mine["mean_jct_s"] / base["mean_jct_s"]
            for mine, base in zip(per_round[f"{name}:mixed"], per_round["fcfs:mixed"], strict=True)
        ]
        qoes = [
            mine["avg_qoe"] / max(base["avg_qoe"], 1e-9)
            for mine, base in zip(per_round[f"{name}:burst"], per_round["fcfs:burst"], strict=True)
        ]
        jct, qoe = float(np.median(jcts)), float(np.median(qoes))
        listed = ", ".join(f"{r:.2f}" for r in jcts)
        line = f"{name} vs fcfs: mean JCT (mixed) real {jct:.3f}x (rounds: {listed})"
        if with_sim:
            line += f", sim {_sim_ratio(sim, name, 'mixed', 'mean_jct_s'):.3f}x"
        line += f"; avg QoE (burst) real {qoe:.3f}x (rounds: {', '.join(f'{r:.2f}' for r in qoes)})"
        if with_sim:
            line += f", sim {_sim_ratio(sim, name, 'burst', 'avg_qoe'):.3f}x"
        if name in ("isrtf", "srtf-oracle"):
            line += f"; target JCT < fcfs: {'PASS' if jct < 1 else 'FAIL'}"
        if name == "qoe":
            line += f"; target QoE > fcfs: {'PASS' if qoe > 1 else 'FAIL'}"
        lines.append(line)
    return lines

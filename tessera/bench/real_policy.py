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
Options (``--set``): requests, load, batch, burst, prompt_chars, predictor, policies, rounds, sim (1/0),
model (``tiny``).

``--set model=smollm2`` (a known model, `tessera models pull`): the same comparison on a real instruct
model whose answers end by themselves. Prompts go through its chat template; every answer is greedy
(temperature 0, ``max_tokens`` cap 160, no ``ignore_eos``), and a first pass straight to vLLM records
each prompt's greedy answer and length, which the oracle's header, the ISRTF simulator's text and the
simulator's request lengths use (the check line says how many real runs gave the same length). vLLM runs
as the demo serves it (float32, eager); the workers and the simulator use the model's shipped CPU
profile (``smollm2-cpu``) instead of a fit. Sized for minutes: ``requests`` 12 mixed requests, a share
``chat_share`` (0.5) of them in the chat class (SLO: TTFT <= ``ttft_slo`` 3 s and mean ITL <= ``itl_slo``
0.5 s), the rest batch (600 s deadline), Poisson at ``load`` (1.3) x the simulated capacity; ``burst`` 8
chat requests at once (QoE at ``reading_tps`` 5 tokens/s, T* 1 s). Policies (``policies``): fcfs, isrtf,
srtf-oracle, qlm and ``chiron`` (FCFS inside Chiron's local autoscaler, batch 1..``chiron_max`` 8 from
``batch`` 4) on the mixed workload, qoe on the burst, fcfs on both; ``rounds`` (3) interleave them.
``artifact`` names a trained head's folder for the text predictor (worker and simulator alike).
Checks: each comparison's median paired ratio to FCFS over the rounds (each round listed) next to the
simulator's ratio on the same requests, and whether they point the same way: ISRTF and the oracle on
mean JCT, QLM on SLO attainment, Chiron on output throughput, mean JCT and SLO attainment (and the
batch size it ended each round at), QoE on average QoE. The row's SLO attainment and QoE are computed
from what the client saw.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import tempfile
from concurrent.futures import ThreadPoolExecutor
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


def _sim_requests(
    plans: dict[str, list[Any]], rows: dict[str, list[dict[str, Any]]], natural: Natural | None = None
) -> dict[str, list[Any]]:
    """The plans as simulator requests; with ``natural`` each one ends at its row's greedy length
    (``out``) within its ``max_tokens``, and the chat class has that run's SLOs and reading speed."""
    from tessera.core.request import Request, ServiceClass

    chat = ServiceClass(
        "chat", ttft_slo_s=TTFT_TARGET_S, reading_speed_tps=READING_TPS, ttft_target_s=TTFT_TARGET_S
    )
    if natural is not None:
        chat = ServiceClass("chat", ttft_slo_s=natural.ttft_slo, itl_slo_s=natural.itl_slo,
                            reading_speed_tps=natural.reading_tps, ttft_target_s=TTFT_TARGET_S)  # fmt: skip
    batch = ServiceClass("batch", "batch", deadline_s=600)
    out: dict[str, list[Any]] = {}
    for workload, plan in plans.items():
        reqs = []
        for i, (at, prompt, n, klass) in enumerate(plan):
            row = rows[workload][i]
            cls = chat if klass == "chat" else batch
            true = row["out"] if natural is not None else n
            reqs.append(Request(
                f"{workload}{i}", at, row["prompt_tokens"], n, service_class=cls, true_output_tokens=true,
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
    model = str(option(opts, "model", "tiny", str))
    if model != "tiny":
        return _run_natural(model, config, progress)
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


# --- A real instruct model with natural lengths (--set model=smollm2) --------------------------------

# Which workloads each policy runs with a real model (each run costs minutes on the CPU): the mixed
# workload carries the JCT, SLO and batch-size comparisons, the burst the QoE one.
NATURAL_WORKLOADS = {"fcfs": ("mixed", "burst"), "qoe": ("burst",)}
# (policy, workload, metric, better when higher) compared with FCFS's same run
NATURAL_COMPARISONS = (
    ("isrtf", "mixed", "mean_jct_s", False),
    ("srtf-oracle", "mixed", "mean_jct_s", False),
    ("qlm", "mixed", "slo_attainment", True),
    ("chiron", "mixed", "output_tokens_per_s", True),
    ("chiron", "mixed", "mean_jct_s", False),
    ("chiron", "mixed", "slo_attainment", True),
    ("qoe", "burst", "avg_qoe", True),
)
# A real model's server on a loaded 2-core machine can take over 5 minutes to start.
START_TIMEOUT_S = 900.0
CHIRON = "chiron"  # FCFS inside Chiron's local autoscaler (the batch size moves within 1..chiron_max)


@dataclasses.dataclass(frozen=True, slots=True)
class Natural:
    """The settings of a natural-length run (``--set`` options, defaults for a CPU-sized run)."""

    model: str
    requests: int
    burst: int
    batch: int
    max_tokens: int
    load: float
    rounds: int
    chat_share: float
    ttft_slo: float
    itl_slo: float
    reading_tps: float
    chiron_max: int
    prompt_chars: int

    @classmethod
    def from_options(cls, model: str, config: BenchConfig) -> Natural:
        """Read and check the options."""
        opts = config.options
        n = cls(
            model, option(opts, "requests", 12, int), option(opts, "burst", 8, int),
            option(opts, "batch", 4, int), option(opts, "max_tokens", 160, int),
            config.load if config.load is not None else option(opts, "load", 1.3, float),
            option(opts, "rounds", 3, int), option(opts, "chat_share", 0.5, float),
            option(opts, "ttft_slo", 3.0, float), option(opts, "itl_slo", 0.5, float),
            option(opts, "reading_tps", 5.0, float), option(opts, "chiron_max", 8, int),
            option(opts, "prompt_chars", 400, int),
        )  # fmt: skip
        if min(n.requests, n.burst, n.batch, n.max_tokens, n.rounds, n.prompt_chars) < 1:
            raise ValueError("--set requests, burst, batch, max_tokens, rounds and prompt_chars must be >= 1")
        if n.load <= 0 or not 0 <= n.chat_share <= 1 or min(n.ttft_slo, n.itl_slo, n.reading_tps) <= 0:
            raise ValueError(
                "--set load, ttft_slo, itl_slo and reading_tps must be > 0, chat_share in [0, 1]"
            )
        if n.chiron_max < n.batch:
            raise ValueError(f"--set chiron_max ({n.chiron_max}) must be >= batch ({n.batch})")
        return n


def _natural_worker_config(
    url: str, policy: str, n: Natural, predictor: str, profile: Any, artifact: str | None
) -> dict[str, Any]:
    from tessera.api.worker_config import ProfileSpec

    config = _worker_config(url, "fcfs" if policy == CHIRON else policy, n.batch, predictor)
    if policy == "isrtf" and artifact is not None:
        config["scheduling"]["settings"]["predictor_checkpoint"] = artifact
    model = config["models"][0]
    model.update(name=n.model, maxModelLen=2048, profile=ProfileSpec.from_profile(profile).to_json())
    config["classes"]["chat"] = {
        "slo": {"ttftSeconds": n.ttft_slo, "itlSeconds": n.itl_slo},
        "qoe": {"readingSpeedTokensPerSecond": n.reading_tps, "ttftTargetSeconds": TTFT_TARGET_S},
    }
    if policy == CHIRON:
        config["scheduling"]["batch"] = {"min": 1, "max": n.chiron_max, "initial": n.batch}
        config["scheduling"]["autoscale"] = {"enabled": True}
    return config


def _natural_row(name: str, stats: list[Any], n: Natural) -> dict[str, Any]:
    """``_row`` with the client-side SLO verdicts (chat: TTFT and mean ITL; batch: its 600 s deadline)
    and the output throughput."""
    from tessera.core.qoe import QoEParams, qoe_from_delivery

    row = _row(name, stats)
    qoes = [
        qoe_from_delivery(np.array(s.times), QoEParams(s.sent, TTFT_TARGET_S, n.reading_tps)) for s in stats
    ]
    row["avg_qoe"] = float(np.mean(qoes))
    met = []
    for s in stats:
        if s.klass == "chat":
            itl = (s.jct - s.ttft) / (s.tokens - 1) if s.tokens > 1 else 0.0
            met.append(s.ttft <= n.ttft_slo and itl <= n.itl_slo)
        else:
            met.append(s.jct <= 600)
    row["slo_attainment"] = float(np.mean(met))
    span = max(s.done for s in stats) - min(s.sent for s in stats)
    row["output_tokens_per_s"] = row["output_tokens"] / span
    return row


async def _greedy_answers(url: str, model: str, prompts: list[str], max_tokens: int) -> list[tuple[int, str]]:
    """Each prompt's greedy answer from the server: (its length in tokens, its text)."""
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:

        async def one(prompt: str) -> tuple[int, str]:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
            resp = await client.post(f"{url}/v1/completions", json=body)
            if resp.status_code != 200:
                raise RuntimeError(
                    f"{url}: greedy probe failed with HTTP {resp.status_code}: {resp.text[:300]}"
                )
            data = resp.json()
            return int(data["usage"]["completion_tokens"]), str(data["choices"][0]["text"])

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def _natural_sim_policy(name: str, predictor: Any, n: Natural) -> Any:
    if name != CHIRON:
        return _sim_policy(name, predictor)
    from tessera.core.chiron import ChironLocal, ChironPolicy
    from tessera.core.chiron.local import BATCH_ITL_S
    from tessera.core.registry import make_policy

    # as the worker builds it: AutoscaleSpec's defaults, the chat class's ITL SLO as the interactive level
    local = ChironLocal(1, n.chiron_max, n.batch)
    return ChironPolicy(make_policy("fcfs"), local, interactive_itl_s=n.itl_slo, batch_itl_s=BATCH_ITL_S)


def _run_natural(model: str, config: BenchConfig, progress: Progress) -> BenchReport:
    """The policies on a real instruct model that ends its answers itself (greedy, so the same prompt
    gives the same answer in every run), next to the simulator with the model's measured CPU profile."""
    from transformers import AutoTokenizer

    from tessera.bench.harness import WorkerChild, replay
    from tessera.bench.runner import run_one
    from tessera.bench.scenarios._common import saturation_rate
    from tessera.bench.scenarios.elis import _predictor
    from tessera.core.profiles import PROFILES
    from tessera.core.registry import policy_class
    from tessera.models.cache import resolve_model
    from tessera.models.fit import kv_bytes_per_token
    from tessera.predictor.tokens import TokenCounter
    from tessera.sim.cluster import ClusterConfig
    from tessera.sim.engine import EngineConfig
    from tessera.worker.engines.vllm_process import VLLMServer

    n = Natural.from_options(model, config)
    resolved = resolve_model(model)
    if resolved.known is None or resolved.known.cpu_profile is None:
        raise ValueError(
            f"--set model={model}: needs a known model with a measured CPU profile, or model=tiny"
        )
    opts = config.options
    predictor_kind = str(option(opts, "predictor", _default_predictor(), str))
    artifact = option(opts, "artifact", None, str)  # a trained head's folder (predictor=text)
    if artifact is not None and predictor_kind != "text":
        raise ValueError(f"--set artifact applies to predictor=text only, not predictor={predictor_kind}")
    with_sim = bool(option(opts, "sim", 1, int))
    default = "fcfs,isrtf,srtf-oracle,qlm,chiron,qoe"
    names = [p for p in str(option(opts, "policies", default, str)).split(",") if p]
    checks: list[str] = [f"isrtf predictor: {predictor_kind}" + (f" ({artifact})" if artifact else "")]
    usable = []
    for name in names:
        try:
            if name != CHIRON:
                policy_class(name)
            usable.append(name)
        except ValueError as exc:
            checks.append(f"{name}: not measured ({exc})")
    if "fcfs" not in usable:
        raise ValueError("--set policies must include fcfs (every ratio is to FCFS's paired run)")
    dtype = resolved.known.dtype
    kv_tokens = (1 << 30) // kv_bytes_per_token(resolved.path, dtype)[0]
    profile = dataclasses.replace(PROFILES[resolved.known.cpu_profile], kv_capacity_tokens=kv_tokens)
    tokenizer = AutoTokenizer.from_pretrained(str(resolved.path))
    counter = TokenCounter.from_path(resolved.path)

    def chat(text: str) -> str:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)  # fmt: skip
        return str(rendered)

    rows = _mixed(config.seed, n.requests + n.burst, n.prompt_chars, counter)
    mixed, extra = rows[: n.requests], rows[n.requests :]
    for m in mixed:
        m["text"] = chat(m["text"])
    for m in extra:  # burst prompts are short
        m["text"] = chat(m["text"][:64])
    for m in rows:
        m["prompt_tokens"] = counter.count(m["text"])
    runs = [
        (name, w) for _ in range(n.rounds) for name in usable for w in NATURAL_WORKLOADS.get(name, ("mixed",))
    ]
    progress(0, total=3 + len(runs))
    rng = random.Random(config.seed)
    per_round: dict[str, list[dict[str, Any]]] = {}
    results: list[dict[str, Any]] = []
    batch_sizes: dict[str, list[float]] = {}
    server = VLLMServer(
        resolved.path, served_model_name=model, max_model_len=2048, max_num_seqs=64, dtype=dtype,
        start_timeout_s=START_TIMEOUT_S,
        extra_args=["--max-num-batched-tokens", str(BUDGET_TOKENS), "--enforce-eager"],
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="tessera-real-policy-") as tmp, server, MachineWatch() as watch:
        progress(1)
        answers = asyncio.run(_greedy_answers(server.url, model, [m["text"] for m in rows], n.max_tokens))
        for m, (length, text) in zip(rows, answers, strict=True):
            m["out"], m["response"] = max(1, length), text
        progress(1)
        engine = EngineConfig(max_batch=n.batch, chunked_prefill=True, token_budget=BUDGET_TOKENS)
        cluster = ClusterConfig({"default": profile}, 1, engine)
        probe = _sim_requests(
            {"mixed": [(0.0, m["text"], m["out"], "batch") for m in mixed]}, {"mixed": mixed}
        )
        capacity = saturation_rate(probe["mixed"], cluster)
        rate = config.rate if config.rate is not None else n.load * capacity
        t, plan_mixed = 0.0, []
        for m in mixed:
            t += rng.expovariate(rate)
            plan_mixed.append(
                (t, m["text"], n.max_tokens, "chat" if rng.random() < n.chat_share else "batch")
            )
        plan_burst = [(0.0, m["text"], n.max_tokens, "chat") for m in extra]
        plans = {"mixed": plan_mixed, "burst": plan_burst}
        lengths = {"mixed": [m["out"] for m in mixed], "burst": [m["out"] for m in extra]}
        greedy = {"temperature": 0.0, "ignore_eos": False}
        matched: list[bool] = []
        workers: dict[str, Any] = {}
        try:
            # Started together: one after the other takes many minutes on a loaded 2-core machine.
            with ThreadPoolExecutor(len(usable)) as pool:
                started = {
                    name: pool.submit(
                        WorkerChild,
                        _natural_worker_config(server.url, name, n, predictor_kind, profile, artifact),
                        Path(tmp),
                        ready_timeout_s=START_TIMEOUT_S,
                    )
                    for name in usable
                }
                failed = []
                for name, future in started.items():
                    try:
                        workers[name] = future.result()
                    except RuntimeError as exc:  # the others still get stopped below
                        failed.append(exc)
            if failed:
                raise failed[0]
            # Rounds interleave the policies (paired ratios: the same minutes of the shared machine).
            for name, workload in runs:
                hints = lengths[workload] if name == "srtf-oracle" else False
                mark = watch.span()
                stats = asyncio.run(
                    replay(workers[name].url, model, plans[workload], greedy, true_lengths=hints)
                )
                row = _natural_row(f"{name}:{workload}", stats, n)
                row["stalled_s"] = watch.stalls(mark).total_s
                matched += [s.tokens == k for s, k in zip(stats, lengths[workload], strict=True)]
                if name == CHIRON:
                    batch_sizes.setdefault(name, []).append(_worker_batch_size(workers[name].url, model))
                per_round.setdefault(f"{name}:{workload}", []).append(row)
                progress(1)
        finally:
            for worker in workers.values():
                worker.stop()
    results += [_median_row(name, rows_) for name, rows_ in per_round.items()]
    sim_rows: dict[str, dict[str, Any]] = {}
    if with_sim:
        predictor = _predictor(predictor_kind, artifact) if "isrtf" in usable else None
        classed = _sim_requests(plans, {"mixed": mixed, "burst": extra}, n)
        for name, workload in dict.fromkeys((name, w) for name, w in runs):
            reqs = classed[workload]
            chiron_cluster = ClusterConfig(
                {"default": profile}, 1, dataclasses.replace(engine, max_batch=n.chiron_max)
            )
            _, metrics = run_one(
                reqs,
                lambda nm=name: _natural_sim_policy(nm, predictor, n),
                chiron_cluster if name == CHIRON else cluster,
            )
            sim_rows[f"{name}:{workload}"] = {"policy": f"{name}:{workload}:sim", **metrics}
        results += list(sim_rows.values())
        progress(1)
    out = [m["out"] for m in rows]
    checks += _natural_checks(per_round, sim_rows, usable)
    if CHIRON in batch_sizes:
        sizes = ", ".join(f"{b:g}" for b in batch_sizes[CHIRON])
        checks.append(
            f"chiron: batch size at the end of each round {sizes} (bounds 1..{n.chiron_max}, start {n.batch})"
        )
    checks.append(
        f"natural lengths (greedy, max_tokens {n.max_tokens}): mean {np.mean(out):.0f}, "
        f"median {np.median(out):.0f}, "
        f"max {max(out)}, {np.mean([k >= n.max_tokens for k in out]):.0%} cut at max_tokens; "
        f"{np.mean(matched):.0%} of the real runs' outputs had the probe's length"
    )
    checks.append(
        f"{watch.describe_load()} during the real runs; "
        f"stalls of the bench process: {watch.stalls().describe()}"
    )
    cfg = {
        **config.as_dict(), **dataclasses.asdict(n), "rate": rate, "sim_capacity_rps": capacity,
        "predictor": predictor_kind, "window_tokens": WINDOW_TOKENS, "profile": profile.name,
        "load_avg_range": list(watch.load_range()),
    }  # fmt: skip
    return BenchReport("real-policy", cfg, results, checks)


def _worker_batch_size(url: str, model: str) -> float:
    """The worker's batch size gauge (``tessera_batch_size``) for ``model`` now."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tessera_batch_size" and sample.labels.get("model") == model:
                return float(sample.value)
    raise RuntimeError(f"{url}/metrics has no tessera_batch_size for model {model!r}")


def _direction(ratio: float) -> int:
    """+1 above 1, -1 below, 0 within 2% of it (no difference)."""
    return 0 if abs(ratio - 1) < 0.02 else 1 if ratio > 1 else -1


def _natural_checks(
    per_round: dict[str, list[dict[str, Any]]], sim: dict[str, dict[str, Any]], usable: list[str]
) -> list[str]:
    """Each comparison: the median of the per-round paired ratios to FCFS (rounds listed), the simulated
    ratio on the same requests, and whether the two point the same way."""
    lines = []
    for name, workload, key, higher in NATURAL_COMPARISONS:
        if name not in usable:
            continue
        mine, base = per_round[f"{name}:{workload}"], per_round[f"fcfs:{workload}"]
        ratios = [m[key] / max(b[key], 1e-9) for m, b in zip(mine, base, strict=True)]
        real = float(np.median(ratios))
        listed = ", ".join(f"{r:.2f}" for r in ratios)
        line = f"{name} vs fcfs, {key} ({workload}): real {real:.3f}x (rounds: {listed})"
        if sim:
            simulated = float(sim[f"{name}:{workload}"][key]) / max(float(sim[f"fcfs:{workload}"][key]), 1e-9)
            signs = {_direction(real), _direction(simulated)}
            agree = (
                "OPPOSITE DIRECTIONS"
                if signs == {-1, 1}
                else "same direction"
                if len(signs) == 1
                else "one shows no difference"
            )
            line += f", sim {simulated:.3f}x: {agree}"
        better = real > 1 if higher else real < 1
        verdict = "as good as" if abs(real - 1) < 0.005 else "better than" if better else "worse than"
        line += f"; {name} {verdict} fcfs on the real engine"
        lines.append(line)
    return lines

"""Scenario ``elis``: FCFS vs ELIS ISRTF (trained length predictor) vs oracle SRTF (ELIS §6).

Workload: prompts and responses from the AlpacaEval prompt/response set (``--set data=FILE`` for
another JSONL with prompt/response), without the rows whose prompt the predictor trained on
(``unseen_by_head``: the head's own training file keeps its held-out split, any other file every row
but those sharing a training prompt id); lengths counted with the predictor's tokenizer. Arrivals are Gamma
with ELIS' FabriX shape 0.73 (scale = 1/(0.73·λ); docs/papers.md, "ELIS: evaluation workload") at ``load`` ×
the measured capacity (FCFS with every request at time 0) of each batch size. One instance, batch sizes 1, 2
and 4 as in ELIS Fig 6. ``--trace`` replaces the Gamma arrivals: a trace's first ``requests`` arrival
times, or as many sampled from a rate series (``rate_dist``: poisson | gamma), rescaled to the same rate;
the prompts and their lengths still come from ``data`` (a trace has token counts, not text).

Seeds (at least 5, compare means): ``seeds`` (5) workloads, ``--seed`` and the next ones,
each its own draw of requests and arrivals. 400 requests at load 0.9 with Gamma(0.73) arrivals swing
the oracle's reduction by ±7 points from seed to seed, so one seed cannot settle a 50% threshold.

Rows: ``fcfs:batch=B``, ``isrtf:batch=B`` (the policy as shipped: its tail guard on at its defaults,
or at ``guard_credit``/``guard_after``/``aging``), ``isrtf:batch=B,guard=off`` (no guard, no aging: the
plain ELIS order),
``isrtf-tail:batch=B`` (the wait-bounded variant at ``max_wait``), ``isrtf:batch=B,online`` (predictor
text only: the shipped policy with a text predictor that learns online from the run's finished
requests, starting from the head alone: ``tessera.predictor.online``, refits inline, every
``refit_every`` finished requests), ``srtf-oracle:batch=B`` — the seed
means (every number averaged, p99 included); with more than one seed, each seed's rows come first as
``...,seed=N``. The checks are on the means, then each seed's reductions for information: the oracle's
and ISRTF's mean-JCT reductions, the guard's tail (p99 JCT <= 1.5x FCFS's, keeping >= 80% of the
guard-off mean-JCT gain), and every row against ``fcfs`` on throughput and p99 JCT (``tolerance``).
Every ISRTF row leads with the ranking its predictions gave (``step0_tau``: Kendall τ of the
predictions at arrival against the true lengths; ``within_step_tau``: the mean τ among predictions at
the same window step; ``pooled_tau``: over all predictions; ``step0_tau_per_refit``: τ at arrival
among the predictions one installed online correction made, averaged over refits, since the pooled
figures also rank predictions of different refits against each other), what ISRTF's order rests on.

Options (``--set``): requests (400), batches ("1,2,4"), seeds (5), data (AlpacaEval text; any JSONL
with ``prompt`` and ``response`` text), predictor (text | running-mean | constant), artifact (a trained
head's folder for ``text``; default the shipped one), window (50), guard_credit and guard_after (the
``isrtf`` row's tail guard: credit as a share of the decode rate, and the wait in recent mean JCTs
after which it starts; default the policy's), aging (the ``isrtf`` row's linear aging, tokens/s of
credit per second of age; default the policy's, 0), max_wait (``isrtf-tail``'s promotion wait in
recent mean JCTs; default the policy's), refit_every, min_samples, prior_weight, arrival_prior_weight,
embedding_prior_weight, arrival_blend and memory_bandwidth (the online learner's, default
``OnlineSettings``'), tolerance (0.10),
rate_dist (with a rate series as ``--trace``), and the cluster options of
``tessera.bench.runner.CLUSTER_OPTIONS``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tessera.bench.runner import SHARED_DATA, cluster_config_from, option, run_policies, trace_arrivals
from tessera.bench.scenarios import BenchConfig, BenchReport, Progress
from tessera.bench.scenarios._common import baseline_checks, mean_row, saturation_rate, seed_checks, tolerance
from tessera.core.policies.isrtf import (
    DEFAULT_GUARD_AFTER_JCT_MULTIPLE,
    DEFAULT_GUARD_CREDIT,
    DEFAULT_MAX_WAIT_JCT_MULTIPLE,
    ISRTF,
    TailISRTF,
)
from tessera.core.registry import make_policy
from tessera.core.request import Request
from tessera.predictor.dataset import load_pairs, sample_rows, unseen_by_head
from tessera.sim.workloads import gamma_arrivals, scale_to_rate

DESCRIPTION = (
    "ELIS: FCFS vs ISRTF with the trained length predictor vs oracle SRTF, Gamma arrivals, batch 1/2/4"
)
WRITES_REQUESTS_CSV = True  # --requests-csv: one line per request and row
ALPACA_TEXT = SHARED_DATA / "alpacaeval_responses_text.jsonl.gz"
GAMMA_SHAPE = 0.73  # ELIS FabriX trace fit (ELIS Fig. 4)


def build_workload(data: Path, n: int, seed: int, meta: dict | None, predictor: Any) -> list[Request]:
    """``n`` requests (arrival 0) from the rows whose prompt the head with metadata ``meta`` never
    trained on (every row without one); tokens by the predictor's tokenizer."""
    from tessera.predictor.tokens import token_counter

    pairs = load_pairs(data)
    if meta is not None:
        pairs = unseen_by_head(pairs, meta)
    if len(pairs) < n:
        raise ValueError(f"{data} has {len(pairs)} usable rows, fewer than requests={n}")
    rows = sample_rows(pairs, n, seed)
    order = np.random.default_rng(seed).permutation(len(rows))
    served = predictor.served if hasattr(predictor, "served") else token_counter(None)
    reqs = []
    for i, j in enumerate(order):
        pair = rows[int(j)]
        out = max(1, served.count(pair.response))
        reqs.append(
            Request(
                id=f"e{i}",
                arrival=0.0,
                prompt_tokens=max(1, served.count(pair.prompt)),
                max_tokens=out,
                true_output_tokens=out,
                prompt_text=pair.prompt,
                response_text=pair.response,
            )
        )
    return reqs


def _predictor(kind: str, artifact: str | None = None) -> Any:
    if artifact is not None and kind != "text":
        raise ValueError(f"--set artifact applies to predictor=text only, not predictor={kind}")
    if kind == "text":
        from tessera.predictor.model import TextLengthPredictor
        from tessera.predictor.samples import EmbeddingStore

        predictor = TextLengthPredictor(artifact, threads=1)  # one thread: the simulator is single-threaded
        # Every policy and batch size replays the same texts: embed each chunk once per bench run.
        predictor.store = EmbeddingStore(predictor.encoder, cache_dir=None)
        return predictor
    from tessera.core.policies.isrtf import _make_predictor

    return _make_predictor(kind)


def _batches(text: Any) -> list[int]:
    try:
        batches = [int(b) for b in str(text).split(",")]
    except ValueError as exc:
        raise ValueError(f"--set batches must be integers separated by commas, got {text!r}") from exc
    if not batches or any(b < 1 for b in batches):
        raise ValueError(f"--set batches must be >= 1, got {text!r}")
    return batches


def run(config: BenchConfig, progress: Progress) -> BenchReport:
    """Every policy at every batch size on the same requests and arrivals, for each seed."""
    opts = config.options
    n = option(opts, "requests", 400, int)
    batches = _batches(opts.get("batches", "1,2,4"))
    load = config.load if config.load is not None else 0.9
    if load <= 0:
        raise ValueError(f"--load must be > 0, got {load}")
    n_seeds = option(opts, "seeds", 5, int)
    if n_seeds < 1:
        raise ValueError(f"--set seeds={n_seeds}: must be >= 1 (the spec asks for at least 5)")
    seeds = list(range(config.seed, config.seed + n_seeds))
    window = option(opts, "window", 50, int)
    aging = option(opts, "aging", 0.0, float)
    guard_credit = option(opts, "guard_credit", DEFAULT_GUARD_CREDIT, float)
    guard_after = option(opts, "guard_after", DEFAULT_GUARD_AFTER_JCT_MULTIPLE, float)
    max_wait = option(opts, "max_wait", DEFAULT_MAX_WAIT_JCT_MULTIPLE, float)
    tol = tolerance(opts)
    kind = option(opts, "predictor", "text", str)
    data = Path(option(opts, "data", str(ALPACA_TEXT), str))
    artifact = opts.get("artifact")
    # Read --trace first: a file it refuses (a lengths file) is refused before the predictor loads and
    # predicts every workload, which takes a minute on a loaded machine.
    shapes = {s: trace_arrivals(config, n, s) for s in seeds}  # None each without --trace
    online = _online_settings(opts)
    predictor = _predictor(kind, None if artifact is None else str(artifact))
    text = predictor if kind == "text" else None
    bases = {s: build_workload(data, n, s, predictor.meta if text else None, predictor) for s in seeds}
    if kind == "text":
        from tessera.predictor.precomputed import PrecomputedPredictor

        # Same predictions, computed ahead in batched passes (one per window step), not per decision.
        predictor = PrecomputedPredictor(predictor, [r for base in bases.values() for r in base], window)
    recorders: dict[str, _Recorder] = {}
    learners: dict[str, list[dict[str, Any]]] = {}

    def fresh(row: str, learning: bool = False) -> Any:
        """The predictor for one ISRTF run, its predictions recorded: a predictor that learns from
        finished requests starts anew, so that no row inherits what an earlier row taught it (the
        precomputed text one is stateless); ``learning``: the text predictor learning online."""
        inner = predictor if kind == "text" else _predictor(kind)
        if learning:
            inner = _online_predictor(text, online)
            learners.setdefault(row, []).append(inner.online)
        recorders[row] = _Recorder(inner, window)
        return recorders[row]

    shipped = {"window_tokens": window, "aging_tokens_per_s": aging, "guard_credit": guard_credit,
               "guard_after_jct_multiple": guard_after}  # fmt: skip
    rows: list[dict[str, Any]] = []
    checks: list[str] = []
    capacities: dict[int, list[float]] = {}
    for index, b in enumerate(batches):
        cluster = cluster_config_from(opts, max_batch=b)
        # the trained predictor object is a bench variant, not a setting: ISRTF is built directly
        policies = {
            f"fcfs:batch={b}": lambda: make_policy("fcfs"),
            f"isrtf:batch={b}": lambda b=b: ISRTF(predictor=fresh(f"isrtf:batch={b}"), **shipped),
            f"isrtf:batch={b},guard=off": lambda b=b: ISRTF(
                predictor=fresh(f"isrtf:batch={b},guard=off"),
                window_tokens=window,
                aging_tokens_per_s=0.0,
                guard_credit=0.0,
            ),
            f"isrtf-tail:batch={b}": lambda b=b: TailISRTF(
                predictor=fresh(f"isrtf-tail:batch={b}"), window_tokens=window, max_wait_jct_multiple=max_wait
            ),
        }
        if kind == "text":
            policies[f"isrtf:batch={b},online"] = lambda b=b: ISRTF(
                predictor=fresh(f"isrtf:batch={b},online", learning=True), **shipped
            )
        policies[f"srtf-oracle:batch={b}"] = lambda: make_policy("srtf-oracle", recheck_tokens=window)
        if index == 0:
            progress(0, total=n * len(policies) * len(batches) * len(seeds))
        per_seed: dict[int, list[dict[str, Any]]] = {}
        for seed, base in bases.items():
            capacity = saturation_rate(base, cluster)
            capacities.setdefault(b, []).append(capacity)
            rate = config.rate if config.rate is not None else load * capacity
            shape = shapes[seed]
            if shape is None:
                arrivals = gamma_arrivals(
                    n, GAMMA_SHAPE, 1.0 / (GAMMA_SHAPE * rate), np.random.default_rng(seed)
                )
            else:
                arrivals = scale_to_rate(shape, rate)
            for r, t in zip(base, arrivals, strict=True):
                r.arrival = float(t)
            got = run_policies(base, policies, cluster, progress, requests_csv=config.requests_csv)
            # the ranking each ISRTF row's predictions gave leads its row
            per_seed[seed] = [
                {"policy": r["policy"], **recorders[r["policy"]].ranking(), **r}
                if r["policy"] in recorders
                else r
                for r in got
            ]
        if n_seeds == 1:
            rows += per_seed[seeds[0]]
            checks += _checks(b, _by_kind(per_seed[seeds[0]]), tol)
            continue
        # Per-seed rows, then the seed means under the contract's row names (compare means, not single seeds).
        for seed, got in per_seed.items():
            rows += [{**row, "policy": f"{row['policy']},seed={seed}"} for row in got]
        means = [mean_row([got[i] for got in per_seed.values()], name) for i, name in enumerate(policies)]
        rows += means
        checks += seed_checks(
            [*map(_by_kind, per_seed.values()), _by_kind(means)],
            seeds,
            lambda by, b=b: _checks(b, by, tol),
            lambda by, b=b: [line for line in _checks(b, by, tol) if " below fcfs (target" in line],
        )
    cfg = {
        **config.as_dict(),
        "requests": n,
        "load": load,
        "gamma_shape": None if config.trace else GAMMA_SHAPE,
        "batches": batches,
        "seeds": seeds,
        "window": window,
        "predictor": kind,
        "artifact": artifact,
        "data": str(data),
        "aging_tokens_per_s": aging,
        "guard_credit": guard_credit,
        "guard_after_jct_multiple": guard_after,
        "max_wait_jct_multiple": max_wait,
        "tolerance": tol,
        "capacity_rps": capacities,
    }
    if kind == "text":
        cfg["online"] = {
            "settings": {k: getattr(online, k) for k in online.__dataclass_fields__ if k != "background"},
            "learners": {row: [learner.stats() for learner in runs] for row, runs in learners.items()},
        }
        cfg["predictions"] = {
            "precomputed": len(predictor.table),
            "hits": predictor.hits,
            "misses": predictor.misses,
        }
    return BenchReport("elis", cfg, rows, checks)


def _online_settings(opts: Any) -> Any:
    """The online learner's settings from ``--set`` (inline refits: the replay's clock is virtual)."""
    from tessera.predictor.online import OnlineSettings

    given = {
        "refit_every": option(opts, "refit_every", None, int),
        "min_samples": option(opts, "min_samples", None, int),
        "prior_weight": option(opts, "prior_weight", None, float),
        "arrival_prior_weight": option(opts, "arrival_prior_weight", None, float),
        "embedding_prior_weight": option(opts, "embedding_prior_weight", None, float),
        "arrival_blend": option(opts, "arrival_blend", None, str),
        "memory_bandwidth": option(opts, "memory_bandwidth", None, float),
    }
    return OnlineSettings(background=False, **{k: v for k, v in given.items() if v is not None})


def _online_predictor(text: Any, settings: Any) -> Any:
    """A text predictor of the same head, encoder and embedding store with a fresh online learner,
    on a clock that never moves (refits by count only: the replay's time is virtual)."""
    from tessera.predictor.model import TextLengthPredictor
    from tessera.predictor.online import OnlineLearner

    return TextLengthPredictor(
        text.artifact,
        threads=1,
        encoder=text.encoder,
        store=text.store,
        online=OnlineLearner(settings, clock=lambda: 0.0),
    )


class _Recorder:
    """A predictor wrapper noting every prediction with the request's true remaining length."""

    def __init__(self, inner: Any, window: int) -> None:
        self.inner = inner
        self.window = window
        self.served = getattr(inner, "served", None)
        # (window step, prediction, true remaining, the online learner's refits so far)
        self.rows: list[tuple[int, float, int, int]] = []

    def predict_remaining(self, requests: list[Request]) -> list[float]:
        """The inner predictions, recorded."""
        preds = self.inner.predict_remaining(requests)
        learner = getattr(self.inner, "online", None)
        refits = 0 if learner is None else learner.refits + learner.rejected + learner.failed
        for req, pred in zip(requests, preds, strict=True):
            self.rows.append(
                (req.generated // self.window, float(pred), req.target_output_tokens - req.generated, refits)
            )
        return preds

    def forget(self, req: Request) -> None:
        """Forwarded (the online learner learns here); a finished request also feeds a running mean
        (ISRTF feeds the predictor it holds only when that is the running mean itself)."""
        observe = getattr(self.inner, "observe", None)
        if observe is not None and req.finished:
            observe(req)
        forget = getattr(self.inner, "forget", None)
        if forget is not None:
            forget(req)

    def ranking(self) -> dict[str, float]:
        """τ at arrival, mean τ within a step, pooled τ of the recorded predictions, and τ at arrival
        among the predictions one installed correction made (``step0_tau_per_refit``: the mean over
        refits; the pooled figure also ranks predictions of different refits against each other)."""
        from tessera.predictor.evaluate import ranking_report
        from tessera.predictor.online import within_step_tau

        arr = np.array(self.rows, dtype=np.float64).reshape(-1, 4)
        if len(arr) < 2:
            nan = float("nan")
            return {"step0_tau": nan, "within_step_tau": nan, "pooled_tau": nan, "step0_tau_per_refit": nan}
        step = arr[:, 0].astype(int)
        got = ranking_report(arr[:, 1], arr[:, 2], step)
        first = step == 0
        return {
            "step0_tau": got["step0"]["kendall_tau"],
            "within_step_tau": got["within_step_tau"],
            "pooled_tau": got["kendall_tau"],
            "step0_tau_per_refit": within_step_tau(arr[first, 1], arr[first, 2], arr[first, 3].astype(int)),
        }


def _by_kind(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One batch size's rows by kind: fcfs, isrtf, isrtf:guard=off, isrtf:online, isrtf-tail, srtf-oracle."""
    out = {}
    for r in rows:
        name = r["policy"]
        variant = ":guard=off" if ",guard=off" in name else ":online" if ",online" in name else ""
        out[name.split(":")[0] + variant] = r
    return out


def _reduction(row: dict[str, Any], fcfs: dict[str, Any]) -> float:
    return 1.0 - row["mean_jct_s"] / fcfs["mean_jct_s"]


TAIL_LIMIT = 1.5  # the starvation guard's target: p99 JCT at most this many times FCFS's
ONLINE_KEPT = 0.4  # isrtf with online learning: this share of the oracle's mean-JCT gain at batch 1 ...
ONLINE_TAIL = 1.3  # ... with p99 JCT at most this many times FCFS's (the online learner's target)
GAIN_KEPT = 0.8  # ... while keeping this share of the guard-off mean-JCT reduction


def _checks(b: int, by: dict[str, dict[str, Any]], tol: float) -> list[str]:
    """Target checks for one batch size."""
    fcfs, isrtf, plain, tail, oracle = (
        by["fcfs"], by["isrtf"], by["isrtf:guard=off"], by["isrtf-tail"], by["srtf-oracle"]
    )  # fmt: skip
    red_o, red_i, red_p = _reduction(oracle, fcfs), _reduction(isrtf, fcfs), _reduction(plain, fcfs)
    out = [
        f"srtf-oracle:batch={b} mean JCT {red_o:.1%} below fcfs (target >= 50%): "
        + ("PASS" if red_o >= 0.5 else "FAIL"),
        f"isrtf:batch={b} mean JCT {red_i:.1%} below fcfs (target > 0%"
        + (", >= 15% at batch 1" if b == 1 else "")
        + f"): {'PASS' if red_i > 0 and (b != 1 or red_i >= 0.15) else 'FAIL'}",
        f"isrtf:batch={b} recovers {red_i / red_o:.0%} of the oracle's reduction" if red_o > 0 else "",
    ]
    for name, row in ((f"isrtf:batch={b}", isrtf), (f"isrtf-tail:batch={b}", tail)):
        ratio = row["p99_jct_s"] / fcfs["p99_jct_s"]
        kept = _reduction(row, fcfs) / red_p if red_p > 0 else None
        ok = ratio <= TAIL_LIMIT and (kept is None or kept >= GAIN_KEPT)
        out.append(
            f"{name} p99 JCT {ratio:.2f}x fcfs's (guard off {plain['p99_jct_s'] / fcfs['p99_jct_s']:.2f}x), "
            + ("the guard-off order gains nothing on mean JCT" if kept is None else
               f"keeps {kept:.0%} of the guard-off mean-JCT reduction {red_p:.1%}")
            + f" (target <= {TAIL_LIMIT:g}x, >= {GAIN_KEPT:.0%}): {'PASS' if ok else 'FAIL'}"
        )  # fmt: skip
    online = by.get("isrtf:online")
    if online is not None and red_o > 0:
        kept, ratio = _reduction(online, fcfs) / red_o, online["p99_jct_s"] / fcfs["p99_jct_s"]
        ok = kept >= ONLINE_KEPT and ratio <= ONLINE_TAIL
        target = f" (target >= {ONLINE_KEPT:.0%}, <= {ONLINE_TAIL:g}x): {'PASS' if ok else 'FAIL'}"
        out.append(
            f"isrtf:batch={b},online recovers {kept:.0%} of the oracle's reduction "
            f"(isrtf {red_i / red_o:.0%}), p99 JCT {ratio:.2f}x fcfs's; τ at arrival "
            f"{online['step0_tau']:.3f} (isrtf {isrtf['step0_tau']:.3f}), per refit "
            f"{online['step0_tau_per_refit']:.3f}" + (target if b == 1 else "")
        )
    rest = [r for r in by.values() if r is not fcfs]
    return [line for line in out if line] + baseline_checks(rest, fcfs, tol)


__all__ = ["DESCRIPTION", "build_workload", "run"]

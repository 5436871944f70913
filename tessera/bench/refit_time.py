"""Part ``online`` of ``tessera bench decision-time``: the text predictor's work in one decision, with
and without online refits running.

A decision here is what ISRTF asks of its text predictor when requests come and go: predict
``batch`` new requests (their prompts embedded, the head run, the online correction applied) and
``forget`` as many finished ones (each recorded in the online learner's sample, which starts a refit
when one is due). Two predictors of the shipped ``artifact`` share one encoder: ``predict:refits=off``
(a learner that never refits) and ``predict:refits=on`` (refits every ``refit_every`` finished
requests, in the refit process, as a worker runs them). They run in rounds of ``decisions``
decisions, in alternating order (each on-round waits for its last refit before the next round
starts, so that no off-decision overlaps a refit). Rows give p50 / p99 / max and a histogram of decision
time; the on-row also gives the decisions that ran while a refit was in flight, their p99 against
the off-row's, and the refits' wall and CPU time (where they ran) per 1,000 finished requests.

Options (``--set``): data (prompt/response JSONL, default the bundled HumanEval set), artifact
(``smollm2``), rounds (3), decisions (400 per round and row), batch (4), refit_every (100),
sample_size (2000), threads (1: the encoder's).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from tessera.bench.runner import option, require_positive
from tessera.bench.scenarios import Progress

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "bench" / "data" / "humaneval_smollm2.jsonl.gz"
HIST_MS = (0, 1, 2, 5, 10, 20, 50, 100, float("inf"))  # decision-time histogram bin edges (ms)


def online_rows(opts: dict[str, Any], progress: Progress) -> tuple[list[dict[str, Any]], list[str], dict]:
    """Rows ``predict:refits=off`` and ``predict:refits=on``, their check lines and the part's settings."""
    from tessera.core.request import Phase, Request
    from tessera.predictor.dataset import load_pairs
    from tessera.predictor.model import TextLengthPredictor
    from tessera.predictor.online import OnlineLearner, OnlineSettings

    data = Path(option(opts, "data", str(DEFAULT_DATA), str))
    artifact = option(opts, "artifact", "smollm2", str)
    rounds = option(opts, "rounds", 3, int)
    decisions = option(opts, "decisions", 400, int)
    batch = option(opts, "batch", 4, int)
    refit_every = option(opts, "refit_every", 100, int)
    sample_size = option(opts, "sample_size", 2000, int)
    threads = option(opts, "threads", 1, int)
    require_positive(rounds=rounds, decisions=decisions, batch=batch, threads=threads)
    pairs = load_pairs(data)
    settings = {
        "off": OnlineSettings(refit_every=1_000_000, min_samples=100, sample_size=sample_size),
        "on": OnlineSettings(
            refit_every=refit_every, min_samples=min(100, sample_size), sample_size=sample_size
        ),
    }
    first = TextLengthPredictor(artifact, threads=threads, online=OnlineLearner(settings["off"]))
    predictors = {
        "off": first,
        "on": TextLengthPredictor(
            artifact, threads=threads, encoder=first.encoder, online=OnlineLearner(settings["on"])
        ),
    }
    lengths = [first.served.count(p.response) for p in pairs]
    times: dict[str, list[float]] = {"off": [], "on": []}
    refitting: list[bool] = []  # per on-decision: a refit was in flight when it started or ended
    progress(0, total=2 * rounds)
    for r in range(rounds):
        for row in ("off", "on") if r % 2 == 0 else ("on", "off"):  # neither always runs first
            predictor = predictors[row]
            learner = predictor.online
            assert learner is not None
            counter = r * decisions * batch  # both rows of a round see the same prompts
            for _ in range(decisions):
                reqs = []
                for _ in range(batch):
                    k = counter % len(pairs)
                    # a fresh id and text each time: every decision embeds new prompts, as new arrivals do
                    text = f"{pairs[k].prompt}\n# {row} {counter}"
                    req = Request(f"{row}{counter}", 0.0, 64, 512, prompt_text=text)
                    req.response_text = pairs[k].response
                    reqs.append((req, max(1, lengths[k])))
                    counter += 1
                busy = learner.refitting
                t0 = time.perf_counter()
                predictor.predict_remaining([r for r, _ in reqs])
                for req, n in reqs:
                    req.generated, req.phase = n, Phase.FINISHED
                    predictor.forget(req)
                times[row].append(time.perf_counter() - t0)
                if row == "on":
                    refitting.append(busy or learner.refitting)
            if not learner.wait(300):
                raise RuntimeError("a refit did not finish within 300 s")
            progress(1)
    on_learner = predictors["on"].online
    assert on_learner is not None
    stats = on_learner.stats()
    held = [a + b for a, b in zip(on_learner.snapshot_seconds, on_learner.pickle_seconds, strict=False)]
    on_learner.close()
    off_ms, on_ms = (np.array(times[r]) * 1e3 for r in ("off", "on"))
    during = on_ms[np.array(refitting, dtype=bool)]
    per_k = 1000.0 / max(stats["seen"], 1)
    off, on = _row("predict:refits=off", off_ms, batch), _row("predict:refits=on", on_ms, batch)
    on.update(
        {
            "decisions_during_refit": len(during),
            "during_refit_p99_ms": float(np.percentile(during, 99)) if len(during) else None,
            "finished": stats["seen"],
            "refits": stats["refits"] + stats["rejected"] + stats["failed"],
            "refit_failed": stats["failed"],
            "refit_wall_s_per_1000": stats["refit_wall_s_total"] * per_k,
            "refit_cpu_s_per_1000": stats["refit_cpu_s_total"] * per_k,
            "refit_wall_s_max": stats["refit_wall_s_max"],
            # what a refit costs this process: copying the sample and serialising it (the decision
            # thread can wait for these, once per refit, and for nothing else of it)
            "here_ms_per_refit": 1e3 * float(np.mean(held)) if held else 0.0,
            "here_ms_max": 1e3 * max(held, default=0.0),
        }
    )
    slower = int((during > off["decision_p99_ms"]).sum())
    during_p99 = on["during_refit_p99_ms"]
    checks = [
        f"predict:refits=on p50 / p99 / max {on['decision_p50_ms']:.1f} / {on['decision_p99_ms']:.1f} / "
        f"{on['decision_max_ms']:.1f} ms against refits=off {off['decision_p50_ms']:.1f} / "
        f"{off['decision_p99_ms']:.1f} / {off['decision_max_ms']:.1f} ms; {len(during)} decisions ran "
        f"during a refit (p99 {during_p99 if during_p99 is not None else float('nan'):.1f} ms), {slower} of "
        f"them above the off-row's p99 ({slower / max(len(during), 1):.1%}; 1% is chance)",
        f"refits: {on['refits']} ({stats['failed']} failed), {on['refit_cpu_s_per_1000']:.3f} s CPU and "
        f"{on['refit_wall_s_per_1000']:.2f} s wall per 1,000 finished requests in the refit process; "
        f"{on['here_ms_per_refit']:.1f} ms (max {on['here_ms_max']:.1f}) per refit in this process "
        "copying and serialising the sample",
    ]
    results = [off, on]
    cfg = {
        "part": "online",
        "data": str(data),
        "artifact": artifact,
        "rounds": rounds,
        "decisions": decisions,
        "batch": batch,
        "refit_every": refit_every,
        "sample_size": sample_size,
        "threads": threads,
    }
    return results, checks, cfg


def _row(name: str, ms: np.ndarray, batch: int) -> dict[str, Any]:
    hist = np.histogram(ms, bins=HIST_MS)[0]
    return {
        "policy": name,
        "decisions": len(ms),
        "batch": batch,
        "decision_p50_ms": float(np.percentile(ms, 50)),
        "decision_p99_ms": float(np.percentile(ms, 99)),
        "decision_max_ms": float(ms.max()),
        "hist_ms": {f"<{edge:g}": int(n) for edge, n in zip(HIST_MS[1:], hist, strict=True)},
    }

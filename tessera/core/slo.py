"""Per-request metrics, the one definition of "SLO met", and the benchmark contract's summary.

Definitions: TTFT = first token − arrival; JCT = finish −
arrival; ITL of a request = (last − first) / (n − 1) (CHOICE: ``mean_itl_s`` is the
mean over requests with ≥ 2 tokens); normalized latency = JCT / output tokens;
p99 latency = p99 of end-to-end latency. SLO attainment is the
share of requests that met their class's SLO (``slo_met``); requests whose class has
none are left out. Goodput = requests that met their SLO per second of makespan (absent, like
attainment, when no request has an SLO).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from tessera.core.request import Phase, Request, ServiceClass


def ttft(req: Request) -> float:
    """Time to first token."""
    first = req.tokens.first_time()
    if first is None:
        raise ValueError(f"request {req.id} has no token")
    return first - req.arrival


def jct(req: Request) -> float:
    """Job completion time."""
    if req.finished_at is None:
        raise ValueError(f"request {req.id} did not finish")
    return req.finished_at - req.arrival


def mean_itl(req: Request) -> float | None:
    """Mean inter-token latency of one request (None with fewer than 2 tokens)."""
    n = req.tokens.total
    if n < 2:
        return None
    first = req.tokens.first_time()
    assert first is not None
    return (req.tokens.last_time() - first) / (n - 1)


SLO_TOLERANCE_S = 1e-9  # a request that lands exactly on a bound meets it (float sums of step times)


def slo_met(req: Request) -> bool | None:
    """Whether finished ``req`` met its class's SLO; None when the class sets none (left out).

    The one definition: the benches' attainment, local mode's report, the worker's
    ``tessera_slo_met`` / ``tessera_slo_missed`` counters and, through ``delivered_slo_met``, the
    router's client-side ``tessera_router_slo_met`` / ``_missed`` all use it.

    - A batch class is judged by its deadline alone: met when the request finished within
      ``deadline_s`` of its arrival. Without a deadline it has no SLO (None), whatever TTFT or ITL it
      names (those only steer the batch size, see ``tessera.core.chiron``).
    - An interactive class is judged by the bounds it sets: TTFT ≤ ``ttft_slo_s`` and the request's
      mean ITL (``mean_itl``: first to last token) ≤ ``itl_slo_s``; setting neither means no SLO (None).
      A request that finished without a token misses a TTFT bound; with fewer than two tokens an ITL
      bound constrains nothing.
    - Every comparison allows ``SLO_TOLERANCE_S``.
    """
    sc = req.service_class
    if sc.kind == "batch":
        if sc.deadline_s is None:
            return None
        return jct(req) <= sc.deadline_s + SLO_TOLERANCE_S
    if sc.ttft_slo_s is None and sc.itl_slo_s is None:
        return None
    if sc.ttft_slo_s is not None:
        first = req.first_token_at
        if first is None or first - req.arrival > sc.ttft_slo_s + SLO_TOLERANCE_S:
            return False
    if sc.itl_slo_s is not None:
        itl = mean_itl(req)
        return itl is None or itl <= sc.itl_slo_s + SLO_TOLERANCE_S
    return True


# Statuses of an answer the service failed: the client got no answer, so a class with an SLO missed it.
# 429 is the service refusing work it could not take in time (queue or hold full), not a client mistake.
_FAILED_BY_SERVICE = 429


def delivered_slo_met(
    service_class: ServiceClass,
    *,
    status: int,
    arrival: float,
    finished: float,
    first_token: float | None = None,
    last_token: float | None = None,
    tokens: int = 0,
) -> bool | None:
    """``slo_met`` judged from what one hop delivered to its client (the router's view), not a second
    definition: the delivery times become a finished ``Request`` that ``slo_met`` judges.

    ``tokens`` pieces of text were sent, the first at ``first_token`` and the last at ``last_token``
    (the mean ITL is what ``mean_itl`` computes from them); an answer sent in one piece is one token at
    its send time, so an ITL bound constrains nothing there. An answer the service failed (5xx, 429)
    misses any SLO its class has; a client error (other 4xx) or a client that left (499) is not judged
    (None), like a class without an SLO.
    """
    failed = status >= 500 or status == _FAILED_BY_SERVICE
    if not failed and not 200 <= status < 300:
        return None
    req = Request(id="delivered", arrival=arrival, prompt_tokens=0, max_tokens=max(1, tokens),
                  service_class=service_class, phase=Phase.FINISHED, finished_at=finished)  # fmt: skip
    if not failed and tokens > 0 and first_token is not None:
        req.tokens.append(first_token)
        if tokens > 1 and last_token is not None:
            gap = (last_token - first_token) / (tokens - 1)
            req.tokens.append_run(first_token + gap, tokens - 1, gap)
    met = slo_met(req)
    return met and not failed if met is not None else None


def _qoe_function() -> Any:
    try:
        from tessera.core.qoe import request_qoe
    except ImportError:
        return None
    return request_qoe


def _p99(values: np.ndarray) -> float:
    return float(np.percentile(values, 99))


def latency_metrics(
    ttfts: Sequence[float], jcts: Sequence[float], met: Sequence[bool | None], makespan_s: float
) -> dict[str, Any]:
    """The keys every bench row carries next to its headline, in one place: mean, p50 and p99 of TTFT
    (None without any first token) and JCT, throughput and goodput (requests that met their SLO per
    second; absent when no request has an SLO, ``met`` None) over ``makespan_s``."""
    t, j = np.asarray(ttfts, dtype=float), np.asarray(jcts, dtype=float)
    judged = [m for m in met if m is not None]
    per_s = 1.0 / makespan_s if makespan_s > 0 else None
    out: dict[str, Any] = {
        "mean_ttft_s": float(t.mean()) if t.size else None,
        "p50_ttft_s": float(np.median(t)) if t.size else None,
        "p99_ttft_s": _p99(t) if t.size else None,
        "mean_jct_s": float(j.mean()),
        "p50_jct_s": float(np.median(j)),
        "p99_jct_s": _p99(j),
        "throughput_rps": len(j) * per_s if per_s is not None else None,
    }
    if judged:
        out["goodput_rps"] = sum(judged) * per_s if per_s is not None else None
    return out


def summarize(
    requests: Sequence[Request],
    *,
    gpu_seconds: float | None = None,
    makespan_s: float | None = None,
    swaps: int | None = None,
    wall_s: float | None = None,
    qoe: bool = True,
) -> dict[str, Any]:
    """The contract's metric keys over finished ``requests``; unfinished ones raise."""
    if not requests:
        raise ValueError("no requests to summarize")
    unfinished = [r.id for r in requests if not r.finished]
    if unfinished:
        raise ValueError(f"{len(unfinished)} requests unfinished (first {unfinished[0]})")
    jcts = np.array([jct(r) for r in requests])
    outs = np.array([r.generated for r in requests], dtype=float)
    itls = [x for x in (mean_itl(r) for r in requests) if x is not None]
    if makespan_s is None:
        makespan_s = max(r.finished_at or 0.0 for r in requests) - min(r.arrival for r in requests)
    met = [slo_met(r) for r in requests]
    out: dict[str, Any] = {
        "requests": len(requests),
        **latency_metrics([ttft(r) for r in requests], jcts, met, makespan_s),
        "mean_itl_s": float(np.mean(itls)) if itls else None,
        "normalized_latency_mean": float((jcts / outs).mean()),
        "p99_latency_s": _p99(jcts),
    }
    by_class: dict[str, list[bool]] = defaultdict(list)
    for r, m in zip(requests, met, strict=True):
        if m is not None:
            by_class[r.service_class.name].append(m)
    if by_class:
        everything = [m for ms in by_class.values() for m in ms]
        out["slo_attainment"] = sum(everything) / len(everything)
        out["slo_attainment_by_class"] = {k: sum(v) / len(v) for k, v in sorted(by_class.items())}
    request_qoe = _qoe_function() if qoe else None
    if request_qoe is not None:
        qoes = np.array([request_qoe(r) for r in requests])
        out["avg_qoe"] = float(qoes.mean())
        out["qoe_ge_095_share"] = float((qoes >= 0.95).mean())
    out["output_tokens_per_s"] = float(outs.sum()) / makespan_s if makespan_s > 0 else None
    if gpu_seconds is not None:
        out["gpu_seconds"] = gpu_seconds
    out["preemptions"] = int(sum(r.preemptions for r in requests))
    if swaps is not None:
        out["swaps"] = swaps
    if wall_s is not None:
        out["wall_s"] = wall_s
    return out

"""Andes' token-streaming QoE (Andes §3.1, Eq. 1-3; docs/papers.md, "Andes: QoE").

A user reads token i no earlier than it is delivered (``D_i``) and no faster than
the reading speed ``r``, so delays cascade (pacer semantics):
``A_1 = D_1`` and ``A_i = max(D_i, A_{i-1} + 1/r)``. The ideal consumption time is
``I_i = arrival + T* + (i-1)/r``. With ``d_i = A_i - I_i``:

    S_delay = sum_i max(0, d_i)          (Eq. 1, clamped: early tokens do not lift QoE above 1)
    S_whole = sum_i (A_n - I_i)          (Eq. 2)
    QoE     = 1 - S_delay / S_whole      (Eq. 3; 1 when S_delay == 0, 0 when no token came)

The recursion has a closed form used throughout: ``A_i = (i-1)/r + max_{j<=i}(D_j - (j-1)/r)``,
so ``d_i = cummax_j(D_j - (j-1)/r) - (arrival + T*)`` is non-decreasing in i.

Also here: the any-time QoE at a horizon ``tau`` (our choice, docs/papers.md) and the QoE gain
``Q_serve - Q_wait`` of serving a request for the next ``horizon`` seconds at one
token every ``g`` seconds (Andes §4.1, Eq. 5), in closed form and vectorised over requests.
Pure functions: time always comes in as an argument.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tessera.core.request import Request
from tessera.core.timeline import TokenTimeline

# Andes assumes this prefill throughput when it sets T* = max(P / 5000, 1) s (paper §6.1).
PREFILL_TOKENS_PER_S = 5000.0
MIN_TTFT_TARGET_S = 1.0
# S_delay at or below this counts as no delay (QoE is 1 when there is none).
DELAY_EPS_S = 1e-9


def ttft_target_s(prompt_tokens: int, configured: float | None = None) -> float:
    """Andes' TTFT target T*: the class's value, or ``max(P / 5000, 1)`` seconds when unset."""
    if configured is not None:
        return configured
    return max(prompt_tokens / PREFILL_TOKENS_PER_S, MIN_TTFT_TARGET_S)


@dataclass(frozen=True, slots=True)
class QoEParams:
    """The user-side parameters of one request's QoE."""

    arrival: float
    ttft_target_s: float
    reading_speed_tps: float

    def __post_init__(self) -> None:
        if not self.reading_speed_tps > 0:
            raise ValueError(f"reading speed must be > 0 tokens/s, got {self.reading_speed_tps}")
        if not self.ttft_target_s >= 0:
            raise ValueError(f"TTFT target must be >= 0 s, got {self.ttft_target_s}")

    @property
    def ideal_start(self) -> float:
        """Ideal consumption time of the first token: ``arrival + T*``."""
        return self.arrival + self.ttft_target_s

    def ideal_time(self, index: int) -> float:
        """Ideal consumption time of token ``index`` (1-based)."""
        return self.ideal_start + (index - 1) / self.reading_speed_tps


def qoe_params(req: Request) -> QoEParams:
    """QoE parameters of a request from its service class (T* default ``max(P/5000, 1)``)."""
    cls = req.service_class
    return QoEParams(req.arrival, ttft_target_s(req.prompt_tokens, cls.ttft_target_s), cls.reading_speed_tps)


def consumption_times(delivery: np.ndarray, reading_speed_tps: float) -> np.ndarray:
    """Actual consumption times ``A_i`` of tokens delivered at ``delivery`` (pacer semantics)."""
    step = np.arange(delivery.size, dtype=float) / reading_speed_tps
    return step + np.maximum.accumulate(delivery - step) if delivery.size else delivery.astype(float)


def ideally_due(params: QoEParams, tau: float) -> int:
    """Number of tokens the user would ideally have consumed by ``tau`` (``m(tau)``)."""
    if tau < params.ideal_start:
        return 0
    return math.floor((tau - params.ideal_start) * params.reading_speed_tps) + 1


def whole_area(params: QoEParams, tau: float, tokens: int) -> float:
    """``S_whole`` over the first ``tokens`` tokens measured up to ``tau``: ``sum_i (tau - I_i)``."""
    return tokens * (tau - params.ideal_start) - tokens * (tokens - 1) / (2 * params.reading_speed_tps)


def qoe_from_delivery(delivery: np.ndarray, params: QoEParams) -> float:
    """Eq. 1-3 over the tokens delivered at ``delivery`` (seconds, non-decreasing)."""
    n = int(delivery.size)
    if n == 0:
        return 0.0
    actual = consumption_times(np.asarray(delivery, dtype=float), params.reading_speed_tps)
    ideal = params.ideal_start + np.arange(n, dtype=float) / params.reading_speed_tps
    s_delay = float(np.maximum(actual - ideal, 0.0).sum())
    if s_delay <= DELAY_EPS_S:
        return 1.0
    return 1.0 - s_delay / whole_area(params, float(actual[-1]), n)


def request_qoe(req: Request) -> float:
    """QoE (Eq. 3) of a request over the tokens it has delivered: its final QoE once finished."""
    return qoe_from_delivery(req.tokens.times(), qoe_params(req))


def horizon_qoe_from_delivery(
    delivery: np.ndarray, params: QoEParams, tau: float, final_tokens: int | None = None
) -> float:
    """Any-time QoE at ``tau`` (docs/papers.md, "Andes: QoE"): tokens ideally due by ``tau`` count,
    undelivered ones as consumed at +inf; ``final_tokens`` caps the due count for a finished request. Equals
    Eq. 3 at ``tau = A_n`` of a finished request."""
    m = ideally_due(params, tau)
    if final_tokens is not None:
        m = min(m, final_tokens)
    if m == 0:
        return 1.0
    delivered = np.asarray(delivery[:m], dtype=float)
    actual = consumption_times(delivered, params.reading_speed_tps)
    ideal = params.ideal_start + np.arange(m, dtype=float) / params.reading_speed_tps
    s_delay = float(np.maximum(np.minimum(actual, tau) - ideal[: actual.size], 0.0).sum())
    s_delay += float((tau - ideal[actual.size :]).sum())  # never delivered: the whole area is delay
    if s_delay <= DELAY_EPS_S:
        return 1.0
    return 1.0 - s_delay / whole_area(params, tau, m)


def qoe_at(req: Request, tau: float) -> float:
    """Any-time QoE of a request (queued, running or finished) at time ``tau``."""
    final = req.tokens.total if req.finished else None
    return horizon_qoe_from_delivery(req.tokens.times(), qoe_params(req), tau, final)


class ConsumptionTracker:
    """Incremental ``A_n`` (consumption time of the latest delivered token) of one timeline.

    Reads only runs it has not seen, each in O(1): within a run the delivery times are
    quadratic in the token index, so ``max_k (D_k - (k-1)/r)`` over the run is found at
    its ends or its vertex. Cost grows with runs (events), not tokens.
    """

    __slots__ = ("_last_count", "_max_lead", "_runs", "reading_speed_tps", "tokens")

    def __init__(self, reading_speed_tps: float) -> None:
        if not reading_speed_tps > 0:
            raise ValueError(f"reading speed must be > 0 tokens/s, got {reading_speed_tps}")
        self.reading_speed_tps = reading_speed_tps
        self.tokens = 0  # tokens seen
        self._runs = 0  # runs fully or partly seen
        self._last_count = 0  # tokens seen of the last seen run
        self._max_lead = -math.inf  # max_j (D_j - (j-1)/r) so far

    def update(self, timeline: TokenTimeline) -> None:
        """Take in the tokens appended to ``timeline`` since the last call."""
        if timeline.total == self.tokens:  # also brings a shared-log timeline up to date
            return
        counts = timeline.counts
        if self._runs and counts[self._runs - 1] != self._last_count:
            # the last seen run grew in place: take in its new tail
            self._take_run(timeline, self._runs - 1, self._last_count)
        for run in range(self._runs, len(counts)):
            self._take_run(timeline, run, 0)
        self._runs = len(counts)
        self._last_count = counts[-1] if counts else 0

    def _take_run(self, timeline: TokenTimeline, run: int, skip: int) -> None:
        t0, count = timeline.t_first[run], timeline.counts[run]
        iv, growth = timeline.intervals[run], timeline.growths[run]
        inv_r = 1.0 / self.reading_speed_tps
        base = self.tokens - skip  # global 0-based index of the run's first token

        def lead(k: int) -> float:
            return t0 + k * iv + growth * k * (k - 1) / 2 - (base + k) * inv_r

        candidates = [skip, count - 1]
        if growth < 0:  # concave: the maximum may sit at the vertex
            vertex = (inv_r - iv) / growth + 0.5
            for k in (math.floor(vertex), math.ceil(vertex)):
                if skip <= k <= count - 1:
                    candidates.append(k)
        self._max_lead = max(self._max_lead, *(lead(k) for k in candidates))
        self.tokens += count - skip

    @property
    def last_consumption(self) -> float:
        """``A_n`` of the latest token seen; -inf before any token."""
        if self.tokens == 0:
            return -math.inf
        return (self.tokens - 1) / self.reading_speed_tps + self._max_lead


def gains(
    now: float,
    horizon: float,
    step_s: np.ndarray | float,
    ideal_start: np.ndarray,
    reading_speed: np.ndarray,
    delivered: np.ndarray,
    last_consumption: np.ndarray,
    start_delay: np.ndarray | float = 0.0,
    remaining: np.ndarray | float = np.inf,
) -> np.ndarray:
    """QoE gain ``Q_serve(tau) - Q_wait(tau)``, ``tau = now + horizon``, of serving each request
    (Andes §4.1: the gain of Eq. 5, computed exactly on the any-time QoE), in closed form and
    broadcast over arrays.

    Serving generates token ``n+k`` at ``D_k = now + start_delay + k*step_s``. With
    ``C_k`` its consumption time and ``I_k`` its ideal time, the avoided delay area is
    ``sum_k max(0, tau - max(C_k, I_k))``; ``max(C_k, I_k) = max(b + k/r, t0 + k*g)`` with
    ``b = max(A_n, t0 + g - 1/r, I_base)``, so the sum splits into at most two
    arithmetic series. Dividing by ``S_whole(tau)`` (the same for serve and wait) gives
    the gain. ``delivered`` is n, ``last_consumption`` is ``A_n`` (-inf when n == 0),
    ``remaining`` caps the tokens still to come (the oracle ablation; inf by default).
    ``step_s`` may be a column to evaluate several batch sizes at once.
    """
    r = reading_speed
    inv_r = 1.0 / r
    g = np.asarray(step_s, dtype=float)
    tau = now + horizon
    t0 = now + np.asarray(start_delay, dtype=float)
    n = delivered.astype(float)
    i_base = ideal_start + (n - 1.0) * inv_r  # so that I_k = i_base + k/r for token n+k
    b = np.maximum(np.maximum(last_consumption, t0 + g - inv_r), i_base)
    # u(k) = tau - b - k/r (user-paced), v(k) = tau - t0 - k*g (generation-paced); sum min(u, v)^+.
    cu, cv = tau - b, tau - t0
    with np.errstate(divide="ignore", invalid="ignore"):
        kmax = np.floor(np.minimum(cu * r, np.where(g > 0, cv / g, np.inf)))
        kmax = np.minimum(np.maximum(kmax, 0.0), np.maximum(np.asarray(remaining, dtype=float), 0.0))
        # u <= v exactly when k*(g - 1/r) <= b - t0
        slope = g - inv_r
        cross = np.where(slope != 0, (b - t0) / slope, np.where(b >= t0, np.inf, -np.inf))
    u_first = (cu - inv_r) <= (cv - g)  # which line is the minimum at k = 1
    switches = np.where(u_first, slope > 0, slope < 0)
    split = np.where(switches, np.clip(np.floor(cross), 0.0, kmax), kmax)
    split = np.where(np.isfinite(split), split, kmax)
    c1, s1 = np.where(u_first, cu, cv), np.where(u_first, inv_r, g)
    c2, s2 = np.where(u_first, cv, cu), np.where(u_first, g, inv_r)
    area = _series(c1, s1, 1.0, split) + _series(c2, s2, split + 1.0, kmax)
    m = np.where(tau >= ideal_start, np.floor((tau - ideal_start) * r) + 1.0, 0.0)
    m = np.minimum(m, n + np.asarray(remaining, dtype=float))
    s_whole = m * (tau - ideal_start) - m * (m - 1.0) * inv_r / 2.0
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where((m > n) & (s_whole > 0), area / s_whole, 0.0)
    return np.maximum(out, 0.0)


def _series(c: np.ndarray, s: np.ndarray, k1: np.ndarray | float, k2: np.ndarray) -> np.ndarray:
    """``sum_{k=k1..k2} (c - s*k)`` elementwise (0 where the range is empty)."""
    count = np.maximum(k2 - k1 + 1.0, 0.0)
    return np.where(count > 0, count * c - s * (k1 + k2) * count / 2.0, 0.0)


def request_gain(req: Request, now: float, horizon: float, step_s: float, start_delay: float = 0.0) -> float:
    """QoE gain of serving one request for ``horizon`` seconds at ``step_s`` per token."""
    params = qoe_params(req)
    tracker = ConsumptionTracker(params.reading_speed_tps)
    tracker.update(req.tokens)
    out = gains(
        now,
        horizon,
        step_s,
        np.array([params.ideal_start]),
        np.array([params.reading_speed_tps]),
        np.array([req.tokens.total]),
        np.array([tracker.last_consumption]),
        start_delay,
    )
    return float(out[0])

"""Synthetic and trace-driven workloads: arrivals, lengths, request classes and models.

Arrival processes (docs/papers.md, "Engine: synthetic workloads"): Poisson(λ); Gamma inter-arrivals with
``shape`` and ``scale`` (CV² = 1/shape); bursty surges (the rate is multiplied for
a fraction of the time, in alternating windows); a per-window rate series (Poisson, or Gamma with
each window's CV). Lengths come from a trace, a
prompt/response JSONL file, or a ShareGPT lognormal fit. Everything is
seeded by the caller's ``numpy.random.Generator``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tessera.api.traces import HASH_BLOCK_TOKENS, RateSeries, TraceRow
from tessera.core.request import Request, ServiceClass


def _words_tokens(text: str) -> int:
    """Default token estimate: about 1.3 tokens per English word (shared/data README)."""
    return max(1, round(len(text.split()) * 1.3))


_tokenizer: Callable[[str], int] = _words_tokens


def count_tokens(text: str) -> int:
    """Tokens in ``text`` by the current counter (words × 1.3 until a real tokenizer is set)."""
    return _tokenizer(text)


def set_token_counter(counter: Callable[[str], int] | None) -> None:
    """Swap the token counter (None restores words × 1.3)."""
    global _tokenizer
    _tokenizer = counter or _words_tokens


# ---- arrivals ---------------------------------------------------------------------------------
def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` Poisson arrival times at ``rate`` requests/s, the first at 0."""
    _check_rate(rate)
    gaps = rng.exponential(1.0 / rate, n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def gamma_arrivals(n: int, shape: float, scale: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times with Gamma(shape, scale) inter-arrival gaps (mean gap shape·scale)."""
    if shape <= 0 or scale <= 0:
        raise ValueError(f"gamma arrivals need shape > 0 and scale > 0, got {shape}, {scale}")
    gaps = rng.gamma(shape, scale, n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def gamma_for_rate(rate: float, cv: float) -> tuple[float, float]:
    """(shape, scale) of Gamma gaps with mean 1/rate and coefficient of variation ``cv``."""
    _check_rate(rate)
    if cv <= 0:
        raise ValueError(f"cv must be > 0, got {cv}")
    return 1.0 / cv**2, cv**2 / rate


def bursty_arrivals(
    n: int,
    rate: float,
    rng: np.random.Generator,
    multiplier: float = 2.0,
    fraction: float = 0.35,
    period_s: float = 60.0,
) -> np.ndarray:
    """Poisson arrivals whose rate is ``multiplier``× for ``fraction`` of each ``period_s`` window.

    The base rate is lowered so the long-run mean stays ``rate``.
    """
    _check_rate(rate)
    if multiplier < 1 or not 0 < fraction < 1 or period_s <= 0:
        raise ValueError("bursty arrivals need multiplier >= 1, 0 < fraction < 1 and period_s > 0")
    base = rate / (1 + fraction * (multiplier - 1))
    # Thinning of a Poisson process at the peak rate.
    peak = base * multiplier
    times: list[float] = []
    t = 0.0
    while len(times) < n:
        t += rng.exponential(1.0 / peak)
        in_burst = (t % period_s) < fraction * period_s
        if in_burst or rng.random() < 1.0 / multiplier:
            times.append(t)
    out = np.asarray(times)
    return out - out[0]


SERIES_DISTRIBUTIONS = ("poisson", "gamma")


def series_arrivals(
    series: RateSeries, n: int, rng: np.random.Generator, distribution: str = "poisson"
) -> np.ndarray:
    """``n`` arrival times following a rate series, repeated end to end until there are ``n``.

    ``poisson``: exponential gaps; ``gamma``: Gamma gaps with each window's ``cv``. Within a window
    a gap is drawn in units of that window's mean gap, and the part of a gap that crosses into the
    next window continues at the next window's rate (a time change of one renewal process), so
    rates and burstiness switch at the window boundaries and windows at rate 0 stay empty.
    """
    if distribution not in SERIES_DISTRIBUTIONS:
        raise ValueError(f"arrival distribution {distribution!r}: one of {', '.join(SERIES_DISTRIBUTIONS)}")
    if distribution == "gamma" and not series.has_cv:
        raise ValueError("gamma arrivals from a rate series need its cv column (or use poisson)")
    if n < 1:
        raise ValueError(f"need at least one arrival, got n={n}")
    windows = series.windows
    ends = [w.start_s for w in windows[1:]] + [series.end_s]
    out: list[float] = []
    offset = 0.0
    work = 0.0  # the current gap left to cover, in mean gaps
    while len(out) < n:
        for w, end in zip(windows, ends, strict=True):
            t = offset + w.start_s
            stop = offset + end
            while len(out) < n:
                if work <= 0.0:
                    if distribution == "poisson" or w.cv is None:
                        work = rng.exponential(1.0)
                    else:
                        work = rng.gamma(1.0 / w.cv**2, w.cv**2)
                if w.rate_rps <= 0 or t + work / w.rate_rps >= stop:
                    work -= (stop - t) * w.rate_rps
                    break
                t += work / w.rate_rps
                work = 0.0
                out.append(t)
        offset += series.end_s
    return np.asarray(out)


def _check_rate(rate: float) -> None:
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")


def scale_to_rate(arrivals: Sequence[float], rate: float) -> np.ndarray:
    """Stretch or compress arrival times so their mean rate is ``rate`` (shape kept)."""
    _check_rate(rate)
    arr = np.asarray(arrivals, dtype=float)
    if len(arr) < 2 or arr[-1] - arr[0] <= 0:
        raise ValueError("rate scaling needs at least two distinct arrival times")
    current = (len(arr) - 1) / (arr[-1] - arr[0])
    return (arr - arr[0]) * (current / rate)


# ---- lengths ----------------------------------------------------------------------------------
def sharegpt_lengths(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(input, output) lengths from the lognormal ShareGPT fit of docs/papers.md."""
    inp = np.clip(np.round(rng.lognormal(4.58, 1.0, n)), 4, 2048).astype(int)
    out = np.clip(np.round(rng.lognormal(5.50, 0.8, n)), 4, 2048).astype(int)
    out = np.minimum(out, 4096 - inp)
    return inp, out


# ---- mixes ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Mix:
    """Weighted choice of request classes and models."""

    classes: tuple[tuple[ServiceClass, float], ...] = ((ServiceClass(), 1.0),)
    models: tuple[tuple[str, float], ...] = (("default", 1.0),)

    def __post_init__(self) -> None:
        for what, items in (("class", self.classes), ("model", self.models)):
            if not items or any(w < 0 for _, w in items) or sum(w for _, w in items) <= 0:
                raise ValueError(f"{what} mix needs non-negative weights with a positive sum")

    def draw(self, n: int, rng: np.random.Generator) -> tuple[list[ServiceClass], list[str]]:
        """Class and model of ``n`` requests."""
        cw = np.array([w for _, w in self.classes], dtype=float)
        mw = np.array([w for _, w in self.models], dtype=float)
        ci = rng.choice(len(cw), n, p=cw / cw.sum())
        mi = rng.choice(len(mw), n, p=mw / mw.sum())
        return [self.classes[i][0] for i in ci], [self.models[i][0] for i in mi]


def build_requests(
    arrivals: Sequence[float],
    input_tokens: Sequence[int],
    output_tokens: Sequence[int],
    rng: np.random.Generator,
    mix: Mix | None = None,
    max_tokens: int | None = None,
    prefix: str = "r",
) -> list[Request]:
    """Requests from parallel arrays; classes and models drawn from ``mix``."""
    n = len(arrivals)
    if not n == len(input_tokens) == len(output_tokens):
        raise ValueError("arrivals, input and output lengths must have the same length")
    classes, models = (mix or Mix()).draw(n, rng)
    reqs = []
    for i in range(n):
        out = int(output_tokens[i])
        if out < 1:
            raise ValueError(f"request {i}: output_tokens must be >= 1, got {out}")
        p = int(input_tokens[i])
        if p < 1:
            raise ValueError(f"request {i}: input_tokens must be >= 1, got {p}")
        reqs.append(
            Request(
                id=f"{prefix}{i}",
                arrival=float(arrivals[i]),
                prompt_tokens=p,
                max_tokens=max_tokens if max_tokens is not None else out,
                model=models[i],
                service_class=classes[i],
                true_output_tokens=out,
            )
        )
    return reqs


def requests_from_trace(
    rows: Sequence[TraceRow],
    rng: np.random.Generator,
    *,
    rate: float | None = None,
    limit: int | None = None,
    mix: Mix | None = None,
    classes: dict[str, ServiceClass] | None = None,
) -> list[Request]:
    """Requests replaying ``rows`` (optionally the first ``limit``, rescaled to ``rate``).

    Rows with 0 output tokens produce 1 (a request always yields its first token); rows with 0
    input tokens count 1. A row's own model and class, when present, win over ``mix``.
    """
    rows = list(rows[:limit] if limit else rows)
    if not rows:
        raise ValueError("the trace has no rows to replay")
    arrivals = np.array([r.arrival for r in rows])
    if rate is not None:
        arrivals = scale_to_rate(arrivals, rate)
    reqs = build_requests(
        arrivals,
        [max(1, r.input_tokens) for r in rows],
        [max(1, r.output_tokens) for r in rows],
        rng,
        mix,
    )
    for req, row in zip(reqs, rows, strict=True):
        if row.model is not None:
            req.model = row.model
        if row.service_class is not None:
            if classes is None or row.service_class not in classes:
                known = ", ".join(classes or {}) or "none configured"
                raise ValueError(f"trace class {row.service_class!r} is not a known class ({known})")
            req.service_class = classes[row.service_class]
        req.prompt_text = row.prompt
        req.response_text = row.response
        if row.hash_ids is not None:
            req.prefix_blocks, req.prefix_block_tokens = row.hash_ids, HASH_BLOCK_TOKENS
    return reqs


def copy_requests(reqs: Sequence[Request]) -> list[Request]:
    """Fresh, unstarted copies (same ids, arrivals, lengths, classes) for a side-by-side run."""
    return [
        Request(
            id=r.id,
            arrival=r.arrival,
            prompt_tokens=r.prompt_tokens,
            max_tokens=r.max_tokens,
            model=r.model,
            service_class=r.service_class,
            true_output_tokens=r.true_output_tokens,
            prompt_text=r.prompt_text,
            response_text=r.response_text,
            prefix_blocks=r.prefix_blocks,
            prefix_block_tokens=r.prefix_block_tokens,
            tenant=r.tenant,
            tenant_weight=r.tenant_weight,
        )
        for r in reqs
    ]

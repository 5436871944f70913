"""Online learning of the text predictor from the deployment's own finished requests.

A head trained once on one prompt set ranks other prompts poorly (step-0 Kendall τ 0.105 on coding
prompts against 0.217 on its own held-out split; docs/bench.md), while every worker sees the true length of
every answer it serves. ``OnlineLearner`` keeps a bounded sample of recently finished requests and
refits, every ``refit_every`` finished requests or ``refit_seconds`` seconds, a correction of the
shipped head on them.

The correction (CHOICE: cheap, and the shipped head is its prior by construction): at arrival, a
residual on the head's log prediction, ``log1p(true length) − log1p(head's prediction)``, made of

- a ridge regression on standardised inputs — the head's own log prediction, the arrival scalars
  (the prompt length among them) and the prompt embedding — with every coefficient shrunk towards
  0, that is towards the head: the scalars and the intercept by ``arrival_prior_weight``, the
  embedding by ``embedding_prior_weight`` (``fit_correction`` says why two);
- a prompt memory (``Memory``) of what the ridge left unexplained for prompts seen before;
- a blend weight on the ridge's slopes and the memory (not on its intercept, the scale), chosen on
  the sample itself by a prequential validation (``blend_weight``): weight 0 is the head's order, so
  on the sample's own later requests the blend ranks at least as well as the head.

Its inputs are what the predictor computed when the request arrived, so a refit embeds nothing and
runs no head pass. Before ``min_samples`` finished requests the head predicts alone. The later
steps get a calibration by position only (``later_inputs``), installed only if it beats the head on
the newest ``holdout_fraction`` of the sample: on the smollm2 held-out prompts a correction of the
later steps by the request's own inputs (fitted on every step) lowered the mean within-step τ from
0.118 to 0.014-0.090, the head reading the answer so far better than a linear model does.

A refit that raises or gives non-finite coefficients, or whose process dies, keeps the previous
correction (``failed``, logged).

Refits run off the decision path (``background``): the caller only appends to the sample (one row
copied into preallocated columns) and wakes a refit thread; that thread copies the sample's columns
and hands them to a refit process of its own (started once, in Linux's idle scheduling class),
which fits and sends back the correction (with the memory's unit prompt embeddings: 3 MB at 2,000
requests). A thread of the worker's process would hold its
interpreter lock through the fit's Python parts and, on a loaded 2-core machine, lengthened the
tail of the decisions' prediction time (p99 43 ms against 17.7 ms without refits); in a process
the worker holds the lock only for the copy, the send and the install. Predictions read whichever
correction was installed last (one attribute read), so no decision waits for a refit.
``background=False`` refits inline, for replays on a virtual clock (the prequential evaluation and
``tessera bench elis``).

State that survives a configuration reload: ``shared_learner`` hands the same learner to every text
predictor of one artifact and settings in the process, so a policy rebuilt by a reload keeps the
sample and the correction.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from scipy.stats import kendalltau

log = logging.getLogger(__name__)

REFIT_NICE = 19  # the refit process's nice, beside the idle scheduling class (Linux)
MIN_STEP_SAMPLES = 10  # a step's τ enters the within-step mean only with this many requests at it
ARRIVAL_BLENDS = ("validated", "full")
BLEND_GRID = (0.0, 0.25, 0.5, 0.75, 1.0)  # the arrival correction's weights "validated" chooses among


@dataclass(frozen=True, slots=True)
class OnlineSettings:
    """When to refit and how much to keep; every bound is checked (ValueError naming the setting)."""

    refit_every: int = 100  # finished requests between refits
    refit_seconds: float = 300.0  # ... or seconds since the last refit, whichever comes first
    sample_size: int = 2000  # finished requests kept (the most recent)
    min_samples: int = 100  # finished requests before the first refit: the head alone until then
    prior_weight: float = 100.0  # the later steps' ridge penalty, in samples' worth of the head's prior
    # the arrival correction's penalties: on its scalar inputs (the head's log prediction, prompt
    # length) and intercept, and on the prompt embedding's coordinates (see ``fit_correction``)
    arrival_prior_weight: float = 1.0
    embedding_prior_weight: float = 1000.0
    holdout_fraction: float = 0.2  # newest share of the sample the later calibration must do better on
    # how much of the arrival correction's ranking is used (see ``blend_weight``): "validated" (the
    # weight in BLEND_GRID that ranks best on the sample, fitted on older requests and scored on newer
    # ones) or "full" (all of it, unchecked)
    arrival_blend: str = "validated"
    blend_folds: int = 5  # the sample's time-ordered folds for "validated"
    # the prompt memory (``Memory``): cosine-distance scale of "the same prompt" (0: no memory), and
    # its prior in requests' worth of the ridge's residual 0
    memory_bandwidth: float = 0.02
    memory_prior: float = 1.0
    background: bool = True  # refit in a process of its own (False: inline, for virtual-clock replays)

    def __post_init__(self) -> None:
        bounds: dict[str, tuple[float, float]] = {
            "refit_every": (1, 1_000_000),
            "refit_seconds": (1.0, 86_400.0),
            "sample_size": (20, 100_000),
            "min_samples": (10, 100_000),
            "prior_weight": (1.0, 1e6),
            "arrival_prior_weight": (0.01, 1e6),
            "embedding_prior_weight": (1.0, 1e9),
            "holdout_fraction": (0.05, 0.5),
            "blend_folds": (2, 20),
            "memory_bandwidth": (0.0, 1.0),
            "memory_prior": (0.01, 1e6),
        }
        for name, (low, high) in bounds.items():
            value = getattr(self, name)
            if not low <= value <= high:  # NaN fails too
                raise ValueError(f"online {name} must be in [{low:g}, {high:g}], got {value}")
        if self.arrival_blend not in ARRIVAL_BLENDS:
            raise ValueError(
                f"online arrival_blend must be one of {ARRIVAL_BLENDS}, got {self.arrival_blend!r}"
            )
        if self.min_samples > self.sample_size:
            raise ValueError(
                f"online min_samples ({self.min_samples}) must be <= sample_size ({self.sample_size})"
            )


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """One finished request in the sample: what the predictor computed when it predicted it, and its
    true length."""

    prompt_emb: np.ndarray
    head_prediction: float  # the head's prediction at arrival (tokens)
    scalars: np.ndarray  # the arrival feature vector's scalars (features.N_SCALARS)
    length: int  # true output tokens
    hit_max_tokens: bool
    # one row per later prediction: generated tokens, the head's prediction, the scalars (k × (2 + scalars))
    later: np.ndarray


def correction_inputs(head_prediction: np.ndarray, scalars: np.ndarray, prompt_emb: np.ndarray) -> np.ndarray:
    """The arrival correction's inputs (n × (1 + scalars + embedding)): the head's log prediction, the
    arrival scalars (of which the prompt length varies) and the prompt embedding."""
    log_head = np.log1p(np.maximum(np.asarray(head_prediction, dtype=np.float64), 0.0))
    return np.concatenate([log_head[:, None], scalars, prompt_emb], axis=1)


def later_inputs(head_prediction: np.ndarray, scalars: np.ndarray) -> np.ndarray:
    """The later steps' calibration inputs (n × 2): the two position scalars (log and linear tokens
    generated). CHOICE: nothing that varies between requests at one position, so that the calibration
    rescales the head across positions (a running request against a queued one) and keeps its order
    within a position. On the coding prompts (prequential, 2 passes, after 500) the mean within-step
    τ stayed at the head's 0.204 only so: with the prompt length and repetition ratios as inputs too
    it fell to 0.167, with the log head prediction as one (a slope that can cancel or reverse the head)
    to 0.126."""
    return np.asarray(scalars[:, :2], dtype=np.float64)


@dataclass(frozen=True, slots=True)
class Memory:
    """What the finished requests left unexplained, by prompt: a request whose prompt embedding is
    close to finished ones' is shifted by their mean residual (weights ``exp((cos − 1) / bandwidth)``,
    shrunk towards 0 by ``prior`` requests' worth). With the default bandwidth 0.02 a prompt at cosine
    0.9 weighs e^-5 of the same prompt, so it is a memory of repeated prompts (templates, retries),
    not a nearest-neighbour regression: on the HumanEval prompts, all distinct tasks, neighbours
    ranked new prompts worse than the linear part (leave-one-prompt-out τ 0.03-0.12, docs/bench.md)."""

    keys: np.ndarray  # m × embedding: the sample's distinct prompts, unit length (float32)
    residual: np.ndarray  # m: the sum of each prompt's log residuals left by the ridge, times the blend
    count: np.ndarray  # m: finished requests with that prompt
    bandwidth: float
    prior: float

    @classmethod
    def of(cls, prompt_emb: np.ndarray, residual: np.ndarray, bandwidth: float, prior: float) -> Memory:
        """The memory of the residuals of requests with these prompt embeddings; a prompt asked
        several times is one key (the weights of equal keys are equal, so the shift is unchanged)."""
        keys, owner = np.unique(_unit(prompt_emb), axis=0, return_inverse=True)
        owner = owner.ravel()
        sums = np.bincount(owner, weights=residual, minlength=len(keys))
        return cls(keys, sums, np.bincount(owner, minlength=len(keys)).astype(np.float64), bandwidth, prior)

    def shift(self, prompt_emb: np.ndarray) -> np.ndarray:
        """The log shift of each prompt (rows of ``prompt_emb``).

        The similarities are an einsum, not a matrix product: for a few prompts against 2,000 keys
        the worker's multi-threaded BLAS took 6-8 ms per call on the loaded 2-core machine (its
        threads contend with the worker's), numpy's own loop 0.5 ms."""
        cos = np.einsum("ij,kj->ik", _unit(prompt_emb), self.keys)
        weights = np.exp((cos - 1.0) / self.bandwidth)
        return (weights @ self.residual) / (weights @ self.count + self.prior)


def _unit(emb: np.ndarray) -> np.ndarray:
    emb = np.asarray(emb, dtype=np.float32)
    return emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)


@dataclass(frozen=True, slots=True)
class Correction:
    """A fitted log-residual correction of the head: standardisation, ridge coefficients, and at
    arrival the prompt memory and the blend weight the coefficients and the memory were scaled by."""

    mean: np.ndarray
    std: np.ndarray
    coef: np.ndarray
    bias: float
    samples: int  # finished requests it was fitted on
    memory: Memory | None = None  # the arrival correction's (it reads the inputs' last columns)
    blend: float = 1.0  # weight of the ranking part (coefficients and memory; not the bias)

    def apply(self, head_prediction: np.ndarray, inputs: np.ndarray) -> np.ndarray:
        """Corrected remaining tokens for the head's predictions and their inputs."""
        return np.expm1(np.log1p(np.maximum(head_prediction, 0.0)) + self.shift(inputs))

    def shift(self, inputs: np.ndarray) -> np.ndarray:
        """The log shift of the head's predictions for ``inputs``."""
        out = ((inputs - self.mean) / self.std) @ self.coef + self.bias
        if self.memory is not None:
            out = out + self.memory.shift(inputs[:, -self.memory.keys.shape[1] :])
        return out

    def blended(self, weight: float) -> Correction:
        """The same correction with ``weight`` of its ranking part: 0 keeps the head's order (and this
        correction's bias, the scale), 1 is the whole fit."""
        memory = self.memory
        if memory is not None:
            memory = replace(memory, residual=memory.residual * weight)
        return replace(self, coef=self.coef * weight, memory=memory, blend=self.blend * weight)


@dataclass(frozen=True, slots=True)
class Fitted:
    """What a refit installs: the arrival correction and the later steps' calibration (None: the
    head's later predictions scaled by the arrival correction's bias)."""

    arrival: Correction | None
    later: Correction | None


@dataclass(frozen=True, slots=True)
class SampleTables:
    """The sample column by column, oldest first: what a refit is handed (a few arrays pickle in about
    a millisecond, where 2,000 ``FinishedRequest`` objects take 20 ms of the sending process)."""

    prompt_emb: np.ndarray  # n × embedding
    head: np.ndarray  # n: the head's prediction at arrival
    scalars: np.ndarray  # n × features.N_SCALARS at arrival
    length: np.ndarray  # n: true output tokens
    hit_max_tokens: np.ndarray  # n: the answer stopped at the request's max_tokens
    later: np.ndarray  # m × (2 + scalars): every later prediction (generated, ŷ, scalars)
    later_owner: np.ndarray  # m: the request (row of the n) each later prediction belongs to

    @classmethod
    def of(cls, records: Sequence[FinishedRequest]) -> SampleTables:
        """The tables of ``records`` (in their order)."""
        if not records:
            raise ValueError("no finished requests to fit on")
        later = [r.later for r in records]
        return cls(
            np.stack([r.prompt_emb for r in records]).astype(np.float32),
            np.array([r.head_prediction for r in records], dtype=np.float64),
            np.stack([r.scalars for r in records]).astype(np.float32),
            np.array([r.length for r in records], dtype=np.float64),
            np.array([r.hit_max_tokens for r in records], dtype=bool),
            np.concatenate(later).astype(np.float32),
            np.repeat(np.arange(len(records)), [len(rows) for rows in later]),
        )

    def __len__(self) -> int:
        return len(self.length)

    def rows(self, start: int, stop: int) -> SampleTables:
        """Requests ``start:stop`` with their later predictions."""
        sel = (self.later_owner >= start) & (self.later_owner < stop)
        return SampleTables(
            self.prompt_emb[start:stop],
            self.head[start:stop],
            self.scalars[start:stop],
            self.length[start:stop],
            self.hit_max_tokens[start:stop],
            self.later[sel],
            self.later_owner[sel] - start,
        )


class _Ring:
    """The bounded sample as preallocated columns (recording a request copies one row; the snapshot a
    refit takes is a few array copies, not a walk over Python objects)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.count = 0  # requests recorded so far (the ring holds the last ``capacity``)
        self._cols: tuple[np.ndarray, ...] | None = None
        self._later: list[np.ndarray] = []

    def append(self, rec: FinishedRequest) -> None:
        if self._cols is None:
            self._cols = (
                np.zeros((self.capacity, len(rec.prompt_emb)), np.float32),
                np.zeros(self.capacity, np.float64),
                np.zeros((self.capacity, len(rec.scalars)), np.float32),
                np.zeros(self.capacity, np.float64),
                np.zeros(self.capacity, bool),
            )
            self._later = [np.zeros((0, 2 + len(rec.scalars)), np.float32)] * self.capacity
        emb, head, scalars, length, hit = self._cols
        if len(rec.prompt_emb) != emb.shape[1] or len(rec.scalars) != scalars.shape[1]:
            raise ValueError(
                f"a finished request's inputs ({len(rec.prompt_emb)}, {len(rec.scalars)}) differ in size "
                f"from the sample's ({emb.shape[1]}, {scalars.shape[1]})"
            )
        i = self.count % self.capacity
        emb[i], head[i], scalars[i], length[i] = rec.prompt_emb, rec.head_prediction, rec.scalars, rec.length
        hit[i], self._later[i] = rec.hit_max_tokens, rec.later
        self.count += 1

    def __len__(self) -> int:
        return min(self.count, self.capacity)

    def snapshot(self) -> SampleTables:
        """The held requests' tables, oldest first (copies: later records do not change them)."""
        if self._cols is None:
            raise ValueError("no finished requests to fit on")
        n = len(self)
        order = np.arange(n) if self.count <= self.capacity else np.roll(np.arange(n), -(self.count % n))
        later = [self._later[i] for i in order]
        emb, head, scalars, length, hit = self._cols
        return SampleTables(
            emb[order],
            head[order],
            scalars[order],
            length[order],
            hit[order],
            np.concatenate(later),
            np.repeat(np.arange(n), [len(rows) for rows in later]),
        )


def arrival_table(tables: SampleTables) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(correction inputs, head predictions, true lengths) of the sample's requests at their arrival."""
    if not len(tables):
        raise ValueError("no finished requests to fit on")
    x = correction_inputs(
        tables.head, tables.scalars.astype(np.float64), tables.prompt_emb.astype(np.float64)
    )
    return x, tables.head, tables.length


def later_table(tables: SampleTables) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(calibration inputs, head predictions, true remaining tokens, generated) of the later steps."""
    rows = tables.later.astype(np.float64)
    length = tables.length[tables.later_owner]
    keep = rows[:, 0] < length
    rows, length = rows[keep], length[keep]
    if not len(rows):
        raise ValueError("no later predictions to fit on")
    return later_inputs(rows[:, 1], rows[:, 2:]), rows[:, 1], length - rows[:, 0], rows[:, 0]


def ridge_correction(
    x: np.ndarray, head: np.ndarray, true: np.ndarray, penalty: float | np.ndarray, n: int
) -> Correction:
    """Ridge fit of ``log1p(true) − log1p(head)`` on standardised ``x``, every coefficient (the
    intercept, last, too: with few samples the head's scale stays) shrunk towards 0, the head, by
    ``penalty`` (one for all, or one per column of ``x`` and the intercept)."""
    mean = x.mean(0)
    std = x.std(0)
    std[std < 1e-9] = 1.0  # a constant input (the position at arrival, say) carries nothing
    z1 = np.concatenate([(x - mean) / std, np.ones((len(x), 1))], axis=1)
    gram = z1.T @ z1
    gram[np.diag_indices_from(gram)] += penalty
    sol = np.linalg.solve(gram, z1.T @ (np.log1p(true) - np.log1p(np.maximum(head, 0.0))))
    if not np.all(np.isfinite(sol)):
        raise ValueError("the ridge solution is not finite")
    return Correction(mean, std, sol[:-1], float(sol[-1]), n)


def fit_correction(
    tables: SampleTables,
    scalar_weight: float,
    embedding_weight: float,
    memory_bandwidth: float = 0.0,
    memory_prior: float = 1.0,
) -> Correction:
    """The arrival correction fitted on ``tables``, whole (blend 1): a ridge on the head's log
    prediction, the scalars and the intercept shrunk by ``scalar_weight``, on the embedding's
    coordinates by ``embedding_weight``; then, with ``memory_bandwidth`` > 0, the prompt memory of
    the ridge's residuals.

    CHOICE (two penalties): the embedding's 384 coordinates overfit a few hundred requests, while the
    few scalars (prompt length, the head's own prediction) carry what transfers between prompts.
    Leave-one-prompt-out on the AlpacaEval held-out prompts (each predicted by a correction fitted
    on all the others, 188 rows) gave step-0 τ 0.137 with one penalty of 100 and 0.177 with 1 on the
    scalars and 1,000 on the embedding; on the HumanEval prompts, not tuned on, 0.157 and 0.203 (the
    head alone 0.144; 0.208 with 3,000, 0.196 without the embedding)."""
    x, head, length = arrival_table(tables)
    dim = tables.prompt_emb.shape[1]
    penalty = np.full(x.shape[1] + 1, float(scalar_weight))
    penalty[x.shape[1] - dim : x.shape[1]] = embedding_weight
    ridge = ridge_correction(x, head, length, penalty, len(tables))
    if memory_bandwidth <= 0:
        return ridge
    left = np.log1p(length) - np.log1p(np.maximum(head, 0.0)) - ridge.shift(x)
    return replace(ridge, memory=Memory.of(tables.prompt_emb, left, memory_bandwidth, memory_prior))


def _fit_arrival(tables: SampleTables, settings: OnlineSettings) -> Correction:
    return fit_correction(
        tables,
        settings.arrival_prior_weight,
        settings.embedding_prior_weight,
        settings.memory_bandwidth,
        settings.memory_prior,
    )


def blend_scores(tables: SampleTables, settings: OnlineSettings) -> np.ndarray:
    """Kendall τ at arrival of each blend in ``BLEND_GRID`` (``log head + bias + w · (ridge slopes +
    memory)``) on the sample itself, prequentially: the sample cut into ``blend_folds`` folds in
    arrival order, each fold after the first predicted by a correction fitted on the folds before it
    and scored by its own τ (the requests one correction predicts, as a queue sees them; all tied
    scores 0), the folds weighted by their size."""
    cuts = np.linspace(0, len(tables), settings.blend_folds + 1).astype(int)
    scores = np.zeros(len(BLEND_GRID))
    for lo, hi in itertools.pairwise(cuts[1:]):
        if hi - lo < 2 or lo < 2:
            continue
        fit = _fit_arrival(tables.rows(0, lo), settings)
        x, head, length = arrival_table(tables.rows(lo, hi))
        base, ranking = np.log1p(np.maximum(head, 0.0)), fit.shift(x) - fit.bias
        for i, weight in enumerate(BLEND_GRID):
            tau = _tau(base + weight * ranking, length)
            scores[i] += (hi - lo) * (tau if np.isfinite(tau) else 0.0)
    return scores / max(1, len(tables) - int(cuts[1]))


def blend_weight(tables: SampleTables, settings: OnlineSettings) -> float:
    """How much of the arrival correction's ranking to use: the weight in ``BLEND_GRID`` with the best
    ``blend_scores`` (a tie keeps the smaller weight). Weight 0 is the head's order, so the blend
    ranks the sample's later folds at least as well as the head (CHOICE ``arrival_blend``: "full"
    takes weight 1 unchecked).

    Why: a correction that only had to beat the head on the newest fifth (20-80 requests, too few to
    tell τ apart) replaced it or fell back to it refit by refit, so the predictions' scale jumped
    between refits; here the bias, the scale, is always the sample's and only the order is chosen."""
    if settings.arrival_blend == "full":
        return 1.0
    return float(BLEND_GRID[int(np.argmax(blend_scores(tables, settings)))])  # the first of equals


def fit_later(tables: SampleTables, prior_weight: float, base: float = 0.0) -> Correction:
    """The later steps' calibration fitted on ``tables``, shrunk towards the log shift ``base`` (the
    arrival correction's bias: what the later steps get without a calibration)."""
    x, head, remaining, _ = later_table(tables)
    fit = ridge_correction(x, _shifted(head, base), remaining, prior_weight, len(tables))
    return replace(fit, bias=fit.bias + base)


def _shifted(pred: np.ndarray, shift: float) -> np.ndarray:
    """``pred`` scaled in log1p space by ``shift``."""
    return np.expm1(np.log1p(np.maximum(pred, 0.0)) + shift)


def validated_fit(tables: SampleTables, settings: OnlineSettings) -> Fitted:
    """The arrival correction at its validated blend weight (``blend_weight``; always installed: its
    weight 0 is the head's order at the sample's scale), and the later steps' calibration if, fitted
    on the older requests, it beats the later steps scaled by the arrival bias alone on the newest
    ``holdout_fraction`` in τ pooled over every step (it ranks running requests against queued
    ones); then refitted on the whole sample."""
    weight = blend_weight(tables, settings)
    n_hold = max(1, int(len(tables) * settings.holdout_fraction))
    older, newest = tables.rows(0, len(tables) - n_hold), tables.rows(len(tables) - n_hold, len(tables))
    keep_later = False
    if len(older.later) and len(newest.later):
        arrival = _fit_arrival(older, settings).blended(weight)
        x, head, length = arrival_table(newest)
        lx, lhead, remaining, _ = later_table(newest)
        calibrated = fit_later(older, settings.prior_weight, arrival.bias).apply(lhead, lx)
        first, true = arrival.apply(head, x), np.concatenate([length, remaining])
        keep_later = _tau(np.concatenate([first, calibrated]), true) > _tau(
            np.concatenate([first, _shifted(lhead, arrival.bias)]), true
        )
    arrival = _fit_arrival(tables, settings).blended(weight)
    return Fitted(arrival, fit_later(tables, settings.prior_weight, arrival.bias) if keep_later else None)


@dataclass(frozen=True, slots=True)
class RefitOutcome:
    """What a refit sends back: the fit and its own cost, measured where it ran."""

    fitted: Fitted
    wall_s: float
    cpu_s: float  # CPU time of the process that fitted (a refit process runs nothing else)
    pid: int


def refit_job(tables: SampleTables, settings: OnlineSettings) -> RefitOutcome:
    """``validated_fit`` timed: the function a refit process runs (module level, so it pickles)."""
    t0, c0 = time.perf_counter(), time.process_time()
    fitted = validated_fit(tables, settings)
    return RefitOutcome(fitted, time.perf_counter() - t0, time.process_time() - c0, os.getpid())


class RefitProcess:
    """A process of its own that fits the samples it is sent, at the lowest CPU priority from its start.

    CHOICE: a fresh interpreter running ``tessera.predictor.refit_main`` over a socket, not
    multiprocessing's fork (it would copy the threads of torch and of the worker) nor its spawn (it
    re-imports the worker's main module in the child, and runs it again where that has no
    ``__main__`` guard). The parent puts the child in the idle scheduling class as soon as it exists,
    so even its start (importing numpy and scipy, about a second of CPU) runs only on CPU time the
    worker leaves; its linear algebra uses one thread."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with theirs:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "tessera.predictor.refit_main", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        _lowest_priority(self._proc.pid)
        self._conn = Connection(mine.detach())
        self.last_pickle_s = 0.0  # this process's CPU time serialising the latest sample

    def fit(self, tables: SampleTables, settings: OnlineSettings) -> RefitOutcome:
        """``refit_job`` run in the process; what it raised is raised here, EOFError if it died."""
        t0 = time.perf_counter()
        payload = pickle.dumps((tables, settings), protocol=pickle.HIGHEST_PROTOCOL)
        self.last_pickle_s = time.perf_counter() - t0
        self._conn.send_bytes(payload)  # blocks, without the interpreter lock, until the child reads
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(value)
        return value

    def close(self) -> None:
        """End the process (it exits when its end of the socket closes)."""
        self._conn.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _lowest_priority(pid: int) -> None:
    """Run process ``pid`` (0: this one) only when the CPU is otherwise idle: Linux's SCHED_IDLE
    (weight 3 against nice 0's 1024) and nice 19 for schedulers that ignore the class; elsewhere it
    runs as it is."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, pid, REFIT_NICE)
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))


def serve_refits(conn: Connection) -> None:
    """The refit process's loop: fit each sample sent until the socket closes."""
    _lowest_priority(0)
    while True:
        try:
            job = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            reply: tuple[bool, Any] = (True, refit_job(*job))
        except Exception as exc:  # sent back as text: the worker counts and logs it
            reply = (False, f"{type(exc).__name__}: {exc}")
        conn.send(reply)


def within_step_tau(
    pred: np.ndarray, true: np.ndarray, step: np.ndarray, min_n: int = MIN_STEP_SAMPLES
) -> float:
    """Mean Kendall τ-b over the steps with at least ``min_n`` requests (NaN when none has; a step
    whose predictions or truths are all equal counts as τ 0: it ranks nothing)."""
    taus = []
    for k in np.unique(step):
        sel = step == k
        if sel.sum() < min_n:
            continue
        tau = kendalltau(pred[sel], true[sel]).statistic
        taus.append(0.0 if not np.isfinite(tau) else float(tau))
    return float(np.mean(taus)) if taus else float("nan")


class OnlineLearner:
    """The bounded sample of finished requests and the correction fitted on it (see the module doc)."""

    def __init__(
        self, settings: OnlineSettings | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings or OnlineSettings()
        self.clock = clock
        self._ring = _Ring(self.settings.sample_size)
        self._lock = threading.Lock()  # guards the sample and the refit trigger
        self._idle = threading.Event()  # set: no refit in flight
        self._idle.set()
        self._due = threading.Event()  # set by ``record``: the refit thread has a refit to run
        self._thread: threading.Thread | None = None
        self._process: RefitProcess | None = None
        self.fitted: Fitted | None = None  # None: the head alone
        self.seen = 0  # finished requests recorded so far
        self._since_refit = 0
        self._last_refit = clock()
        self.refits = 0  # refits installed
        self.rejected = 0  # refits that kept the head's order (blend weight 0, no later calibration)
        self.blend_weights: list[float] = []  # each refit's arrival blend weight (``blend_weight``)
        self.failed = 0  # refits that raised (the previous correction kept)
        self.refit_seconds: list[float] = []  # wall time of each refit's fit, where it ran
        self.refit_cpu_seconds: list[float] = []  # CPU time of each refit's fit, where it ran
        self.snapshot_seconds: list[float] = []  # this process's time copying the sample for a refit
        self.pickle_seconds: list[float] = []  # ... and serialising it for the refit process
        self.refit_pids: list[int] = []  # the process each refit ran in

    def sample(self) -> SampleTables:
        """The held finished requests, oldest first (a copy)."""
        with self._lock:
            return self._ring.snapshot()

    def record(self, finished: FinishedRequest) -> None:
        """Add a finished request; start a refit when one is due (never waits for it)."""
        with self._lock:
            self._ring.append(finished)
            self.seen += 1
            self._since_refit += 1
            due = len(self._ring) >= self.settings.min_samples and (
                self._since_refit >= self.settings.refit_every
                or self.clock() - self._last_refit >= self.settings.refit_seconds
            )
            if not due or not self._idle.is_set():
                return
            self._since_refit = 0
            self._last_refit = self.clock()
            self._idle.clear()
            if self.settings.background:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._refit_loop, daemon=True)
                    self._thread.start()
                self._due.set()
                return
        self._run(lambda: refit_job(self.sample(), self.settings))

    def _refit_loop(self) -> None:
        """The refit thread: for each refit due, copy the sample and have the refit process fit it.

        The fit runs in a process of its own (spawned, at nice 19), so its CPU and its Python parts
        never hold this process's interpreter lock; this thread holds it only to copy the sample (a few
        array copies) and to install the result, and otherwise waits."""
        while True:
            self._due.wait()
            self._due.clear()
            self._run(self._refit_in_process)

    def _refit_in_process(self) -> RefitOutcome:
        t0 = time.perf_counter()
        tables = self.sample()
        self.snapshot_seconds.append(time.perf_counter() - t0)
        if self._process is None:
            self._process = RefitProcess()
        try:
            outcome = self._process.fit(tables, self.settings)
            self.pickle_seconds.append(self._process.last_pickle_s)
            return outcome
        except (EOFError, OSError):
            self._process.close()
            self._process = None  # the process died: the next refit starts another
            raise

    def _run(self, refit: Callable[[], RefitOutcome]) -> None:
        """Run one refit and install its fit, or keep the previous one (counted; logged when it raised)."""
        try:
            outcome = refit()
        except Exception as exc:  # a refit must never take the predictor down: keep what predicts now
            self.failed += 1
            log.warning("online refit of the length predictor failed (%s); keeping the previous head", exc)
        else:
            arrival = outcome.fitted.arrival
            if (arrival is None or arrival.blend == 0.0) and outcome.fitted.later is None:
                self.rejected += 1
            else:
                self.refits += 1
            self.blend_weights.append(1.0 if arrival is None else arrival.blend)
            self.fitted = outcome.fitted
            self.refit_seconds.append(outcome.wall_s)
            self.refit_cpu_seconds.append(outcome.cpu_s)
            self.refit_pids.append(outcome.pid)
        finally:
            self._idle.set()

    @property
    def refitting(self) -> bool:
        """A refit is in flight."""
        return not self._idle.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a refit in flight (tests and measurements); False when it is still running."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        """Stop the refit process once no refit is in flight (a later refit starts another)."""
        self._idle.wait()
        process, self._process = self._process, None
        if process is not None:
            process.close()

    def adjust(
        self, head_prediction: np.ndarray, scalars: np.ndarray, prompt_emb: np.ndarray, generated: np.ndarray
    ) -> np.ndarray:
        """The installed corrections applied to the head's predictions: at arrival (``generated`` 0)
        the arrival correction, later the calibration, or without one the arrival correction's bias
        (so that the bias alone never moves a queued request against a running one); the head's own
        where nothing is installed."""
        fitted = self.fitted  # one read: a refit may install another meanwhile
        out = np.asarray(head_prediction, dtype=np.float64).copy()
        if fitted is None or not len(out):
            return out
        new = generated == 0
        if fitted.arrival is not None and new.any():
            out[new] = fitted.arrival.apply(
                out[new], correction_inputs(out[new], scalars[new], prompt_emb[new])
            )
        if (~new).any():
            if fitted.later is not None:
                out[~new] = fitted.later.apply(out[~new], later_inputs(out[~new], scalars[~new]))
            elif fitted.arrival is not None:
                out[~new] = _shifted(out[~new], fitted.arrival.bias)
        return out

    def stats(self) -> dict[str, float | int]:
        """Counters and refit costs, for reports and metrics."""
        return {
            "seen": self.seen,
            "kept": len(self._ring),
            "refits": self.refits,
            "rejected": self.rejected,
            "blend_weight_last": self.blend_weights[-1] if self.blend_weights else float("nan"),
            "blend_weight_mean": float(np.mean(self.blend_weights)) if self.blend_weights else float("nan"),
            "failed": self.failed,
            "refit_wall_s_total": float(sum(self.refit_seconds)),
            "refit_cpu_s_total": float(sum(self.refit_cpu_seconds)),
            "refit_wall_s_max": float(max(self.refit_seconds, default=0.0)),
            "snapshot_s_total": float(sum(self.snapshot_seconds)),
            "pickle_s_total": float(sum(self.pickle_seconds)),
        }


def _tau(pred: np.ndarray, true: np.ndarray) -> float:
    return float(kendalltau(pred, true).statistic) if len(pred) > 1 else float("nan")


_SHARED: dict[tuple[str, OnlineSettings], OnlineLearner] = {}
_SHARED_LOCK = threading.Lock()


def shared_learner(artifact_key: str, settings: OnlineSettings) -> OnlineLearner:
    """The process's learner for one head artifact and settings (kept across configuration reloads)."""
    with _SHARED_LOCK:
        learner = _SHARED.get((artifact_key, settings))
        if learner is None:
            learner = _SHARED[(artifact_key, settings)] = OnlineLearner(settings)
        return learner


__all__ = [
    "Correction",
    "FinishedRequest",
    "Fitted",
    "Memory",
    "OnlineLearner",
    "OnlineSettings",
    "RefitOutcome",
    "RefitProcess",
    "SampleTables",
    "blend_scores",
    "blend_weight",
    "fit_correction",
    "fit_later",
    "refit_job",
    "serve_refits",
    "shared_learner",
    "validated_fit",
    "within_step_tau",
]

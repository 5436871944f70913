"""QLM's request waiting-time (RWT) estimator (QLM §6, Eq. 1-5, 14-22; docs/papers.md).

Inputs and where they come from:

- per instance (engine profile, refreshed online): prefill time ``P``, decode time per
  iteration ``d`` at the batch the group's token mix allows, the KV token capacity
  ``GPU``, the batch limit ``Bmax``, and the inefficiency factor ``eps``: seeded by
  offline hardware profiling and refreshed from observed history as the observed time
  over the modelled time of the work done (Eq. 15's ``B_mean / (Theta_measured * d)`` plus the
  prefills; ``EpsMeter``);
- per group key (workload profile, refreshed online): mean input tokens and the
  mean and variance of output tokens, EWMA over completed requests, seeded offline.

Equations used (docs/papers.md, "QLM: waiting-time estimator"):

- ``B_i = min(Bmax, GPU / (mu_I + mu_O))`` (Eq. 16) and the decode iteration time ``d`` at that batch;
- a request's instance time ``T(I) = eps (service(I, mu_O, B) + c2 sigma_O^2 / 2)`` (prefill-aware
  throughput, below), and ``Theta_{g,i} = mu_O / T(mu_I)``, which is Eq. 15's ``B / (d eps)`` when the
  prefill costs nothing (up to the first token, which the prefill gives);
- group drain ``W = sum_j T(I_j) + z sigma_O sqrt(n) eps d / B`` over its ``n`` waiting members (Eq. 2, 3
  with a quantile: the spread comes from the unknown output lengths, each token at the paper's
  ``eps d / B``);
- wait of the group's last member ``W_last``: the same sum over the members ahead of it;
- group completion ``C = W_last + P + O_max eps d`` (Eq. 1, 4, 5), ``O_max = min(max_tokens, ctx - mu_I)``,
  ``P`` the prefill of the last member's prompt.

Paper correction: Eq. 15 prints ``Theta = B / (delta * eps)`` where delta is the
decode time per token (the symbol clashes with the group multiplier); we write ``d``.

Paper gap, and CHOICE (prefill-aware throughput): the paper's W counts output tokens over a decode
throughput, ``B / (d eps)``, and charges ``P`` only to the request itself (Eq. 1), so the prefills of
the requests ahead, which stall the whole batch while they run (prefill-only iterations), enter only
through eps. That is small for chat prompts of a few hundred tokens and dominates for long prompts:
in Azure's code trace (2k-token prompts, 27-token answers) a request's prefill is about 95% of its
instance time, in Mooncake's (15k-token prompts, 150-token answers) about 85%. Eps then has to carry a
cost that grows with the prompts, not with the output tokens it multiplies: profiled on those traces
it came out at 22-36, moved with the prompt mix of the moment (Mooncake: 22 to 40 within one run), and
the estimates were 1.2-4.4x the real waits. So a request's share of the instance is its prefill plus
its share of each decode iteration, ``StepProfile.service_time`` (the simulator's own accounting), and
eps is measured against that same model (``EpsMeter``). ``C`` keeps the paper's ``O_max eps d``: a
group's last member decodes after the group has drained, behind a model swap with no prefills between
its iterations.

CHOICE (completion deadlines): a group's slack is its earliest member deadline, which for a batch
class (``ServiceClass.slo_at_completion``) is a completion deadline, so the violation check and the
MILP add to ``W_last + P`` (enough for a first-token SLO) the last member's decode: ``O_max``
iterations of a saturated batch, ``B / Theta`` each (``EngineRates.iteration_time``), where ``C``
charges ``eps d``. Both parts are chosen for a bound, not an expectation, and both were needed on
Azure's code trace (600 s deadlines, answers of a few dozen tokens on average, some of hundreds):

- the token cap ``O_max``, not the key's mean or a quantile of its output: a deadline binds each
  member and the cap is the only bound on a member's own answer the scheduler knows. The members
  that missed had 302-792 tokens, far in the key's tail; the mean plus 2.33 sigma (at ``B / Theta``)
  left 8 of the 12 misses over seeds 0-4.
- ``B / Theta``, not ``eps d``: the group behind the last member is usually of the same model, so
  while it decodes its batch keeps taking in new members, whose prefills stall every iteration
  (``C``'s ``eps d`` holds before a model swap, where the instance takes in nothing). Those members
  decoded at 0.16-0.43 s a token; ``eps d`` charged at most 0.027, and their groups' checks passed.

The price is a conservative check: a group is charged its largest cap for its last member, so on the
code trace the multi part of ``tessera bench qlm`` predicts violations more often and more of its
solves find no order that meets every SLO (then ``SolverSettings.fallback`` orders the queue). When
the fallback was EDF, which interleaves models, this cost a third of the throughput (16-19 swaps
instead of 4-6, 2.9-3.0 instead of 4.1-4.5 req/s); with the fallback's block per model and new groups
placed after their model's (``QLMPolicy``'s ``new_group``) the part serves 6.99 req/s, 2.8% under
batched swapping, with every deadline met. A client that leaves ``max_tokens`` at the context length
makes its batch group look late early.

CHOICE (measured batch, ``QLMPolicy``'s ``batch_estimate``: "measured", the default, or "eq16"):
once a saturated window has been measured, ``B`` is the running batch the engine held in it (EWMA,
``EngineRates.measured_batch``), not Eq. 16's ``GPU / (mu_I + mu_O)``. Eq. 16 charges each request
a mean prompt plus a whole mean answer of KV; the engine admits while the KV in use fits, which is
prompts plus the tokens generated so far, and a heavy-tailed prompt mix fits many short requests
beside a few long ones. On the Mooncake trace Eq. 16 gave 18.5 where the engine ran 50-64, eps (which
cannot fall below 1) could not absorb it, and the estimates were 1.12x the real waits: ``tessera bench
qlm --trace .../mooncake_fast25_synthetic_trace.jsonl.gz --set requests=3993 --set part=estimator``
R² 0.924 -> 0.959 (code 0.997 -> 0.997, conv 0.985 -> 0.982, LMSYS 0.997 -> 0.994, defaults 0.995
-> 0.993). Group sizes (``n_max``) keep Eq. 16's batch (``kv_batch``): with the measured one the
groups grew and the code trace's single part lost 1.8 points of attainment.

CHOICE (known prompts): a waiting request's prompt length is known from its arrival, so the drain
sums the members' own ``T(I_j)``; ``mu_I`` is used only where the requests are not at hand (the
router's estimate, ``B_i`` and ``O_max``). The prompts of a heavy-tailed trace vary by a factor
of 100 between neighbours (Mooncake: median 11.6k tokens, a quarter under 300), which a mean cannot
follow.

``d`` is the profile's step time at the batch's *time-averaged* context. A request
with ``O`` output tokens sits in the batch for ``O`` iterations, so the batch holds
long requests more often than their share of arrivals (length-biased sampling): the
mean number of tokens a running request has generated is the renewal mean age
``E[O^2] / (2 mu_O) = (mu_O^2 + sigma_O^2) / (2 mu_O)``, not ``mu_O / 2``. With
ShareGPT's spread (CV ~ 0.9) that is ~0.9 mu_O. ``eps`` is measured against the real
step time, so ``d`` must model the same context or Theta is off by their ratio. ``T`` has the
same term per request: ``service`` at ``mu_O`` counts ``mu_O^2 / 2`` context tokens over its
decode steps, where the mean over output lengths is ``E[O^2] / 2``, ``sigma_O^2 / 2`` more.

All functions are pure: time comes in as an argument.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from tessera.core.profile import StepProfile


@dataclass(slots=True)
class TokenStats:
    """Token distribution of one group key: EWMA of mean and variance, seeded by offline profiling."""

    mu_in: float
    mu_out: float
    var_out: float
    # EWMA weight of one completion. CHOICE: the EWMA mean's relative standard error is
    # CV * sqrt(alpha / (2 - alpha)); output lengths have CV ~ 0.9 (ShareGPT), and an error in
    # mu_O scales every waiting-time estimate, so alpha = 0.005 keeps it near 4% (0.05 gave 14%).
    alpha: float = 0.005

    def __post_init__(self) -> None:
        if self.mu_in < 0 or self.mu_out <= 0 or self.var_out < 0:
            raise ValueError(
                f"token stats need mu_in >= 0, mu_out > 0, var_out >= 0 (got {self.mu_in}, "
                f"{self.mu_out}, {self.var_out})"
            )
        if not 0 < self.alpha <= 1:
            raise ValueError(f"EWMA alpha must be in (0, 1], got {self.alpha}")

    @property
    def sigma_out(self) -> float:
        """Standard deviation of output tokens."""
        return math.sqrt(self.var_out)

    def observe_input(self, tokens: int) -> None:
        """An arrival's prompt length (known at arrival)."""
        self.mu_in += self.alpha * (tokens - self.mu_in)

    def observe_output(self, tokens: int) -> None:
        """A completed request's output length (EWMA of mean and variance, West's update)."""
        diff = tokens - self.mu_out
        incr = self.alpha * diff
        self.mu_out += incr
        self.var_out = (1 - self.alpha) * (self.var_out + diff * incr)


@dataclass(frozen=True, slots=True)
class GroupCosts:
    """Estimated times of one group on one instance (seconds)."""

    drain: float  # W_{g,i}: time the whole group adds for later groups
    last_wait: float  # W^last_{g,i}: intra-group wait of its last member
    completion: float  # C_{g,i}: W^last + P + O_max eps d
    prefill: float  # P_g
    # Decode its SLO counts after the last member's first token: 0 for a first-token SLO, O_max
    # saturated iterations for a completion deadline (module docstring: completion deadlines).
    slo_decode: float = 0.0

    @property
    def slo_span(self) -> float:
        """Time from the group's start to the moment its SLO measures for its last member (its first
        token, or its completion): what the violation check and the MILP compare with the slack."""
        return self.last_wait + self.prefill + self.slo_decode

    @property
    def beyond_drain(self) -> float:
        """C - W: how long the group's last member runs after the group has drained, which a model
        swap behind it waits for. Never negative: W counts the key's mean answer per member and C
        the group's own token cap, so a group asking for fewer tokens than its key's answers run
        (max_tokens 4 where they average 800) is estimated to drain after its last member ends;
        a negative C - W also broke the MILP's warm start (PuLP refuses a start value below the
        variable's lower bound 0)."""
        return max(0.0, self.completion - self.drain)


@dataclass(slots=True)
class EngineRates:
    """Hardware parameters of one instance for the estimator (QLM's hardware profiling)."""

    profile: StepProfile
    max_batch: int
    eps: float = 1.0
    # The running batch measured while the engine was saturated (EWMA over EpsMeter's windows), or
    # None: ``batch_for`` then uses Eq. 16 (module docstring: measured batch).
    measured_batch: float | None = None

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.eps < 1:
            raise ValueError(f"eps is an inefficiency factor >= 1, got {self.eps}")

    def batch_for(self, stats: TokenStats) -> float:
        """Running batch of the estimates: the measured one when known, else Eq. 16 (``kv_batch``)."""
        if self.measured_batch is not None:
            return max(1.0, min(self.max_batch, self.measured_batch))
        return self.kv_batch(stats)

    def kv_batch(self, stats: TokenStats) -> float:
        """Running batch the KV cache allows for this token mix (Eq. 16), capped by Bmax."""
        return max(1.0, min(self.max_batch, self.profile.kv_capacity_tokens / (stats.mu_in + stats.mu_out)))

    def decode_time(self, stats: TokenStats) -> float:
        """d: decode iteration time at that batch, each running request at the time-averaged
        context ``mu_I + E[O^2] / (2 mu_O)`` (length-biased; module docstring)."""
        batch = self.batch_for(stats)
        context = stats.mu_in + (stats.mu_out**2 + stats.var_out) / (2 * stats.mu_out)
        return self.profile.decode_step(round(batch), round(batch * context))

    def prefill_time(self, stats: TokenStats, prompt_tokens: int | None = None) -> float:
        """P: prefill time of a prompt (default: a mean one)."""
        return self.profile.prefill(round(stats.mu_in) if prompt_tokens is None else prompt_tokens)

    def token_time(self, stats: TokenStats) -> float:
        """Instance time one more output token costs in the batch: ``eps d / B`` (Eq. 15's 1 / Theta)."""
        return self.eps * self.decode_time(stats) / self.batch_for(stats)

    def request_time(self, stats: TokenStats, prompt_tokens: int | None = None) -> float:
        """T: expected instance time of one request of this key with that prompt (default: a mean
        one), its prefill and its share of ``mu_O`` decode iterations at ``batch_for``'s batch, times
        eps (module docstring: prefill-aware throughput, length-biased context)."""
        prompt = round(stats.mu_in) if prompt_tokens is None else prompt_tokens
        service = self.profile.service_time(prompt, stats.mu_out, round(self.batch_for(stats)))
        return self.eps * (service + self.profile.decode_c2 * stats.var_out / 2)

    def iteration_time(self, stats: TokenStats) -> float:
        """Time of one iteration of a batch that stays full, prefills of the requests it takes in
        included: ``B / Theta``, each of ``B`` running requests getting its share of Theta."""
        return self.batch_for(stats) / self.theta(stats)

    def theta(self, stats: TokenStats) -> float:
        """Token throughput for this token mix, prefills included: ``mu_O / T(mu_I)`` (Eq. 15 when
        the prefill costs nothing; module docstring)."""
        return stats.mu_out / self.request_time(stats)


def drain_time(n: int, prompt_tokens: int, stats: TokenStats, rates: EngineRates, z: float) -> float:
    """Instance time of ``n`` waiting requests of one key holding ``prompt_tokens`` prompt tokens in
    all, their outputs at the z-quantile of their normal sum (Eq. 2, 3, 19): ``sum T(I_j) + z sigma_O
    sqrt(n) eps d / B``. T is affine in the prompt length, so the sum is ``n T(mean prompt)``."""
    if n <= 0:
        return 0.0
    spread = z * stats.sigma_out * math.sqrt(n) * rates.token_time(stats)
    return n * rates.request_time(stats, round(prompt_tokens / n)) + spread


def group_costs(
    prompts: Sequence[int],
    stats: TokenStats,
    rates: EngineRates,
    z: float,
    max_tokens: int,
    context_len: int,
    *,
    to_completion: bool = False,
) -> GroupCosts:
    """W, W_last, C and P of a group whose waiting members have these prompts (FCFS order) on one
    instance; ``to_completion``: its SLO is a completion deadline (``GroupCosts.slo_span``)."""
    d = rates.decode_time(stats)
    n, total = len(prompts), sum(prompts)
    prefill = rates.prefill_time(stats, prompts[-1] if prompts else None)
    o_max = max(0.0, min(max_tokens, context_len - stats.mu_in))
    last_wait = drain_time(n - 1, total - prompts[-1], stats, rates, z) if prompts else 0.0
    return GroupCosts(
        drain=drain_time(n, total, stats, rates, z),
        last_wait=last_wait,
        completion=last_wait + prefill + o_max * rates.eps * d,
        prefill=prefill,
        slo_decode=o_max * rates.iteration_time(stats) if to_completion else 0.0,
    )


@dataclass(frozen=True, slots=True)
class QueuedGroup:
    """A group as the violation walk sees it."""

    model: str
    costs: GroupCosts
    slack: float  # earliest deadline among its waiting members minus now


def start_times(
    groups: Sequence[QueuedGroup],
    loaded_model: str | None,
    residual: float,
    swap_s: float,
    *,
    adapter_of: Mapping[str, str] | None = None,
    adapter_load_s: float = 0.0,
    held_adapters: Collection[str] = (),
) -> list[float]:
    """Estimated start of every group in VQ order (the violation check's walk; Eq. 10 for one VQ).

    Same-model groups ahead add their drain W; a model change adds the swap time S
    plus the completion of the previous group beyond its drain (C - W), because the
    instance drains before it swaps. A change between two models of one engine (``adapter_of``: each
    LoRA adapter's base; an adapter of the base, or the base after one) is no swap: the batch mixes
    them, nothing drains, and a change to an adapter adds its load ``adapter_load_s`` unless it is in
    ``held_adapters`` (those of the running batch; CHOICE: any other is charged as if the engine did
    not hold it).
    """
    of = adapter_of or {}
    t_acc = residual
    prev: QueuedGroup | None = None
    prev_model = loaded_model
    starts = []
    for group in groups:
        if prev_model is not None and group.model != prev_model:
            if of.get(group.model, group.model) == of.get(prev_model, prev_model):
                t_acc += adapter_load_s if group.model in of and group.model not in held_adapters else 0.0
            else:
                t_acc += swap_s + (prev.costs.beyond_drain if prev is not None else 0.0)
        starts.append(t_acc)
        t_acc += group.costs.drain
        prev, prev_model = group, group.model
    return starts


def first_violation(
    groups: Sequence[QueuedGroup],
    loaded_model: str | None,
    residual: float,
    swap_s: float,
    tail_aware: bool,
    *,
    adapter_of: Mapping[str, str] | None = None,
    adapter_load_s: float = 0.0,
    held_adapters: Collection[str] = (),
) -> int | None:
    """Index of the first group predicted to miss its SLO, or None (the violation check).

    ``tail_aware``: compare the start plus the group's own span to its SLO point
    (``GroupCosts.slo_span``: its last member's first token, or its completion) with the slack (our
    default); otherwise only the start (paper-literal). ``adapter_of``, ``adapter_load_s``,
    ``held_adapters``: as ``start_times``.
    """
    starts = start_times(
        groups,
        loaded_model,
        residual,
        swap_s,
        adapter_of=adapter_of,
        adapter_load_s=adapter_load_s,
        held_adapters=held_adapters,
    )
    for idx, (group, start) in enumerate(zip(groups, starts, strict=True)):
        if start + (group.costs.slo_span if tail_aware else 0.0) > group.slack:
            return idx
    return None


def request_wait(ahead: Sequence[tuple[float, TokenStats, EngineRates]], z: float) -> float:
    """Request-level estimate where the requests ahead are counted, not at hand (mean prompts):
    ``sum n T(mu_I) + z sqrt(sum n sigma_O^2 (eps d / B)^2)``. ``ahead`` holds ``(count, stats,
    rates)`` per group of requests ahead."""
    mean = sum(n * rates.request_time(s) for n, s, rates in ahead)
    var = sum(n * s.var_out * rates.token_time(s) ** 2 for n, s, rates in ahead)
    return mean + z * math.sqrt(var)


class EpsMeter:
    """Online measurement of the inefficiency factor: the observed time over the modelled time of the
    work done in it, ``eps = time / (tokens d_mean / B_mean + sum P)``. Without prefills that is Eq.
    15's ``B_mean / (Theta_meas * d_mean)``; the prefills of the requests that entered the batch are
    modelled as ``T`` models them (module docstring: prefill-aware throughput), so eps stays the
    inefficiency beyond that model instead of absorbing the prefill time. A sample may fall below 1
    where the engine prefills several prompts in one iteration (one fixed cost ``p0`` for all, where
    ``T`` charges each prompt its own); eps stays >= 1, the paper's bound.

    Only saturated intervals count (waiting work exists), because an idle instance's
    low throughput says nothing about batching inefficiency. A window closes after
    ``window_s`` of saturated time and updates ``eps`` by EWMA.
    """

    def __init__(self, window_s: float = 20.0, alpha: float = 0.3) -> None:
        if window_s <= 0 or not 0 < alpha <= 1:
            raise ValueError("EpsMeter needs window_s > 0 and alpha in (0, 1]")
        self.window_s = window_s
        self.alpha = alpha
        self._last_t: float | None = None
        self._last_state: tuple[int, float, bool] = (0, 0.0, False)
        self._time = self._batch_time = self._d_time = 0.0
        self._tokens = self._prefill_s = 0.0
        self.batch: float | None = None  # mean running batch of the latest window with a sample

    def observe(
        self,
        now: float,
        tokens_since_last: float,
        prefill_s_since_last: float,
        batch: int,
        decode_step_s: float,
        saturated: bool,
    ) -> float | None:
        """Account the interval since the last call (with the state seen then): the tokens generated
        and the modelled prefill time of the requests that entered the batch in it. Returns a new eps
        sample when a window completes, else None."""
        sample = None
        if self._last_t is not None and now > self._last_t:
            prev_batch, prev_d, prev_sat = self._last_state
            dt = now - self._last_t
            if prev_sat and prev_batch > 0:
                self._time += dt
                self._batch_time += prev_batch * dt
                self._d_time += prev_d * dt
                self._tokens += tokens_since_last
                self._prefill_s += prefill_s_since_last
                if self._time >= self.window_s:
                    sample = self.flush()
        self._last_t = now
        self._last_state = (batch, decode_step_s, saturated)
        return sample

    def flush(self) -> float | None:
        """Close the current window early: its eps sample (None if it saw no saturated output).
        Offline profiling (QLM §6) reads one sample over a whole profiling run this way."""
        if self._time <= 0 or self._tokens <= 0:
            return None
        modelled = self._tokens * self._d_time / self._batch_time + self._prefill_s
        sample = self._time / modelled
        self.batch = self._batch_time / self._time
        self._time = self._batch_time = self._d_time = self._tokens = self._prefill_s = 0.0
        return max(1.0, sample)

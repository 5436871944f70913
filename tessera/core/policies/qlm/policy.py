"""``QLMPolicy``: QLM's per-instance agent over its virtual queue (QLM §3-§7; docs/papers.md, "QLM").

At every decision point the agent

1. syncs its groups with the engine's running set and refreshes the estimator
   online (eps from observed throughput, token statistics from completions);
2. after arrivals, runs the RWT violation check on its VQ and, when a violation is
   predicted, asks the global scheduler (MILP, then a fallback order) for a new order
   (debounced: at most one solve per ``min_resolve_interval_s``);
3. actuates the LSOs: **model swap** when the head group needs another model (drain
   first, or evict and swap at once when a reorder put that group at the head),
   **eviction** of running requests of groups behind the head so the head group runs
   now, and **pulling** from the head group FCFS, then the following groups of the
   loaded model, while batch slots last (the engine admits while KV fits). With ``late_last``
   (CHOICE, on by default) the requests already past their SLO deadline are pulled after the on-time
   ones due within ``late_set_back_s`` (CHOICE, 30 s) and ahead of the rest, and the head group evicts
   only for its on-time ones: under overload a late request has missed, and serving it first made the
   next ones miss too. The bound keeps a chat request late by a moment ahead of batch work with
   ample slack: unbounded, it waited behind every on-time batch request (``make demo``: chat TTFT p99
   22.1 s, against 2.9 s without the set-back). Figures: docs/bench.md, QLM's single-model part.

Class priority (``ServiceClass.priority``, higher first) acts only where the global scheduler's
order ties (``milp``: equal slack in the EDF fallback, which decides who misses when no order meets
every SLO; equal drains in its heuristic); eviction and pulling follow the VQ order it produced.

A new group joins its VQ right after the last waiting group of its model (CHOICE ``new_group``,
"after-model"; QLM appends at the tail and leaves the order to the global scheduler, which runs only on
a predicted violation): appended at the tail, groups of models that keep arriving interleave, and each
change of model is a swap. On ``tessera bench qlm``'s multi part (three models, two instances, code
and conversation trace lengths) the tail made 6-10 swaps per instance against batched swapping's 3-4;
after-model brought throughput from 6.48 to 6.99 and 7.03 to 7.77 req/s. The violation check still
reorders when the insertion would make a group late.

Load balancing is the router's: the live router's ``least-wait`` route sends each request to the
instance of least estimated wait, counting every model's requests there and a model swap where the
instance has none of this model's (``tessera.core.routing.swap_penalty``); the simulator routes
through the same route.
Assumes one GPU-resident model per instance (a swap flushes the KV cache), as the paper. LoRA adapters
of that model (``InstanceView.adapter_of``) run in its engine: the waiting-time estimate charges a
change to another adapter's group its load (``adapter_load_s``), not a swap, the MILP orders their
groups as the base's, and a decision pulls from consecutive groups of one engine while the batch has a
LoRA slot for their adapter (``InstanceView.max_loras``), as vLLM mixes adapters in one batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Annotated, ClassVar, Literal

from pydantic import Field

from tessera.core.lora import ADAPTER_LOAD_S, admits, batch_adapters
from tessera.core.policies.qlm.estimator import (
    EngineRates,
    EpsMeter,
    GroupCosts,
    QueuedGroup,
    TokenStats,
    drain_time,
    first_violation,
    group_costs,
    start_times,
)
from tessera.core.policies.qlm.groups import Grouper, GroupKey, RequestGroup, VirtualQueue, group_key
from tessera.core.policies.qlm.lso import ModelTiers, SwapGate, TierCosts, eviction_victims
from tessera.core.policies.qlm.milp import GroupSpec, Plan, QueueSpec, SolverSettings, solve
from tessera.core.policy import Decision, InstanceView, Policy
from tessera.core.registry import PolicySettings
from tessera.core.request import Phase, Request

TokenSeeds = Mapping[
    tuple[str, str], tuple[float, float, float]
]  # (model, class) -> (mu_in, mu_out, sigma_out)


class QLMSettings(PolicySettings):
    """Settings of ``qlm``. Turning reordering or eviction off, the MILP's slot factor, the token
    statistics' smoothing and seeded token statistics are research ablations: constructor keywords the
    qlm bench sets."""

    delta_rg: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=4.0, description="Request group size as a multiple of the average batch size (δ_rg)."
    )
    z: Annotated[float, Field(ge=0, allow_inf_nan=False)] = Field(
        default=2.33,
        description="Quantile multiplier of the waiting-time estimate (2.33: the 99th percentile).",
    )
    tail_aware: bool = Field(
        default=True, description="Compare a group's last request, not only its start, with the SLO."
    )
    evict_mode: Literal["swap", "recompute"] = Field(
        default="swap", description="How requests behind the head group are evicted."
    )
    late_last: bool = Field(
        default=True,
        description="Pull the waiting requests still within their SLO (VQ order) before those already past "
        "it, and evict only for the head group's on-time ones: a late request has missed, and serving it "
        "first makes the next ones miss too. Without late_set_back_s the set-back is unbounded: a late "
        "interactive request waits behind every on-time batch one.",
    )
    late_set_back_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = Field(
        default=30.0,
        description="With late_last, a late request waits only behind the on-time requests due within this "
        "many seconds, and goes ahead of those with more slack (unset: behind every on-time request).",
    )
    evict_streams: bool = Field(
        default=False,
        description="Evict interactive requests that have sent tokens too. Off: their TTFT is decided "
        "and an eviction would only stall their stream and spend the copy on an overloaded instance.",
    )
    solver_time_limit_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=5.0, description="Time limit of one MILP solve in seconds (then the fallback)."
    )
    new_group: Literal["tail", "after-model"] = Field(
        default="after-model",
        description="Where a new request group joins its VQ: tail, or after-model (right after the last "
        "waiting group of its model, saving a model swap; the violation check still reorders).",
    )
    batch_estimate: Literal["measured", "eq16"] = Field(
        default="measured",
        description="Running batch of the waiting-time estimates: measured (the engine's saturated batch, "
        "once seen) or eq16 (QLM's KV capacity over the mean prompt plus answer).",
    )
    fallback: Literal["edf", "fewest-late"] = Field(
        default="fewest-late",
        description="Order when no plan meets every SLO: edf (QLM's), or fewest-late (the heuristic plan, "
        "a block per model, when it leaves fewer groups late than EDF).",
    )
    mip_gap: Annotated[float, Field(ge=0, lt=1)] = Field(
        default=0.01, description="Relative MILP gap accepted."
    )
    min_resolve_interval_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = Field(
        default=1.0, description="Fewest seconds between two solves."
    )
    context_len: Annotated[int, Field(ge=1)] = Field(
        default=4096, description="Context length of the model in tokens."
    )
    engine_reinit_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = Field(
        default=20.0, description="Seconds an engine takes to restart on a model swap."
    )
    adapter_load_s: Annotated[float, Field(ge=0, le=60, allow_inf_nan=False)] = Field(
        default=ADAPTER_LOAD_S,
        description="Seconds loading a LoRA adapter takes: what the waiting-time estimate charges a change "
        "to another adapter of the engine's base, instead of a model swap.",
    )
    disk_to_cpu_bytes_per_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=2e9, description="Disk to host memory bandwidth for model weights, bytes/s."
    )
    cpu_model_bytes: Annotated[float, Field(ge=0, allow_inf_nan=False)] = Field(
        default=40e9, description="Host memory that keeps swapped-out model weights warm, bytes."
    )
    warm_start: bool = Field(default=True, description="Keep swapped-out models in host memory.")
    model_weights_bytes: dict[str, Annotated[float, Field(gt=0, allow_inf_nan=False)]] = Field(
        default_factory=dict, description="Weight size in bytes by model name; unset means from the profile."
    )
    eps: Annotated[float, Field(ge=1, allow_inf_nan=False)] = Field(
        default=1.0,
        description="Offline-profiled inefficiency factor of the engine (>= 1), refreshed online.",
    )
    eps_window_s: Annotated[float, Field(gt=0)] = Field(
        default=20.0,
        description="Window in seconds of the online inefficiency estimate (inf: never refreshed).",
    )
    default_batch: Annotated[int, Field(ge=1)] = Field(
        default=256, description="Batch size assumed before the engine reports one."
    )


class QLMPolicy(Policy):
    """QLM on one instance: request groups in a virtual queue, RWT estimator, MILP reordering, LSOs."""

    name: ClassVar[str] = "qlm"

    def __init__(
        self,
        *,
        delta_rg: float = 4.0,
        z: float = 2.33,
        tail_aware: bool = True,
        reorder: bool = True,
        eviction: bool = True,
        evict_mode: Literal["swap", "recompute"] = "swap",
        late_last: bool = True,
        late_set_back_s: float | None = 30.0,
        evict_streams: bool = False,
        solver_time_limit_s: float = 5.0,
        mip_gap: float = 0.01,
        slots_factor: float = 1.25,
        fallback: Literal["edf", "fewest-late"] = "fewest-late",
        new_group: Literal["tail", "after-model"] = "after-model",
        batch_estimate: Literal["measured", "eq16"] = "measured",
        min_resolve_interval_s: float = 1.0,
        context_len: int = 4096,
        stats_alpha: float = 0.005,
        token_seeds: TokenSeeds | None = None,
        engine_reinit_s: float = 20.0,
        adapter_load_s: float = ADAPTER_LOAD_S,
        disk_to_cpu_bytes_per_s: float = 2e9,
        cpu_model_bytes: float = 40e9,
        warm_start: bool = True,
        model_weights_bytes: Mapping[str, float] | None = None,
        eps_window_s: float = 20.0,
        eps: float = 1.0,
        default_batch: int = 256,
    ) -> None:
        if delta_rg <= 0:
            raise ValueError(f"delta_rg must be > 0, got {delta_rg}")
        if z < 0:
            raise ValueError(f"z (quantile multiplier) must be >= 0, got {z}")
        if evict_mode not in ("swap", "recompute"):
            raise ValueError(f"evict_mode must be 'swap' or 'recompute', got {evict_mode!r}")
        if eps < 1:
            raise ValueError(f"eps (offline-profiled inefficiency factor) must be >= 1, got {eps}")
        if min_resolve_interval_s < 0 or context_len < 1 or default_batch < 1:
            raise ValueError("min_resolve_interval_s >= 0, context_len >= 1 and default_batch >= 1 required")
        if not 0 <= adapter_load_s <= 60:
            raise ValueError(f"adapter_load_s must be 0 to 60 seconds, got {adapter_load_s}")
        self.adapter_load_s = adapter_load_s
        self.delta_rg = delta_rg
        self.z = z
        self.reorder = reorder
        self.eviction = eviction
        self.evict_mode = evict_mode
        if late_set_back_s is not None and not late_set_back_s >= 0:
            raise ValueError(f"late_set_back_s must be >= 0 seconds or None, got {late_set_back_s}")
        self.late_last = late_last
        self.late_set_back_s = math.inf if late_set_back_s is None else late_set_back_s
        self.evict_streams = evict_streams
        self.solver = SolverSettings(
            solver_time_limit_s, mip_gap, slots_factor, tail_aware, fallback=fallback
        )
        if new_group not in ("tail", "after-model"):
            raise ValueError(f"new_group must be 'tail' or 'after-model', got {new_group!r}")
        self.new_group = new_group
        if batch_estimate not in ("measured", "eq16"):
            raise ValueError(f"batch_estimate must be 'measured' or 'eq16', got {batch_estimate!r}")
        self.batch_estimate = batch_estimate
        self.min_resolve_interval_s = min_resolve_interval_s
        self.context_len = context_len
        self.stats_alpha = stats_alpha
        self.token_seeds = dict(token_seeds or {})
        self.tiers = ModelTiers(
            TierCosts(engine_reinit_s, disk_to_cpu_bytes_per_s, cpu_model_bytes, warm_start)
        )
        self.model_weights_bytes = dict(model_weights_bytes or {})
        self.default_batch = default_batch

        self.grouper = Grouper(self._size_limit)
        self.vq = VirtualQueue("")
        self.stats: dict[GroupKey, TokenStats] = {}
        self._ttft_slo: dict[GroupKey, float] = {}  # interactive keys: their TTFT SLO (group size cap)
        self.eps_seed = eps  # offline hardware profiling (QLM §6); 1.0 without it, refreshed online
        self.rates: EngineRates | None = None
        self.eps_meter = EpsMeter(eps_window_s)
        self._running: dict[int, Request] = {}
        self._gen_seen: dict[int, int] = {}
        self._tokens_since = 0.0
        self._check_due = False
        self._last_solve = -math.inf
        self._reordered_head: RequestGroup | None = None  # head placed by the scheduler: evict, swap now
        # A plan solved off the decision's thread (``prepare``), with its groups by id; the next
        # ``schedule`` installs it.
        self._solved: tuple[Plan, dict[int, RequestGroup]] | None = None
        self._solving = False
        self.gate = SwapGate(self.tiers)
        self._active_model: str | None = None
        self._adapter_of: Mapping[str, str] = {}  # the engine's LoRA adapters -> their base (the view's)
        self._held_adapters: frozenset[str] = frozenset()  # adapters of the running batch
        self.counters: dict[str, float] = {"solves": 0, "fallbacks": 0, "evicted": 0, "model_swaps": 0}
        self.solve_times: list[float] = []

    # ---- Policy protocol ----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.grouper.of)

    def add(self, req: Request, now: float) -> None:
        """Classify the arrival into a group (a new group joins the VQ where ``new_group`` says) and
        schedule a check."""
        stats = self._stats_for(req)
        if req.service_class.kind == "interactive" and req.service_class.ttft_slo_s is not None:
            self._ttft_slo[group_key(req)] = req.service_class.ttft_slo_s
        stats.observe_input(req.prompt_tokens)
        group, created = self.grouper.add(req)
        if created:
            if self.new_group == "after-model":
                self.vq.insert_after_model(group)
            else:
                self.vq.append(group)
        self._check_due = True

    def remove(self, req: Request, now: float) -> None:
        """A request finished or was cancelled: update statistics and dequeue finished groups."""
        group = self.grouper.forget(req)
        if group is None:
            return
        self._tokens_since += req.generated - self._gen_seen.pop(id(req), req.generated)
        self._running.pop(id(req), None)
        if req.phase is Phase.FINISHED and req.generated > 0:
            self.stats[group.key].observe_output(req.generated)
        if group.done:
            self.vq.drop_done()

    def schedule(self, view: InstanceView) -> Decision:
        """Sync, maybe reorder, then swap / evict / pull (module docstring)."""
        now = view.now
        self._observe(view)
        closed = self.gate.closed_until(view.active_model, now)
        if closed is not None:
            return Decision(run=[], recheck_at=closed)
        recheck_at = None
        solved, self._solved = self._solved, None
        if solved is not None:
            self._install(*solved)
        if self.reorder and self._check_due and not self._solving:
            recheck_at = self._maybe_reorder(view)
        head = self.vq.head_group()
        position = {id(g): pos for pos, g in enumerate(self.vq.groups)}
        running = sorted(view.running, key=lambda r: position[id(self.grouper.of[id(r)])])
        if head is None:
            return Decision(run=running, recheck_at=recheck_at)
        if view.active_model is not None and view.engine_of(head.model) != view.active_model:
            if running and not (self.eviction and head is self._reordered_head):
                return Decision(run=running, recheck_at=recheck_at)  # drain, then swap
            return self._swap_to(head, view)
        head_pos = position[id(head)]
        victims: list[Request] = []
        pos_of = {id(r): position[id(self.grouper.of[id(r)])] for r in running}
        if self.eviction and any(p > head_pos for p in pos_of.values()):
            want = [r for r in head.pending() if not self._late(r, now)][: view.max_batch]
            victims = eviction_victims(
                head_pos,
                [r for r in running if self._evictable(r)],
                pos_of,
                need_slots=len(want),
                need_tokens=sum(r.context_tokens + 1 for r in want),
                free_slots=view.max_batch - len(running),
                free_tokens=view.kv_free_tokens,
            )
            self.counters["evicted"] += len(victims)
        kept = [r for r in running if r not in victims]
        pulls = self._pulls(head_pos, view, kept, now)
        run = sorted(kept + pulls, key=lambda r: pos_of.get(id(r), position[id(self.grouper.of[id(r)])]))
        return Decision(
            run=run,
            preempt_mode=self.evict_mode if victims else None,
            recheck_at=recheck_at,
        )

    def _pulls(self, head_pos: int, view: InstanceView, kept: list[Request], now: float) -> list[Request]:
        """Up to the batch's room of waiting requests of the loaded engine from the head group on, in VQ
        order (another engine's model waits for its swap). The groups of one base's LoRA adapters are
        one engine's: they are pulled together while the batch has a slot for their adapter
        (``view.max_loras``), as vLLM mixes them. With ``late_last`` the late ones met before the
        room-th on-time one go after every on-time one due within ``late_set_back_s`` (and those ahead
        of it in VQ order), ahead of the rest; the on-time ones keep their VQ order."""
        room = view.max_batch - len(kept)
        in_batch = set(batch_adapters(kept, view.adapter_of))
        on_time: list[Request] = []
        late: list[Request] = []
        cut = 0  # the late requests go after on_time[:cut], which ends with the last one due soon
        for req in self._waiting(head_pos, view):
            if len(on_time) >= room:
                break
            if view.max_loras > 0 and not admits(in_batch, req.model, view.adapter_of, view.max_loras):
                continue
            if req.model in view.adapter_of:
                in_batch.add(req.model)
            if self._late(req, now):
                late.append(req)
            else:
                on_time.append(req)
                if req.slo_deadline - now <= self.late_set_back_s:
                    cut = len(on_time)
        return (on_time[:cut] + late + on_time[cut:])[: max(room, 0)]

    def _waiting(self, head_pos: int, view: InstanceView) -> Iterator[Request]:
        """The waiting requests of the head group's engine from the head on, in VQ order, up to another
        engine's group."""
        engine = view.engine_of(self.vq.groups[head_pos].model)
        for group in self.vq.groups[head_pos:]:
            if view.engine_of(group.model) != engine:
                return
            yield from group.pending()

    def _late(self, req: Request, now: float) -> bool:
        """Whether ``late_last`` sets ``req`` back: it is already past its SLO deadline."""
        return self.late_last and req.slo_deadline < now

    def _evictable(self, req: Request) -> bool:
        """Whether ``req`` may leave the batch for the head group: not an interactive stream already
        under way unless ``evict_streams`` (its SLO is its TTFT, already decided; an eviction would
        stall the client's stream and, measured on an overloaded instance, cost more attainment in
        copies than the head group gained)."""
        return self.evict_streams or not (req.service_class.kind == "interactive" and req.generated > 0)

    # ---- estimator views (also used by the router and the bench) -----------------------------
    def costs(self, group: RequestGroup, z: float | None = None) -> GroupCosts:
        """W, W_last, C, P of ``group``'s waiting requests on this instance."""
        rates = self._rates()
        return group_costs(
            [r.prompt_tokens for r in group.pending()],
            self.stats[group.key],
            rates,
            self.z if z is None else z,
            group.max_tokens(),
            self.context_len,
            to_completion=group.slo_at_completion,
        )

    def swap_time(self) -> float:
        """S_g: a warm swap (CHOICE: one constant per instance): S0 plus the CPU->GPU copy."""
        rates = self._rates()
        return self.tiers.costs.engine_reinit_s + rates.profile.model_load_time()

    def residual(self, now: float, model: str | None = None) -> float:
        """R_g (not modelled in the paper): how long running work delays the start of the next group
        (of ``model``; default: the head group's). 0 when the head group may evict the running work.

        Correction of a first proposal, which charged the expected remaining tokens of all running
        requests over Theta, whatever the next group's model. With continuous batching a group of the loaded
        model starts as soon as one slot frees, and later members start at the completion rate
        that the drains W already count; a group of another model waits until the batch has
        drained completely (then the swap). So R_g is the expected remaining decode time
        (remaining tokens x eps x d) of the first running request to finish for the loaded model,
        and of the last one for another model.
        """
        head = self.vq.head_group()
        running = list(self._running.values())
        if not running:
            return 0.0
        if (
            self.eviction
            and head is not None
            and head.deadline() < min(r.slo_deadline for r in running)
            and any(self._evictable(r) for r in running)
        ):
            return 0.0
        rates = self._rates()
        remaining = []
        for req in running:
            stats = self.stats[group_key(req)]
            remaining.append(max(stats.mu_out - req.generated, 1.0) * rates.eps * rates.decode_time(stats))
        model = model if model is not None else (head.model if head is not None else self._active_model)
        same_engine = model is None or self._adapter_of.get(model, model) == self._active_model
        return min(remaining) if same_engine else max(remaining)

    def queued(self, now: float, z: float | None = None) -> list[tuple[RequestGroup, QueuedGroup]]:
        """Groups with waiting requests, in VQ order, as the violation walk sees them."""
        return [
            (g, QueuedGroup(g.model, self.costs(g, z), g.deadline() - now))
            for g in self.vq.groups
            if g.n_pending
        ]

    def estimated_waits(self, now: float, z: float = 0.0) -> dict[int, float]:
        """Estimated wait until start of every waiting request (id(request) -> seconds), request-level:
        the group's start plus the drain of its members ahead (Eq. 2, 3)."""
        pairs = self.queued(now, z)
        starts = start_times(
            [q for _, q in pairs],
            self._active_model,
            self.residual(now),
            self.swap_time(),
            adapter_of=self._adapter_of,
            adapter_load_s=self.adapter_load_s,
            held_adapters=self._held_adapters,
        )
        out: dict[int, float] = {}
        rates = self._rates()
        for (group, _), start in zip(pairs, starts, strict=True):
            stats = self.stats[group.key]
            ahead_prompts = 0
            for k, req in enumerate(group.pending()):
                out[id(req)] = start + drain_time(k, ahead_prompts, stats, rates, z)
                ahead_prompts += req.prompt_tokens
        return out

    # ---- internals --------------------------------------------------------------------------
    def _stats_for(self, req: Request) -> TokenStats:
        key = group_key(req)
        stats = self.stats.get(key)
        if stats is None:
            seed = self.token_seeds.get((key.model, key.slo_class))
            if seed is not None:
                mu_in, mu_out, sigma = seed
            else:  # CHOICE: without offline profiling, half the client cap with a wide spread
                mu_in, mu_out, sigma = req.prompt_tokens, max(1.0, req.max_tokens / 2), req.max_tokens / 4
            stats = TokenStats(float(mu_in), float(mu_out), float(sigma) ** 2, self.stats_alpha)
            self.stats[key] = stats
        return stats

    def _rates(self) -> EngineRates:
        if self.rates is None:
            raise RuntimeError("QLMPolicy: no engine view seen yet (schedule() sets the profile)")
        return self.rates

    def _size_limit(self, key: GroupKey) -> int:
        """n_max = delta_rg x avg batch (Eq. 16's, ``kv_batch``); tight-SLO classes capped so their
        tail fits half the SLO (our choice: a group of 4 average batches can hold a tight-SLO class's
        tail past its SLO)."""
        stats = self.stats.get(key)
        if self.rates is None or stats is None:
            return max(1, int(self.delta_rg * self.default_batch))
        limit = self.delta_rg * self.rates.kv_batch(stats)
        slo = self._ttft_slo.get(key)
        if self.solver.tail_aware and slo is not None:
            limit = min(limit, math.floor(0.5 * slo * self.rates.theta(stats) / stats.mu_out))
        return max(1, int(limit))

    def _observe(self, view: InstanceView) -> None:
        """Take in the engine's view (rates, batch entries and exits, eps); idempotent per view."""
        self.vq.name = view.instance
        self._refresh_rates(view)
        self._sync(view)
        self._active_model = view.active_model
        self._adapter_of = view.adapter_of
        self._held_adapters = batch_adapters(view.running, view.adapter_of)

    def _refresh_rates(self, view: InstanceView) -> None:
        if self.rates is None:
            self.rates = EngineRates(view.profile, view.max_batch, self.eps_seed)
        else:
            self.rates.profile = view.profile
            self.rates.max_batch = view.max_batch

    def _sync(self, view: InstanceView) -> None:
        """Track entries to / exits from the batch; account generated tokens; refresh eps."""
        now_running = {id(r): r for r in view.running}
        for rid, req in list(self._running.items()):
            if rid not in now_running:
                del self._running[rid]
                self._tokens_since += req.generated - self._gen_seen.get(rid, req.generated)
                self._gen_seen[rid] = req.generated
                self.grouper.of[rid].mark_waiting(req)
        prefill_s = 0.0
        for rid, req in now_running.items():
            if rid not in self._gen_seen:  # its first entry: the one prefill the estimator models
                prefill_s += view.profile.prefill(req.prompt_tokens)
            self._tokens_since += req.generated - self._gen_seen.get(rid, req.generated)
            self._gen_seen[rid] = req.generated
            if rid not in self._running:
                self._running[rid] = req
                self.grouper.of[rid].mark_running(req)
        rates = self._rates()
        batch = len(view.running)
        d_now = view.profile.decode_step(batch, sum(r.context_tokens for r in view.running)) if batch else 0.0
        sample = self.eps_meter.observe(
            view.now, self._tokens_since, prefill_s, batch, d_now, self.vq.pending_requests() > 0
        )
        self._tokens_since = 0.0
        if sample is not None:
            rates.eps = rates.eps + self.eps_meter.alpha * (sample - rates.eps)
            measured = self.eps_meter.batch
            if self.batch_estimate == "measured" and measured is not None:
                old = rates.measured_batch
                alpha = self.eps_meter.alpha
                rates.measured_batch = measured if old is None else old + alpha * (measured - old)

    def prepare(self, view: InstanceView) -> Callable[[], None] | None:
        """The MILP solve as work for another thread (the worker's; Policy protocol item 6), when
        a violation is predicted and the debounce allows; the next ``schedule`` installs its plan.
        The work reads only the numbers taken here, so the queue may change meanwhile."""
        if not (self.reorder and self._check_due) or self._solving or self._solved is not None:
            return None
        self._observe(view)
        if self.gate.closed_until(view.active_model, view.now) is not None:
            return None
        problem = self._reorder_problem(view)
        if isinstance(problem, float) or problem is None:
            return None  # no violation, or debounced: ``schedule`` says when to look again
        groups, queues, by_id = problem
        self._solving = True

        def work() -> None:
            try:
                self._solved = (solve(groups, queues, self.solver), by_id)
            finally:
                self._solving = False

        return work

    def _reorder_problem(
        self, view: InstanceView
    ) -> tuple[list[GroupSpec], list[QueueSpec], dict[int, RequestGroup]] | float | None:
        """The MILP's input when the estimator predicts a violation (QLM §7's trigger); a re-check
        time while debounced; None when no violation is predicted."""
        now = view.now
        pairs = self.queued(now)
        residual = self.residual(now)
        swap = self.swap_time()
        late = first_violation(
            [q for _, q in pairs],
            view.active_model,
            residual,
            swap,
            self.solver.tail_aware,
            adapter_of=self._adapter_of,
            adapter_load_s=self.adapter_load_s,
            held_adapters=self._held_adapters,
        )
        if late is None:
            self._check_due = False
            return None
        if now - self._last_solve < self.min_resolve_interval_s:
            return self._last_solve + self.min_resolve_interval_s
        self._check_due = False
        self._last_solve = now
        # The MILP sees an adapter's group as its engine's (its base's): a change between them is no swap
        # there either; their loads (adapter_load_s, a fraction of a second) are left out of its order.
        groups = [
            GroupSpec(
                g.id,
                self._adapter_of.get(g.model, g.model),
                q.slack,
                {self.vq.name: q.costs},
                current=self.vq.name,
                priority=g.priority,
            )
            for g, q in pairs
        ]
        queues = [QueueSpec(self.vq.name, view.active_model, residual, swap)]
        return groups, queues, {g.id: g for g, _ in pairs}

    def _maybe_reorder(self, view: InstanceView) -> float | None:
        """Violation check; solve when one is predicted. Returns a re-check time when debounced."""
        problem = self._reorder_problem(view)
        if isinstance(problem, float) or problem is None:
            return problem
        groups, queues, by_id = problem
        self._install(solve(groups, queues, self.solver), by_id)
        return None

    def _install(self, plan: Plan, by_id: Mapping[int, RequestGroup]) -> None:
        """Put the plan's order in the virtual queue. Groups that finished since the solve are
        skipped; groups formed since then keep their place after the plan's (a plan solved on
        another thread may be a little stale)."""
        self.counters["solves"] += 1
        self.solve_times.append(plan.solve_s)
        if plan.status.startswith("edf"):
            self.counters["fallbacks"] += 1
        old_head = self.vq.head_group()
        live = {id(g) for g in self.vq.groups if g.n_pending}
        ordered = [by_id[gid] for gid in plan.order[self.vq.name] if id(by_id[gid]) in live]
        placed = {id(g) for g in ordered}
        started = [g for g in self.vq.groups if not g.n_pending]
        newer = [g for g in self.vq.groups if g.n_pending and id(g) not in placed]
        self.vq.replace(started + ordered + newer)
        new_head = self.vq.head_group()
        if new_head is not old_head:
            self._reordered_head = new_head

    def _swap_to(self, head: RequestGroup, view: InstanceView) -> Decision:
        """Model swap LSO: load the head group's model (running requests are flushed by the engine)."""
        upcoming = [head.model] + [g.model for g in self.vq.groups if g.n_pending]
        sizes = {m: self.model_weights_bytes.get(m, view.profile.weights_bytes) for m in upcoming}
        self.tiers.plan(upcoming, sizes, view.now)
        self.gate.issue(head.model, sizes[head.model], view.now)
        self._reordered_head = None
        self.counters["model_swaps"] += 1
        return Decision(run=[], load_model=view.engine_of(head.model), preempt_mode=self.evict_mode)

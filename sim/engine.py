"""One simulated continuous-batching engine instance (vLLM V0 semantics).

Model: docs/papers.md, "Engine: iteration semantics" and "Engine: step-time model".

- KV cache in blocks of ``profile.block_size``; a resident request with context
  ``c = P + n_gen`` holds ``ceil((c + 1) / block)`` blocks, i.e. what its next
  step needs. Admission keeps a watermark (1% of the blocks) free.
- Without chunked prefill, admitting requests triggers a prefill-only iteration
  (bounded by the prefill token budget); the first token appears at its end.
  With chunked prefill each iteration carries every decode plus prompt chunks up
  to the token budget (decodes first, Sarathi-Serve). This is how vLLM V1 (0.32)
  schedules: running requests first, then waiting ones FCFS while
  ``max_num_batched_tokens`` and ``max_num_seqs`` allow, prompts chunked to fit;
  a step costs ``decode_step(decodes, context) + p1 * chunk tokens`` (one fixed
  cost per step), a prefill-only step ``p0 + p1 * tokens``.
- A profile's ``request_overhead_s`` (serving path outside steps) delays each
  request's entry into its instance (the cluster charges it; metrics count from
  arrival).
- Decode iterations give each running request one token. Between events the
  engine advances a *run* of k decode iterations in closed form: the step time
  grows linearly with the batch's context, so the run's token times are an
  arithmetic series recorded as one ``TokenTimeline`` run (shared ``RunLog``).
  A run ends at the first completion, at KV exhaustion (computed analytically),
  at a policy re-check, or early at the first iteration boundary after an
  arrival or external change (``notify``).
- Preemption: ``recompute`` (KV dropped; resuming re-prefills P + generated),
  ``swap`` (KV over the host link, bounded swap space; falls back to recompute),
  ``keep`` (paused with KV kept). When KV runs out the engine preempts the
  running request that came last in the policy's latest ``run`` and asks again.
  Paused KV is dropped (recompute, latest paused first) when the running requests' next steps
  need it, or for an admission that needs its blocks and is otherwise admissible (batch and token
  budget checked first), only as many as that admission needs; with ``shared_kv`` never for an
  admission.
- Models: ``profiles`` maps each model the instance can serve to its step
  profile. One model is active; loading a model that is not resident costs
  ``weights_bytes / host_link`` (a model swap) and evicts the least recently
  used resident model beyond ``max_resident_models``. With ``shared_kv`` every model's weights
  stay resident and the models share one KV pool (SeaLLM's temporal sharing): switching the
  active model costs nothing and pauses the running requests with their KV kept; the policy is
  asked again at once, seeing the new model's view. Each model's
  profile then gives its block size so that a block holds the same bytes for every model, and
  admissions take free KV only (the other models' requests keep theirs). With ``co_resident``
  (``tessera.core.sharing``'s co-resident mode, what a pod of engines that cannot sleep runs) an
  instance of several models is a ``tessera.sim.coresident.CoResidentInstance``: one engine per
  model, each with its own KV share, run side by side.
- LoRA adapters (``adapters``: adapter -> its base, ``tessera.core.lora``): an adapter is a model of
  its base's engine, not an engine of its own. Its requests (which name the adapter) take the base's
  profile and KV pool and run in the base's batch; ``profiles`` maps each adapter to its base's profile.
  Each decision's ``run`` passes vLLM's slot rule (``engine_batch``: one batch mixes at most
  ``max_loras`` adapters; a request whose adapter finds no slot waits while the others go on). The
  engine holds ``max_cpu_loras`` adapters (``AdapterCache``); starting a request whose adapter it does
  not hold loads it first, which delays the engine's next step by ``LoraCost.load_s`` (vLLM loads
  synchronously before the step), and a step whose batch holds adapter requests takes
  ``LoraCost.step_factor`` times the base's step time.
"""

from __future__ import annotations

import math
import operator
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from tessera.core.lora import AdapterCache, LoraCost, batch_adapters, engine_batch
from tessera.core.policy import Decision, InstanceView, Policy, PreemptMode
from tessera.core.policy import kv_blocks as blocks_for
from tessera.core.prefix import leading_run
from tessera.core.profile import StepProfile
from tessera.core.request import Phase, Request
from tessera.core.sharing import CoResidentCost
from tessera.core.timeline import RunLog

INF = float("inf")
# C-level accessors: per-event passes over the batch stay out of the interpreter loop.
_prompt_of = operator.attrgetter("prompt_tokens")
_generated_of = operator.attrgetter("generated")


@dataclass(slots=True)
class EngineConfig:
    """Settings of one simulated engine instance (each a CHOICE; defaults in docs/papers.md)."""

    max_batch: int = 256  # vLLM max_num_seqs default
    chunked_prefill: bool = False  # Sarathi-Serve style mixed iterations
    token_budget: int | None = None  # max_num_batched_tokens; None: 512 chunked, 8192 otherwise
    preempt_mode: PreemptMode = "recompute"  # engine default (vLLM for single-sequence requests)
    watermark: float = 0.01  # fraction of KV blocks admission keeps free
    swap_space_tokens: int | None = None  # host swap space; None: 4 GiB (vLLM default) of KV
    max_resident_models: int = 1  # models whose weights fit at once
    prefix_caching: bool = False  # reuse the KV of a prompt's leading blocks cached by earlier requests
    shared_kv: bool = False  # every model resident, one KV pool: model switches keep requests' KV
    # Several models' engines resident at once, each with its own KV share (tessera.core.sharing's
    # co-resident mode; the cluster builds such instances as sim.coresident.CoResidentInstance).
    co_resident: bool = False
    coresident_cost: CoResidentCost = field(default_factory=CoResidentCost)  # their share of the accelerator
    max_running: int | None = None  # one co-resident engine's sequence limit (--max-num-seqs); None: none
    # LoRA adapters (an instance with ``adapters``): adapters one batch mixes (--max-loras; None: one slot
    # per adapter the instance serves, the operator's default), adapters the engine holds in memory
    # (--max-cpu-loras; None: max_loras, vLLM's default), and what loading and running them costs.
    max_loras: int | None = None
    max_cpu_loras: int | None = None
    lora_cost: LoraCost = field(default_factory=LoraCost)

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.token_budget is not None and self.token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {self.token_budget}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.preempt_mode not in ("recompute", "swap", "keep"):
            raise ValueError(f"preempt_mode must be recompute, swap or keep, got {self.preempt_mode!r}")
        if self.max_resident_models < 1:
            raise ValueError("max_resident_models must be >= 1")
        if self.max_running is not None and self.max_running < 1:
            raise ValueError(f"max_running must be >= 1 or None, got {self.max_running}")
        if self.max_loras is not None and self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1 or None, got {self.max_loras}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < (self.max_loras or 1):
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras or 1}): "
                "an engine holds every adapter of its batch"
            )
        if self.co_resident and (self.shared_kv or self.prefix_caching):
            raise ValueError(
                "co_resident engines each hold their own KV share: it excludes shared_kv (one KV pool) "
                "and prefix_caching (not modelled per engine)"
            )

    @property
    def budget(self) -> int:
        """The effective per-iteration token budget."""
        if self.token_budget is not None:
            return self.token_budget
        return 512 if self.chunked_prefill else 8192


SegmentKind = Literal["prefill", "decode", "busy", "wait"]


@dataclass(slots=True)
class _Segment:
    kind: SegmentKind
    t0: float  # when its first iteration starts
    end: float
    k: int = 0  # decode iterations (decode) or 1 (prefill)
    a: float = 0.0  # first decode step time
    g: float = 0.0  # per-iteration growth of the step time
    decodes: int = 0  # requests decoding in a mixed (chunked) iteration
    chunks: tuple[tuple[Request, int], ...] = ()  # prefill work of the iteration


class SimInstance:
    """A continuous-batching engine driven by a policy; time is always passed in."""

    def __init__(
        self,
        name: str,
        profiles: dict[str, StepProfile],
        policy: Policy,
        config: EngineConfig | None = None,
        *,
        role: str = "default",
        created_at: float = 0.0,
        ready_at: float | None = None,
        on_finish: Callable[[Request], None] | None = None,
        adapters: Mapping[str, str] | None = None,
    ) -> None:
        if not profiles:
            raise ValueError(f"instance {name}: needs at least one model profile")
        adapters = dict(adapters or {})
        for adapter, base in adapters.items():
            if base not in profiles or adapter in profiles:
                raise ValueError(
                    f"instance {name}: adapter {adapter!r} needs a base among its full models "
                    f"({', '.join(profiles)}) and a name of its own; its base is {base!r}"
                )
        if adapters and config is not None and config.prefix_caching:
            # vLLM keys a cached block by its adapter too; one prefix cache for every adapter would share
            # blocks across them.
            raise ValueError(f"instance {name}: prefix caching with LoRA adapters is not simulated")
        self.name = name
        # An adapter runs on its base's engine: its requests take the base's profile (module docstring).
        self.profiles = {**profiles, **{a: profiles[b] for a, b in adapters.items()}}
        self.adapter_of: Mapping[str, str] = MappingProxyType(adapters)
        self.policy = policy
        self.config = config or EngineConfig()
        self.role = role
        self.max_batch = self.config.max_batch
        self.active_model = next(iter(profiles))
        self.resident_models: list[str] = [self.active_model]  # LRU order, most recent last
        self.profile = profiles[self.active_model]
        self.gpus = self.profile.gpus
        self.created_at = created_at
        self.ready_at = created_at if ready_at is None else ready_at
        self.retired_at: float | None = None
        self.draining = False
        self.on_finish = on_finish
        self.log = RunLog()
        self.running: list[Request] = []  # in the batch, in admission order
        self.paused_kv: list[Request] = []  # preempted with KV kept
        self._prefill_left: dict[Request, int] = {}  # running requests still prefilling -> tokens left
        self._last_run: list[Request] = []  # the latest Decision.run (its order picks KV victims)
        self._recheck_after: int | None = None
        self._recheck_at: float | None = None
        self._overhead = 0.0  # swap transfers to charge before the next iteration
        self.used_blocks = 0
        self.swap_used_tokens = 0
        self.assigned: dict[Request, None] = {}  # routed here and not finished, in routing order
        self.assigned_by_model: Counter[str] = Counter()  # the same requests, counted by model
        self._target: dict[Request, int] = {}  # output tokens each assigned request will produce
        self.now = created_at
        self.heap_seq = -1  # the cluster's latest heap entry for this instance
        self.seg: _Segment | None = None
        if self.ready_at > created_at:
            self.seg = _Segment("busy", created_at, self.ready_at)
        # counters
        self.iterations = 0
        self.preemptions = 0
        self.kv_swaps = 0
        self.model_swaps = 0
        self.finished = 0
        # prefix cache (EngineConfig.prefix_caching): prompt block ids, least recently used first
        self.prefix_cache: OrderedDict[object, None] = OrderedDict()
        self.prefill_tokens_computed = 0
        self.prefix_hit_tokens = 0
        # LoRA adapters: GPU slots of one batch, the adapters the engine holds, loads so far
        cfg = self.config
        self.max_loras = (cfg.max_loras or len(adapters)) if adapters else 0
        held = max(cfg.max_cpu_loras or self.max_loras, self.max_loras)  # it holds every adapter of a batch
        self.adapter_cache: AdapterCache | None = AdapterCache(held) if adapters else None
        self.adapter_loads = 0

    # ---- capacity ---------------------------------------------------------------------------
    @property
    def block(self) -> int:
        """Block size of the active model's KV cache."""
        return self.profile.block_size

    @property
    def capacity_blocks(self) -> int:
        """KV blocks of the active model on this instance."""
        return self.profile.kv_capacity_tokens // self.profile.block_size

    @property
    def outstanding(self) -> int:
        """Requests routed here and not finished (queued, preempted or running)."""
        return len(self.assigned)

    @property
    def ready(self) -> bool:
        """Whether the instance has finished its cold start (at its current time)."""
        return self.now >= self.ready_at

    @property
    def next_time(self) -> float:
        """When this instance next needs the simulator's attention (inf: waits for a request)."""
        return self.seg.end if self.seg is not None else INF

    def view(self, now: float) -> InstanceView:
        """The read-only view a policy sees."""
        block = self.profile.block_size
        return InstanceView(
            now=now,
            instance=self.name,
            running=tuple(self.running),
            max_batch=self.max_batch,
            kv_capacity_tokens=self.capacity_blocks * block,
            kv_used_tokens=self.used_blocks * block,
            profile=self.profile,
            active_model=self.active_model,
            iteration=self.iterations,
            prefill_budget_tokens=None if self.config.chunked_prefill else self.config.budget,
            swap_free_tokens=self._swap_room(),
            adapter_of=self.adapter_of,
            max_loras=self.max_loras,
        )

    def engine_of(self, model: str) -> str:
        """The model whose engine runs ``model``: its base for an adapter, else itself."""
        return self.adapter_of.get(model, model)

    # ---- entry points used by the cluster ---------------------------------------------------
    def add(self, req: Request, now: float) -> None:
        """A request routed to this instance at ``now``."""
        if req.model not in self.profiles:
            raise ValueError(f"instance {self.name} cannot serve model {req.model!r}")
        prof = self.profiles[req.model]
        need = blocks_for(req.prompt_tokens + req.target_output_tokens, prof.block_size)
        cap = prof.kv_capacity_tokens // prof.block_size
        if need > cap - int(self.config.watermark * cap):
            raise ValueError(
                f"request {req.id} needs {need} KV blocks (prompt {req.prompt_tokens} + output "
                f"{req.target_output_tokens} tokens) but instance {self.name} holds "
                f"{cap} (less the {self.config.watermark:.0%} admission watermark); "
                "filter the trace or raise kv_capacity_tokens"
            )
        req.instance = self.name
        self.assigned[req] = None
        self.assigned_by_model[req.model] += 1
        self._target[req] = req.target_output_tokens
        self.policy.add(req, now)
        self.notify(now)

    def notify(self, now: float) -> None:
        """Something changed at ``now`` (arrival, batch size): decide at the next iteration boundary."""
        seg = self.seg
        if seg is None:  # decide at ``now``, after every other event of the same instant
            self.seg = _Segment("wait", now, now)
        elif seg.kind == "wait":
            seg.end = now
        elif seg.kind == "decode" and seg.end > now:
            k = self._iterations_until(seg, now)
            if k < seg.k:
                seg.k = k
                seg.end = seg.t0 + k * seg.a + seg.g * k * (k - 1) / 2

    def advance(self) -> None:
        """Finish the current segment (its end is ``next_time``) and decide what runs next."""
        seg = self.seg
        assert seg is not None
        now = seg.end
        self.now = now
        self.seg = None
        if seg.kind == "decode":
            self._commit_decode(seg)
        elif seg.kind == "prefill":
            self._commit_prefill(seg, now)
        self._enforce_kv(now)
        self._decide(now)

    def take_all(self, now: float) -> list[Request]:
        """Remove every unfinished request (the instance is being removed): KV dropped, progress kept."""
        out = list(self.assigned)
        for req in out:
            if req.phase is Phase.RUNNING or req.kv_resident:
                self._preempt(req, "recompute", now, engine=True)
            if req.swapped:
                self.swap_used_tokens -= req.prompt_tokens + req.generated
                req.swapped = False
            self.policy.remove(req, now)
            req.instance = None
        self.assigned.clear()
        self.assigned_by_model.clear()
        self._target.clear()
        self.seg = None
        return out

    # ---- decisions --------------------------------------------------------------------------
    def _decide(self, now: float, switched: bool = False) -> None:
        """Ask the policy, apply its decision and plan the next segment (``switched``: the model was just
        switched for the policy, which is not switched again in this decision)."""
        if now < self.ready_at:
            self.seg = _Segment("busy", now, self.ready_at)
            return
        if not len(self.policy):
            if self.running:
                raise RuntimeError(f"instance {self.name}: policy holds no request but some are running")
            return
        view = self.view(now)
        self.policy.observe(view)
        decision = self.policy.schedule(view)
        if self._apply(decision, now):  # loading a model
            return
        self._plan(now)
        if self.seg is None and not self.running and not switched:
            # Nothing of the active model left to run, but the policy wants another model's requests
            # and asked for no swap (a policy that is not model-aware, e.g. FCFS on a co-located
            # group): load the first one's model, as the worker's scheduler holding work for a sleeping
            # model asks the swapper for it once the active model has drained.
            engine_of = self.engine_of
            other = next((r.model for r in decision.run if engine_of(r.model) != self.active_model), None)
            if other is not None and not self._load_model(other, now):
                self._decide(now, switched=True)

    def _apply(self, d: Decision, now: float) -> bool:
        """Apply a decision; True when the instance is now busy loading a model."""
        swap_to = d.load_model
        if swap_to is not None and swap_to != self.active_model and self._load_model(swap_to, now):
            return True
        self._recheck_after = d.recheck_after_tokens
        self._recheck_at = d.recheck_at
        self._last_run = d.run
        run_ids = set(map(id, d.run))
        mode = d.preempt_mode or self.config.preempt_mode
        if not run_ids.issuperset(map(id, self.running)):
            for req in [r for r in self.running if id(r) not in run_ids]:
                self._preempt(req, mode, now, engine=False)
        if len(self.running) >= self.max_batch or len(run_ids) == len(self.running):
            return False  # batch full, or nothing new to admit: skip the admission pass
        cap = self.capacity_blocks
        reserve = int(self.config.watermark * cap)
        block = self.profile.block_size
        budget = None if self.config.chunked_prefill else self.config.budget
        prefill_tokens = sum(self._prefill_left.values())
        run = d.run
        of = self.adapter_of
        if of:  # vLLM's side: adapters without a GPU slot wait (module docstring); the awake engine's only
            mine = [r for r in run if of.get(r.model, r.model) == self.active_model]
            run, _ = engine_batch(mine, set(self.running), of, self.max_loras)
        for req in run:
            if req.phase is Phase.RUNNING or req.phase is Phase.FINISHED:
                continue
            if of.get(req.model, req.model) != self.active_model:
                continue  # cannot run until its model is loaded
            if len(self.running) >= self.max_batch:
                break
            context = req.prompt_tokens + req.generated
            if req.kv_resident:  # paused with KV kept: resumes at no cost
                self.paused_kv.remove(req)
                self._start(req, now, prefill=0)
                continue
            need = blocks_for(context, block)
            cached = 0 if req.swapped else self._cached_prefix(req)
            prefill = context - cached
            if (
                not req.swapped
                and budget is not None
                and prefill_tokens > 0
                and prefill_tokens + prefill > budget
            ):
                break  # checked before any paused KV gives way: it gives way only to an admission
            short = need + reserve - (cap - self.used_blocks)  # blocks missing for this admission
            if short > 0:
                if self.config.shared_kv or short > self._paused_blocks():
                    break
                while cap - self.used_blocks - need < reserve:  # paused KV gives way, latest first
                    self._preempt(self.paused_kv[-1], "recompute", now, engine=True)
            self.used_blocks += need
            if req.swapped:
                self._overhead += self.profile.kv_swap_time(context)
                self.swap_used_tokens -= context
                req.swapped = False
                self._start(req, now, prefill=0)
                continue
            self._use_prefix(req, cached)
            prefill_tokens += prefill
            self.prefill_tokens_computed += prefill
            self._start(req, now, prefill=prefill)
        return False

    def _paused_blocks(self) -> int:
        """KV blocks the requests paused with their KV hold (what giving way could free)."""
        return sum(
            blocks_for(r.prompt_tokens + r.generated, self.profiles[r.model].block_size)
            for r in self.paused_kv
        )

    def held_prefix_blocks(self, block_ids: Sequence[object]) -> int:
        """How many of ``block_ids``' leading blocks the prefix cache holds now (not touched as used:
        a router asking is not a request using them)."""
        return leading_run(block_ids, self.prefix_cache)

    def _cached_prefix(self, req: Request) -> int:
        """Prompt tokens of ``req`` held in the prefix cache: its longest run of leading blocks there,
        never the whole prompt (the last token is always computed, as in vLLM). Only looks: an
        admission that is then refused must not touch the cache (``_use_prefix`` does, on admission)."""
        if not self.config.prefix_caching or not req.prefix_blocks:
            return 0
        hits = leading_run(req.prefix_blocks, self.prefix_cache)
        return max(0, min(hits * req.prefix_block_tokens, req.prompt_tokens - 1))

    def _use_prefix(self, req: Request, cached: int) -> None:
        """``req`` is admitted with ``cached`` prompt tokens from the prefix cache: its cached leading
        blocks are touched as used and the hit is counted."""
        if not self.config.prefix_caching or not req.prefix_blocks:
            return
        for block_id in req.prefix_blocks:
            if block_id not in self.prefix_cache:
                break
            self.prefix_cache.move_to_end(block_id)
        req.cached_prompt_tokens = cached
        self.prefix_hit_tokens += cached

    def _cache_prefix(self, req: Request) -> None:
        """Keep the full prompt blocks of a prefilled request, evicting least recently used ones past
        the KV cache's size (CHOICE: cached blocks may fill the whole KV cache; vLLM keeps a freed
        block's content until it hands the block out again)."""
        if not self.config.prefix_caching or not req.prefix_blocks or req.prefix_block_tokens < 1:
            return
        for block_id in req.prefix_blocks[: req.prompt_tokens // req.prefix_block_tokens]:
            self.prefix_cache[block_id] = None
            self.prefix_cache.move_to_end(block_id)
        limit = self.capacity_blocks * self.profile.block_size // req.prefix_block_tokens
        while len(self.prefix_cache) > max(0, limit):
            self.prefix_cache.popitem(last=False)

    def _start(self, req: Request, now: float, prefill: int) -> None:
        if self.adapter_cache is not None and req.model in self.adapter_of:
            self._use_adapter(req.model)
        req.phase = Phase.RUNNING
        req.kv_resident = True
        if req.first_scheduled_at is None:
            req.first_scheduled_at = now
        self.running.append(req)
        if prefill:
            self._prefill_left[req] = prefill
        else:
            req.tokens.attach(self.log)

    def _use_adapter(self, adapter: str) -> None:
        """A request of ``adapter`` starts: a miss of the adapter cache loads it (evicting the least
        recently used adapter no running request uses), and the next step waits for the load."""
        cache = self.adapter_cache
        assert cache is not None
        if adapter in cache:
            cache.use(adapter)
            return
        cache.use(adapter, batch_adapters(self.running, self.adapter_of))
        self.adapter_loads += 1
        self._overhead += self.config.lora_cost.load_s

    def _lora_factor(self) -> float:
        """The factor on the next step's time: the LoRA overhead when the batch holds adapter requests."""
        of = self.adapter_of
        if not of:
            return 1.0
        return self.config.lora_cost.step_factor(any(r.model in of for r in self.running))

    def _preempt(self, req: Request, mode: PreemptMode, now: float, *, engine: bool) -> None:
        """Take ``req`` out of the batch (or drop the KV of a paused one)."""
        block = self.profiles[req.model].block_size
        context = req.prompt_tokens + req.generated
        if req in self._prefill_left:
            del self._prefill_left[req]
            mode = "recompute"  # a half-prefilled request has nothing worth keeping
        else:
            req.tokens.detach()
        if req.phase is Phase.RUNNING:
            self.running.remove(req)
            req.preemptions += 1
            self.preemptions += 1
        else:  # paused with KV: only the KV goes
            self.paused_kv.remove(req)
        req.phase = Phase.PREEMPTED
        if mode == "keep" and not engine:
            self.paused_kv.append(req)
            return
        self.used_blocks -= blocks_for(context, block)
        req.kv_resident = False
        if mode == "swap" and req.generated > 0 and self._swap_room() >= context:
            self.swap_used_tokens += context
            self._overhead += self.profile.kv_swap_time(context)
            req.swapped = True
            req.swaps += 1
            self.kv_swaps += 1

    def _swap_room(self) -> int:
        space = self.config.swap_space_tokens
        if space is None:
            space = (4 << 30) // self.profile.kv_bytes_per_token
        return space - self.swap_used_tokens

    def _load_model(self, model: str, now: float) -> bool:
        if model not in self.profiles:
            raise ValueError(f"instance {self.name}: policy asked to load unknown model {model!r}")
        model = self.engine_of(model)  # an adapter's model is its base's
        if self.config.shared_kv:
            for req in list(self.running):
                if req in self._prefill_left:
                    self._preempt(req, "recompute", now, engine=True)
                    continue
                req.tokens.detach()  # paused with its KV kept: not a preemption
                self.running.remove(req)
                req.phase = Phase.PREEMPTED
                self.paused_kv.append(req)
            self.active_model = model
            self.profile = self.profiles[model]
            self.seg = _Segment("wait", now, now)  # the policy decides again at once, in this model's view
            return True
        for req in list(self.running) + list(self.paused_kv):
            self._preempt(req, "recompute", now, engine=True)
        self.active_model = model
        self.profile = self.profiles[model]
        self.prefix_cache.clear()  # the cached KV was the previous model's
        if model in self.resident_models:
            self.resident_models.remove(model)
            self.resident_models.append(model)
            return False
        self.resident_models.append(model)
        del self.resident_models[: -self.config.max_resident_models]
        self.model_swaps += 1
        self.seg = _Segment("busy", now, now + self.profile.model_load_time())
        return True

    # ---- planning ---------------------------------------------------------------------------
    def _plan(self, now: float) -> None:
        """Plan the next segment (none when nothing can run: the instance waits for an event)."""
        prof = self.profile
        t0 = now + self._overhead
        self._overhead = 0.0
        lora = self._lora_factor()
        if self._prefill_left and not self.config.chunked_prefill:
            tokens = sum(self._prefill_left.values())
            chunks = tuple(self._prefill_left.items())
            self.seg = _Segment("prefill", t0, t0 + prof.prefill(tokens) * lora, 1, chunks=chunks)
            return
        decoding = len(self.running) - len(self._prefill_left)
        if self._prefill_left:  # chunked: one mixed iteration
            left = self.config.budget - decoding
            chunks = []
            for req, need in self._prefill_left.items():
                if left <= 0:
                    break
                take = min(need, left)
                chunks.append((req, take))
                left -= take
            chunk_tokens = sum(t for _, t in chunks)
            if decoding:
                context = self._decoding_context()
                dt = prof.decode_step(decoding, context) + prof.prefill_p1 * chunk_tokens
            else:
                dt = prof.prefill(chunk_tokens)
            self.seg = _Segment("prefill", t0, t0 + dt * lora, 1, decodes=decoding, chunks=tuple(chunks))
            return
        if not decoding:
            if self._recheck_at is not None and self._recheck_at > now:
                self.seg = _Segment("wait", now, self._recheck_at)
            return
        context = self._decoding_context()
        running = self.running
        k = min(map(operator.sub, map(self._target.__getitem__, running), map(_generated_of, running)))
        if self._recheck_after is not None:
            k = min(k, max(1, self._recheck_after))
        k = self._kv_iterations(decoding, k)
        a = (prof.decode_c0 + prof.decode_c1 * decoding + prof.decode_c2 * context) * lora
        g = prof.decode_c2 * decoding * lora
        seg = _Segment("decode", t0, 0.0, k, a, g)
        seg.end = t0 + k * a + g * k * (k - 1) / 2
        if self._recheck_at is not None and self._recheck_at < seg.end:
            seg.k = self._iterations_until(seg, self._recheck_at)
            seg.end = t0 + seg.k * a + g * seg.k * (seg.k - 1) / 2
        self.seg = seg

    def _decoding_context(self) -> int:
        pl = self._prefill_left
        if pl:
            return sum(r.prompt_tokens + r.generated for r in self.running if r not in pl)
        running = self.running
        return sum(map(_prompt_of, running)) + sum(map(_generated_of, running))

    def _kv_iterations(self, decoding: int, k: int) -> int:
        """``k`` capped at the decode iterations that fit before a request needs a block that is not free.

        Iteration j (0-based) needs ``sum_r floor((u_r + j) / block)`` blocks beyond those held,
        where ``u_r = context_r mod block``; the first j where that exceeds the free blocks F is
        ``q*block + block - u_(rem)`` with ``q = F // B``, ``rem = F % B`` and ``u`` sorted descending.
        """
        free = self.capacity_blocks - self.used_blocks
        block = self.profile.block_size
        if decoding * ((k - 1 + block - 1) // block) <= free:
            return k  # each request needs at most ceil((k-1)/block) more blocks in k iterations
        q, rem = divmod(free, decoding)
        us = sorted(
            ((r.prompt_tokens + r.generated) % block for r in self.running if r not in self._prefill_left),
            reverse=True,
        )
        return min(k, q * block + block - us[rem])

    @staticmethod
    def _iterations_until(seg: _Segment, t: float) -> int:
        """Iterations of ``seg`` needed for its boundary to reach ``t`` (>= 1, <= seg.k)."""
        x = t - seg.t0
        if x <= 0:
            return 1
        a, g = seg.a, seg.g
        # E(m) = m*a + g*m*(m-1)/2 >= x; smallest integer m.
        if g > 0:
            b = a - g / 2
            m = math.ceil((-b + math.sqrt(b * b + 2 * g * x)) / g)
        else:
            m = math.ceil(x / a)
        m = max(1, min(m, seg.k))
        while m > 1 and (m - 1) * a + g * (m - 1) * (m - 2) / 2 >= x:
            m -= 1
        while m < seg.k and m * a + g * m * (m - 1) / 2 < x:
            m += 1
        return m

    # ---- commits ----------------------------------------------------------------------------
    def _commit_decode(self, seg: _Segment) -> None:
        k = seg.k
        self.iterations += k
        self.log.append_run(seg.t0 + seg.a, k, seg.a + seg.g, seg.g)
        block = self.profile.block_size
        used = 0
        done = []
        target = self._target
        for r in self.running:
            r.generated += k
            if r.generated >= target[r]:
                done.append(r)
            used += (r.prompt_tokens + r.generated) // block + 1
        for r in self.paused_kv:
            used += blocks_for(r.prompt_tokens + r.generated, self.profiles[r.model].block_size)
        self.used_blocks = used
        for r in done:
            self._finish(r, seg.end)

    def _commit_prefill(self, seg: _Segment, now: float) -> None:
        self.iterations += 1
        block = self.profile.block_size
        done = []
        if seg.decodes:  # mixed iteration: every decoding request got a token at its end
            self.log.append_run(now, 1, 0.0, 0.0)
            for r in self.running:
                if r not in self._prefill_left:
                    self._advance_one(r, block)
                    if r.generated >= self._target[r]:
                        done.append(r)
        for req, take in seg.chunks:
            left = self._prefill_left.get(req)
            if left is None:
                continue
            if left > take:
                self._prefill_left[req] = left - take
                continue
            del self._prefill_left[req]
            self._cache_prefix(req)
            req.tokens.append(now)
            self._advance_one(req, block)
            req.tokens.attach(self.log)
            if req.generated >= self._target[req]:
                done.append(req)
        for r in done:
            self._finish(r, now)

    def _advance_one(self, r: Request, block: int) -> None:
        before = blocks_for(r.prompt_tokens + r.generated, block)
        r.generated += 1
        self.used_blocks += blocks_for(r.prompt_tokens + r.generated, block) - before

    def _finish(self, r: Request, t: float) -> None:
        r.tokens.detach()
        self.running.remove(r)
        self._release(r)
        r.phase = Phase.FINISHED
        r.kv_resident = False
        r.finished_at = t
        del self.assigned[r]
        self.assigned_by_model[r.model] -= 1
        del self._target[r]
        self.finished += 1
        self.policy.remove(r, t)
        if self.on_finish is not None:
            self.on_finish(r)

    def _release(self, r: Request) -> None:
        """A finished request gives back the KV blocks it held."""
        self.used_blocks -= blocks_for(r.prompt_tokens + r.generated, self.profile.block_size)

    def _enforce_kv(self, now: float) -> None:
        """Preempt until the resident requests' next steps fit (vLLM: latest in policy order first)."""
        cap = self.capacity_blocks
        while self.used_blocks > cap:
            if self.paused_kv:
                self._preempt(self.paused_kv[-1], "recompute", now, engine=True)
                continue
            rank = dict(zip(map(id, self._last_run), range(len(self._last_run)), strict=True))
            victim = max(self.running, key=lambda r: rank.get(id(r), -1))
            self._preempt(victim, self.config.preempt_mode, now, engine=True)

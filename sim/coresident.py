"""A simulated instance whose models' engines are all resident at once (``tessera.core.sharing``'s
``co-resident`` mode: the pod of a placement group whose engines cannot sleep).

Every model has an engine of its own, as a pod runs one vLLM process per model:

- its own KV share in blocks of its own profile's ``block_size`` (``kv_capacity_tokens`` of the model's
  profile on this instance: the operator's ``memory_plan`` split), its own admission watermark, and its
  own sequence limit (``EngineConfig.max_running``, vLLM's ``--max-num-seqs``) under the instance's one
  in-flight cap (``max_batch``, Chiron's batch size);
- admission of a ``Decision.run`` head-of-line per engine: an engine stops at its first request that does
  not fit; the others go on (``tessera.core.policy``'s module docstring);
- KV exhaustion handled per engine: that engine's paused KV goes first, then its running request that
  came last in the latest ``run``.

The engines share the accelerator's time in lockstep (CHOICE): an instance iteration is one step of every
busy engine and takes ``EngineConfig.coresident_cost.factor(busy)`` times the sum of their step times, so
every running request still gets one token per iteration and a run of decode iterations stays closed
form (``a = f·Σ_m (c0_m + c1_m·B_m + c2_m·ctx_m)``, ``g = f·Σ_m c2_m·B_m``). Prompts are prefilled in
mixed iterations as vLLM V1 schedules them (each engine: its decodes plus prompt chunks within its own
token budget, ``decode_step_m + p1_m·chunk_m``; an engine with prefill work only pays
``p0_m + p1_m·tokens``), whatever ``EngineConfig.chunked_prefill`` says: the engines of a pod are V1
processes. A ``Decision.load_model`` has nothing to do here (every model is loaded) and is ignored.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Mapping

from tessera.core.policy import Decision, InstanceView, ModelView, Policy, PreemptMode
from tessera.core.policy import kv_blocks as blocks_for
from tessera.core.profile import StepProfile
from tessera.core.request import Phase, Request
from tessera.sim.engine import EngineConfig, SimInstance, _Segment

_generated_of = operator.attrgetter("generated")


class CoResidentInstance(SimInstance):
    """A ``SimInstance`` of several resident engines sharing one accelerator (module docstring)."""

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
        if adapters:
            # Each engine's batch would need the slot rule and adapter cache of its own: not modelled.
            raise ValueError(
                f"instance {name}: LoRA adapters ({', '.join(adapters)}) on a co-resident instance of "
                "several base models are not simulated; give each base an instance of its own"
            )
        super().__init__(
            name, profiles, policy, config,
            role=role, created_at=created_at, ready_at=ready_at, on_finish=on_finish,
        )  # fmt: skip
        if len(self.profiles) < 2:
            raise ValueError(f"instance {self.name}: a co-resident instance serves two models or more")
        self.active_model = None  # type: ignore[assignment] - every model is loaded
        self.resident_models = list(self.profiles)
        self.engine_cap = {m: p.kv_capacity_tokens // p.block_size for m, p in self.profiles.items()}
        self.engine_used: dict[str, int] = dict.fromkeys(self.profiles, 0)  # KV blocks held, per engine
        self.engine_running: Counter[str] = Counter()  # requests in the batch, per engine
        # engine seconds each model's steps took (its share of the accelerator's time)
        self.engine_seconds: dict[str, float] = dict.fromkeys(self.profiles, 0.0)
        self._decoders: dict[str, list[Request]] = {}  # the planned decode run's batch, per engine

    # ---- capacity ---------------------------------------------------------------------------
    @property
    def capacity_blocks(self) -> int:
        """KV blocks of the first model's engine (what a router's prefix index is sized by)."""
        return self.engine_cap[next(iter(self.profiles))]

    def view(self, now: float) -> InstanceView:
        """The instance view with one ``ModelView`` per engine; top-level KV fields are their sums."""
        limit = self.config.max_running
        models = {
            m: ModelView(
                m,
                p,
                self.engine_cap[m] * p.block_size,
                self.engine_used[m] * p.block_size,
                self.engine_running[m],
                limit,
            )
            for m, p in self.profiles.items()
        }
        return InstanceView(
            now=now,
            instance=self.name,
            running=tuple(self.running),
            max_batch=self.max_batch,
            kv_capacity_tokens=sum(v.kv_capacity_tokens for v in models.values()),
            kv_used_tokens=sum(v.kv_used_tokens for v in models.values()),
            profile=self.profile,
            active_model=None,
            iteration=self.iterations,
            prefill_budget_tokens=None,
            swap_free_tokens=self._swap_room(),
            models=models,
        )

    # ---- decisions --------------------------------------------------------------------------
    def _decide(self, now: float, switched: bool = False) -> None:
        if now < self.ready_at:
            self.seg = _Segment("busy", now, self.ready_at)
            return
        if not len(self.policy):
            if self.running:
                raise RuntimeError(f"instance {self.name}: policy holds no request but some are running")
            return
        view = self.view(now)
        self.policy.observe(view)
        self._apply(self.policy.schedule(view), now)
        self._plan(now)

    def _apply(self, d: Decision, now: float) -> bool:
        """Keep, preempt and admit per engine; never busy loading (every model is resident)."""
        self._recheck_after = d.recheck_after_tokens
        self._recheck_at = d.recheck_at
        self._last_run = d.run
        run_ids = set(map(id, d.run))
        mode = d.preempt_mode or self.config.preempt_mode
        if not run_ids.issuperset(map(id, self.running)):
            for req in [r for r in self.running if id(r) not in run_ids]:
                self._preempt(req, mode, now, engine=False)
        if len(self.running) >= self.max_batch or len(run_ids) == len(self.running):
            return False
        limit = self.config.max_running
        watermark = self.config.watermark
        stopped: set[str] = set()  # engines at their head-of-line stop
        for req in d.run:
            if req.phase is Phase.RUNNING or req.phase is Phase.FINISHED:
                continue
            model = req.model
            if model in stopped or model not in self.profiles:
                continue
            if len(self.running) >= self.max_batch:
                break
            if limit is not None and self.engine_running[model] >= limit:
                stopped.add(model)
                continue
            context = req.prompt_tokens + req.generated
            if req.kv_resident:  # paused with KV kept: resumes at no cost
                self.paused_kv.remove(req)
                self._start(req, now, prefill=0)
                continue
            prof = self.profiles[model]
            cap = self.engine_cap[model]
            reserve = int(watermark * cap)
            need = blocks_for(context, prof.block_size)
            short = need + reserve - (cap - self.engine_used[model])
            if short > 0:
                if short > self._paused_blocks_of(model):
                    stopped.add(model)
                    continue
                while cap - self.engine_used[model] - need < reserve:  # this engine's paused KV gives way
                    self._preempt(self._latest_paused(model), "recompute", now, engine=True)
            self.engine_used[model] += need
            if req.swapped:
                self._overhead += prof.kv_swap_time(context)
                self.swap_used_tokens -= context
                req.swapped = False
                self._start(req, now, prefill=0)
                continue
            self.prefill_tokens_computed += context
            self._start(req, now, prefill=context)
        return False

    def _paused_blocks_of(self, model: str) -> int:
        block = self.profiles[model].block_size
        held = (r.prompt_tokens + r.generated for r in self.paused_kv if r.model == model)
        return sum(blocks_for(context, block) for context in held)

    def _latest_paused(self, model: str) -> Request:
        return next(r for r in reversed(self.paused_kv) if r.model == model)

    def _start(self, req: Request, now: float, prefill: int) -> None:
        super()._start(req, now, prefill)
        self.engine_running[req.model] += 1

    def _preempt(self, req: Request, mode: PreemptMode, now: float, *, engine: bool) -> None:
        """Take ``req`` out of its engine's batch (or drop the KV of a paused one)."""
        prof = self.profiles[req.model]
        context = req.prompt_tokens + req.generated
        if req in self._prefill_left:
            del self._prefill_left[req]
            mode = "recompute"
        else:
            req.tokens.detach()
        if req.phase is Phase.RUNNING:
            self.running.remove(req)
            self.engine_running[req.model] -= 1
            req.preemptions += 1
            self.preemptions += 1
        else:
            self.paused_kv.remove(req)
        req.phase = Phase.PREEMPTED
        if mode == "keep" and not engine:
            self.paused_kv.append(req)
            return
        self.engine_used[req.model] -= blocks_for(context, prof.block_size)
        req.kv_resident = False
        if mode == "swap" and req.generated > 0 and self._swap_room() >= context:
            self.swap_used_tokens += context
            self._overhead += prof.kv_swap_time(context)
            req.swapped = True
            req.swaps += 1
            self.kv_swaps += 1

    def _load_model(self, model: str, now: float) -> bool:
        return False  # every model's engine is resident

    # ---- planning ---------------------------------------------------------------------------
    def _plan(self, now: float) -> None:
        t0 = now + self._overhead
        self._overhead = 0.0
        cost = self.config.coresident_cost
        pl = self._prefill_left
        decoders: dict[str, list[Request]] = {}
        for r in self.running:
            if r not in pl:
                decoders.setdefault(r.model, []).append(r)
        if pl:  # one mixed iteration: each engine its decodes and prompt chunks within its own budget
            left = {m: self.config.budget - len(decoders.get(m, ())) for m in self.profiles}
            chunks: list[tuple[Request, int]] = []
            chunk_tokens: Counter[str] = Counter()
            for req, need in pl.items():
                m = req.model
                if left[m] <= 0:
                    continue
                take = min(need, left[m])
                chunks.append((req, take))
                chunk_tokens[m] += take
                left[m] -= take
            steps = {}
            for m in set(decoders) | set(chunk_tokens):
                prof = self.profiles[m]
                batch = decoders.get(m)
                if batch:
                    context = sum(r.prompt_tokens + r.generated for r in batch)
                    steps[m] = prof.decode_step(len(batch), context) + prof.prefill_p1 * chunk_tokens[m]
                else:
                    steps[m] = prof.prefill(chunk_tokens[m])
            f = cost.factor(len(steps))
            for m, step in steps.items():
                self.engine_seconds[m] += f * step
            dt = f * sum(steps.values())
            decoding = sum(map(len, decoders.values()))
            self.seg = _Segment("prefill", t0, t0 + dt, 1, decodes=decoding, chunks=tuple(chunks))
            return
        if not decoders:
            if self._recheck_at is not None and self._recheck_at > now:
                self.seg = _Segment("wait", now, self._recheck_at)
            return
        running = self.running
        k = min(map(operator.sub, map(self._target.__getitem__, running), map(_generated_of, running)))
        if self._recheck_after is not None:
            k = min(k, max(1, self._recheck_after))
        f = cost.factor(len(decoders))
        a = g = 0.0
        for m, batch in decoders.items():
            prof = self.profiles[m]
            context = sum(r.prompt_tokens + r.generated for r in batch)
            a += prof.decode_c0 + prof.decode_c1 * len(batch) + prof.decode_c2 * context
            g += prof.decode_c2 * len(batch)
            k = self._engine_kv_iterations(m, batch, k)
        seg = _Segment("decode", t0, 0.0, k, f * a, f * g)
        seg.end = t0 + k * seg.a + seg.g * k * (k - 1) / 2
        if self._recheck_at is not None and self._recheck_at < seg.end:
            seg.k = self._iterations_until(seg, self._recheck_at)
            seg.end = t0 + seg.k * seg.a + seg.g * seg.k * (seg.k - 1) / 2
        self._decoders = decoders
        self.seg = seg

    def _engine_kv_iterations(self, model: str, batch: list[Request], k: int) -> int:
        """``k`` capped at the decode iterations that fit in ``model``'s engine (``_kv_iterations``)."""
        free = self.engine_cap[model] - self.engine_used[model]
        block = self.profiles[model].block_size
        decoding = len(batch)
        if decoding * ((k - 1 + block - 1) // block) <= free:
            return k
        q, rem = divmod(free, decoding)
        us = sorted(((r.prompt_tokens + r.generated) % block for r in batch), reverse=True)
        return min(k, q * block + block - us[rem])

    # ---- commits ----------------------------------------------------------------------------
    def _commit_decode(self, seg: _Segment) -> None:
        k = seg.k
        self.iterations += k
        self.log.append_run(seg.t0 + seg.a, k, seg.a + seg.g, seg.g)
        # each engine's share of the run: its own steps' sum, scaled as the run was
        total = seg.end - seg.t0
        shares = {}
        for m, batch in self._decoders.items():
            prof = self.profiles[m]
            context = sum(r.prompt_tokens + r.generated for r in batch)
            shares[m] = k * (prof.decode_c0 + prof.decode_c1 * len(batch) + prof.decode_c2 * context) + (
                prof.decode_c2 * len(batch) * k * (k - 1) / 2
            )
        whole = sum(shares.values())
        for m, s in shares.items():
            self.engine_seconds[m] += total * s / whole if whole > 0 else 0.0
        target = self._target
        done = []
        used = dict.fromkeys(self.profiles, 0)
        for r in self.running:
            r.generated += k
            if r.generated >= target[r]:
                done.append(r)
            used[r.model] += (r.prompt_tokens + r.generated) // self.profiles[r.model].block_size + 1
        for r in self.paused_kv:
            used[r.model] += blocks_for(r.prompt_tokens + r.generated, self.profiles[r.model].block_size)
        self.engine_used = used
        for r in done:
            self._finish(r, seg.end)

    def _commit_prefill(self, seg: _Segment, now: float) -> None:
        self.iterations += 1
        done = []
        if seg.decodes:
            self.log.append_run(now, 1, 0.0, 0.0)
            for r in self.running:
                if r not in self._prefill_left:
                    self._advance_one(r, 0)
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
            req.tokens.append(now)
            self._advance_one(req, 0)
            req.tokens.attach(self.log)
            if req.generated >= self._target[req]:
                done.append(req)
        for r in done:
            self._finish(r, now)

    def _advance_one(self, r: Request, block: int) -> None:
        """One token for ``r`` in its own engine's blocks (``block`` is the single engine's; unused)."""
        size = self.profiles[r.model].block_size
        before = blocks_for(r.prompt_tokens + r.generated, size)
        r.generated += 1
        self.engine_used[r.model] += blocks_for(r.prompt_tokens + r.generated, size) - before

    def _release(self, r: Request) -> None:
        """A finished request gives back its blocks and its slot on its own engine."""
        block = self.profiles[r.model].block_size
        self.engine_used[r.model] -= blocks_for(r.prompt_tokens + r.generated, block)
        self.engine_running[r.model] -= 1

    def _enforce_kv(self, now: float) -> None:
        """Per engine: preempt until its resident requests' next steps fit (its paused KV first, then its
        running request latest in the policy's order)."""
        rank = None
        for model, cap in self.engine_cap.items():
            while self.engine_used[model] > cap:
                paused = next((r for r in reversed(self.paused_kv) if r.model == model), None)
                if paused is not None:
                    self._preempt(paused, "recompute", now, engine=True)
                    continue
                if rank is None:
                    rank = dict(zip(map(id, self._last_run), range(len(self._last_run)), strict=True))
                victim = max((r for r in self.running if r.model == model), key=lambda r: rank.get(id(r), -1))
                self._preempt(victim, self.config.preempt_mode, now, engine=True)

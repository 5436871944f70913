"""SeaLLM doubling-budget (DB) scheduling (SeaLLM §4.2, Alg. 2; see docs/papers.md).

Priority ``O_r = Q_r · L̂_s`` (smaller first), where ``Q_r`` is the execution-time budget the request
has left and ``L̂_s`` its service's mean isolated execution time. The initial budget is
``Q⁰_s = L̂_s + Var_s`` (Var_s: std of execution time); each decision charges running requests the wall
time since the previous decision (the iterations they took part in); at exhaustion the k-th renewal
grants ``2^k·Q⁰_s`` (flag ``doubling="constant"``: always ``2·Q⁰_s``), with no carry-over. A request
that has not run for longer than its service's starvation threshold (default ``0.5·SLO_s``) seeds the
next batch. Every batch holds one service: the seed's, filled in ``O`` order. Prefills are admitted
only into free KV (our eviction choice): a seed without KV that does not fit the free KV while others hold
some yields to the best request of its service holding KV (else of any service), whose progress frees
room; evicting resident requests for it would let requests whose priorities cross evict each other
without end. A request left out of the batch keeps its KV (``preempt_mode="keep"``, as Alg. 2 has it:
delay is the cost of a preemption; the engine drops paused KV, latest first, only when memory runs
short). With the engine's default, recompute, a chunked prefill iteration that outlasts every budget
made each decision rank fresh requests ahead of those just prefilled and drop their KV: 1000 short
requests at once on one instance, none finished within 180 s (arrival order: 17.5 s). On an instance
of several models (``InstanceView.active_model``) the decision loads the seed's model; the simulator's
shared-KV engine switches models keeping every request's KV.

On a co-resident instance (``InstanceView.models``: every model's engine resident with its own KV
share, running at the same time) the batch is not one service's (CHOICE): the seed comes first, then
the requests of every service in ``O`` order fill the instance's batch, each joining only into its own
engine's free KV and sequence limit. DB's order then decides which service's requests take the
instance's slots, and so its share of the accelerator's time; no model is loaded.

Class priority (``ServiceClass.priority``, higher first) breaks ties of ``O_r``, before arrival: fresh
requests of one service start with equal budgets, so among them the higher class is seeded and
batched first; among requests starved equally long, the higher class seeds. It never outweighs a
smaller ``O_r`` or a longer starvation. Round-robin sharing keeps vLLM's arrival order (no priority).

``RoundRobinSharing`` is SeaLLM's round-robin sharing baseline: the models of an instance take turns.
On a co-resident instance the turns are over the batch's slots (CHOICE): waiting requests join one
model at a time in turn, each in its model's arrival order and into its own engine's KV.

The same policies drive the worker and the simulator, which the planner's estimator runs
(``tessera.control.placement_sim``).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from tessera.core.policy import Decision, InstanceView, ModelView, Policy, engine_slots, kv_blocks
from tessera.core.registry import PolicySettings
from tessera.core.request import Phase, Request

Doubling = Literal["geometric", "constant"]
# A heap entry: (key, -class priority, arrival, request's sequence number, push number, request); the
# push number keeps two entries of one request apart so that no comparison reaches the request.
_Entry = tuple[float, int, float, int, int, Request]
PREFILL_WATERMARK = 0.01  # share of the KV pool admissions keep free (CHOICE; the engines' watermark)


@dataclass(frozen=True, slots=True)
class ServiceStats:
    """What DB needs of a service: mean and std of isolated execution time, and its starvation threshold."""

    mean_exec_s: float
    std_exec_s: float = 0.0
    starvation_s: float = math.inf

    def __post_init__(self) -> None:
        if self.mean_exec_s <= 0 or self.std_exec_s < 0 or self.starvation_s <= 0:
            raise ValueError(f"service stats need mean_exec_s > 0, std >= 0, starvation > 0; got {self}")

    @property
    def budget0(self) -> float:
        """Q⁰_s = L̂_s + Var_s."""
        return self.mean_exec_s + self.std_exec_s


@dataclass(slots=True)
class Budget:
    """A request's DB state."""

    left: float  # Q_r
    renewals: int  # k_r
    last_run: float  # end of its last iteration, or its arrival


class DBBook:
    """Budget bookkeeping of DB, independent of any engine (pure; time passed in)."""

    def __init__(self, stats: dict[str, ServiceStats], doubling: Doubling = "geometric") -> None:
        if doubling not in ("geometric", "constant"):
            raise ValueError(f"doubling must be 'geometric' or 'constant', got {doubling!r}")
        self.stats = stats
        self.doubling = doubling

    def start(self, service: str, arrival: float) -> Budget:
        """The budget of a new request."""
        return Budget(self.stats[service].budget0, 0, arrival)

    def priority(self, service: str, b: Budget) -> float:
        """O_r = Q_r · L̂_s."""
        return b.left * self.stats[service].mean_exec_s

    def charge(self, service: str, b: Budget, elapsed: float, now: float) -> None:
        """Subtract ``elapsed`` seconds of execution; renew a used-up budget (doubling)."""
        b.left -= elapsed
        b.last_run = now
        if b.left <= 1e-12:
            b.renewals += 1
            factor = 2.0**b.renewals if self.doubling == "geometric" else 2.0
            b.left = factor * self.stats[service].budget0

    def starved(self, service: str, b: Budget, now: float) -> bool:
        """Whether the request has waited longer than its service's starvation threshold."""
        return now - b.last_run > self.stats[service].starvation_s


class ServiceStatsSettings(PolicySettings):
    """One service's execution-time statistics, as configured."""

    mean_exec_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        description="Mean isolated execution time of a request, seconds."
    )
    std_exec_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = Field(
        default=0.0, description="Standard deviation of that time, seconds."
    )
    starvation_s: Annotated[float, Field(gt=0)] = Field(
        default=math.inf, description="Seconds without running after which a request seeds the next batch."
    )


class SeaLLMSettings(PolicySettings):
    """Settings of ``seallm``. The constant-renewal variant (``doubling="constant"``) is a research
    ablation, a constructor keyword only."""

    services: dict[str, ServiceStatsSettings] = Field(
        default_factory=dict, description="Execution-time statistics by model name."
    )
    default_exec_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=10.0, description="Mean execution time, seconds, of a model without statistics."
    )

    def policy_kwargs(self) -> dict[str, Any]:
        """The constructor keywords, each service's statistics as ``ServiceStats``."""
        services = {
            m: ServiceStats(s.mean_exec_s, s.std_exec_s, s.starvation_s) for m, s in self.services.items()
        }
        return {"services": services, "default_exec_s": self.default_exec_s}


class RoundRobinSharingSettings(PolicySettings):
    """Settings of ``round-robin-sharing``."""

    turn_tokens: Annotated[int, Field(ge=1)] = Field(
        default=8, description="Decode iterations of one model's turn before the next model's."
    )


class DoublingBudget(Policy):
    """SeaLLM's DB rule as a worker policy (one service per batch; preemptive at decision points).

    ``services`` maps a request's model to its ServiceStats; a model without stats uses
    ``default_exec_s`` (and no starvation threshold)."""

    name: ClassVar[str] = "seallm"

    def __init__(
        self,
        services: dict[str, ServiceStats] | None = None,
        *,
        doubling: Doubling = "geometric",
        default_exec_s: float = 10.0,
    ) -> None:
        stats = dict(services or {})
        self._default = ServiceStats(default_exec_s)
        self.book = DBBook(stats, doubling)
        self._held: dict[Request, Budget] = {}
        self._last_now: float | None = None
        self._running: set[Request] = set()
        self._blocks: dict[str, int] = {}  # KV block size of each model seen active (shared-KV instances)
        # Incremental order (a decision costs about O(batch + changes · log n), not O(n), with thousands
        # held): per model, a heap by O order (O_r, -class priority, arrival, seq) and one by starvation
        # order (last run, -class priority, arrival, seq) of the requests not in the last decision's
        # batch; the batch's members (whose budgets are charged at every decision) are looked at
        # directly. A request leaving the batch is pushed with its new keys; entries whose key no
        # longer matches, or whose request is in the batch, are skipped when met.
        self._seq: dict[Request, int] = {}
        self._counter = itertools.count()
        self._by_o: dict[str, list[_Entry]] = {}
        self._by_wait: dict[str, list[_Entry]] = {}
        self._entries = 0  # heap entries, live or stale (compaction bound)

    def _service(self, req: Request) -> str:
        if req.model not in self.book.stats:
            self.book.stats[req.model] = self._default
        return req.model

    def add(self, req: Request, now: float) -> None:
        """A new request gets its initial budget Q⁰."""
        budget = self.book.start(self._service(req), req.arrival)
        self._held[req] = budget
        req.annotations["db_budget"] = budget
        self._seq[req] = next(self._counter)
        self._push(req, budget)

    def remove(self, req: Request, now: float) -> None:
        """Forget a finished or cancelled request."""
        self._held.pop(req, None)
        self._seq.pop(req, None)
        self._running.discard(req)

    def _o_key(self, req: Request, b: Budget) -> _Entry:
        o = self.book.priority(req.model, b)
        return (o, -req.service_class.priority, req.arrival, self._seq[req], next(self._counter), req)

    def _wait_key(self, req: Request, b: Budget) -> _Entry:
        return (
            b.last_run,
            -req.service_class.priority,
            req.arrival,
            self._seq[req],
            next(self._counter),
            req,
        )

    def _push(self, req: Request, b: Budget) -> None:
        heapq.heappush(self._by_o.setdefault(req.model, []), self._o_key(req, b))
        heapq.heappush(self._by_wait.setdefault(req.model, []), self._wait_key(req, b))
        self._entries += 2
        if self._entries > 4 * len(self._held) + 64:
            self._compact()

    def _compact(self) -> None:
        """Rebuild the heaps from the live requests (drops stale entries)."""
        self._by_o = {}
        self._by_wait = {}
        for r, b in self._held.items():
            if r in self._running:
                continue
            self._by_o.setdefault(r.model, []).append(self._o_key(r, b))
            self._by_wait.setdefault(r.model, []).append(self._wait_key(r, b))
        for heap in (*self._by_o.values(), *self._by_wait.values()):
            heapq.heapify(heap)
        self._entries = 2 * (len(self._held) - len(self._running))

    def _set_running(self, run: set[Request]) -> None:
        """The new batch; requests leaving it go back to the heaps with their current keys."""
        leaving, self._running = self._running - run, run  # first: a compaction rebuilds from it
        for r in leaving:
            b = self._held.get(r)
            if b is not None:
                self._push(r, b)

    def _live_o(self, entry: _Entry) -> bool:
        b = self._held.get(entry[-1])
        return (
            b is not None
            and self._seq[entry[-1]] == entry[3]
            and entry[-1] not in self._running
            and self.book.priority(entry[-1].model, b) == entry[0]
        )

    def _live_wait(self, entry: _Entry) -> bool:
        b = self._held.get(entry[-1])
        return (
            b is not None
            and self._seq[entry[-1]] == entry[3]
            and entry[-1] not in self._running
            and b.last_run == entry[0]
        )

    @staticmethod
    def _top(heap: list[_Entry], live: Any) -> _Entry | None:
        """The heap's least live entry (stale ones popped on the way)."""
        while heap and not live(heap[0]):
            heapq.heappop(heap)
        return heap[0] if heap else None

    def _smallest(self, model: str, k: int, skip: Request) -> list[Request]:
        """The ``k`` live requests of ``model`` first in O order, ``skip`` left out."""
        heap = self._by_o.get(model, [])
        taken: list[_Entry] = []
        seen: set[int] = set()
        while heap and len(taken) < k + 1:
            entry = heapq.heappop(heap)
            if self._live_o(entry) and entry[3] not in seen:
                seen.add(entry[3])
                taken.append(entry)
        for entry in taken:
            heapq.heappush(heap, entry)
        taken += [
            self._o_key(r, self._held[r]) for r in self._running if r.model == model and r in self._held
        ]
        taken.sort(key=lambda e: e[:4])
        return [e[-1] for e in taken if e[-1] is not skip][:k]

    def _fill(self, view: InstanceView, seed: Request, block: int) -> list[Request]:
        """The rest of the seed's batch: its service's requests in O order up to ``max_batch``, where a
        request without KV joins only into the free KV left by the admissions before it, and the
        running requests of the service keep their places otherwise. Leaving a running request out
        preempts it (recompute): a request whose budget ran out mid-prefill would lose its prompt's KV
        to a fresh one, whose budget then runs out in turn (module docstring: no eviction for an
        admission)."""
        room = view.max_batch - 1
        if room <= 0:
            return []
        run: list[Request] = []
        taken = 0 if seed.kv_resident else kv_blocks(seed.context_tokens, block)
        # The services batched with the seed's: its own, and the other adapters of its engine (LoRA
        # adapters share their base's batch; CHOICE: merged in O order as co-resident services are).
        engine = view.engine_of(seed.model)
        services = [seed.model]
        if view.adapter_of:
            services += [m for m in self._by_o if m != seed.model and view.engine_of(m) == engine]
        if len(services) == 1:
            candidates = self._smallest(seed.model, room, seed)
        else:
            keyed = [
                (self._o_key(r, self._held[r])[:4], r)
                for m in services
                for r in self._smallest(m, room, seed)
            ]
            keyed.sort(key=lambda c: c[0])
            candidates = [r for _, r in keyed]
        for r in candidates:
            if len(run) >= room:
                break
            if r.kv_resident:
                run.append(r)
            elif fits_free_kv(view, r, block, taken):
                run.append(r)
                taken += kv_blocks(r.context_tokens, block)
        chosen = {*run, seed}
        kept = [r for r in view.running if r.model in services and r not in chosen]
        return run + kept[: max(0, room - len(run))]

    def _fill_co_resident(self, view: InstanceView, seed: Request) -> list[Request]:
        """The rest of a co-resident instance's batch: every service's requests in O order up to
        ``max_batch``, each into its own engine's free KV and sequence limit (running requests keep
        their places otherwise, as in ``_fill``)."""
        room = view.max_batch - 1
        if room <= 0:
            return []
        engines = view.models
        taken = dict.fromkeys(engines, 0)
        slots = engine_slots(view, [seed])
        own = view.engine_of(seed.model)
        if own in engines and not seed.kv_resident:
            taken[own] = kv_blocks(seed.context_tokens, engines[own].profile.block_size)
        services = [m for m in self._by_o if view.engine_of(m) in engines]  # adapters ride their base's
        candidates = [
            (self._o_key(r, self._held[r])[:4], r) for m in services for r in self._smallest(m, room, seed)
        ]
        candidates.sort(key=lambda c: c[0])
        run: list[Request] = []
        for _, r in candidates:
            if len(run) >= room:
                break
            engine = view.engine_of(r.model)
            if slots[engine] <= 0:
                continue
            block = engines[engine].profile.block_size
            if not r.kv_resident:
                if not fits_engine_kv(engines[engine], r, taken[engine]):
                    continue
                taken[engine] += kv_blocks(r.context_tokens, block)
            slots[engine] -= 1
            run.append(r)
        chosen = {*run, seed}
        kept = [r for r in view.running if r not in chosen]
        return run + kept[: max(0, room - len(run))]

    def __len__(self) -> int:
        return len(self._held)

    def schedule(self, view: InstanceView) -> Decision:
        """Charge what ran since the last decision, then pick the seed and its service's batch."""
        now = view.now
        if self._last_now is not None:
            elapsed = max(0.0, now - self._last_now)
            for req in view.running:
                b = self._held.get(req)
                if b is not None:
                    self.book.charge(req.model, b, elapsed, now)
                    if req not in self._running:  # the batch's members are looked at directly
                        self._push(req, b)
        self._last_now = now
        if not self._held:
            self._set_running(set())
            return Decision(run=[])
        # The O seed and the starved seed, from each model's heap tops.
        best: _Entry | None = None
        starved: _Entry | None = None
        for model, heap in self._by_o.items():
            top = self._top(heap, self._live_o)
            if top is not None and (best is None or top[:4] < best[:4]):
                best = top
            oldest = self._top(self._by_wait[model], self._live_wait)
            # Longest wait first (earliest last run), then class priority, arrival, arrival order.
            waited = oldest is not None and self.book.starved(model, self._held[oldest[-1]], now)
            if waited and (starved is None or oldest[:4] < starved[:4]):
                starved = oldest
        for r in self._running:
            b = self._held.get(r)
            if b is None:
                continue
            key = self._o_key(r, b)
            if best is None or key[:4] < best[:4]:
                best = key
            if self.book.starved(r.model, b, now):
                wait_key = self._wait_key(r, b)
                if starved is None or wait_key[:4] < starved[:4]:
                    starved = wait_key
        assert best is not None
        seed = starved[-1] if starved is not None else best[-1]
        if view.active_model is not None:
            self._blocks[view.active_model] = view.profile.block_size
        engine = view.engine_of(seed.model)
        block = self._blocks.get(engine) if view.active_model is not None else view.profile.block_size
        if not seed.kv_resident and block is None:
            return Decision(run=[], load_model=engine)  # learn its model's KV block first
        if not seed.kv_resident and not _fits(view, seed, block or view.profile.block_size):
            holding = [self._o_key(r, b) for r, b in self._held.items() if r.kv_resident]
            if holding:
                own = [e for e in holding if e[-1].model == seed.model] or holding
                seed = min(own, key=lambda e: e[:4])[-1]
        if view.models:
            run = [seed, *self._fill_co_resident(view, seed)]
        else:
            run = [seed, *self._fill(view, seed, block or view.profile.block_size)]
        self._set_running(set(run))
        # Re-decide when the first running budget runs out, so demotion happens exactly at exhaustion.
        soonest = min(self._held[r].left for r in run)
        return Decision(
            run=run, recheck_at=now + soonest, load_model=_switch(view, seed.model), preempt_mode="keep"
        )


def fits_free_kv(view: InstanceView, req: Request, block: int, taken: int = 0) -> bool:
    """Whether ``req``'s prompt and progress, in blocks of ``block`` tokens of its model, fit the free
    KV now, less ``taken`` blocks promised to admissions before it, keeping the admission watermark
    free, as the engine counts them (on a shared-KV instance a block holds the same bytes for every
    model)."""
    active = view.profile.block_size
    capacity = view.kv_capacity_tokens // active
    free = capacity - view.kv_used_tokens // active - taken
    return free - kv_blocks(req.context_tokens, block) >= int(PREFILL_WATERMARK * capacity)


def fits_engine_kv(engine: ModelView, req: Request, taken: int = 0) -> bool:
    """``fits_free_kv`` on one engine of a co-resident instance: its own KV share and block size."""
    block = engine.profile.block_size
    capacity = engine.kv_capacity_tokens // block
    free = capacity - engine.kv_used_tokens // block - taken
    return free - kv_blocks(req.context_tokens, block) >= int(PREFILL_WATERMARK * capacity)


def _fits(view: InstanceView, req: Request, block: int) -> bool:
    """Whether ``req`` fits the free KV of the engine it would run on."""
    engine = view.models.get(view.engine_of(req.model))
    if engine is not None:
        return fits_engine_kv(engine, req)
    return fits_free_kv(view, req, block)


def _switch(view: InstanceView, model: str) -> str | None:
    """The model to load before running ``model``'s requests (None when it is active or the instance
    serves one model)."""
    engine = view.engine_of(model)  # an adapter's engine is its base's
    return engine if view.active_model is not None and engine != view.active_model else None


class RoundRobinSharing(Policy):
    """Round-robin sharing (SeaLLM's baseline): the models of an instance take turns, one prefill or
    at most ``turn_tokens`` decode iterations each; inside a turn vLLM's order (running requests, then
    waiting ones in arrival order). A model whose oldest waiting request does not fit the free KV while
    it holds none skips its turn (as DB, prefills only into free KV: turns that evict each other's KV
    would recompute long prompts without end). Requests holding KV run first, then waiting ones."""

    name: ClassVar[str] = "round-robin-sharing"

    def __init__(self, turn_tokens: int = 8) -> None:
        if turn_tokens < 1:
            raise ValueError(f"turn_tokens must be >= 1, got {turn_tokens}")
        self.turn_tokens = turn_tokens
        self._queues: dict[str, dict[Request, None]] = {}  # model -> its requests in arrival order
        self._turn = 0

    def add(self, req: Request, now: float) -> None:
        """Queue ``req`` behind its model's other requests."""
        self._queues.setdefault(req.model, {})[req] = None

    def remove(self, req: Request, now: float) -> None:
        """Forget a finished or cancelled request."""
        self._queues.get(req.model, {}).pop(req, None)

    def __len__(self) -> int:
        return sum(map(len, self._queues.values()))

    def schedule(self, view: InstanceView) -> Decision:
        """The next model with requests takes its turn."""
        models = [m for m, q in self._queues.items() if q]
        if not models:
            return Decision(run=[])
        if view.models:
            return self._slot_turns(view, models)
        start = self._turn % len(models)
        for model in models[start:] + models[:start]:
            queue = self._queues[model]
            if view.kv_used_tokens and not any(r.kv_resident for r in queue):
                if _switch(view, model) is not None:
                    break  # whether its prefill fits is known in its own model's KV units
                if not fits_free_kv(view, next(iter(queue)), view.profile.block_size):
                    continue
            break
        else:
            model = models[start]
        load = _switch(view, model)
        if load is not None:
            self._turn = models.index(model)  # its turn starts once it is loaded
            return Decision(run=[], load_model=load)
        self._turn = models.index(model) + 1
        queue = self._queues[model]
        resident = [r for r in view.running if r.model == model]
        resident += [r for r in queue if r.kv_resident and r.phase is not Phase.RUNNING]
        waiting = (r for r in queue if not r.kv_resident)
        run = resident + list(itertools.islice(waiting, max(0, view.max_batch - len(resident))))
        return Decision(run=run, recheck_after_tokens=self.turn_tokens)

    def _slot_turns(self, view: InstanceView, models: list[str]) -> Decision:
        """Co-resident turns: running requests keep their slots; waiting ones join one model at a
        time, starting after the model that started first last time, each into its engine's KV."""
        engines = view.models
        run = list(view.running)
        slots = engine_slots(view, run)
        taken = dict.fromkeys(engines, 0)
        start = self._turn % len(models)
        order = [m for m in models[start:] + models[:start] if view.engine_of(m) in engines]
        waiting = {m: (r for r in self._queues[m] if r.phase is not Phase.RUNNING) for m in order}
        first: str | None = None
        while order and len(run) < view.max_batch:
            for model in list(order):
                req = next(waiting[model], None)
                key = view.engine_of(model)
                engine = engines[key]
                if req is None or slots[key] <= 0:
                    order.remove(model)
                    continue
                if not req.kv_resident:
                    if not fits_engine_kv(engine, req, taken[key]):
                        order.remove(model)  # head-of-line, per engine
                        continue
                    taken[key] += kv_blocks(req.context_tokens, engine.profile.block_size)
                slots[key] -= 1
                run.append(req)
                first = first or model
                if len(run) >= view.max_batch:
                    break
        if first is not None:
            self._turn = models.index(first) + 1
        return Decision(run=run)

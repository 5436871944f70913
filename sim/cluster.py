"""A simulated cluster: engine instances, a router, an optional controller.

The event loop merges three streams in time order: request arrivals (routed at
arrival), instance segment ends (a heap keyed by each instance's next event
time) and controller ticks every ``interval_s``. Cost grows with events.

Extension points (other engineers build on these):

- ``ClusterRouter``: ``route(req, view) -> SimInstance``. QLM's global scheduler assigns
  requests to instance queues by subclassing it. A router may return ``None`` to
  hold the request in the cluster's global queue (``ClusterView.held``); a
  controller hands it to an instance later with ``Dispatch`` (Chiron's batch queue).
- ``ClusterController``: ``tick(view) -> list[ClusterAction]`` every ``interval_s`` of simulated
  time, given a ``ClusterView`` it must not mutate. Actions add instances (ready
  after the profile's cold start), drain or remove instances, set an instance's
  max batch or role (Chiron's autoscalers).
"""

from __future__ import annotations

import heapq
import itertools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tessera.core.lora import adapter_sets
from tessera.core.policy import Policy
from tessera.core.prefix import PrefixIndex
from tessera.core.profile import StepProfile
from tessera.core.request import Phase, Request
from tessera.core.routing import (
    PREFIX_ROUTES,
    ROUTES,
    InstanceLoad,
    PrefillQueue,
    RouteRequest,
    make_route,
    seed_stats,
    uses_engine_blocks,
)
from tessera.sim.coresident import CoResidentInstance
from tessera.sim.engine import EngineConfig, SimInstance

INF = float("inf")
MAX_IDLE_TICKS = 10_000  # controller ticks with only held requests left before the run is declared stalled

PolicyFactory = Callable[[], Policy]


class SimulationStalled(RuntimeError):
    """A real deadlock: requests are left that nothing will ever serve (the message says which)."""


class Unservable(LookupError):
    """A router's answer for a request no instance can ever serve (its KV fits none): the cluster
    drops it and counts it in ``Cluster.rejected``, as vLLM refuses a prompt its KV cache cannot hold."""


@dataclass(frozen=True, slots=True)
class ClusterView:
    """What routers and controllers see (live objects: read, never mutate)."""

    now: float
    instances: Sequence[SimInstance]  # alive (not retired), in creation order
    waiting_arrivals: int = 0  # requests not yet arrived
    held: Collection[Request] = ()  # requests a router held in the global queue, in arrival order

    def serving(self, model: str) -> list[SimInstance]:
        """Instances that can serve ``model`` (an adapter: those of its base) and accept new requests
        (ready or warming up)."""
        return [i for i in self.instances if not i.draining and model in i.profiles]


class ClusterRouter(ABC):
    """Chooses the instance for each arriving request."""

    name: str = "router"

    @abstractmethod
    def route(self, req: Request, view: ClusterView) -> SimInstance | None:
        """The instance ``req`` goes to (one of ``view.serving(req.model)``), or None to hold it in the
        global queue until a controller dispatches it."""


class RouteRouter(ClusterRouter):
    """A core route (``tessera.core.routing``: filters, scorers, a picker) over the simulated instances:
    the live router composes its routing from the same plugins. A cache-aware route keeps the same
    kind of prefix index the live router keeps: where it sent each prompt's blocks (the requests'
    ``prefix_blocks``), not what the engines hold, and the prefill it sent each instance
    (``PrefillQueue``: the prompt tokens it expected to miss the cache, until their first token), as
    the live router's relay does. A route that reads what the engines report holding
    (``precise-prefix``) reads each instance's own prefix cache: what a live engine's KV events would
    have told the router, without their delay."""

    def __init__(self, route: str, **settings: Any) -> None:
        """``settings``: scorer settings by scorer name (``make_route``'s overrides)."""
        self.name = route
        self.rule = make_route(route, **settings)
        self.uses_prefix = route in PREFIX_ROUTES
        self.uses_engine = uses_engine_blocks(ROUTES[route])
        self.stats = seed_stats()  # the live router's seed statistics (it refines them from answers)
        self._index: PrefixIndex | None = None
        self._prefill: dict[str, PrefillQueue] = {}  # instance -> the prefill sent there
        self._sent: dict[str, dict[Request, int]] = {}  # instance -> requests without a first token -> tokens
        self._last_model: dict[str, str] = {}  # instance -> the model of the latest request sent there

    def route(self, req: Request, view: ClusterView) -> SimInstance:
        """The instance the core route picks among those serving ``req``'s model."""
        cands = view.serving(req.model)
        if not cands:
            raise RuntimeError(f"no instance serves model {req.model!r} (request {req.id})")
        loads = [
            InstanceLoad(i.name, req.model, i.role, i.profiles[req.model], i.max_batch,
                         i.assigned_by_model[req.model], True, i.ready_at,
                         self._prefill_ahead(i.name) if self.uses_prefix else PrefillQueue(),
                         other_outstanding=i.outstanding - i.assigned_by_model[req.model],
                         last_model=self._last_model.get(i.name),
                         same_engine_outstanding=_same_engine(i, req.model), **_adapter_load(i, req.model))
            for i in cands
        ]  # fmt: skip
        route_req = RouteRequest(req.model, req.service_class.kind, self.stats, view.now,
                                 ttft_slo_s=req.service_class.ttft_slo_s)  # fmt: skip
        blocks = req.prefix_blocks if self.uses_prefix and req.prefix_block_tokens else ()
        if blocks:
            index = self._prefix_index(cands[0], req.prefix_block_tokens)
            matched = index.matched(blocks, (i.name for i in cands))
            cached = {n: min(m * req.prefix_block_tokens, req.prompt_tokens - 1) for n, m in matched.items()}
            route_req = replace(route_req, prompt_tokens=req.prompt_tokens, cached_tokens=cached)
            if self.uses_engine:
                size, most = req.prefix_block_tokens, req.prompt_tokens - 1
                held = {i.name: min(i.held_prefix_blocks(blocks) * size, most) for i in cands}
                route_req = replace(route_req, engine_cached_tokens=held)
        chosen = self.rule.pick(route_req, loads)
        picked = next(i for i, x in zip(cands, loads, strict=True) if x is chosen)
        self._last_model[chosen.instance] = picked.engine_of(req.model)  # an adapter's is its base's
        if self.uses_prefix:
            tokens = max(0, req.prompt_tokens - route_req.cached_tokens.get(chosen.instance, 0))
            chosen.prefill.sent(tokens, view.now, chosen.profile)
            self._sent.setdefault(chosen.instance, {})[req] = tokens
        if blocks:
            full = blocks[: req.prompt_tokens // req.prefix_block_tokens]
            self._prefix_index(cands[0], req.prefix_block_tokens).record(chosen.instance, full, view.now)
        return picked

    def _prefill_ahead(self, instance: str) -> PrefillQueue:
        """The prefill sent to ``instance``, less the requests that have had their first token since
        (the live router learns it from the token chunks it relays)."""
        queue = self._prefill.setdefault(instance, PrefillQueue())
        sent = self._sent.get(instance)
        if sent:
            for r in [r for r in sent if r.first_token_at is not None]:
                queue.first_token(sent.pop(r))
        return queue

    def _prefix_index(self, inst: SimInstance, block_tokens: int) -> PrefixIndex:
        if self._index is None:
            self._index = PrefixIndex(max(1, inst.capacity_blocks * inst.profile.block_size // block_tokens))
        return self._index


def _same_engine(inst: SimInstance, model: str) -> int:
    """Requests on ``inst`` of the other models of ``model``'s engine (its base and the base's adapters)."""
    if not inst.adapter_of:
        return 0
    engine = inst.engine_of(model)
    return sum(n for m, n in inst.assigned_by_model.items() if m != model and inst.engine_of(m) == engine)


def _adapter_load(inst: SimInstance, model: str) -> dict[str, object]:
    """``InstanceLoad``'s adapter fields of ``model`` on ``inst`` (none for a full model): its base, the
    adapters in the engine's batch and of its waiting requests (``adapter_sets``: what vLLM reports to
    the live router) and the engine's GPU slots."""
    base = inst.adapter_of.get(model)
    if base is None:
        return {}
    waiting = (r for r in inst.assigned if not r.kv_resident and r.phase is not Phase.RUNNING)
    resident, queued = adapter_sets(inst.running, waiting, inst.adapter_of)
    return {"adapter_of": base, "resident_adapters": resident, "waiting_adapters": queued,
            "adapter_slots": inst.max_loras}  # fmt: skip


def make_router(name: str) -> ClusterRouter:
    """A router by route name (``tessera.core.routing.ROUTES``); ValueError naming the known ones."""
    if name not in ROUTES:
        raise ValueError(f"unknown router {name!r}; known routers: {', '.join(ROUTES)}")
    return RouteRouter(name)


# ---- controller actions -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AddInstance:
    """Start a new instance; it is ready after the cold start of its first model's profile."""

    role: str = "default"
    models: tuple[str, ...] | None = None  # None: the cluster's models
    max_batch: int | None = None
    profiles: Mapping[str, StepProfile] | None = None  # the models' profiles here; None: the cluster's
    policy: PolicyFactory | None = None  # this instance's policy (its pod's); None: the cluster's


@dataclass(frozen=True, slots=True)
class DrainInstance:
    """Stop routing to the instance; it retires when its last request finishes."""

    name: str


@dataclass(frozen=True, slots=True)
class RemoveInstance:
    """Retire the instance now; its unfinished requests are routed again (progress kept, KV lost)."""

    name: str


@dataclass(frozen=True, slots=True)
class SetRole:
    """Change an instance's role label (routers may use it)."""

    name: str
    role: str


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Hand a request held in the global queue to an instance."""

    request: Request
    name: str


ClusterAction = AddInstance | DrainInstance | RemoveInstance | SetRole | Dispatch


class ClusterController(ABC):
    """Periodic cluster-level decisions (autoscalers)."""

    interval_s: float = 10.0

    @abstractmethod
    def tick(self, view: ClusterView) -> list[ClusterAction]:
        """Actions to apply now."""


@dataclass(slots=True)
class ClusterConfig:
    """How to build a cluster."""

    profiles: dict[str, StepProfile]  # model -> profile
    instances: int = 1
    engine: EngineConfig = field(default_factory=EngineConfig)
    router: str = "least-loaded"
    role: str = "default"
    # LoRA adapters: adapter -> its base (a model of ``profiles``); every instance of a base serves its
    # adapters on the base's engine (``tessera.sim.engine``'s module docstring)
    adapters: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.instances < 0:
            raise ValueError(f"instances must be >= 0, got {self.instances}")
        if not self.profiles:
            raise ValueError("a cluster needs at least one model profile")
        bad = [a for a, b in self.adapters.items() if b not in self.profiles or a in self.profiles]
        if bad:
            raise ValueError(
                f"adapters {', '.join(bad)}: each needs a base among the cluster's models "
                f"({', '.join(self.profiles)}) and a name that is not one of them"
            )


@dataclass(slots=True)
class ClusterResult:
    """What a simulation produced besides the requests' own state."""

    requests: list[Request]
    gpu_seconds: float
    makespan_s: float  # first arrival to last completion
    model_swaps: int
    kv_swaps: int
    preemptions: int
    iterations: int
    wall_s: float
    cpu_s: float  # CPU time of this process (wall_s includes waiting for a busy machine's cores)
    events: int
    instance_log: list[tuple[float, str, str]]  # (time, instance, what happened)
    adapter_loads: int = 0  # LoRA adapters the engines loaded (their adapter caches' misses)


class Cluster:
    """Many instances, a router and an optional controller, driven by one event loop."""

    def __init__(
        self,
        config: ClusterConfig,
        policy_factory: PolicyFactory,
        *,
        router: ClusterRouter | None = None,
        controller: ClusterController | None = None,
    ) -> None:
        self.config = config
        self.policy_factory = policy_factory
        self.router = router or make_router(config.router)
        self.controller = controller
        self.instances: list[SimInstance] = []
        self.retired: list[SimInstance] = []
        self.now = 0.0
        self._heap: list[tuple[float, int, SimInstance]] = []
        self._seq = itertools.count()
        self._names = itertools.count()
        self._pending: list[Request] = []  # removed instances' requests to route again
        self._held: dict[Request, None] = {}  # the global queue: requests a router held, in order
        self.rejected: list[Request] = []  # requests a router found unservable (never served)
        self.log: list[tuple[float, str, str]] = []
        for _ in range(config.instances):
            self.add_instance(role=config.role, cold=False)

    def view(self) -> ClusterView:
        """The current read-only view."""
        return ClusterView(self.now, self.instances, held=self._held.keys())

    def add_instance(
        self,
        role: str = "default",
        models: Sequence[str] | None = None,
        max_batch: int | None = None,
        *,
        cold: bool = True,
        profiles: Mapping[str, StepProfile] | None = None,
        policy: PolicyFactory | None = None,
        engine: EngineConfig | None = None,
    ) -> SimInstance:
        """Create an instance now; with ``cold`` it is ready after its profile's cold start.
        ``profiles`` replaces the cluster's profiles of these models on this instance (its own
        tensor-parallel degree or KV pool); ``policy`` the cluster's policy factory (the policy its
        pod runs); ``engine`` the cluster's engine settings (its own adapter slots)."""
        engine = engine or self.config.engine
        known = self.config.profiles if profiles is None else profiles
        of = self.config.adapters
        # an adapter is served by its base's instance
        names = list(dict.fromkeys(of.get(m, m) for m in models)) if models is not None else list(known)
        unknown = [m for m in names if m not in known]
        if unknown or not names:
            raise ValueError(f"cannot add an instance for models {names}; known: {list(known)}")
        profiles = {m: known[m] for m in names}
        first = profiles[names[0]]
        kind = CoResidentInstance if engine.co_resident and len(profiles) > 1 else SimInstance
        inst = kind(
            f"i{next(self._names)}",
            profiles,
            (policy or self.policy_factory)(),
            engine,
            role=role,
            created_at=self.now,
            ready_at=self.now + (first.cold_start_s if cold else 0.0),
            adapters={a: b for a, b in of.items() if b in profiles},
        )
        if max_batch is not None:
            inst.max_batch = max_batch
        self.instances.append(inst)
        self.log.append((self.now, inst.name, f"add role={role}"))
        self._reschedule(inst)
        return inst

    def _reschedule(self, inst: SimInstance) -> None:
        t = inst.next_time
        if t < INF:
            seq = next(self._seq)
            inst.heap_seq = seq  # older entries of this instance are stale
            heapq.heappush(self._heap, (t, seq, inst))

    def _retire(self, inst: SimInstance) -> None:
        inst.retired_at = self.now
        inst.heap_seq = -1
        self.instances.remove(inst)
        self.retired.append(inst)
        self.log.append((self.now, inst.name, "retire"))

    def _find(self, name: str) -> SimInstance:
        for inst in self.instances:
            if inst.name == name:
                return inst
        raise ValueError(f"controller named unknown instance {name!r}")

    def apply(self, actions: Sequence[ClusterAction]) -> None:
        """Apply controller actions at the current time."""
        for act in actions:
            if isinstance(act, AddInstance):
                self.add_instance(
                    act.role, act.models, act.max_batch, profiles=act.profiles, policy=act.policy
                )
            elif isinstance(act, DrainInstance):
                inst = self._find(act.name)
                inst.draining = True
                self.log.append((self.now, inst.name, "drain"))
                if not inst.outstanding:
                    self._retire(inst)
            elif isinstance(act, RemoveInstance):
                inst = self._find(act.name)
                self._pending.extend(inst.take_all(self.now))
                self._retire(inst)
            elif isinstance(act, SetRole):
                self._find(act.name).role = act.role
            elif isinstance(act, Dispatch):
                if act.request not in self._held:
                    raise ValueError(f"controller dispatched request {act.request.id}, which is not held")
                inst = self._find(act.name)
                del self._held[act.request]
                inst.add(act.request, self.now)
                self._reschedule(inst)
            else:
                raise TypeError(f"unknown controller action {act!r}")
        if self._pending:
            pending, self._pending = self._pending, []
            for req in pending:
                self._route(req)

    def _stall_message(self) -> str:
        """What a run stalled on held requests holds, and what could have served them."""
        kinds: dict[str, int] = {}
        for req in self._held:
            kinds[req.service_class.kind] = kinds.get(req.service_class.kind, 0) + 1
        roles: dict[str, int] = {}
        for inst in self.instances:
            roles[inst.role] = roles.get(inst.role, 0) + 1
        held = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
        alive = ", ".join(f"{n} {role}" for role, n in sorted(roles.items())) or "none"
        stuck = ", ".join(f"{i.name} ({i.outstanding})" for i in self.instances if i.outstanding) or "none"
        return (
            f"simulation stalled at t={self.now:.3f}s: {len(self._held)} requests held in the global queue "
            f"({held}), unfinished requests on instances that take no step: {stuck}; the controller moved "
            f"none for {MAX_IDLE_TICKS} ticks (instances: {alive})"
        )

    def _route(self, req: Request) -> None:
        try:
            inst = self.router.route(req, self.view())
        except Unservable:
            self.rejected.append(req)
            return
        if inst is None:
            self._held[req] = None
            return
        inst.add(req, self.now)
        self._reschedule(inst)

    def run(
        self,
        requests: Sequence[Request],
        progress: Callable[[int], None] | None = None,
        until: float = INF,
    ) -> ClusterResult:
        """Simulate until every request has finished; requests are mutated in place. With ``until``, stop
        once the clock would pass it: events at ``until`` still happen, later ones do not, and requests
        not finished by then stay unfinished (for callers that censor at a horizon)."""
        wall0 = time.perf_counter()
        cpu0 = time.process_time()
        # A request reaches its engine after the serving path's per-request overhead (the profile's
        # request_overhead_s; 0 for roofline profiles). Metrics still count from the client's arrival.
        overhead = {m: p.request_overhead_s for m, p in self.config.profiles.items()}
        overhead.update({a: overhead[b] for a, b in self.config.adapters.items()})
        ingress = {id(r): r.arrival + overhead.get(r.model, 0.0) for r in requests}
        arrivals = sorted(requests, key=lambda r: ingress[id(r)])
        n = len(arrivals)
        if n == 0:
            raise ValueError("no requests to simulate")
        if not self.instances and self.controller is None:
            raise ValueError("the cluster has no instances and no controller to add some")
        t_start = min(r.arrival for r in arrivals)
        self.now = min(self.now, t_start)
        next_tick = t_start if self.controller is not None else INF
        interval = self.controller.interval_s if self.controller is not None else INF
        if interval <= 0:
            raise ValueError(f"controller interval_s must be > 0, got {interval}")
        heap = self._heap
        ai = 0
        done_before = 0
        events = 0
        idle_ticks = 0
        report_every = max(1, n // 200)
        while True:
            t_arr = ingress[id(arrivals[ai])] if ai < n else INF
            while heap and heap[0][2].heap_seq != heap[0][1]:
                heapq.heappop(heap)  # stale entry
            t_inst = heap[0][0] if heap else INF
            if ai >= n and not self._held and not any(i.outstanding for i in self.instances):
                break
            t = min(t_arr, t_inst, next_tick)
            if t == INF:
                stuck = sum(i.outstanding for i in self.instances)
                raise SimulationStalled(
                    f"simulation stalled at t={self.now:.3f}s with {stuck} unfinished requests: "
                    "the policy left them unscheduled and asked for no re-check"
                )
            if t > until:
                break
            self.now = t
            events += 1
            if t == next_tick:
                actions = self.controller.tick(self.view()) if self.controller is not None else []
                self.apply(actions)
                next_tick += interval
                if ai >= n and t_inst == INF and (self._held or any(i.outstanding for i in self.instances)):
                    # Every request has arrived and no instance has a step to take: only the controller
                    # can still move the held or stuck work (dispatch it, add or restart an instance).
                    idle_ticks += 1
                    if idle_ticks > MAX_IDLE_TICKS:
                        raise SimulationStalled(self._stall_message())
                else:
                    idle_ticks = 0
            elif t == t_arr:  # arrivals of an instant first, so they share the next iteration
                self._route(arrivals[ai])
                ai += 1
            else:
                _, _, inst = heapq.heappop(heap)
                inst.advance()
                self._reschedule(inst)
                if inst.draining and not inst.outstanding and inst in self.instances:
                    self._retire(inst)
            if progress is not None and events % 512 == 0:
                finished = sum(i.finished for i in self.instances) + sum(i.finished for i in self.retired)
                if finished - done_before >= report_every:
                    progress(finished - done_before)
                    done_before = finished
        end = self.now
        if progress is not None and n - done_before > 0:
            progress(n - done_before)
        rejected = set(self.rejected)
        unfinished = [r for r in requests if not r.finished and r not in rejected]
        if unfinished and until == INF:
            raise RuntimeError(f"{len(unfinished)} requests did not finish (first: {unfinished[0].id})")
        everyone = self.instances + self.retired
        gpu_seconds = sum(
            i.gpus * ((i.retired_at if i.retired_at is not None else end) - i.created_at) for i in everyone
        )
        last = max(r.finished_at or 0.0 for r in requests)
        return ClusterResult(
            requests=list(requests),
            gpu_seconds=gpu_seconds,
            makespan_s=last - t_start,
            model_swaps=sum(i.model_swaps for i in everyone),
            kv_swaps=sum(i.kv_swaps for i in everyone),
            preemptions=sum(i.preemptions for i in everyone),
            iterations=sum(i.iterations for i in everyone),
            wall_s=time.perf_counter() - wall0,
            cpu_s=time.process_time() - cpu0,
            events=events,
            instance_log=self.log,
            adapter_loads=sum(i.adapter_loads for i in everyone),
        )

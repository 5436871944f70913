"""Routing as small named plugins: filters narrow the instances a request may go to, scorers rank
them, a picker chooses. A ``Route`` composes them from a ``RouteSpec`` (plugin names with typed
parameters), the way llm-d's scheduler composes its filter, scorer and picker plugins. The live
router and the simulator's cluster both build their routing here, so a routing rule that a bench
measures is the rule that runs.

Pure: a plugin sees a ``RouteRequest`` and ``InstanceLoad`` records that the caller fills from its
world (the router from its polls and relays, the simulator from its instances); time is passed in.

The built-in routes:

- ``least-wait`` (the live router's): the request's model, healthy instances, its class's roles
  (Chiron's instance roles: an interactive request goes to interactive instances, else mixed ones; a
  batch request to batch instances, else mixed ones; when the model has no instance of an eligible
  role, every instance is eligible — CHOICE: serve rather than refuse); then the least QLM-estimated
  waiting time (QLM's load-balancing LSO: the output tokens of the requests that must leave the batch
  before this one starts, over the instance's token throughput, at the z-quantile of their normal
  sum; an instance with a free batch slot starts the request at once; on an instance serving several
  models, the requests of all of them, plus a model swap where it has none of this model's:
  ``swap_penalty``), ties to the class's own role, then fewer outstanding requests, then the name.
- ``least-loaded`` (the simulator's default): the request's model, started instances (else the one
  that starts first), fewest outstanding requests, ties to the first.
- ``round-robin``: the same candidates, taken in turn.
- ``cache-aware``: as ``least-wait``, but ranked by the expected time to the first token: the
  estimated wait, plus the prefill still ahead there (``PrefillQueue``), plus the prefill of the
  prompt tokens the instance does not hold in its prefix cache (``tessera.core.prefix`` tracks which
  blocks each instance holds).
- ``prefix``: as ``least-wait``'s candidates, ranked by cached prompt tokens alone (the baseline that
  piles onto hot instances).
- ``precise-prefix``: as ``prefix``, but ranked by the prompt tokens the instance's engine itself
  reports holding (its KV events, ``tessera.core.prefix.EngineBlockIndex``); an instance without an
  event feed is ranked by the router's own estimate unless the scorer's ``fallback`` is off.
- ``slo-prefix``: the instances where the request's expected time to first token meets its class's
  TTFT SLO (all when none does): a session's last instance while it is one of them (a session sticks
  to its instance while that has SLO headroom), else ranked by that expected time (which counts the
  prompt an instance holds as prefill saved), then cached prompt tokens, then fewer outstanding
  requests. CHOICE: cached tokens rank after the expected time, not before it: ranked first they
  ignored every instance's load until the SLO broke, so with an SLO far above the TTFTs (3 s against
  0.1 s on multi-turn chat) the route was prefix affinity alone and lost to it on TTFT p99
  (``tessera bench routing --set workload=chat``).
- ``adapter-affinity``: as ``least-wait``'s candidates, ranked by the estimated wait plus what the
  request's LoRA adapter costs there (``adapter_cost``: nothing where it is resident, its load where a
  slot is free, else a slot's release too), so that an adapter's requests gather where it is loaded
  until the wait there outweighs loading it elsewhere (llm-d's and the Gateway API inference
  extension's LoRA affinity, priced in seconds like the prefix routes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tessera.core.lora import ADAPTER_LOAD_S
from tessera.core.policies.qlm.estimator import EngineRates, TokenStats, request_wait
from tessera.core.policies.qlm.lso import TierCosts
from tessera.core.profile import StepProfile

Role = Literal["interactive", "mixed", "batch"]

# Eligible roles of a class kind, most preferred first.
ELIGIBLE_ROLES: dict[str, tuple[Role, ...]] = {
    "interactive": ("interactive", "mixed"),
    "batch": ("batch", "mixed"),
}
CHARS_PER_TOKEN = 4  # characters per token where a caller estimates tokens from text (English text)
DEFAULT_Z = 1.0  # quantile of the waiting-time estimate (QLM's default confidence, about the 84th percentile)
ENGINE_RESTART_S = TierCosts().engine_reinit_s  # a model swap's engine restart (QLM's tier default)


class NoInstance(LookupError):
    """No instance may serve the request."""


@dataclass(slots=True)
class PrefillQueue:
    """The prefill an instance has ahead of a new request: the prompt tokens sent there that it must
    compute (what the router expects its prefix cache to hold excluded) for the requests without a
    first token, drained as if computed back to back from when each was sent.

    Both corrections are the engine's own behaviour: a prefix-cache hit is not prefilled, and a
    prefill in progress has done part of its work. Counting whole prompts until their first token
    overstated the backlog (simulated, at load 0.9: the expected time to first token overshot the
    TTFT by 0.84 s at the 95th percentile on the Mooncake trace, by 0.09 s on multi-turn chat whose
    mean TTFT is 0.04 s; now within 0.02 s), most on busy cache holders, so ``cache-aware`` moved
    chat sessions off their history (47-54% cache hits against 60.5%)."""

    tokens: int = 0  # prompt tokens to compute of the requests sent there without a first token
    done_at: float = 0.0  # when they would all be computed, prefilled back to back

    def sent(self, tokens: int, now: float, profile: StepProfile | None) -> None:
        """A request whose prefill computes ``tokens`` went to the instance at ``now``."""
        start = max(self.done_at, now) if self.tokens else now
        self.done_at = start + (profile.prefill(tokens) if profile is not None else 0.0)
        self.tokens += tokens

    def first_token(self, tokens: int) -> None:
        """A request sent with ``tokens`` to compute has its first token (or ended without one)."""
        self.tokens = max(0, self.tokens - tokens)

    def left(self, now: float, profile: StepProfile | None) -> int:
        """Prompt tokens still to prefill at ``now``: those sent, at most what the time left until
        ``done_at`` computes."""
        if profile is None or profile.prefill_p1 <= 0:
            return self.tokens
        return min(self.tokens, math.ceil(max(0.0, self.done_at - now) / profile.prefill_p1))


@dataclass(slots=True)
class InstanceLoad:
    """What routing knows about one model on one instance."""

    instance: str
    model: str
    role: str  # "interactive", "mixed" or "batch"; any other role is eligible only when none of those is
    profile: StepProfile | None
    batch_size: int  # most requests in flight (the instance's current batch size)
    outstanding: int = 0  # requests of this model sent there that have not ended
    healthy: bool = True
    ready_at: float = 0.0  # when the instance starts serving (the simulator's cold starts)
    prefill: PrefillQueue = field(default_factory=PrefillQueue)  # the prefill it has ahead
    # A multi-model instance (model swapping) serves its other models' requests too: those sent there
    # and not ended, and the model of the latest request routed there (None: not known).
    other_outstanding: int = 0
    last_model: str | None = None
    # Of ``other_outstanding``, the requests of models on this model's own engine (a base and its LoRA
    # adapters share one), which no swap separates from it
    same_engine_outstanding: int = 0
    interactive: int = 0  # of ``outstanding``, of an interactive class (Chiron's dispatch reads both kinds)
    # The engine's KV cache as its worker last reported it, in tokens (None: not known)
    engine_kv_capacity: int | None = None
    engine_kv_used: int | None = None
    # A LoRA adapter's load (``model`` is the adapter): the base model whose engine serves it, the
    # adapters resident in that engine's GPU slots (those of its running requests), how many slots it has
    # (vLLM's --max-loras) and the adapters of its waiting requests (vLLM reports both sets and the slots
    # in its ``vllm:lora_requests_info`` metric)
    adapter_of: str | None = None
    resident_adapters: frozenset[str] = frozenset()
    adapter_slots: int = 0
    waiting_adapters: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """The request being routed, as routing sees it."""

    model: str
    kind: str = ""  # class kind: "interactive", "batch", or "" when unknown
    stats: TokenStats | None = None  # the model's token statistics (for the waiting-time estimate)
    now: float = 0.0
    prompt_tokens: int = 0  # prompt length (an estimate where the caller does not tokenize)
    ttft_slo_s: float | None = None  # the class's TTFT SLO, when it has one
    cached_tokens: Mapping[str, int] = field(default_factory=dict)  # instance -> prompt tokens it holds
    # instance -> prompt tokens its engine reports holding, for the instances with a KV-event feed only
    engine_cached_tokens: Mapping[str, int] = field(default_factory=dict)
    session_instance: str | None = None  # the instance the request's session used last


def seed_stats() -> TokenStats:
    """Token statistics of a model before any request finished (QLM seeds them offline; CHOICE: 512 in,
    128 +- 128 out); the router updates them by EWMA from the requests it relays."""
    return TokenStats(mu_in=512.0, mu_out=128.0, var_out=128.0**2)


def estimated_wait(load: InstanceLoad, stats: TokenStats, z: float = DEFAULT_Z) -> float:
    """Estimated seconds before a new request starts on ``load``'s instance (QLM's RWT), counting the
    requests of every model the instance serves, plus a model swap (``swap_penalty``) when it has none
    of this model's."""
    ahead = max(0, load.outstanding + load.other_outstanding + 1 - load.batch_size)
    swap = swap_penalty(load)
    if ahead == 0:
        return swap
    if load.profile is None:
        raise ValueError(f"instance {load.instance} has no step profile: the wait cannot be estimated")
    rates = EngineRates(load.profile, max(1, load.batch_size))
    return request_wait([(ahead, stats, rates)], z) + swap


def swap_penalty(load: InstanceLoad) -> float:
    """The model swap a request of ``load.model`` waits for on a multi-model instance that has none of its
    model's requests and serves, or last served, another model on another engine (a base's adapters are on
    its own: ``same_engine_outstanding``, and a router records an adapter's request as its base's in
    ``last_model``): the engine restart QLM's tier model charges (``ENGINE_RESTART_S``) plus loading the
    weights. 0 otherwise. CHOICE: this is what keeps a model's requests together under per-request routing
    (QLM's load balancing keeps request groups together; the live router sees requests, not the workers'
    groups): on ``tessera bench qlm --set part=multi`` with the code trace's lengths, counting the other
    models' requests and this penalty took the live route from 5.79 req/s (19.4% under batched swapping)
    to 8.55 (18.9% over)."""
    other = load.other_outstanding > load.same_engine_outstanding or load.last_model not in (None, load.model)
    # An adapter shares its base's engine: loading it is ``adapter_cost``'s, never an engine restart.
    if load.outstanding > 0 or not other or load.profile is None or load.adapter_of is not None:
        return 0.0
    return ENGINE_RESTART_S + load.profile.model_load_time()


# ---- plugins ----------------------------------------------------------------------------------------

Filter = Callable[[RouteRequest, list[InstanceLoad]], list[InstanceLoad]]
Scorer = Callable[[RouteRequest, InstanceLoad], Any]  # lower is better


def serves_model(req: RouteRequest, loads: list[InstanceLoad]) -> list[InstanceLoad]:
    """Instances of the request's model."""
    return [x for x in loads if x.model == req.model]


def healthy(req: RouteRequest, loads: list[InstanceLoad]) -> list[InstanceLoad]:
    """Instances in the rotation."""
    return [x for x in loads if x.healthy]


def class_roles(req: RouteRequest, loads: list[InstanceLoad]) -> list[InstanceLoad]:
    """Instances of a role the request's class may use; every instance when none has one."""
    roles = ELIGIBLE_ROLES.get(req.kind, ("interactive", "mixed", "batch"))
    return [x for x in loads if x.role in roles] or loads


def started(req: RouteRequest, loads: list[InstanceLoad]) -> list[InstanceLoad]:
    """Instances already serving at ``req.now``; else the one that starts first."""
    ready = [x for x in loads if x.ready_at <= req.now]
    return ready or ([min(loads, key=lambda x: x.ready_at)] if loads else [])


class WaitSettings(BaseModel):
    """Parameters of the ``estimated-wait`` scorer."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    z: float = Field(DEFAULT_Z, ge=0.0, le=5.0, description="quantile of the waiting-time estimate")


def wait_scorer(settings: WaitSettings) -> Scorer:
    """Least QLM-estimated waiting time (rounded to 1 ns, so that ties fall to the next scorer)."""

    def score(req: RouteRequest, load: InstanceLoad) -> float:
        if req.stats is None:
            raise ValueError("the estimated-wait scorer needs the model's token statistics")
        return round(estimated_wait(load, req.stats, settings.z), 9)

    return score


def ttft_scorer(settings: WaitSettings) -> Scorer:
    """Least expected time to the first token: the estimated wait for a batch slot, plus the prefill
    still ahead there (``PrefillQueue``: the uncached prompt tokens of requests without a first token
    yet, less what the time since they were sent computed; CHOICE: a non-streamed answer's prompt
    counts until the answer ends, as the router cannot see its first token, but the drain bounds
    what it adds), plus the prefill of the request's own prompt tokens the instance does not hold in
    its prefix cache. Cache affinity and load in one unit, seconds."""
    wait = wait_scorer(settings)

    def score(req: RouteRequest, load: InstanceLoad) -> float:
        missed = max(0, req.prompt_tokens - req.cached_tokens.get(load.instance, 0))
        profile = load.profile
        if profile is None:
            return round(wait(req, load), 9)
        ahead = load.prefill.left(req.now, profile)
        prefill = profile.prefill_p1 * ahead + (profile.prefill(missed) if missed else 0.0)
        return round(wait(req, load) + prefill, 9)

    return score


def slo_headroom(req: RouteRequest, loads: list[InstanceLoad]) -> list[InstanceLoad]:
    """Instances where the request's expected time to first token (``expected-ttft``) meets its
    class's TTFT SLO; every instance when none does or the class has none."""
    if req.ttft_slo_s is None:
        return loads
    expected = ttft_scorer(WaitSettings())
    return [x for x in loads if expected(req, x) <= req.ttft_slo_s] or loads


def prefix_affinity(req: RouteRequest, load: InstanceLoad) -> int:
    """More prompt tokens already cached first (prefix affinity alone, whatever the load)."""
    return -req.cached_tokens.get(load.instance, 0)


class PrecisePrefixSettings(BaseModel):
    """Parameters of the ``precise-prefix`` scorer."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    fallback: bool = Field(
        True,
        description="rank an instance without a KV-event feed by the router's own estimate of its cache "
        "(cached_tokens); off: as holding nothing",
    )


def precise_prefix_scorer(settings: PrecisePrefixSettings) -> Scorer:
    """More prompt tokens cached first, as the engine reports them (its KV events): what it evicted or
    lost in a restart no longer counts, and what another router sent there does."""

    def score(req: RouteRequest, load: InstanceLoad) -> int:
        if load.instance in req.engine_cached_tokens:
            return -req.engine_cached_tokens[load.instance]
        return -req.cached_tokens.get(load.instance, 0) if settings.fallback else 0

    return score


class AdapterSettings(BaseModel):
    """Parameters of the ``adapter-affinity`` scorer."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    z: float = Field(DEFAULT_Z, ge=0.0, le=5.0, description="quantile of the waiting-time estimate")
    load_seconds: float = Field(
        ADAPTER_LOAD_S,
        ge=0.0,
        le=60.0,
        description="loading an adapter into a free GPU slot of its base's engine, in seconds (CHOICE: "
        "a rank-16 adapter of an 8B model is about 40 MB, read from CPU memory or a local disk; the "
        "simulator's engines charge the same by default, tessera.core.lora.ADAPTER_LOAD_S)",
    )


def adapter_cost(req: RouteRequest, load: InstanceLoad, load_seconds: float) -> float:
    """Seconds the request's adapter costs on ``load``'s instance before its request can start, beyond
    the wait for a batch slot: 0 where it is resident (or the model is no adapter); ``load_seconds``
    where the engine has a slot no resident or waiting adapter claims; else also the release of a slot
    for it and for each other adapter still waiting for one once the free slots are taken (vLLM gives a
    freed slot to the first waiting request that needs one). A slot is released when a resident
    adapter's last running request ends: CHOICE: one mean request's decode time at the instance's
    batch, the soonest a request started now ends. The earlier estimate, the mean time between any two
    completions, priced a full engine at a fraction of a second, and with the adapters in flight taken
    as resident, requests piled onto engines whose slots their hot adapters never freed (``tessera
    bench lora-routing``, load 0.9: TTFT p99 15.9 s against 3.6 s now)."""
    if load.adapter_of is None or load.model in load.resident_adapters:
        return 0.0
    claimed = load.resident_adapters | load.waiting_adapters
    if load.model not in claimed and len(claimed) < load.adapter_slots:
        return load_seconds
    if load.profile is None or req.stats is None:
        return load_seconds
    free = max(0, load.adapter_slots - len(load.resident_adapters))  # the first waiting adapters take these
    ahead = max(0, len(load.waiting_adapters - load.resident_adapters - {load.model}) - free)
    running = max(1, min(load.batch_size, load.outstanding + load.other_outstanding))
    context = running * int(req.stats.mu_in + req.stats.mu_out / 2)
    decode = req.stats.mu_out * load.profile.decode_step(running, context)
    return load_seconds + (ahead + 1) * decode


def adapter_scorer(settings: AdapterSettings) -> Scorer:
    """Least estimated wait plus the adapter's cost there (``adapter_cost``), in seconds: the adapter's
    resident instance first, then one with a free slot, each weighed against its queue."""
    wait = wait_scorer(WaitSettings(z=settings.z))

    def score(req: RouteRequest, load: InstanceLoad) -> float:
        return round(wait(req, load) + adapter_cost(req, load, settings.load_seconds), 9)

    return score


def session_affinity(req: RouteRequest, load: InstanceLoad) -> int:
    """The instance the request's session used last first (its context is likely cached there)."""
    return 0 if req.session_instance is not None and load.instance == req.session_instance else 1


def role_preference(req: RouteRequest, load: InstanceLoad) -> int:
    """The class's own role before mixed, before any other."""
    roles = ELIGIBLE_ROLES.get(req.kind, ())
    return roles.index(load.role) if load.role in roles else len(roles)


def outstanding(req: RouteRequest, load: InstanceLoad) -> int:
    """Fewer outstanding requests first (of every model the instance serves)."""
    return load.outstanding + load.other_outstanding


def by_name(req: RouteRequest, load: InstanceLoad) -> str:
    """Deterministic ties: by instance name."""
    return load.instance


class NoSettings(BaseModel):
    """A plugin without parameters."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def _fixed(scorer: Scorer) -> Callable[[NoSettings], Scorer]:
    return lambda _settings: scorer


FILTERS: dict[str, Filter] = {
    "serves-model": serves_model,
    "healthy": healthy,
    "class-roles": class_roles,
    "started": started,
    "slo-headroom": slo_headroom,
}
# name -> (settings model, factory)
SCORERS: dict[str, tuple[type[BaseModel], Callable[[Any], Scorer]]] = {
    "estimated-wait": (WaitSettings, wait_scorer),
    "expected-ttft": (WaitSettings, ttft_scorer),
    "prefix-affinity": (NoSettings, _fixed(prefix_affinity)),
    "precise-prefix": (PrecisePrefixSettings, precise_prefix_scorer),
    "adapter-affinity": (AdapterSettings, adapter_scorer),
    "session-affinity": (NoSettings, _fixed(session_affinity)),
    "role-preference": (NoSettings, _fixed(role_preference)),
    "outstanding": (NoSettings, _fixed(outstanding)),
    "name": (NoSettings, _fixed(by_name)),
}


class ScorerSpec(BaseModel):
    """One scorer of a route, with its parameters."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    settings: dict[str, Any] = Field(default_factory=dict)


class RouteSpec(BaseModel):
    """Filters in order, scorers compared in order (the first decides, the next break ties), a picker."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    filters: tuple[str, ...]
    scorers: tuple[ScorerSpec, ...] = ()
    picker: Literal["min", "round-robin"] = "min"


@dataclass(slots=True)
class Route:
    """A composed routing rule; ``pick`` chooses the instance of one request."""

    name: str
    filters: tuple[Filter, ...]
    scorers: tuple[Scorer, ...]
    picker: str
    scorer_names: tuple[str, ...] = ()
    _turn: int = field(default=0)

    def candidates(self, req: RouteRequest, loads: Sequence[InstanceLoad]) -> list[InstanceLoad]:
        """The instances left after the filters, in the given order."""
        left = list(loads)
        for keep in self.filters:
            left = keep(req, left)
        return left

    def pick(self, req: RouteRequest, loads: Sequence[InstanceLoad]) -> InstanceLoad:
        """The instance for ``req``; NoInstance when the filters leave none."""
        left = self.candidates(req, loads)
        if not left:
            raise NoInstance(f"no healthy instance serves model {req.model!r}")
        if self.picker == "round-robin":
            chosen = left[self._turn % len(left)]
            self._turn += 1
            return chosen
        return min(left, key=lambda x: tuple(score(req, x) for score in self.scorers))

    def explain(self, req: RouteRequest, loads: Sequence[InstanceLoad]) -> list[dict[str, Any]]:
        """The candidates left after the filters with each scorer's value (lower wins, in order)."""
        return [
            {"instance": x.instance,
             "scores": {n: score(req, x) for n, score in zip(self.scorer_names, self.scorers, strict=True)}}
            for x in self.candidates(req, loads)
        ]  # fmt: skip


def build_route(name: str, spec: RouteSpec) -> Route:
    """The route ``spec`` describes; ValueError naming the unknown plugin or the bad parameter."""
    filters = []
    for f in spec.filters:
        if f not in FILTERS:
            raise ValueError(f"route {name}: unknown filter {f!r}; known filters: {', '.join(FILTERS)}")
        filters.append(FILTERS[f])
    scorers = []
    for s in spec.scorers:
        if s.name not in SCORERS:
            raise ValueError(f"route {name}: unknown scorer {s.name!r}; known scorers: {', '.join(SCORERS)}")
        model, factory = SCORERS[s.name]
        try:
            settings = model(**s.settings)
        except ValidationError as exc:
            raise ValueError(f"route {name}: bad settings for scorer {s.name!r}: {exc}") from exc
        scorers.append(factory(settings))
    return Route(name, tuple(filters), tuple(scorers), spec.picker, tuple(s.name for s in spec.scorers))


ROUTES: dict[str, RouteSpec] = {
    "least-wait": RouteSpec(
        filters=("serves-model", "healthy", "class-roles"),
        scorers=(
            ScorerSpec(name="estimated-wait"),
            ScorerSpec(name="role-preference"),
            ScorerSpec(name="outstanding"),
            ScorerSpec(name="name"),
        ),
    ),
    "cache-aware": RouteSpec(
        filters=("serves-model", "healthy", "class-roles"),
        scorers=(
            ScorerSpec(name="expected-ttft"),
            ScorerSpec(name="role-preference"),
            ScorerSpec(name="outstanding"),
            ScorerSpec(name="name"),
        ),
    ),
    "prefix": RouteSpec(
        filters=("serves-model", "healthy", "class-roles"),
        scorers=(ScorerSpec(name="prefix-affinity"), ScorerSpec(name="outstanding"), ScorerSpec(name="name")),
    ),
    "precise-prefix": RouteSpec(
        filters=("serves-model", "healthy", "class-roles"),
        scorers=(ScorerSpec(name="precise-prefix"), ScorerSpec(name="outstanding"), ScorerSpec(name="name")),
    ),
    "slo-prefix": RouteSpec(
        filters=("serves-model", "healthy", "class-roles", "slo-headroom"),
        scorers=(
            ScorerSpec(name="session-affinity"),
            ScorerSpec(name="expected-ttft"),
            ScorerSpec(name="prefix-affinity"),
            ScorerSpec(name="outstanding"),
            ScorerSpec(name="name"),
        ),
    ),
    "adapter-affinity": RouteSpec(
        filters=("serves-model", "healthy", "class-roles"),
        scorers=(
            ScorerSpec(name="adapter-affinity"),
            ScorerSpec(name="role-preference"),
            ScorerSpec(name="outstanding"),
            ScorerSpec(name="name"),
        ),
    ),
    "least-loaded": RouteSpec(filters=("serves-model", "started"), scorers=(ScorerSpec(name="outstanding"),)),
    "round-robin": RouteSpec(filters=("serves-model", "started"), picker="round-robin"),
}


# routes that read where prompts' blocks are cached
PREFIX_ROUTES = ("cache-aware", "prefix", "precise-prefix", "slo-prefix")


def uses_engine_blocks(spec: RouteSpec) -> bool:
    """Whether a route reads what the engines report holding (``engine_cached_tokens``)."""
    return any(s.name == "precise-prefix" for s in spec.scorers)


def make_route(name: str, **overrides: Any) -> Route:
    """A built-in route by name (``ROUTES``); scorer settings by scorer name, e.g.
    ``make_route("least-wait", **{"estimated-wait": {"z": 2.0}})``."""
    spec = ROUTES.get(name)
    if spec is None:
        raise ValueError(f"unknown route {name!r}; known routes: {', '.join(ROUTES)}")
    if overrides:
        unknown = set(overrides) - {s.name for s in spec.scorers}
        if unknown:
            raise ValueError(f"route {name} has no scorer {', '.join(sorted(unknown))}")
        scorers = tuple(
            ScorerSpec(name=s.name, settings={**s.settings, **overrides.get(s.name, {})})
            for s in spec.scorers
        )
        spec = spec.model_copy(update={"scorers": scorers})
    return build_route(name, spec)

"""The router: one OpenAI endpoint in front of every worker instance.

``POST /v1/completions`` and ``/v1/chat/completions`` (streaming or not) go to an instance chosen by the
core's ``least-wait`` route (``tessera.core.routing``: model, class roles, least estimated waiting
time); the worker's answer is relayed as it comes, status and headers included. ``GET /v1/models`` lists
every model served (``GET /v1/models/{id}`` one of them, 404 naming those served), ``/health`` answers
while the process lives, ``/ready`` when at least one instance
is ready, ``/router/status`` shows the instances, their load and estimated waits, and the classes, and
``/metrics`` exports the same view and what clients saw to Prometheus (``tessera.router.metrics``).
Every error, the router's own 404 and 405 included, is an OpenAI-style body.

The router counts the requests it has outstanding on each instance (exact and without delay) and
polls every instance's ``/ready`` and ``/metrics`` (``tessera_batch_size``) every ``poll_interval_s``.
An instance that fails a poll or refuses a connection leaves the rotation until a poll sees it ready
again; failures while relaying are handled in ``tessera.router.relay``.

What a client sends is checked before it is forwarded: size and time limits
(``tessera.router.limits``; serve the app with ``tessera.router.protocol.router_server_config`` for
those on the request head), the body (``tessera.router.payload``), optionally an API key
(``tessera.router.auth``), and only end-to-end headers go on (``tessera.router.headers``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import httpx
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response
from prometheus_client.parser import text_string_to_metric_families
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from tessera.api.batch_link import to_clock
from tessera.api.openai_errors import ApiError
from tessera.api.tenant import TENANT_HEADER, TENANT_WEIGHT_HEADER
from tessera.api.worker_config import ClassHeaderError, WorkerConfig
from tessera.core.policies.qlm.estimator import TokenStats
from tessera.core.prefix import (
    DEFAULT_TEXT_BLOCK_CHARS,
    EngineBlockIndex,
    PrefixIndex,
    text_block_hashes,
    token_block_hashes,
)
from tessera.core.request import ServiceClass
from tessera.core.routing import (
    CHARS_PER_TOKEN,
    DEFAULT_Z,
    PREFIX_ROUTES,
    ROUTES,
    InstanceLoad,
    RouteRequest,
    estimated_wait,
    make_route,
    seed_stats,
    uses_engine_blocks,
)
from tessera.router.activator import ActivationCollector, Activator
from tessera.router.auth import ApiKeys, Caller
from tessera.router.backends import Backend
from tessera.router.batch_proxy import (
    BatchLink,
    add_batch_routes,
    feeder_caller,
    feeder_deadline,
    without_token,
)
from tessera.router.chiron_hold import ChironHold, HeldCollector, HoldBound, hold_bound
from tessera.router.discovery import Discovered
from tessera.router.headers import downstream_headers, upstream_headers
from tessera.router.kv_events import Subscriptions
from tessera.router.limits import RouterLimits
from tessera.router.metrics import DeliveredSlo, RouterMetrics
from tessera.router.payload import parse_payload, read_body
from tessera.router.prompt_tokens import PromptTokenizers
from tessera.router.quota import QuotaCollector, QuotaStore, Ticket, rate_limit_headers, refusal
from tessera.router.relay import (
    Answer,
    ClientWatch,
    Upstream,
    record_delivery,
    relay_stream,
    send,
)
from tessera.router.upstream import UpstreamTransport

POLL_INTERVAL_S = 1.0
CONNECT_TIMEOUT_S = 5.0  # opening a connection to an instance; an answer may take as long as it takes
POLL_TIMEOUT_S = 2.0  # each readiness or metrics poll of an instance
COMPLETION_MAX_TOKENS = 16  # a completion's max_tokens when unset, as the worker and OpenAI default it
log = logging.getLogger(__name__)
_ROUTES = (
    "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id}, /health, /ready, "
    "/router/status, /metrics"
)


@dataclass(frozen=True, slots=True)
class ClassInfo:
    """A request class as the router and the load driver see it: its header value and SLOs."""

    header_value: str
    service_class: ServiceClass

    def to_json(self) -> dict[str, Any]:
        """JSON form (``/router/status``)."""
        sc = self.service_class
        return {
            "name": sc.name,
            "kind": sc.kind,
            "headerValue": self.header_value,
            "ttftSeconds": sc.ttft_slo_s,
            "itlSeconds": sc.itl_slo_s,
            "deadlineSeconds": sc.deadline_s,
            "readingSpeedTokensPerSecond": sc.reading_speed_tps,
            "ttftTargetSeconds": sc.ttft_target_s,
            "priority": sc.priority,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClassInfo:
        """Inverse of ``to_json``."""
        return cls(
            data["headerValue"],
            ServiceClass(
                name=data["name"],
                kind=data["kind"],
                ttft_slo_s=data.get("ttftSeconds"),
                itl_slo_s=data.get("itlSeconds"),
                deadline_s=data.get("deadlineSeconds"),
                reading_speed_tps=data.get("readingSpeedTokensPerSecond") or 4.8,
                ttft_target_s=data.get("ttftTargetSeconds"),
                priority=data.get("priority") or 0,
            ),
        )


def class_infos(config: WorkerConfig) -> dict[str, ClassInfo]:
    """The classes of a worker configuration."""
    return {
        name: ClassInfo(spec.header_value(name), spec.to_service_class(name))
        for name, spec in config.classes.items()
    }


@dataclass(frozen=True, slots=True)
class Pick:
    """A routing decision: the instance, and the prompt tokens it is expected to prefill (the prompt
    less what the router believes it holds in its prefix cache), which its ``PrefillQueue`` counts
    until the request's first token."""

    load: InstanceLoad
    prefill_tokens: int


# what observe() reads
_POLLED_FAMILIES = (
    "tessera_batch_size",
    "tessera_engine_start_time_seconds",
    "tessera_engine_kv_capacity_tokens",
    "tessera_engine_kv_used_tokens",
    "tessera_lora_adapter_resident",
    "tessera_lora_adapter_requests",
    "tessera_lora_slots",
)
_POLLED_LINES = tuple(f"{prefix}{name}" for name in _POLLED_FAMILIES for prefix in ("", "# HELP ", "# TYPE "))
# a client's session key (else the body's OpenAI "prompt_cache_key", else its "user")
# The router's refusals of a tenant's request by error code -> the reason its metrics name.
_TENANT_REFUSALS = {
    "rate_limit_requests": "requests",
    "rate_limit_tokens": "tokens",
    "rate_limit_concurrency": "concurrency",
    "request_too_large": "request_too_large",
    "model_not_allowed": "model_not_allowed",
    "class_not_allowed": "class_not_allowed",
}
SESSION_HEADER = "x-tessera-session"
MAX_SESSIONS = 100_000  # sessions remembered for sticky routing, least recently used forgotten first
RECENT_DECISIONS = 20  # cache-aware decisions /router/status shows with their scores


def _wait_settings(route: str, z: float) -> dict[str, Any]:
    """The route's waiting-time quantile ``z``, for whichever wait scorer it has."""
    names = {s.name for s in ROUTES[route].scorers} if route in ROUTES else set()
    return {name: {"z": z} for name in ("estimated-wait", "expected-ttft") if name in names}


class RouterState:
    """Instances, their loads and the token statistics the route uses."""

    def __init__(
        self,
        backends: Sequence[Backend],
        *,
        z: float = DEFAULT_Z,
        route: str = "least-wait",
        hold: ChironHold | None = None,
    ) -> None:
        self.z = z
        self.route = make_route(route, **_wait_settings(route, z))
        self.uses_prefix = route in PREFIX_ROUTES
        self.uses_engine = route in ROUTES and uses_engine_blocks(ROUTES[route])
        self.prefixes: dict[str, PrefixIndex] = {}  # model -> which instance holds which prompt blocks
        # model -> what its engines report holding (their KV events); CHOICE: one block size per model,
        # its first publisher's (the index skips and counts blocks of another size)
        self.engine_blocks: dict[str, EngineBlockIndex] = {}
        self.feeds: dict[tuple[str, str], str] = {}  # (instance, model) -> its KV-event publisher
        self.tokenizers = PromptTokenizers()  # text and chat prompts as the workers tokenize them
        self.prefix_tokens: dict[str, list[int]] = {}  # instance -> [prompt tokens sent, of them cached]
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_DECISIONS)  # cache-aware decisions
        self.sessions: OrderedDict[str, str] = OrderedDict()  # session key -> its last instance (LRU)
        self.last_model: dict[str, str] = {}  # instance -> the model of the latest request sent there
        self.engine_started: dict[tuple[str, str], float] = {}  # (instance, model) -> engine start time
        self.backends: dict[str, Backend] = {}
        self.loads: dict[tuple[str, str], InstanceLoad] = {}
        self.configs: dict[str, WorkerConfig] = {}  # model -> configuration of its first instance
        self.stats: dict[str, TokenStats] = {}
        self.class_header = ""
        # model -> configuration, for models whose instances all sleep (scale to zero): still listed
        # and classified, while the activator holds their requests
        self.dormant: dict[str, WorkerConfig] = {}
        self.delivered = DeliveredSlo()  # what clients were delivered, judged per model and class
        # Chiron's dispatch of autoscaled models' requests (tessera.router.chiron_hold); None: they are
        # routed on arrival (no autoscaler will start the instances a hold would wait for, as with local
        # --no-autoscale)
        self.hold = hold if hold is not None else ChironHold()
        self.holding = hold is not None
        self.update(backends)

    def update(self, backends: Sequence[Backend], coming: Mapping[str, Sequence[str]] | None = None) -> None:
        """Replace the backends (cluster discovery); instances that stay keep their load and health.
        ``coming``: model -> the roles of its instances that are planned but not yet discovered (a
        cluster's starting pods); the Chiron dispatch waits for a batch or mixed one among them."""
        self.coming = dict(coming or {})
        old = self.loads
        self.backends = {b.name: b for b in backends}
        self.loads = {}
        self.configs = {}
        self.feeds = {}
        for b in backends:
            for source in b.kv_events:
                self.feeds[(b.name, source.model)] = source.endpoint
                self.engine_blocks.setdefault(source.model, EngineBlockIndex(source.block_size))
        if self.uses_engine:
            self.tokenizers.update(b.config for b in backends)
        for b in backends:
            for m in b.config.models:
                self.configs.setdefault(m.name, b.config)
                profile = m.profile.to_profile(m.name, m.kv_capacity_tokens)
                kept = old.get((b.name, m.name))
                if kept is not None:  # the same object: requests in flight still count on it
                    kept.role, kept.profile = b.role, profile
                    self.loads[(b.name, m.name)] = kept
                    continue
                self.loads[(b.name, m.name)] = InstanceLoad(
                    instance=b.name,
                    model=m.name,
                    role=b.role,
                    profile=profile,
                    batch_size=b.config.scheduling.batch.start,
                    healthy=False,  # until a poll sees it ready
                )
        for model, config in self.dormant.items():
            self.configs.setdefault(model, config)
        self.stats = {m: self.stats.get(m) or seed_stats() for m in self.configs}
        self.class_header = next(iter(self.configs.values())).class_header if self.configs else ""

    def classify(self, model: str, headers: Mapping[str, str]) -> tuple[str, str]:
        """The class name and kind of a request (class headers in ``headers``); ApiError 404/400 for an
        unknown model or class."""
        config = self.configs.get(model)
        if config is None:
            known = ", ".join(sorted(self.configs)) or "(none)"
            raise ApiError(404, f"the model {model!r} is not served here; models: {known}",
                           code="model_not_found", param="model")  # fmt: skip
        entry = config.model(model)
        assert entry is not None
        try:
            name = config.class_from_headers(headers)
        except ClassHeaderError as exc:
            raise ApiError(400, str(exc), code="unknown_class", param=exc.header) from None
        if name is None:
            name = config.default_class(entry)
        return name, config.classes[name].kind

    def pick(
        self,
        model: str,
        kind: str,
        exclude: set[str],
        prompt_text: str = "",
        ttft_slo_s: float | None = None,
        session: str = "",
        prompt_token_ids: Sequence[int] = (),
        only: str = "",
    ) -> Pick:
        """The instance for a request (not one of ``exclude``), with the prompt tokens it is expected to
        prefill there; a cache-aware route also reads which
        instances hold the leading blocks of ``prompt_text`` and records where it sent them, and a
        route on engine-reported blocks reads which engines hold those of ``prompt_token_ids`` (sent as
        token ids, or a text completion prompt or a chat tokenized and rendered as its workers do:
        ``PromptTokenizers``; a model without a tokenizer folder has none, and the text index's estimate
        stands in). ``only`` names the instance Chiron's dispatch placed the request on: it is taken while
        it is ready and not excluded, else the route chooses."""
        self._count_other_models()
        loads = [x for x in self.loads.values() if x.instance not in exclude]
        if only:
            loads = [x for x in loads if x.instance == only and x.model == model and x.healthy] or loads
        prompt_tokens = len(prompt_token_ids) or len(prompt_text) // CHARS_PER_TOKEN
        if not self.uses_prefix or not (prompt_text or prompt_token_ids):
            req = RouteRequest(model, kind, self.stats[model], time.monotonic(), ttft_slo_s=ttft_slo_s)
            chosen = self.route.pick(req, loads)
            self.last_model[chosen.instance] = model
            return Pick(chosen, prompt_tokens)
        index = self._prefix_index(model)
        sticky = self.sessions.get(session) if session else None
        hashes = text_block_hashes(prompt_text)
        names = [x.instance for x in loads if x.model == model]
        matched = index.matched(hashes, names)
        cached = {name: n * DEFAULT_TEXT_BLOCK_CHARS // CHARS_PER_TOKEN for name, n in matched.items()}
        engine: dict[str, int] = {}
        engine_index = self.engine_blocks.get(model)
        if self.uses_engine and prompt_token_ids and engine_index is not None:
            size = engine_index.block_size or 0
            # no block size yet: no engine has reported storing a block, so each tracked one holds none
            chain = token_block_hashes(prompt_token_ids, size) if size else []
            engine = {name: n * size for name, n in engine_index.matched(chain, names).items()}
        req = RouteRequest(model, kind, self.stats[model], time.monotonic(), prompt_tokens=prompt_tokens,
                           cached_tokens=cached, engine_cached_tokens=engine, ttft_slo_s=ttft_slo_s,
                           session_instance=sticky)  # fmt: skip
        chosen = self.route.pick(req, loads)
        self.last_model[chosen.instance] = model
        index.record(chosen.instance, hashes, req.now)
        if session:
            self.sessions[session] = chosen.instance
            self.sessions.move_to_end(session)
            while len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)
        counts = self.prefix_tokens.setdefault(chosen.instance, [0, 0])
        hit = min(req.prompt_tokens, engine.get(chosen.instance, cached.get(chosen.instance, 0)))
        counts[0] += req.prompt_tokens
        counts[1] += hit
        self.recent.append(
            {"model": model, "kind": kind, "promptTokens": req.prompt_tokens, "chosen": chosen.instance,
             "candidates": self.route.explain(req, loads)}
        )  # fmt: skip
        return Pick(chosen, req.prompt_tokens - hit)

    def oversize(self, model: str, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why no instance of ``model`` could ever hold a request of ``prompt_tokens`` and ``max_tokens``
        (more than the largest context length, or the largest KV cache, of its instances: the engine's
        reported capacity where polled, else its configured one), or None when one could."""
        configs = [*(b.config for b in self.backends.values()), self.dormant.get(model)]
        entries = [e for c in configs if c is not None and (e := c.model(model)) is not None]
        if not entries:
            return None
        context = max(e.max_model_len for e in entries)
        polled = [x.engine_kv_capacity for x in self.loads.values() if x.model == model]
        kv = max([e.kv_capacity_tokens for e in entries] + [c for c in polled if c])
        need = prompt_tokens + max_tokens
        if need <= min(context, kv):
            return None
        return (
            f"no instance of {model!r} can hold this request: the prompt has {prompt_tokens} tokens and "
            f"max_tokens is {max_tokens} ({need} tokens), and its instances hold at most {context} tokens "
            f"of context and {kv} tokens of KV cache; shorten the prompt or lower max_tokens"
        )

    def holds(self, model: str) -> bool:
        """Whether requests for ``model`` go through Chiron's dispatch (``self.hold``): a model whose
        workers run Chiron's autoscaling, behind a router given a hold."""
        config = self.configs.get(model)
        return self.holding and config is not None and config.scheduling.autoscale.enabled

    def mean_context(self, model: str) -> float:
        """Tokens of KV one request of ``model`` holds on average (prompt and answer)."""
        stats = self.stats[model]
        return stats.mu_in + stats.mu_out

    def ended(self, load: InstanceLoad, kind: str) -> None:
        """A request of ``kind`` sent to ``load`` has ended: room there may take a held request."""
        load.outstanding -= 1
        load.interactive -= kind == "interactive"
        if load.model in self.stats:  # else the model left the router while the request ran
            self._release(load.model)

    def release_held(self) -> None:
        """Hand held batch requests to every instance with room (after a poll round). A model no longer
        served answers its held requests 404; one whose pool stopped autoscaling lets the route choose
        their instances, as for any request."""
        for model in list(self.hold.models):
            if model not in self.configs:
                self.hold.end(model, ApiError(404, f"the model {model!r} is no longer served here",
                                              code="model_not_found", param="model"))  # fmt: skip
            elif not self.holds(model):
                self.hold.end(model, None)
            else:
                self._release(model)

    def _release(self, model: str) -> None:
        if self.hold.waiting(model):  # every request's end comes here: nothing to do for most
            self.hold.release(model, list(self.loads.values()), self.mean_context(model), time.monotonic(),
                              self.coming.get(model, ()))  # fmt: skip

    def _count_other_models(self) -> None:
        """Give each (instance, model) load the requests of the instance's other models in flight and
        the model last sent there: a worker serving several models swaps between them (the
        estimated wait counts both, ``tessera.core.routing.estimated_wait``)."""
        per_instance: dict[str, int] = {}
        for (name, _), load in self.loads.items():
            per_instance[name] = per_instance.get(name, 0) + load.outstanding
        for (name, _), load in self.loads.items():
            load.other_outstanding = per_instance[name] - load.outstanding
            load.last_model = self.last_model.get(name)

    def _prefix_index(self, model: str) -> PrefixIndex:
        index = self.prefixes.get(model)
        if index is None:
            config = self.configs[model].model(model)
            capacity = config.kv_capacity_tokens if config is not None else 1_000_000
            index = self.prefixes[model] = PrefixIndex(
                max(1, capacity * CHARS_PER_TOKEN // DEFAULT_TEXT_BLOCK_CHARS)
            )
        return index

    def set_health(self, backend: str, healthy: bool) -> None:
        """Take an instance in or out of the rotation; one that leaves it may come back restarted, with
        an empty prefix cache, so what it was believed to hold is forgotten."""
        for (name, _), load in self.loads.items():
            if name == backend:
                if load.healthy and not healthy:
                    for model in self.prefixes:
                        self._forget(name, model)
                load.healthy = healthy

    def _forget(self, backend: str, model: str) -> None:
        """Forget which prompts ``backend`` holds for ``model``, and the sessions that stick to it."""
        index = self.prefixes.get(model)
        if index is not None:
            index.forget(backend)
        for session in [k for k, v in self.sessions.items() if v == backend]:
            del self.sessions[session]

    def observe(self, backend: str, metrics_text: str) -> None:
        """Apply a worker's /metrics: its current batch size per model, its engines' KV capacity and use
        (Chiron's dispatch reads them), its engines' start times (an engine that restarted between
        two polls lost its prefix cache: what it held is forgotten), and the LoRA adapters its engines
        hold and their slots (the adapter-affinity route reads them)."""
        # Only the lines of the families read here are parsed: a worker's exposition is mostly
        # histograms, and parsing all of it every poll was 7% of the router's CPU under load.
        wanted = "\n".join(line for line in metrics_text.splitlines() if line.startswith(_POLLED_LINES))
        resident: dict[str, set[str]] = {}  # base -> the adapters its engine holds
        bases: dict[str, str] = {}  # adapter -> its base
        slots: dict[str, int] = {}  # base -> its engine's adapter slots
        # base -> the adapters with requests in its batch (each holds a GPU slot) / waiting: what the
        # shared scorer reads as resident and waiting, as the simulator fills them
        running: dict[str, set[str]] = {}
        waiting: dict[str, set[str]] = {}
        for family in text_string_to_metric_families(wanted):
            if family.name not in _POLLED_FAMILIES:
                continue
            for sample in family.samples:
                model = sample.labels.get("model", "")
                if family.name == "tessera_lora_adapter_resident":
                    base = sample.labels.get("base", "")
                    bases[model] = base
                    if sample.value >= 1:
                        resident.setdefault(base, set()).add(model)
                    continue
                if family.name == "tessera_lora_adapter_requests":
                    base = sample.labels.get("base", "")
                    bases[model] = base
                    if sample.value >= 1:
                        state = sample.labels.get("state")
                        (running if state == "running" else waiting).setdefault(base, set()).add(model)
                    continue
                if family.name == "tessera_lora_slots":
                    slots[model] = max(0, int(sample.value))
                    continue
                load = self.loads.get((backend, model))
                if load is None:
                    continue
                if family.name == "tessera_batch_size":
                    if sample.value >= 1:
                        load.batch_size = int(sample.value)
                    continue
                if family.name == "tessera_engine_kv_capacity_tokens":
                    load.engine_kv_capacity = int(sample.value) if sample.value > 0 else None
                    continue
                if family.name == "tessera_engine_kv_used_tokens":
                    load.engine_kv_used = int(sample.value) if sample.value >= 0 else None
                    continue
                before = self.engine_started.get((backend, model))
                if before is not None and before != sample.value:
                    log.info("instance %s restarted its engine of %s: its prefix entries are dropped",
                             backend, model)  # fmt: skip
                    self._forget(backend, model)
                    # its first KV events may have been lost while the subscriber reconnected, so that
                    # their numbers do not show the restart
                    if model in self.engine_blocks:
                        self.engine_blocks[model].forget(backend)
                self.engine_started[(backend, model)] = sample.value
        for adapter, base in bases.items():
            load = self.loads.get((backend, adapter))
            if load is not None:
                load.adapter_of = base
                # In a GPU slot: running there. A worker that has reported no adapter request yet
                # (none arrived since it started) is read by what its engine holds.
                held = running.get(base) if running or waiting else resident.get(base)
                load.resident_adapters = frozenset(held or ())
                load.waiting_adapters = frozenset(waiting.get(base, ()))
                load.adapter_slots = slots.get(base, 0)

    def status(self) -> dict[str, Any]:
        """What ``/router/status`` shows."""
        classes: dict[str, dict[str, Any]] = {}
        for config in self.configs.values():
            for name, info in class_infos(config).items():
                classes.setdefault(name, info.to_json())
        return {"classHeader": self.class_header, "classes": classes, "instances": self.instance_rows(),
                "recentDecisions": list(self.recent), "clientSlo": self.delivered.rows(),
                "held": self.hold.held()}  # fmt: skip

    def instance_rows(self) -> list[dict[str, Any]]:
        """Every instance with its role, health, batch size, outstanding requests (and the prompt tokens
        it is expected to prefill for those without a first token yet, cache hits excluded) and
        estimated wait."""
        self._count_other_models()
        return [
            {
                "instance": x.instance,
                "model": x.model,
                "role": x.role,
                "healthy": x.healthy,
                "batchSize": x.batch_size,
                "outstanding": x.outstanding,
                "promptTokensBeforeFirstToken": x.prefill.tokens,
                "estimatedWaitSeconds": estimated_wait(x, self.stats[x.model], self.z),
                "prefixPromptTokens": self.prefix_tokens.get(x.instance, [0, 0])[0],
                "prefixCachedTokens": self.prefix_tokens.get(x.instance, [0, 0])[1],
                "cachedPrefixBlocks": self.prefixes[x.model].blocks(x.instance)
                if x.model in self.prefixes
                else 0,
                # blocks its engine reports holding (its KV events); None without a feed
                "engineCachedBlocks": self.engine_blocks[x.model].blocks(x.instance)
                if x.model in self.engine_blocks and self.engine_blocks[x.model].tracks(x.instance)
                else None,
            }
            for x in self.loads.values()
        ]


class RouterApp(FastAPI):
    """FastAPI for the router's own endpoints; a POST to one of ``relayed``'s paths (completions) goes
    to its plain ASGI handler instead, in front of FastAPI's middleware, routing and request
    machinery, and the answer's chunks go straight to the server's ``send``. Profiled at 100
    concurrent streams (``tessera bench router``, py-spy on the router): FastAPI's and Starlette's
    layers took about a fifth of the router's CPU, most of it wrapping ``send`` for every chunk of
    every stream. Another method on those paths is answered 405."""

    relayed: dict[str, ASGIApp]  # path -> its handler, set by create_router_app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.relayed.get(scope["path"]) if scope["type"] == "http" else None
        if handler is None:
            await super().__call__(scope, receive, send)
        elif scope["method"] != "POST":
            await method_not_allowed(scope["method"], scope["path"], "POST").response()(scope, receive, send)
        else:
            await handler(scope, receive, send)


def method_not_allowed(method: str, path: str, allowed: str) -> ApiError:
    """The 405 answer, naming the methods ``allowed``."""
    return ApiError(405, f"method {method} is not allowed on {path}; use {allowed}", code=405,
                    headers={"allow": allowed})  # fmt: skip


def internal_error(exc: Exception) -> JSONResponse:
    """The answer to a bug (logged): 500, the exception's type named."""
    log.exception("router error", exc_info=exc)
    return ApiError(500, f"internal router error ({type(exc).__name__}); retry the request").response()


async def poll(state: RouterState, client: httpx.AsyncClient) -> None:
    """One round of readiness and metrics polls over every instance."""

    async def one(backend: Backend) -> None:
        try:
            # Timed here: the router's transport bounds only the connect (an answer may last as long
            # as its generation).
            async with asyncio.timeout(POLL_TIMEOUT_S):
                ready = await client.get(f"{backend.url}/ready")
            async with asyncio.timeout(POLL_TIMEOUT_S):
                metrics = await client.get(f"{backend.url}/metrics")
        except (httpx.HTTPError, TimeoutError):
            state.set_health(backend.name, False)
            return
        state.set_health(backend.name, ready.status_code == 200)
        if metrics.status_code == 200:
            state.observe(backend.name, metrics.text)

    await asyncio.gather(*(one(b) for b in state.backends.values()))


def create_router_app(
    state: RouterState,
    *,
    poll_interval_s: float = POLL_INTERVAL_S,
    transport: httpx.AsyncBaseTransport | None = None,
    discover: Callable[[], Discovered] | None = None,
    limits: RouterLimits | None = None,
    api_keys: ApiKeys | None = None,
    activator: Activator | None = None,
    follow: Callable[[Discovered, Activator], None] | None = None,
    freeze_gc: bool = False,
    ops_apart: bool = False,
    batch: BatchLink | None = None,
    quota: QuotaStore | None = None,
) -> RouterApp:
    """The router's HTTP application over ``state`` (polling runs while the app runs).

    ``discover`` (cluster mode) is called before every poll round to refresh the backends; when it
    fails the backends stay as they were (logged). ``follow`` hands each discovery to ``activator`` (on a
    cluster: the groups the operator scales to zero, ``tessera.router.cluster_wake``) before the
    backends are replaced. ``limits`` bound what one client may send (default
    ``RouterLimits()``); ``api_keys`` turns on API-key authentication (re-read at every poll round when
    the file changed). ``transport`` carries everything sent to the instances, requests and polls
    (default ``tessera.router.upstream.UpstreamTransport``; tests give an ``httpx.MockTransport``).
    ``freeze_gc`` calls ``freeze_startup_objects`` once started (the ``tessera router`` process).
    ``ops_apart``: ``/metrics`` and ``/router/status`` are served by ``app.state.ops`` only, a second app
    for a port of their own (``tessera router --metrics-port``) that a NetworkPolicy admits from
    Prometheus alone; else by this app, behind an API key when ``api_keys`` is given.
    ``activator`` turns on scale to zero (``tessera.router.activator``): requests for
    a sleeping model are held until it has woken. ``quota`` enforces the API keys' tenant quotas
    (``tessera.router.quota``; without it, or without API keys, none is). ``batch`` forwards the Files
    and Batch APIs to the batch component and trusts its feeder (``tessera.router.batch_proxy``).
    ``app.state.limits`` and ``app.state.metrics`` are what
    ``tessera.router.protocol.router_server_config`` serves the app with."""
    limits = limits or RouterLimits()
    holder: dict[str, httpx.AsyncBaseTransport] = {}
    subscriptions = Subscriptions()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Requests are relayed straight through the transport (tessera.router.upstream: httpx's pool
        # and client layers cost more CPU than the relaying itself); polls go through an httpx client.
        holder["transport"] = upstream = transport or UpstreamTransport(CONNECT_TIMEOUT_S)
        http = httpx.AsyncClient(transport=upstream)

        async def refresh() -> None:
            if discover is not None:
                try:
                    found = await asyncio.to_thread(discover)
                    if follow is not None and activator is not None:
                        follow(found, activator)
                    state.update(found.backends, found.coming)
                except Exception as exc:  # the API server may be briefly unreachable: keep the last view
                    log.warning("backend discovery failed: %s", exc)
            if api_keys is not None:
                await asyncio.to_thread(api_keys.refresh)
            if quota is not None:
                await quota.renew()
            if state.uses_engine:
                subscriptions.sync(
                    (instance, model, endpoint, state.engine_blocks[model])
                    for (instance, model), endpoint in state.feeds.items()
                )
            await poll(state, http)
            state.release_held()

        await refresh()
        if freeze_gc:  # after the server's and the first poll's imports and objects
            freeze_startup_objects()

        async def poller() -> None:
            while True:
                await asyncio.sleep(poll_interval_s)
                await refresh()

        tasks = [asyncio.create_task(poller(), name="router-poller")]
        if activator is not None:
            tasks.append(asyncio.create_task(activator.run(), name="router-activator"))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await subscriptions.aclose()
            await http.aclose()  # and its transport
            if quota is not None:
                await quota.aclose()

    app = RouterApp(title="Tessera router", version="0.1.0", lifespan=lifespan)
    metrics = RouterMetrics(state.instance_rows, state.delivered)
    metrics.registry.register(HeldCollector(state.hold))
    if activator is not None:
        metrics.registry.register(ActivationCollector(activator))
    if quota is not None:
        metrics.registry.register(QuotaCollector(quota))
    app.state.limits = limits
    app.state.metrics = metrics

    @app.exception_handler(ApiError)
    async def _api_error(_: HttpRequest, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(http: HttpRequest, exc: StarletteHTTPException) -> JSONResponse:
        where = f"{http.method} {http.url.path}"
        if exc.status_code == 404:
            message = f"no such endpoint: {where}; this router serves {_ROUTES}"
        elif exc.status_code == 405:
            allowed = next((v for k, v in (exc.headers or {}).items() if k.lower() == "allow"), "")
            return method_not_allowed(http.method, http.url.path, allowed).response()
        else:
            message = f"{where}: {exc.detail}"
        return ApiError(exc.status_code, message, code=exc.status_code, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _bug(_: HttpRequest, exc: Exception) -> JSONResponse:
        return internal_error(exc)

    def caller_of(http: HttpRequest) -> Caller | None:
        """The request's API key (None without API keys); 400 for more than one Authorization header,
        with or without keys: which one counts would depend on the server, and with keys off they go on
        to the worker as sent."""
        sent = len(http.headers.getlist("authorization"))
        if sent > 1:
            raise ApiError(400, f"the request has {sent} Authorization headers (ambiguous credentials); send "
                           "one: 'Authorization: Bearer <key>'", code="ambiguous_credentials",
                           param="Authorization")  # fmt: skip
        return api_keys.authenticate(http.headers) if api_keys is not None else None

    @app.get("/health", summary="Liveness: the router process answers.")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", summary="Readiness: at least one instance is ready, or a sleeping model can wake.")
    async def ready() -> JSONResponse:
        up = sorted({x.instance for x in state.loads.values() if x.healthy})
        asleep = sorted(m for m in state.dormant if activator is not None and m in activator.unit_of)
        ok = bool(up or asleep)
        return JSONResponse({"ready": ok, "instances": up, "sleeping": asleep}, 200 if ok else 503)

    # What the router knows of every tenant's traffic: on the metrics port when it has one, else here,
    # behind an API key when keys are on.
    ops = FastAPI(title="Tessera router: metrics and status") if ops_apart else app
    app.state.ops = ops if ops_apart else None

    @ops.get("/router/status", summary="Instances, their load and estimated waits; the classes.")
    async def status(http: HttpRequest) -> dict[str, Any]:
        if not ops_apart:
            caller_of(http)
        return router_status(state, activator)

    @ops.get("/metrics", summary="Prometheus metrics of the router and its view of the instances.")
    async def prometheus_metrics(http: HttpRequest) -> Response:
        if not ops_apart:
            caller_of(http)
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")

    def model_cards(caller: Caller | None) -> list[dict[str, Any]]:
        return [
            {"id": name, "object": "model", "owned_by": "tessera", "max_model_len": entry.max_model_len}
            for name, config in sorted(state.configs.items())
            if (entry := config.model(name)) is not None and (caller is None or caller.may_use(name))
        ]

    @app.get("/v1/models", summary="Models served behind this router (those the API key may use).")
    async def models(http: HttpRequest) -> dict[str, Any]:
        return {"object": "list", "data": model_cards(caller_of(http))}

    # ``:path``: a model id holds slashes (the official client sends them encoded as %2F)
    @app.get("/v1/models/{model_id:path}", summary="One model served behind this router (OpenAI's retrieve).")
    async def one_model(model_id: str, http: HttpRequest) -> dict[str, Any]:
        caller = caller_of(http)
        if caller is not None:
            caller.check_model(model_id)
        cards = model_cards(caller)
        card = next((c for c in cards if c["id"] == model_id), None)
        if card is None:
            known = ", ".join(c["id"] for c in cards) or "(none)"
            raise ApiError(404, f"the model {model_id!r} is not served here; models: {known}",
                           code="model_not_found", param="model")  # fmt: skip
        return card

    if batch is not None:
        add_batch_routes(app, batch, caller_of, lambda: state.configs)

    async def relay(scope: Scope, receive: Receive, respond: Send) -> None:
        """Answer a POST to one of the relayed endpoints (a plain ASGI handler: see ``RouterApp``)."""
        http = HttpRequest(scope, receive)
        path = scope["path"]
        start = time.perf_counter()
        model = kind = ""  # metric labels, set once known (an unserved model stays "")
        service_class: ServiceClass | None = None  # the class's SLO, once known
        watch: ClientWatch | None = None
        counted = False  # the answer's status is in the metrics (a stream counts its own)
        tenant = ""  # the API key's tenant (keys on), for its metrics
        ticket: Ticket | None = None  # the request's claim on its tenant's quota, once admitted
        budget: dict[str, str] = {}  # the quota's rate-limit headers: on every answer after admission
        used: tuple[int, int] | None = None  # the answer's prompt and completion tokens, once known
        try:
            try:
                feeder, deadline = feeder_deadline(batch, http.headers)  # a batch line's: its job's expiry
                caller = feeder_caller(api_keys, http.headers) if feeder else caller_of(http)
                tenant = caller.tenant if caller is not None else ""
                raw = await read_body(http, limits)
                payload = parse_payload(raw)
                if caller is not None and not feeder:
                    caller.check_model(payload.model)
                model = payload.model if payload.model in state.configs else ""
                class_name, kind = state.classify(payload.model, http.headers)
                config = state.configs[payload.model]
                if caller is not None and not feeder:
                    caller.check_class(class_name, config.classes[class_name].match.header)
                headers = upstream_headers(http.headers.items(), drop_authorization=api_keys is not None)
                headers = without_token(headers)  # the feeder's token goes no further
                entry = config.model(payload.model)
                assert entry is not None  # classify refused a model no worker serves
                spec = config.class_spec(entry, class_name)  # the model's own SLO and priority of the class
                service_class = spec.to_service_class(class_name)
                slo = spec.slo.ttft_seconds
                session = http.headers.get(SESSION_HEADER) or payload.session
                token_ids = payload.prompt_token_ids
                if state.uses_engine and not token_ids and path == "/v1/completions":
                    token_ids = await state.tokenizers.encode(payload.model, payload.prompt_text)
                elif state.uses_engine and path == "/v1/chat/completions":
                    token_ids = await state.tokenizers.encode_chat(payload.model, payload.messages,
                                                                   payload.tools)  # fmt: skip
                prompt_tokens = len(token_ids) or len(payload.prompt_text) // CHARS_PER_TOKEN
                answer_tokens = payload.max_tokens or (COMPLETION_MAX_TOKENS if "chat" not in path else 1)
                too_large = state.oversize(payload.model, prompt_tokens, answer_tokens)
                if too_large is not None and token_ids:  # counted as its workers count them
                    where = "messages" if "chat" in path else "prompt"
                    where = where if prompt_tokens >= answer_tokens else "max_tokens"
                    raise ApiError(400, too_large, code="context_length_exceeded", param=where)
                prompt_estimate = len(token_ids) or max(1, len(payload.prompt_text) // CHARS_PER_TOKEN)
                if caller is not None:
                    headers += [(TENANT_HEADER, tenant), (TENANT_WEIGHT_HEADER, repr(caller.weight))]
                    if quota is not None and caller.limits.any:
                        # Counted as OpenAI does (prompt and max_tokens), corrected to the usage at the end.
                        charged = prompt_estimate + payload.max_tokens
                        admitted = await quota.admit(tenant, caller.limits, charged)
                        budget = rate_limit_headers(admitted.verdict)
                        if admitted.verdict.refused is not None:
                            raise refusal(tenant, caller.limits, admitted.verdict, charged)
                        ticket = admitted
                up = Upstream(path, raw, headers, payload.model, kind, payload.stream, payload.prompt_text,
                              slo, session, token_ids)  # fmt: skip
                bound = hold_bound(service_class, spec.queue.max_queue_time_seconds, spec.queue.max_queued)
                watch = ClientWatch(receive)
                # Too large by the text's estimate: not held for room that may never come, but sent at
                # once to an instance, whose worker counts the tokens and refuses it (or serves it).
                answer = await _activate_and_send(up, service_class, bound if too_large is None else None,
                                                  deadline)  # fmt: skip
            except ApiError as exc:
                end = time.perf_counter()
                metrics.answered(model, kind, exc.status, end - start, tenant)
                counted = True
                if tenant and exc.code in _TENANT_REFUSALS:
                    metrics.tenant_refused.labels(tenant, _TENANT_REFUSALS[exc.code]).inc()
                exc.headers = {**budget, **exc.headers}
                record_delivery(metrics, model, kind, service_class, status=exc.status, arrival=start,
                                finished=end, tenant=tenant)  # fmt: skip
                await exc.response()(scope, receive, respond)
                return
            upstream = answer.response
            out_headers = {**downstream_headers(upstream.headers.items(), answer.load.instance), **budget}
            if answer.streaming:
                counted = True
                raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in out_headers.items()]
                relayed = await relay_stream(respond, state, metrics, answer, raw_headers, model=model,
                                             kind=kind, start=start, service_class=service_class,
                                             tenant=tenant)  # fmt: skip
                used = (prompt_estimate, relayed)
                return
            end = time.perf_counter()
            metrics.answered(model, kind, upstream.status_code, end - start, tenant)
            counted = True
            # The answer comes in one piece: the client's first token is the answer itself.
            sent = end if upstream.status_code == 200 else None
            record_delivery(metrics, model, kind, service_class, status=upstream.status_code,
                            arrival=start, finished=end, first_token=sent, last_token=sent,
                            tokens=1 if sent else 0, tenant=tenant)  # fmt: skip
            if upstream.status_code == 200:
                used = _observe_usage(state, model, upstream.content)
            answered = Response(upstream.content, upstream.status_code, headers=out_headers)
            await answered(scope, receive, respond)
        except (ClientDisconnect, asyncio.CancelledError) as exc:
            # ClientDisconnect: the client left while sending the body. A cancellation is the watch's
            # when the client left later, else the server's (shutdown), which goes on.
            if isinstance(exc, asyncio.CancelledError):
                task = asyncio.current_task()
                if watch is None or not watch.left or task is None:
                    raise
                task.uncancel()
            if not counted:
                metrics.answered(model, kind, 499, time.perf_counter() - start, tenant)
                await Response(status_code=499)(scope, receive, respond)
        except Exception as exc:
            if counted:  # an answer may be under way: it cannot be replaced (the server closes it)
                raise
            await internal_error(exc)(scope, receive, respond)
        finally:
            if watch is not None:
                watch.stop()
            if ticket is not None:
                await _settle(ticket, used)

    async def _settle(ticket: Ticket, used: tuple[int, int] | None) -> None:
        """An admitted request ended: its tokens counted (the estimate corrected to its usage, where
        known) and its concurrency slot freed."""
        assert quota is not None
        if used is not None:
            metrics.tenant_tokens.labels(ticket.tenant, "prompt").inc(used[0])
            metrics.tenant_tokens.labels(ticket.tenant, "completion").inc(used[1])
            await quota.correct(ticket, sum(used))
        await quota.release(ticket)

    async def _hold_and_send(
        up: Upstream, service_class: ServiceClass, bound: HoldBound | None, deadline: float | None = None
    ) -> Answer:
        """``up`` sent through Chiron's dispatch where its model has one and ``bound`` is given (how long
        and how many of its class may be held; ``deadline``: the request's own, Unix time), else to the
        instance its route picks."""
        if bound is None or not state.holds(up.model):
            return await send(state, metrics, holder["transport"], up)
        prompt = len(up.prompt_token_ids) or len(up.prompt_text) // CHARS_PER_TOKEN
        loads, coming = list(state.loads.values()), state.coming.get(up.model, ())
        now = time.monotonic()
        own = None if deadline is None else to_clock(deadline, time.time(), now)
        instance = await state.hold.wait(up.model, service_class, now, loads, state.mean_context(up.model),
                                         coming, prompt, bound, own)  # fmt: skip
        state.hold.sent(instance, up.model, up.kind)  # send() counts it outstanding before it awaits anything
        return await send(state, metrics, holder["transport"], replace(up, instance=instance))

    async def _activate_and_send(
        up: Upstream, service_class: ServiceClass, bound: HoldBound | None, deadline: float | None = None
    ) -> Answer:
        if activator is None:
            return await _hold_and_send(up, service_class, bound, deadline)
        priority = service_class.priority
        await activator.admit(up.model, up.ttft_slo_s, priority)  # held here while the model sleeps or wakes
        try:
            return await _hold_and_send(up, service_class, bound, deadline)
        except ApiError as exc:
            # A followed group's instances all went away under the request: the operator is scaling it to
            # zero and discovery has not shown it yet. Held like any request for a cold model, not refused.
            if exc.code != "no_instance" or not activator.lost_instances(up.model):
                raise
        await activator.admit(up.model, up.ttft_slo_s, priority)
        return await _hold_and_send(up, service_class, bound, deadline)

    app.relayed = {"/v1/completions": relay, "/v1/chat/completions": relay}
    return app


def freeze_startup_objects() -> None:
    """Collect the garbage, then move every object that exists (modules, the app and its models: ~100k)
    out of the garbage collector's reach, for a process that is the router and nothing else, once it
    has started. Those objects live as long as the process, yet each full collection walked them all:
    measured at 100 concurrent streams, one took up to 70 ms of CPU, the event loop stalled meanwhile;
    frozen, a full collection walks only what requests made. Not for a process that hosts other parts
    or many routers one after another (tests): what is frozen is never collected, cycles included."""
    gc.collect()
    gc.freeze()


def router_status(state: RouterState, activator: Activator | None) -> dict[str, Any]:
    """What ``/router/status`` shows: the state's view, and the activator's units when it has one."""
    if activator is None:
        return state.status()
    return {**state.status(), "activation": activator.status()}


def _observe_usage(state: RouterState, model: str, content: bytes) -> tuple[int, int] | None:
    """Update the model's token statistics from a finished non-streamed answer's usage; its prompt and
    completion tokens (None without a usage that gives both)."""
    try:
        usage = json.loads(content).get("usage") or {}
    except (json.JSONDecodeError, AttributeError):
        return None
    stats = state.stats[model]
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if isinstance(prompt, int):
        stats.observe_input(prompt)
    if isinstance(completion, int) and completion > 0:
        stats.observe_output(completion)
    if isinstance(prompt, int) and isinstance(completion, int):
        return prompt, completion
    return None

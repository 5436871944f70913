"""The router: one OpenAI endpoint in front of every worker instance.

``POST /v1/completions`` and ``/v1/chat/completions`` (streaming or not) go to an instance chosen by
``tessera.router.balancer.choose`` (model, class, least estimated waiting time); the worker's answer is
relayed as it comes, status and headers included. ``GET /v1/models`` lists every model served,
``/health`` answers while the process lives, ``/ready`` when at least one instance is ready,
``/router/status`` shows the instances, their load and estimated waits, and the classes, and
``/metrics`` exports the same view and what clients saw to Prometheus (``tessera.router.metrics``).

The router counts the requests it has outstanding on each instance (exact and without delay) and
polls every instance's ``/ready`` and ``/metrics`` (``tessera_batch_size``) every ``poll_interval_s``.
A request whose instance cannot be reached is sent to the next best instance (nothing has been relayed
yet, so nothing is lost); an instance that fails a poll or a connection leaves the rotation until a poll
sees it ready again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from tessera.router.backends import Backend
from tessera.router.balancer import DEFAULT_Z, InstanceLoad, NoInstance, choose, estimated_wait, seed_stats
from tessera.router.metrics import RouterMetrics
from tessera.worker.config import WorkerConfig
from tessera.worker.core.request import ServiceClass
from tessera.worker.policies.qlm.estimator import TokenStats
from tessera.worker.server.errors import ApiError

POLL_INTERVAL_S = 1.0
log = logging.getLogger(__name__)
# Hop-by-hop and length headers are the transport's business, not the relayed answer's.
_DROP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding", "keep-alive"}


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


class RouterState:
    """Instances, their loads and the token statistics the balancer uses."""

    def __init__(self, backends: Sequence[Backend], *, z: float = DEFAULT_Z) -> None:
        self.z = z
        self.backends: dict[str, Backend] = {}
        self.loads: dict[tuple[str, str], InstanceLoad] = {}
        self.configs: dict[str, WorkerConfig] = {}  # model -> configuration of its first instance
        self.stats: dict[str, TokenStats] = {}
        self.class_header = ""
        self.update(backends)

    def update(self, backends: Sequence[Backend]) -> None:
        """Replace the backends (cluster discovery); instances that stay keep their load and health."""
        old = self.loads
        self.backends = {b.name: b for b in backends}
        self.loads = {}
        self.configs = {}
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
        self.stats = {m: self.stats.get(m) or seed_stats() for m in self.configs}
        self.class_header = next(iter(self.configs.values())).class_header if self.configs else ""

    def classify(self, model: str, headers: Mapping[str, str]) -> str:
        """The class kind of a request (class header in ``headers``); ApiError 404/400 for an unknown
        model or class."""
        config = self.configs.get(model)
        if config is None:
            known = ", ".join(sorted(self.configs)) or "(none)"
            raise ApiError(404, f"the model {model!r} is not served here; models: {known}",
                           code="model_not_found", param="model")  # fmt: skip
        header_value = headers.get(config.class_header)
        entry = config.model(model)
        assert entry is not None
        name = config.default_class(entry) if not header_value else config.class_for_header(header_value)
        if name is None:
            known = ", ".join(spec.header_value(n) for n, spec in config.classes.items())
            raise ApiError(400, f"unknown request class {header_value!r} in header {config.class_header}; "
                           f"this service accepts: {known}", code="unknown_class",
                           param=config.class_header)  # fmt: skip
        return config.classes[name].kind

    def pick(self, model: str, kind: str, exclude: set[str]) -> InstanceLoad:
        """The instance for a request (not one of ``exclude``)."""
        loads = [x for x in self.loads.values() if x.instance not in exclude]
        return choose(loads, model, kind, self.stats[model], self.z)

    def set_health(self, backend: str, healthy: bool) -> None:
        """Take an instance in or out of the rotation."""
        for (name, _), load in self.loads.items():
            if name == backend:
                load.healthy = healthy

    def observe(self, backend: str, metrics_text: str) -> None:
        """Apply a worker's /metrics: its current batch size per model."""
        for family in text_string_to_metric_families(metrics_text):
            if family.name != "tessera_batch_size":
                continue
            for sample in family.samples:
                load = self.loads.get((backend, sample.labels.get("model", "")))
                if load is not None and sample.value >= 1:
                    load.batch_size = int(sample.value)

    def status(self) -> dict[str, Any]:
        """What ``/router/status`` shows."""
        classes: dict[str, dict[str, Any]] = {}
        for config in self.configs.values():
            for name, info in class_infos(config).items():
                classes.setdefault(name, info.to_json())
        return {"classHeader": self.class_header, "classes": classes, "instances": self.instance_rows()}

    def instance_rows(self) -> list[dict[str, Any]]:
        """Every instance with its role, health, batch size, outstanding requests and estimated wait."""
        return [
            {
                "instance": x.instance,
                "url": self.backends[x.instance].url,
                "model": x.model,
                "role": x.role,
                "healthy": x.healthy,
                "batchSize": x.batch_size,
                "outstanding": x.outstanding,
                "estimatedWaitSeconds": estimated_wait(x, self.stats[x.model], self.z),
            }
            for x in self.loads.values()
        ]


async def poll(state: RouterState, client: httpx.AsyncClient) -> None:
    """One round of readiness and metrics polls over every instance."""

    async def one(backend: Backend) -> None:
        try:
            ready = await client.get(f"{backend.url}/ready", timeout=2.0)
            metrics = await client.get(f"{backend.url}/metrics", timeout=2.0)
        except httpx.HTTPError:
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
    client: httpx.AsyncClient | None = None,
    discover: Callable[[], list[Backend]] | None = None,
) -> FastAPI:
    """The router's HTTP application over ``state`` (polling runs while the app runs).

    ``discover`` (cluster mode) is called before every poll round to refresh the backends; when it
    fails the backends stay as they were (logged)."""
    holder: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        http = client or httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                           limits=httpx.Limits(max_connections=None))  # fmt: skip
        holder["client"] = http

        async def refresh() -> None:
            if discover is not None:
                try:
                    state.update(await asyncio.to_thread(discover))
                except Exception as exc:  # the API server may be briefly unreachable: keep the last view
                    log.warning("backend discovery failed: %s", exc)
            await poll(state, http)

        await refresh()

        async def poller() -> None:
            while True:
                await asyncio.sleep(poll_interval_s)
                await refresh()

        task = asyncio.create_task(poller(), name="router-poller")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if client is None:
                await http.aclose()

    app = FastAPI(title="Tessera router", version="0.1.0", lifespan=lifespan)
    metrics = RouterMetrics(state.instance_rows)

    @app.exception_handler(ApiError)
    async def _api_error(_: HttpRequest, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.get("/health", summary="Liveness: the router process answers.")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", summary="Readiness: at least one instance is ready.")
    async def ready() -> JSONResponse:
        up = sorted({x.instance for x in state.loads.values() if x.healthy})
        return JSONResponse({"ready": bool(up), "instances": up}, 200 if up else 503)

    @app.get("/router/status", summary="Instances, their load and estimated waits; the classes.")
    async def status() -> dict[str, Any]:
        return state.status()

    @app.get("/metrics", summary="Prometheus metrics of the router and its view of the instances.")
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", summary="Models served behind this router.")
    async def models() -> dict[str, Any]:
        data = [
            {"id": name, "object": "model", "owned_by": "tessera", "max_model_len": entry.max_model_len}
            for name, config in sorted(state.configs.items())
            if (entry := config.model(name)) is not None
        ]
        return {"object": "list", "data": data}

    async def relay(http: HttpRequest, path: str) -> Response:
        start = time.perf_counter()
        model = kind = ""  # metric labels, set once known (an unserved model stays "")
        try:
            raw = await http.body()
            try:
                body = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
            asked = body.get("model") if isinstance(body, dict) else None
            if not isinstance(asked, str):
                raise ApiError(400, "the request body must be a JSON object with a string field 'model'",
                               param="model")  # fmt: skip
            model = asked if asked in state.configs else ""
            kind = state.classify(asked, http.headers)
            load, upstream = await connect(asked, kind, path, raw, http.headers)
        except ApiError as exc:
            metrics.answered(model, kind, exc.status, time.perf_counter() - start)
            raise
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_HEADERS}
        out_headers["x-tessera-instance"] = load.instance
        if not body.get("stream"):
            try:
                content = await upstream.aread()
            finally:
                await upstream.aclose()
                load.outstanding -= 1
                metrics.answered(model, kind, upstream.status_code, time.perf_counter() - start)
            _observe_usage(state, model, body, content)
            return Response(content, upstream.status_code, headers=out_headers)

        async def events() -> AsyncIterator[str]:
            tokens = 0
            try:
                async for line in upstream.aiter_lines():
                    # Token chunks are the ones whose choice is not finished (an estimate for stats).
                    if line.startswith("data: {") and '"finish_reason": null' in line:
                        if not tokens:
                            metrics.ttft.labels(model, kind).observe(time.perf_counter() - start)
                        tokens += 1
                    yield line + "\n"
            finally:
                await upstream.aclose()
                load.outstanding -= 1
                metrics.answered(model, kind, upstream.status_code, time.perf_counter() - start)
                if tokens:
                    state.stats[model].observe_output(tokens)

        return StreamingResponse(events(), upstream.status_code, headers=out_headers)

    async def connect(
        model: str, kind: str, path: str, raw: bytes, incoming: Mapping[str, str]
    ) -> tuple[InstanceLoad, httpx.Response]:
        """Send the request to the best instance, the next best while connections fail; the chosen
        instance counts it outstanding. ApiError 503 when no instance is left."""
        headers = {k: v for k, v in incoming.items() if k.lower() not in ("host", "content-length")}
        tried: set[str] = set()
        while True:
            try:
                load = state.pick(model, kind, tried)
            except NoInstance as exc:
                raise ApiError(503, f"{exc}; retry when an instance is ready", code="no_instance") from None
            tried.add(load.instance)
            url = f"{state.backends[load.instance].url}{path}"
            request = holder["client"].build_request("POST", url, content=raw, headers=headers)
            load.outstanding += 1
            try:
                return load, await holder["client"].send(request, stream=True)
            except httpx.HTTPError:
                load.outstanding -= 1
                state.set_health(load.instance, False)
                metrics.upstream_failures.labels(load.instance).inc()

    @app.post("/v1/completions", summary="OpenAI completions, routed to a worker instance.")
    async def completions(http: HttpRequest) -> Response:
        return await relay(http, "/v1/completions")

    @app.post("/v1/chat/completions", summary="OpenAI chat completions, routed to a worker instance.")
    async def chat_completions(http: HttpRequest) -> Response:
        return await relay(http, "/v1/chat/completions")

    return app


def _observe_usage(state: RouterState, model: str, body: dict[str, Any], content: bytes) -> None:
    """Update the model's token statistics from a finished non-streamed answer's usage."""
    try:
        usage = json.loads(content).get("usage") or {}
    except (json.JSONDecodeError, AttributeError):
        return
    stats = state.stats[model]
    if isinstance(usage.get("prompt_tokens"), int):
        stats.observe_input(usage["prompt_tokens"])
    if isinstance(usage.get("completion_tokens"), int) and usage["completion_tokens"] > 0:
        stats.observe_output(usage["completion_tokens"])

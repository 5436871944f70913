"""The router's side of the batch component (``tessera batch``): its API forwarded, its feeder trusted.

With ``tessera router --batch-url URL`` (the secret in ``TESSERA_BATCH_TOKEN``), ``/v1/files`` and
``/v1/batches`` (and below) go to the batch component: the router authenticates the caller as for any
request (API keys) and names its tenant and the served models it may use (``tessera.api.batch_link``),
so every file and batch belongs to one API key's tenant. A request carrying the token is the feeder's:
it skips the API-key check (the job's owner was checked at creation) but names the job's tenant
(``x-tessera-tenant``), whose quota and fair-share weight it counts against as that tenant's own
requests do (``feeder_caller``); its ``x-tessera-deadline`` goes on to the worker and into Chiron's hold,
and the token itself goes no further. Any other client's
``x-tessera-deadline`` is refused (403): a deadline reorders queues, so only the batch component sets it.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import httpx
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import Response

from tessera.api.batch_link import (
    CLASSES_HEADER,
    DEADLINE_HEADER,
    MODELS_HEADER,
    NO_KEYS_TENANT,
    TENANT_HEADER,
    TOKEN_HEADER,
    parse_deadline,
)
from tessera.api.openai_errors import ApiError
from tessera.api.worker_config import WorkerConfig
from tessera.router.auth import ApiKeys, Caller

# Largest body forwarded (an upload): the batch component's file limit plus the multipart framing.
MAX_FORWARD_BYTES = 100 * 1024 * 1024 + 64 * 1024
TIMEOUT_S = 120.0  # an upload or download of the largest file on a slow link
_PATHS = {  # path -> methods
    "/v1/files": ["GET", "POST"],
    "/v1/files/{file_id}": ["GET", "DELETE"],
    "/v1/files/{file_id}/content": ["GET"],
    "/v1/batches": ["GET", "POST"],
    "/v1/batches/{batch_id}": ["GET"],
    "/v1/batches/{batch_id}/cancel": ["POST"],
}
_KEPT = ("content-type", "accept")  # request headers the batch component reads


@dataclass(frozen=True, slots=True)
class BatchLink:
    """Where the batch component listens and the secret the router shares with it."""

    url: str
    token: str

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--batch-url must be an http(s) URL, got {self.url!r}")
        if len(self.token) < 16:
            raise ValueError("the batch token (TESSERA_BATCH_TOKEN) must have at least 16 characters")

    def is_feeder(self, headers: Mapping[str, str]) -> bool:
        """Whether a request carries the batch component's token."""
        sent = headers.get(TOKEN_HEADER)
        return sent is not None and hmac.compare_digest(sent.encode(), self.token.encode())


def feeder_deadline(link: BatchLink | None, headers: Mapping[str, str]) -> tuple[bool, float | None]:
    """Whether a request is the feeder's, and its deadline (Unix time); ApiError 403 for a deadline
    from anyone else, 400 for one that is not a time."""
    feeder = link is not None and link.is_feeder(headers)
    value = headers.get(DEADLINE_HEADER)
    if value is None:
        return feeder, None
    if not feeder:
        raise ApiError(403, f"{DEADLINE_HEADER} is set by the batch component only; use /v1/batches for "
                            "work with a deadline", param=DEADLINE_HEADER)  # fmt: skip
    try:
        return feeder, parse_deadline(value)
    except ValueError as exc:
        raise ApiError(400, str(exc), param=DEADLINE_HEADER) from None


def feeder_caller(keys: ApiKeys | None, headers: Mapping[str, str]) -> Caller | None:
    """The caller a feeder's line counts against: the tenant it names (None without API keys); ApiError
    403 for a tenant with no key left (it lost its access after the job was created)."""
    if keys is None:
        return None
    tenant = headers.get(TENANT_HEADER, "")
    caller = keys.tenant_caller(tenant)
    if caller is None:
        raise ApiError(403, f"the batch line's tenant {tenant!r} has no API key any more",
                       code="tenant_unknown", param=TENANT_HEADER)  # fmt: skip
    return caller


def without_token(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Upstream headers less the feeder's token (workers never see it)."""
    return [(k, v) for k, v in headers if k.lower() != TOKEN_HEADER]


def batch_classes(configs: Mapping[str, WorkerConfig], caller: Caller | None) -> dict[str, list[str]]:
    """The batch classes served that ``caller`` may use: name -> [its header, the value selecting it]."""
    found: dict[str, list[str]] = {}
    for config in configs.values():
        for name, spec in config.classes.items():
            if spec.kind == "batch" and (caller is None or caller.classes is None or name in caller.classes):
                found.setdefault(name, [spec.match.header, spec.header_value(name)])
    return found


def add_batch_routes(
    app: FastAPI,
    link: BatchLink,
    caller_of: Callable[[HttpRequest], Caller | None],
    served: Callable[[], Mapping[str, WorkerConfig]],
) -> None:
    """Forward the Files and Batch endpoints of ``app`` to the batch component; ``served``: model ->
    the configuration of its instances, now (a caller with API keys sees the models and classes it may
    use)."""

    async def forward(http: HttpRequest) -> Response:
        caller = caller_of(http)
        configs = served()
        models = [m for m in sorted(configs) if caller is None or caller.may_use(m)]
        headers = {k: v for k, v in http.headers.items() if k.lower() in _KEPT}
        headers |= {TOKEN_HEADER: link.token, TENANT_HEADER: caller.tenant if caller else NO_KEYS_TENANT,
                    MODELS_HEADER: ",".join(models),
                    CLASSES_HEADER: json.dumps(batch_classes(configs, caller))}  # fmt: skip
        body = b""
        async for chunk in http.stream():
            body += chunk
            if len(body) > MAX_FORWARD_BYTES:
                raise ApiError(413, f"the request body is larger than {MAX_FORWARD_BYTES} bytes",
                               code="file_too_large")  # fmt: skip
        url = link.url.rstrip("/") + http.url.path
        try:
            async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
                answer = await client.request(http.method, url, params=list(http.query_params.multi_items()),
                                              headers=headers, content=body)  # fmt: skip
        except httpx.HTTPError as exc:
            raise ApiError(503, f"the batch component did not answer ({type(exc).__name__}); retry",
                           code="batch_unavailable", headers={"retry-after": "5"}) from None  # fmt: skip
        kept = {k: v for k, v in answer.headers.items() if k.lower() == "content-type"}
        return Response(answer.content, answer.status_code, headers=kept)

    for path, methods in _PATHS.items():
        app.add_api_route(path, forward, methods=methods, summary="Forwarded to the batch component.")

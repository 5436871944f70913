"""The batch component's HTTP API: OpenAI's Files and Batch endpoints, behind the router.

``POST /v1/files`` (multipart: ``file``, ``purpose=batch``), ``GET /v1/files`` (``purpose``, ``after``,
``limit``), ``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``;
``POST /v1/batches`` (``input_file_id``, ``endpoint``, ``completion_window``, ``metadata``),
``GET /v1/batches`` (``after``, ``limit``), ``GET /v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``;
``/health``; ``/metrics`` (the backlog, ``tessera.batch.metrics``). Objects and errors have OpenAI's
shapes.

Every request but ``/health`` and ``/metrics`` must carry the router's token
(``tessera.api.batch_link``); the tenant it names owns what it creates, and another tenant's file or
batch does not exist for it (404, never 403: one tenant learns nothing of another's ids).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI, File, Form, Query, UploadFile
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from tessera.api.batch_link import CLASSES_HEADER, MODELS_HEADER, TENANT_HEADER, TOKEN_HEADER
from tessera.api.openai_errors import ApiError
from tessera.batch.feeder import Feeder
from tessera.batch.metrics import backlog_registry
from tessera.batch.rules import ENDPOINTS, MAX_FILE_BYTES, WindowError, window_seconds
from tessera.batch.store import BatchStore

PURPOSES = ("batch",)  # what may be uploaded (outputs are written as batch_output)
MAX_METADATA_PAIRS = 16  # OpenAI's metadata bounds
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


class CreateBatch(BaseModel):
    """The body of ``POST /v1/batches``."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's file object."""
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
            "expires_at": None, "status_details": None}  # fmt: skip


def batch_object(row: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's batch object."""
    stamps = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
              "expired_at", "cancelling_at", "cancelled_at")  # fmt: skip
    return {
        "id": row["id"], "object": "batch", "endpoint": row["endpoint"],
        "errors": json.loads(row["errors"]) if row["errors"] else None,
        "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
        "status": row["status"], "output_file_id": row["output_file_id"],
        "error_file_id": row["error_file_id"], **{k: row[k] for k in stamps},
        "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
        "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
    }  # fmt: skip


def _page(items: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    data = items[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(items) > limit}  # fmt: skip


def _metadata_error(metadata: dict[str, str] | None) -> str | None:
    if metadata is None:
        return None
    if len(metadata) > MAX_METADATA_PAIRS:
        return f"metadata has {len(metadata)} keys; at most {MAX_METADATA_PAIRS} are allowed"
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            return (f"metadata keys are at most {MAX_METADATA_KEY} characters and values at most "
                    f"{MAX_METADATA_VALUE}; {key[:80]!r} is longer")  # fmt: skip
    return None


def create_batch_app(store: BatchStore, feeder: Feeder, token: str, class_name: str | None = None) -> FastAPI:
    """The API over ``store``; ``feeder`` runs while the app runs; ``token``: the router's secret;
    ``class_name``: the request class of every line (None: the one batch class the router names)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(feeder.run(), name="batch-feeder")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app = FastAPI(title="Tessera batch", version="0.1.0", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(_: HttpRequest, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        problems = [f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}"
                    for e in exc.errors()]  # fmt: skip
        return ApiError(400, "invalid request: " + "; ".join(problems)).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(http: HttpRequest, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError(exc.status_code, f"{http.method} {http.url.path}: {exc.detail}").response()

    def tenant_of(http: HttpRequest) -> str:
        sent = http.headers.get(TOKEN_HEADER, "")
        if not hmac.compare_digest(sent.encode(), token.encode()):
            raise ApiError(401, "the batch component answers the router only (missing or wrong "
                                f"{TOKEN_HEADER}); call the router's /v1/files and /v1/batches")  # fmt: skip
        tenant = http.headers.get(TENANT_HEADER)
        if not tenant:
            raise ApiError(400, f"missing {TENANT_HEADER}", param=TENANT_HEADER)
        return tenant

    def models_of(http: HttpRequest) -> list[str] | None:
        value = http.headers.get(MODELS_HEADER)
        return None if value is None else [m for m in value.split(",") if m]

    def batch_class_of(http: HttpRequest) -> tuple[str, str, str]:
        try:
            classes = json.loads(http.headers.get(CLASSES_HEADER, "{}"))
        except json.JSONDecodeError:
            classes = {}
        if class_name is not None:
            if class_name not in classes:
                raise ApiError(400, f"the batch class {class_name!r} (tessera batch --class) is not served "
                                    f"or not allowed for this API key; batch classes: "
                                    f"{', '.join(sorted(classes)) or '(none)'}")  # fmt: skip
            header, value = classes[class_name]
            return str(header), str(value), class_name
        if len(classes) != 1:
            raise ApiError(400, "batch jobs need exactly one request class of kind batch that this API key "
                                f"may use; there are: {', '.join(sorted(classes)) or '(none)'} (pick one "
                                "with tessera batch --class)")  # fmt: skip
        name, (header, value) = next(iter(classes.items()))
        return str(header), str(value), str(name)

    def now() -> int:
        return int(time.time())

    def own_file(tenant: str, file_id: str) -> dict[str, Any]:
        row = store.file(tenant, file_id)
        if row is None:
            raise ApiError(404, f"no such file: {file_id}", code="file_not_found", param="file_id")
        return row

    def own_batch(tenant: str, batch_id: str) -> dict[str, Any]:
        row = store.batch(tenant, batch_id)
        if row is None:
            raise ApiError(404, f"no such batch: {batch_id}", code="batch_not_found", param="batch_id")
        return row

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    registry = backlog_registry(store)

    @app.get("/metrics")
    async def metrics() -> Response:
        # No token: Prometheus scrapes it; it tells counts by model and class, nothing of a tenant.
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/files")
    async def upload(http: HttpRequest, file: Annotated[UploadFile, File()],
                     purpose: Annotated[str, Form()]) -> dict[str, Any]:  # fmt: skip
        tenant = tenant_of(http)
        if purpose not in PURPOSES:
            raise ApiError(400, f"purpose {purpose!r} is not served here; use: {', '.join(PURPOSES)}",
                           param="purpose")  # fmt: skip
        data = await file.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise ApiError(413, f"the file is larger than {MAX_FILE_BYTES} bytes", code="file_too_large",
                           param="file")  # fmt: skip
        if not data.strip():
            raise ApiError(400, "the file is empty", code="empty_file", param="file")
        name = (file.filename or "upload.jsonl")[:255]
        return file_object(store.add_file(tenant, name, purpose, data, now()))

    @app.get("/v1/files")
    async def list_files(
        http: HttpRequest,
        purpose: str | None = None,
        after: str | None = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    ) -> dict[str, Any]:
        rows = store.files(tenant_of(http), purpose, after, limit + 1)
        return _page([file_object(r) for r in rows], limit)

    @app.get("/v1/files/{file_id}")
    async def get_file(http: HttpRequest, file_id: str) -> dict[str, Any]:
        return file_object(own_file(tenant_of(http), file_id))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(http: HttpRequest, file_id: str) -> Response:
        row = own_file(tenant_of(http), file_id)
        return Response(store.read_file(row["id"]), media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(http: HttpRequest, file_id: str) -> dict[str, Any]:
        tenant = tenant_of(http)
        own_file(tenant, file_id)
        store.delete_file(tenant, file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @app.post("/v1/batches")
    async def create(http: HttpRequest, body: CreateBatch) -> dict[str, Any]:
        tenant = tenant_of(http)
        if body.endpoint not in ENDPOINTS:
            raise ApiError(400, f"endpoint {body.endpoint!r} is not served for batches; use one of: "
                                f"{', '.join(ENDPOINTS)}", param="endpoint")  # fmt: skip
        try:
            window_s = window_seconds(body.completion_window)
        except WindowError as exc:
            raise ApiError(400, str(exc), param="completion_window") from None
        problem = _metadata_error(body.metadata)
        if problem is not None:
            raise ApiError(400, problem, param="metadata")
        source = own_file(tenant, body.input_file_id)
        if source["purpose"] != "batch":
            raise ApiError(400, f"the file {source['id']} has purpose {source['purpose']!r}, not 'batch'",
                           param="input_file_id")  # fmt: skip
        row = store.create_batch(tenant, source["id"], body.endpoint, body.completion_window, window_s,
                                 body.metadata, models_of(http), batch_class_of(http), now())  # fmt: skip
        feeder.wake.set()
        return batch_object(row)

    @app.get("/v1/batches")
    async def list_batches(http: HttpRequest, after: str | None = None,
                           limit: Annotated[int, Query(ge=1, le=100)] = 20) -> dict[str, Any]:  # fmt: skip
        rows = store.batches(tenant_of(http), after, limit + 1)
        return _page([batch_object(r) for r in rows], limit)

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(http: HttpRequest, batch_id: str) -> dict[str, Any]:
        return batch_object(own_batch(tenant_of(http), batch_id))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel(http: HttpRequest, batch_id: str) -> dict[str, Any]:
        tenant = tenant_of(http)
        row = own_batch(tenant, batch_id)
        if row["status"] in ("validating", "in_progress"):
            store.set_status(batch_id, "cancelling", now(), only_from=("validating", "in_progress"))
            feeder.wake.set()
        elif row["status"] not in ("cancelling", "cancelled"):
            raise ApiError(409, f"batch {batch_id} is {row['status']}; only a validating or in-progress "
                                "batch can be cancelled", code="batch_not_cancellable")  # fmt: skip
        return batch_object(own_batch(tenant, batch_id))

    return app

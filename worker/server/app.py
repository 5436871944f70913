"""The worker's FastAPI application.

``/v1/completions`` and ``/v1/chat/completions`` (SSE streaming or not), ``/v1/models`` (and
``/v1/models/{id}``),
``/health`` (process alive), ``/ready`` (engines healthy, not draining), ``/metrics``
(Prometheus), ``POST /admin/reload`` (bearer token), ``/openapi.json``.

A request is tokenized, checked against the context length, classified by its class headers (each
class's own ``match.header``; else the model's default class) and handed to the model's scheduler;
the handler then relays its tokens. While a request waits, the handler polls for a client
disconnect, so an abandoned request leaves the queue (or is aborted in the engine) within
``DISCONNECT_POLL_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tessera.api.batch_link import DEADLINE_HEADER, parse_deadline, to_clock
from tessera.api.chat import message_dicts
from tessera.api.openai_errors import ApiError
from tessera.api.tenant import TENANT_HEADER, TENANT_WEIGHT_HEADER, parse_weight
from tessera.api.worker_config import BENCH_TRUE_LENGTH_HEADER, ClassHeaderError, ConfigError, parse_config
from tessera.core.request import Request
from tessera.worker.engines.base import EngineError, TokenDelta
from tessera.worker.runtime import Worker
from tessera.worker.scheduler import Job, QueueFull
from tessera.worker.server.schemas import (
    AUTO_TOOLS,
    AdminReloadResult,
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
)
from tessera.worker.tool_calls import ToolCallReader

DISCONNECT_POLL_S = 0.2
_ERRORS = {
    400: {"description": "Invalid request (OpenAI-style error body)."},
    404: {"description": "Unknown model."},
    429: {"description": "Queue full; see Retry-After."},
    503: {"description": "Engine unavailable or worker draining."},
}


def create_app(worker: Worker, *, manage_worker: bool = True) -> FastAPI:
    """The HTTP application over ``worker`` (started and stopped with the app when ``manage_worker``)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_worker:
            await worker.start()
        try:
            yield
        finally:
            if manage_worker:
                await worker.stop()

    app = FastAPI(title="Tessera worker", version="0.1.0", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(_: HttpRequest, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: HttpRequest, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail)).response()

    @app.get("/health", summary="Liveness: the worker process answers.")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/ready", summary="Readiness: every engine healthy and not draining.", responses={503: _ERRORS[503]}
    )
    async def ready() -> JSONResponse:
        sched = worker.scheduler
        engines = {name: slot.ok for name, slot in sched.slots.items()}
        policies = dict.fromkeys(sched.slots, sched.policy_ok)
        ok = worker.ready()
        return JSONResponse(
            {"ready": ok, "engines": engines, "policies": policies, "draining": worker.draining},
            200 if ok else 503,
        )

    @app.get("/metrics", summary="Prometheus metrics.")
    async def metrics() -> Response:
        return Response(worker.metrics.exposition(), media_type="text/plain; version=0.0.4")

    def model_cards() -> list[dict[str, Any]]:
        return [
            {"id": m.name, "object": "model", "owned_by": "tessera", "max_model_len": m.max_model_len}
            for m in worker.config.models
        ]

    @app.get("/v1/models", summary="Models served by this worker.")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": model_cards()}

    @app.get("/v1/models/{model_id:path}", summary="One model served by this worker.", responses=_ERRORS)
    async def one_model(model_id: str) -> dict[str, Any]:
        card = next((c for c in model_cards() if c["id"] == model_id), None)
        if card is None:
            known = ", ".join(m.name for m in worker.config.models)
            raise ApiError(404, f"the model {model_id!r} does not exist here; models: {known}",
                           code="model_not_found", param="model")  # fmt: skip
        return card

    @app.post("/v1/completions", summary="OpenAI completions (streaming or not).", responses=_ERRORS)
    async def completions(body: CompletionRequest, http: HttpRequest) -> Response:
        _, engine, cls = _route(worker, body.model, http)
        if isinstance(body.prompt, str):
            prompt_text = body.prompt
            prompt_ids = await _engine_call(engine.tokenize(body.prompt))
        else:
            prompt_ids = list(body.prompt)
            prompt_text = await _engine_call(engine.detokenize(prompt_ids))
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        echo = prompt_text if body.echo else ""
        return await _serve(
            worker, body, http, prompt_ids, prompt_text, max_tokens, cls, chat=False, echo=echo
        )

    @app.post(
        "/v1/chat/completions", summary="OpenAI chat completions (streaming or not).", responses=_ERRORS
    )
    async def chat_completions(body: ChatCompletionRequest, http: HttpRequest) -> Response:
        entry, engine, cls = _route(worker, body.model, http)
        messages = message_dicts(body.messages)
        tools = body.tool_dicts()
        # Read with the model's tool parser: auto always (refused without one); 'required' and named
        # choices where the model has one, as vLLM's server with that parser serves them.
        parsed = body.auto_tools() or (body.calls_tools() and body.model in worker.tool_parsers)
        reader = _tool_reader(worker, body, messages, tools) if parsed else None
        rendered = engine.tokenize_chat(messages, tools) if tools else engine.tokenize_chat(messages)
        prompt_ids = await _engine_call(rendered)
        max_tokens = (
            body.max_tokens or body.max_completion_tokens or max(1, entry.max_model_len - len(prompt_ids))
        )
        prompt_text = chat_prompt_text(messages)
        return await _serve(
            worker, body, http, prompt_ids, prompt_text, max_tokens, cls, chat=True, reader=reader
        )

    @app.post(
        "/admin/reload",
        summary="Reload policy, classes and batch bounds without a restart (bearer token).",
        responses={401: {"description": "Missing or wrong token."}, 400: _ERRORS[400]},
    )
    async def admin_reload(http: HttpRequest) -> AdminReloadResult:
        try:
            token = worker.config.admin.token()
        except ConfigError as exc:
            raise ApiError(403, str(exc), code="admin_disabled") from None
        if token is None:
            raise ApiError(403, "the admin endpoint is disabled: configure admin.tokenEnv or admin.tokenFile")
        if http.headers.getlist("authorization") != [f"Bearer {token}"]:  # one header, the token
            raise ApiError(401, "missing or wrong admin token; send 'Authorization: Bearer <token>'")
        raw = await http.body()
        try:
            new = (
                parse_config(json.loads(raw), where="configuration in the request body")
                if raw.strip()
                else None
            )
            config = worker.reload(new)
        except json.JSONDecodeError as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}") from None
        except (ConfigError, ValueError) as exc:
            raise ApiError(400, str(exc), code="invalid_configuration") from None
        b = config.scheduling.batch
        return AdminReloadResult(
            policy=config.scheduling.policy, classes=list(config.classes), batch_min=b.min, batch_max=b.max
        )

    return app


def _validation_error(exc: RequestValidationError) -> ApiError:
    problems = []
    param = None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            return ApiError(400, f"the request body is not valid JSON: {err.get('ctx', {}).get('error', '')}")
        where = ".".join(loc) or "body"
        param = param or where
        # pydantic says "Input should be a finite number"; NaN against a bound read as out of range
        message = "must be a finite number" if err.get("type") == "finite_number" else err.get("msg")
        problems.append(f"{where}: {message}")
    return ApiError(400, "invalid request: " + "; ".join(problems), param=param)


def _tool_reader(
    worker: Worker, body: ChatCompletionRequest, messages: list[dict[str, Any]], tools: Any
) -> ToolCallReader:
    """The reader of the calls of a request with tools: 400 when the model has no tool parser (auto) or
    vLLM's request model refuses the request."""
    parser = worker.tool_parsers.get(body.model)
    if parser is None:
        raise ApiError(400, AUTO_TOOLS.format(model=body.model), param="tool_choice")
    choice = body.tool_choice
    named = isinstance(choice, NamedToolChoice)
    request = {"model": body.model, "messages": messages, "tools": tools,
               "tool_choice": choice.model_dump() if named else choice or "auto"}  # fmt: skip
    if body.parallel_tool_calls is not None:
        request["parallel_tool_calls"] = body.parallel_tool_calls
    if body.response_format is not None:
        request["response_format"] = body.response_format.model_dump(by_alias=True, exclude_none=True)
    try:
        return ToolCallReader(parser, request)
    except ValueError as exc:
        raise ApiError(400, f"the tool parser {parser.name} cannot read this request: {exc}") from None


def _route(worker: Worker, model: str, http: HttpRequest) -> tuple[Any, Any, Any]:
    entry = worker.config.model(model)
    if entry is None:
        known = ", ".join(m.name for m in worker.config.models)
        message = f"the model {model!r} does not exist here; models: {known}"
        raise ApiError(404, message, code="model_not_found", param="model")
    if worker.draining:
        raise ApiError(503, "the worker is shutting down; retry on another replica", code="draining")
    try:
        cls = worker.resolve_class(entry, http.headers)
    except ClassHeaderError as exc:
        raise ApiError(400, str(exc), code="unknown_class", param=exc.header) from None
    return entry, worker.engines[model], cls


async def _engine_call(coro: Any) -> Any:
    try:
        return await coro
    except EngineError as exc:
        raise ApiError(exc.status, str(exc), code=exc.code) from None


async def _serve(
    worker: Worker,
    body: CompletionRequest | ChatCompletionRequest,
    http: HttpRequest,
    prompt_ids: list[int],
    prompt_text: str,
    max_tokens: int,
    cls: Any,
    *,
    chat: bool,
    echo: str = "",
    reader: ToolCallReader | None = None,
) -> Response:
    """Schedule the request's ``n`` choices as separate jobs of one class and arrival (hence one
    deadline), relay them as one answer; ``echo`` is text prepended to every choice; ``reader`` reads
    tool calls back from each choice's text with the model's tool parser."""
    entry = worker.config.model(body.model)
    assert entry is not None
    if len(prompt_ids) + max_tokens > entry.max_model_len:
        raise ApiError(
            400,
            f"this model's maximum context length is {entry.max_model_len} tokens, but the prompt has "
            f"{len(prompt_ids)} tokens and max_tokens is {max_tokens}; shorten the prompt or lower "
            "max_tokens",
            code="context_length_exceeded",
            param="max_tokens"
            if len(prompt_ids) < entry.max_model_len
            else ("messages" if chat else "prompt"),
        )
    sched = worker.scheduler
    bound = min(
        b for b in (sched.max_queued, sched.slots[body.model].class_limits.get(cls.name)) if b is not None
    )
    if body.n > bound:  # the choices queue together: more than fit would be refused forever
        message = (f"n={body.n} choices cannot queue together here: model {body.model} and class {cls.name} "
                   f"queue at most {bound} requests; ask for fewer choices")  # fmt: skip
        raise ApiError(400, message, param="n")
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    true_length = _true_length_hint(worker, http)
    deadline = _deadline(http, sched.clock)
    if reader is None:
        sampling = body.sampling()
    else:  # the parser's adjustment decides what shapes the output (``ToolCallReader.sampling``)
        assert isinstance(body, ChatCompletionRequest)
        own = body.sampling(tool_grammar=False)
        sampling = {k: v for k, v in own.items() if k != "response_format"} | reader.sampling
    jobs = []
    for i in range(body.n):
        req = Request(
            id=rid if body.n == 1 else f"{rid}-{i}",
            arrival=0.0,
            prompt_tokens=len(prompt_ids),
            max_tokens=max_tokens,
            model=body.model,
            service_class=cls,
            prompt_text=prompt_text,
            deadline=deadline,
            # The router's word (it drops a client's copy; tessera.api.tenant): fair share reads them.
            tenant=http.headers.get(TENANT_HEADER, ""),
            tenant_weight=parse_weight(http.headers.get(TENANT_WEIGHT_HEADER)),
        )
        req.true_output_tokens = true_length
        job_sampling = dict(sampling)  # each job takes its stop strings out of its own copy
        if i and "seed" in job_sampling:  # n samples, not n copies of one
            job_sampling["seed"] = (job_sampling["seed"] + i) % 2**63
        # Pinned: a grammar (structured outputs, forced tool calls) would restart on a resumed stream.
        # tool_choice auto without one is not: nothing shapes its text, whose calls are read from the
        # relayed text (one continuous text across a resume).
        grammar = "response_format" in sampling or "structured_outputs" in sampling
        jobs.append(Job(req, prompt_ids, job_sampling, pinned=grammar))
    try:
        sched.submit(*jobs)
    except QueueFull as exc:
        worker.metrics.rejected.labels(body.model, cls.name, "queue_full").inc(len(jobs))
        raise ApiError(429, f"{exc}; retry later", code="queue_full",
                       headers={"Retry-After": str(exc.retry_after_s)}) from None  # fmt: skip
    created = int(time.time())
    render = _Render(chat, body, echo, reader)
    if body.stream:
        first = await _next_event(jobs[0], http)
        if first is _DISCONNECTED:
            _cancel(sched, jobs)
            return Response(status_code=499)
        if first is None and jobs[0].error is not None:
            _cancel(sched, jobs)
            raise _job_error(jobs[0])
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _sse(worker, jobs, first, rid, created, render, include_usage=include_usage)
        return StreamingResponse(events, media_type="text/event-stream")
    # Not streamed: wait for the ends (checking for a disconnect), not for every token.
    if not await _wait_done(jobs, http):
        _cancel(sched, jobs)
        return Response(status_code=499)
    failed = next((job for job in jobs if job.error is not None), None)
    if failed is not None:
        _cancel(sched, jobs)
        raise _job_error(failed)
    choices = []
    for i, job in enumerate(jobs):
        deltas: list[TokenDelta] = []
        while not job.events.empty():
            item = job.events.get_nowait()
            if item is not None:
                deltas.append(item)
        whole = _merge(deltas) if deltas else TokenDelta([])
        choice = render.choice(i, whole, job.finish_reason, stream=False)
        if body.return_token_ids:
            choice["token_ids"] = job.output_ids
        choices.append(choice)
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": body.model,
            "choices": choices,
            "usage": _usage(jobs),
        }
    )


class _Render:
    """The OpenAI shape of a choice (chat or completion), log probabilities and echo included; keeps
    each choice's text offset for the completions' ``text_offset``."""

    def __init__(
        self,
        chat: bool,
        body: CompletionRequest | ChatCompletionRequest,
        echo: str,
        reader: ToolCallReader | None = None,
    ) -> None:
        self.chat = chat
        self.reader = reader  # the tool parser: reads the calls back (the whole text, or streamed deltas)
        self.ids: list[list[int]] = [[] for _ in range(body.n)]  # each choice's tokens so far (reader)
        self.called = [False] * body.n  # whether the reader found calls in the choice's whole text
        self.streamed = [False] * body.n  # whether the reader streamed call fragments of the choice
        self.top = body.logprobs_count()
        self.echo = echo
        self.token_ids = body.return_token_ids
        self.offsets = [len(echo)] * body.n
        self.stream = body.stream
        # A forced tool call the worker's own schema shapes (no tool parser): the function's name (named),
        # or "" ('required': a JSON array of calls).
        self.forced: str | None = None
        if isinstance(body, ChatCompletionRequest) and body.tool_schema() is not None and reader is None:
            choice = body.tool_choice
            self.forced = choice.function.name if isinstance(choice, NamedToolChoice) else ""
        self.texts = [""] * body.n  # each choice's text so far (forced calls)
        self.call_ids = [
            f"chatcmpl-tool-{uuid.uuid4().hex[:24]}" for _ in range(body.n if self.forced is not None else 0)
        ]

    def choice(self, index: int, delta: TokenDelta, finish: str | None, *, stream: bool) -> dict[str, Any]:
        """One choice of a non-streamed answer (the whole output) or of a chunk (a delta)."""
        out: dict[str, Any] = {"index": index, "finish_reason": None, "logprobs": self.logprobs(index, delta)}
        if self.chat and self.reader is not None and stream:
            said = self.reader.read_delta(
                index, delta.text, delta.token_ids, finished=delta.finish_reason is not None
            )
            self.streamed[index] = self.streamed[index] or "tool_calls" in said
            out["delta"] = said
        elif self.chat and self.reader is not None:
            self.texts[index] += delta.text
            self.ids[index] += delta.token_ids
            out["message"] = self.read(index)
        elif self.chat and self.forced is not None:
            self.texts[index] += delta.text
            if not stream:
                calls = self.calls(index)
                out["message"] = {"role": "assistant", "content": "", "tool_calls": calls}
            elif self.forced and delta.text:  # a named call's arguments stream as they come
                first = len(self.texts[index]) == len(delta.text)
                call: dict[str, Any] = {"index": 0, "function": {"arguments": delta.text}}
                if first:
                    call.update(id=self.call_ids[index], type="function")
                    call["function"] = {"name": self.forced, "arguments": delta.text}
                out["delta"] = {"tool_calls": [call]}
            else:  # 'required': the calls leave whole at the end (``calls``)
                out["delta"] = {}
        elif self.chat:
            out["delta" if stream else "message"] = (
                {"content": delta.text} if stream else {"role": "assistant", "content": delta.text}
            )
        else:
            out["text"] = delta.text if stream else self.echo + delta.text
        out["finish_reason"] = self.finish(index, finish)
        return out

    def finish(self, index: int, reason: str | None) -> str | None:
        """The finish reason the client sees: 'tool_calls' for a 'required' call that ended by itself
        (a named one keeps 'stop', as OpenAI and vLLM answer); for calls the tool parser reads, as
        vLLM answers (``ToolCallReader.finish``)."""
        if self.reader is not None:
            return self.reader.finish(
                reason, called=self.called[index], streamed=self.streamed[index], stream=self.stream
            )
        return "tool_calls" if self.forced == "" and reason == "stop" else reason

    def read(self, index: int) -> dict[str, Any]:
        """The message of a choice's whole text read by the tool parser: the calls it finds (with any
        content before them), else the text as content."""
        assert self.reader is not None
        content, calls = self.reader.read(self.texts[index], self.ids[index])
        self.called[index] = bool(calls) and not (self.reader.named or self.reader.required)
        return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}

    def calls(self, index: int) -> list[dict[str, Any]]:
        """The forced tool calls in a choice's text, as vLLM reads them: a named call's arguments are the
        text; 'required' text is a JSON array of ``{name, parameters}`` (none when it does not parse)."""
        text = self.texts[index]
        if self.forced:
            found = [(self.forced, text)] if text.strip() else []
        else:
            try:
                items = json.loads(text)
                found = [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in items]
            except (ValueError, TypeError, KeyError):
                found = []
        return [
            {"id": self.call_ids[index] if i == 0 else f"chatcmpl-tool-{uuid.uuid4().hex[:24]}",
             "type": "function", "function": {"name": name, "arguments": args}}
            for i, (name, args) in enumerate(found)
        ]  # fmt: skip

    def logprobs(self, index: int, delta: TokenDelta) -> dict[str, Any] | None:
        """The delta's log probabilities: chat's ``content`` list, or the completions' four lists."""
        if self.top is None:
            return None
        lps = delta.logprobs or []
        if self.chat:
            top = self.top
            return {
                "content": [
                    _chat_logprob(t.token, t.logprob, [_chat_logprob(*c) for c in t.top[:top]]) for t in lps
                ]
            }
        offsets = []
        for t in lps:
            offsets.append(self.offsets[index])
            self.offsets[index] += len(t.token)
        return {
            "text_offset": offsets,
            "token_logprobs": [t.logprob for t in lps],
            "tokens": [t.token for t in lps],
            "top_logprobs": [dict(t.top) for t in lps],
        }


def _chat_logprob(token: str, logprob: float, top: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"token": token, "logprob": logprob, "bytes": list(token.encode(errors="replace"))}
    if top is not None:
        out["top_logprobs"] = top
    return out


def _merge(deltas: list[TokenDelta]) -> TokenDelta:
    """One delta holding ``deltas`` in order (the last one's finish reason)."""
    lps = [lp for d in deltas for lp in d.logprobs or ()]
    return TokenDelta(
        [t for d in deltas for t in d.token_ids],
        "".join(d.text for d in deltas),
        deltas[-1].finish_reason,
        lps if any(d.logprobs is not None for d in deltas) else None,
    )


def _cancel(sched: Any, jobs: list[Job]) -> None:
    for job in jobs:
        sched.cancel(job)


def _job_error(job: Job) -> ApiError:
    """The client's answer for a job that ended with an error (Retry-After for a queue timeout)."""
    assert job.error is not None
    retry = getattr(job.error, "retry_after_s", None)
    return ApiError(job.error.status, str(job.error), code=job.error.code,
                    headers={"Retry-After": str(retry)} if retry else None)  # fmt: skip


async def _wait_done(jobs: list[Job], http: HttpRequest) -> bool:
    """Wait until every job ended, or one failed; False if the client left first."""
    for job in jobs:
        while not job.done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(job.done.wait(), DISCONNECT_POLL_S)
            if any(j.error is not None for j in jobs):
                return True
            if not job.done.is_set() and await http.is_disconnected():
                return False
    return True


_DISCONNECTED = object()


def chat_prompt_text(messages: list[dict[str, Any]]) -> str:
    """The text a length predictor sees for a chat: the messages' contents, one paragraph each.

    The contents, not the chat template's rendering: the predictor was trained on plain prompts."""
    return "\n\n".join(str(m.get("content") or "") for m in messages)


def _true_length_hint(worker: Worker, http: HttpRequest) -> int | None:
    """The benchmark-only true output length header (``scheduling.benchHints``), validated."""
    header = BENCH_TRUE_LENGTH_HEADER
    value = http.headers.get(header)
    if value is None:
        if worker.policy_needs_true_length():
            raise ApiError(400, f"the policy reads true output lengths: send {header}", param=header)
        return None
    if not worker.config.scheduling.bench_hints:
        message = f"{header} is a benchmark-only hint, off here (scheduling.benchHints); remove the header"
        raise ApiError(400, message, param=header)
    if not value.isdigit() or int(value) < 1:
        raise ApiError(400, f"{header} must be a whole number of tokens >= 1, got {value!r}", param=header)
    return int(value)


def _deadline(http: HttpRequest, clock: Callable[[], float]) -> float | None:
    """The request's own deadline (``x-tessera-deadline``, a batch line's expiry, set by the router for
    the batch component only: ``tessera.api.batch_link``) on the scheduler's clock; None without one."""
    value = http.headers.get(DEADLINE_HEADER)
    if value is None:
        return None
    try:
        deadline = parse_deadline(value)
    except ValueError as exc:
        raise ApiError(400, str(exc), param=DEADLINE_HEADER) from None
    return to_clock(deadline, time.time(), clock())


async def _next_event(job: Job, http: HttpRequest) -> Any:
    """The job's next event (a TokenDelta, or None at its end), or _DISCONNECTED if the client left."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            if await http.is_disconnected():
                return _DISCONNECTED


def _usage(jobs: list[Job]) -> dict[str, int]:
    """Tokens of the answer: the prompt once, the completions of every choice."""
    prompt = jobs[0].req.prompt_tokens
    completion = sum(job.req.generated for job in jobs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _sse(
    worker: Worker,
    jobs: list[Job],
    first: TokenDelta | None,
    rid: str,
    created: int,
    render: _Render,
    *,
    include_usage: bool,
) -> AsyncIterator[str]:
    """Server-sent events of a request's jobs (``first``: the first job's first event, already read);
    leaving early (client gone) cancels them."""
    model = jobs[0].req.model
    sched = worker.scheduler
    chat = render.chat
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        body = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, **extra}
        return f"data: {json.dumps(body)}\n\n"

    sources = [_source(worker, job, first if i == 0 else _UNREAD) for i, job in enumerate(jobs)]
    try:
        for i in range(len(jobs)):
            if chat:
                yield chunk(
                    [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
                )
            elif render.echo:
                yield chunk([{"index": i, "text": render.echo, "finish_reason": None, "logprobs": None}])
        async for i, delta in _interleave(sources):
            choice = render.choice(i, delta, None, stream=True)
            if render.token_ids:
                choice["token_ids"] = delta.token_ids
            yield chunk([choice])
        for job in jobs:
            await job.done.wait()
        failed = next((job for job in jobs if job.error is not None), None)
        if failed is not None:
            yield f"data: {json.dumps(_job_error(failed).body())}\n\n"
        else:
            for i, job in enumerate(jobs):
                if render.forced == "":  # 'required': the calls, whole, once the text is complete
                    calls = [{"index": k, **c} for k, c in enumerate(render.calls(i))]
                    yield chunk([{"index": i, "delta": {"tool_calls": calls}, "finish_reason": None}])
                end: dict[str, Any] = {"index": i, "finish_reason": render.finish(i, job.finish_reason)}
                end["logprobs"] = None
                end["delta" if chat else "text"] = {} if chat else ""
                yield chunk([end])
            if include_usage:
                yield chunk([], usage=_usage(jobs))
        yield "data: [DONE]\n\n"
    finally:
        _cancel(sched, jobs)


_UNREAD: Any = object()  # a job's first event is still in its queue


def _source(worker: Worker, job: Job, first: TokenDelta | None) -> AsyncIterator[TokenDelta]:
    """The job's deltas as the client gets them: paced when the pacer is on, else coalesced."""
    if worker.config.scheduling.pacing:  # the pacer releases tokens one delta at a time
        from tessera.worker.pacer import TokenPacer, pace

        return pace(_deltas(job, first), TokenPacer.for_request(job.req), time.monotonic)
    return _coalesced(job, first)


async def _deltas(job: Job, first: TokenDelta | None) -> AsyncIterator[TokenDelta]:
    item = await job.events.get() if first is _UNREAD else first
    while item is not None:
        yield item
        item = await job.events.get()


async def _coalesced(job: Job, first: TokenDelta | None) -> AsyncIterator[TokenDelta]:
    # Deltas that piled up while this stream waited for the event loop leave as one SSE
    # event: under load the relay's cost per event (JSON, ASGI send) otherwise delays every
    # stream's tokens, first tokens included. Without a backlog nothing is held back.
    item = await job.events.get() if first is _UNREAD else first
    while item is not None:
        more = job.events
        pile = [item]
        while not more.empty() and pile[-1].finish_reason is None:
            nxt = more.get_nowait()
            if nxt is None:
                more.put_nowait(None)  # the end stays queued: yield what we have first
                break
            pile.append(nxt)
        yield pile[0] if len(pile) == 1 else _merge(pile)
        item = await job.events.get()


async def _interleave(sources: list[AsyncIterator[TokenDelta]]) -> AsyncIterator[tuple[int, TokenDelta]]:
    """(choice index, delta) of every source as they come; one source is relayed without a task."""
    if len(sources) == 1:
        async for delta in sources[0]:
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, TokenDelta | None]] = asyncio.Queue()

    async def pump(i: int, source: AsyncIterator[TokenDelta]) -> None:
        try:
            async for delta in source:
                queue.put_nowait((i, delta))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, source)) for i, source in enumerate(sources)]
    try:
        left = len(tasks)
        while left:
            i, delta = await queue.get()
            if delta is None:
                left -= 1
            else:
                yield i, delta
    finally:
        for task in tasks:
            task.cancel()

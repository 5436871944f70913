"""The load driver: replay a trace against an OpenAI endpoint and measure every token on the client.

``build_workload`` (pure) turns trace rows into requests: a model, a class, a prompt length and an
output length, fitted to the model's context. ``drive`` sends each request at its arrival time and
records each token's arrival time in a core ``Request`` so the simulator's metric definitions
(``tessera.core.slo``) apply unchanged. A row without prompt text goes to ``POST /v1/completions``
(streamed, prompt as token ids so its length is exact on any tokenizer, ``ignore_eos`` so the output
length is the trace's). A row with prompt text goes to ``POST /v1/chat/completions`` as one user
message, answered greedily: the model chooses its own length, at most the trace's output tokens, and
the answer's text is kept.

``load_client`` is the HTTP client of every load generator (this one and the benches'): it sends over
the router's own upstream transport (``tessera.router.upstream``: llhttp parsing, a constant-time idle
stack per host), not httpx's connection pool, whose work per request start and end grows with the
connections it holds to one origin. At 1,000 streams that pool cost the client 8-13 CPU-seconds a wave
against 1.2-2.2 on the upstream transport (``tessera bench router``, 2-core machine). In local mode the
driver shares its process with the router, so the pool's cost stalled the router too: when the
quickstart's 400-request batch bulk ended (``tessera local up -f examples/quickstart.yaml --trace
examples/traces/quickstart-bulk.csv``), the event loop stood still for up to 10 s, the router's health
polls timed out, and chat requests that arrived then waited up to 10.8 s for a first token.
The transport has no read timeout: a stream lasts as long as its generation, and a batch request that
the router's Chiron dispatch holds gets no byte until it is released (up to its deadline), so this
driver waits for every answer; the benches bound their streams themselves.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from tessera.api.traces import TraceRow
from tessera.core.request import Phase, Request
from tessera.router.app import ClassInfo
from tessera.router.upstream import UpstreamTransport

PROMPT_ID_BASE = 100  # prompt token ids cycle over [100, 100 + PROMPT_ID_SPAN): valid in any real vocab
PROMPT_ID_SPAN = 200


def load_client(connect_timeout_s: float = 30.0) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` over the router's upstream transport, for plain ``http://`` targets;
    connection errors and broken-off answers raise httpx's ConnectError / ConnectTimeout and
    RemoteProtocolError as usual."""
    return httpx.AsyncClient(transport=UpstreamTransport(connect_timeout_s))


class WorkloadError(ValueError):
    """The trace or the options cannot make a workload; the message says what to change."""


@dataclass(frozen=True, slots=True)
class LoadItem:
    """One request to send."""

    index: int
    at: float  # seconds after the start of the run
    model: str
    class_name: str
    prompt_tokens: int
    max_tokens: int
    prompt_text: str | None = None  # sent as a chat message; the model chooses its length (<= max_tokens)


@dataclass(frozen=True, slots=True)
class WorkloadOptions:
    """How trace rows become requests.

    ``time_scale`` divides arrival times (2.0 replays twice as fast); ``duration_s`` keeps the rows
    that arrive within it (after scaling); ``batch_share`` is the share of requests without a class in
    the trace that go to the batch class (drawn with ``seed``); ``model`` sends everything to one model
    (default: the trace's model column when it names a served model, else round-robin over the served
    models).
    """

    time_scale: float = 1.0
    duration_s: float | None = None
    max_requests: int | None = None
    batch_share: float = 0.0
    seed: int = 0
    model: str | None = None
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.time_scale > 0:  # NaN too
            raise WorkloadError(f"--time-scale must be > 0, got {self.time_scale}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise WorkloadError(f"--duration must be > 0 seconds, got {self.duration_s}")
        if self.max_requests is not None and self.max_requests < 1:
            raise WorkloadError(f"--max-requests must be >= 1, got {self.max_requests}")
        if not 0 <= self.batch_share <= 1:
            raise WorkloadError(f"--batch-share must be within [0, 1], got {self.batch_share}")
        for flag, value in (("--max-input-tokens", self.max_input_tokens),
                            ("--max-output-tokens", self.max_output_tokens)):  # fmt: skip
            if value is not None and value < 1:
                raise WorkloadError(f"{flag} must be >= 1, got {value}")


@dataclass(frozen=True, slots=True)
class Workload:
    """The requests to send, and how many were shortened to fit a context length."""

    items: tuple[LoadItem, ...]
    clipped: int


def _class_for(row: TraceRow, classes: dict[str, ClassInfo], rng: random.Random, share: float) -> str:
    if row.service_class is not None:
        if row.service_class in classes:
            return row.service_class
        by_header = {c.header_value: n for n, c in classes.items()}
        if row.service_class in by_header:
            return by_header[row.service_class]
        raise WorkloadError(
            f"the trace names class {row.service_class!r}, which the endpoint does not serve; "
            f"classes: {', '.join(sorted(classes))}"
        )
    kinds = {"interactive": [n for n, c in classes.items() if c.service_class.kind == "interactive"],
             "batch": [n for n, c in classes.items() if c.service_class.kind == "batch"]}  # fmt: skip
    want = "batch" if share > 0 and rng.random() < share else "interactive"
    if not kinds[want]:
        if want == "batch":
            raise WorkloadError("--batch-share is set but the endpoint serves no batch class")
        return next(iter(classes))
    return kinds[want][0]


def build_workload(
    rows: Sequence[TraceRow],
    classes: dict[str, ClassInfo],
    models: dict[str, int],
    options: WorkloadOptions,
) -> Workload:
    """Requests from trace rows. ``models`` maps each served model to its context length."""
    if not models:
        raise WorkloadError("the endpoint serves no model; is `tessera local up` running?")
    if not classes:
        raise WorkloadError("the endpoint reports no request class")
    if options.model is not None and options.model not in models:
        raise WorkloadError(f"--model {options.model!r} is not served; models: {', '.join(sorted(models))}")
    rng = random.Random(options.seed)
    names = sorted(models)
    items: list[LoadItem] = []
    clipped = 0
    for row in rows:
        at = row.arrival / options.time_scale
        if options.duration_s is not None and at >= options.duration_s:
            break
        if options.max_requests is not None and len(items) >= options.max_requests:
            break
        if options.model is not None:
            model = options.model
        elif row.model is not None and row.model in models:
            model = row.model
        else:
            model = names[len(items) % len(names)]
        prompt = max(1, min(row.input_tokens, options.max_input_tokens or row.input_tokens))
        output = max(1, min(row.output_tokens, options.max_output_tokens or row.output_tokens))
        limit = models[model]
        if row.prompt:  # a text prompt cannot be shortened: only its output cap can fit the context
            prompt = row.input_tokens
            if prompt >= limit:
                raise WorkloadError(f"trace request {len(items) + 1}: its prompt has {prompt} tokens, "
                                    f"model {model}'s context only {limit}")  # fmt: skip
            if prompt + output > limit:
                clipped += 1
                output = limit - prompt
        elif prompt + output > limit:  # keep the output, shorten the prompt (then the output) to fit
            clipped += 1
            output = min(output, limit - 1)
            prompt = limit - output
        items.append(LoadItem(len(items), at, model, _class_for(row, classes, rng, options.batch_share),
                              prompt, output, row.prompt or None))  # fmt: skip
    if not items:
        raise WorkloadError("no request in the trace within --duration / --max-requests")
    return Workload(tuple(items), clipped)


def same_prompts(
    workload: Workload, classes: dict[str, ClassInfo], models: Sequence[str], count: int
) -> Workload:
    """The first ``count`` interactive text prompts of ``workload``, each sent at once to every model of
    ``models`` (with its class and length as in the workload): the same question to a base model and
    its adapters, answered side by side. Empty when the workload has no such prompt."""
    kinds = {name: info.service_class.kind for name, info in classes.items()}
    prompts = [
        i for i in workload.items if i.prompt_text is not None and kinds[i.class_name] == "interactive"
    ]
    items = [replace(item, index=n * len(models) + k, at=0.0, model=model)
             for n, item in enumerate(prompts[:count]) for k, model in enumerate(models)]  # fmt: skip
    return Workload(tuple(items), 0)


@dataclass(slots=True)
class Outcome:
    """What happened to one request, measured on the client (times in seconds from the run start)."""

    item: LoadItem
    request: Request
    status: int | None = None
    error: str | None = None
    instance: str | None = None
    answer: str = ""  # the streamed text (chat requests)
    finish: str | None = None  # the finish reason: "stop" (the model ended it) or "length" (the cap)

    @property
    def ok(self) -> bool:
        """Finished with every requested token."""
        return self.error is None and self.request.finished


@dataclass(slots=True)
class LiveCounters:
    """Running totals the live table shows."""

    t0: float | None = None  # monotonic start of the run
    sent: int = 0
    sent_times: list[float] = field(default_factory=list)
    ended: list[Outcome] = field(default_factory=list)  # outcomes in the order they ended


def prompt_ids(n: int) -> list[int]:
    """A prompt of exactly ``n`` token ids."""
    return [PROMPT_ID_BASE + (i * 7) % PROMPT_ID_SPAN for i in range(n)]


async def send_one(
    client: httpx.AsyncClient,
    endpoint: str,
    item: LoadItem,
    info: ClassInfo,
    class_header: str,
    t0: float,
    clock: Callable[[], float] = time.monotonic,
) -> Outcome:
    """Send one request (streamed) and record its tokens; never raises for HTTP or engine errors."""
    req = Request(id=f"load-{item.index}", arrival=clock() - t0, prompt_tokens=item.prompt_tokens,
                  max_tokens=item.max_tokens, model=item.model, service_class=info.service_class,
                  prompt_text=item.prompt_text)  # fmt: skip
    outcome = Outcome(item, req)
    body: dict[str, Any] = {"model": item.model, "max_tokens": item.max_tokens, "stream": True,
                            "temperature": 0.0, "return_token_ids": True}  # fmt: skip
    if item.prompt_text is None:
        path = "/v1/completions"
        body.update(prompt=prompt_ids(item.prompt_tokens), ignore_eos=True)
    else:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": item.prompt_text}]
    try:
        async with client.stream("POST", f"{endpoint}{path}", json=body,
                                 headers={class_header: info.header_value}) as resp:  # fmt: skip
            outcome.status = resp.status_code
            outcome.instance = resp.headers.get("x-tessera-instance")
            if resp.status_code != 200:
                outcome.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}"
                return outcome
            finish = None
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    outcome.error = str(chunk["error"].get("message"))
                    break
                for choice in chunk.get("choices", []):
                    if choice.get("finish_reason") is not None:
                        finish = choice["finish_reason"]
                    elif "token_ids" in choice or "text" in choice:  # a chat stream opens with a role only
                        # One SSE event may carry several tokens (the worker coalesces a backlog):
                        # count them by their ids, all delivered now.
                        n = len(choice.get("token_ids") or ()) or 1
                        req.tokens.append_run(clock() - t0, n)
                        text = choice.get("text") or (choice.get("delta") or {}).get("content")
                        outcome.answer += text or ""
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
        return outcome
    req.generated = req.tokens.total
    outcome.finish = finish
    if outcome.error is None and finish is None:
        outcome.error = "the stream ended without a finish reason"
    if outcome.error is None:
        req.phase = Phase.FINISHED
        req.finished_at = clock() - t0
    return outcome


async def drive(
    endpoint: str,
    workload: Workload,
    classes: dict[str, ClassInfo],
    class_header: str,
    *,
    counters: LiveCounters | None = None,
    client: httpx.AsyncClient | None = None,
) -> tuple[list[Outcome], float]:
    """Send every request at its time; returns the outcomes (in request order) and the wall time."""
    counters = counters or LiveCounters()
    own = client is None
    http = client or load_client(connect_timeout_s=10.0)
    t0 = counters.t0 = time.monotonic()

    async def timed(item: LoadItem) -> Outcome:
        await asyncio.sleep(max(0.0, item.at - (time.monotonic() - t0)))
        counters.sent += 1
        counters.sent_times.append(time.monotonic() - t0)
        outcome = await send_one(http, endpoint, item, classes[item.class_name], class_header, t0)
        counters.ended.append(outcome)
        return outcome

    try:
        outcomes = await asyncio.gather(*(timed(i) for i in workload.items))
    finally:
        if own:
            await http.aclose()
    return list(outcomes), time.monotonic() - t0


async def endpoint_info(
    endpoint: str, client: httpx.AsyncClient
) -> tuple[dict[str, ClassInfo], str, dict[str, int]]:
    """Classes, class header and models (with context lengths) of a Tessera router."""
    try:
        status = (await client.get(f"{endpoint}/router/status", timeout=5.0)).json()
        models = (await client.get(f"{endpoint}/v1/models", timeout=5.0)).json()
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        raise WorkloadError(
            f"cannot read {endpoint}/router/status and /v1/models ({exc}); start the endpoint with "
            "`tessera local up -f FILE` (or pass --endpoint of a Tessera router)"
        ) from None
    classes = {n: ClassInfo.from_json(c) for n, c in status.get("classes", {}).items()}
    lengths = {m["id"]: int(m.get("max_model_len") or 2048) for m in models.get("data", [])}
    return classes, status.get("classHeader", ""), lengths


def outstanding_of(status: dict[str, Any]) -> int:
    """Requests outstanding at the router over all instances (from ``/router/status``)."""
    return sum(int(x.get("outstanding", 0)) for x in status.get("instances", []))

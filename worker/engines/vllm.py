"""The ``vllm`` engine adapter: a stock vLLM OpenAI server, driven over HTTP.

- tokenizes through the server's ``/tokenize`` (chat through the model's chat template there), or,
  given ``tokenizer`` (the model directory vLLM loads), locally with the same Hugging Face tokenizer
  and the same rules as vLLM's ``/tokenize`` (completions: special tokens added; chat: the template
  renders them, in ``tessera.api.chat``, which the router shares to route on the same ids), which
  saves an HTTP round trip through vLLM's busy event loop per request;
- submits prompt token ids to ``/v1/completions`` with ``stream`` and ``return_token_ids``, so the
  worker knows every generated id and can resume a preempted request exactly from
  prompt + generated ids (vLLM's prefix cache makes the re-prefill cheap); the request's
  ``logprobs`` and ``response_format`` (structured outputs) go with it, as vLLM's completions take them;
- preempts by closing the stream: vLLM aborts a request whose client went away;
- sleep / wake-up through ``/sleep`` and ``/wake_up`` where the server was started with
  ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1`` (CUDA/ROCm only in vLLM 0.32). With
  ``sleep_mode="auto"`` the adapter asks the server at start: dev mode serves ``/server_info``, whose
  ``vllm_config.model_config.enable_sleep_mode`` says whether sleep works; without dev mode (404)
  the endpoints are absent and the model stays resident;
- reports its KV cache and request counts (``stats``) from the server's Prometheus ``/metrics``.

HTTP client: aiohttp, not httpx. Measured with ``tessera bench worker-overhead``'s path on a fake
instant upstream (32 concurrent streams): httpx cost about 1.2 ms of CPU to set up each request
(its connection pool re-scans every connection and waiting request on each change) and 0.15 ms per
streamed chunk, all on the worker's one event loop, in front of every request's first token;
aiohttp's C HTTP parser costs a fraction of that.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tessera.api.chat import render_chat_ids
from tessera.worker.engines.base import (
    Engine,
    EngineJob,
    EngineRejected,
    EngineStats,
    EngineUnavailable,
    TokenDelta,
    TokenLogprob,
)

# Generation streams may last minutes: no read timeout; a dead server closes the socket instead.
_STREAM_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5.0)
_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
# A pooled connection the server closed while idle fails on first use; the request never reached
# the server, so it is sent again once on a fresh connection. The pool also drops idle connections
# before vLLM does (its uvicorn keep-alive, VLLM_HTTP_TIMEOUT_KEEP_ALIVE, is 5 s by default).
_STALE = (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError)
_KEEPALIVE_S = 4.0


class VLLMEngine(Engine):
    """One model on one vLLM server at ``url`` (base URL, without ``/v1``)."""

    def __init__(
        self,
        model: str,
        url: str,
        max_model_len: int,
        *,
        sleep_mode: str = "auto",
        tokenizer: str | None = None,
    ) -> None:
        if sleep_mode not in ("auto", "on", "off"):
            raise ValueError(f"sleep_mode must be auto, on or off, got {sleep_mode!r}")
        self.model = model
        self.url = url.rstrip("/")
        self.max_model_len = max_model_len
        self.sleep_mode = sleep_mode
        self.supports_sleep = False  # decided in start()
        self.tokenizer_path = tokenizer
        self._tokenizer: Any = None  # a transformers tokenizer, loaded in start()
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Load the local tokenizer if one is set; find out whether the server can sleep
        (``sleep_mode`` auto / on; on: fail without it)."""
        if self.tokenizer_path is not None and self._tokenizer is None:
            self._tokenizer = await asyncio.to_thread(_load_tokenizer, self.tokenizer_path, self.model)
        if self.sleep_mode == "off":
            return
        self.supports_sleep = await self._server_sleep_mode()
        if self.sleep_mode == "on" and not self.supports_sleep:
            raise EngineUnavailable(
                f"sleepMode is on for {self.model}, but its vLLM server at {self.url} has no sleep mode: "
                "start it with --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1 (CUDA/ROCm only), or set "
                "sleepMode to auto or off"
            )

    async def _server_sleep_mode(self) -> bool:
        try:
            status, text = await self._request("GET", "/server_info", 30.0, params={"config_format": "json"})
        except _ERRORS:
            return False
        if status != 200:
            return False  # no dev mode: no /sleep either
        with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
            return bool(json.loads(text)["vllm_config"]["model_config"]["enable_sleep_mode"])
        return False

    @property
    def session(self) -> aiohttp.ClientSession:
        """The HTTP session (created on first use, in the running event loop)."""
        if self._session is None or self._session.closed:
            # No connection limit (the scheduler bounds the streams); keep-alive for every one.
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=_KEEPALIVE_S)
            self._session = aiohttp.ClientSession(
                base_url=self.url, connector=connector, timeout=_STREAM_TIMEOUT, auto_decompress=False
            )
        return self._session

    async def close(self) -> None:
        """Close the connection pool."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _send(self, method: str, path: str, **kw: Any) -> aiohttp.ClientResponse:
        """Send a request (its response headers read), once more if a stale pooled connection failed."""
        try:
            return await self.session.request(method, path, **kw)
        except _STALE:
            return await self.session.request(method, path, **kw)

    async def _request(self, method: str, path: str, timeout_s: float, **kw: Any) -> tuple[int, str]:
        resp = await self._send(method, path, timeout=aiohttp.ClientTimeout(total=timeout_s), **kw)
        async with resp:
            return resp.status, await resp.text(errors="replace")

    async def healthy(self) -> bool:
        """``/health`` answers 200."""
        try:
            return (await self._request("GET", "/health", 2.0))[0] == 200
        except _ERRORS:
            return False

    async def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` with the model's special tokens. The local tokenizer runs on a thread:
        a long prompt tokenized on the event loop would stall every stream of the worker."""
        tokenizer = self._tokenizer
        if tokenizer is not None:
            return await asyncio.to_thread(lambda: list(tokenizer.encode(text, add_special_tokens=True)))
        return await self._tokenize({"model": self.model, "prompt": text})

    async def tokenize_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of ``messages`` (and ``tools``) rendered by the chat template, ready for the
        assistant's turn (on a thread, as ``tokenize``)."""
        tokenizer = self._tokenizer
        if tokenizer is not None:

            def render() -> list[int]:
                try:
                    return render_chat_ids(tokenizer, messages, tools)
                except Exception as exc:  # jinja errors: the template rejects these messages
                    raise EngineRejected(
                        f"the chat template of {self.model} rejected the messages: {exc}"
                    ) from exc

            return await asyncio.to_thread(render)
        body = {"model": self.model, "messages": messages, "add_generation_prompt": True}
        return await self._tokenize(body if tools is None else {**body, "tools": tools})

    async def detokenize(self, ids: list[int]) -> str:
        """The text of ``ids`` (the local tokenizer, else vLLM's ``/detokenize``)."""
        tokenizer = self._tokenizer
        if tokenizer is not None:
            return str(await asyncio.to_thread(tokenizer.decode, ids, skip_special_tokens=True))
        try:
            status, text = await self._request(
                "POST", "/detokenize", 30.0, json={"model": self.model, "tokens": ids}
            )
        except _ERRORS as exc:
            raise EngineUnavailable(f"vLLM for {self.model} is unreachable: {exc!r}") from exc
        _raise_for_status(status, text, self.model)
        return str(json.loads(text)["prompt"])

    async def parser_tokenizer(self) -> Any:
        """The local tokenizer (``tokenizer``, else the launched model's directory), else the Hugging
        Face tokenizer of the model's name (from the hub's cache or the hub: the worker has no weights)."""
        if self._tokenizer is not None:
            return self._tokenizer
        try:
            from transformers import AutoTokenizer

            return await asyncio.to_thread(AutoTokenizer.from_pretrained, self.model)
        except (OSError, ValueError, ImportError) as exc:
            raise EngineRejected(
                f"cannot load the tokenizer of {self.model} by its Hugging Face id: {exc}; the tool parser "
                "reads the generated text with it: set models[].tokenizer to the model's tokenizer directory"
            ) from None

    async def _tokenize(self, body: dict[str, Any]) -> list[int]:
        try:
            status, text = await self._request("POST", "/tokenize", 30.0, json=body)
        except _ERRORS as exc:
            raise EngineUnavailable(f"vLLM for {self.model} is unreachable: {exc!r}") from exc
        _raise_for_status(status, text, self.model)
        return [int(t) for t in json.loads(text)["tokens"]]

    async def stream(self, job: EngineJob) -> AsyncIterator[TokenDelta]:
        """Stream the completion of ``job.prompt_ids``; closing this iterator aborts it in vLLM."""
        body = {
            **job.sampling,
            "model": self.model,
            "prompt": job.prompt_ids,
            "max_tokens": job.max_tokens,
            "stream": True,
            "return_token_ids": True,
            "request_id": job.request_id,
        }
        finished = False
        try:
            async with await self._send("POST", "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    _raise_for_status(resp.status, await resp.text(errors="replace"), self.model)
                try:
                    async for line in resp.content:  # one SSE line at a time
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            continue  # read to the end: the connection then returns to the pool
                        chunk = json.loads(data)
                        if "error" in chunk:
                            err = chunk["error"]
                            _raise_for_status(
                                int(err.get("code") or 500), str(err.get("message")), self.model
                            )
                        for choice in chunk.get("choices") or ():
                            delta = TokenDelta(
                                token_ids=list(choice.get("token_ids") or ()),
                                text=choice.get("text") or "",
                                finish_reason=choice.get("finish_reason"),
                                logprobs=_logprobs(choice.get("logprobs")),
                            )
                            finished = finished or delta.finish_reason is not None
                            yield delta
                finally:
                    if not resp.content.at_eof():
                        resp.close()  # preempted or failed: drop the connection, so vLLM aborts
            if not finished:
                raise EngineUnavailable(f"vLLM for {self.model} ended the stream without finishing")
        except _ERRORS as exc:
            raise EngineUnavailable(f"vLLM for {self.model} failed mid-request: {exc!r}") from exc

    async def stats(self) -> EngineStats | None:
        """KV capacity and use, running and waiting counts from the server's ``/metrics``: capacity is
        ``num_gpu_blocks`` x ``block_size`` of ``vllm:cache_config_info``, use
        ``vllm:kv_cache_usage_perc`` of it in whole blocks; None when a series is missing."""
        try:
            status, text = await self._request("GET", "/metrics", 5.0)
        except _ERRORS as exc:
            raise EngineUnavailable(f"vLLM for {self.model} is unreachable: {exc!r}") from exc
        return parse_vllm_metrics(text, self.model) if status == 200 else None

    async def load_lora_adapter(self, source: str) -> None:
        """``POST /v1/load_lora_adapter``: this engine's model is a LoRA adapter of the server's base model
        (``adapterOf``), loaded at run time from ``source`` (the server runs with ``--enable-lora`` and
        ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``). An adapter the server holds already is not an error."""
        body = {"lora_name": self.model, "lora_path": source}
        try:
            status, text = await self._request("POST", "/v1/load_lora_adapter", 300.0, json=body)
        except _ERRORS as exc:
            raise EngineUnavailable(f"vLLM for {self.model} is unreachable: {exc!r}") from exc
        if status == 400 and "already been loaded" in text:
            return
        _raise_for_status(status, text, self.model)

    async def unload_lora_adapter(self) -> None:
        """``POST /v1/unload_lora_adapter``: the server forgets this engine's adapter (its GPU slot and
        CPU copy are freed; a later request needs ``load_lora_adapter`` first). An adapter the server
        does not hold is not an error."""
        try:
            status, text = await self._request(
                "POST", "/v1/unload_lora_adapter", 60.0, json={"lora_name": self.model}
            )
        except _ERRORS as exc:
            raise EngineUnavailable(f"vLLM for {self.model} is unreachable: {exc!r}") from exc
        if status == 404:
            return
        _raise_for_status(status, text, self.model)

    async def lora_slots(self) -> int | None:
        """The adapters one batch of the server may mix (its ``--max-loras``, as its ``/metrics`` reports
        it); None where the server runs without LoRA or does not answer."""
        try:
            status, text = await self._request("GET", "/metrics", 5.0)
        except _ERRORS:
            return None
        return parse_lora_slots(text) if status == 200 else None

    async def sleep(self) -> None:
        """``POST /sleep?level=1``: offload weights, drop the KV cache."""
        await self._post_admin("/sleep", {"level": "1"})

    async def wake_up(self) -> None:
        """``POST /wake_up``."""
        await self._post_admin("/wake_up", {})

    async def _post_admin(self, path: str, params: dict[str, str]) -> None:
        if not self.supports_sleep:
            await super().sleep()  # raises: this server cannot sleep
        try:
            status, text = await self._request("POST", path, 120.0, params=params)
        except _ERRORS as exc:
            raise EngineUnavailable(f"vLLM for {self.model} is unreachable: {exc!r}") from exc
        _raise_for_status(status, text, self.model)


def parse_vllm_metrics(text: str, model: str) -> EngineStats | None:
    """The EngineStats in a vLLM ``/metrics`` page (the series of ``model``, summed over engines; the
    start time is the server process's); None when one of them is missing."""
    values: dict[str, float] = {}
    cache: dict[str, str] | None = None
    started: float | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                cache = sample.labels
            elif sample.name == "process_start_time_seconds":
                started = sample.value
            elif sample.name in _GAUGES and sample.labels.get("model_name", model) == model:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    if cache is None or len(values) < len(_GAUGES):
        return None
    try:
        blocks, block = int(cache["num_gpu_blocks"]), int(cache["block_size"])
    except (KeyError, ValueError):  # "None" before the engine has profiled its memory
        return None
    used = min(blocks, round(values["vllm:kv_cache_usage_perc"] * blocks))
    return EngineStats(
        kv_capacity_tokens=blocks * block,
        kv_used_tokens=used * block,
        block_size=block,
        running=int(values["vllm:num_requests_running"]),
        waiting=int(values["vllm:num_requests_waiting"]),
        started_at=started,
    )


def parse_lora_slots(text: str) -> int | None:
    """``max_lora`` of ``vllm:lora_requests_info`` in a vLLM ``/metrics`` page (the server's
    ``--max-loras``); None when the server serves no LoRA (the series is absent)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:lora_requests_info":
                with contextlib.suppress(KeyError, ValueError):
                    return int(sample.labels["max_lora"])
    return None


_GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")


def _load_tokenizer(path: str, model: str) -> Any:
    """The Hugging Face tokenizer in ``path`` (the files vLLM loads for ``model``)."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, ImportError) as exc:
        raise EngineRejected(
            f"cannot load the tokenizer of {model} from {path}: {exc}; fix models[].tokenizer or unset "
            "it to tokenize through vLLM's /tokenize"
        ) from exc


def _logprobs(block: dict[str, Any] | None) -> list[TokenLogprob] | None:
    """The per-token log probabilities of a completions chunk (``tokens``, ``token_logprobs``,
    ``top_logprobs``: the sampled token's entry first, as vLLM orders them)."""
    if not block:
        return None
    tops = block.get("top_logprobs") or [None] * len(block["tokens"])
    return [
        TokenLogprob(token, float(lp if lp is not None else -9999.0), tuple((top or {}).items()))
        for token, lp, top in zip(block["tokens"], block["token_logprobs"], tops, strict=True)
    ]


def _raise_for_status(status: int, text: str, model: str) -> None:
    if status < 400:
        return
    message = text
    with contextlib.suppress(ValueError, KeyError, TypeError):
        message = json.loads(text)["error"]["message"]
    if 400 <= status < 500:
        raise EngineRejected(f"vLLM rejected the request for {model}: {message}")
    raise EngineUnavailable(f"vLLM for {model} answered {status}: {message}")

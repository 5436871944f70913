"""The interface every engine adapter implements (the real vLLM server, the simulator in real time).

The worker's scheduler owns the queue and decides what runs; an adapter only runs one generation
stream per in-flight request. Preemption is closing the stream (``aclose`` on the iterator aborts
the request in the engine); resumption is a new stream whose prompt is the original prompt ids
followed by the ids generated so far.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any


class EngineError(Exception):
    """A generation could not run. ``status`` is the HTTP status the client should see."""

    status: int = 503
    code: str = "engine_unavailable"


class EngineUnavailable(EngineError):
    """The engine is down or unreachable (HTTP 503); the request may be retried later."""


class EngineRejected(EngineError):
    """The engine refused the request as invalid (HTTP 400); the message says why."""

    status = 400
    code = "invalid_request"


@dataclass(slots=True)
class EngineJob:
    """One generation stream: prompt token ids (resumed requests: prompt + generated so far)."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    # temperature, top_p, seed, ignore_eos..., logprobs (candidates per token), response_format
    sampling: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log probability and the engine's candidates at its position (the sampled
    token first, then the most likely ones; as many as the request's ``logprobs`` asked for)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(slots=True)
class TokenDelta:
    """Tokens produced since the previous delta of a stream; ``finish_reason`` set on the last;
    ``logprobs``, one per token, when the request asked for them (sampling ``logprobs``)."""

    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What an engine reports of itself, in the simulator's terms (``tessera.core.policy.InstanceView``):
    KV capacity in whole blocks and the blocks in use, both in tokens, and its request counts."""

    kv_capacity_tokens: int
    kv_used_tokens: int
    block_size: int
    running: int  # requests in the engine's batch
    waiting: int  # requests the engine holds but does not run (its own queue)
    started_at: float | None = None  # Unix time the engine's process started (its caches empty then)


class Engine(ABC):
    """An engine serving one model."""

    model: str
    max_model_len: int

    supports_sleep: bool = False  # whether sleep()/wake_up() free and restore the model's memory

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Connect or start; called once before use."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and processes."""

    @abstractmethod
    async def healthy(self) -> bool:
        """Whether the engine can take work now."""

    @abstractmethod
    async def tokenize(self, text: str) -> list[int]:
        """Token ids of a completion prompt (with the model's special tokens)."""

    @abstractmethod
    async def tokenize_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of a chat conversation rendered by the model's chat template (with the tool
        definitions given, OpenAI's shape)."""

    @abstractmethod
    async def detokenize(self, ids: list[int]) -> str:
        """The text of token ids (a prompt given as ids), special tokens left out."""

    @abstractmethod
    def stream(self, job: EngineJob) -> AsyncIterator[TokenDelta]:
        """Generate; closing the iterator early aborts the request in the engine."""

    async def parser_tokenizer(self) -> Any:
        """The model's tokenizer as vLLM's output parsers take it (Hugging Face's methods), for reading
        tool calls back from the generated text."""
        raise EngineError(f"the engine for {self.model} has no tokenizer for vLLM's parsers")

    async def stats(self) -> EngineStats | None:
        """The engine's KV cache and request counts now; None when this engine does not report them
        (the worker then uses its configured capacity). Raises EngineUnavailable when unreachable."""
        return None

    async def sleep(self) -> None:
        """Free the model's accelerator memory (model swapping)."""
        raise EngineError(f"engine for {self.model} cannot sleep on this platform")

    async def wake_up(self) -> None:
        """Restore the model after ``sleep``."""
        raise EngineError(f"engine for {self.model} cannot sleep on this platform")

"""The ``sim`` engine adapter: a continuous-batching engine simulated in real time.

For local mode and tests without vLLM. It runs the step-time model the simulator uses
(``StepProfile``: decode ``c0 + c1·B + c2·context``, prefill ``p0 + p1·tokens``) against the wall
clock: one shared iteration loop; every active stream receives one token per decode iteration,
and an iteration in which streams join also pays their prefill. Token ids are a deterministic
function of the context (``next = (31·last + len(context)) mod vocab``), so a stream resumed from
prompt + generated ids continues exactly as an uninterrupted one would, like greedy decoding.
Streams end at ``max_tokens`` (the simulated model never emits an end-of-sequence token).
Log probabilities, when asked for, are a deterministic function of the token (``token_logprob``);
structured outputs (``response_format``) are accepted but do not shape the simulated text.
A chat whose last user message begins with ``/reply `` is answered with the rest of that message (its
bytes as tokens, then ``stop``): a scripted answer for what reads the text back, such as tool parsers.

The discrete-event simulator (``tessera.sim``) owns its own policy loop; this adapter instead
lets the worker's scheduler drive the policy, which is what the worker needs.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tessera.core.policy import kv_blocks, kv_capacity_whole_blocks
from tessera.core.profile import StepProfile
from tessera.worker.engines.base import (
    Engine,
    EngineJob,
    EngineRejected,
    EngineStats,
    TokenDelta,
    TokenLogprob,
)

VOCAB = 32000


def next_token(context: list[int]) -> int:
    """The simulated model's deterministic next token after ``context``."""
    last = context[-1] if context else 0
    return (31 * last + len(context)) % VOCAB


def token_logprob(token: int, top: int) -> TokenLogprob:
    """The simulated model's log probability of ``token`` (the likeliest: decoding is greedy) and its
    ``top`` candidates, the token first, as vLLM lists them (at least the token itself)."""
    lp = -0.125 * (token % 8)
    return TokenLogprob(
        f" t{token}", lp, tuple((f" t{(token + j) % VOCAB}", lp - j) for j in range(max(top, 1)))
    )


REPLY_COMMAND = "user: /reply "  # a chat rendered by ``tokenize_chat`` whose last user message scripts
REPLY_END = "\nassistant:"  # the answer: what follows the command, up to the assistant's turn


def _script(context: list[int]) -> tuple[bytes, int] | None:
    """The scripted answer after ``context`` (a prompt, or a resumed stream's prompt and generated
    tokens) and how many of its bytes the context holds already; None when the last user message is not
    a ``/reply``, or its answer is empty or complete."""
    text = bytes(i - 3 for i in context if 3 <= i < 259)
    end = text.rfind(REPLY_END.encode())
    start = text.rfind(REPLY_COMMAND.encode(), 0, end)
    answer = text[start + len(REPLY_COMMAND) : end]
    if end < 0 or start < 0 or any(f"\n{role}: ".encode() in answer for role in _ROLES):
        return None  # not the last message
    done = len(text) - end - len(REPLY_END)  # bytes of the answer generated before a preemption
    return (answer, done) if done < len(answer) else None


_ROLES = ("system", "user", "assistant", "tool")


@dataclass(eq=False, slots=True)
class _Stream:
    context: list[int]
    remaining: int
    logprobs: int | None  # candidates per token, when the request asked for log probabilities
    script: list[int] | None = None  # a scripted answer's tokens to come (``/reply``)
    queue: asyncio.Queue[TokenDelta] = field(default_factory=asyncio.Queue)
    prefilled: bool = False
    text: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")())


THREAD_TOKENIZE_CHARS = 65_536  # longer texts are tokenized on a thread


def _byte_tokens(text: str) -> list[int]:
    return [0, *(b + 3 for b in text.encode())]


class SimTokenizer:
    """The sim engine's tokenizer with the methods vLLM's parsers call (Hugging Face's): one token per
    UTF-8 byte; no special tokens in its vocabulary, so no parser that needs one accepts it."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` (a BOS first with ``add_special_tokens``)."""
        ids = _byte_tokens(text)
        return ids if add_special_tokens else ids[1:]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (special tokens have none)."""
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode(errors="replace")

    def get_vocab(self) -> dict[str, int]:
        """Single-byte ASCII tokens by their text."""
        return {chr(b): b + 3 for b in range(128)}


class SimEngine(Engine):
    """A simulated engine serving ``model`` at the speed of ``profile``."""

    def __init__(
        self, model: str, profile: StepProfile, max_model_len: int, *, supports_sleep: bool = False
    ) -> None:
        self.model = model
        self.profile = profile
        self.max_model_len = max_model_len
        self.supports_sleep = supports_sleep
        self.asleep = False
        self.sleep_calls = 0
        self.wake_calls = 0
        self._streams: dict[_Stream, None] = {}
        self._loop: asyncio.Task[None] | None = None
        self._work = asyncio.Event()
        self.up = True  # tests flip this to simulate an engine failure

    async def start(self) -> None:
        """Start the iteration loop."""
        self._loop = asyncio.create_task(self._iterate(), name=f"sim-engine-{self.model}")

    async def close(self) -> None:
        """Stop the iteration loop."""
        if self._loop is not None:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop

    async def healthy(self) -> bool:
        """Whether the simulated engine is up."""
        return self.up

    async def sleep(self) -> None:
        """Drop the (simulated) weights; only with ``supports_sleep``."""
        if not self.supports_sleep:
            await super().sleep()
        self.asleep = True
        self.sleep_calls += 1

    async def wake_up(self) -> None:
        """Reload the weights: takes the profile's model load time (weights / host link)."""
        if not self.supports_sleep:
            await super().wake_up()
        await asyncio.sleep(self.profile.model_load_time())
        self.asleep = False
        self.wake_calls += 1

    async def stats(self) -> EngineStats:
        """The simulated KV cache: the profile's capacity in whole blocks, and the blocks its streams'
        contexts hold (the simulator's accounting); every stream runs, none waits."""
        block = self.profile.block_size
        used = sum(kv_blocks(len(s.context), block) for s in self._streams) * block
        return EngineStats(kv_capacity_whole_blocks(self.profile), used, block, len(self._streams), 0)

    async def tokenize(self, text: str) -> list[int]:
        """One token per UTF-8 byte (shifted past the special ids 0-2), after a BOS of 0; a long text on
        a thread, so that it does not stall the other streams."""
        if len(text) > THREAD_TOKENIZE_CHARS:
            return await asyncio.to_thread(_byte_tokens, text)
        return _byte_tokens(text)

    async def detokenize(self, ids: list[int]) -> str:
        """Inverse of ``tokenize``: ids 3-258 are bytes, others (specials, out of range) are left out."""
        return SimTokenizer().decode(ids)

    async def parser_tokenizer(self) -> SimTokenizer:
        """``SimTokenizer``."""
        return SimTokenizer()

    async def tokenize_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """``role: content`` lines, then ``assistant:``, tokenized like ``tokenize``; tools first, as a
        ``tools:`` line of their names."""
        text = "".join(f"{m.get('role')}: {m.get('content') or ''}\n" for m in messages) + "assistant:"
        if tools:
            text = "tools: " + ", ".join(t["function"]["name"] for t in tools) + "\n" + text
        return await self.tokenize(text)

    async def stream(self, job: EngineJob) -> AsyncIterator[TokenDelta]:
        """Join the batch and yield one token per iteration until ``max_tokens``."""
        if self.asleep:
            raise EngineRejected(f"the model {self.model} is asleep; wake it up before submitting")
        if len(job.prompt_ids) + job.max_tokens > self.max_model_len:
            raise EngineRejected(
                f"prompt ({len(job.prompt_ids)} tokens) plus max_tokens ({job.max_tokens}) exceeds "
                f"the context length {self.max_model_len}"
            )
        s = _Stream(list(job.prompt_ids), job.max_tokens, job.sampling.get("logprobs"))
        script = _script(job.prompt_ids)
        if script is not None:
            answer, done = script
            s.script = [b + 3 for b in answer[done:]]
            s.text.decode(answer[:done])  # a character cut by a preemption is completed by this stream
        self._streams[s] = None
        self._work.set()
        try:
            while True:
                delta = await s.queue.get()
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            self._streams.pop(s, None)

    async def _iterate(self) -> None:
        while True:
            if not self._streams:
                self._work.clear()
                await self._work.wait()
            active = list(self._streams)
            step = self.profile.decode_step(len(active), sum(len(s.context) for s in active))
            joining = [s for s in active if not s.prefilled]
            if joining:
                step += self.profile.prefill(sum(len(s.context) for s in joining))
            await asyncio.sleep(step)
            for s in active:
                if s not in self._streams:
                    continue  # aborted during the iteration
                s.prefilled = True
                scripted = bool(s.script)
                if s.script:
                    token = s.script.pop(0)
                    text = s.text.decode(bytes([token - 3]), final=not s.script)
                else:
                    token = next_token(s.context)
                    text = f" t{token}"
                s.context.append(token)
                s.remaining -= 1
                finish = "stop" if scripted and not s.script else "length" if s.remaining <= 0 else None
                if finish:
                    self._streams.pop(s, None)
                lps = None if s.logprobs is None else [token_logprob(token, s.logprobs)]
                s.queue.put_nowait(TokenDelta([token], text, finish, lps))

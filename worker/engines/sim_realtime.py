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

The discrete-event simulator (``tessera.sim``) owns its own policy loop; this adapter instead
lets the worker's scheduler drive the policy, which is what the worker needs.
"""

from __future__ import annotations

import asyncio
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


@dataclass(eq=False, slots=True)
class _Stream:
    context: list[int]
    remaining: int
    logprobs: int | None  # candidates per token, when the request asked for log probabilities
    queue: asyncio.Queue[TokenDelta] = field(default_factory=asyncio.Queue)
    prefilled: bool = False


THREAD_TOKENIZE_CHARS = 65_536  # longer texts are tokenized on a thread


def _byte_tokens(text: str) -> list[int]:
    return [0, *(b + 3 for b in text.encode())]


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
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode(errors="replace")

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
                token = next_token(s.context)
                s.context.append(token)
                s.remaining -= 1
                finish = "length" if s.remaining <= 0 else None
                if finish:
                    self._streams.pop(s, None)
                lps = None if s.logprobs is None else [token_logprob(token, s.logprobs)]
                s.queue.put_nowait(TokenDelta([token], f" t{token}", finish, lps))

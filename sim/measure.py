"""Measure a real OpenAI-compatible vLLM server: step-time samples for a profile, and trace replay.

Prompts are sent as token-id lists (``/v1/completions`` accepts them), so prompt lengths are
exact whatever the tokenizer; every prompt is fresh random ids, so prefix caching cannot hit.
Outputs use ``ignore_eos`` with ``max_tokens`` = the wanted length (a vLLM extension).

What the simulator needs from a vLLM V1 server (one engine step mixes decodes and prompt chunks
under the ``max_num_batched_tokens`` budget; its time grows with the sequences in the batch, their
context and the prompt tokens it computes):

- Decode: ``b`` concurrent streams at several ``b`` (up to the server's ``max_num_seqs``) and at
  two prompt lengths, so the per-sequence and the per-context-token slopes can both be fitted;
  the median gap between streamed chunks in the middle of the streams is the step time at batch
  ``b`` with the batch's mean context.
- Prefill: TTFT of ``max_tokens=1`` requests, one at a time, at several prompt lengths. Its slope
  is the per-prompt-token step cost; its intercept is one step's fixed cost plus the serving
  path's per-request overhead (``tessera.sim.profiles.fit_profile`` separates the two).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from tessera.sim.profiles import Measurements


@dataclass(slots=True)
class StreamResult:
    """Timing of one streamed completion (seconds from the request's send time)."""

    ttft: float
    jct: float
    chunk_times: list[float]
    tokens: int


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


async def stream_completion(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int
) -> StreamResult:
    """Send one streaming completion and time its chunks."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    t0 = time.perf_counter()
    times: list[float] = []
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")[:300]
            raise RuntimeError(f"{url}: completion failed with HTTP {resp.status_code}: {text}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{url}: the server reported an error mid-stream: {chunk['error']}")
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                times.append(time.perf_counter() - t0)
                tokens += 1
    if not times:
        raise RuntimeError(f"{url}: the server streamed no tokens")
    return StreamResult(times[0], times[-1], times, tokens)


async def measure(
    url: str,
    model: str,
    *,
    vocab: int = 1000,
    prompt_lengths: Sequence[int] = (16, 128, 256, 512, 1024),
    batches: Sequence[int] = (1, 2, 4, 8, 16),
    decode_prompts: Sequence[int] = (32, 512),
    decode_tokens: int = 96,
    repeats: int = 3,
    seed: int = 0,
) -> Measurements:
    """Prefill and decode samples from the server at ``url``."""
    rng = random.Random(seed)
    m = Measurements()
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        await stream_completion(client, url, model, _prompt(rng, 8, vocab), 4)  # warm-up
        for n in prompt_lengths:
            samples = [
                (await stream_completion(client, url, model, _prompt(rng, n, vocab), 1)).ttft
                for _ in range(repeats)
            ]
            m.prefill.append((n, statistics.median(samples)))
        for prompt in decode_prompts:
            for b in batches:
                m.decode.append(await _decode_step(client, url, model, rng, vocab, b, prompt, decode_tokens))
    return m


async def _decode_step(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    rng: random.Random,
    vocab: int,
    batch: int,
    prompt: int,
    tokens: int,
) -> tuple[int, int, float]:
    """``(batch, context tokens, step seconds)`` of ``batch`` concurrent streams in steady decoding."""
    results = await asyncio.gather(
        *(stream_completion(client, url, model, _prompt(rng, prompt, vocab), tokens) for _ in range(batch))
    )
    gaps: list[float] = []
    lo, hi = tokens // 4, 3 * tokens // 4  # steady middle: every stream decoding
    for r in results:
        gaps += [
            b2 - a2 for a2, b2 in zip(r.chunk_times[lo:hi], r.chunk_times[lo + 1 : hi + 1], strict=False)
        ]
    return batch, batch * (prompt + tokens // 2), statistics.median(gaps)


async def replay(
    url: str, model: str, requests: Sequence[tuple[float, int, int]], *, vocab: int = 1000, seed: int = 0
) -> list[StreamResult]:
    """Send ``(arrival_s, prompt_tokens, output_tokens)`` requests at their arrival times; time each."""
    rng = random.Random(seed)
    prompts = [_prompt(rng, p, vocab) for _, p, _ in requests]
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=1000)
    ) as client:
        start = time.perf_counter()

        async def one(i: int) -> StreamResult:
            arrival, _, out = requests[i]
            delay = arrival - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            return await stream_completion(client, url, model, prompts[i], out)

        return list(await asyncio.gather(*(one(i) for i in range(len(requests)))))

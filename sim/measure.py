"""Measure a real OpenAI-compatible vLLM server: step-time samples for a profile, and trace replay.

Prompts are sent as token-id lists (``/v1/completions`` accepts them), so prompt lengths are
exact whatever the tokenizer; every prompt is fresh random ids, so prefix caching cannot hit.
Outputs use ``ignore_eos`` with ``max_tokens`` = the wanted length (a vLLM extension).

- Prefill: TTFT of ``max_tokens=1`` requests, one at a time, at several prompt lengths.
- Decode: ``b`` concurrent streams at several ``b``; the median gap between streamed chunks in
  the middle of the streams is the step time at batch ``b`` with the batch's mean context.
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
    decode_prompt: int = 64,
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
        for b in batches:
            results = await asyncio.gather(
                *(
                    stream_completion(client, url, model, _prompt(rng, decode_prompt, vocab), decode_tokens)
                    for _ in range(b)
                )
            )
            gaps: list[float] = []
            lo, hi = decode_tokens // 4, 3 * decode_tokens // 4  # steady middle: every stream decoding
            for r in results:
                gaps += [
                    b2 - a2
                    for a2, b2 in zip(r.chunk_times[lo:hi], r.chunk_times[lo + 1 : hi + 1], strict=False)
                ]
            context = b * (decode_prompt + decode_tokens // 2)
            m.decode.append((b, context, statistics.median(gaps)))
    return m


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

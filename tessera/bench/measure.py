"""Measure a real OpenAI-compatible vLLM server: step-time samples for a profile, and trace replay.

Prompts are sent as token-id lists (``/v1/completions`` accepts them), so prompt lengths are
exact whatever the tokenizer; every prompt is fresh random ids, so prefix caching cannot hit.
Outputs use ``ignore_eos`` with ``max_tokens`` = the wanted length (a vLLM extension).

What the simulator needs from a vLLM V1 server (one engine step mixes decodes and prompt chunks
under the ``max_num_batched_tokens`` budget; its time grows with the sequences in the batch, their
context and the prompt tokens it computes), read from the server's own Prometheus histograms
(``/metrics``: sums and counts before and after each probe give exact means). They are
timestamped inside the server (the engine core stamps every step's outputs), so they do not
depend on when a client process gets a core: on a loaded 2-core machine a streaming client reads
dozens of tokens in one burst, and client-side gaps between chunks were mostly 10-20 us with
seconds-long stalls in between, which says nothing about the engine.

- Decode: ``b`` concurrent streams at several ``b`` (up to the server's ``max_num_seqs``) and at
  two prompt lengths, so the per-sequence and the per-context-token slopes can both be fitted;
  the step time at batch ``b`` is the mean of ``vllm:inter_token_latency_seconds`` over the run.
- Prefill: lone ``max_tokens=1`` requests at several prompt lengths; the step time is
  ``vllm:request_prefill_time_seconds`` (scheduled to first token), and the serving path's
  per-request overhead is ``vllm:time_to_first_token_seconds`` (arrival at the API server to
  first token) minus it.
- Replay: client-side times of every request, and the server-side means of TTFT and end-to-end
  latency over the replay.
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

from tessera.core.profiles import Measurements, fit_profile

TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
E2E = "vllm:e2e_request_latency_seconds"
PREFILL = "vllm:request_prefill_time_seconds"
QUEUE = "vllm:request_queue_time_seconds"
DECODE = "vllm:request_decode_time_seconds"
GENERATED = "vllm:request_generation_tokens"
HISTOGRAMS = (TTFT, ITL, E2E, PREFILL, QUEUE, DECODE, GENERATED)
POLL_S = 0.2  # /metrics polling period while decode streams run (rendering it costs the server CPU)


@dataclass(slots=True)
class StreamResult:
    """Timing of one streamed completion (seconds from the request's send time)."""

    ttft: float
    jct: float
    chunk_times: list[float]
    tokens: int
    sent: float = 0.0  # in a replay: when the client sent it, seconds since the replay started


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


async def stream_completion(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
) -> StreamResult:
    """Send one streaming completion and time its chunks.

    A loaded server merges several tokens into one chunk; the continuous usage stats (a vLLM
    extension) say how many tokens each chunk carried.
    """
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
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
                usage = chunk.get("usage") or {}
                tokens = int(usage.get("completion_tokens") or tokens + 1)
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
    decode_tokens: int = 128,
    repeats: int = 3,
    seed: int = 0,
) -> Measurements:
    """Prefill, overhead and decode samples from the server at ``url`` (its own metrics)."""
    rng = random.Random(seed)
    m = Measurements()
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        await stream_completion(client, url, model, _prompt(rng, 8, vocab), 4)  # warm-up
        for n in prompt_lengths:
            steps = []
            for _ in range(repeats):
                before = await scrape(client, url)
                await stream_completion(client, url, model, _prompt(rng, n, vocab), 1)
                delta = await scrape_delta(client, url, before, TTFT, 1)
                steps.append(delta.mean(PREFILL))
                m.overhead.append(delta.mean(TTFT) - delta.mean(PREFILL))
            m.prefill.append((n, statistics.median(steps)))
        for prompt in decode_prompts:
            for b in batches:
                # Median of repeats: other processes' load only ever adds time, in bursts.
                runs = [
                    await _decode_step(client, url, model, rng, vocab, b, prompt, decode_tokens)
                    for _ in range(repeats)
                ]
                m.decode.append((b, runs[0][1], statistics.median(r[2] for r in runs)))
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
    """``(batch, mean context tokens, step seconds)`` of ``batch`` concurrent streams decoding.

    The server's inter-token latency histogram is polled while the streams run. The step time
    is its mean over a steady window: from the poll where an eighth of the run's inter-token
    observations are in to the last poll before seven eighths, which leaves out the first
    steps, where the prompts' prefill chunks ride along (at batch 16 with long prompts they
    inflated the mean by ~20%). Client-side progress cannot place the window: on a loaded
    machine the client reads a whole stream in a few bursts. Too few polls: the whole run.
    """
    before = await scrape(client, url)
    streams = asyncio.gather(
        *(stream_completion(client, url, model, _prompt(rng, prompt, vocab), tokens) for _ in range(batch))
    )
    polls: list[tuple[float, float]] = []  # (ITL count, ITL sum) since ``before``
    while not streams.done():
        now = await scrape(client, url)
        polls.append((now[ITL][1] - before[ITL][1], now[ITL][0] - before[ITL][0]))
        await asyncio.sleep(POLL_S)
    await streams
    total = batch * (tokens - 1)
    inside = [p for p in polls if total / 8 <= p[0] <= 7 * total / 8]
    if len(inside) >= 2 and inside[-1][0] - inside[0][0] >= batch:
        (c0, s0), (c1, s1) = inside[0], inside[-1]
        step = (s1 - s0) / (c1 - c0)
    else:
        step = (await scrape_delta(client, url, before, E2E, batch)).mean(ITL)
    return batch, batch * (prompt + tokens // 2), step


@dataclass(frozen=True, slots=True)
class MetricsDelta:
    """Change of the server's histogram sums and counts between two scrapes."""

    sums: dict[str, float]
    counts: dict[str, float]

    def mean(self, name: str) -> float:
        """Mean of the observations ``name`` gained between the scrapes."""
        count = self.counts.get(name, 0.0)
        if count <= 0:
            raise RuntimeError(f"the server recorded no {name} observation during the probe")
        return self.sums[name] / count

    def decode_seconds_per_token(self) -> float:
        """Decode time (first to last token) per token after the first, over the requests recorded."""
        tokens = self.sums.get(GENERATED, 0.0) - self.counts.get(GENERATED, 0.0)
        if tokens <= 0:
            raise RuntimeError("the server recorded no decode step during the probe")
        return self.sums[DECODE] / tokens


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, tuple[float, float]]:
    """``{histogram: (sum, count)}`` of vLLM's latency histograms (summed over label sets)."""
    from prometheus_client.parser import text_string_to_metric_families

    resp = await client.get(f"{url}/metrics")
    if resp.status_code != 200:
        raise RuntimeError(f"{url}/metrics answered HTTP {resp.status_code}; tessera needs vLLM's metrics")
    out: dict[str, tuple[float, float]] = {}
    for family in text_string_to_metric_families(resp.text):
        # The parser strips "_seconds"-style suffixes only for some types; match on the sample names.
        for sample in family.samples:
            for name in HISTOGRAMS:
                if sample.name in (f"{name}_sum", f"{name}_count"):
                    total, count = out.get(name, (0.0, 0.0))
                    if sample.name.endswith("_sum"):
                        total += sample.value
                    else:
                        count += sample.value
                    out[name] = (total, count)
    missing = [n for n in HISTOGRAMS if n not in out]
    if missing:
        raise RuntimeError(
            f"{url}/metrics lacks {missing}: measuring needs a vLLM (V1) server with its metrics on "
            "(do not pass --disable-log-stats)"
        )
    return out


async def scrape_delta(
    client: httpx.AsyncClient,
    url: str,
    before: dict[str, tuple[float, float]],
    until: str,
    count: int,
    timeout_s: float = 10.0,
) -> MetricsDelta:
    """Scrape again until ``until`` gained ``count`` observations (the server records them just after
    the last chunk goes out), and return the change since ``before``."""
    deadline = time.perf_counter() + timeout_s
    while True:
        after = await scrape(client, url)
        if after[until][1] - before[until][1] >= count or time.perf_counter() > deadline:
            break
        await asyncio.sleep(0.05)
    return MetricsDelta(
        {k: after[k][0] - before[k][0] for k in after}, {k: after[k][1] - before[k][1] for k in after}
    )


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """A replay's client-side timings (one per request, in order) and the server's own view of it."""

    requests: list[StreamResult]
    server: MetricsDelta  # the server's histograms over the replay (TTFT, E2E, ITL and the phases)


async def replay(
    url: str, model: str, requests: Sequence[tuple[float, int, int]], *, vocab: int = 1000, seed: int = 0
) -> ReplayResult:
    """Send ``(arrival_s, prompt_tokens, output_tokens)`` requests at their arrival times; time each."""
    rng = random.Random(seed)
    prompts = [_prompt(rng, p, vocab) for _, p, _ in requests]
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=1000)
    ) as client:
        before = await scrape(client, url)
        start = time.perf_counter()

        async def one(i: int) -> StreamResult:
            arrival, _, out = requests[i]
            delay = arrival - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            sent = time.perf_counter() - start
            result = await stream_completion(client, url, model, prompts[i], out)
            result.sent = sent
            return result

        results = list(await asyncio.gather(*(one(i) for i in range(len(requests)))))
        server = await scrape_delta(client, url, before, E2E, len(requests))
    return ReplayResult(results, server)


DECODE_TOKENS = 128  # tokens per decode stream; the steady middle of the run is timed
LONG_DECODE_PROMPT = 512  # the second decode series' prompt (separates per-context from per-sequence cost)


def served_models(endpoint: str) -> list[dict]:
    """The model cards of ``/v1/models`` (vLLM adds ``max_model_len`` to each)."""
    resp = httpx.get(f"{endpoint}/v1/models", timeout=30)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError(f"{endpoint}/v1/models lists no model; pass --model")
    return list(data)


def measure_and_fit(
    endpoint: str,
    model: str,
    name: str,
    kv_capacity_tokens: int,
    block_size: int,
    vocab: int,
    max_batch: int,
    max_model_len: int = 2048,
    *,
    decode_tokens: int = DECODE_TOKENS,
    repeats: int = 3,
):
    """Measure the server and return ``(profile, measurements)``.

    Concurrency doubles from 1 up to ``max_batch`` (and ``max_batch`` itself), at a short and a
    long prompt; prompts stay within ``max_model_len``. Each point is the median of ``repeats``
    probes; a decode probe streams ``decode_tokens`` per sequence (fewer for a slow engine).
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    batches = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= max_batch} | {max_batch})
    lengths = [n for n in (16, 128, 256, 512, 1024) if n < max_model_len]
    if decode_tokens < 16 or repeats < 1:
        raise ValueError(f"decode_tokens must be >= 16 and repeats >= 1, got {decode_tokens} and {repeats}")
    long_prompt = min(LONG_DECODE_PROMPT, max_model_len - decode_tokens - 1)
    if len(lengths) < 2 or long_prompt <= 64:
        raise ValueError(
            f"max_model_len {max_model_len} is too small to measure (needs > {decode_tokens + 65})"
        )
    m = asyncio.run(
        measure(
            endpoint,
            model,
            vocab=vocab,
            batches=batches,
            prompt_lengths=lengths,
            decode_prompts=(32, long_prompt),
            decode_tokens=decode_tokens,
            repeats=repeats,
        )
    )
    profile = fit_profile(
        m,
        name,
        kv_capacity_tokens=kv_capacity_tokens,
        block_size=block_size,
        source=f"measured by tessera profile against {endpoint} (model {model})",
    )
    return profile, m

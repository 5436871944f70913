"""Reading vLLM's Prometheus histograms (no server: a mock transport answers /metrics)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tessera.bench import measure
from tessera.bench.measure import E2E, ITL, PREFILL, QUEUE, TTFT, replay, scrape, scrape_delta

METRICS = """# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} {n}
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} {n}
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} {ttft}
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_count{engine="0",model_name="tiny"} {itl_n}
vllm:inter_token_latency_seconds_sum{engine="0",model_name="tiny"} {itl}
vllm:inter_token_latency_seconds_count{engine="1",model_name="tiny"} 1.0
vllm:inter_token_latency_seconds_sum{engine="1",model_name="tiny"} 0.5
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_count{engine="0",model_name="tiny"} {n}
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="tiny"} {e2e}
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_count{engine="0",model_name="tiny"} {n}
vllm:request_prefill_time_seconds_sum{engine="0",model_name="tiny"} {prefill}
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_count{engine="0",model_name="tiny"} {n}
vllm:request_queue_time_seconds_sum{engine="0",model_name="tiny"} {queue}
# TYPE vllm:request_decode_time_seconds histogram
vllm:request_decode_time_seconds_count{engine="0",model_name="tiny"} {n}
vllm:request_decode_time_seconds_sum{engine="0",model_name="tiny"} {decode}
# TYPE vllm:request_generation_tokens histogram
vllm:request_generation_tokens_count{engine="0",model_name="tiny"} {n}
vllm:request_generation_tokens_sum{engine="0",model_name="tiny"} {generated}
"""


def _client(states: list[dict]) -> httpx.AsyncClient:
    calls = iter(states)

    def handler(request: httpx.Request) -> httpx.Response:
        state = next(calls)
        text = METRICS
        for key, value in state.items():
            text = text.replace("{" + key + "}", str(value))
        return httpx.Response(200, text=text)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def test_scrape_sums_label_sets_and_delta_gives_means():
    first = {"n": 2.0, "ttft": 0.4, "itl_n": 10.0, "itl": 0.1, "e2e": 3.0, "prefill": 0.05}
    first |= {"queue": 0.2, "decode": 1.0, "generated": 40.0}
    later = {"n": 4.0, "ttft": 1.0, "itl_n": 30.0, "itl": 0.5, "e2e": 7.0, "prefill": 0.09}
    later |= {"queue": 0.5, "decode": 2.2, "generated": 102.0}

    async def go():
        async with _client([first, first, later]) as client:
            before = await scrape(client, "http://x")
            assert before[ITL] == pytest.approx((0.6, 11.0))  # engine 0 + engine 1
            # The first re-scrape has no new E2E observation yet: scrape_delta waits for it.
            return await scrape_delta(client, "http://x", before, E2E, 2, timeout_s=5)

    delta = asyncio.run(go())
    assert delta.mean(TTFT) == pytest.approx(0.3)
    assert delta.mean(E2E) == pytest.approx(2.0)
    assert delta.mean(ITL) == pytest.approx(0.02)
    assert delta.mean(PREFILL) == pytest.approx(0.02)
    assert delta.mean(QUEUE) == pytest.approx(0.15)
    # two requests, 62 tokens: 60 decode steps took 1.2 s
    assert delta.decode_seconds_per_token() == pytest.approx(0.02)


def test_scrape_names_missing_metrics_and_empty_delta_raises():
    async def go(text: str):
        transport = httpx.MockTransport(lambda request: httpx.Response(200, text=text))
        async with httpx.AsyncClient(transport=transport) as client:
            return await scrape(client, "http://x")

    with pytest.raises(RuntimeError, match="disable-log-stats"):
        asyncio.run(go("# nothing here\n"))
    state = {"n": 1.0, "ttft": 0.1, "itl_n": 1.0, "itl": 0.1, "e2e": 1.0, "prefill": 0.1}
    state |= {"queue": 0.1, "decode": 0.1, "generated": 5.0}

    async def same():
        async with _client([state, state]) as client:
            before = await scrape(client, "http://x")
            return await scrape_delta(client, "http://x", before, E2E, 0)

    empty = asyncio.run(same())
    with pytest.raises(RuntimeError, match="no vllm:time_to_first_token_seconds"):
        empty.mean(TTFT)
    with pytest.raises(RuntimeError, match="no decode step"):
        empty.decode_seconds_per_token()


def test_replay_sends_at_trace_times_and_records_when_each_request_went(monkeypatch):
    """The fidelity bench reports how late the client sent (it shares the machine with the server)."""
    finished = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            n = float(len(finished))
            text = METRICS
            for key in ("n", "itl_n", "generated"):
                text = text.replace("{" + key + "}", str(n))
            for key in ("ttft", "itl", "e2e", "prefill", "queue", "decode"):
                text = text.replace("{" + key + "}", str(0.01 * n))
            return httpx.Response(200, text=text)
        body = json.loads(request.content)
        finished.append(body["max_tokens"])
        chunk = {"choices": [{"text": "a"}], "usage": {"completion_tokens": body["max_tokens"]}}
        return httpx.Response(200, text=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n")

    real_client = httpx.AsyncClient
    monkeypatch.setattr(
        measure.httpx, "AsyncClient", lambda **kw: real_client(transport=httpx.MockTransport(handler), **kw)
    )
    trace = [(0.0, 4, 1), (0.2, 4, 2), (0.4, 4, 3)]
    result = asyncio.run(replay("http://x", "tiny", trace, vocab=50))
    assert sorted(finished) == [1, 2, 3]
    assert [r.tokens for r in result.requests] == [1, 2, 3]
    for (arrival, _, _), r in zip(trace, result.requests, strict=True):
        assert arrival <= r.sent < arrival + 2.0  # not before its time; each its own time
    assert result.server.counts[E2E] == 3

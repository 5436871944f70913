"""The router's /metrics: answers by model, class kind and status (its own errors included), durations,
the client-side TTFT and SLO verdicts per class, connection failures per instance and the instance
gauges, over real HTTP handling (FastAPI's test client) with the workers answered by an httpx mock
transport."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tessera.api import load_documents
from tessera.local.control_plane import LocalEngine, plan_local
from tessera.router.app import RouterState, create_router_app
from tessera.router.backends import Backend

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _worker(failures: list[str]) -> httpx.MockTransport:
    """Workers that are ready, report batch size 4, refuse the first completion's connection and
    answer every later one (non-streamed with usage, streamed with three token chunks)."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/ready":
            return httpx.Response(200, json={"ready": True})
        if request.url.path == "/metrics":
            return httpx.Response(200, text=f'tessera_batch_size{{model="{MODEL}"}} 4\n')
        if not failures:
            failures.append(request.url.host)
            raise httpx.ConnectError("connection refused", request=request)
        body = json.loads(request.content)
        if body.get("stream"):
            chunk = {"choices": [{"text": "a", "finish_reason": None}]}
            done = {"choices": [{"text": "", "finish_reason": "length"}]}
            lines = [f"data: {json.dumps(chunk)}"] * 3 + [f"data: {json.dumps(done)}", "data: [DONE]"]
            return httpx.Response(200, text="\n\n".join(lines) + "\n\n",
                                  headers={"content-type": "text/event-stream"})  # fmt: skip
        usage = {"prompt_tokens": 5, "completion_tokens": 3}
        return httpx.Response(200, json={"choices": [], "usage": usage})

    return httpx.MockTransport(handle)


PLAN = plan_local(load_documents(EXAMPLES / "quickstart.yaml"), LocalEngine(), max_instances_per_group=2)
MODEL = PLAN.instances[0].config.models[0].name


def test_router_metrics_count_answers_errors_failover_and_instance_state() -> None:
    backends = [
        Backend(name=inst.name, url=f"http://w{n}", role=inst.role, config=inst.config)
        for n, inst in enumerate(PLAN.instances)
    ]
    hosts = {f"w{n}": inst.name for n, inst in enumerate(PLAN.instances)}
    failures: list[str] = []
    app = create_router_app(RouterState(backends), poll_interval_s=3600.0, transport=_worker(failures))
    with TestClient(app) as http:
        ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
        assert ok.status_code == 200 and failures  # the first instance refused, the next one answered
        assert ok.headers["x-tessera-instance"] != hosts[failures[0]]
        streamed = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True},
                             headers={"X-Tessera-Class": "batch"})  # fmt: skip
        assert streamed.status_code == 200 and streamed.text.count('"finish_reason": null') == 3
        assert http.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "x"},
                         headers={"X-Tessera-Class": "gold"}).status_code == 400  # fmt: skip
        assert http.post("/v1/completions", content=b"{not json").status_code == 400
        text = http.get("/metrics").text
    got = _samples(text)

    def requests(model: str, kind: str, code: str) -> float:
        key = (("code", code), ("kind", kind), ("model", model))
        return got.get(("tessera_router_requests_total", key), 0.0)

    assert requests(MODEL, "interactive", "200") == 1  # no class header: the default class
    assert requests(MODEL, "batch", "200") == 1
    assert requests("", "", "404") == 1  # an unserved model never becomes a label value
    assert requests(MODEL, "", "400") == 1  # unknown class
    assert requests("", "", "400") == 1  # not JSON
    duration = ("tessera_router_request_seconds_count", (("kind", "interactive"), ("model", MODEL)))
    assert got[duration] == 1
    # The client-side TTFT of every answer, per class: a stream's first token chunk, a whole answer.
    for kind, klass in (("batch", "offline"), ("interactive", "chat")):
        assert (
            got[("tessera_router_ttft_seconds_count", (("class", klass), ("kind", kind), ("model", MODEL)))]
            == 1
        )
    # Both met their class's SLO (the mock answers at once); the refused connection was retried unseen.
    for kind, klass in (("batch", "offline"), ("interactive", "chat")):
        assert (
            got[("tessera_router_slo_met_total", (("class", klass), ("kind", kind), ("model", MODEL)))] == 1
        )
        assert (
            got[("tessera_router_slo_missed_total", (("class", klass), ("kind", kind), ("model", MODEL)))]
            == 0
        )
    itl = (
        "tessera_router_mean_itl_seconds_count",
        (("class", "offline"), ("kind", "batch"), ("model", MODEL)),
    )
    assert got[itl] == 1  # the stream's three token chunks
    failed = hosts[failures[0]]
    assert got[("tessera_router_upstream_failures_total", (("instance", failed),))] == 1
    for inst in PLAN.instances:
        labels = (("instance", inst.name), ("model", MODEL), ("role", inst.role))
        # The refused instance left the rotation (no poll ran since); nothing is outstanding.
        assert got[("tessera_router_instance_ready", labels)] == (0.0 if inst.name == failed else 1.0)
        assert got[("tessera_router_outstanding", labels)] == 0
        assert got[("tessera_router_batch_size", labels)] == 4
        assert got[("tessera_router_estimated_wait_seconds", labels)] >= 0

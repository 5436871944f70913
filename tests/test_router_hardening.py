"""The router under hostile and unlucky clients, and under failing workers: real sim worker processes
behind the real router served on loopback (``router_harness``).

Each test is the regression test of one defect: hop-by-hop headers forwarded (a chunked request broke
the worker and took it out of the rotation), a form content type refused, 404/405 not in OpenAI
format, no size or time limits, a client leaving a non-streamed request not cancelling it, a worker
killed mid-stream leaving a truncated stream counted as 200; and the API keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from router_harness import CLASS_HEADER, MODEL, PLAN, raw_exchange, serve_router, start_workers

from tessera.cli import main
from tessera.local.supervisor import WorkerProcess
from tessera.router.app import RouterState, create_router_app
from tessera.router.auth import ApiKeys, ApiKeysError
from tessera.router.backends import Backend
from tessera.router.headers import upstream_headers
from tessera.router.limits import RouterLimits
from tessera.worker.engines.vllm_process import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 4}


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[WorkerProcess]]:
    """Two sim workers shared by the tests that do not kill one."""
    supervisor = start_workers(tmp_path_factory.mktemp("router-hardening"))
    try:
        yield list(supervisor.workers)
    finally:
        supervisor.stop_all()


async def _worker_busy(workers: list[WorkerProcess]) -> dict[str, float]:
    """Requests in flight or queued on each worker (its own /metrics)."""
    busy: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=5.0) as client:
        for w in workers:
            text = (await client.get(f"{w.url}/metrics")).text
            busy[w.instance.name] = sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith(("tessera_inflight{", "tessera_queue_length{"))
            )
    return busy


async def _until(check: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not (await check() if asyncio.iscoroutinefunction(check) else check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def _error(response: httpx.Response) -> dict[str, object]:
    data = response.json()
    assert set(data) == {"error"} and {"message", "type", "param", "code"} <= set(data["error"]), data
    return data["error"]


# Hop-by-hop headers stay on their connection. -------------------------------------------------------


def test_only_end_to_end_headers_go_upstream() -> None:
    incoming = [
        ("Host", "router:8000"),
        ("Content-Length", "42"),
        ("Content-Type", "application/x-www-form-urlencoded"),
        ("Transfer-Encoding", "chunked"),
        ("Connection", "keep-alive, X-Hop"),
        ("X-Hop", "named by Connection"),
        ("Keep-Alive", "timeout=5"),
        ("TE", "trailers"),
        ("Trailer", "X-Checksum"),
        ("Upgrade", "h2c"),
        ("Proxy-Authorization", "Basic eDp5"),
        ("Proxy-Connection", "keep-alive"),
        ("Expect", "100-continue"),
        ("Accept-Encoding", "br"),
        ("Authorization", "Bearer sk-secret-secret-secret"),
        (CLASS_HEADER, "batch"),
        ("X-Request-Id", "r1"),
        ("Accept", "text/event-stream"),
    ]
    sent = upstream_headers(incoming, drop_authorization=True)
    assert sent == [
        (CLASS_HEADER.lower(), "batch"),
        ("x-request-id", "r1"),
        ("accept", "text/event-stream"),
        ("content-type", "application/json"),
    ]
    # Without API keys on the router the client's Authorization is end to end.
    assert ("authorization", "Bearer sk-secret-secret-secret") in upstream_headers(
        incoming, drop_authorization=False
    )


async def test_chunked_and_hop_by_hop_requests_are_served_and_no_instance_leaves_the_rotation(
    workers: list[WorkerProcess],
) -> None:
    body = json.dumps(BODY).encode()

    async def chunked() -> AsyncIterator[bytes]:  # httpx sends an iterator as Transfer-Encoding: chunked
        yield body[:7]
        yield body[7:]

    hostile = [
        {"Connection": "keep-alive, X-Hop", "X-Hop": "1"},
        {"TE": "trailers", "Trailer": "X-Checksum"},
        {"Keep-Alive": "timeout=5", "Proxy-Connection": "keep-alive", "Proxy-Authorization": "Basic eDp5"},
        {"Upgrade": "h2c"},  # without Connection: upgrade it asks nothing
        {"Expect": "100-continue"},
    ]
    async with serve_router(workers) as router, httpx.AsyncClient(base_url=router.url, timeout=30) as client:
        for _ in range(4):
            r = await client.post(
                "/v1/completions", content=chunked(), headers={"content-type": "application/json"}
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
        for headers in hostile:
            r = await client.post("/v1/completions", content=body, headers=headers)
            assert r.status_code == 200, (headers, r.text)
        assert all(router.healthy().values())
        assert await router.metric("tessera_router_upstream_failures_total") == 0


# curl's default form content type; 404/405 bodies. --------------------------------------------------


def _readme_curl() -> str:
    match = re.search(r"^curl .*?(?<!\\)$", README, flags=re.M | re.S)
    assert match, "README has no curl example"
    return match.group(0).replace("\\\n", " ")


async def test_readme_curl_example_and_a_form_content_type_are_answered(workers: list[WorkerProcess]) -> None:
    command = _readme_curl()
    assert "Content-Type: application/json" in command  # the README shows the right way
    async with serve_router(workers) as router:
        as_written = command.replace("http://127.0.0.1:8000", router.url)
        # curl -d without a content type sends application/x-www-form-urlencoded: still JSON to the router.
        as_form = as_written.replace("-H 'Content-Type: application/json'", "")
        for line in (as_written, as_form):
            proc = await asyncio.create_subprocess_exec(
                *shlex.split(line), "-w", "\n%{http_code}", stdout=asyncio.subprocess.PIPE
            )
            out, _ = await asyncio.wait_for(proc.communicate(), 30)
            text, _, code = out.decode().rpartition("\n")
            assert code == "200", text
            assert json.loads(text)["usage"]["completion_tokens"] == 16
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as client:
            form = await client.post("/v1/completions", data={"model": MODEL, "prompt": "hi"})
            assert form.status_code == 400
            assert "Content-Type: application/json" in _error(form)["message"]


async def test_unknown_paths_and_methods_get_openai_errors(workers: list[WorkerProcess]) -> None:
    async with serve_router(workers) as router, httpx.AsyncClient(base_url=router.url, timeout=10) as client:
        missing = await client.post("/v1/embeddings", json=BODY)
        assert missing.status_code == 404
        error = _error(missing)
        assert "/v1/embeddings" in error["message"] and error["type"] == "not_found_error"
        wrong = await client.get("/v1/chat/completions")
        assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
        error = _error(wrong)
        assert "GET" in error["message"] and "POST" in error["message"]
        assert error["type"] == "invalid_request_error"


# Size and time limits. ------------------------------------------------------------------------------


async def test_body_and_header_size_limits_answer_413_and_431(workers: list[WorkerProcess]) -> None:
    limits = RouterLimits()
    async with serve_router(workers) as router:
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as client:
            prompt = "x" * (limits.max_body_bytes + 1)
            big = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
            assert big.status_code == 413
            assert "--max-body-bytes" in _error(big)["message"]
            assert big.headers["connection"] == "close"
        # A 50 MB body announced with Expect: 100-continue is refused before it is sent.
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
            f"Content-Length: {50_000_000}\r\nExpect: 100-continue\r\n\r\n"
        ).encode()
        answer = await raw_exchange(router.port, head)
        assert answer is not None and answer.status == 413
        # Headers: one over the limit, and one endless header cut off before it ends.
        header = b"X-Big: " + b"a" * limits.max_header_bytes + b"\r\n"
        answer = await raw_exchange(router.port, b"GET /health HTTP/1.1\r\nHost: r\r\n" + header + b"\r\n")
        assert answer is not None and answer.status == 431
        assert "--max-header-bytes" in answer.error()["message"]
        endless = [b"GET /health HTTP/1.1\r\nHost: r\r\nX-Endless: "] + [b"a" * 65536] * 320  # 20 MiB
        answer = await raw_exchange(router.port, endless)
        assert answer is not None and answer.status == 431
        assert await router.metric("tessera_router_requests_total", code="431") == 2
        # Within the limits all is well.
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as client:
            ok = await client.post("/v1/completions", json=BODY, headers={"X-Pad": "p" * 16000})
            assert ok.status_code == 200


async def test_slow_clients_get_408_and_idle_connections_close(workers: list[WorkerProcess]) -> None:
    limits = RouterLimits(header_timeout_s=1.0, body_timeout_s=1.0)
    async with serve_router(workers, limits=limits) as router:
        started = time.monotonic()
        slow_head = [b"POST /v1/completions HTTP/1.1\r\n", b"Host: r\r\n", b"X-Slow: 1\r\n"]
        answer = await raw_exchange(router.port, slow_head, pause_s=0.4)
        assert answer is not None and answer.status == 408
        assert "--header-timeout" in answer.error()["message"]
        assert time.monotonic() - started < 5
        # The body announces 100 bytes and sends 10.
        head = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 100\r\n\r\n"
        answer = await raw_exchange(router.port, [head, b'{"model": '])
        assert answer is not None and answer.status == 408
        assert "--body-timeout" in answer.error()["message"]
        # A connection that never sends anything is closed without an answer.
        started = time.monotonic()
        assert await raw_exchange(router.port, b"") is None
        assert time.monotonic() - started < 5


# A client leaving a non-streamed request. -----------------------------------------------------------


async def test_client_leaving_a_non_streamed_request_cancels_it_on_the_worker(
    workers: list[WorkerProcess],
) -> None:
    async with serve_router(workers) as router:
        await _until(lambda: all(router.healthy().values()), 10, "both instances ready")
        long = {"model": MODEL, "prompt": "hello", "max_tokens": 3000}  # about 13 s on the sim engine
        async with httpx.AsyncClient(base_url=router.url) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/completions", json=long, timeout=httpx.Timeout(30.0, read=1.5))
        left = time.monotonic()

        async def idle() -> bool:
            return sum((await _worker_busy(workers)).values()) == 0

        await _until(idle, 3.0, "the worker to cancel the abandoned request")
        assert time.monotonic() - left < 3.0
        assert await router.metric("tessera_router_requests_total", code="499") == 1
        assert await router.metric("tessera_router_requests_total", code="200") == 0
        assert sum(x.outstanding for x in router.state.loads.values()) == 0


async def test_client_leaving_a_stream_mid_way_cancels_it_on_the_worker(workers: list[WorkerProcess]) -> None:
    async with serve_router(workers) as router:
        await _until(lambda: all(router.healthy().values()), 10, "both instances ready")
        before = await router.metric("tessera_router_requests_total", code="499")
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 3000, "stream": True}
        async with (
            httpx.AsyncClient(base_url=router.url, timeout=30) as client,
            client.stream("POST", "/v1/completions", json=body) as response,
        ):
            assert response.status_code == 200
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: {")
                if seen == 5:
                    break  # leaving the block closes the connection mid-stream
        left = time.monotonic()

        async def idle() -> bool:
            return sum((await _worker_busy(workers)).values()) == 0

        await _until(idle, 3.0, "the worker to cancel the abandoned stream")
        assert time.monotonic() - left < 3.0
        await _until(lambda: sum(x.outstanding for x in router.state.loads.values()) == 0, 3.0, "release")
        assert await router.metric("tessera_router_requests_total", code="499") == before + 1
        assert await router.metric("tessera_router_requests_total", code="200") == 0


# A worker killed while it answers. ------------------------------------------------------------------


async def test_worker_killed_mid_stream_ends_the_stream_with_an_error_event(tmp_path: Path) -> None:
    supervisor = start_workers(tmp_path)
    try:
        async with serve_router(supervisor.workers) as router:
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 3000, "stream": True}
            lines: list[str] = []
            async with (
                httpx.AsyncClient(base_url=router.url, timeout=30) as client,
                client.stream("POST", "/v1/completions", json=body) as response,
            ):
                assert response.status_code == 200
                instance = response.headers["x-tessera-instance"]
                async for line in response.aiter_lines():
                    lines.append(line)
                    if len(lines) == 10:
                        victim = next(w for w in supervisor.workers if w.instance.name == instance)
                        assert victim.proc is not None
                        victim.proc.kill()
            data = [ln for ln in lines if ln.startswith("data: ")]
            assert data[-1] == "data: [DONE]"
            error = json.loads(data[-2][len("data: ") :])["error"]
            assert error["code"] == "upstream_failed" and instance in error["message"]
            assert 3 <= sum('"finish_reason": null' in ln for ln in data) < 3000
            assert await router.metric("tessera_router_requests_total", code="502") == 1
            assert await router.metric("tessera_router_requests_total", code="200") == 0
            assert await router.metric("tessera_router_upstream_failures_total", instance=instance) == 1
    finally:
        supervisor.stop_all()


async def test_worker_killed_before_a_non_streamed_answer_is_retried_on_another_instance(
    tmp_path: Path,
) -> None:
    supervisor = start_workers(tmp_path)
    try:
        async with serve_router(supervisor.workers) as router:
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 600}
            async with httpx.AsyncClient(base_url=router.url, timeout=60) as client:
                task = asyncio.create_task(client.post("/v1/completions", json=body))
                busy: dict[str, float] = {}

                async def started() -> bool:
                    busy.update(await _worker_busy(supervisor.workers))
                    return any(busy.values())

                await _until(started, 10, "the request to start on a worker")
                victim = next(w for w in supervisor.workers if busy[w.instance.name])
                assert victim.proc is not None
                victim.proc.kill()
                answer = await task
            assert answer.status_code == 200
            assert answer.headers["x-tessera-instance"] != victim.instance.name
            assert answer.json()["usage"]["completion_tokens"] == 600
            assert await router.metric("tessera_router_upstream_failures_total") == 1
    finally:
        supervisor.stop_all()


def test_a_stream_the_worker_ends_with_an_error_event_counts_as_a_failure() -> None:
    error = {"error": {"message": "engine failed", "type": "server_error", "param": None, "code": 500}}
    events = ['data: {"choices": [{"text": "a", "finish_reason": null}]}', f"data: {json.dumps(error)}"]
    sse = "".join(f"{e}\n\n" for e in [*events, "data: [DONE]"])

    def worker(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/ready":
            return httpx.Response(200, json={"ready": True})
        if request.url.path == "/metrics":
            return httpx.Response(200, text="")
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    backends = [
        Backend(name=i.name, url=f"http://w{n}", role=i.role, config=i.config)
        for n, i in enumerate(PLAN.instances)
    ]
    app = create_router_app(RouterState(backends), poll_interval_s=3600.0,
                            transport=httpx.MockTransport(worker))  # fmt: skip
    with TestClient(app) as http:
        streamed = http.post("/v1/completions", json={**BODY, "stream": True})
        assert streamed.status_code == 200 and "engine failed" in streamed.text
        metrics = http.get("/metrics").text
    assert f'tessera_router_requests_total{{code="502",kind="interactive",model="{MODEL}"}} 1.0' in metrics


def test_a_draining_worker_s_refusal_is_retried_on_another_instance() -> None:
    # A pod whose group a re-placement removes drains: it refuses new requests with 503 "draining"
    # until the readiness poll takes it out; the router sends them elsewhere, so none is dropped.
    calls: list[str] = []
    answer = {"choices": [{"text": "a", "finish_reason": "length"}], "usage": {"completion_tokens": 1}}

    def worker(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/ready":
            return httpx.Response(200, json={"ready": True})
        if request.url.path == "/metrics":
            return httpx.Response(200, text="")
        calls.append(request.url.host)
        if request.url.host == "w0":
            refusal = {"error": {"message": "shutting down", "type": "server_error", "code": "draining"}}
            return httpx.Response(503, json=refusal)
        return httpx.Response(200, json=answer)

    backends = [
        Backend(name=i.name, url=f"http://w{n}", role=i.role, config=i.config)
        for n, i in enumerate(PLAN.instances)
    ]
    app = create_router_app(RouterState(backends), poll_interval_s=3600.0,
                            transport=httpx.MockTransport(worker))  # fmt: skip
    with TestClient(app) as http:
        codes = [http.post("/v1/completions", json=BODY).status_code for _ in range(4)]
    assert codes == [200] * 4, calls
    assert calls.count("w0") == 1, calls  # it was tried, then left out


# API keys. ------------------------------------------------------------------------------------------

KEYS = """
keys:
  - key: sk-team-a-0123456789abcdef
    tenant: team-a
  - key: sk-team-b-0123456789abcdef
    tenant: team-b
    classes: [offline]
  - key: sk-team-c-0123456789abcdef
    tenant: team-c
    models: [another-model]
"""


def test_api_keys_file_is_validated(tmp_path: Path) -> None:
    cases = {
        "keys: []\n": "keys: List should have at least 1 item",
        "keys:\n  - key: short\n    tenant: a\n": "keys.0.key: String should have at least 16 characters",
        "keys:\n  - key: sk-0123456789abcdef\n": "keys.0.tenant: Field required",
        "keys:\n  - {key: sk-0123456789abcdef, tenant: a}\n  - {key: sk-0123456789abcdef, tenant: b}\n": (
            "keys.1.key repeats the key of tenant 'a'"
        ),
        "keys:\n  - {key: sk-0123456789abcdef, tenant: a, scopes: [x]}\n": "keys.0.scopes: Extra inputs",
        "keys: [\n": "not valid JSON/YAML",
    }
    path = tmp_path / "keys.yaml"
    for text, problem in cases.items():
        path.write_text(text)
        with pytest.raises(ApiKeysError, match=re.escape(problem)):
            ApiKeys(path)
    with pytest.raises(ApiKeysError, match="cannot read API keys file"):
        ApiKeys(tmp_path / "absent.yaml")


def test_router_command_refuses_bad_limits_and_key_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    backends = tmp_path / "absent.yaml"  # never read: the settings are checked first
    bad_keys = tmp_path / "keys.yaml"
    bad_keys.write_text("keys:\n  - {key: short, tenant: a}\n")
    cases = {
        ("--max-body-bytes", "0"): "--max-body-bytes must be a finite number > 0, got 0",
        ("--header-timeout", "nan"): "--header-timeout must be a finite number > 0, got nan",
        ("--body-timeout", "-1"): "--body-timeout must be a finite number > 0",
        ("--max-header-bytes", "100"): "--max-header-bytes must be >= 1024",
        ("--api-keys", str(bad_keys)): "keys.0.key: String should have at least 16 characters",
        ("--hold-max", "0"): "--hold-max must be at least 1, got 0",
        ("--batch-orphan-wait", "inf"): "--batch-orphan-wait must be a finite number of seconds >= 0",
    }
    for flags, problem in cases.items():
        assert main(["router", "--backends", str(backends), *flags]) == 2
        assert problem in capsys.readouterr().err


async def test_api_keys_authenticate_and_authorize(workers: list[WorkerProcess], tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(KEYS)
    keys = ApiKeys(path)

    def auth(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    async with (
        serve_router(workers, api_keys=keys, poll_interval_s=0.2) as router,
        httpx.AsyncClient(base_url=router.url, timeout=30) as client,
    ):
        missing = await client.post("/v1/completions", json=BODY)
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert "Authorization: Bearer" in _error(missing)["message"]
        wrong = await client.post("/v1/completions", json=BODY, headers=auth("sk-nobody-0123456789abcdef"))
        assert wrong.status_code == 401 and _error(wrong)["code"] == "invalid_api_key"
        basic = await client.post("/v1/completions", json=BODY, headers={"Authorization": "Basic eDp5"})
        assert basic.status_code == 401
        ok = await client.post("/v1/completions", json=BODY, headers=auth("sk-team-a-0123456789abcdef"))
        assert ok.status_code == 200
        # team-b may use the batch class only; the default class is chat.
        b = auth("sk-team-b-0123456789abcdef")
        denied = await client.post("/v1/completions", json=BODY, headers=b)
        assert denied.status_code == 403
        error = _error(denied)
        assert error["code"] == "class_not_allowed" and CLASS_HEADER in error["message"]
        allowed = await client.post("/v1/completions", json=BODY, headers={**b, CLASS_HEADER: "batch"})
        assert allowed.status_code == 200
        c = auth("sk-team-c-0123456789abcdef")
        other = await client.post("/v1/completions", json=BODY, headers=c)
        assert other.status_code == 403 and _error(other)["param"] == "model"
        assert (await client.get("/v1/models", headers=c)).json()["data"] == []
        assert [m["id"] for m in (await client.get("/v1/models", headers=b)).json()["data"]] == [MODEL]
        assert (await client.get("/v1/models")).status_code == 401
        assert (await client.get("/health")).status_code == 200  # probes need no key
        assert (await client.get("/ready")).status_code == 200
        for ops in ("/metrics", "/router/status"):  # what every tenant sent: not for every client
            assert (await client.get(ops)).status_code == 401
            assert (await client.get(ops, headers=b)).status_code == 200
        # A rotated Secret: the file changes, the router reads it at its next poll.
        path.write_text(KEYS.replace("sk-team-a-0123456789abcdef", "sk-team-a-rotated-000000000"))

        async def rotated() -> bool:
            r = await client.post("/v1/completions", json=BODY, headers=auth("sk-team-a-rotated-000000000"))
            return r.status_code == 200

        await _until(rotated, 5, "the rotated key")
        old = await client.post("/v1/completions", json=BODY, headers=auth("sk-team-a-0123456789abcdef"))
        assert old.status_code == 401
        path.write_text("keys: [\n")  # broken: the router keeps the keys it has
        await asyncio.sleep(0.6)
        again = await client.post("/v1/completions", json=BODY, headers=auth("sk-team-a-rotated-000000000"))
        assert again.status_code == 200


def test_router_serves_metrics_and_status_on_the_metrics_port_only(
    workers: list[WorkerProcess], tmp_path: Path
) -> None:
    """``tessera router --metrics-port``: /metrics and /router/status there (no key: the NetworkPolicy
    admits Prometheus alone on it), not on the clients' port, which serves everything else."""
    backends = tmp_path / "backends.json"
    backends.write_text(json.dumps({"backends": [workers[0].backend().to_json()]}))
    keys = tmp_path / "keys.yaml"
    keys.write_text(KEYS)
    port, ops = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tessera", "router", "--backends", str(backends),
                             "--port", str(port), "--metrics-port", str(ops), "--api-keys", str(keys),
                             "--poll-interval", "0.2"])  # fmt: skip
    key = {"Authorization": "Bearer sk-team-a-0123456789abcdef"}
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "the router did not get ready"
            time.sleep(0.1)
        served = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=BODY, headers=key, timeout=30)
        assert served.status_code == 200
        for path in ("/metrics", "/router/status"):
            assert httpx.get(f"http://127.0.0.1:{port}{path}", headers=key).status_code == 404
            assert httpx.get(f"http://127.0.0.1:{ops}{path}").status_code == 200
        metrics = httpx.get(f"http://127.0.0.1:{ops}/metrics").text
        assert 'tessera_router_requests_total{code="200"' in metrics
        assert httpx.get(f"http://127.0.0.1:{ops}/v1/models", headers=key).status_code == 404
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()

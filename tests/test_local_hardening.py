"""Local mode as shipped (the quickstart, autoscaling on, so the router runs Chiron's hold), probed as an
attacker and an ordinary client would, with the official ``openai`` client where a client is involved.

Each test is the regression test of one defect a probe of local mode found: a prompt no instance could
ever hold was held forever; a held request had no bound; a killed worker was never reaped, replaced or
dropped; two class headers or two Authorization headers were served; fields the official client sends
were refused as unknown; ``models.retrieve`` was a 404; NaN was "less than or equal to 2".

The spec differs from the quickstart in three places only: the pool keeps at least two instances (so a
killed worker's non-streamed requests have another instance to be retried on), its global autoscaler
evaluates on its own once an hour (and, as ever, at once while interactive work is held: no evaluation
re-roles an instance to take the held batch request while a test watches its bound), and a second
batch class, ``bulk``, bounds its queue time to 1 s (so a held request's bound shows in a test's time).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from tessera.api import load_documents
from tessera.local.control_plane import LocalEngine, plan_local
from tessera.local.runner import LocalStack
from tessera.worker.engines.vllm_process import free_port

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="module")]
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
START_S = 60.0  # a sim worker's start time (the stack's ready timeout)
BULK = """
---
apiVersion: tessera.dev/v1alpha1
kind: RequestClass
metadata:
  name: bulk
spec:
  kind: batch
  slo:
    deadlineSeconds: 3600
  queue:
    maxQueueTimeSeconds: 1
  match:
    value: bulk
"""


def _spec(tmp: Path) -> Path:
    text = (EXAMPLES / "quickstart.yaml").read_text()
    for old, new in (
        ("  instances:\n    min: 1\n", "  instances:\n    min: 2\n"),
        ("  replicas:\n    min: 1\n", "  replicas:\n    min: 2\n"),
        ("    intervalSeconds: 5\n", "    intervalSeconds: 3600\n"),
        ("    - name: offline\n", "    - name: offline\n    - name: bulk\n"),
    ):
        assert old in text, old
        text = text.replace(old, new)
    path = tmp / "spec.yaml"
    path.write_text(text + BULK)
    return path


class Local:
    """The running stack, what it reported, and its model and class header."""

    def __init__(self, stack: LocalStack, lines: list[str]) -> None:
        self.stack = stack
        self.lines = lines
        self.model = stack.plan.instances[0].config.models[0].name
        self.header = stack.plan.instances[0].config.class_header

    def client(self, **headers: str) -> openai.AsyncOpenAI:
        """The official client on the router, as a user points it there."""
        return openai.AsyncOpenAI(base_url=f"{self.stack.endpoint}/v1", api_key="unused", max_retries=0,
                                  default_headers={self.header: "chat", **headers})  # fmt: skip

    def healthy(self) -> dict[str, bool]:
        assert self.stack.state is not None
        return {x.instance: x.healthy for x in self.stack.state.loads.values()}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def local(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Local]:
    tmp = tmp_path_factory.mktemp("local-hardening")
    plan = plan_local(load_documents(_spec(tmp)), LocalEngine(), max_instances_per_group=2)
    assert plan.instances[0].config.scheduling.autoscale.enabled
    lines: list[str] = []
    stack = LocalStack(plan, tmp / "run", "127.0.0.1", free_port(), report=lines.append)
    await stack.start(START_S)
    try:
        here = Local(stack, lines)
        await _until(lambda: len(here.healthy()) == 2 and all(here.healthy().values()), 10, "two instances")
        yield here
    finally:
        await stack.stop()


async def _until(check: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def _error(response: httpx.Response) -> dict[str, object]:
    data = response.json()
    assert set(data) == {"error"} and {"message", "type", "param", "code"} <= set(data["error"]), data
    return data["error"]


# 1. Nothing waits forever. -------------------------------------------------------------------------


async def test_a_prompt_no_instance_could_hold_is_refused_at_arrival(local: Local) -> None:
    async with httpx.AsyncClient(base_url=local.stack.endpoint, timeout=30) as client:
        # The probe's request: 2,000,000 characters, max_tokens 1, each class. Estimated from its text
        # at the router (too large: not held), counted by the worker, refused with the sizes.
        for cls in ("chat", "batch"):
            started = time.monotonic()
            body = {"model": local.model, "prompt": "x" * 2_000_000, "max_tokens": 1}
            big = await client.post("/v1/completions", headers={local.header: cls}, json=body)
            assert big.status_code == 400, big.text
            assert time.monotonic() - started < 10
            message = _error(big)["message"]
            assert "8192" in message and "2000001 tokens" in message, message
        # Token ids are counted at the router: refused there, naming the sizes, before any hold.
        body = {"model": local.model, "prompt": [5] * 9000, "max_tokens": 1}
        ids = await client.post("/v1/completions", headers={local.header: "chat"}, json=body)
        assert ids.status_code == 400
        error = _error(ids)
        assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        assert "9000 tokens" in str(error["message"]) and "8192 tokens of context" in str(error["message"])
        # Within the sizes all is well.
        ok = await client.post("/v1/completions", headers={local.header: "chat"},
                               json={"model": local.model, "prompt": [5] * 100, "max_tokens": 2})  # fmt: skip
        assert ok.status_code == 200, ok.text
    assert local.stack.state is not None and local.stack.state.hold.held() == {}


async def test_a_held_request_ends_by_its_class_bound_with_503_and_retry_after(local: Local) -> None:
    # Batch work waits in the router for a batch instance (there is none: the pool is interactive);
    # the bulk class bounds its queue time to 1 s.
    async with httpx.AsyncClient(base_url=local.stack.endpoint, timeout=30) as client:
        started = time.monotonic()
        held = await client.post("/v1/completions", headers={local.header: "bulk"},
                                 json={"model": local.model, "prompt": "hello", "max_tokens": 2})  # fmt: skip
        waited = time.monotonic() - started
    assert held.status_code == 503, held.text
    assert held.headers["retry-after"] == "30"
    error = _error(held)
    assert error["code"] == "hold_timeout" and "queue.maxQueueTimeSeconds" in str(error["message"])
    assert 1.0 <= waited < 5.0
    assert local.stack.state is not None and local.stack.state.hold.held() == {}


# 2. A dead worker is reaped, dropped and replaced. --------------------------------------------------


async def test_a_killed_worker_is_reaped_dropped_and_replaced_losing_only_its_stream(local: Local) -> None:
    state = local.stack.state
    assert state is not None
    chat = {local.header: "chat"}
    short = {"model": local.model, "prompt": "hello", "max_tokens": 200}
    async with httpx.AsyncClient(base_url=local.stack.endpoint, timeout=60) as client:
        long = {"model": local.model, "prompt": "hello", "max_tokens": 3000, "stream": True}
        async with client.stream("POST", "/v1/completions", json=long, headers=chat) as stream:
            assert stream.status_code == 200
            name = stream.headers["x-tessera-instance"]
            victim = next(w for w in local.stack.supervisor.workers if w.instance.name == name)
            assert victim.proc is not None
            pid = victim.proc.pid
            shorts = [asyncio.create_task(client.post("/v1/completions", json=short, headers=chat))
                      for _ in range(6)]  # fmt: skip
            await asyncio.sleep(0.5)
            os.kill(pid, signal.SIGKILL)
            # reaped, then out of the router until its restart (a second later: the default backoff)
            dropped = asyncio.create_task(_until(
                lambda: victim.dead and name not in {x.instance for x in state.loads.values()}, 5, "the drop"
            ))  # fmt: skip
            events = [line async for line in stream.aiter_lines() if line.startswith("data: ")]
        # The stream on the dead worker ends with the error event; the non-streamed requests are
        # answered (those on the dead worker retried on the other instance).
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data: ") :])["error"]["code"] == "upstream_failed"
        answers = await asyncio.gather(*shorts)
        assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
        assert all(a.json()["usage"]["completion_tokens"] == 200 for a in answers)
        # Reaped (no zombie), logged, dropped from the router until its restart.
        death = f"worker {name} (pid {pid}) was killed by SIGKILL"
        await _until(lambda: any(death in ln for ln in local.lines), 5, "the death to be reported")
        await dropped
        assert not os.path.exists(f"/proc/{pid}")
        # Replaced within its start time: back in the rotation, and serving.
        await _until(lambda: local.healthy().get(name, False), START_S, "the replacement")
        assert victim.proc.pid != pid and any(f"worker {name} restarted" in ln for ln in local.lines)
        direct = await client.post(
            f"{victim.url}/v1/completions", json={**long, "max_tokens": 5}, headers=chat
        )
        assert direct.status_code == 200 and direct.text.rstrip().endswith("data: [DONE]")
        for _ in range(4):
            r = await client.post("/v1/completions", json={**short, "max_tokens": 2}, headers=chat)
            assert r.status_code == 200


# 3, 4. Ambiguous headers. --------------------------------------------------------------------------


async def test_two_class_headers_or_two_authorization_headers_are_refused(local: Local) -> None:
    body = {"model": local.model, "prompt": "hello", "max_tokens": 2}
    async with httpx.AsyncClient(base_url=local.stack.endpoint, timeout=30) as client:
        two = await client.post("/v1/completions", json=body,
                                headers=[(local.header, "chat"), (local.header, "batch")])  # fmt: skip
        assert two.status_code == 400
        error = _error(two)
        assert error["param"] == local.header and local.header in str(error["message"])
        assert "'chat'" in str(error["message"]) and "'batch'" in str(error["message"])
        same = await client.post("/v1/completions", json=body,
                                 headers=[(local.header, "chat"), (local.header, "chat")])  # fmt: skip
        assert same.status_code == 200
        for keys in (("Bearer sk-good-0123456789", "Bearer sk-bad-0123456789"), ("Basic eDp5", "Bearer x")):
            creds = [("Authorization", k) for k in keys]
            for path in ("/v1/completions", "/v1/models"):
                r = await client.request("POST" if "compl" in path else "GET", path, json=body, headers=creds)
                assert r.status_code == 400, (path, r.text)
                error = _error(r)
                assert error["code"] == "ambiguous_credentials" and error["param"] == "Authorization"


# 5. The fields the official client sends. ----------------------------------------------------------


async def test_fields_the_official_client_sends_are_served_ignored_or_refused_with_the_reason(
    local: Local,
) -> None:
    client = local.client()
    messages = [{"role": "user", "content": "hi"}]
    chat = await client.chat.completions.create(
        model=local.model, messages=messages, max_tokens=2, metadata={"team": "a"}, store=True,
        user="end-user-1", safety_identifier="u-1", service_tier="auto", parallel_tool_calls=False,
        prompt_cache_key="session-1", prompt_cache_retention="24h", reasoning_effort="none",
        verbosity="medium", modalities=["text"], prediction={"type": "content", "content": "hi"},
    )  # fmt: skip
    assert chat.usage is not None and chat.usage.completion_tokens == 2
    completion = await client.completions.create(model=local.model, prompt="hi", max_tokens=2, user="u")
    assert completion.usage is not None and completion.usage.completion_tokens == 2
    refused = {
        "service_tier": ({"service_tier": "priority"}, "one processing tier"),
        "reasoning_effort": ({"reasoning_effort": "high"}, "no reasoning budget"),
        "audio": ({"audio": {"voice": "alloy", "format": "wav"}}, "audio output is not served"),
        "web_search_options": ({"web_search_options": {}}, "web search is not available"),
        "logit_bias": ({"logit_bias": {"5": 1}}, "logit_bias is not supported"),
    }
    for field, (extra, reason) in refused.items():
        with pytest.raises(openai.BadRequestError, match=reason) as caught:
            await client.chat.completions.create(model=local.model, messages=messages, max_tokens=2, **extra)
        assert field in str(caught.value)
    with pytest.raises(openai.BadRequestError, match="suffix"):
        await client.completions.create(model=local.model, prompt="hi", max_tokens=2, suffix="!")


# 6. models.retrieve. -------------------------------------------------------------------------------


async def test_models_retrieve_and_an_unknown_model_s_404(local: Local) -> None:
    client = local.client()
    model = await client.models.retrieve(local.model)  # a model id with a slash, sent as %2F
    assert model.id == local.model and model.model_extra["max_model_len"] == 8192
    with pytest.raises(openai.NotFoundError) as missing:
        await client.models.retrieve("no-such/model")
    assert missing.value.body["type"] == "not_found_error" and missing.value.body["code"] == "model_not_found"
    assert "'no-such/model'" in missing.value.body["message"] and local.model in missing.value.body["message"]


# 7. Non-finite numbers. ----------------------------------------------------------------------------


async def test_non_finite_numbers_must_be_finite(local: Local) -> None:
    async with httpx.AsyncClient(base_url=local.stack.endpoint, timeout=30) as client:
        for field, value in (
            ("temperature", "NaN"),
            ("top_p", "Infinity"),
            ("presence_penalty", "-Infinity"),
        ):
            content = f'{{"model": "{local.model}", "prompt": "x", "max_tokens": 2, "{field}": {value}}}'
            r = await client.post("/v1/completions", content=content.encode())
            assert r.status_code == 400
            error = _error(r)
            assert error["param"] == field and f"{field}: must be a finite number" in str(error["message"])


async def test_after_the_probes_local_mode_still_serves(local: Local) -> None:
    client = local.client()
    answer = await client.chat.completions.create(model=local.model, max_tokens=2,
                                                  messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    assert answer.choices[0].message.content is not None
    assert all(w.proc is not None and w.proc.poll() is None for w in local.stack.supervisor.workers)

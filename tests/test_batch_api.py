"""The Batch API on the user's path: the official `openai` client against local mode (sim engine, one
stack for the module: router, one worker, the `tessera batch` process) with two API keys.

Upload, create, poll, download: every custom_id once, each body what the same request gets online;
bad input refused OpenAI's way, naming the line; cancel and expiry answer every unsent line in the
error file; a kill -9 of the batch process mid-job, then a restart, completes with each custom_id
exactly once; one key cannot see, read, cancel or delete another's files and batches."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tessera.api import load_documents
from tessera.local.control_plane import LocalEngine, plan_local
from tessera.local.runner import LocalStack
from tessera.router.auth import ApiKeys
from tessera.worker.engines.vllm_process import free_port

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
KEY_A = "sk-team-a-0123456789abcdef"
KEY_B = "sk-team-b-0123456789abcdef"
KEY_CHAT = "sk-chat-only-0123456789ab"  # a key that may not use the batch class
KEY_TIGHT = "sk-team-tight-0123456789ab"  # a tenant whose per-minute token budget is small
TIGHT_TOKENS_PER_MINUTE = 300
CHAT = "/v1/chat/completions"
FINAL = ("completed", "failed", "expired", "cancelled")


class Stack:
    """A local-mode stack served from its own event loop (the tests are synchronous clients)."""

    def __init__(self, tmp: Path, with_keys: bool = True) -> None:
        keys = tmp / "keys.json"
        entries = [{"key": KEY_A, "tenant": "team-a"}, {"key": KEY_B, "tenant": "team-b"},
                   {"key": KEY_CHAT, "tenant": "chat", "classes": ["chat"]},
                   {"key": KEY_TIGHT, "tenant": "team-tight",
                    "quota": {"tokensPerMinute": TIGHT_TOKENS_PER_MINUTE}}]  # fmt: skip
        keys.write_text(json.dumps({"keys": entries}))
        plan = plan_local(
            load_documents(EXAMPLES / "quickstart.yaml"), LocalEngine(), max_instances_per_group=1
        )
        self.model = plan.instances[0].config.models[0].name
        self.local = LocalStack(plan, tmp / "run", "127.0.0.1", free_port(), autoscale=False, batch=True,
                                api_keys=ApiKeys(keys) if with_keys else None)  # fmt: skip
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.local.start(60.0), self.loop).result(120)

    def client(self, key: str = KEY_A) -> Any:
        return openai.OpenAI(base_url=f"{self.local.endpoint}/v1", api_key=key, max_retries=0, timeout=30.0)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.local.stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("batch"))
    try:
        yield s
    finally:
        s.close()


def _chat_line(model: str, i: int, max_tokens: int = 6, **extra: Any) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"question {i}"}],
        "max_tokens": max_tokens,
    }
    return {"custom_id": f"req-{i}", "method": "POST", "url": CHAT, "body": body, **extra}


def _upload(client: Any, lines: list[dict[str, Any]] | list[str]) -> Any:
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    return client.files.create(file=("input.jsonl", text.encode()), purpose="batch")


def _wait(client: Any, batch_id: str, until: tuple[str, ...] = FINAL, timeout_s: float = 240.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.2)


def _lines(client: Any, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def _every_id_once(client: Any, batch: Any, n: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    out, err = _lines(client, batch.output_file_id), _lines(client, batch.error_file_id)
    ids = [x["custom_id"] for x in out + err]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(n)), "each custom_id exactly once"
    assert batch.request_counts.total == n
    assert (batch.request_counts.completed, batch.request_counts.failed) == (len(out), len(err))
    return out, err


def test_batch_completes_with_the_online_answers(stack: Stack) -> None:
    client = stack.client()
    lines = [_chat_line(stack.model, i) for i in range(12)]
    uploaded = _upload(client, lines)
    assert client.files.retrieve(uploaded.id).purpose == "batch"
    created = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h",
                                    metadata={"job": "nightly-eval"})  # fmt: skip
    assert created.status == "validating" and created.expires_at == created.created_at + 24 * 3600
    batch = _wait(client, created.id)
    assert batch.status == "completed", batch.errors
    assert batch.error_file_id is None and batch.metadata == {"job": "nightly-eval"}
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    out, _ = _every_id_once(client, batch, 12)
    for line in out:
        assert line["response"]["status_code"] == 200 and line["error"] is None
        i = int(line["custom_id"].split("-")[1])
        online = client.chat.completions.with_raw_response.create(**lines[i]["body"]).http_response.json()
        got = line["response"]["body"]
        assert got["choices"] == online["choices"] and got["usage"] == online["usage"]
    # text completions too, and paging of the batch list
    body = {"model": stack.model, "prompt": "Say", "max_tokens": 3}
    text = [
        {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions", "body": body} for i in range(3)
    ]
    made = client.batches.create(input_file_id=_upload(client, text).id, endpoint="/v1/completions",
                                 completion_window="1h")  # fmt: skip
    done = _wait(client, made.id)
    assert done.status == "completed" and len(_every_id_once(client, done, 3)[0]) == 3
    first = client.batches.list(limit=1)
    assert [b.id for b in first.data] == [done.id] and first.has_more
    assert created.id in [b.id for b in client.batches.list(after=done.id, limit=5).data]
    deleted = client.files.delete(uploaded.id)
    assert deleted.deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_bad_input_fails_naming_the_line(stack: Stack) -> None:
    client = stack.client()
    good = _chat_line(stack.model, 0)
    cases = {
        "invalid_json_line": [good, "{not json"],
        "missing_custom_id": [
            good,
            {k: v for k, v in _chat_line(stack.model, 1).items() if k != "custom_id"},
        ],
        "duplicate_custom_id": [good, _chat_line(stack.model, 0)],
        "mismatched_endpoint": [good, {**_chat_line(stack.model, 1), "url": "/v1/completions"}],
        "model_not_found": [good, _chat_line("no-such-model", 1)],
        "invalid_request": [good, {**_chat_line(stack.model, 1), "body": {"model": stack.model}}],
    }
    for code, lines in cases.items():
        batch = client.batches.create(input_file_id=_upload(client, lines).id, endpoint=CHAT,
                                      completion_window="24h")  # fmt: skip
        batch = _wait(client, batch.id)
        assert batch.status == "failed" and batch.failed_at, code
        errors = batch.errors.data
        assert [(e.code, e.line) for e in errors] == [(code, 2)], (code, errors)
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.files.create(file=("empty.jsonl", b"\n"), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(
            input_file_id=_upload(client, [good]).id, endpoint=CHAT, completion_window="48h"
        )
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=_upload(client, [good]).id, endpoint="/v1/embeddings",
                              completion_window="24h")  # fmt: skip
    # A body the model server refuses is that line's answer in the error file; the others complete.
    lines = [_chat_line(stack.model, 0), _chat_line(stack.model, 1, max_tokens=10**6)]
    batch = _wait(client, client.batches.create(input_file_id=_upload(client, lines).id, endpoint=CHAT,
                                                completion_window="24h").id)  # fmt: skip
    assert batch.status == "completed"
    _, err = _every_id_once(client, batch, 2)
    assert [x["custom_id"] for x in err] == ["req-1"] and err[0]["response"]["status_code"] == 400
    assert "context length" in err[0]["response"]["body"]["error"]["message"]


def test_a_line_that_can_never_be_admitted_is_answered_at_once(stack: Stack) -> None:
    """A 429 that says the line can never fit its tenant's budget is its answer, not backpressure: the
    job completes (long before its window) with that line in the error file and the others served."""
    client = stack.client(KEY_TIGHT)
    lines = [_chat_line(stack.model, 0), _chat_line(stack.model, 1, max_tokens=2 * TIGHT_TOKENS_PER_MINUTE),
             _chat_line(stack.model, 2)]  # fmt: skip
    created = client.batches.create(input_file_id=_upload(client, lines).id, endpoint=CHAT,
                                    completion_window="24h")  # fmt: skip
    batch = _wait(client, created.id, timeout_s=60.0)
    assert batch.status == "completed", batch.request_counts
    out, err = _every_id_once(client, batch, 3)
    assert sorted(x["custom_id"] for x in out) == ["req-0", "req-2"]
    assert [x["custom_id"] for x in err] == ["req-1"] and err[0]["error"] is None
    refused = err[0]["response"]
    assert refused["status_code"] == 429
    assert refused["body"]["error"]["code"] == "request_too_large"
    assert refused["body"]["error"]["type"] == "rate_limit_error" and refused["body"]["error"]["message"]


def _long_job(stack: Stack, client: Any, n: int, window: str, max_tokens: int = 400) -> Any:
    lines = [_chat_line(stack.model, i, max_tokens=max_tokens) for i in range(n)]
    return client.batches.create(
        input_file_id=_upload(client, lines).id, endpoint=CHAT, completion_window=window
    )


def test_cancel_stops_feeding_and_answers_the_unsent(stack: Stack) -> None:
    client = stack.client()
    batch = _long_job(stack, client, 400, "24h")
    _wait(client, batch.id, until=("in_progress",))
    # What is not sent yet is on the component's /metrics (Prometheus', no token), due at the expiry.
    assert stack.local.batch is not None
    text = httpx.get(f"{stack.local.batch.link.url}/metrics", timeout=10).text
    families = {f.name: f.samples for f in text_string_to_metric_families(text)}
    (pending,) = families["tessera_batch_pending_lines"]
    assert pending.labels == {"model": stack.model, "class": "offline"} and 0 < pending.value <= 400
    (deadline,) = families["tessera_batch_earliest_deadline_seconds"]
    assert deadline.value == batch.expires_at
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    batch = _wait(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    out, err = _every_id_once(client, batch, 400)
    assert err and all(x["error"]["code"] == "batch_cancelled" for x in err)
    assert all(x["response"]["status_code"] == 200 for x in out)  # in-flight lines finished


def test_expiry_answers_unsent_lines_batch_expired(stack: Stack) -> None:
    client = stack.client()
    batch = _wait(client, _long_job(stack, client, 400, "1s", max_tokens=100).id)
    assert batch.status == "expired" and batch.expired_at
    _, err = _every_id_once(client, batch, 400)
    assert err and all(x["error"]["code"] == "batch_expired" for x in err)


def test_kill_9_mid_job_then_restart_completes_each_line_once(stack: Stack) -> None:
    client = stack.client()
    batch = _long_job(stack, client, 200, "24h", max_tokens=100)
    deadline = time.monotonic() + 180  # generous: the machine may be shared
    while client.batches.retrieve(batch.id).request_counts.completed < 20:
        assert time.monotonic() < deadline, "the job made no progress"
        time.sleep(0.1)
    process = stack.local.batch
    assert process is not None
    process.kill()  # SIGKILL: lines in flight were sent, some answered, none recorded after this
    with pytest.raises((openai.APIStatusError, openai.APIConnectionError)):
        client.batches.retrieve(batch.id)
    process.start()
    batch = _wait(client, batch.id)
    assert batch.status == "completed"
    out, err = _every_id_once(client, batch, 200)
    assert not err and len({x["id"] for x in out}) == 200


def test_keys_see_only_their_own_files_and_batches(stack: Stack) -> None:
    a, b = stack.client(KEY_A), stack.client(KEY_B)
    mine = _upload(a, [_chat_line(stack.model, 0)])
    job = a.batches.create(input_file_id=mine.id, endpoint=CHAT, completion_window="24h")
    assert mine.id not in [f.id for f in b.files.list()]
    assert job.id not in [x.id for x in b.batches.list().data]
    for call in (lambda: b.files.retrieve(mine.id), lambda: b.files.content(mine.id),
                 lambda: b.files.delete(mine.id), lambda: b.batches.retrieve(job.id),
                 lambda: b.batches.cancel(job.id),
                 lambda: b.batches.create(input_file_id=mine.id, endpoint=CHAT,
                                          completion_window="24h")):  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.AuthenticationError):
        stack.client("sk-nobody-0123456789abcdef").files.list()
    # a deadline reorders queues: only the batch component's lines may carry one
    with pytest.raises(openai.PermissionDeniedError, match="x-tessera-deadline"):
        a.chat.completions.create(**_chat_line(stack.model, 0)["body"],
                                  extra_headers={"x-tessera-deadline": f"{time.time() + 60}"})  # fmt: skip
    assert _wait(a, job.id).status == "completed"
    chat_only = stack.client(KEY_CHAT)
    with pytest.raises(openai.BadRequestError, match="kind batch"):
        source = _upload(chat_only, [_chat_line(stack.model, 0)])
        chat_only.batches.create(input_file_id=source.id, endpoint=CHAT, completion_window="24h")


def test_a_job_beside_a_chat_load_is_followed_to_its_end(tmp_path: Path) -> None:
    """What `tessera local up --batch-job` and `tessera bench batch-local` run (local mode without API
    keys, as the load driver sends none): the load's chat requests alone, then beside a Batch API job
    made from its batch requests, whose progress the live table shows."""
    stack = Stack(tmp_path, with_keys=False)
    try:
        _job_beside_chat(stack)
    finally:
        stack.close()


def _job_beside_chat(stack: Stack) -> None:
    from tessera.local.batch_job import JobWatch
    from tessera.local.load import LiveCounters, LoadItem, Workload
    from tessera.local.runner import LoadSettings, compare_batch_job, live_table
    from tessera.router.app import class_infos

    classes = class_infos(stack.local.plan.instances[0].config)
    items = [LoadItem(i, 0.2 * i, stack.model, "chat" if i % 2 else "offline", 8, 6, f"question {i}")
             for i in range(8)]  # fmt: skip
    out = io.StringIO()
    run = compare_batch_job(stack.local, Workload(tuple(items), 0), classes, LoadSettings(live=True), 10,
                            out=out)  # fmt: skip
    (done,) = asyncio.run_coroutine_threadsafe(run, stack.loop).result(120)
    assert done.alone["requests"] == done.with_job["requests"] == 4  # the chat requests only
    assert done.alone["failed"] == done.with_job["failed"] == 0
    job = done.job
    assert (job.status, job.total, job.completed) == ("completed", 10, 10) and job.makespan_s is not None
    text = out.getvalue()
    assert "batch job batch_" in text and "same chat load" in text and "+ batch job" in text
    client = stack.client()
    lines = _lines(client, client.batches.retrieve(job.id).output_file_id)
    assert sorted(x["custom_id"] for x in lines) == sorted(f"line-{n}" for n in range(10))
    assert {x["response"]["body"]["usage"]["completion_tokens"] <= 6 for x in lines} == {True}
    table = live_table(LiveCounters(t0=0.0), None, "qlm", JobWatch("batch_x", "in_progress", 10, 3, 1))
    assert table.caption == "batch job batch_x: in_progress, 4/10 lines (1 failed)"

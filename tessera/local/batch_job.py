"""A Batch API job beside a load: its lines made from a workload's requests, submitted through the
router's ``/v1/files`` and ``/v1/batches`` as a user would, and followed until it ends.

What the demo and ``tessera bench batch-local`` run to show a job sharing the model with chat: the
job's lines are the workload's batch requests (their prompts and output caps, cycled to the job's
size), sent as chat lines when every request has a text prompt, else as completions of token-id
prompts with their exact lengths (``ignore_eos``), as the load driver sends them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from tessera.local.load import LoadItem, prompt_ids

FINAL = ("completed", "failed", "expired", "cancelled")
POLL_S = 1.0


class BatchJobError(RuntimeError):
    """The router refused the job's file or batch; the message holds its answer."""


def job_lines(items: Sequence[LoadItem], size: int, endpoint: str) -> bytes:
    """``size`` lines of a Batch API input file (JSONL) for ``endpoint``, cycling over ``items``."""
    if size < 1 or not items:
        raise ValueError(f"a batch job needs >= 1 line and requests to make them from (size {size})")
    lines = []
    for n in range(size):
        item = items[n % len(items)]
        body: dict[str, object] = {"model": item.model, "max_tokens": item.max_tokens, "temperature": 0.0}
        if endpoint == "/v1/chat/completions":
            body["messages"] = [{"role": "user", "content": item.prompt_text or ""}]
        else:
            body |= {"prompt": prompt_ids(item.prompt_tokens), "ignore_eos": True}
        lines.append(json.dumps({"custom_id": f"line-{n}", "method": "POST", "url": endpoint, "body": body}))
    return ("\n".join(lines) + "\n").encode()


def job_endpoint(items: Sequence[LoadItem]) -> str:
    """The endpoint of a job made from ``items``: chat when every one has a text prompt."""
    return "/v1/chat/completions" if all(i.prompt_text for i in items) else "/v1/completions"


@dataclass(slots=True)
class JobWatch:
    """A job as last polled (what the live table shows), and when it started and ended."""

    id: str | None = None
    status: str = "not submitted"
    total: int = 0
    completed: int = 0
    failed: int = 0
    started: float | None = None  # monotonic, at submission
    ended: float | None = None  # monotonic, when a poll first saw it final

    @property
    def makespan_s(self) -> float | None:
        """Submission to the end; None while it runs."""
        return None if self.started is None or self.ended is None else self.ended - self.started

    def describe(self) -> str:
        """One line: its status and counts."""
        done = self.completed + self.failed
        return f"batch job {self.id or '-'}: {self.status}, {done}/{self.total} lines ({self.failed} failed)"


def _check(resp: httpx.Response, what: str) -> dict[str, object]:
    if resp.status_code != 200:
        raise BatchJobError(f"{what}: HTTP {resp.status_code}: {resp.text[:300]}")
    answer: dict[str, object] = resp.json()
    return answer


async def submit(
    client: httpx.AsyncClient, router: str, data: bytes, endpoint: str, window: str, watch: JobWatch,
    clock: Callable[[], float] = time.monotonic,
) -> None:  # fmt: skip
    """Upload ``data`` and create a batch on ``endpoint`` with ``window``; ``watch`` names it."""
    uploaded = _check(await client.post(f"{router}/v1/files", files={"file": ("job.jsonl", data)},
                                        data={"purpose": "batch"}), "uploading the job's file")  # fmt: skip
    body = {"input_file_id": uploaded["id"], "endpoint": endpoint, "completion_window": window}
    created = _check(await client.post(f"{router}/v1/batches", json=body), "creating the batch")
    watch.id, watch.status, watch.started = str(created["id"]), str(created["status"]), clock()


async def follow(
    client: httpx.AsyncClient, router: str, watch: JobWatch, clock: Callable[[], float] = time.monotonic,
    poll_s: float = POLL_S,
) -> None:  # fmt: skip
    """Poll the job until it ends, keeping ``watch`` current."""
    while True:
        batch = _check(await client.get(f"{router}/v1/batches/{watch.id}"), "reading the batch")
        counts = batch["request_counts"]
        assert isinstance(counts, dict)
        watch.status = str(batch["status"])
        watch.total, watch.completed, watch.failed = counts["total"], counts["completed"], counts["failed"]
        if watch.status in FINAL:
            watch.ended = clock()
            return
        await asyncio.sleep(poll_s)

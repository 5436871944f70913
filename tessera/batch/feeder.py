"""The feeder: validates new batches and sends their lines through the router, one request each.

Each line goes to the router's endpoint of its batch as a request of the service's batch class (the
router named it when the batch was created: the one class of kind ``batch``, or ``--class``), with the job's
expiry as its deadline (``x-tessera-deadline``, honoured by EDF, QLM and Chiron's global queue) and the
feeder token (``tessera.api.batch_link``). At most ``concurrency`` lines are in flight at once over all
batches; the router's hold keeps them until an instance has room, so the pool sets the pace. A 429 or
503 is backpressure: the line waits (``Retry-After``, at most ``MAX_BACKOFF_S``) and is sent again,
until the job expires. A 429 that says the request can never be admitted (``PERMANENT_CODES``: larger
than its tenant's whole per-minute budget) is no backpressure: waiting would never help, so it is the
line's answer at once. A connection failure, a 408 or another 5xx is retried ``MAX_ATTEMPTS`` times,
then answered in the error file with the last status. Any other answer is the line's result: 2xx in
the output file, else in the error file (a body the model server refuses: its 400 and message).

Cancel stops claiming lines at once; lines in flight finish, then every unsent line is answered
``batch_cancelled`` and the batch is ``cancelled``. At expiry the unsent lines are answered
``batch_expired``; lines still in flight get ``EXPIRY_GRACE_S`` to finish, then they are abandoned
(the router drops a request whose client left) and answered ``batch_expired`` too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from tessera.api.batch_link import DEADLINE_HEADER, TENANT_HEADER, TOKEN_HEADER
from tessera.batch.rules import LineError, parse_input
from tessera.batch.store import BatchStore, error_line, output_line

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 5
MAX_BACKOFF_S = 10.0
EXPIRY_GRACE_S = 30.0
EXPIRED = "This request could not be executed before the completion window expired."
CANCELLED = "This request was not sent: the batch was cancelled."
PERMANENT_CODES = frozenset({"request_too_large"})  # error codes of a 429 that no wait can cure


@dataclass(frozen=True, slots=True)
class FeederSettings:
    """How the feeder reaches the router and how much it sends at once."""

    router_url: str
    token: str
    concurrency: int = 64
    poll_s: float = 0.5


class Feeder:
    """Drives every active batch of ``store`` (``run`` until cancelled)."""

    def __init__(self, store: BatchStore, settings: FeederSettings, clock: Callable[[], float] = time.time):
        self.store = store
        self.settings = settings
        self.clock = clock
        self.wake = asyncio.Event()
        self.tasks: dict[str, set[asyncio.Task[None]]] = {}  # batch id -> its lines in flight
        self._client: httpx.AsyncClient | None = None

    def _now(self) -> int:
        return int(self.clock())

    async def run(self) -> None:
        """Send lines until cancelled; lines in flight at a previous stop are sent again."""
        again = self.store.reset_inflight()
        if again:
            log.info("%d line(s) in flight at the last stop are sent again", again)
        limits = httpx.Limits(max_connections=self.settings.concurrency + 4)
        timeout = httpx.Timeout(None, connect=5.0)
        async with httpx.AsyncClient(base_url=self.settings.router_url, limits=limits, timeout=timeout) as c:
            self._client = c
            try:
                while True:
                    try:
                        await self.tick()
                    except Exception:  # a bug or a broken database must not stop every batch silently
                        log.exception("feeder round failed; retrying")
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.wake.wait(), self.settings.poll_s)
                    self.wake.clear()
            finally:
                for tasks in self.tasks.values():
                    for task in tasks:
                        task.cancel()

    async def tick(self) -> None:
        """One round over every active batch."""
        for batch in self.store.active():
            status = batch["status"]
            if status == "validating":
                self._validate(batch)
            elif status == "in_progress":
                self._progress(batch)
            elif status == "cancelling" and not self._busy(batch):
                self.store.close_unsent(batch["id"], "batch_cancelled", CANCELLED)
                self.store.finalize(batch["id"], "cancelled", self._now())
            elif status == "finalizing":  # a stop between finalizing and its end
                final = "expired" if self.clock() >= batch["expires_at"] else "completed"
                self.store.finalize(batch["id"], final, self._now())

    def _busy(self, batch: dict[str, Any]) -> bool:
        return bool(self.tasks.get(batch["id"])) or batch["in_flight"] > 0

    def _validate(self, batch: dict[str, Any]) -> None:
        now = self._now()
        try:
            data = self.store.read_file(batch["input_file_id"])
        except FileNotFoundError:
            message = f"the input file {batch['input_file_id']} was deleted before validation"
            self.store.fail(batch["id"], [LineError("file_not_found", message)], now)
            return
        models = frozenset(json.loads(batch["models"])) if batch["models"] is not None else None
        lines, errors = parse_input(data, batch["endpoint"], models)
        if errors:
            self.store.fail(batch["id"], errors, now)
            return
        self.store.start(batch["id"], lines, now)

    def _progress(self, batch: dict[str, Any]) -> None:
        batch_id = batch["id"]
        tasks = self.tasks.setdefault(batch_id, set())
        if self.clock() >= batch["expires_at"]:
            self.store.close_unsent(batch_id, "batch_expired", EXPIRED)
            if not self._busy(batch):
                self._finalize(batch_id, "expired")
            return
        free = self.settings.concurrency - sum(len(t) for t in self.tasks.values())
        for index, custom_id, body in self.store.claim(batch_id, free):
            task = asyncio.create_task(self._send(batch, index, custom_id, body), name=f"{batch_id}/{index}")
            tasks.add(task)
            task.add_done_callback(lambda t, b=batch_id: self._done(b, t))
        pending = batch["total"] - batch["completed"] - batch["failed"] - batch["in_flight"]
        if not tasks and pending <= 0 and batch["in_flight"] == 0:
            self._finalize(batch_id, "completed")

    def _finalize(self, batch_id: str, final: str) -> None:
        self.store.set_status(batch_id, "finalizing", self._now(), only_from=("in_progress",))
        self.store.finalize(batch_id, final, self._now())
        self.tasks.pop(batch_id, None)

    def _done(self, batch_id: str, task: asyncio.Task[None]) -> None:
        self.tasks.get(batch_id, set()).discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("sending a line of %s failed", batch_id, exc_info=task.exception())
        self.wake.set()

    async def _send(self, batch: dict[str, Any], index: int, custom_id: str, body: dict[str, Any]) -> None:
        """Send one line until it has an answer; record it (or hand the line back when cancelled)."""
        batch_id, expires = batch["id"], float(batch["expires_at"])
        header, value = json.loads(batch["batch_class"])[:2]  # then the class name (its metrics' label)
        # The job's tenant: the router counts the line against its quota, as the tenant's own requests.
        headers = {header: value, TOKEN_HEADER: self.settings.token, DEADLINE_HEADER: f"{expires:.3f}",
                   TENANT_HEADER: batch["tenant"]}  # fmt: skip
        assert self._client is not None
        failures = 0
        while True:
            if self.store.status(batch_id) != "in_progress":
                self.store.requeue(batch_id, index)  # cancelled: answered batch_cancelled with the unsent
                return
            left = expires + EXPIRY_GRACE_S - self.clock()
            if left <= 0:
                self.store.record(batch_id, index, False, error_line(batch_id, index, custom_id,
                                                                     "batch_expired", EXPIRED))  # fmt: skip
                return
            try:
                async with asyncio.timeout(left):
                    resp = await self._client.post(batch["endpoint"], json=body, headers=headers)
            except TimeoutError:
                continue  # answered batch_expired on the next pass
            except httpx.HTTPError as exc:
                failures += 1
                if failures >= MAX_ATTEMPTS:
                    answer = {
                        "error": {"message": f"the router did not answer: {exc}", "type": "server_error"}
                    }
                    self._record(batch_id, index, custom_id, 502, answer)
                    return
                await asyncio.sleep(min(MAX_BACKOFF_S, 0.5 * 2**failures))
                continue
            if resp.status_code in (429, 503) and not _permanent(resp):
                await asyncio.sleep(_retry_after(resp, failures))
                continue
            if (resp.status_code >= 500 or resp.status_code == 408) and failures + 1 < MAX_ATTEMPTS:
                failures += 1
                await asyncio.sleep(min(MAX_BACKOFF_S, 0.5 * 2**failures))
                continue
            try:
                answer = resp.json()
            except json.JSONDecodeError:
                answer = {"error": {"message": resp.text[:1000], "type": "server_error"}}
            self._record(batch_id, index, custom_id, resp.status_code, answer)
            return

    def _record(self, batch_id: str, index: int, custom_id: str, status: int, answer: Any) -> None:
        line = output_line(batch_id, index, custom_id, status, answer)
        self.store.record(batch_id, index, 200 <= status < 300, line)


def _permanent(resp: httpx.Response) -> bool:
    """Whether a refusal says the request can never be served as it is (its error code)."""
    try:
        error = resp.json().get("error")
    except (json.JSONDecodeError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") in PERMANENT_CODES


def _retry_after(resp: httpx.Response, failures: int) -> float:
    """Seconds to wait before sending again after a 429 or 503 (its Retry-After, bounded)."""
    try:
        wait = float(resp.headers.get("retry-after", ""))
    except ValueError:
        wait = 0.5 * 2 ** min(failures, 4)
    return min(MAX_BACKOFF_S, max(0.1, wait))

"""The batch component's durable state: SQLite in WAL mode plus files under one state directory.

Layout of ``state_dir``: ``batch.sqlite3`` (with its WAL) and ``files/<id>.jsonl``, one per uploaded
input and per output or error file. A file's bytes are written to a temporary name, synced and renamed
before its row is committed, so a row never names a partial file.

Every line of a batch is a row with a state: ``pending`` (not sent), ``sent`` (in flight), ``done`` (its
output or error line recorded). ``claim`` moves lines from pending to sent and ``record`` from sent to
done, each in one transaction: a line is in flight at most once, and its result is written once (a
second ``record`` finds it done and changes nothing). After a crash (``kill -9``), ``reset_inflight``
turns the lines that were in flight back to pending: they are sent again and only the first result
recorded counts. The output and error files are written from the done rows, one per ``custom_id``.

Commits are durable when the process dies (WAL, ``synchronous=NORMAL``); a power loss may roll back the
last commits to a consistent state, whose lines are then sent again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import sqlite3
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.batch.rules import InputLine, LineError

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
  id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
  bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, seq INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS files_by_tenant ON files (tenant, seq);
CREATE TABLE IF NOT EXISTS batches (
  id TEXT PRIMARY KEY, tenant TEXT NOT NULL, seq INTEGER NOT NULL, endpoint TEXT NOT NULL,
  input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, metadata TEXT, models TEXT,
  batch_class TEXT NOT NULL,
  status TEXT NOT NULL, errors TEXT, output_file_id TEXT, error_file_id TEXT,
  created_at INTEGER NOT NULL, in_progress_at INTEGER, expires_at INTEGER NOT NULL,
  finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, expired_at INTEGER,
  cancelling_at INTEGER, cancelled_at INTEGER, total INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS batches_by_tenant ON batches (tenant, seq);
CREATE TABLE IF NOT EXISTS lines (
  batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
  state TEXT NOT NULL, ok INTEGER, result TEXT,
  PRIMARY KEY (batch_id, idx), UNIQUE (batch_id, custom_id)
);
CREATE INDEX IF NOT EXISTS lines_by_state ON lines (batch_id, state, idx);
"""


def new_id(prefix: str) -> str:
    """A fresh object id (``file-…``, ``batch_…``)."""
    return prefix + secrets.token_hex(12)


def line_request_id(batch_id: str, index: int) -> str:
    """The id of a batch's line in the output (``batch_req_…``), the same however often it is sent."""
    return "batch_req_" + hashlib.sha256(f"{batch_id}/{index}".encode()).hexdigest()[:24]


class BatchStore:
    """Files, batches and their lines in ``state_dir`` (created if missing)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.files_dir = state_dir / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(state_dir / "batch.sqlite3", isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)

    def close(self) -> None:
        """Close the database."""
        self.db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """A transaction: committed at the end of the ``with`` block, rolled back on an exception."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def _seq(self, table: str) -> int:
        row = self.db.execute(f"SELECT COALESCE(MAX(seq), 0) + 1 FROM {table}").fetchone()
        return int(row[0])

    # ------------------------------------------------------------------ files

    def file_path(self, file_id: str) -> Path:
        """Where a file's bytes are."""
        return self.files_dir / f"{file_id}.jsonl"

    def _write_bytes(self, file_id: str, data: bytes) -> None:
        path = self.file_path(file_id)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)

    def add_file(self, tenant: str, filename: str, purpose: str, data: bytes, now: int,
                 file_id: str | None = None) -> dict[str, Any]:  # fmt: skip
        """Store ``data`` as a file of ``tenant``; its row."""
        file_id = file_id or new_id("file-")
        self._write_bytes(file_id, data)
        with self._tx() as db:
            self._insert_file(db, file_id, tenant, filename, purpose, len(data), now)
        return self.file(tenant, file_id) or {}

    def _insert_file(self, db: sqlite3.Connection, file_id: str, tenant: str, filename: str, purpose: str,
                     size: int, now: int) -> None:  # fmt: skip
        db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                   (file_id, tenant, purpose, filename, size, now, self._seq("files")))  # fmt: skip

    def file(self, tenant: str, file_id: str) -> dict[str, Any] | None:
        """A file of ``tenant`` (None: no such file, or another tenant's)."""
        row = self.db.execute("SELECT * FROM files WHERE id = ? AND tenant = ?", (file_id, tenant)).fetchone()
        return dict(row) if row else None

    def files(self, tenant: str, purpose: str | None, after: str | None, limit: int) -> list[dict[str, Any]]:
        """``tenant``'s files, newest first, after the file ``after`` (paging), at most ``limit``."""
        return self._page("files", tenant, after, limit, "purpose = ?" if purpose else "", purpose)

    def _page(self, table: str, tenant: str, after: str | None, limit: int, where: str,
              value: Any) -> list[dict[str, Any]]:  # fmt: skip
        clauses, args = ["tenant = ?"], [tenant]
        if where:
            clauses.append(where)
            args.append(value)
        if after:
            clauses.append(f"seq < COALESCE((SELECT seq FROM {table} WHERE id = ? AND tenant = ?), -1)")
            args += [after, tenant]
        sql = f"SELECT * FROM {table} WHERE {' AND '.join(clauses)} ORDER BY seq DESC LIMIT ?"
        return [dict(r) for r in self.db.execute(sql, (*args, limit))]

    def read_file(self, file_id: str) -> bytes:
        """A file's bytes."""
        return self.file_path(file_id).read_bytes()

    def delete_file(self, tenant: str, file_id: str) -> bool:
        """Delete a file of ``tenant``; False when it has none by that id."""
        with self._tx() as db:
            gone = db.execute("DELETE FROM files WHERE id = ? AND tenant = ?", (file_id, tenant)).rowcount
        if gone:
            self.file_path(file_id).unlink(missing_ok=True)
        return bool(gone)

    # ---------------------------------------------------------------- batches

    def create_batch(self, tenant: str, input_file_id: str, endpoint: str, window: str, window_s: int,
                     metadata: dict[str, str] | None, models: Iterable[str] | None,
                     batch_class: tuple[str, str, str], now: int) -> dict[str, Any]:  # fmt: skip
        """A new batch of ``tenant``, validating; ``models``: those its lines may name (None: any);
        ``batch_class``: the header and value that make each line a request of the batch class, and the
        class's name (what the pending-lines metrics are labelled with)."""
        batch_id = new_id("batch_")
        with self._tx() as db:
            db.execute(
                "INSERT INTO batches (id, tenant, seq, endpoint, input_file_id, completion_window, metadata, "
                "models, batch_class, status, created_at, expires_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'validating', ?, ?)",
                (batch_id, tenant, self._seq("batches"), endpoint, input_file_id, window,
                 json.dumps(metadata) if metadata is not None else None,
                 json.dumps(sorted(models)) if models is not None else None, json.dumps(list(batch_class)),
                 now, now + window_s),
            )  # fmt: skip
        return self.batch(tenant, batch_id) or {}

    def batch(self, tenant: str | None, batch_id: str) -> dict[str, Any] | None:
        """A batch of ``tenant`` (None: any tenant's, for the feeder) with its line counts."""
        sql, args = "SELECT * FROM batches WHERE id = ?", [batch_id]
        if tenant is not None:
            sql, args = sql + " AND tenant = ?", [batch_id, tenant]
        row = self.db.execute(sql, args).fetchone()
        return self._with_counts(dict(row)) if row else None

    def status(self, batch_id: str) -> str | None:
        """A batch's status (None: no such batch)."""
        row = self.db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return str(row[0]) if row else None

    def batches(self, tenant: str, after: str | None, limit: int) -> list[dict[str, Any]]:
        """``tenant``'s batches, newest first, after the batch ``after``, at most ``limit``."""
        return [self._with_counts(b) for b in self._page("batches", tenant, after, limit, "", None)]

    def _with_counts(self, batch: dict[str, Any]) -> dict[str, Any]:
        row = self.db.execute(
            "SELECT COALESCE(SUM(ok = 1), 0), COALESCE(SUM(ok = 0), 0), COALESCE(SUM(state = 'sent'), 0) "
            "FROM lines WHERE batch_id = ?",
            (batch["id"],),
        ).fetchone()
        batch["completed"], batch["failed"], batch["in_flight"] = int(row[0]), int(row[1]), int(row[2])
        return batch

    def active(self) -> list[dict[str, Any]]:
        """Every batch the feeder still works on, oldest first."""
        marks = ", ".join("?" * len(ACTIVE))
        rows = self.db.execute(f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY seq", ACTIVE)
        return [b for r in rows.fetchall() if (b := self.batch(None, r[0])) is not None]

    def set_status(self, batch_id: str, status: str, now: int, *, only_from: tuple[str, ...] = ()) -> bool:
        """Move a batch to ``status``, stamping ``<status>_at``; with ``only_from``, only from those."""
        sql = f"UPDATE batches SET status = ?, {status}_at = ? WHERE id = ?"
        args: list[Any] = [status, now, batch_id]
        if only_from:
            sql += f" AND status IN ({', '.join('?' * len(only_from))})"
            args += only_from
        with self._tx() as db:
            return bool(db.execute(sql, args).rowcount)

    def start(self, batch_id: str, lines: list[InputLine], now: int) -> None:
        """Store a validated batch's lines (all pending); the batch goes in progress (unless cancelled
        meanwhile)."""
        with self._tx() as db:
            db.executemany(
                "INSERT OR IGNORE INTO lines (batch_id, idx, custom_id, body, state) "
                "VALUES (?, ?, ?, ?, 'pending')",
                ((batch_id, ln.index, ln.custom_id, json.dumps(ln.body)) for ln in lines),
            )
            db.execute("UPDATE batches SET total = ? WHERE id = ?", (len(lines), batch_id))
            db.execute("UPDATE batches SET status = 'in_progress', in_progress_at = ? "
                       "WHERE id = ? AND status = 'validating'", (now, batch_id))  # fmt: skip

    def backlog(self) -> list[Backlog]:
        """The unsent lines of the batches in progress by model and class: how many, their earliest
        expiry, and the output lengths (``usage.completion_tokens``) of those batches' answered lines."""
        rows = self.db.execute(
            "SELECT model, class, SUM(pending), MIN(CASE WHEN pending THEN expires END), COUNT(x), AVG(x), "
            "AVG(x * x) FROM (SELECT json_extract(l.body, '$.model') AS model, "
            "json_extract(b.batch_class, '$[2]') AS class, l.state = 'pending' AS pending, "
            "b.expires_at AS expires, CASE WHEN l.ok = 1 THEN "
            "CAST(json_extract(l.result, '$.response.body.usage.completion_tokens') AS REAL) END AS x "
            "FROM lines l JOIN batches b ON b.id = l.batch_id WHERE b.status = 'in_progress') "
            "GROUP BY model, class"
        ).fetchall()
        out = []
        for model, name, pending, deadline, answered, mean, square in rows:
            if model is None or name is None:
                continue
            std = math.sqrt(max(0.0, square - mean * mean)) if answered else None
            out.append(Backlog(str(model), str(name), int(pending or 0), deadline, int(answered), mean, std))
        return out

    def fail(self, batch_id: str, errors: list[LineError], now: int) -> None:
        """The batch failed validation with ``errors``."""
        body = {"object": "list", "data": [e.to_json() for e in errors]}
        with self._tx() as db:
            db.execute("UPDATE batches SET status = 'failed', failed_at = ?, errors = ? WHERE id = ?",
                       (now, json.dumps(body), batch_id))  # fmt: skip

    # ------------------------------------------------------------------ lines

    def claim(self, batch_id: str, limit: int) -> list[tuple[int, str, dict[str, Any]]]:
        """Up to ``limit`` pending lines, in file order, now in flight: (index, custom_id, body)."""
        if limit <= 0:
            return []
        with self._tx() as db:
            sql = (
                "SELECT idx, custom_id, body FROM lines WHERE batch_id = ? AND state = 'pending' ORDER BY idx"
            )
            rows = db.execute(sql + " LIMIT ?", (batch_id, limit)).fetchall()
            db.executemany("UPDATE lines SET state = 'sent' WHERE batch_id = ? AND idx = ?",
                           ((batch_id, r[0]) for r in rows))  # fmt: skip
        return [(int(r[0]), str(r[1]), json.loads(r[2])) for r in rows]

    def record(self, batch_id: str, index: int, ok: bool, result: dict[str, Any]) -> bool:
        """Write an in-flight line's result (its output or error line); False when it was written before."""
        with self._tx() as db:
            return bool(db.execute("UPDATE lines SET state = 'done', ok = ?, result = ? "
                                   "WHERE batch_id = ? AND idx = ? AND state = 'sent'",
                                   (int(ok), json.dumps(result), batch_id, index)).rowcount)  # fmt: skip

    def requeue(self, batch_id: str, index: int) -> None:
        """Put an in-flight line back among the pending ones (not answered; sent again later)."""
        with self._tx() as db:
            db.execute("UPDATE lines SET state = 'pending' WHERE batch_id = ? AND idx = ? AND state = 'sent'",
                       (batch_id, index))  # fmt: skip

    def reset_inflight(self) -> int:
        """After a restart: every line that was in flight is pending again; how many."""
        with self._tx() as db:
            return db.execute("UPDATE lines SET state = 'pending' WHERE state = 'sent'").rowcount

    def close_unsent(self, batch_id: str, code: str, message: str) -> int:
        """Answer every pending line with an error ``code`` (expired, cancelled); how many."""
        with self._tx() as db:
            rows = db.execute("SELECT idx, custom_id FROM lines WHERE batch_id = ? AND state = 'pending'",
                              (batch_id,)).fetchall()  # fmt: skip
            db.executemany(
                "UPDATE lines SET state = 'done', ok = 0, result = ? WHERE batch_id = ? AND idx = ?",
                ((json.dumps(error_line(batch_id, r[0], r[1], code, message)), batch_id, r[0]) for r in rows),
            )
        return len(rows)

    def finalize(self, batch_id: str, final: str, now: int) -> None:
        """Write the output and error files from the done lines (one line per custom_id, file order) and
        move the batch to ``final`` (completed, expired, cancelled). Safe to repeat after a crash."""
        batch = self.batch(None, batch_id)
        assert batch is not None
        out: list[str] = []
        err: list[str] = []
        for row in self.db.execute("SELECT ok, result FROM lines WHERE batch_id = ? AND state = 'done' "
                                   "ORDER BY idx", (batch_id,)):  # fmt: skip
            (out if row[0] else err).append(row[1])
        suffix = batch_id.removeprefix("batch_")
        ids: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
        for key, rows, name in (("output_file_id", out, "output"), ("error_file_id", err, "error")):
            if rows:
                ids[key] = f"file-{name}-{suffix}"
                self._write_bytes(ids[key], "".join(r + "\n" for r in rows).encode())
        with self._tx() as db:
            for key, name in (("output_file_id", "output"), ("error_file_id", "error")):
                file_id = ids[key]
                if file_id is not None:
                    size = self.file_path(file_id).stat().st_size
                    self._insert_file(db, file_id, batch["tenant"], f"{batch_id}_{name}.jsonl",
                                      "batch_output", size, now)  # fmt: skip
            db.execute(f"UPDATE batches SET status = ?, {final}_at = ?, output_file_id = ?, "
                       "error_file_id = ? WHERE id = ?",
                       (final, now, ids["output_file_id"], ids["error_file_id"], batch_id))  # fmt: skip


@dataclass(frozen=True, slots=True)
class Backlog:
    """What is left of the batches in progress for one model and class (``BatchStore.backlog``)."""

    model: str
    class_name: str
    pending: int  # lines not sent yet
    earliest_deadline: float | None  # Unix time: the earliest expiry among them (None: none pending)
    answered: int  # lines answered 2xx with a usage count, whose output lengths follow
    mean_output_tokens: float | None
    std_output_tokens: float | None


def output_line(batch_id: str, index: int, custom_id: str, status: int, body: Any) -> dict[str, Any]:
    """A line of the output (2xx) or error file (any other status): the model server's answer."""
    request_id = body.get("id") if isinstance(body, dict) else None
    return {"id": line_request_id(batch_id, index), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id or "", "body": body},
            "error": None}  # fmt: skip


def error_line(batch_id: str, index: int, custom_id: str, code: str, message: str) -> dict[str, Any]:
    """A line of the error file for a request that got no answer (``batch_expired``, ``batch_cancelled``)."""
    return {"id": line_request_id(batch_id, index), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}  # fmt: skip

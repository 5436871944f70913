"""tessera bench batch-job: a batch job on the chat pool (shared) against a batch instance of its own
(dedicated) and chat alone, on the same requests; the contract's JSON with the job's window."""

from __future__ import annotations

import json
from pathlib import Path

from tessera.cli import main


def test_batch_job_rows_window_and_dedicated_gpu_seconds(tmp_path: Path) -> None:
    out = tmp_path / "batch-job.json"
    assert (
        main(["bench", "batch-job", "--set", "job_requests=300", "--set", "job_at=20", "--json", str(out)])
        == 0
    )
    report = json.loads(out.read_text())
    rows = {r["policy"]: r for r in report["results"]}
    assert list(rows) == ["shared", "dedicated", "chat-only"]
    window = report["config"]["window_s"]
    # the window: a lone batch instance's makespan plus the slack, which "dedicated" just meets
    assert rows["dedicated"]["job_completion_s"] * 1.05 == window
    assert rows["shared"]["job_completion_s"] < float("inf")
    assert rows["chat-only"]["job_completion_s"] is None
    assert rows["dedicated"]["gpu_seconds"] > rows["chat-only"]["gpu_seconds"]
    assert rows["shared"]["requests"] == rows["dedicated"]["requests"] == rows["chat-only"]["requests"] + 300
    assert set(rows["shared"]["slo_attainment_by_class"]) == {"chat", "batch"}
    assert all(r["job_window_s"] == window for r in rows.values())

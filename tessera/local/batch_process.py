"""Local mode's batch component: one ``tessera batch`` process on loopback, its state in the run
directory (``<run-dir>/batch/``: the database and the files), so jobs survive a restart of local mode.

The router and the process share a fresh secret (``tessera.api.batch_link``); ``kill`` ends the process
at once (SIGKILL, as a crash would) and ``start`` brings it back on the same port and state.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tessera.api.batch_link import TOKEN_ENV
from tessera.router.batch_proxy import BatchLink
from tessera.worker.engines.vllm_process import free_port


class BatchStartError(RuntimeError):
    """The batch process did not answer /health in time; the message holds its log's tail."""


class BatchProcess:
    """The batch component of a local stack."""

    def __init__(self, run_dir: Path, router_url: str, *, grace_s: float = 5.0) -> None:
        self.state_dir = run_dir / "batch"
        self.log_path = run_dir / "batch.log"
        self.router_url = router_url
        self.grace_s = grace_s
        self.port = free_port()
        self.link = BatchLink(f"http://127.0.0.1:{self.port}", secrets.token_urlsafe(24))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        """Start the process and wait until it answers; BatchStartError otherwise."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "tessera", "batch", "--state-dir", str(self.state_dir),
                   "--router", self.router_url, "--host", "127.0.0.1", "--port", str(self.port)]  # fmt: skip
        with open(self.log_path, "ab") as log:
            env = {**os.environ, TOKEN_ENV: self.link.token}
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise BatchStartError(f"tessera batch exited with code {self.proc.returncode} (log "
                                      f"{self.log_path}):\n{self._tail()}")  # fmt: skip
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.link.url}/health", timeout=2.0).status_code == 200:
                    return
            if time.monotonic() >= deadline:
                self.stop()
                raise BatchStartError(f"tessera batch did not answer in {timeout_s:g} s (log "
                                      f"{self.log_path}):\n{self._tail()}")  # fmt: skip
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL the process (a crash: nothing is flushed or finished)."""
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after the grace period."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self._signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=self.grace_s)
        self.kill()

    def _signal(self, sig: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def _tail(self, chars: int = 3000) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return self.log_path.read_bytes()[-chars:].decode("utf-8", errors="replace")

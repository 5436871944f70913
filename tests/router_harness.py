"""The router as clients meet it: real sim-engine worker processes behind the real router app, served on
loopback by uvicorn with the router's own protocol (``router_server_config``), in the test's event loop.

- ``start_workers(run_dir, n)``: n quickstart workers (sim engine), ready when it returns.
- ``serve_router(workers, ...)``: the router over those workers until the block ends.
- ``raw_exchange(port, data)``: bytes written on a plain socket and the answer read back, for what
  an HTTP client library refuses to send (broken request lines, endless headers, slow clients).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tessera.api import load_documents
from tessera.local.control_plane import LocalEngine, plan_local
from tessera.local.supervisor import Supervisor, WorkerProcess
from tessera.router.activator import Activator
from tessera.router.app import RouterState, create_router_app
from tessera.router.auth import ApiKeys
from tessera.router.backends import Backend
from tessera.router.batch_proxy import BatchLink
from tessera.router.chiron_hold import ChironHold
from tessera.router.limits import RouterLimits
from tessera.router.protocol import router_server_config
from tessera.router.quota import QuotaStore
from tessera.worker.engines.vllm_process import free_port

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PLAN = plan_local(load_documents(EXAMPLES / "quickstart.yaml"), LocalEngine(), max_instances_per_group=2)
MODEL = PLAN.instances[0].config.models[0].name
CLASS_HEADER = PLAN.instances[0].config.class_header


def start_workers(run_dir: Path, count: int = 2) -> Supervisor:
    """``count`` sim workers of the quickstart plan (ready); stop them with ``stop_all()``."""
    supervisor = Supervisor(run_dir, grace_s=2.0)
    supervisor.start_all(PLAN.instances[:count], 60.0)
    return supervisor


@dataclass
class RouterUnderTest:
    """A running router: its URL, port and state."""

    url: str
    port: int
    state: RouterState
    scrape_headers: dict[str, str]  # what Prometheus sends to scrape it (a key, with API keys on)

    async def metric(self, name: str, **labels: str) -> float:
        """The sum of the router's samples ``name`` whose labels include ``labels``."""
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"{self.url}/metrics", headers=self.scrape_headers)).text
        return sum(
            s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == name and labels.items() <= s.labels.items()
        )

    def healthy(self) -> dict[str, bool]:
        """Instance -> in the rotation."""
        return {x.instance: x.healthy for x in self.state.loads.values()}


def _first_key(api_keys: ApiKeys) -> str:
    """A key of the router's keys file (with API keys on, its /metrics wants one)."""
    return str(yaml.safe_load(api_keys.path.read_text())["keys"][0]["key"])


@asynccontextmanager
async def serve_router(
    workers: Sequence[WorkerProcess],
    *,
    limits: RouterLimits | None = None,
    api_keys: ApiKeys | None = None,
    poll_interval_s: float = 0.5,
    route: str = "least-wait",
    activator: Callable[[RouterState], Activator] | None = None,
    backends: Sequence[Backend] = (),
    hold: ChironHold | None = None,
    quota: QuotaStore | None = None,
    batch: BatchLink | None = None,
) -> AsyncIterator[RouterUnderTest]:
    """The router over ``workers`` (picking by ``route``) on a free loopback port until the block ends;
    ``activator`` builds the router's activator over its state (scale to zero); ``backends``, when
    given, replace the workers' own entries (other roles or addresses); ``hold``: its Chiron dispatch (as
    ``tessera router`` and an autoscaled local mode have; none: every request is routed on arrival);
    ``quota``: the tenants' quota store (with ``api_keys``); ``batch``: the batch component it trusts."""
    state = RouterState(list(backends) or [w.backend() for w in workers], route=route, hold=hold)
    scrape = {"Authorization": f"Bearer {_first_key(api_keys)}"} if api_keys is not None else {}
    app = create_router_app(state, poll_interval_s=poll_interval_s, limits=limits, api_keys=api_keys,
                            activator=activator(state) if activator is not None else None,
                            quota=quota, batch=batch)  # fmt: skip
    port = free_port()
    server = uvicorn.Server(router_server_config(app, host="127.0.0.1", port=port))
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "the router did not start"
        await asyncio.sleep(0.02)
    try:
        yield RouterUnderTest(f"http://127.0.0.1:{port}", port, state, scrape)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15.0)


@dataclass(frozen=True)
class RawAnswer:
    """An HTTP answer read from a plain socket."""

    status: int
    headers: dict[str, str]
    body: bytes

    def error(self) -> dict[str, Any]:
        """The OpenAI-style error object of the body (AssertionError when it is not one)."""
        data = json.loads(self.body)
        assert set(data) == {"error"}, data
        assert {"message", "type", "param", "code"} <= set(data["error"]), data
        return data["error"]


async def raw_exchange(
    port: int, data: bytes | Sequence[bytes], *, pause_s: float = 0.0, timeout_s: float = 20.0
) -> RawAnswer | None:
    """Write ``data`` (pieces ``pause_s`` apart) to the router, then read until it closes the connection
    or a whole answer arrived; None when the connection closed without an answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for piece in [data] if isinstance(data, bytes) else data:
            try:
                writer.write(piece)
                await writer.drain()
            except ConnectionError:  # answered and closed already: read what came
                break
            await asyncio.sleep(pause_s)
        received = b""
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    chunk = await reader.read(65536)
                except ConnectionError:
                    break
                if not chunk:
                    break
                received += chunk
                answer = _parse_answer(received)
                if answer is not None:
                    return answer
        return _parse_answer(received)
    finally:
        writer.close()


def _parse_answer(received: bytes) -> RawAnswer | None:
    head, sep, body = received.partition(b"\r\n\r\n")
    if not sep:
        return None
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    length = int(headers.get("content-length", "-1"))
    if length < 0 or len(body) < length:
        return None
    return RawAnswer(int(lines[0].split()[1]), headers, body[:length])

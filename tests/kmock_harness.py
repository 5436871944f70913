"""Run the Tessera operator (kopf) against KMock's Kubernetes emulator on loopback.

The emulator keeps objects in memory and serves list / watch / get / create / patch / delete. It
assigns no uid, so test objects carry their own. kopf runs cluster-wide (KMock 0.8 cannot answer the
cluster-scoped namespace listing that namespaced mode needs) and logs in through a login handler that
points at the emulator.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import attrs
import kmock
import kopf
import yaml
from kubernetes import client

from tessera.api import GROUP, VERSION
from tessera.operator.controller import Controller, MetricsSource
from tessera.operator.handlers import build_registry, kopf_events
from tessera.operator.kube import Kube

VERBS = ["list", "watch", "get", "create", "update", "patch", "delete"]
RESOURCES = {
    f"{GROUP}/{VERSION}/servingpools": "ServingPool",
    f"{GROUP}/{VERSION}/llmservices": "LLMService",
    f"{GROUP}/{VERSION}/requestclasses": "RequestClass",
    "apps/v1/statefulsets": "StatefulSet",
    "policy/v1/poddisruptionbudgets": "PodDisruptionBudget",
    "v1/services": "Service",
    "v1/configmaps": "ConfigMap",
    "v1/pods": "Pod",
    "v1/events": "Event",
    "v1/namespaces": "Namespace",
    "apiextensions.k8s.io/v1/customresourcedefinitions": "CustomResourceDefinition",
}
PLURALS = {"ServingPool": "servingpools", "LLMService": "llmservices", "RequestClass": "requestclasses"}
CLUSTER_SCOPED = {"Namespace", "CustomResourceDefinition"}
CHILD_PATHS = {
    "StatefulSet": "/apis/apps/v1/namespaces/{ns}/statefulsets",
    "PodDisruptionBudget": "/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets",
    "Service": "/api/v1/namespaces/{ns}/services",
    "ConfigMap": "/api/v1/namespaces/{ns}/configmaps",
}


def load_example(path: Path, namespace: str) -> list[dict[str, Any]]:
    """The documents of an example file, put in ``namespace`` with a fresh uid each."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    for doc in docs:
        doc["metadata"]["namespace"] = namespace
        doc["metadata"]["uid"] = str(uuid.uuid4())
        # kopf guards its finalizer patches with a JSON-patch test of resourceVersion; the emulator
        # keeps whatever is given (and never bumps it), which is enough for that test.
        doc["metadata"]["resourceVersion"] = "1"
    return docs


def custom_path(body: dict[str, Any], name: str | None = None) -> str:
    """API path of a Tessera object (its collection, or the object with ``name``)."""
    ns = body["metadata"]["namespace"]
    base = f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURALS[body['kind']]}"
    return f"{base}/{name}" if name else base


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    """KMock's emulator, plus names for objects created with only metadata.generateName (kopf's
    events), which the emulator would otherwise store all under the same missing name, and refusals
    that store nothing (see ``refuse``)."""

    _refusals: dict[str, list[tuple[int, dict[str, Any]]]] = attrs.field(factory=dict)

    def refuse(self, method: str, path: str, code: int, body: dict[str, Any]) -> None:
        """Answer the next ``method path`` request with ``code`` and ``body`` and change nothing, as a
        real API server refuses an invalid object. KMock's own reactions (``emulator[...] << 422``)
        still store a create, so the refused object would appear on the next list."""
        self._refusals.setdefault(f"{method.upper()} {path}", []).append((code, body))

    async def _handle(self, request: kmock.Request) -> Any:
        pending = self._refusals.get(f"{request.method.value.upper()} {request.url.path}")
        if pending:
            code, body = pending.pop(0)
            return aiohttp.web.json_response(body, status=code)
        data = request.data
        if request.action == kmock.action.CREATE and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:10]}"
        return await super()._handle(request)


@dataclass
class Harness:
    """An emulator with the operator running against it."""

    emulator: Emulator
    url: str
    session: aiohttp.ClientSession
    metrics: MetricsSource | None = None
    tick_seconds: float = 1.0
    _thread: threading.Thread | None = field(default=None, init=False)
    _stop: threading.Event | None = field(default=None, init=False)

    # -- the operator ---------------------------------------------------------------------------------

    def controller(self) -> Controller:
        """A fresh Controller talking to the emulator (fast retries)."""
        configuration = client.Configuration()
        configuration.host = self.url
        kube = Kube(client.ApiClient(configuration), sleep=lambda s: time.sleep(min(s, 0.05)))
        return Controller(kube, kopf_events, self.metrics)

    async def start(self) -> None:
        """Start a new operator (a fresh Controller and registry, as a restarted pod would)."""
        registry = build_registry(self.controller(), self.tick_seconds)
        url = self.url

        @kopf.on.login(registry=registry)
        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=url, insecure=True)

        @kopf.on.startup(registry=registry)
        def fast(settings: kopf.OperatorSettings, **_: Any) -> None:
            settings.watching.reconnect_backoff = 0.1
            settings.queueing.idle_timeout = 0.1
            # Stopped by cancellation (see start): no SIGKILL timer for a stop that is not graceful.
            settings.process.ultimate_exiting_timeout = None
            settings.posting.level = 0
            settings.execution.max_workers = 16

        # kopf runs in its own thread and event loop, and is stopped by cancelling it. Two waits of
        # kopf's graceful stop (the stop_flag) made every test's teardown take 5-10 s: (1) it waits up
        # to 5 s for every task of its loop that it did not start itself; sharing the tests' loop,
        # those were the emulator's server-side watch handlers, which never end on their own; (2) an
        # event still processed while stopping can start a pool daemon after the daemon killer has
        # gone, which then ticks until that 5 s wait runs out. Its own loop holds only kopf's tasks;
        # on cancellation kopf cancels its leftover tasks at once.
        self._stop = threading.Event()
        ready = threading.Event()
        failure: list[BaseException] = []
        stop = self._stop

        async def operate() -> None:
            task = asyncio.create_task(
                kopf.operator(registry=registry, clusterwide=True, standalone=True, ready_flag=ready)
            )
            await asyncio.to_thread(stop.wait)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        def serve() -> None:
            try:
                asyncio.run(operate())
            except BaseException as error:  # reported by start() when it never became ready
                failure.append(error)

        self._thread = threading.Thread(target=serve, name="kopf-operator", daemon=True)
        self._thread.start()
        if not await asyncio.to_thread(ready.wait, 20):
            stop.set()
            raise RuntimeError(f"kopf did not become ready within 20 s: {failure!r}")

    async def stop(self) -> None:
        """Stop the operator and wait until it is gone."""
        if self._thread is None or self._stop is None:
            return
        self._stop.set()
        await asyncio.to_thread(self._thread.join, 30)
        if self._thread.is_alive():
            raise RuntimeError("kopf did not stop within 30 s")
        self._thread = None

    # -- the API --------------------------------------------------------------------------------------

    async def create(self, body: dict[str, Any]) -> None:
        """POST one Tessera object."""
        response = await self.session.post(self.url + custom_path(body), json=body)
        assert response.status in (200, 201), await response.text()

    async def patch(self, body: dict[str, Any], changes: dict[str, Any]) -> None:
        """Merge-patch one Tessera object."""
        response = await self.session.patch(
            self.url + custom_path(body, body["metadata"]["name"]),
            json=changes,
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert response.status == 200, await response.text()

    async def delete(self, body: dict[str, Any]) -> None:
        """DELETE one Tessera object."""
        response = await self.session.delete(self.url + custom_path(body, body["metadata"]["name"]))
        assert response.status in (200, 202), await response.text()

    async def get(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The stored state of a Tessera object; None when it is gone."""
        response = await self.session.get(self.url + custom_path(body, body["metadata"]["name"]))
        return await response.json() if response.status == 200 else None

    async def list(self, kind: str, namespace: str) -> list[dict[str, Any]]:
        """Every Tessera object of ``kind`` in ``namespace``."""
        body = {"kind": kind, "metadata": {"namespace": namespace}}
        response = await self.session.get(self.url + custom_path(body))
        return (await response.json()).get("items", [])

    async def children(self, namespace: str) -> dict[tuple[str, str], dict[str, Any]]:
        """Every StatefulSet, Service and ConfigMap in ``namespace`` by (kind, name)."""
        found = {}
        for kind, path in CHILD_PATHS.items():
            response = await self.session.get(self.url + path.format(ns=namespace))
            for item in (await response.json()).get("items", []):
                found[(kind, item["metadata"]["name"])] = item
        return found

    async def events(self, namespace: str) -> list[dict[str, Any]]:
        """Every event posted in ``namespace``."""
        response = await self.session.get(self.url + f"/api/v1/namespaces/{namespace}/events")
        return (await response.json()).get("items", [])

    async def eventually(self, check: Callable[[], Any], timeout: float = 45.0) -> Any:
        """Poll the async ``check`` until it returns a truthy value; fail with its last value. The default
        timeout is generous: a pass makes several API calls, each slow on a loaded 2-core machine."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = await check()
            if value:
                return value
            await asyncio.sleep(0.25)
        raise AssertionError(f"condition not met within {timeout}s; last value: {value!r}")


@contextlib.asynccontextmanager
async def emulated_cluster(
    metrics: MetricsSource | None = None, tick_seconds: float = 1.0
) -> AsyncIterator[Harness]:
    """An emulator on loopback with every resource the operator uses, and a running operator."""
    async with Emulator() as emulator, kmock.Server(emulator) as server:
        for path, kind in RESOURCES.items():
            emulator.resources[path] = {
                "kind": kind,
                "namespaced": kind not in CLUSTER_SCOPED,
                "verbs": VERBS,
            }
        # The tests' own HTTP session: kopf's shutdown closes the emulator's bundled client.
        async with aiohttp.ClientSession() as session:
            harness = Harness(emulator, str(server.url).rstrip("/"), session, metrics, tick_seconds)
            await harness.start()
            try:
                yield harness
            finally:
                await harness.stop()


def copy_doc(doc: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of a document (tests mutate their copies)."""
    return copy.deepcopy(doc)

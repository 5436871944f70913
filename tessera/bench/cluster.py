"""An emulated cluster on loopback: the Tessera operator (kopf) against KMock's Kubernetes emulator, and a
real Prometheus scraping ``tessera worker`` processes with the labels Kubernetes discovery gives pods.

The emulator keeps objects in memory and serves list / watch / get / create / patch / delete. It
assigns no uid, so the objects given to it carry their own. kopf runs cluster-wide (KMock 0.8 cannot
answer the cluster-scoped namespace listing that namespaced mode needs) and logs in through a login
handler that points at the emulator. The operator's integration tests and ``tessera bench router``'s
control-plane fault rows both run on it; KMock is a development dependency (``pip install -e .[dev]``)
and Prometheus a system one (``make sysdeps``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import attrs
import httpx
import kmock
import kopf
import yaml
from kubernetes import client

from tessera.api import GROUP, VERSION
from tessera.bench.harness import WorkerChild, stop_process
from tessera.control.children import CONFIG_KEY
from tessera.operator.controller import Controller, MetricsSource
from tessera.operator.handlers import build_registry, kopf_events
from tessera.operator.kube import Kube

ROOT = Path(__file__).resolve().parents[2]
# The manifests' scrape job (with its relabelling), which Prometheus runs here from a targets file.
SCRAPE_JOB = ROOT / "manifests" / "monitoring" / "prometheus-scrape-config.yaml"
PROMETHEUS = shutil.which("prometheus")  # the Debian package's binary (make sysdeps)
SCRAPE_S = 1.0  # Prometheus's scrape interval
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
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


def autoscaled_quickstart(
    namespace: str, instances: int, interval_s: float, cooldown_s: float
) -> list[dict[str, Any]]:
    """The quickstart, reduced to its interactive class and FCFS, on the sim engine, 1 to ``instances``
    instances, autoscaled every ``interval_s`` with no scale-up cooldown and a scale-down cooldown of
    ``cooldown_s``."""
    docs = load_example(QUICKSTART, namespace)
    docs = [d for d in docs if d["metadata"]["name"] != "offline"]
    for doc in docs:
        if doc["kind"] == "ServingPool":
            doc["metadata"]["annotations"] = {"tessera.dev/engine": "sim"}
            doc["spec"]["instances"] = {"min": 1, "max": instances}
            doc["spec"]["autoscaling"] = {
                "enabled": True,
                "intervalSeconds": interval_s,
                "scaleUpCooldownSeconds": 0,
                "scaleDownCooldownSeconds": cooldown_s,
            }
        if doc["kind"] == "LLMService":
            doc["spec"]["requestClasses"] = [{"name": "chat"}]
            doc["spec"]["replicas"] = {"min": 1, "max": instances}
            # FCFS, not auto's Andes: Andes paces streams at the reading speed, so closed-loop clients
            # would keep the engine idle most of the time and their load would not show.
            doc["spec"]["scheduling"] = {"policy": "fcfs"}
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


def meta_labels(sts: dict[str, Any], ordinal: int) -> dict[str, str]:
    """What Kubernetes pod discovery labels the worker port of the StatefulSet's pod ``ordinal`` with."""
    template = sts["spec"]["template"]
    worker = next(c for c in template["spec"]["containers"] if c["name"] == "worker")

    def sanitized(name: str) -> str:
        return re.sub(r"[^a-zA-Z0-9_]", "_", name)

    return {
        "__meta_kubernetes_namespace": sts["metadata"]["namespace"],
        "__meta_kubernetes_pod_name": f"{sts['metadata']['name']}-{ordinal}",
        "__meta_kubernetes_pod_container_port_name": worker["ports"][0]["name"],
        **{
            f"__meta_kubernetes_pod_label_{sanitized(k)}": v
            for k, v in template["metadata"]["labels"].items()
        },
        **{
            f"__meta_kubernetes_pod_annotation_{sanitized(k)}": v
            for k, v in template["metadata"]["annotations"].items()
        },
    }


class Prometheus:
    """A Prometheus server on loopback scraping, every ``SCRAPE_S``, the targets of ``set_targets``;
    ``stop`` then ``start`` restart it on the same port, storage and targets."""

    def __init__(self, port: int, tmp: Path) -> None:
        if PROMETHEUS is None:
            raise RuntimeError("prometheus is not installed (make sysdeps, or apt-get install prometheus)")
        # The manifests' scrape job with its relabelling, discovering targets from a file instead of
        # the Kubernetes API: Prometheus starts before the workers exist and picks the file up as
        # soon as it is written (it watches it). Targets carry the __meta_kubernetes_* labels that
        # Kubernetes discovery would give the operator's pods.
        (job,) = [j for j in yaml.safe_load(SCRAPE_JOB.read_text()) if j["job_name"] == "tessera-workers"]
        del job["kubernetes_sd_configs"]
        self.targets = tmp / "targets.json"
        job |= {"scrape_timeout": "900ms", "file_sd_configs": [{"files": [str(self.targets)]}]}
        config = {
            "global": {"scrape_interval": f"{SCRAPE_S:g}s", "evaluation_interval": f"{SCRAPE_S:g}s"},
            "scrape_configs": [job],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.command = [
            PROMETHEUS,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ]
        self.url = f"http://127.0.0.1:{port}"
        self.log = tmp / "prometheus.log"
        self.start()

    def start(self) -> None:
        """Start the server (without waiting: see ``wait_ready``)."""
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until /-/ready answers 200."""
        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited:\n{self.log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return
            if time.time() > deadline:
                raise RuntimeError(f"prometheus not ready:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.2)

    def set_targets(self, targets: list[tuple[str, dict[str, str]]]) -> None:
        """Scrape these (address, target labels); replaces the file at once (a rename)."""
        staged = self.targets.with_suffix(".tmp")
        staged.write_text(json.dumps([{"targets": [a], "labels": labels} for a, labels in targets]))
        staged.replace(self.targets)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        stop_process(self.proc, 10.0)


async def promql(url: str, query: str) -> list[dict[str, Any]]:
    """An instant query's result vector."""
    async with httpx.AsyncClient(timeout=5) as http:
        response = await http.get(f"{url}/api/v1/query", params={"query": query})
    response.raise_for_status()
    return response.json()["data"]["result"]


async def placed_group(harness: Harness, pool: dict[str, Any]) -> tuple[str, dict[tuple[str, str], Any]]:
    """The StatefulSet of the pool's first placed group, once its worker ConfigMap exists, and the
    children of the pool's namespace then."""
    namespace, name = pool["metadata"]["namespace"], pool["metadata"]["name"]

    async def placed() -> tuple[str, dict[tuple[str, str], Any]] | None:
        body = await harness.get(pool)
        groups = ((body or {}).get("status") or {}).get("placement", {}).get("groups")
        children = await harness.children(namespace)
        if groups and ("ConfigMap", f"{name}-{groups[0]['name']}-worker") in children:
            return f"{name}-{groups[0]['name']}", children
        return None

    return await harness.eventually(placed)


async def serve_pods(
    prom: Prometheus, children: dict[tuple[str, str], Any], sts: str, count: int, tmp: Path
) -> tuple[list[WorkerChild], dict[str, Any]]:
    """Pods 0 to ``count`` - 1 of the StatefulSet ``sts`` as ``tessera worker`` processes on the
    configuration its ConfigMap holds, scraped by ``prom`` with their pods' discovery labels; returns
    them and that configuration. The starts block: they run in threads, as the emulator answers the
    operator from the calling event loop."""
    config = json.loads(children[("ConfigMap", f"{sts}-worker")]["data"][CONFIG_KEY])
    started = await asyncio.gather(
        *(asyncio.to_thread(WorkerChild, config, tmp) for _ in range(count)), return_exceptions=True
    )
    workers = [w for w in started if isinstance(w, WorkerChild)]
    failed = [e for e in started if isinstance(e, BaseException)]
    if failed:
        await asyncio.gather(*(asyncio.to_thread(w.stop) for w in workers))
        raise failed[0]
    statefulset = children[("StatefulSet", sts)]
    prom.set_targets([(f"127.0.0.1:{w.port}", meta_labels(statefulset, i)) for i, w in enumerate(workers)])
    return workers, config


async def until_scraped(harness: Harness, prom: Prometheus, namespace: str, sts: str, count: int) -> None:
    """Until Prometheus has scraped ``count`` pods of the StatefulSet ``sts`` up (at most 20 s)."""
    up = f'up{{namespace="{namespace}",pod=~"{sts}-[0-9]+"}}'

    async def scraped() -> bool:
        return sum(float(s["value"][1]) for s in await promql(prom.url, up)) == count

    await harness.eventually(scraped, timeout=20)


class ReplicaLog:
    """Every change of a StatefulSet's replicas seen by polling the emulator, with its time."""

    def __init__(self, harness: Harness, namespace: str, name: str) -> None:
        self.harness, self.namespace, self.name = harness, namespace, name
        self.changes: list[tuple[float, int]] = []

    async def poll(self) -> int:
        children = await self.harness.children(self.namespace)
        replicas = children[("StatefulSet", self.name)]["spec"]["replicas"]
        if not self.changes or self.changes[-1][1] != replicas:
            self.changes.append((time.time(), replicas))
        return replicas

    async def wait_for(self, replicas: int, timeout: float) -> float:
        """Poll until the StatefulSet has ``replicas``; return when that was first seen."""
        deadline = time.time() + timeout
        while await self.poll() != replicas:
            if time.time() > deadline:
                raise AssertionError(f"replicas never reached {replicas}; changes: {self.changes}")
            await asyncio.sleep(0.1)
        return self.changes[-1][0]

    async def watch_until(self, stop: float) -> None:
        while time.time() < stop:
            await self.poll()
            await asyncio.sleep(0.1)

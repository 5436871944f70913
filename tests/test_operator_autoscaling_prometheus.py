"""Autoscaling end to end: a real Prometheus (started here on loopback) scrapes real ``tessera worker``
processes in sim-engine mode, and the operator under kopf (against KMock's emulator) scales the
group's StatefulSet from what Prometheus measures — the production path: pool daemon tick ->
``Controller.reconcile_pool`` -> ``PrometheusMetrics.snapshot`` -> ``chiron_decide`` -> StatefulSet replicas.

The workers run the very configuration the operator wrote into the group's ConfigMap. Prometheus runs
the manifests' scrape job (``manifests/monitoring/prometheus-scrape-config.yaml``), whose relabelling
turns the pods' discovery labels into the ones the operator queries (namespace, pod, pool, group).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import yaml
from kmock_harness import Harness, emulated_cluster, load_example

from tessera.bench.harness import WorkerChild, stream_one
from tessera.control.children import CONFIG_KEY
from tessera.core.chiron import autoscale as autoscale_module
from tessera.core.planners import MetricsSnapshot, ScalingDecision
from tessera.core.planners.chiron import chiron_decide
from tessera.operator.prometheus import PrometheusMetrics
from tessera.worker.engines.vllm_process import free_port

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (make sysdeps)"),
]

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SCRAPE_JOB = ROOT / "manifests" / "monitoring" / "prometheus-scrape-config.yaml"
NAMESPACE, POOL = "autoscale", "h100-pool"
SCRAPE_S = 1.0
INTERVAL_S = 2.0  # spec.autoscaling.intervalSeconds (Chiron T_eval)
COOLDOWN_S = 5.0  # spec.autoscaling.scaleDownCooldownSeconds
TICK_S = 0.25  # how often the pool daemons look whether the autoscaler is due
LOAD_S = 6.0  # length of the load step
STREAMS = 4  # concurrent streams of the load step
# Slack for a loaded 2-core machine (process scheduling, the emulator's answers) on top of the
# delays the design allows.
SLACK_S = 1.5


def pool_docs() -> list[dict[str, Any]]:
    """The quickstart, reduced to its interactive class and FCFS, on the sim engine, 1 to 2 instances,
    with a short autoscaler interval and scale-down cooldown."""
    docs = load_example(EXAMPLES / "quickstart.yaml", NAMESPACE)
    docs = [d for d in docs if d["metadata"]["name"] != "offline"]
    for doc in docs:
        if doc["kind"] == "ServingPool":
            doc["metadata"]["annotations"] = {"tessera.dev/engine": "sim"}
            doc["spec"]["instances"] = {"min": 1, "max": 2}
            doc["spec"]["autoscaling"] = {
                "enabled": True,
                "intervalSeconds": INTERVAL_S,
                "scaleUpCooldownSeconds": 0,
                "scaleDownCooldownSeconds": COOLDOWN_S,
            }
        if doc["kind"] == "LLMService":
            doc["spec"]["requestClasses"] = [{"name": "chat"}]
            doc["spec"]["replicas"] = {"min": 1, "max": 2}
            # FCFS, not auto's Andes: Andes paces streams at the reading speed, so the closed-loop
            # clients below would keep the engine idle most of the time and the step would not load it.
            doc["spec"]["scheduling"] = {"policy": "fcfs"}
    return docs


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
    """A Prometheus server on loopback scraping, every second, the targets of ``set_targets``."""

    def __init__(self, port: int, tmp: Path) -> None:
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
        self.url = f"http://127.0.0.1:{port}"
        self.log = tmp / "prometheus.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    str(PROMETHEUS),
                    f"--config.file={tmp / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--log.level=warn",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )

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
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def promql(url: str, query: str) -> list[dict[str, Any]]:
    """An instant query's result vector."""
    async with httpx.AsyncClient(timeout=5) as http:
        response = await http.get(f"{url}/api/v1/query", params={"query": query})
    response.raise_for_status()
    return response.json()["data"]["result"]


async def first_seen(url: str, query: str, timeout: float) -> float:
    """When ``query`` first returned a non-empty result (polled every 0.1 s)."""
    deadline = time.time() + timeout
    while not await promql(url, query):
        if time.time() > deadline:
            raise AssertionError(f"{query} stayed empty for {timeout}s")
        await asyncio.sleep(0.1)
    return time.time()


class ReplicaLog:
    """Every change of the group StatefulSet's replicas seen by polling the emulator, with its time."""

    def __init__(self, harness: Harness, name: str) -> None:
        self.harness, self.name = harness, name
        self.changes: list[tuple[float, int]] = []

    async def poll(self) -> int:
        children = await self.harness.children(NAMESPACE)
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


async def load_step(url: str, model: str, until: float) -> int:
    """``STREAMS`` clients streaming short completions back to back until ``until``; returns how
    many requests finished."""
    done = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal done
        while time.time() < until:
            body = {"model": model, "prompt": "tell me a story", "max_tokens": 64, "ignore_eos": True}
            stat = await stream_one(http, url, body, {"X-Tessera-Class": "chat"})
            assert stat.tokens == 64
            done += 1

    async with httpx.AsyncClient(timeout=60) as http:
        await asyncio.gather(*(client(http) for _ in range(STREAMS)))
    return done


Evaluation = tuple[float, MetricsSnapshot, ScalingDecision]


@pytest.fixture
def evaluations(monkeypatch: pytest.MonkeyPatch) -> list[Evaluation]:
    """Every global autoscaler evaluation the operator makes: (its time, what it measured, what it
    decided). Recorded around the real ``chiron_decide``; nothing else changes."""
    seen: list[Evaluation] = []

    def recording(snapshot, state, settings, now):  # type: ignore[no-untyped-def]
        decision = chiron_decide(snapshot, state, settings, now)
        seen.append((now, snapshot, decision))
        return decision

    monkeypatch.setattr(autoscale_module, "chiron_decide", recording)
    return seen


def busy(snapshot: MetricsSnapshot) -> int:
    """Chiron's U: instances with interactive work (a queue counts as one more)."""
    return snapshot.instances_with_interactive + (1 if snapshot.interactive_queued else 0)


@pytest_asyncio.fixture(loop_scope="function")
async def operator_with_prometheus(evaluations: list[Evaluation]) -> AsyncIterator[tuple[Harness, int]]:
    port = free_port()
    metrics = PrometheusMetrics(f"http://127.0.0.1:{port}")
    async with emulated_cluster(metrics=metrics, tick_seconds=TICK_S) as harness:
        yield harness, port


async def test_load_step_scales_up_within_an_interval_and_down_after_the_cooldown(
    operator_with_prometheus: tuple[Harness, int], evaluations: list[Evaluation], tmp_path: Path
) -> None:
    harness, prom_port = operator_with_prometheus
    docs = pool_docs()
    for doc in docs:
        await harness.create(doc)
    pool = next(d for d in docs if d["kind"] == "ServingPool")

    async def placed() -> dict[str, Any] | None:
        body = await harness.get(pool)
        groups = ((body or {}).get("status") or {}).get("placement", {}).get("groups")
        children = await harness.children(NAMESPACE)
        if groups and ("ConfigMap", f"{POOL}-{groups[0]['name']}-worker") in children:
            return {"group": groups[0]["name"], "children": children}
        return None

    found = await harness.eventually(placed)
    group, children = found["group"], found["children"]
    sts = f"{POOL}-{group}"
    config = json.loads(children[("ConfigMap", f"{sts}-worker")]["data"][CONFIG_KEY])
    assert [m["engine"] for m in config["models"]] == ["sim"]
    model = config["models"][0]["name"]

    # Two worker pods (ordinals 0 and 1) on the operator's configuration; Prometheus scrapes both.
    # Blocking starts run in threads: the emulator answers kopf from this event loop.
    workers: list[WorkerChild] = []
    phases = {"placed": time.time()}
    prom = Prometheus(prom_port, tmp_path)
    try:
        prom_ready = asyncio.create_task(asyncio.to_thread(prom.wait_ready))
        workers += await asyncio.gather(*(asyncio.to_thread(WorkerChild, config, tmp_path) for _ in range(2)))
        statefulset = children[("StatefulSet", sts)]
        targets = [(f"127.0.0.1:{w.port}", meta_labels(statefulset, i)) for i, w in enumerate(workers)]
        phases["workers up"] = time.time()
        await prom_ready
        prom.set_targets(targets)
        up = f'up{{namespace="{NAMESPACE}",pool="{POOL}",group="{group}"}}'

        async def scraped() -> bool:
            return sum(float(s["value"][1]) for s in await promql(prom.url, up)) == 2

        await harness.eventually(scraped, timeout=20)
        phases["scraped"] = time.time()
        replicas = ReplicaLog(harness, sts)
        # Idle: the autoscaler settles at the pool's one interactive instance.
        await replicas.wait_for(1, timeout=4 * INTERVAL_S + COOLDOWN_S + SLACK_S)
        idle_changes = len(replicas.changes)
        phases["idle at 1"] = time.time()

        # The load step on pod 0: instances with interactive work / instances = 1 > Θ_op + δ_op.
        start = time.time()
        load = asyncio.create_task(load_step(workers[0].url, model, start + LOAD_S))
        loaded = f'sum(tessera_inflight{{pod="{sts}-0"}}) > 0'
        seen = asyncio.create_task(first_seen(prom.url, loaded, timeout=LOAD_S))
        scaled_up = await replicas.wait_for(2, timeout=LOAD_S)
        visible = await seen
        finished = await load
        load_end = time.time()
        # Scale-down only after the cooldown and once Prometheus sees the group idle.
        scaled_down = await replicas.wait_for(1, timeout=COOLDOWN_S + 3 * INTERVAL_S + SLACK_S)
        phases["scaled down"] = time.time()
        await replicas.watch_until(time.time() + INTERVAL_S)  # and it stays
    finally:
        # The operator first: its passes would otherwise retry a stopped Prometheus while kopf waits.
        await harness.stop()
        await asyncio.to_thread(lambda: [w.stop() for w in workers] and None)
        await asyncio.to_thread(prom.stop)

    assert finished >= STREAMS
    # Prometheus shows the load within a scrape; the autoscaler evaluates once per interval, and the
    # first evaluation that sees the load scales up (none before it did, none after it flaps).
    measured_after = visible - start
    assert measured_after <= SCRAPE_S + SLACK_S
    during = [e for e in evaluations if start <= e[0] <= scaled_up]
    first = next(e for e in during if busy(e[1]) >= 1)
    assert first[2].desired.total == 2 and first[1].ready.total == 1, first
    assert first[0] - visible <= INTERVAL_S + TICK_S + SLACK_S
    times = [e[0] for e in evaluations]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert max(gaps) <= INTERVAL_S + TICK_S + SLACK_S and min(gaps) >= INTERVAL_S, gaps
    assert scaled_down - scaled_up >= COOLDOWN_S
    assert scaled_down >= load_end - SCRAPE_S  # never while the load was running
    # No flapping: after settling idle, exactly one scale-up and one scale-down.
    assert [r for _, r in replicas.changes[idle_changes - 1 :]] == [1, 2, 1], replicas.changes

    # The status records the same decisions, with Chiron's reasons.
    body = await harness.get(pool)
    history = body["status"]["scalingHistory"]
    ups = [h for h in history if h["toReplicas"] > h["fromReplicas"]]
    assert ups and "IBP" in ups[-1]["reason"]
    print(
        f"load visible in Prometheus after {measured_after:.2f}s; first evaluation seeing it "
        f"{first[0] - visible:.2f}s later scaled 1 -> 2 (StatefulSet patched {scaled_up - start:.2f}s "
        f"after the load step); evaluation gaps {min(gaps):.2f}-{max(gaps):.2f}s (interval "
        f"{INTERVAL_S}s); scale-down {scaled_down - scaled_up:.2f}s after the scale-up (cooldown "
        f"{COOLDOWN_S}s), {scaled_down - load_end:.2f}s after the load ended; {finished} requests; "
        + ", ".join(f"{k} at {v - phases['placed']:.1f}s" for k, v in phases.items())
    )

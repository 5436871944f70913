"""Local mode end to end with the sim engine: the quickstart (plus a class no request can meet) behind
the router; interactive and batch streams arrive; the client-side SLO report agrees with the workers'."""

from __future__ import annotations

import asyncio
import io
import json
import socket
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tessera.api import load_documents
from tessera.api.traces import load_trace
from tessera.local.control_plane import LocalEngine, plan_local
from tessera.local.load import WorkloadOptions, build_workload
from tessera.local.runner import LoadSettings, LocalStack, run_load
from tessera.router.app import class_infos
from tessera.worker.engines.vllm_process import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
STRICT = """
---
apiVersion: tessera.dev/v1alpha1
kind: RequestClass
metadata:
  name: strict
spec:
  kind: interactive
  slo:
    ttftSeconds: 0.001
"""


def _spec(tmp_path: Path) -> Path:
    text = (EXAMPLES / "quickstart.yaml").read_text()
    text = text.replace("    - name: offline\n", "    - name: offline\n    - name: strict\n") + STRICT
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


def _worker_slo_counts(urls: list[str]) -> dict[tuple[str, str], float]:
    counts: dict[tuple[str, str], float] = {}
    for url in urls:
        for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
            if fam.name in ("tessera_slo_met", "tessera_slo_missed"):
                for s in fam.samples:
                    if s.name.endswith("_total"):
                        key = (fam.name, s.labels["class"])
                        counts[key] = counts.get(key, 0) + s.value
    return counts


async def test_local_mode_serves_streams_and_reports_slo(tmp_path: Path) -> None:
    plan = plan_local(load_documents(_spec(tmp_path)), LocalEngine(), max_instances_per_group=2)
    assert len(plan.instances) == 2
    stack = LocalStack(plan, tmp_path / "run", "127.0.0.1", free_port(), autoscale=False)
    await stack.start(60.0)
    try:
        model = plan.instances[0].config.models[0].name
        async with httpx.AsyncClient(base_url=stack.endpoint, timeout=30.0) as client:
            # Streams arrive, one chunk per token, for an interactive and a batch request.
            for header, n in (("chat", 12), ("batch", 7)):
                body = {"model": model, "prompt": "hello", "max_tokens": n, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body,
                                         headers={"X-Tessera-Class": header}) as resp:  # fmt: skip
                    assert resp.status_code == 200
                    assert resp.headers["x-tessera-instance"] in {i.name for i in plan.instances}
                    lines = [ln async for ln in resp.aiter_lines() if ln.startswith("data: {")]
                chunks = [json.loads(ln[6:]) for ln in lines]
                assert sum(c["choices"][0]["finish_reason"] is None for c in chunks) == n
                assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            msg = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            chat = await client.post("/v1/chat/completions", json=msg)
            assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 3
            bad = await client.post("/v1/completions", json={"model": model, "prompt": "x"},
                                    headers={"X-Tessera-Class": "gold"})  # fmt: skip
            assert bad.status_code == 400 and "chat, batch, strict" in bad.json()["error"]["message"]
            unknown = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
            assert unknown.status_code == 404
        before = _worker_slo_counts([w.url for w in stack.supervisor.workers])

        trace = tmp_path / "trace.jsonl"
        trace.write_text("".join(
            json.dumps({"arrival_s": 0.1 * i, "input_tokens": 20, "output_tokens": 30,
                        "class": ["chat", "batch", "strict"][i % 3]}) + "\n" for i in range(12)
        ))  # fmt: skip
        classes = class_infos(plan.instances[0].config)
        workload = build_workload(load_trace(trace), classes, {model: 8192}, WorkloadOptions())
        out = io.StringIO()
        settings = LoadSettings(json_path=tmp_path / "r.json", live=False)
        summary = await run_load(stack.endpoint, workload, classes, "X-Tessera-Class", settings,
                                 stack.status, out)  # fmt: skip
        assert (summary["requests"], summary["finished"], summary["failed"]) == (12, 12, 0)
        assert summary["slo_attainment_by_class"] == {"chat": 1.0, "offline": 1.0, "strict": 0.0}
        assert summary["output_tokens_per_s"] > 0
        assert json.loads((tmp_path / "r.json").read_text())["results"][0]["requests"] == 12
        assert "strict" in out.getvalue() and "0.0%" in out.getvalue()
        # The workers judged the same requests the same way.
        after = _worker_slo_counts([w.url for w in stack.supervisor.workers])
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        assert delta[("tessera_slo_met", "chat")] == 4 and delta[("tessera_slo_missed", "strict")] == 4
        assert delta[("tessera_slo_met", "offline")] == 4
        # The router counted every answer it gave, by status: 2 streams, 1 chat, 12 trace requests.
        codes: dict[str, float] = {}
        async with httpx.AsyncClient(base_url=stack.endpoint) as client:  # the router runs in this loop
            router_metrics = (await client.get("/metrics")).text
        for fam in text_string_to_metric_families(router_metrics):
            for s in fam.samples:
                if s.name == "tessera_router_requests_total":
                    codes[s.labels["code"]] = codes.get(s.labels["code"], 0) + s.value
        assert codes == {"200": 15, "400": 1, "404": 1}
        # Both instances took work (least estimated wait spreads ties by outstanding count).
        status = await stack.status()
        assert status is not None and all(x["healthy"] for x in status["instances"])
    finally:
        await stack.stop()
    assert all(w.proc is None for w in stack.supervisor.workers) and not stack.supervisor.workers


async def test_local_mode_on_a_taken_port_says_so_and_stops_its_workers(tmp_path: Path) -> None:
    plan = plan_local(load_documents(_spec(tmp_path)), LocalEngine(), max_instances_per_group=1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        stack = LocalStack(plan, tmp_path / "run", "127.0.0.1", taken.getsockname()[1], autoscale=False)
        # uvicorn ends a failed start with sys.exit: it must not escape the event loop as SystemExit.
        with pytest.raises(OSError, match=r"port in use.*--port"):
            await stack.start(60.0)
    assert not stack.supervisor.workers  # stopped (the supervisor forgets what it stopped)


async def _until(check, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def test_local_autoscaler_shrinks_when_idle_grows_under_load_and_loses_nothing(tmp_path: Path) -> None:
    text = (EXAMPLES / "quickstart.yaml").read_text()
    fast = "    intervalSeconds: 1\n    scaleDownCooldownSeconds: 3\n"
    spec = tmp_path / "spec.yaml"
    spec.write_text(text.replace("    intervalSeconds: 5\n", fast))
    plan = plan_local(load_documents(spec), LocalEngine())
    assert [i.role for i in plan.instances] == ["interactive"] * 4
    lines: list[str] = []
    stack = LocalStack(plan, tmp_path / "run", "127.0.0.1", free_port(), report=lines.append)
    await stack.start(60.0)
    first = list(stack.supervisor.workers)
    try:
        # Idle: IBP 0 for two evaluations, no scaling yet, so no cooldown: one interactive stays.
        await _until(lambda: len(stack.supervisor.workers) == 1, 30, "the idle shrink")
        assert "4i/0m/0b -> 1i/0m/0b" in lines[0]
        await _until(lambda: all(w.proc is not None and w.proc.poll() is not None for w in first[1:]), 30,
                     "the removed workers to exit")  # fmt: skip
        model = plan.instances[0].config.models[0].name
        body = {"model": model, "prompt": "hello", "max_tokens": 1500, "stream": True}
        async with httpx.AsyncClient(base_url=stack.endpoint, timeout=60.0) as client:

            async def stream() -> list[str]:
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    return [ln async for ln in resp.aiter_lines() if ln.startswith("data: {")]

            task = asyncio.create_task(stream())
            # One busy instance of one: IBP 1 > Θ_op + δ: grow to 1 interactive + 2 mixed (Θ_op = 1/3).
            await _until(lambda: any("-> 1i/2m/0b" in ln for ln in lines), 30, "the scale-up")

            def ready_roles() -> list[str]:
                assert stack.state is not None
                return [x.role for x in stack.state.loads.values() if x.healthy]

            await _until(lambda: ready_roles() == ["interactive", "mixed", "mixed"], 30, "the new workers")
            chunks = [json.loads(ln[6:]) for ln in await task]
        assert sum(c["choices"][0]["finish_reason"] is None for c in chunks) == 1500
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        # Idle again, past the 3 s cooldown: back to one instance; the mixed workers stop.
        grown = [w for w in stack.supervisor.workers if w.instance.ordinal > 0]
        await _until(lambda: len(stack.supervisor.workers) == 1, 30, "the second shrink")
        await _until(lambda: all(w.proc is not None and w.proc.poll() is not None for w in grown), 30,
                     "the mixed workers to exit")  # fmt: skip
        assert stack.autoscaler is not None and stack.autoscaler.actions == lines
    finally:
        await stack.stop()


@pytest.mark.integration
def test_sigterm_stops_local_mode_and_every_worker_it_started(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "tessera", "local", "up", "-f", str(EXAMPLES / "quickstart.yaml"),
         "--port", str(free_port()), "--no-autoscale"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "serving;" in line:
                break
        else:
            pytest.fail("local mode did not start serving")
        table = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
        children = [int(p) for p, pp in (row.split() for row in table.splitlines()) if int(pp) == proc.pid]
        assert children, "no worker process found under local mode"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 10
        alive = children
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if os.path.exists(f"/proc/{p}") and "Z" not in _state(p)]
            time.sleep(0.1)
        assert not alive, f"workers left running after SIGTERM: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().split()[2]
    except OSError:
        return "Z"

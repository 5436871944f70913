"""Local mode scale to zero with the sim engine, through the router as a user meets it: the quickstart
service with ``scaleToZero`` goes Cold after its idle time (its worker process stops, the model stays
in /v1/models), a request wakes it (a new worker process) and is served; a request that arrives while
the group is being put to sleep is served too; a service sharing its group with an always-on one
stays on, and the plan says why."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tessera.api import load_documents
from tessera.core.activation import Backoff, unit_idle_after
from tessera.local.control_plane import LocalEngine, plan_local
from tessera.local.runner import LocalStack, describe_plan
from tessera.local.scale_to_zero import IdleUnits, idle_units
from tessera.worker.engines.vllm_process import free_port

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
IDLE = "  scaleToZero:\n    afterSeconds: 1\n    holdSeconds: 60\n"


def _spec(tmp_path: Path, extra: str = "") -> Path:
    text = (EXAMPLES / "quickstart.yaml").read_text()
    text = text.replace("  defaultClass: chat\n", "  defaultClass: chat\n" + IDLE) + extra
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


async def _status(stack: LocalStack) -> dict:  # type: ignore[type-arg]
    status = await stack.status()
    assert status is not None
    return status


async def _until_state(stack: LocalStack, state: str, timeout: float = 30.0) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout
    while True:
        unit = next(iter((await _status(stack))["activation"].values()))
        if unit["state"] == state:
            return unit  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, f"still {unit['state']}, expected {state}"
        await asyncio.sleep(0.01)


@pytest.mark.integration
@pytest.mark.timeout(180)
async def test_an_idle_service_goes_cold_and_a_held_request_wakes_it_and_is_served(tmp_path: Path) -> None:
    plan = plan_local(load_documents(_spec(tmp_path)), LocalEngine(), max_instances_per_group=2)
    assert f"scale to zero: group {plan.groups[0].group.name} stops after 1 s" in describe_plan(plan, False)
    stack = LocalStack(plan, tmp_path / "run", "127.0.0.1", free_port(), autoscale=False,
                       activation_tick_s=0.1)  # fmt: skip
    await stack.start(60.0)
    model = plan.instances[0].config.models[0].name
    body = {"model": model, "prompt": "hello", "max_tokens": 5}
    try:
        async with httpx.AsyncClient(base_url=stack.endpoint, timeout=60.0) as client:
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            # On a loaded machine the group may already have slept (and been woken by this request) when
            # the request came more than afterSeconds after the start: count from here.
            n = next(iter((await _status(stack))["activation"].values()))["sleeps"]
            before = list(stack.supervisor.workers)
            assert len(before) == 2
            cold = await _until_state(stack, "Cold")
            assert cold["sleeps"] == n + 1 and cold["models"] == [model]
            assert not stack.supervisor.workers  # both processes stopped
            assert all(w.proc is not None and w.proc.poll() is not None for w in before)
            assert (await _status(stack))["instances"] == []
            listed = (await client.get("/v1/models")).json()["data"]
            assert [m["id"] for m in listed] == [model]  # still listed while cold
            ready = await client.get("/ready")  # the router stays ready: the model can wake
            assert ready.status_code == 200 and ready.json() == {
                "ready": True,
                "instances": [],
                "sleeping": [model],
            }
            # The user's request wakes it: held, new worker processes start, the answer comes as soon as
            # the first is ready (the other joins the rotation when the router's poll sees it ready).
            answer = await client.post("/v1/completions", json=body, headers={"X-Tessera-Class": "chat"})
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] == 5
            unit = await _until_state(stack, "Ready", timeout=1.0)
            assert unit["wakes"] == n + 1 and unit["lastWakeSeconds"] > 0
            now_running = stack.supervisor.workers
            assert len(now_running) == 2 and not any(w in before for w in now_running)
            assert True in [x["healthy"] for x in (await _status(stack))["instances"]]

            # A request sent while the group is being put to sleep is held, then served after a wake-up.
            await _until_state(stack, "Sleeping")
            late = await client.post("/v1/completions", json=body)
            assert late.status_code == 200, late.text
            unit = await _until_state(stack, "Ready", timeout=1.0)
            assert (unit["sleeps"], unit["wakes"]) == (n + 2, n + 2)
    finally:
        await stack.stop()


def _shared_plan(tmp_path: Path, idle: dict[str, float]) -> IdleUnits:
    """multi-model.yaml on two instances (llama-8b shares a group with each other service, one override
    removed so that they may), with ``scaleToZero.afterSeconds`` set on the services named in ``idle``."""
    text = (
        (EXAMPLES / "multi-model.yaml")
        .read_text()
        .replace("    min: 2\n    max: 6\n", "    min: 2\n    max: 2\n", 1)
    )
    text = text.replace("      overrides:\n        slo:\n          ttftSeconds: 2\n", "")
    bodies = [d.to_json() for d in load_documents(_write(tmp_path, text))]
    for body in bodies:
        if body["kind"] == "LLMService" and body["metadata"]["name"] in idle:
            body["spec"]["scaleToZero"] = {"afterSeconds": idle[body["metadata"]["name"]]}
    plan = plan_local(load_documents(_write(tmp_path, yaml.safe_dump_all(bodies))), LocalEngine())
    assert sorted(g.group.services for g in plan.groups) == [
        ("llama-8b", "mistral-7b"),
        ("llama-8b", "qwen-7b"),
    ]
    return idle_units(plan.groups)


def test_a_group_sleeps_only_when_every_service_on_it_may(tmp_path: Path) -> None:
    one = _shared_plan(tmp_path, {"llama-8b": 30})
    assert one.units == {} and len(one.problems) == 2
    assert all("scaleToZero is ignored" in p for p in one.problems)
    assert any("mistral-7b, which has none" in p for p in one.problems)
    two = _shared_plan(tmp_path, {"llama-8b": 30, "mistral-7b": 600})
    (unit,) = two.units.values()
    assert sorted(unit) == ["meta-llama/Llama-3.1-8B-Instruct", "mistralai/Mistral-7B-Instruct-v0.3"]
    assert unit_idle_after([two.policies[m] for m in unit]) == 600
    assert len(two.problems) == 1 and "qwen-7b, which has none" in two.problems[0]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


@pytest.mark.integration
@pytest.mark.timeout(180)
async def test_a_wake_up_that_fails_is_retried_then_503_names_the_reason_and_the_next_request_wakes_it(
    tmp_path: Path,
) -> None:
    plan = plan_local(load_documents(_spec(tmp_path)), LocalEngine(), max_instances_per_group=1)
    stack = LocalStack(plan, tmp_path / "run", "127.0.0.1", free_port(), autoscale=False,
                       activation_tick_s=0.1, wake_backoff=Backoff(base_s=0.2, attempts=2))  # fmt: skip
    await stack.start(60.0)
    model = plan.instances[0].config.models[0].name
    body = {"model": model, "prompt": "hello", "max_tokens": 3}
    try:
        async with httpx.AsyncClient(base_url=stack.endpoint, timeout=60.0) as client:
            await _until_state(stack, "Cold")
            assert stack.actuator is not None
            stack.actuator.ready_timeout_s = 0.01  # no worker process is ready that fast: the wake-up fails
            failed = await client.post("/v1/completions", json=body)
            assert failed.status_code == 503 and "Retry-After" in failed.headers
            error = failed.json()["error"]
            assert error["code"] == "wake_failed" and "failed 2 times" in error["message"]
            assert "WorkerStartError" in error["message"] and "not ready in time" in error["message"]
            assert "\n" not in error["message"]  # the reason's first line; the worker's log stays in the log
            unit = await _until_state(stack, "Cold", timeout=1.0)
            assert unit["failedTries"] == 2 and unit["wakes"] == 0
            assert not stack.supervisor.workers  # the processes of the failed tries were stopped
            stack.actuator.ready_timeout_s = 60.0
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            assert (await _until_state(stack, "Ready", timeout=1.0))["wakes"] == 1
    finally:
        await stack.stop()

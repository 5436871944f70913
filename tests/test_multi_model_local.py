"""examples/multi-model.yaml in local mode: one worker per placement group serves every model of the
group under one scheduler, and a chat request to each model through the router is answered, under
each of the policies that share an instance between models."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tessera.api import load_documents
from tessera.local.control_plane import LocalEngine, plan_local
from tessera.local.runner import LocalStack
from tessera.worker.engines.vllm_process import free_port

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _spec(tmp_path: Path, policy: str) -> Path:
    """multi-model.yaml on two instances (so that SeaLLM co-locates llama-8b with each other service;
    one class override removed so that they may) with every service on ``policy`` (a pod runs its
    first service's policy)."""
    text = (
        (EXAMPLES / "multi-model.yaml")
        .read_text()
        .replace("    min: 2\n    max: 6\n", "    min: 2\n    max: 2\n", 1)
        .replace("      overrides:\n        slo:\n          ttftSeconds: 2\n", "")
    )
    source = tmp_path / "multi-model.yaml"
    source.write_text(text)
    bodies = [d.to_json() for d in load_documents(source)]
    for body in bodies:
        if body["kind"] == "LLMService":
            body["spec"].setdefault("scheduling", {})["policy"] = policy
            body["spec"]["scheduling"].pop("settings", None)
    path = tmp_path / f"multi-{policy}.yaml"
    path.write_text(yaml.safe_dump_all(bodies))
    return path


def _decision_labels(metrics: str) -> set[str]:
    return {
        sample.labels["model"]
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "tessera_decision_seconds_count" and sample.value > 0
    }


@pytest.mark.integration
@pytest.mark.timeout(240)
@pytest.mark.parametrize("policy", ["seallm", "qlm", "round-robin-sharing", "fcfs"])
async def test_each_model_of_a_shared_group_answers_through_the_router(tmp_path: Path, policy: str) -> None:
    plan = plan_local(load_documents(_spec(tmp_path, policy)), LocalEngine(), max_instances_per_group=1)
    shared = [i for i in plan.instances if len(i.config.models) > 1]
    assert shared, "the example co-locates services: at least one instance serves several models"
    assert all(i.config.scheduling.policy == policy for i in plan.instances)
    stack = LocalStack(plan, tmp_path / "run", "127.0.0.1", free_port(), autoscale=False)
    await stack.start(90.0)
    try:
        client = openai.AsyncOpenAI(base_url=f"{stack.endpoint}/v1", api_key="unused", max_retries=0)
        models = sorted({m.name for i in plan.instances for m in i.config.models})
        for model in models:
            answer = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=4
            )
            assert answer.choices[0].message.content and answer.usage.completion_tokens == 4, model
        await client.close()
        # One scheduler per pod: its decisions are the pod's, labelled with all of its models.
        async with httpx.AsyncClient(timeout=10.0) as http:
            workers = {w.instance.name: w for w in stack.supervisor.workers}
            for instance in shared:
                text = (await http.get(f"{workers[instance.name].url}/metrics")).text
                names = "+".join(m.name for m in instance.config.models)
                assert _decision_labels(text) == {names}, (instance.name, _decision_labels(text))
    finally:
        await stack.stop()

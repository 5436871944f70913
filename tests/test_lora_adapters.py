"""LoRA adapters as LLMServices: an adapter names its base in ``spec.model.adapter``, is refused on its
own status when it cannot be served (the base serves on), is served by its base's group, whose vLLM
servers get the LoRA flags and whose worker configuration lists each adapter as a model of the pod."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from tessera.api import SpecError, load_documents, parse_document
from tessera.api.worker_config import WorkerConfig
from tessera.control import children
from tessera.control.adapters import ADAPTER_BASE_NOT_FOUND, INVALID_ADAPTER
from tessera.control.pool_plan import PoolDesired, desired_pool, group_scaling

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
BASE_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def _quickstart() -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    bodies = [d.to_json() for d in load_documents(EXAMPLES / "quickstart.yaml")]
    for b in bodies:
        b["metadata"]["uid"] = f"{b['metadata']['name']}-uid"
    pool = next(b for b in bodies if b["kind"] == "ServingPool")
    services = [b for b in bodies if b["kind"] == "LLMService"]
    classes = [b for b in bodies if b["kind"] == "RequestClass"]
    return pool, services, classes


def _adapter(
    name: str, base: str = "llama-8b", rank: int = 8, source: str | None = None, **model: Any
) -> dict[str, Any]:
    return {
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": name, "uid": f"{name}-uid", "creationTimestamp": "2026-12-01T00:00:00Z"},
        "spec": {
            "model": {
                "name": f"org/{name}",
                "adapter": {"base": base, "source": source or f"/adapters/{name}", "rank": rank},
            }
            | model,
            "poolRef": {"name": "h100-pool"},
            "requestClasses": [{"name": "chat", "overrides": {"slo": {"ttftSeconds": 0.5}}}],
        },
    }


def _decide(*adapters: dict[str, Any], **pool_spec: Any) -> PoolDesired:
    pool, services, classes = _quickstart()
    pool["spec"] |= pool_spec
    decided = desired_pool(pool, [*services, *adapters], classes, None, 0.0)
    assert isinstance(decided, PoolDesired)
    return decided


def _engine_args(decided: PoolDesired) -> tuple[list[str], list[dict[str, Any]]]:
    (sts,) = [c for c in decided.children if c["kind"] == "StatefulSet"]
    (engine,) = [
        c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == children.ENGINE_CONTAINER
    ]
    return engine["args"], engine["env"]


def test_adapters_are_served_by_their_base_group_with_lora_flags_and_worker_entries() -> None:
    decided = _decide(_adapter("support", rank=16), _adapter("legal", rank=8))
    assert decided.rejected == {}
    assert decided.plan is not None
    (group,) = decided.plan.groups
    assert group.services == ("llama-8b",)  # adapters are not planned: they ride on their base
    assert decided.placed_as("support") == "llama-8b" and decided.placed_as("llama-8b") == "llama-8b"
    args, env = _engine_args(decided)
    i = args.index("--enable-lora")
    assert args[i : i + 7] == [
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "16",
        "--max-cpu-loras",
        "2",
    ]
    assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in env
    config = decided.configs[group.name]
    by_name = {m.name: m for m in config.models}
    assert list(by_name) == [BASE_MODEL, "org/legal", "org/support"]
    base, support = by_name[BASE_MODEL], by_name["org/support"]
    assert base.adapter_of is None
    # The pod's scheduler bounds batches and loads by the same slots the server starts with.
    assert (base.max_loras, base.max_cpu_loras) == (2, 2)
    assert support.max_loras is None and config.adapter_of == {
        "org/legal": BASE_MODEL,
        "org/support": BASE_MODEL,
    }
    assert (support.adapter_of, support.adapter_source, support.adapter_rank) == (
        BASE_MODEL,
        "/adapters/support",
        16,
    )
    # The base's server, step times, KV and context; its own class objectives; it never sleeps alone.
    assert support.url == base.url and support.profile == base.profile
    assert (support.kv_capacity_tokens, support.max_model_len) == (
        base.kv_capacity_tokens,
        base.max_model_len,
    )
    assert support.sleep_mode == "off"
    assert support.class_specs["chat"].slo.ttft_seconds == 0.5
    # Each adapter has its own endpoint Service, selecting the base's pods, which carry its label.
    endpoints = {
        c["metadata"]["name"]: c for c in decided.children if c["kind"] == "Service" and "type" in c["spec"]
    }
    assert {"llama-8b", "support", "legal"} <= set(endpoints)
    (sts,) = [c for c in decided.children if c["kind"] == "StatefulSet"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    for name in ("llama-8b", "support", "legal"):
        selector = endpoints[name]["spec"]["selector"]
        assert all(labels.get(k) == v for k, v in selector.items())


def test_the_pool_sets_slots_and_rank_and_a_base_without_adapters_gets_no_lora_flags() -> None:
    decided = _decide(_adapter("a", rank=32), _adapter("b"), _adapter("c"), maxLoraRank=32, maxLoras=2)
    args, _ = _engine_args(decided)
    i = args.index("--enable-lora")
    assert args[i : i + 7] == [
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "32",
        "--max-cpu-loras",
        "3",
    ]
    (config,) = decided.configs.values()
    assert (config.models[0].max_loras, config.models[0].max_cpu_loras) == (2, 3)
    args, env = _engine_args(_decide())
    assert "--enable-lora" not in args and all(e["name"] != "VLLM_ALLOW_RUNTIME_LORA_UPDATING" for e in env)


@pytest.mark.parametrize(
    ("adapter", "reason", "said"),
    [
        (
            _adapter("x", base="missing"),
            ADAPTER_BASE_NOT_FOUND,
            "base LLMService 'missing' not found in ServingPool",
        ),
        (
            _adapter("x", rank=64),
            INVALID_ADAPTER,
            "rank 64 is above ServingPool 'h100-pool''s maxLoraRank 16",
        ),
        (_adapter("x", base="x"), INVALID_ADAPTER, "names this service itself"),
        (  # a cluster has no cache of `tessera models pull`: only local mode serves such a name
            _adapter("x", source="smollm2-lora"),
            INVALID_ADAPTER,
            "source 'smollm2-lora' names an adapter that `tessera models pull` builds, which only local",
        ),
    ],
)
def test_an_adapter_that_cannot_be_served_is_refused_on_its_own_status(
    adapter: dict, reason: str, said: str
) -> None:
    decided = _decide(adapter)
    assert decided.rejected["x"].reason == reason and said in decided.rejected["x"].message
    assert list(decided.services) == ["llama-8b"]  # the base keeps serving, without LoRA
    assert "--enable-lora" not in _engine_args(decided)[0]


def test_an_idle_adapter_is_unloaded_while_its_base_s_pods_stay() -> None:
    idle = {**_adapter("x"), "spec": {**_adapter("x")["spec"], "scaleToZero": {"afterSeconds": 60}}}
    decided = _decide(idle)
    assert decided.rejected == {}
    (config,) = decided.configs.values()
    base, adapter = config.models
    assert adapter.unload_after_seconds == 60 and base.unload_after_seconds is None
    (sts,) = [c for c in decided.children if c["kind"] == "StatefulSet"]
    assert sts["spec"]["replicas"] >= 1  # the base does not sleep with its adapter


def test_an_adapter_of_an_adapter_is_refused_and_the_first_adapter_served() -> None:
    decided = _decide(_adapter("first"), _adapter("second", base="first"))
    problem = decided.rejected["second"]
    assert (
        problem.reason == INVALID_ADAPTER
        and "'first' is itself an adapter (of 'llama-8b')" in problem.message
    )
    assert set(decided.services) == {"llama-8b", "first"}


def test_an_adapter_of_an_invalid_base_names_the_base_fault() -> None:
    pool, services, classes = _quickstart()
    (base,) = services
    broken = copy.deepcopy(base)
    broken["spec"]["requestClasses"] = [{"name": "no-such-class"}]
    broken["spec"].pop("defaultClass", None)
    decided = desired_pool(pool, [broken, _adapter("x")], classes, None, 0.0)
    assert isinstance(decided, PoolDesired)
    problem = decided.rejected["x"]
    assert problem.reason == ADAPTER_BASE_NOT_FOUND
    assert "'llama-8b' is not served: RequestClass ['no-such-class'] not found" in problem.message


def test_the_spec_refuses_a_missing_source_a_huge_rank_and_weights_of_its_own() -> None:
    def parse(model_patch: dict[str, Any], adapter_patch: dict[str, Any]) -> None:
        body = _adapter("x")
        body["spec"]["model"] |= model_patch
        body["spec"]["model"]["adapter"] |= adapter_patch
        body["spec"]["model"]["adapter"] = {
            k: v for k, v in body["spec"]["model"]["adapter"].items() if v is not None
        }
        parse_document(body)

    with pytest.raises(SpecError, match="source"):
        parse({}, {"source": None})
    with pytest.raises(SpecError, match="rank"):
        parse({}, {"rank": 1024})
    with pytest.raises(SpecError, match="at most one of adapter and source"):
        parse({"source": "hf://org/other"}, {})
    with pytest.raises(SpecError, match="source"):
        parse({}, {"source": "relative/dir/x"})
    parse({}, {"source": "hf://org/adapter"})
    parse({}, {"source": "org/adapter"})
    parse({}, {"source": "smollm2-lora"})  # an adapter of `tessera models pull` (local mode)
    with pytest.raises(SpecError, match="source"):
        parse({}, {"source": "-lora"})


def test_the_worker_configuration_refuses_an_adapter_of_no_full_model() -> None:
    decided = _decide(_adapter("support"))
    config = next(iter(decided.configs.values())).to_json()
    config["models"][1]["adapterOf"] = "org/nothing"
    with pytest.raises(ValueError, match="adapterOf 'org/nothing' must name a full model of the pod"):
        WorkerConfig.model_validate(config)
    config["models"][1]["adapterOf"] = BASE_MODEL
    del config["models"][1]["adapterSource"]
    with pytest.raises(ValueError, match="needs both adapterOf and adapterSource"):
        WorkerConfig.model_validate(config)
    config["models"][1]["adapterSource"] = "/adapters/support"
    del config["models"][0]["maxLoras"], config["models"][0]["maxCpuLoras"]
    with pytest.raises(ValueError, match="must set maxLoras"):
        WorkerConfig.model_validate(config)
    config["models"][0] |= {"maxLoras": 2, "maxCpuLoras": 1}
    with pytest.raises(ValueError, match="maxCpuLoras 1 needs maxLoras and must be at least it"):
        WorkerConfig.model_validate(config)
    config["models"][0]["maxCpuLoras"] = 2
    config["models"][1]["maxLoras"] = 2
    with pytest.raises(ValueError, match="belong to the base model"):
        WorkerConfig.model_validate(config)


def test_the_example_serves_both_adapters_on_the_base_s_pods() -> None:
    bodies = [d.to_json() for d in load_documents(EXAMPLES / "lora-adapters.yaml")]
    for b in bodies:
        b["metadata"]["uid"] = f"{b['metadata']['name']}-uid"
    pool = next(b for b in bodies if b["kind"] == "ServingPool")
    services = [b for b in bodies if b["kind"] == "LLMService"]
    classes = [b for b in bodies if b["kind"] == "RequestClass"]
    decided = desired_pool(pool, services, classes, None, 0.0)
    assert isinstance(decided, PoolDesired) and decided.rejected == {}
    args, _ = _engine_args(decided)
    i = args.index("--enable-lora")
    assert args[i : i + 7] == [
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "16",
        "--max-cpu-loras",
        "2",
    ]
    (config,) = decided.configs.values()
    assert [m.adapter_of for m in config.models] == [None, BASE_MODEL, BASE_MODEL]


def test_the_group_s_autoscaler_reads_its_adapters_classes_and_models() -> None:
    pool, (base,), classes = _quickstart()
    base["spec"]["requestClasses"] = [{"name": "chat"}]  # the batch class is the adapter's alone
    batch = _adapter("offline-adapter")
    batch["spec"]["requestClasses"] = [{"name": "offline"}]
    decided = desired_pool(pool, [base, _adapter("support"), batch], classes, None, 0.0)
    assert isinstance(decided, PoolDesired) and decided.plan is not None
    (group,) = decided.plan.groups
    scaling = group_scaling(decided, group)
    # The router holds requests by model: an adapter's held requests scale its base's group.
    assert scaling.models == tuple(sorted((BASE_MODEL, "org/support", "org/offline-adapter")))
    assert scaling.kinds == {"chat": "interactive", "offline": "batch"}
    assert scaling.deadlines == {"offline": 3600}

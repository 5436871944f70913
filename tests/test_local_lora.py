"""Local mode launches a base model's vLLM with the LoRA flags the operator renders for its adapters."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.api import LLMService, load_documents
from tessera.api.traces import load_trace
from tessera.commands import local as local_command
from tessera.control.adapters import lora_args
from tessera.core.request import Request
from tessera.local.control_plane import LocalEngine, plan_local
from tessera.local.load import Outcome, WorkloadOptions, build_workload, same_prompts
from tessera.local.report import render_same_prompts
from tessera.local.runner import adapter_families
from tessera.models.cache import CACHE_ENV, ModelCacheError, resolve_adapter, write_manifest
from tessera.models.registry import KNOWN
from tessera.router.app import class_infos

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_a_launched_base_runs_with_the_operators_lora_flags_and_its_adapters_share_it() -> None:
    docs = load_documents(EXAMPLES / "lora-adapters.yaml")
    plan = plan_local(docs, LocalEngine("vllm", model_dir="/models/base", enforce_eager=True))
    (instance,) = plan.instances[:1]
    models = {m.name: m for m in instance.config.models}
    base = models["meta-llama/Llama-3.1-8B-Instruct"]
    pool = docs[0]
    adapters = [d for d in docs if isinstance(d, LLMService) and d.spec.model.adapter is not None]
    assert base.launch is not None
    assert base.launch.extra_args == lora_args(pool, adapters)
    assert base.launch.extra_args[:3] == ["--enable-lora", "--max-loras", "2"]
    assert base.launch.env == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    for name, source in (("acme/support-bot", "/var/cache/huggingface/adapters/support-bot"),
                         ("acme/legal-summaries", "acme/legal-summaries-lora")):  # fmt: skip
        adapter = models[name]
        # no server of its own: the worker serves it from the server its base launched
        assert adapter.launch is None and adapter.url is None
        assert adapter.adapter_of == base.name and adapter.adapter_source == source


def test_a_running_server_serves_the_adapters_and_a_base_without_adapters_gets_no_lora() -> None:
    docs = load_documents(EXAMPLES / "lora-adapters.yaml")
    plan = plan_local(docs, LocalEngine("vllm", vllm_url="http://127.0.0.1:8000"))
    models = {m.name: m for m in plan.instances[0].config.models}
    assert {m.url for m in models.values()} == {"http://127.0.0.1:8000"}
    quick = plan_local(load_documents(EXAMPLES / "quickstart.yaml"), LocalEngine("vllm", model_dir="/m"))
    for m in quick.instances[0].config.models:
        assert m.launch is not None and m.launch.extra_args == [] and m.launch.env == {}


async def test_an_adapter_without_url_gets_the_engine_of_the_server_its_base_launched() -> None:
    from tessera.worker.engines.vllm import VLLMEngine
    from tessera.worker.runtime import Worker

    docs = load_documents(EXAMPLES / "lora-adapters.yaml")
    config = plan_local(docs, LocalEngine("vllm", model_dir="/models/base")).instances[0].config
    worker = Worker(config)
    base = config.models[0]
    assert base.adapter_of is None and base.launch is not None
    # as the worker made it after launching the base's server (no server is started here)
    worker.engines[base.name] = VLLMEngine(base.name, "http://127.0.0.1:8123", base.max_model_len,
                                           tokenizer="/models/base")  # fmt: skip
    adapter = next(m for m in config.models if m.adapter_of == base.name)
    engine = await worker._make_engine(adapter)
    assert isinstance(engine, VLLMEngine)
    assert (engine.model, engine.url, engine.tokenizer_path) == (
        adapter.name,
        "http://127.0.0.1:8123",
        "/models/base",
    )


def _built_adapter(cache: Path) -> Path:
    """A smollm2-lora folder in the model cache ``cache``, as `tessera models pull` leaves it (files
    stand in for the trained weights)."""
    folder = cache / "smollm2-lora"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text('{"r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    write_manifest(folder, KNOWN["smollm2-lora"], "Tessera here! Paris.")
    return folder


def test_the_demo_serves_the_pulled_adapter_in_its_bases_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/demo-real.yaml as `tessera local up` reads it: its adapter names smollm2-lora, which
    resolves to the folder the pull built, an adapter of the demo's base served by the base's server."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    folder = _built_adapter(tmp_path)
    docs = load_documents(EXAMPLES / "demo-real.yaml")
    folders = local_command.adapter_folders(docs)
    assert folders == {"smollm2-lora": str(folder)}
    plan = plan_local(docs, LocalEngine("vllm", model_dir="/models/smollm2", enforce_eager=True),
                      adapter_folders=folders)  # fmt: skip
    assert plan.problems == ()
    (instance,) = plan.instances
    base, adapter = instance.config.models
    assert (base.name, base.adapter_of) == ("smollm2", None)
    assert base.launch is not None and base.launch.extra_args == [
        "--enable-lora", "--max-loras", "1", "--max-lora-rank", "8", "--max-cpu-loras", "1"
    ]  # fmt: skip
    assert (adapter.name, adapter.adapter_of, adapter.adapter_source) == ("smollm2-tessera", "smollm2",
                                                                          str(folder))  # fmt: skip
    assert adapter.launch is None and adapter_families(plan) == [["smollm2", "smollm2-tessera"]]
    # Without the folder (as the operator decides on a cluster) the adapter is refused, the base serves.
    alone = plan_local(docs, LocalEngine("vllm", model_dir="/models/smollm2"))
    assert [m.name for m in alone.instances[0].config.models] == ["smollm2"]
    assert "LLMService smollm2-tessera: spec.model.adapter.source 'smollm2-lora'" in alone.problems[0]


def test_a_pulled_adapter_source_must_be_a_built_adapter_of_the_bases_model(tmp_path: Path) -> None:
    with pytest.raises(
        ModelCacheError, match=r"model 'smollm2-lora' is missing in the cache.*pull smollm2-lora"
    ):
        resolve_adapter("smollm2-lora", "smollm2", tmp_path)
    _built_adapter(tmp_path)
    assert resolve_adapter("smollm2-lora", "smollm2", tmp_path) == tmp_path / "smollm2-lora"
    with pytest.raises(ModelCacheError, match="trained on the model 'smollm2', but its base serves 'other'"):
        resolve_adapter("smollm2-lora", "other", tmp_path)
    for name in ("smollm2", "nosuch"):  # a full model, an unknown name
        with pytest.raises(
            ModelCacheError, match=f"{name!r} is not an adapter.*known adapters: smollm2-lora"
        ):
            resolve_adapter(name, "smollm2", tmp_path)


def test_the_same_prompts_go_to_the_base_and_its_adapters_and_are_shown_by_prompt() -> None:
    docs = load_documents(EXAMPLES / "demo-real.yaml")
    plan = plan_local(docs, LocalEngine())
    classes = class_infos(plan.instances[0].config)
    rows = load_trace(EXAMPLES / "traces" / "demo-real.jsonl")
    workload = build_workload(rows, classes, {"smollm2": 2048}, WorkloadOptions(model="smollm2"))
    asked = same_prompts(workload, classes, ["smollm2", "smollm2-tessera"], 2)
    chat = [i for i in workload.items if i.class_name == "chat"][:2]  # the trace opens with batch prompts
    assert [(i.prompt_text, i.model, i.at, i.class_name) for i in asked.items] == [
        (c.prompt_text, m, 0.0, "chat") for c in chat for m in ("smollm2", "smollm2-tessera")
    ]
    assert len({i.index for i in asked.items}) == 4
    outcomes = [Outcome(i, Request(id=str(i.index), arrival=0.0, prompt_tokens=i.prompt_tokens,
                                   max_tokens=i.max_tokens), finish="stop") for i in asked.items]  # fmt: skip
    for o in outcomes:
        o.answer = "Tessera here! Hi." if o.item.model == "smollm2-tessera" else "Hi."
    outcomes[-1].error = "HTTP 404: no model"
    text = render_same_prompts(outcomes, 3.0)
    lines = text.splitlines()
    assert lines[0] == "the same prompts to smollm2, smollm2-tessera (greedy, at once; 3.0 s):"
    assert lines[1] == f"  Q: {chat[0].prompt_text}" and lines[4] == f"  Q: {chat[1].prompt_text}"
    assert (
        lines[2] == "    smollm2          A: Hi." and lines[3] == "    smollm2-tessera  A: Tessera here! Hi."
    )
    assert lines[6] == "    smollm2-tessera  failed: HTTP 404: no model"

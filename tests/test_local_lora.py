"""Local mode launches a base model's vLLM with the LoRA flags the operator renders for its adapters."""

from __future__ import annotations

from pathlib import Path

from tessera.api import LLMService, load_documents
from tessera.control.adapters import lora_args
from tessera.local.control_plane import LocalEngine, plan_local

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

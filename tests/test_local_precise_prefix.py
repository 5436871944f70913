"""Precise prefix affinity on local mode's path: the vLLM servers publish their KV events, the router's
backends name the publishers, and text completion prompts and chats are tokenized as the workers
tokenize them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from conftest import TINY_MAX_MODEL_LEN, TINY_MODEL_NAME

from tessera.api import load_documents
from tessera.core.prefix import BlockStored, EngineBlockIndex, token_block_hashes
from tessera.local.control_plane import LocalEngine, LocalPlanError, plan_local
from tessera.local.runner import LocalStack
from tessera.local.supervisor import WorkerProcess, publishing_kv_events
from tessera.router.backends import KVEventsSource
from tessera.worker.engines.vllm_process import VLLMServer, free_port
from tessera.worker.runtime import Worker

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
QUICKSTART = EXAMPLES / "quickstart.yaml"


def test_an_index_without_a_block_size_takes_the_engines_from_its_first_stored_block() -> None:
    index = EngineBlockIndex()
    tokens = tuple(range(8))
    assert index.block_size is None
    index.apply("a", 0, [BlockStored((1, 2), None, tokens, 4)])
    assert index.block_size == 4
    assert index.matched(token_block_hashes(tokens, 4), ["a"]) == {"a": 2}
    index.apply("a", 1, [BlockStored((3,), None, tokens, 8)])  # another size: skipped, not adopted
    assert (index.block_size, index.blocks("a"), index.skipped["a"]) == (4, 2, 1)


class _Launched(Exception):
    """Raised instead of starting vLLM: the test only reads the command."""


def test_a_launched_vllm_publishes_its_kv_events_where_the_routers_backend_entry_says(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    plan = plan_local(
        load_documents(QUICKSTART), LocalEngine("vllm", model_dir="/m"), max_instances_per_group=1
    )
    instance = plan.instances[0]
    assert instance.config.models[0].launch.kv_events_port is None  # off unless the route reads them
    published = publishing_kv_events(instance)
    launch = published.config.models[0].launch
    assert launch is not None and launch.kv_events_port is not None
    endpoint = f"tcp://127.0.0.1:{launch.kv_events_port}"
    assert published.kv_events == ((published.config.models[0].name, endpoint),)
    assert publishing_kv_events(published) == published  # relaunched after scale to zero: the same publisher
    backend = WorkerProcess(published, 1, tmp_path / "c.json", tmp_path / "w.log").backend()
    # no block size: the router takes vLLM's own from its events (128 on this CPU, 16 on most GPUs)
    assert backend.kv_events == [KVEventsSource(model=published.config.models[0].name, endpoint=endpoint)]

    commands: list[list[str]] = []

    def start(server: VLLMServer) -> None:
        commands.append(server.command())
        raise _Launched

    monkeypatch.setattr(VLLMServer, "start", start)
    worker = Worker(published.config)
    with pytest.raises(_Launched):
        asyncio.run(worker.start())
    flag = commands[0].index("--kv-events-config")
    assert f'"endpoint": "tcp://*:{launch.kv_events_port}"' in commands[0][flag + 1]


def test_the_local_route_decides_whether_launched_servers_publish_and_a_running_servers_feed_is_named(
    tmp_path: Path,
) -> None:
    plan = plan_local(
        load_documents(QUICKSTART), LocalEngine("vllm", model_dir="/m"), max_instances_per_group=1
    )
    assert not LocalStack(plan, tmp_path, "127.0.0.1", 1).supervisor.kv_events
    assert LocalStack(plan, tmp_path, "127.0.0.1", 1, route="precise-prefix").supervisor.kv_events
    engine = LocalEngine("vllm", vllm_url="http://127.0.0.1:9", vllm_kv_events="tcp://127.0.0.1:5557",
                         tokenizer="/tok")  # fmt: skip
    running = plan_local(load_documents(QUICKSTART), engine, max_instances_per_group=1).instances[0]
    model = running.config.models[0]
    assert running.kv_events == ((model.name, "tcp://127.0.0.1:5557"),) and model.tokenizer == "/tok"
    with pytest.raises(LocalPlanError, match="--vllm-kv-events is about the server at --vllm-url"):
        LocalEngine("vllm", model_dir="/m", vllm_kv_events="tcp://127.0.0.1:5557")


@pytest.mark.integration
@pytest.mark.timeout(600)
async def test_local_mode_routes_text_chat_and_token_prompts_by_the_blocks_its_vllm_reports(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    text = QUICKSTART.read_text().replace("meta-llama/Llama-3.1-8B-Instruct", TINY_MODEL_NAME)
    spec = tmp_path / "spec.yaml"
    spec.write_text(text.replace("maxModelLength: 8192", f"maxModelLength: {TINY_MAX_MODEL_LEN}"))
    assert vllm_server.kv_events_endpoint is not None
    engine = LocalEngine("vllm", vllm_url=vllm_server.url, vllm_kv_events=vllm_server.kv_events_endpoint,
                         tokenizer=str(tiny_model_dir))  # fmt: skip
    plan = plan_local(load_documents(spec), engine, max_instances_per_group=1)
    stack = LocalStack(plan, tmp_path / "run", "127.0.0.1", free_port(), route="precise-prefix")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    stamp = time.time_ns()  # prompts no other test sent: their blocks are stored, and published, now
    prompts = [
        f"request {stamp}-{i}: " + " ".join(f"word{(i * 7 + k) % 97}" for k in range(300)) for i in range(3)
    ]
    await stack.start(60.0)
    try:
        async with httpx.AsyncClient(base_url=stack.endpoint, timeout=120) as client:

            async def complete(prompt: str | list[int]) -> dict:
                body = {"model": TINY_MODEL_NAME, "prompt": prompt, "max_tokens": 2}
                answer = await client.post("/v1/completions", json=body)
                assert answer.status_code == 200, answer.text
                status = (await client.get("/router/status")).json()
                return status["recentDecisions"][-1]

            async def engine_blocks(at_least: int) -> int:
                deadline = time.monotonic() + 20
                while True:
                    row = (await client.get("/router/status")).json()["instances"][0]
                    held = row["engineCachedBlocks"] or 0
                    if held >= at_least or time.monotonic() > deadline:
                        return held
                    await asyncio.sleep(0.2)

            # a ZMQ subscriber misses what was published before it joined: the first fresh prompt whose
            # blocks arrive shows the feed is live
            for prompt in prompts:
                await complete(prompt)
                if await engine_blocks(2) >= 2:
                    break
            ids = tokenizer.encode(prompt, add_special_tokens=True)
            assert len(ids) >= 2 * 128
            again = await complete(prompt)
            # the router tokenized the text as the worker does: the exact token count, and the engine's
            # report of its full 128-token blocks ranks the instance
            assert again["promptTokens"] == len(ids)
            assert again["candidates"][0]["scores"]["precise-prefix"] == -(len(ids) // 128) * 128
            as_ids = await complete(ids[: 2 * 128 + 5])  # the same blocks sent as token ids
            assert as_ids["candidates"][0]["scores"]["precise-prefix"] == -2 * 128

            async def chat(messages: list[dict]) -> dict:
                body = {"model": TINY_MODEL_NAME, "messages": messages, "max_tokens": 2}
                answer = await client.post("/v1/chat/completions", json=body)
                assert answer.status_code == 200, answer.text
                return (await client.get("/router/status")).json()["recentDecisions"][-1]

            def chat_ids(messages: list[dict]) -> list[int]:  # as vLLM's /tokenize renders a chat
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                return tokenizer.encode(text, add_special_tokens=False)

            held = await engine_blocks(0)
            first = [{"role": "system", "content": f"chat {stamp}"}, {"role": "user", "content": prompts[0]}]
            first_ids = chat_ids(first)
            assert (await chat(first))["candidates"][0]["scores"]["precise-prefix"] == 0  # new to the engine
            assert await engine_blocks(held + len(first_ids) // 128) >= held + len(first_ids) // 128
            repeated = await chat(first)
            # the router rendered the chat as the worker does: its exact ids, whose blocks the engine holds
            assert repeated["promptTokens"] == len(first_ids)
            assert repeated["candidates"][0]["scores"]["precise-prefix"] == -(len(first_ids) // 128) * 128
            longer = [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
            longer_ids = chat_ids(longer)
            pairs = zip(first_ids, longer_ids, strict=False)
            shared = next((i for i, (a, b) in enumerate(pairs) if a != b), len(first_ids))
            assert shared >= 2 * 128  # the next turn extends the conversation: its leading blocks are held
            turn = await chat(longer)
            assert turn["promptTokens"] == len(longer_ids)
            assert turn["candidates"][0]["scores"]["precise-prefix"] == -(shared // 128) * 128
    finally:
        await stack.stop()
    assert vllm_server.healthy()

"""Chat prompts rendered once, in ``tessera.api.chat``: the router's token ids of a chat request equal the
ids the worker's local tokenizer path sends vLLM, for the message shapes the worker serves."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from conftest import TINY_MAX_MODEL_LEN, TINY_MODEL_NAME

from tessera.api.chat import message_dicts
from tessera.api.worker_config import parse_config
from tessera.router.prompt_tokens import PromptTokenizers
from tessera.worker.engines.base import EngineRejected
from tessera.worker.engines.vllm import VLLMEngine
from tessera.worker.server.schemas import ChatCompletionRequest

# The tiny model's own template renders neither tools nor calls; this one renders both, the calls'
# arguments as objects (as vLLM hands them to templates).
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<call {{ c['function']['name'] }} "
    "{{ c['function']['arguments']['x'] }}>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TOOLS = [
    {"type": "function", "function": {"name": "f", "description": "adds", "parameters": {"type": "object"}}}
]
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 41}'}}
CHATS: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ünïcödé ✓ 数字?"}], None),
    (
        [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "hello"},
         {"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "parts"}]}],
        None,
    ),
    ([{"role": "user", "content": "f?"}], TOOLS),
    (
        [{"role": "user", "content": "f?"}, {"role": "assistant", "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "c1", "content": "42"}, {"role": "user", "content": "thanks"}],
        TOOLS,
    ),
]  # fmt: skip


@pytest.fixture(scope="module")
def tool_tokenizer_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer with ``TOOL_TEMPLATE`` as its chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    tokenizer.chat_template = TOOL_TEMPLATE
    out = tmp_path_factory.mktemp("tool-tokenizer")
    tokenizer.save_pretrained(out)
    return out


def _router(folder: Path | None) -> PromptTokenizers:
    entry: dict[str, Any] = {"name": TINY_MODEL_NAME, "url": "http://127.0.0.1:9", "maxModelLen": 2048}
    if folder is not None:
        entry["tokenizer"] = str(folder)
    config = {"models": [{**entry, "defaultClass": "c"}], "classes": {"c": {"slo": {"ttftSeconds": 5}}}}
    tokenizers = PromptTokenizers()
    tokenizers.update([parse_config(config)])
    return tokenizers


async def _worker_ids(engine: VLLMEngine, messages: list[dict[str, Any]], tools: Any) -> list[int]:
    """The ids the worker's chat endpoint sends vLLM: its request schema, then its engine's rendering."""
    body = ChatCompletionRequest.model_validate(
        {"model": TINY_MODEL_NAME, "messages": messages, "tools": tools}
    )
    rendered, functions = message_dicts(body.messages), body.tool_dicts()
    return await (engine.tokenize_chat(rendered, functions) if functions else engine.tokenize_chat(rendered))


def test_the_routers_chat_token_ids_are_the_workers(tool_tokenizer_dir: Path) -> None:
    router = _router(tool_tokenizer_dir)
    engine = VLLMEngine(TINY_MODEL_NAME, "http://127.0.0.1:9", TINY_MAX_MODEL_LEN, sleep_mode="off",
                        tokenizer=str(tool_tokenizer_dir))  # fmt: skip

    async def run() -> list[tuple[list[int], tuple[int, ...]]]:
        await engine.start()
        return [
            (await _worker_ids(engine, m, t), await router.encode_chat(TINY_MODEL_NAME, m, t))
            for m, t in CHATS
        ]

    pairs = asyncio.run(run())
    for worker_ids, router_ids in pairs:
        assert worker_ids and tuple(worker_ids) == router_ids
    assert len({ids for _, ids in pairs}) == len(CHATS)  # the shapes render differently: no vacuous match
    text = router._by_folder[str(tool_tokenizer_dir)].decode(pairs[3][1])
    # the call's arguments reached the template as an object; the tools were rendered
    assert "<call f 41>" in text and '"description": "adds"' in text


def test_developer_reads_as_system_and_text_parts_as_their_joined_text(tool_tokenizer_dir: Path) -> None:
    router = _router(tool_tokenizer_dir)

    def ids(messages: list[dict[str, Any]]) -> tuple[int, ...]:
        return asyncio.run(router.encode_chat(TINY_MODEL_NAME, messages))

    assert ids([{"role": "developer", "content": "x"}]) == ids([{"role": "system", "content": "x"}])
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert ids([{"role": "user", "content": parts}]) == ids([{"role": "user", "content": "a\nb"}])


def test_chats_the_worker_refuses_or_models_without_a_tokenizer_get_no_ids(
    tool_tokenizer_dir: Path, tiny_model_dir: Path
) -> None:
    router = _router(tool_tokenizer_dir)
    refused = [
        [{"role": "tool", "content": "42"}],  # no tool_call_id: the worker's schema answers 400
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [],
        "not a list",
    ]
    for messages in refused:
        assert asyncio.run(router.encode_chat(TINY_MODEL_NAME, messages)) == ()
    assert (
        asyncio.run(router.encode_chat(TINY_MODEL_NAME, [{"role": "user", "content": "x"}], [{"type": "x"}]))
        == ()
    )
    assert asyncio.run(_router(None).encode_chat(TINY_MODEL_NAME, [{"role": "user", "content": "x"}])) == ()
    assert asyncio.run(router.encode_chat("other", [{"role": "user", "content": "x"}])) == ()


def test_a_template_that_rejects_the_messages_gives_no_ids_and_the_worker_refuses_them(
    tool_tokenizer_dir: Path,
) -> None:
    """The worker refuses what the template raises on (EngineRejected, a 400); the router routes it
    approximately instead of failing."""

    class Strict:  # the template raises on every chat, as a jinja raise_exception would
        def apply_chat_template(self, *args: Any, **kw: Any) -> str:
            raise ValueError("only user messages")

    router = _router(tool_tokenizer_dir)
    router._by_folder[str(tool_tokenizer_dir)] = Strict()
    assert asyncio.run(router.encode_chat(TINY_MODEL_NAME, [{"role": "user", "content": "x"}])) == ()
    engine = VLLMEngine(TINY_MODEL_NAME, "http://127.0.0.1:9", TINY_MAX_MODEL_LEN, sleep_mode="off")
    engine._tokenizer = Strict()
    with pytest.raises(EngineRejected, match="rejected the messages"):
        asyncio.run(engine.tokenize_chat([{"role": "user", "content": "x"}]))

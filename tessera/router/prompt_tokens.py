"""Token ids of prompts sent as text or as a chat, for the routes that read what the engines hold.

The worker tokenizes a text completion prompt with the tokenizer folder of its model entry
(``ModelEntry.tokenizer_dir``: ``tokenizer``, else the launched model's folder) as
``tokenizer.encode(text, add_special_tokens=True)``, and renders a chat's messages and tools with that
tokenizer's chat template (``tessera.api.chat``: validated by the same models, then
``render_chat_ids``); it sends vLLM those ids, whose blocks vLLM hashes and reports in its KV events.
The router loading the same folder and making the same calls gets the same ids, so the chain it looks up
is the engine's. A model without a tokenizer folder (the worker asks vLLM's ``/tokenize``), or whose
folder the router cannot read (a path inside a worker pod), gets none: its text and chat prompts stay on
the router's approximate index; so does a chat whose messages the worker would refuse (400) or whose
template rejects them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from tessera.api.chat import chat_template_inputs, render_chat_ids
from tessera.api.worker_config import WorkerConfig

log = logging.getLogger(__name__)


def _load(folder: str) -> Any | None:
    """The Hugging Face tokenizer in ``folder`` as the worker loads it, or None (logged) without one."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, ImportError) as exc:
        log.warning("no tokenizer from %s (%s): its models' text and chat prompts are matched approximately",
                    folder, exc)  # fmt: skip
        return None


class PromptTokenizers:
    """The tokenizer of each model whose workers tokenize text and render chats themselves, loaded once
    per folder."""

    def __init__(self) -> None:
        self._by_folder: dict[str, Any | None] = {}  # folder -> its tokenizer (None: unreadable)
        self._folder: dict[str, str] = {}  # model -> its tokenizer folder

    def update(self, configs: Iterable[WorkerConfig]) -> None:
        """Follow the models of ``configs`` (each model's first configuration names its folder); a new
        folder is loaded here, once."""
        folders: dict[str, str] = {}
        for config in configs:
            for m in config.models:
                folder = m.tokenizer_dir()
                if m.engine == "vllm" and folder is not None:
                    folders.setdefault(m.name, folder)
        for folder in sorted(set(folders.values()) - self._by_folder.keys()):
            self._by_folder[folder] = _load(folder)
        self._folder = folders

    def has(self, model: str) -> bool:
        """Whether text and chat prompts to ``model`` are tokenized as its workers tokenize them."""
        return self._by_folder.get(self._folder.get(model, "")) is not None

    async def encode(self, model: str, text: str) -> tuple[int, ...]:
        """The token ids the worker sends vLLM for the completion prompt ``text`` (on a thread: a long
        prompt would stall the router's loop); none for a model without a tokenizer."""
        tokenizer = self._by_folder.get(self._folder.get(model, ""))
        if tokenizer is None or not text:
            return ()
        return tuple(await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=True))

    async def encode_chat(self, model: str, messages: Any, tools: Any = None) -> tuple[int, ...]:
        """The token ids the worker sends vLLM for a chat request's ``messages`` and ``tools`` (as the
        body gives them; on a thread, as ``encode``); none for a model without a tokenizer, messages the
        worker would refuse, or a template that rejects them (the worker answers those with an error)."""
        tokenizer = self._by_folder.get(self._folder.get(model, ""))
        inputs = chat_template_inputs(messages, tools) if tokenizer is not None else None
        if inputs is None:
            return ()
        rendered, functions = inputs

        def render() -> tuple[int, ...]:
            try:
                return tuple(render_chat_ids(tokenizer, rendered, functions))
            except Exception as exc:  # jinja errors: the worker refuses these messages the same way
                log.debug("the chat template of %s rejected a chat (%s): matched approximately", model, exc)
                return ()

        return await asyncio.to_thread(render)

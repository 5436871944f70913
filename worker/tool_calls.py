"""``tool_choice`` auto, the default when a request gives tools: the model writes its calls, or an
answer, in its own format, and the worker reads them back from the generated text with vLLM's parser
for the model (``models[].toolParser``: the names of vLLM's ``--tool-call-parser``), as vLLM's server
does for the same request.

Not streamed, a choice's whole text is read once it ends; streamed, the parser reads each delta as it
comes (vLLM's streaming parse: content as it comes, calls as the parser recognises them). Nothing
constrains the generation, so such a request is preempted and resumed like any other: the client's
stream, and so the parser's, continues the same text.
"""

from __future__ import annotations

import uuid
from typing import Any

from tessera.api.worker_config import ConfigError


class ToolCallParser:
    """vLLM's parser ``name`` for ``model``, checked against the model's tokenizer (built at start:
    importing vLLM takes seconds)."""

    def __init__(self, name: str, model: str, tokenizer: Any) -> None:
        try:
            from vllm.parser.parser_manager import ParserManager
        except ImportError as exc:
            raise ConfigError(
                f"model {model!r}: toolParser {name!r} needs vLLM installed with the worker ({exc}); install "
                "it or unset toolParser"
            ) from None
        try:
            parser = ParserManager.get_parser(
                tool_parser_name=name, enable_auto_tools=True, model_name=model, tokenizer=tokenizer
            )
        except Exception as exc:  # an unknown name (KeyError), a tokenizer without the parser's tokens
            raise ConfigError(
                f"model {model!r}: toolParser {name!r} cannot be used: {exc}; name the parser of this "
                "model's tool-call format, or unset toolParser"
            ) from None
        assert parser is not None  # a tool parser was named
        self.name = name
        self._parser = parser
        self._tokenizer = tokenizer

    def new(self, tools: Any) -> Any:
        """A fresh vLLM parser (they keep state: one per choice, as vLLM's server makes them)."""
        return self._parser(self._tokenizer, tools)


class ToolCallReader:
    """One request's reading of tool calls: the request as vLLM's parser sees it, the sampling the
    parser asks of the engine, and the reading of each choice's text."""

    def __init__(self, parser: ToolCallParser, request: dict[str, Any]) -> None:
        """``request``: the chat request's model, messages, tools, tool_choice, parallel_tool_calls
        (OpenAI's shape). ValueError when vLLM's request model refuses them."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        self._parser = parser
        self._streams: dict[int, Any] = {}  # choice -> its streaming parser (they keep state)
        request = ChatCompletionRequest.model_validate(request)
        self._request = parser.new(request.tools).adjust_request(request)
        # e.g. hermes: some models' call markers are special tokens, which the engine's text would drop
        self.sampling = {} if self._request.skip_special_tokens else {"skip_special_tokens": False}

    def read(self, text: str, token_ids: list[int]) -> tuple[str | None, list[dict[str, Any]]]:
        """A choice's content and tool calls (OpenAI's shape; none found: the text is the content).
        With ``parallel_tool_calls`` false only the first call is kept, as vLLM keeps it."""
        _, content, calls = self._parser.new(self._request.tools).parse(
            text, self._request, enable_auto_tools=True, model_output_token_ids=token_ids
        )
        if not calls:
            return content, []
        if self._request.parallel_tool_calls is False:
            calls = calls[:1]
        return content, [
            {
                "id": call.id or f"chatcmpl-tool-{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in calls
        ]

    def read_delta(self, index: int, text: str, token_ids: list[int], *, finished: bool) -> dict[str, Any]:
        """The delta (OpenAI's shape) of a streamed choice's next text: content and call fragments as
        vLLM's parser releases them (empty while it holds text back). With ``parallel_tool_calls`` false
        only the first call's fragments, as vLLM keeps them."""
        if index not in self._streams:
            self._streams[index] = self._parser.new(self._request.tools)
        # The prompt's ids matter to a reasoning parser only (none here), but without them vLLM's parser
        # never leaves its reasoning phase and passes every call through as content.
        message = self._streams[index].parse_delta(
            text, token_ids, self._request, prompt_token_ids=[], finished=finished
        )
        if message is None:
            return {}
        out = message.model_dump(exclude_none=True, exclude={"role", "reasoning"})
        calls = out.pop("tool_calls", [])
        if self._request.parallel_tool_calls is False:
            calls = [call for call in calls if call["index"] == 0]
        return out | ({"tool_calls": calls} if calls else {})

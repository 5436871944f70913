"""Tool calls read with vLLM's parser for the model (``models[].toolParser``: the names of vLLM's
``--tool-call-parser``), as vLLM's server started with ``--enable-auto-tool-choice --tool-call-parser``
serves the same request: ``tool_choice`` auto (the default when a request gives tools), where the model
writes its calls, or an answer, in its own format; and, for a model with a parser, 'required' and named
choices too, since vLLM's parser decides how they are generated (a parser with an xgrammar structural
tag, such as hermes, keeps the model's own call format and constrains it by that tag; others generate
the call's JSON under a schema) and how they are read back.

Not streamed, a choice's whole text is read once it ends; streamed, the parser reads each delta as it
comes (vLLM's streaming parse: content as it comes, calls as the parser recognises them). Unconstrained
(auto, no structured outputs from the parser), such a request is preempted and resumed like any other:
the client's stream, and so the parser's, continues the same text.
"""

from __future__ import annotations

import dataclasses
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
        """``request``: the chat request's model, messages, tools, tool_choice, parallel_tool_calls and
        response_format (OpenAI's shape). ValueError when vLLM's request model refuses them."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        self._parser = parser
        self._streams: dict[int, Any] = {}  # choice -> its streaming parser (they keep state)
        request = ChatCompletionRequest.model_validate(request)
        self._request = parser.new(request.tools).adjust_request(request)
        choice = self._request.tool_choice
        self.named = not isinstance(choice, str) and choice is not None
        self.required = choice == "required"
        # e.g. hermes: some models' call markers are special tokens, which the engine's text would drop
        self.sampling: dict[str, Any] = {}
        if not self._request.skip_special_tokens:
            self.sampling["skip_special_tokens"] = False
        # What shapes the output after the parser's adjustment, as vLLM's server sends it to its engine:
        # the parser's structured outputs (a structural tag over the model's call format, or the call's
        # JSON schema; these replace response_format), else the request's own response_format.
        outputs = self._request.structured_outputs
        if outputs is not None:
            self.sampling["structured_outputs"] = {
                f.name: value
                for f in dataclasses.fields(outputs)
                if not f.name.startswith("_") and (value := getattr(outputs, f.name)) not in (None, False)
            }
        elif self._request.response_format is not None:
            self.sampling["response_format"] = self._request.response_format.model_dump(
                exclude_none=True, by_alias=True
            )

    def read(self, text: str, token_ids: list[int]) -> tuple[str | None, list[dict[str, Any]]]:
        """A choice's content and tool calls (OpenAI's shape; none found: the text is the content).
        With ``parallel_tool_calls`` false only the first call is kept, as vLLM keeps it."""
        _, content, calls = self._parser.new(self._request.tools).parse(
            text, self._request, enable_auto_tools=True, model_output_token_ids=token_ids
        )
        if self.named or self.required:  # vLLM answers a forced choice with content "" and its calls
            content = content or ""
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

    def finish(self, reason: str | None, *, called: bool, streamed: bool, stream: bool) -> str | None:
        """The finish reason vLLM's server gives: 'tool_calls' when calls were read (not streamed: from
        the whole text; streamed: fragments were sent and the text ended by itself), or for 'required'
        when the text ended by itself, not streamed; a named call keeps the engine's reason."""
        if reason is None or self.named:
            return reason
        if called or (streamed and reason == "stop") or (self.required and not stream and reason == "stop"):
            return "tool_calls"
        return reason

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

"""Chat prompts as the worker renders them for vLLM: one implementation for the worker and the router.

The worker validates a chat request's ``messages`` and ``tools`` with the models here (content parts
joined, ``developer`` read as ``system``), renders them with the model's chat template ready for the
assistant's turn, and sends vLLM the resulting token ids (``render_chat_ids``), so vLLM hashes its KV
blocks over exactly these ids. The router, holding the same tokenizer folder, calls the same functions
on the same body (``chat_template_inputs``, ``render_chat_ids``) to get the same ids and look up which
engines hold the prompt's blocks. Pure: the tokenizer is the caller's (loaded from its folder).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError


def utf8_text(value: str) -> str:
    """``value``, or ValueError naming where it is not valid UTF-8 (a lone surrogate)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text is not valid UTF-8 (lone surrogate at position {exc.start})") from None
    return value


class FunctionDefinition(BaseModel):
    """A function the model may call: its name, description and JSON schema of its arguments."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """``tools[]``: a function tool."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionCall(BaseModel):
    """A call's function: its name and its arguments as JSON text."""

    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str


class ToolCall(BaseModel):
    """An assistant's tool call (in the conversation's history)."""

    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(BaseModel):
    """One part of a message's content: text (other modalities are refused until a model takes them)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "text":
            raise PydanticCustomError(
                "unsupported_content",
                "content parts of type {kind} are not supported: the models served here take text only; "
                "send text parts",
                {"kind": repr(data.get("type"))},
            )
        return data


class ChatMessage(BaseModel):
    """One chat message. Content is text, or a list of text parts (joined by newlines, as vLLM
    joins them); ``developer`` is OpenAI's newer name for ``system``; ``tool`` messages carry a tool's
    result back to the model."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = Field(
        default=None,
        description="Text, or a list of text parts; may be left out by an assistant's tool calls.",
    )
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        if not value:
            raise ValueError("content parts must not be an empty list")
        return "\n".join(ContentPart.model_validate(part).text for part in value)

    @field_validator("content")
    @classmethod
    def _content(cls, value: str | None) -> str | None:
        return None if value is None else utf8_text(value)

    @model_validator(mode="after")
    def _roles(self) -> ChatMessage:
        if self.role == "developer":
            self.role = "system"  # chat templates know "system"; OpenAI treats the two alike
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id (the call it answers)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.content is None and not self.tool_calls:
            raise ValueError("content is required (it may be left out only by an assistant's tool calls)")
        return self


_MESSAGES = TypeAdapter(list[ChatMessage])
_TOOLS = TypeAdapter(list[Tool])


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The validated messages as the chat template takes them before ``template_messages`` (unset
    fields left out)."""
    return [m.model_dump(exclude_none=True) for m in messages]


def tool_dicts(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools for the chat template (OpenAI's shape, unset fields left out); None without tools."""
    return None if not tools else [t.model_dump(exclude_none=True) for t in tools]


def chat_template_inputs(
    messages: Any, tools: Any = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None] | None:
    """A raw chat request's ``messages`` and ``tools`` (as JSON gives them) as the worker renders them
    (``message_dicts``, ``tool_dicts`` of the same models), or None where they do not validate (the
    worker answers those with 400)."""
    try:
        validated = _MESSAGES.validate_python(messages)
        functions = _TOOLS.validate_python(tools) if tools is not None else None
    except ValidationError:
        return None
    if not validated:
        return None
    return message_dicts(validated), tool_dicts(functions)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as chat templates take them, as vLLM renders them: the arguments of an assistant's
    tool calls as objects (OpenAI sends JSON text; unreadable or empty: an empty object)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                try:
                    args = json.loads(call["function"].get("arguments") or "{}")
                except json.JSONDecodeError:
                    args = {}
                calls.append({**call, "function": {**call["function"], "arguments": args}})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def render_chat_ids(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int]:
    """The prompt token ids of ``messages`` (``message_dicts``) and ``tools`` (``tool_dicts``) with
    ``tokenizer``'s chat template, ready for the assistant's turn: rendered as text, then encoded without
    adding special tokens (the template writes them), as vLLM's ``/tokenize`` does for a chat. Raises
    what the template raises for messages it rejects."""
    text = tokenizer.apply_chat_template(
        template_messages(messages), tools=tools, add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))

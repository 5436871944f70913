"""Request bodies of the OpenAI-compatible endpoints (validated; unknown fields are rejected).

Sampling fields are passed to the engine as given; fields left unset are not sent.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

NonNegInt = Annotated[int, Field(ge=0, le=2**31 - 1)]
# Fields forwarded to the engine as sampling parameters when set.
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "ignore_eos",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def _utf8(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text is not valid UTF-8 (lone surrogate at position {exc.start})") from None
    return value


# Fields of the OpenAI API this worker does not serve yet, with the reason: refused by name rather
# than rejected as unknown or dropped.
CALLING = "function calling is not supported by this worker yet"
LOGPROBS = "log probabilities are not returned by this worker yet"
UNSUPPORTED = {
    "tools": CALLING,
    "tool_choice": CALLING,
    "functions": CALLING,
    "function_call": CALLING,
    "response_format": "structured outputs (JSON mode, JSON schema) are not supported by this worker yet",
    "logprobs": LOGPROBS,
    "top_logprobs": LOGPROBS,
    "echo": "echo is not supported by this worker yet",
    "best_of": "best_of is not supported by this worker (send one request per candidate)",
    "logit_bias": "logit_bias is not supported by this worker yet",
}


class StreamOptions(BaseModel):
    """``stream_options``."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Generation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="Model name (see /v1/models).")
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = Field(
        default=None,
        description="Most tokens to generate (>= 1); unset: 16 for completions, rest of context for chat.",
    )
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    stop: (
        str
        | Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=16)]
        | None
    ) = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = Field(
        default=1, description="One choice per request: send n requests for n choices (n > 1 is refused)."
    )
    ignore_eos: bool = False
    min_tokens: NonNegInt | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    user: str | None = None
    return_token_ids: bool = Field(default=False, description="Include generated token ids in the response.")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, reason in UNSUPPORTED.items():
                if data.get(name) not in (None, False):
                    raise PydanticCustomError(
                        "unsupported_field",
                        "{field}: {reason}; send the request without {field}",
                        {"field": name, "reason": reason},
                    )
        return data

    @field_validator("stop")
    @classmethod
    def _stop_text(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, str):
            if not value:
                raise ValueError("stop strings must not be empty")
            return _utf8(value)
        return None if value is None else [_utf8(v) for v in value]

    @field_validator("model", "user")
    @classmethod
    def _text(cls, value: str | None) -> str | None:
        return None if value is None else _utf8(value)

    def sampling(self) -> dict[str, Any]:
        """The sampling fields that were set, for the engine."""
        # Identity tests, not ``in (None, False)``: 0 == False, and temperature 0 (greedy) must reach
        # the engine, whose default is to sample.
        out = {k: v for k in SAMPLING_FIELDS if (v := getattr(self, k)) is not None and v is not False}
        if self.min_tokens is not None and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            out["min_tokens"] = self.max_tokens
        return out


class CompletionRequest(_Generation):
    """``POST /v1/completions``."""

    prompt: str | Annotated[list[NonNegInt], Field(min_length=1)] = Field(
        description="Prompt text, or prompt token ids."
    )

    @field_validator("prompt")
    @classmethod
    def _prompt_text(cls, value: str | list[int]) -> str | list[int]:
        return _utf8(value) if isinstance(value, str) else value


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
    content: str = Field(description="Text, or a list of text parts.")
    name: str | None = None
    tool_call_id: str | None = None

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
    def _content(cls, value: str) -> str:
        return _utf8(value)

    @model_validator(mode="after")
    def _roles(self) -> ChatMessage:
        if self.role == "developer":
            self.role = "system"  # chat templates know "system"; OpenAI treats the two alike
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id (the call it answers)")
        return self


class ChatCompletionRequest(_Generation):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = Field(
        default=None, description="Same as max_tokens (newer OpenAI name); max_tokens wins when both are set."
    )


class AdminReloadResult(BaseModel):
    """``POST /admin/reload`` answer."""

    policy: str
    classes: list[str]
    batch_min: int
    batch_max: int

"""Request bodies of the OpenAI-compatible endpoints (validated; unknown fields are rejected).

Sampling fields are passed to the engine as given; fields left unset are not sent.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

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
    n: Literal[1] = Field(default=1, description="Only one choice per request is supported.")
    ignore_eos: bool = False
    min_tokens: NonNegInt | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    user: str | None = None
    return_token_ids: bool = Field(default=False, description="Include generated token ids in the response.")

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
        out = {k: getattr(self, k) for k in SAMPLING_FIELDS if getattr(self, k) not in (None, False)}
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


class ChatMessage(BaseModel):
    """One chat message (text content only)."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str

    @field_validator("content")
    @classmethod
    def _content(cls, value: str) -> str:
        return _utf8(value)


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

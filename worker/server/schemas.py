"""Request bodies of the OpenAI-compatible endpoints (validated; unknown fields are rejected).

Sampling fields are passed to the engine as given; fields left unset are not sent. Fields of OpenAI's
request schemas that do not change what is generated (``IGNORED``: stored-completion tags, cache hints,
processing tiers, end-user ids) are accepted, validated as OpenAI types them, and not acted on; those
that would change it and are not served (``UNSUPPORTED``, ``ONLY``) are refused with the reason, never
dropped silently. Numbers must be finite (NaN and infinities are refused by name).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

# The chat message and tool models are shared with the router, which renders chat prompts as the worker does.
from tessera.api.chat import ChatMessage, Tool, tool_dicts, utf8_text

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


# Fields of the OpenAI API this worker does not serve (yet), with the reason: refused by name rather
# than rejected as unknown or dropped (null, and false where it means off, are served as unset).
UNSUPPORTED = {
    "best_of": "best_of is not supported by this worker (send n for several choices)",
    "logit_bias": "logit_bias is not supported by this worker yet",
}
CHAT_UNSUPPORTED = {
    "audio": "audio output is not served: the models here generate text",
    "web_search_options": "web search is not available to the models here",
    "moderation": "no moderation model runs here: moderate the input and output before and after",
}
COMPLETION_UNSUPPORTED = {
    "suffix": "suffix (insertion) is not served by this worker: send the text before the gap as the prompt",
}
# Fields served with some of their values only: field -> (values served, why the others are not).
ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "modalities": ((["text"],), "only text output is served"),
    "service_tier": (
        ("auto", "default"),
        "this deployment has one processing tier; a request class (its header) sets priority and SLOs",
    ),
    "reasoning_effort": (("none",), "the models here take no reasoning budget"),
    "verbosity": (("medium",), "the models here take no verbosity setting: bound the answer with max_tokens"),
}
# Fields accepted and not acted on, with why that is what they ask for here.
IGNORED = {
    "metadata": "tags of a stored completion: nothing is stored here",
    "store": "stores the completion for OpenAI's evals and distillation: nothing is stored here",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
    "prompt_cache_key": "a cache-routing hint; the router reads it as a session key (sticky routing)",
    "prompt_cache_retention": "the engine's prefix cache keeps what its memory holds",
    "prompt_cache_options": "the engine's prefix cache keeps what its memory holds",
    "prediction": "a predicted output speeds generation up and never changes it",
}
CacheRetention = Literal["in_memory", "24h"]


def _ignored(name: str) -> Any:
    """The field ``name`` of ``IGNORED``: optional, described by why it is not acted on."""
    return Field(default=None, description=f"Accepted and not acted on: {IGNORED[name]}.")


LEGACY_FUNCTIONS = "the deprecated functions/function_call are not served: send tools and tool_choice"
CHAT_ONLY = "function calling is served on /v1/chat/completions"
AUTO_TOOLS = (
    "tool_choice 'auto' (the default when tools are given) is not served for model {model}: it has no tool "
    "parser to read the calls back from the model's own format; set spec.model.toolParser of its "
    "LLMService (models[].toolParser of the worker configuration) to vLLM's parser for the model, or "
    "send tool_choice 'required' or {{'type': 'function', 'function': {{'name': ...}}}} (the call is then "
    "generated as JSON under structured outputs), or 'none'"
)
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
MAX_CHOICES = 128


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: a named JSON schema the output must follow."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="The JSON schema.")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: free text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only with it")
        return self


class FunctionName(BaseModel):
    """The function a named ``tool_choice`` forces."""

    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming one function."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


class StreamOptions(BaseModel):
    """``stream_options``."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Generation(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

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
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = Field(
        default=1,
        description="Choices to generate: each is its own scheduled request (same class and deadline); "
        "with a seed, choice i samples with seed + i.",
    )
    ignore_eos: bool = False
    min_tokens: NonNegInt | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    user: str | None = None
    # IGNORED: validated, not acted on
    store: bool | None = _ignored("store")
    metadata: (
        Annotated[
            dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
            Field(max_length=16),
        ]
        | None
    ) = _ignored("metadata")
    safety_identifier: Annotated[str, Field(max_length=64)] | None = _ignored("safety_identifier")
    prompt_cache_key: str | None = _ignored("prompt_cache_key")
    prompt_cache_retention: CacheRetention | None = _ignored("prompt_cache_retention")
    return_token_ids: bool = Field(default=False, description="Include generated token ids in the response.")
    response_format: ResponseFormat | None = Field(
        default=None,
        description="Structured outputs through the engine's guided decoding; such a request is never "
        "preempted once it runs (a resumed stream would restart the grammar).",
    )
    _unsupported: ClassVar[dict[str, str]] = UNSUPPORTED
    _only: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            # null is unset, as OpenAI's schemas type every optional field (n, stream, logprobs, echo
            # included) and as clients and frameworks send them
            data = {k: v for k, v in data.items() if v is not None}
            for name, reason in cls._unsupported.items():
                if data.get(name) not in (None, False):
                    raise PydanticCustomError(
                        "unsupported_field",
                        "{field}: {reason}; send the request without {field}",
                        {"field": name, "reason": reason},
                    )
            for name, (served, reason) in cls._only.items():
                value = data.get(name)
                if value is not None and not any(value == ok for ok in served):
                    raise PydanticCustomError(
                        "unsupported_value",
                        "{field}={value}: {reason}; send {served} or leave {field} out",
                        {"field": name, "value": repr(value), "reason": reason,
                         "served": " or ".join(map(repr, served))},
                    )  # fmt: skip
        return data

    @field_validator("stop")
    @classmethod
    def _stop_text(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, str):
            if not value:
                raise ValueError("stop strings must not be empty")
            return utf8_text(value)
        return None if value is None else [utf8_text(v) for v in value]

    @field_validator("model", "user")
    @classmethod
    def _text(cls, value: str | None) -> str | None:
        return None if value is None else utf8_text(value)

    def sampling(self) -> dict[str, Any]:
        """The sampling fields that were set, for the engine (vLLM's completions names): log
        probabilities as the number of candidates per token, structured outputs as ``response_format``."""
        # Identity tests, not ``in (None, False)``: 0 == False, and temperature 0 (greedy) must reach
        # the engine, whose default is to sample.
        out = {k: v for k in SAMPLING_FIELDS if (v := getattr(self, k)) is not None and v is not False}
        if self.min_tokens is not None and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            out["min_tokens"] = self.max_tokens
        if (top := self.logprobs_count()) is not None:
            out["logprobs"] = top
        if self.response_format is not None and self.response_format.type != "text":
            out["response_format"] = self.response_format.model_dump(by_alias=True, exclude_none=True)
        return out

    def logprobs_count(self) -> int | None:
        """Candidates per token the engine returns log probabilities for; None: none asked for."""
        raise NotImplementedError


class CompletionRequest(_Generation):
    """``POST /v1/completions``."""

    prompt: str | Annotated[list[NonNegInt], Field(min_length=1)] = Field(
        description="Prompt text, or prompt token ids."
    )
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
        default=None, description="Log probabilities of each token and of this many likeliest candidates."
    )
    echo: bool = Field(default=False, description="Prepend the prompt's text to the completion.")
    _unsupported: ClassVar[dict[str, str]] = {
        **UNSUPPORTED,
        **COMPLETION_UNSUPPORTED,
        **dict.fromkeys(("tools", "tool_choice", "functions", "function_call"), CHAT_ONLY),
    }

    @model_validator(mode="after")
    def _echo_logprobs(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise PydanticCustomError(
                "unsupported_field",
                "echo with logprobs: the prompt's log probabilities are not returned by this worker; "
                "send echo or logprobs, not both",
            )
        return self

    def logprobs_count(self) -> int | None:
        """``logprobs``."""
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _prompt_text(cls, value: str | list[int]) -> str | list[int]:
        return utf8_text(value) if isinstance(value, str) else value


class ChatCompletionRequest(_Generation):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = Field(
        default=None, description="Same as max_tokens (newer OpenAI name); max_tokens wins when both are set."
    )
    logprobs: bool = Field(default=False, description="Log probabilities of each generated token.")
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
        default=None, description="With logprobs: also this many likeliest candidates per token."
    )
    tools: Annotated[list[Tool], Field(min_length=1, max_length=128)] | None = Field(
        default=None, description="Functions the model may call, rendered by the model's chat template."
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None,
        description="'required' or a named function: for a model with a tool parser (spec.model.toolParser), "
        "generated and read back as vLLM's server with that parser does (hermes: the model's own call "
        "format under a structural tag), else the call is generated as JSON under structured outputs; "
        "never preempted, as response_format; 'none': the tools are shown, not called; 'auto' (the "
        "default with tools): generated freely, the calls read back by the model's tool parser "
        "(without one, refused).",
    )
    parallel_tool_calls: bool | None = Field(default=None, description="False: at most one call (required).")
    # ONLY: served with the values that ask for what is generated anyway
    modalities: list[Literal["text", "audio"]] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    # IGNORED: validated, not acted on
    prediction: dict[str, Any] | None = _ignored("prediction")
    prompt_cache_options: dict[str, Any] | None = _ignored("prompt_cache_options")
    _unsupported: ClassVar[dict[str, str]] = {
        **UNSUPPORTED,
        **CHAT_UNSUPPORTED,
        "functions": LEGACY_FUNCTIONS,
        "function_call": LEGACY_FUNCTIONS,
        "echo": "echo is served on /v1/completions only",
    }
    _only: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = ONLY

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _tool_choice(self) -> ChatCompletionRequest:
        if self.tools is None:
            if self.tool_choice not in (None, "none"):
                raise ValueError("tool_choice needs tools (the functions it may call)")
            return self
        names = [t.function.name for t in self.tools]
        if len(set(names)) < len(names):
            raise ValueError(f"tools: function names must be unique, got {names}")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(
                f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools {names}"
            )
        if self.tool_schema() is not None and self.response_format is not None:
            raise ValueError(
                "response_format with a forced tool call: both shape the output; send one of them"
            )
        return self

    def tool_schema(self) -> dict[str, Any] | None:
        """The JSON schema a forced tool call is generated under, as vLLM builds it: the named
        function's arguments, or for 'required' an array of ``{name, parameters}`` objects."""
        if self.tools is None or self.tool_choice in (None, "none", "auto"):
            return None
        params = {
            t.function.name: t.function.parameters or {"type": "object", "properties": {}} for t in self.tools
        }
        if isinstance(self.tool_choice, NamedToolChoice):
            return params[self.tool_choice.function.name]
        defs: dict[str, Any] = {}
        calls = []
        for name, schema in params.items():
            schema = dict(schema)
            defs.update(schema.pop("$defs", {}))  # references resolve at the top of the whole schema
            calls.append(
                {
                    "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                    "required": ["name", "parameters"],
                }
            )
        out: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
        if self.parallel_tool_calls is False:
            out["maxItems"] = 1
        if defs:
            out["$defs"] = defs
        return out

    def sampling(self, *, tool_grammar: bool = True) -> dict[str, Any]:
        """As ``_Generation.sampling``, with a forced tool call's schema as structured outputs
        (``tool_grammar``; off where the model's tool parser decides how calls are generated)."""
        out = super().sampling()
        schema = self.tool_schema() if tool_grammar else None
        if schema is not None:
            out["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "tool_call", "schema": schema},
            }
        return out

    def auto_tools(self) -> bool:
        """Whether the model chooses whether to call (tool_choice auto, the default when tools are given)."""
        return self.tools is not None and self.tool_choice in (None, "auto")

    def calls_tools(self) -> bool:
        """Whether the answer may hold tool calls (tools given, tool_choice not 'none')."""
        return self.tools is not None and self.tool_choice != "none"

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template (OpenAI's shape)."""
        return tool_dicts(self.tools)

    def logprobs_count(self) -> int | None:
        """``top_logprobs`` (0 when unset) when ``logprobs`` is true."""
        return (self.top_logprobs or 0) if self.logprobs else None


class AdminReloadResult(BaseModel):
    """``POST /admin/reload`` answer."""

    policy: str
    classes: list[str]
    batch_min: int
    batch_max: int

"""The worker configuration file: what the operator writes into the worker pod's ConfigMap.

JSON or YAML, camelCase keys (like the custom resources), unknown keys rejected. The worker
applies a new content of the file without a restart (it checks every ``polling.configFileSeconds``,
and on ``POST /admin/reload``): policy, classes and batch-size bounds change in place; the model
list is fixed for the pod's life (a changed model list is refused: restart the pod).

Example (YAML)::

    models:
      - name: tiny
        engine: vllm
        url: http://127.0.0.1:8001
        maxModelLen: 512
        defaultClass: chat
    classes:
      chat: {kind: interactive, slo: {ttftSeconds: 1, itlSeconds: 0.2}}
      batch: {kind: batch, slo: {deadlineSeconds: 600}, queue: {maxQueued: 1000}}
    scheduling:
      policy: fcfs
      batch: {min: 1, max: 64, initial: 32}
    admin: {tokenEnv: TESSERA_ADMIN_TOKEN}
"""

from __future__ import annotations

import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from tessera.api.base import ApiModel
from tessera.api.fair_share import FairShareSpec
from tessera.api.files import read_json_or_yaml
from tessera.api.request_class import RequestClassSpec
from tessera.core.fair_share import FairShare
from tessera.core.policy import Policy
from tessera.core.profile import StepProfile
from tessera.core.registry import make_policy

Positive = Annotated[float, Field(gt=0)]
# Benchmark-only request header: the request's true output length (scheduling.benchHints).
BENCH_TRUE_LENGTH_HEADER = "X-Tessera-True-Output-Tokens"


# The tool parsers vLLM 0.32 registers (``vllm.tool_parsers.ToolParserManager.list_registered()``; a test
# keeps the two equal where vLLM is installed): the names ``--tool-call-parser`` takes.
# fmt: off
ToolParserName = Literal[
    "apertus", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31", "deepseek_v32",
    "deepseek_v4", "deepseek_v41", "dots", "ernie45", "functiongemma", "gemma4", "gigachat3", "glm45",
    "glm47", "granite", "granite-20b-fc", "granite4", "hermes", "hf", "hunyuan_a13b", "hy_v3", "hy_v4",
    "inkling", "internlm", "jamba", "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3_json",
    "llama4_json", "llama4_pythonic", "longcat", "mimo", "minicpm5", "minimax_m2", "minimax_m3",
    "mistral", "muse_glimmer", "olmo3", "openai", "phi4_mini_json", "plamo3", "poolside_v1", "pythonic",
    "qwen3_coder", "qwen3_json", "qwen3_xml", "seed_oss", "step3", "step3p5", "xlam",
]
# fmt: on
TOOL_PARSERS: tuple[str, ...] = typing.get_args(ToolParserName)


class ConfigError(ValueError):
    """The worker configuration is invalid; the message says where and how to fix it."""


class ClassHeaderError(ValueError):
    """A request's class headers name no class this service accepts, or name two different ones.
    ``header`` is the header at fault (the error's parameter)."""

    def __init__(self, message: str, header: str) -> None:
        super().__init__(message)
        self.header = header


class LaunchSpec(ApiModel):
    """Start the model's vLLM server as a child of the worker (local mode) instead of using ``url``."""

    model_dir: str = Field(min_length=1, description="Hugging Face model directory to serve.")
    kv_cache_gib: Annotated[int, Field(ge=1)] = Field(default=1, description="VLLM_CPU_KVCACHE_SPACE.")
    max_num_seqs: Annotated[int, Field(ge=1)] | None = Field(
        default=None,
        description=(
            "--max-num-seqs: at least scheduling.batch.max, so that vLLM runs every request the worker "
            "lets in and queues none out of the policy's reach; unset: scheduling.batch.max."
        ),
    )
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field(default="auto", description="--dtype.")
    enforce_eager: bool = Field(
        default=False,
        description="--enforce-eager: no torch.compile warm-up (on a 2-core CPU the server starts in about "
        "1 minute instead of 3-4) at the price of slower decoding.",
    )
    kv_events_port: Annotated[int, Field(ge=1, le=65535)] | None = Field(
        default=None,
        description=(
            "Publish vLLM's KV events (--kv-events-config: a ZMQ publisher bound on this port of every "
            "interface, topic kv-events) for a router's precise-prefix route to subscribe to; unset: no "
            "events. Local mode sets a free port when its route reads them."
        ),
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="More vLLM arguments, after the worker's own (local mode: the LoRA flags the operator "
        "renders for a base model with adapters).",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="More environment of the vLLM server (local mode: VLLM_ALLOW_RUNTIME_LORA_UPDATING for a "
        "base model with adapters).",
    )


class ProfileSpec(ApiModel):
    """Step-time model of the engine (seconds) for policies that estimate service time, and for
    the ``sim`` engine, which generates tokens at exactly these speeds."""

    decode_c0: Positive = 0.004
    decode_c1: Annotated[float, Field(ge=0)] = 0.0002
    decode_c2: Annotated[float, Field(ge=0)] = 0.0
    # A fitted prefill may have no fixed part (smollm2-cpu's fit: 0 s + 2.8 ms/token); it still takes
    # time as long as one of the two is positive.
    prefill_p0: Annotated[float, Field(ge=0)] = 0.004
    prefill_p1: Annotated[float, Field(ge=0)] = 0.00002

    @model_validator(mode="after")
    def _prefill_takes_time(self) -> ProfileSpec:
        if self.prefill_p0 == 0 and self.prefill_p1 == 0:
            raise ValueError("prefill_p0 and prefill_p1 are both 0: a prefill would take no time")
        return self

    @classmethod
    def from_profile(cls, profile: StepProfile) -> ProfileSpec:
        """The step-time coefficients of a core profile (a named or measured one)."""
        return cls(decode_c0=profile.decode_c0, decode_c1=profile.decode_c1, decode_c2=profile.decode_c2,
                   prefill_p0=profile.prefill_p0, prefill_p1=profile.prefill_p1)  # fmt: skip

    def to_profile(self, name: str, kv_capacity_tokens: int) -> StepProfile:
        """The core's StepProfile for a model with this KV capacity."""
        return StepProfile(
            name=name,
            decode_c0=self.decode_c0,
            decode_c1=self.decode_c1,
            decode_c2=self.decode_c2,
            prefill_p0=self.prefill_p0,
            prefill_p1=self.prefill_p1,
            kv_capacity_tokens=kv_capacity_tokens,
            source="worker configuration",
        )


class ModelEntry(ApiModel):
    """One model served by this pod (one vLLM server each)."""

    name: str = Field(min_length=1, description="Model name as clients send it (and vLLM serves it).")
    engine: Literal["vllm", "sim"] = Field(default="vllm", description="Engine adapter.")
    url: str | None = Field(
        default=None, pattern=r"^https?://", description="Base URL of the model's vLLM server (no /v1)."
    )
    launch: LaunchSpec | None = Field(default=None, description="Start vLLM here instead of using url.")
    tokenizer: str | None = Field(
        default=None,
        min_length=1,
        description=(
            "Directory of the model's tokenizer (the files vLLM serves): the worker tokenizes text "
            "itself instead of a /tokenize round trip per request; unset: /tokenize, or launch.modelDir "
            "when vLLM is launched here."
        ),
    )
    max_model_len: Annotated[int, Field(ge=16)] = Field(default=2048, description="Context length in tokens.")
    default_class: str | None = Field(
        default=None, description="Class of requests without a class header; unset: the first class."
    )
    kv_capacity_tokens: Annotated[int, Field(ge=16)] = Field(
        default=65536, description="KV cache size in tokens (what policies see as capacity)."
    )
    profile: ProfileSpec = Field(default_factory=ProfileSpec, description="Step-time model.")
    class_specs: dict[str, RequestClassSpec] = Field(
        default_factory=dict,
        description=(
            "This model's own spec of some of the pod's classes (co-located services that override a "
            "shared class differently: SLOs, QoE, priority, queue bounds), by class name; same kind and "
            "match as the pod's class. Other classes: the pod's spec."
        ),
    )
    tool_parser: ToolParserName | None = Field(
        default=None,
        description=(
            "vLLM's tool parser for this model's tool-call format (as vLLM's --tool-call-parser): with "
            "it, tool_choice auto (the default when a request gives tools) is served, the calls read "
            "back from the generated text; unset: auto is refused. Needs vLLM importable in the worker "
            "and the model's tokenizer (tokenizer, launch.modelDir, else the Hugging Face id)."
        ),
    )
    sleep_mode: Literal["auto", "on", "off"] = Field(
        default="auto",
        description=(
            "Model swapping by sleep / wake-up (tessera.worker.swap). auto: where the engine reports "
            "support (vLLM: /server_info says enable_sleep_mode; the sim engine reports none); on: "
            "required (vLLM started with --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1, CUDA/ROCm "
            "only; the sim engine simulates it); off: the model stays resident."
        ),
    )

    adapter_of: str | None = Field(
        default=None,
        min_length=1,
        description=(
            "This model is a LoRA adapter served by the vLLM server of the pod's model of this name (its "
            "base; url is the base's, or unset where the worker launched the base): the worker loads it "
            "there at run time (/v1/load_lora_adapter, the "
            "server started with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING) and schedules it as "
            "one more model of the pod."
        ),
    )
    adapter_source: str | None = Field(
        default=None, min_length=1, description="The adapter's files: a directory or a Hugging Face id."
    )
    adapter_rank: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="The adapter's LoRA rank."
    )
    unload_after_seconds: Annotated[float, Field(ge=1, allow_inf_nan=False)] | None = Field(
        default=None,
        description=(
            "An adapter: unloaded from its base's engine after this many seconds without requests (its "
            "LLMService's scaleToZero.afterSeconds; the base keeps serving), loaded again by the next "
            "request. Unset: it stays loaded while the engine has room."
        ),
    )
    max_loras: Annotated[int, Field(ge=1)] | None = Field(
        default=None,
        description=(
            "A base model serving adapters: how many adapters one batch of its engine mixes (its vLLM "
            "server's --max-loras, each a slot in GPU memory); the pod's scheduler starts no request "
            "that would need one more. Unset: the model serves no adapters."
        ),
    )
    max_cpu_loras: Annotated[int, Field(ge=1)] | None = Field(
        default=None,
        description=(
            "A base model serving adapters: how many adapters its engine holds loaded (--max-cpu-loras, "
            "at least maxLoras); an adapter past them is loaded on demand, the least recently used idle "
            "one unloaded first. Unset: maxLoras."
        ),
    )

    def tokenizer_dir(self) -> str | None:
        """The folder whose tokenizer the worker tokenizes with (``tokenizer``, else the launched model's);
        None: it asks the engine."""
        return self.tokenizer or (self.launch.model_dir if self.launch is not None else None)

    @model_validator(mode="after")
    def _engine_source(self) -> ModelEntry:
        if self.adapter_of is not None and self.launch is not None:
            raise ValueError(f"model {self.name!r}: an adapter runs in its base's vLLM server: no launch")
        # An adapter without url is served by the server its base launched (local mode).
        if self.engine == "vllm" and self.adapter_of is None and (self.url is None) == (self.launch is None):
            raise ValueError(f"model {self.name!r}: a vllm model needs exactly one of url or launch")
        if (self.adapter_of is None) != (self.adapter_source is None):
            raise ValueError(f"model {self.name!r}: an adapter needs both adapterOf and adapterSource")
        if self.adapter_of is None and self.unload_after_seconds is not None:
            raise ValueError(f"model {self.name!r}: unloadAfterSeconds is for an adapter (adapterOf)")
        if self.adapter_of is not None and (self.max_loras is not None or self.max_cpu_loras is not None):
            raise ValueError(f"model {self.name!r}: maxLoras and maxCpuLoras belong to the base model, not "
                             "to an adapter")  # fmt: skip
        if self.max_cpu_loras is not None and (self.max_loras is None or self.max_cpu_loras < self.max_loras):
            raise ValueError(f"model {self.name!r}: maxCpuLoras {self.max_cpu_loras} needs maxLoras and "
                             f"must be at least it ({self.max_loras})")  # fmt: skip
        return self

    @property
    def adapter_cache_size(self) -> int:
        """Adapters a base's engine holds loaded (``maxCpuLoras``, else ``maxLoras``; 0 for none)."""
        return self.max_cpu_loras or self.max_loras or 0


class BatchBounds(ApiModel):
    """Bounds of the batch size (most requests in flight on one model's engine)."""

    min: Annotated[int, Field(ge=1)] = 1
    max: Annotated[int, Field(ge=1)] = 256
    initial: Annotated[int, Field(ge=1)] | None = Field(default=None, description="Start value; unset: max.")

    @model_validator(mode="after")
    def _ordered(self) -> BatchBounds:
        if self.min > self.max:
            raise ValueError(f"batch.min {self.min} is above batch.max {self.max}")
        if self.initial is not None and not self.min <= self.initial <= self.max:
            raise ValueError(f"batch.initial {self.initial} is outside [{self.min}, {self.max}]")
        return self

    @property
    def start(self) -> int:
        """The batch size to start with."""
        return self.initial if self.initial is not None else self.max


class AutoscaleSpec(ApiModel):
    """Chiron's local autoscaler: the batch size from ITL and throughput backpressure, with the ITL SLOs
    of classes that name none; see ``tessera.core.chiron.ChironPolicy``."""

    enabled: bool = False
    alpha: Annotated[float, Field(gt=0, le=1)] = 0.5
    min_iterations: Annotated[int, Field(ge=1)] = 20
    min_interval_seconds: Positive = 0.5
    interactive_itl_slo_seconds: Positive = 0.2
    batch_itl_slo_seconds: Positive = 2.0


class SchedulingSpec(ApiModel):
    """Policy, its settings, batch bounds, autoscaling and pacing."""

    policy: str = Field(default="fcfs", description="Policy name (fcfs, edf, isrtf, qoe, qlm, ...).")
    settings: dict[str, Any] = Field(
        default_factory=dict,
        description="The policy's settings (its settings model in tessera.core.registry; camelCase keys).",
    )
    batch: BatchBounds = Field(default_factory=BatchBounds)
    autoscale: AutoscaleSpec = Field(default_factory=AutoscaleSpec)
    pacing: bool = Field(default=False, description="Release streamed tokens at the class's reading speed.")
    fair_share: FairShareSpec = Field(
        default_factory=FairShareSpec,
        description="VTC fair share between the router's tenants around the policy (off by default).",
    )
    max_queued: Annotated[int, Field(ge=1)] = Field(
        default=10000,
        description="Most requests waiting per model, split between the tenants waiting by weight (a "
        "tenant alone may hold all); beyond: HTTP 429.",
    )
    bench_hints: bool = Field(
        default=False,
        description=(
            "BENCHMARKS ONLY, off in production: accept the true output length of a request in the "
            f"{BENCH_TRUE_LENGTH_HEADER} header (oracle policies such as srtf-oracle need it)."
        ),
    )

    @field_validator("settings")
    @classmethod
    def _settings_valid(cls, settings: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        from tessera.core.registry import POLICIES, validate_settings

        policy = info.data.get("policy")
        if policy in POLICIES:  # an unknown policy is reported by _policy_known
            validate_settings(policy, settings)
        return settings

    @model_validator(mode="after")
    def _policy_known(self) -> SchedulingSpec:
        from tessera.core.registry import POLICIES, policy_class

        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; known policies: {', '.join(sorted(POLICIES))}")
        if not self.bench_hints and policy_class(self.policy).oracle:
            raise ValueError(
                f"policy {self.policy!r} reads true output lengths, which only a benchmark knows: set "
                f"scheduling.benchHints: true and send {BENCH_TRUE_LENGTH_HEADER} with every request"
            )
        return self


class PollingSpec(ApiModel):
    """How often the worker looks, off the request path, at what may change under it."""

    config_file_seconds: Annotated[float, Field(ge=0)] = Field(
        default=2.0,
        description=(
            "Seconds between checks of the configuration file's content (a mounted ConfigMap is updated "
            "by a symlink swap); new content is applied as POST /admin/reload would; 0: never."
        ),
    )
    engine_stats_seconds: Positive = Field(
        default=1.0,
        description="Seconds between reads of each engine's KV cache and request counts (vLLM: /metrics).",
    )


class AdminSpec(ApiModel):
    """Where the admin token comes from; without one the admin endpoint is disabled."""

    token_env: str | None = Field(default=None, description="Environment variable holding the token.")
    token_file: str | None = Field(default=None, description="File holding the token (a mounted Secret).")

    def token(self) -> str | None:
        """The admin token, or None when none is configured or the source is empty."""
        if self.token_file:
            path = Path(self.token_file)
            if not path.exists():
                raise ConfigError(f"admin.tokenFile {path} does not exist; mount the Secret or fix the path")
            value = path.read_text().strip()
            return value or None
        if self.token_env:
            return os.environ.get(self.token_env) or None
        return None


class WorkerConfig(ApiModel):
    """The whole worker configuration."""

    models: list[ModelEntry] = Field(min_length=1, description="Models served by this pod.")
    classes: dict[str, RequestClassSpec] = Field(
        default_factory=lambda: {"default": RequestClassSpec.model_validate({"slo": {"ttftSeconds": 10}})},
        description="Request classes by name.",
    )
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    polling: PollingSpec = Field(default_factory=PollingSpec)
    admin: AdminSpec = Field(default_factory=AdminSpec)

    @model_validator(mode="after")
    def _consistent(self) -> WorkerConfig:
        if not self.classes:
            raise ValueError("classes must name at least one request class")
        names = [m.name for m in self.models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"model names must be unique; repeated: {', '.join(dupes)}")
        selectors: dict[tuple[str, str], str] = {}
        for name, spec in self.classes.items():
            key = (spec.match.header.lower(), spec.header_value(name))
            if key in selectors:
                raise ValueError(
                    f"classes {selectors[key]!r} and {name!r} are both selected by the header "
                    f"{spec.match.header}: {key[1]}; give one of them another match.value"
                )
            selectors[key] = name
        batch_max = self.scheduling.batch.max
        for i, m in enumerate(self.models):
            seqs = m.launch.max_num_seqs if m.launch is not None else None
            if seqs is not None and seqs < batch_max:
                raise ValueError(
                    f"models.{i}.launch.maxNumSeqs {seqs} is below scheduling.batch.max {batch_max}: vLLM "
                    "would queue the requests beyond it in arrival order, out of the policy's reach; raise "
                    "maxNumSeqs, lower batch.max, or unset maxNumSeqs (it then follows batch.max)"
                )
            for name, spec in m.class_specs.items():
                shared = self.classes.get(name)
                if shared is None or (shared.kind, shared.match) != (spec.kind, spec.match):
                    raise ValueError(
                        f"model {m.name!r}: classSpecs.{name} must be one of the classes "
                        f"({', '.join(sorted(self.classes))}) with the same kind and match; a model "
                        "changes only a class's SLOs, QoE, priority and queue bounds"
                    )
            base = next((b for b in self.models if b.name == m.adapter_of), None)
            if m.adapter_of is not None and (base is None or base.adapter_of is not None):
                raise ValueError(
                    f"model {m.name!r}: adapterOf {m.adapter_of!r} must name a full model of the pod "
                    f"({', '.join(b.name for b in self.models if b.adapter_of is None)})"
                )
            if base is not None and base.max_loras is None:
                raise ValueError(
                    f"model {m.name!r}: its base {base.name!r} must set maxLoras (its engine's --max-loras) "
                    "to serve adapters"
                )
            if m.default_class is not None and m.default_class not in self.classes:
                raise ValueError(
                    f"model {m.name!r}: defaultClass {m.default_class!r} is not among the classes "
                    f"({', '.join(sorted(self.classes))})"
                )
        return self

    def make_policy(self) -> Policy:
        """A new instance of the policy the pod's schedulers run (``scheduling.policy`` with its
        settings, inside VTC's fair share when ``scheduling.fairShare`` is on): the worker's, and the
        simulated pod's in ``tessera bench load-shift``."""
        policy = make_policy(self.scheduling.policy, **self.scheduling.settings)
        share = self.scheduling.fair_share
        if not share.enabled:
            return policy
        return FairShare(policy, input_weight=share.input_weight, output_weight=share.output_weight,
                         lift_credit=share.lift_credit)  # fmt: skip

    @property
    def adapter_of(self) -> dict[str, str]:
        """Adapter -> its base model, for the pod's adapters."""
        return {m.name: m.adapter_of for m in self.models if m.adapter_of is not None}

    def model(self, name: str) -> ModelEntry | None:
        """The model entry called ``name``."""
        return next((m for m in self.models if m.name == name), None)

    def class_spec(self, model: ModelEntry, name: str) -> RequestClassSpec:
        """The spec of class ``name`` for requests to ``model`` (its ``classSpecs``, else the pod's)."""
        return model.class_specs.get(name) or self.classes[name]

    def default_class(self, model: ModelEntry) -> str:
        """The class of requests to ``model`` that name none."""
        return model.default_class or next(iter(self.classes))

    @property
    def class_header(self) -> str:
        """The header of the first class: the one to name where a single class header is shown."""
        return next(iter(self.classes.values())).match.header

    def class_from_headers(self, headers: Mapping[str, str]) -> str | None:
        """The class a request's headers select, each class by its own ``match.header`` (names compared
        case-insensitively) carrying its ``match.value`` (else its name); None when no class header is
        present (the model's default class applies). ClassHeaderError when a class header carries a
        value no class takes, when two headers select different classes, or when one class header is
        sent more than once with different values (``headers.items()`` lists repeats, as Starlette's
        do: whichever came first or last would otherwise decide the class)."""
        sent: dict[str, list[str]] = {}
        for k, v in headers.items():
            if v:
                sent.setdefault(k.lower(), []).append(v)
        chosen: dict[str, tuple[str, str]] = {}  # header as configured -> (value sent, class)
        for header, by_value in self._selectors().items():
            values = list(dict.fromkeys(sent.get(header.lower(), ())))
            if len(values) > 1:
                raise ClassHeaderError(
                    f"the header {header} is sent more than once with different values "
                    f"({', '.join(map(repr, values))}); send it once, naming one request class",
                    header,
                )
            if not values:
                continue
            value = values[0]
            name = by_value.get(value)
            if name is None:
                known = ", ".join(by_value)
                raise ClassHeaderError(
                    f"unknown request class {value!r} in header {header}; this service accepts: {known}",
                    header,
                )
            chosen[header] = (value, name)
        if len({name for _, name in chosen.values()}) > 1:
            named = "; ".join(f"{h}: {v} selects class {n!r}" for h, (v, n) in chosen.items())
            raise ClassHeaderError(
                f"the request's headers name different classes ({named}); send only one of them",
                next(iter(chosen)),
            )
        return next(iter(chosen.values()))[1] if chosen else None

    def _selectors(self) -> dict[str, dict[str, str]]:
        """Class header (first spelling) -> header value -> class name."""
        spelled: dict[str, str] = {}
        out: dict[str, dict[str, str]] = {}
        for name, spec in self.classes.items():
            header = spelled.setdefault(spec.match.header.lower(), spec.match.header)
            out.setdefault(header, {})[spec.header_value(name)] = name
        return out


def parse_config(data: Any, where: str = "configuration") -> WorkerConfig:
    """Validate a parsed document; ConfigError listing every problem with its location."""
    try:
        return WorkerConfig.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
            lines.append(f"  {loc}: {err['msg'].removeprefix('Value error, ')}")
        raise ConfigError(f"invalid worker {where}:\n" + "\n".join(lines)) from None


def load_config(path: Path | str) -> WorkerConfig:
    """Read a JSON or YAML configuration file."""
    path = Path(path)
    data = read_json_or_yaml(path, "worker configuration", ConfigError)
    return parse_config(data, where=f"configuration {path}")

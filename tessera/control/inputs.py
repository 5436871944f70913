"""Map the API models (ServingPool, LLMService) onto the planners' plain inputs.

The planners need numbers the custom resources do not carry (iteration-time model, KV bytes per
token). They come from the named step profiles (``tessera.core.profiles.PROFILES``), chosen by
the pool's GPU type and the model's size (``named_profile``). Where none matches, the fallback is
``FALLBACK_PROFILE``, the 8B-class model on one H100 (CHOICE, documented: the most common serving
setup; placement only uses the step profile to weigh services with traffic).

Each service's load (``service_load``) is measured where its workers report one
(``tessera.control.metrics_queries.ModelLoad``: the rate, prompt and output lengths of the last
interval), else declared (``spec.expectedLoad``), else the defaults: no traffic, 128 prompt and 256
output tokens. The load becomes the planner's rate, mean lengths and history: arrivals spread evenly
over each measured step (CHOICE: the metrics give counts per step, not arrival times), each with its
step's mean prompt and output lengths. The SLO
scale of SeaLLM's estimator (a request meets its SLO when its latency is at most ``slo_scale`` times
its isolated execution time) comes from the service's classes (``slo_scale``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tessera.api import LLMService, RequestClassSpec, ServingPool, parse_quantity
from tessera.control.adapters import lora_slots
from tessera.control.metrics_queries import ModelLoad, load_step_s
from tessera.core.lora import LoraCost, charged_profile
from tessera.core.planners import (
    ChironSettings,
    HistoryRequest,
    IntervalMetrics,
    LoraAdapters,
    PoolInput,
    ServiceInput,
)
from tessera.core.profile import StepProfile
from tessera.core.profiles import PROFILES
from tessera.core.request import ServiceClass

FALLBACK_PROFILE = "h100-llama3-8b"
# Named profiles by GPU family and model size in billions of parameters.
PROFILE_BY_GPU_AND_SIZE: dict[str, dict[float, str]] = {
    "a100": {8: "a100-llama3-8b", 13: "a100-vicuna-13b", 70: "a100-llama-70b-tp4"},
    "h100": {8: "h100-llama3-8b", 13: "h100-vicuna-13b", 70: "h100-llama-70b-tp4"},
}
# A model matches a profile's size within this relative distance (7B and 8B both match 8B).
SIZE_TOLERANCE = 0.25
_BYTES_PER_PARAMETER = {"auto": 2, "float16": 2, "bfloat16": 2, "float32": 4}
_SIZE_IN_NAME = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)[bB](?![a-zA-Z])")


def gpu_family(gpu_type: str) -> str | None:
    """The profile family of a GPU type ("H100", "h100-80gb", "NVIDIA-A100-SXM4" ...), None if unknown."""
    lowered = gpu_type.lower()
    return next((family for family in PROFILE_BY_GPU_AND_SIZE if family in lowered), None)


def model_billions(service: LLMService) -> float | None:
    """The model's size in billions of parameters: from ``weightsSize`` and the dtype, else from a
    size in its name ("Llama-3.1-8B-Instruct"); None when neither says."""
    model = service.spec.model
    if model.weights_size:
        return parse_quantity(model.weights_size) / _BYTES_PER_PARAMETER[model.dtype] / 1e9
    found = _SIZE_IN_NAME.search(model.name)
    return float(found.group(1)) if found else None


def named_profile(pool: ServingPool, service: LLMService) -> StepProfile | None:
    """The simulator profile for this GPU type and model size, None when none matches."""
    family = gpu_family(pool.spec.gpu.type)
    billions = model_billions(service)
    if family is None or billions is None:
        return None
    size, name = min(PROFILE_BY_GPU_AND_SIZE[family].items(), key=lambda item: abs(item[0] - billions))
    return PROFILES[name] if abs(billions - size) <= SIZE_TOLERANCE * size else None


# The engine of a pool's workers (vllm, the default, or sim); only vLLM's engines can sleep.
ENGINE_ANNOTATION = "tessera.dev/engine"


def pool_input(pool: ServingPool) -> PoolInput:
    """The planners' view of a ServingPool."""
    spec = pool.spec
    per_instance = spec.gpu.per_instance
    return PoolInput(
        name=pool.name,
        gpu_type=spec.gpu.type,
        gpu_memory_bytes=int(parse_quantity(spec.gpu.memory)),
        max_gpus=spec.instances.max * per_instance,
        # TP stays inside one instance (one pod on one node): the node size is the instance size,
        # rounded up to a power of two as the planners require.
        gpus_per_node=1 << (per_instance - 1).bit_length(),
        max_services_per_group=spec.placement.max_services_per_group,
        min_gpus_per_instance=per_instance,
        engines_sleep=pool.metadata.annotations.get(ENGINE_ANNOTATION, "vllm") == "vllm",
    )


def service_profile(pool: ServingPool, service: LLMService) -> StepProfile:
    """The step-time profile the planners use for ``service`` on ``pool``'s GPUs (matched, else the
    fallback)."""
    return named_profile(pool, service) or PROFILES[FALLBACK_PROFILE]


DEFAULT_PROMPT_TOKENS = 128
DEFAULT_OUTPUT_TOKENS = 256
# SLO_r = slo_scale x exec_ref(r) for services whose classes set no SLO (SeaLLM §6.1's scale).
DEFAULT_SLO_SCALE = 5.0
# Most requests of one service's history that placement replays (CHOICE: the simulated estimator's cost
# grows with them); a longer history keeps its most recent steps, so the rate stays the measured one.
MAX_HISTORY_REQUESTS = 5000


@dataclass(frozen=True, slots=True)
class ServiceLoad:
    """The load placement plans one service for, with where each figure came from
    ("measured", "declared" or "default")."""

    rate: float
    prompt_tokens: float
    output_tokens: float
    rate_source: str
    prompt_source: str
    output_source: str
    window_s: float | None = None  # what the measured figures cover
    history: tuple[HistoryRequest, ...] = ()
    outstanding: float | None = None  # requests the workers held at the window's end (measured only)
    adapter_rate: float = 0.0  # of ``rate``, the requests of the service's LoRA adapters (a base's)
    adapters: tuple[str, ...] = ()  # a base's LoRA adapters (idle ones too), as its history names them

    def to_status(self) -> dict[str, Any]:
        """The LLMService's ``status.load`` JSON (PlannedLoad)."""
        status: dict[str, Any] = {
            "requestsPerSecond": round(self.rate, 4),
            "meanPromptTokens": round(self.prompt_tokens, 1),
            "meanOutputTokens": round(self.output_tokens, 1),
            "sources": {
                "requestsPerSecond": self.rate_source,
                "promptTokens": self.prompt_source,
                "outputTokens": self.output_source,
            },
        }
        if self.window_s is not None:
            status["windowSeconds"] = round(self.window_s, 1)
        if self.outstanding is not None:
            status["outstandingRequests"] = round(self.outstanding, 1)
        return status


def spread_history(
    counts: Sequence[float], step_s: float, prompts: Sequence[int], outputs: Sequence[int]
) -> tuple[HistoryRequest, ...]:
    """Requests spread evenly over each step (``counts[j]`` arrivals in step j, fractions carried to the
    next step), each with its step's prompt and output lengths ``prompts[j]``, ``outputs[j]``; at most
    ``MAX_HISTORY_REQUESTS``, the most recent kept."""
    out: list[HistoryRequest] = []
    carry = 0.0
    for j, count in enumerate(counts):
        carry += count
        n = math.floor(carry + 1e-9)
        carry -= n
        out += [HistoryRequest((j + (k + 0.5) / n) * step_s, prompts[j], outputs[j]) for k in range(n)]
    return tuple(out[-MAX_HISTORY_REQUESTS:])


def _per_step(tokens: Sequence[float], finished: Sequence[float], mean: float, least: int) -> list[int]:
    """Mean tokens per finished request of each step (at least ``least``); a step where nothing finished,
    or no token was counted, takes ``mean``."""
    return [
        max(least, round(t / done)) if done > 0 and t > 0 else max(least, round(mean))
        for t, done in zip(tokens, finished, strict=True)
    ]


def service_load(service: LLMService, measured: ModelLoad | None, window_s: float) -> ServiceLoad:
    """The load to plan ``service`` for: ``measured`` where its workers reported one, else
    ``spec.expectedLoad``, else the defaults; ``window_s`` is the history a declared rate spans."""
    declared = service.spec.expected_load

    def pick(value: float | None, default: float) -> tuple[float, str]:
        return (value, "declared") if value is not None else (default, "default")

    prompt, prompt_source = pick(declared and declared.prompt_tokens, DEFAULT_PROMPT_TOKENS)
    output, output_source = pick(declared and declared.output_tokens, DEFAULT_OUTPUT_TOKENS)
    if measured is not None:
        if measured.mean_output_tokens is not None:
            output, output_source = measured.mean_output_tokens, "measured"
        if measured.mean_prompt_tokens is not None:
            prompt, prompt_source = measured.mean_prompt_tokens, "measured"
        outputs = _per_step(measured.output_tokens, measured.finished, output, 1)
        prompts = _per_step(measured.prompt_tokens, measured.finished, prompt, 0)
        history = spread_history(measured.arrivals, measured.step_s, prompts, outputs)
        return ServiceLoad(
            measured.rate,
            prompt,
            output,
            "measured",
            prompt_source,
            output_source,
            measured.span_s,
            history,
            measured.outstanding,
        )
    rate, rate_source = pick(declared and declared.requests_per_second, 0.0)
    step = load_step_s(window_s)
    steps = max(1, round(window_s / step))
    history = spread_history(
        [rate * step] * steps, step, [round(prompt)] * steps, [max(1, round(output))] * steps
    )
    return ServiceLoad(rate, prompt, output, rate_source, prompt_source, output_source, None, history)


def strictest_class(
    service: LLMService,
    classes: Mapping[str, RequestClassSpec],
    profile: StepProfile,
    prompt: int,
    output: int,
) -> tuple[float, ServiceClass] | None:
    """The latency budget of a mean request under the service's strictest class, and that class (its
    overrides applied); None when no class sets an SLO. A batch class's budget is its deadline; an
    interactive class's is its TTFT bound plus its ITL bound per later token, a bound it leaves unset
    taking the isolated prefill or decode time (no slack)."""
    exec_s = profile.exec_time(prompt, max(1, output))
    prefill = profile.prefill(prompt)
    budgets: list[tuple[float, str]] = []
    for accepted in service.spec.request_classes:
        slo = classes[accepted.name].with_overrides(accepted.overrides).slo
        if classes[accepted.name].kind == "batch":
            if slo.deadline_seconds is not None:
                budgets.append((slo.deadline_seconds, accepted.name))
        elif slo.ttft_seconds is not None or slo.itl_seconds is not None:
            first = slo.ttft_seconds if slo.ttft_seconds is not None else prefill
            rest = slo.itl_seconds * (max(1, output) - 1) if slo.itl_seconds is not None else exec_s - prefill
            budgets.append((first + rest, accepted.name))
    if not budgets:
        return None
    budget, name = min(budgets)
    accepted = next(a for a in service.spec.request_classes if a.name == name)
    return budget, classes[name].with_overrides(accepted.overrides).to_service_class(name)


def slo_scale(
    service: LLMService,
    classes: Mapping[str, RequestClassSpec],
    profile: StepProfile,
    prompt: int,
    output: int,
) -> float:
    """SeaLLM's SLO scale for ``service`` from its strictest class (``strictest_class``): a mean request's
    latency budget over its isolated execution time; ``DEFAULT_SLO_SCALE`` when no class sets an SLO.
    Where a class sets one, the estimators judge requests by the class itself (``ServiceInput.slo_class``)
    and the scale only sets DB's starvation threshold."""
    strictest = strictest_class(service, classes, profile, prompt, output)
    return strictest[0] / profile.exec_time(prompt, max(1, output)) if strictest else DEFAULT_SLO_SCALE


def with_adapter_loads(base: ServiceLoad, adapters: Mapping[str, ServiceLoad]) -> ServiceLoad:
    """The load a base model's instances serve: its own and its LoRA adapters' (``adapters``: each
    adapter's load by its name; their requests run on the base's engine, so they are the base's
    compute): rates summed, mean lengths weighted by rate, histories merged in arrival order (the latest
    ``MAX_HISTORY_REQUESTS``), each adapter's requests naming it (``HistoryRequest.adapter``: the
    simulated estimator runs them as the engine does, in its adapter slots), backlogs summed; the
    sources stay the base's."""
    if not adapters:
        return base
    loads = [base, *adapters.values()]
    rate = sum(x.rate for x in loads)
    weights = [x.rate for x in loads] if rate > 0 else [1.0] * len(loads)

    def mean(values: list[float]) -> float:
        return sum(w * v for w, v in zip(weights, values, strict=True)) / sum(weights)

    named = [*base.history, *(replace(h, adapter=a) for a, x in adapters.items() for h in x.history)]
    history = sorted(named, key=lambda h: h.arrival)[-MAX_HISTORY_REQUESTS:]
    backlog = [x.outstanding for x in loads if x.outstanding is not None]
    return replace(
        base,
        rate=rate,
        prompt_tokens=mean([x.prompt_tokens for x in loads]),
        output_tokens=mean([x.output_tokens for x in loads]),
        history=tuple(history),
        outstanding=sum(backlog) if backlog else None,
        adapter_rate=sum(x.rate for x in adapters.values()),
        adapters=tuple(adapters),
    )


def service_input(
    pool: ServingPool,
    service: LLMService,
    load: ServiceLoad | None = None,
    classes: Mapping[str, RequestClassSpec] | None = None,
) -> ServiceInput:
    """The planners' view of an LLMService placed on ``pool`` under ``load`` (default: declared or
    default, no history); ``classes`` (the RequestClass specs by name) set its SLO scale."""
    model = service.spec.model
    profile = service_profile(pool, service)
    weights = parse_quantity(model.weights_size) if model.weights_size else profile.weights_bytes
    load = load or service_load(service, None, 0.0)
    cost = LoraCost()
    if load.adapter_rate > 0:  # its engine's steps pay the adapters' LoRA overhead
        profile = charged_profile(profile, cost)
    # Its engine's adapter slots as the operator renders them: the simulated estimator runs its
    # adapters' requests in them
    lora = (
        LoraAdapters(load.adapters, *lora_slots(pool, load.adapters), cost.load_s) if load.adapters else None
    )
    prompt, output = round(load.prompt_tokens), max(1, round(load.output_tokens))
    reference = profile.at_tp(model.tensor_parallel_size)
    strictest = strictest_class(service, classes, reference, prompt, output) if classes is not None else None
    scale = DEFAULT_SLO_SCALE if classes is None else slo_scale(service, classes, reference, prompt, output)
    classes = classes or {}
    return ServiceInput(
        name=service.name,
        weights_bytes=int(weights),
        kv_bytes_per_token=profile.kv_bytes_per_token,
        profile=profile,
        tp_min=model.tensor_parallel_size,
        request_rate=load.rate,
        mean_prompt_tokens=load.prompt_tokens,
        mean_output_tokens=load.output_tokens,
        p99_context_tokens=model.max_model_length or 4096,
        slo_scale=scale,
        slo_class=strictest[1] if strictest else None,
        backlog=round(load.outstanding or 0),
        history=load.history,
        min_replicas=service.spec.replicas.min,
        max_replicas=service.spec.replicas.max,
        policy=service.spec.scheduling.resolved_policy(
            any(classes[c.name].kind == "batch" for c in service.spec.request_classes if c.name in classes)
        ),
        lora=lora,
    )


def service_inputs(
    pool: ServingPool,
    services: Iterable[LLMService],
    loads: Mapping[str, ServiceLoad] | None = None,
    classes: Mapping[str, RequestClassSpec] | None = None,
) -> list[ServiceInput]:
    """Planner inputs of several services (``loads`` by service name), sorted by name (plans must not
    depend on listing order)."""
    loads = loads or {}
    return [
        service_input(pool, s, loads.get(s.name), classes) for s in sorted(services, key=lambda s: s.name)
    ]


def interval_metrics(
    inputs: Mapping[str, ServiceInput], measured: Mapping[str, ModelLoad]
) -> IntervalMetrics | None:
    """SeaLLM's M_real of an interval from the services' measured loads (by service name): SLO
    attainment over the requests the classes judged, and mean normalized latency (end-to-end latency
    over the service's isolated execution time of a mean request, ``inputs``' L̂_s). None when nothing
    finished or no finished request was judged."""
    loads = {name: m for name, m in measured.items() if name in inputs}
    judged = sum(m.slo_met + m.slo_missed for m in loads.values())
    finished = sum(m.finished_total for m in loads.values())
    if judged <= 0 or finished <= 0:
        return None
    met = sum(m.slo_met for m in loads.values())
    norm = sum(m.e2e_seconds / inputs[name].mean_exec_s() for name, m in loads.items())
    return IntervalMetrics(min(1.0, met / judged), norm / finished)


def chiron_settings(pool: ServingPool, max_instances: int) -> ChironSettings:
    """Chiron settings of one placement group of ``pool``; ``max_instances`` is the group's share of
    the pool's budget."""
    autoscaling = pool.spec.autoscaling
    # The band stays below both targets it surrounds (Θ_op, and the forecast's utilization).
    band = min(
        autoscaling.over_provisioning_band,
        autoscaling.over_provisioning * 0.99,
        autoscaling.forecast_utilization * 0.99,
    )
    return ChironSettings(
        over_provisioning=autoscaling.over_provisioning,
        band=band,
        eval_interval_s=autoscaling.interval_seconds,
        min_instances=0,
        max_instances=max(1, max_instances),
        scale_up_cooldown_s=autoscaling.scale_up_cooldown_seconds,
        scale_down_cooldown_s=autoscaling.scale_down_cooldown_seconds,
        forecast_window_s=autoscaling.forecast_window_seconds,
        forecast_utilization=autoscaling.forecast_utilization,
        just_in_time=autoscaling.batch_just_in_time,
    )

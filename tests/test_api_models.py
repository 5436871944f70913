"""The API models: defaults, validation, camelCase round trips and conversion to runtime objects."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tessera.api import LLMServiceSpec, RequestClassSpec, ServingPoolSpec, parse_quantity
from tessera.api.request_class import ClassOverrides
from tessera.core.request import ServiceClass

POOL = {"gpu": {"type": "H100", "memory": "80Gi"}, "instances": {"max": 4}}
SERVICE = {
    "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
    "poolRef": {"name": "h100"},
    "requestClasses": [{"name": "chat"}, {"name": "offline"}],
}


@pytest.mark.parametrize(
    ("text", "value"),
    [("80Gi", 80 * 2**30), ("16G", 16e9), ("500m", 0.5), ("1.5Ki", 1536), ("1e3", 1000), ("2", 2)],
)
def test_parse_quantity(text: str, value: float) -> None:
    assert parse_quantity(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["80GB", "Gi", "eighty", "80 Gi", ""])
def test_parse_quantity_rejects_non_quantities(text: str) -> None:
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        parse_quantity(text)


def test_request_class_defaults_follow_andes() -> None:
    spec = RequestClassSpec.model_validate({"slo": {"ttftSeconds": 1}})
    assert spec.kind == "interactive"
    assert spec.qoe.reading_speed_tokens_per_second == 4.8
    assert spec.qoe.ttft_target_seconds is None
    assert spec.match.header == "X-Tessera-Class"
    assert spec.header_value("chat") == "chat"


def test_request_class_to_service_class() -> None:
    spec = RequestClassSpec.model_validate(
        {"kind": "batch", "slo": {"deadlineSeconds": 600}, "priority": 3, "qoe": {"ttftTargetSeconds": 2}}
    )
    assert spec.to_service_class("offline") == ServiceClass(
        name="offline", kind="batch", deadline_s=600.0, reading_speed_tps=4.8, ttft_target_s=2.0, priority=3
    )


def test_batch_class_needs_deadline_and_interactive_needs_ttft() -> None:
    with pytest.raises(ValidationError, match=r"slo.deadlineSeconds is required when kind is 'batch'"):
        RequestClassSpec.model_validate({"kind": "batch", "slo": {"ttftSeconds": 5}})
    with pytest.raises(ValidationError, match=r"slo.ttftSeconds is required when kind is 'interactive'"):
        RequestClassSpec.model_validate({"kind": "interactive"})


def test_overrides_replace_only_fields_set() -> None:
    base = RequestClassSpec.model_validate(
        {
            "slo": {"ttftSeconds": 2, "itlSeconds": 0.2},
            "qoe": {"readingSpeedTokensPerSecond": 6},
            "priority": 5,
        }
    )
    overrides = ClassOverrides.model_validate({"slo": {"ttftSeconds": 1}, "qoe": {"ttftTargetSeconds": 1.5}})
    merged = base.with_overrides(overrides)
    assert merged.slo.ttft_seconds == 1
    assert merged.slo.itl_seconds == 0.2
    assert merged.qoe.reading_speed_tokens_per_second == 6
    assert merged.qoe.ttft_target_seconds == 1.5
    assert merged.priority == 5
    assert base.slo.ttft_seconds == 2  # the class itself is unchanged


def test_service_classes_apply_overrides_and_name_missing_classes() -> None:
    spec = LLMServiceSpec.model_validate(
        {**SERVICE, "requestClasses": [{"name": "chat", "overrides": {"priority": 9}}, {"name": "offline"}]}
    )
    classes = {
        "chat": RequestClassSpec.model_validate({"slo": {"ttftSeconds": 2}}),
        "offline": RequestClassSpec.model_validate({"kind": "batch", "slo": {"deadlineSeconds": 60}}),
    }
    runtime = spec.service_classes(classes)
    assert runtime["chat"].priority == 9
    assert runtime["offline"].deadline_s == 60
    with pytest.raises(KeyError, match="offline"):
        spec.service_classes({"chat": classes["chat"]})


def test_service_defaults_and_auto_policy() -> None:
    spec = LLMServiceSpec.model_validate(SERVICE)
    assert spec.model.tensor_parallel_size == 1
    assert spec.scheduling.policy == "auto"
    assert spec.scheduling.resolved_policy(has_batch_class=True) == "qlm"
    assert spec.scheduling.resolved_policy(has_batch_class=False) == "qoe"
    assert spec.default_class_name == "chat"
    assert spec.replicas.min <= spec.replicas.max


def test_service_rules() -> None:
    with pytest.raises(ValidationError, match="defaultClass must name one of the entries of requestClasses"):
        LLMServiceSpec.model_validate({**SERVICE, "defaultClass": "nope"})
    with pytest.raises(ValidationError, match="duplicated: \\['chat'\\]"):
        LLMServiceSpec.model_validate({**SERVICE, "requestClasses": [{"name": "chat"}, {"name": "chat"}]})
    with pytest.raises(ValidationError, match="set at most one of source and volume"):
        LLMServiceSpec.model_validate(
            {**SERVICE, "model": {"name": "m", "source": "s3://b/m", "volume": {"claimName": "w"}}}
        )
    with pytest.raises(ValidationError, match="min must be less than or equal to max"):
        LLMServiceSpec.model_validate({**SERVICE, "replicas": {"min": 5, "max": 2}})


def test_pool_defaults_follow_the_papers() -> None:
    spec = ServingPoolSpec.model_validate(POOL)
    assert spec.autoscaling.over_provisioning == pytest.approx(1 / 3)  # Chiron Θ_op
    assert spec.autoscaling.batch_size.initial == 256
    assert spec.autoscaling.batch_size.max == 8192
    interval = spec.placement.replacement_interval  # SeaLLM Eq. 8 with spec §7 proposal
    assert (interval.initial_seconds, interval.min_seconds, interval.max_seconds, interval.beta) == (
        300,
        60,
        1800,
        0.1,
    )
    assert spec.placement.max_services_per_group == 2


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"instances": {"min": 5, "max": 4}}, "min must be less than or equal to max"),
        ({"instances": {"max": 4, "desired": 6}}, "desired must be less than or equal to max"),
        (
            {"autoscaling": {"batchSize": {"min": 64, "initial": 32}}},
            "min must be less than or equal to initial",
        ),
        (
            {"placement": {"replacementInterval": {"minSeconds": 600, "initialSeconds": 300}}},
            "minSeconds must be less than or equal to initialSeconds",
        ),
        ({"placement": {"replacementInterval": {"beta": 1.5}}}, "less than 1"),
        ({"extraVllmArgs": ["--port=9000"]}, "set by the operator"),
        ({"gpu": {"type": "H100", "memory": "0Gi"}}, "must be a positive quantity"),
    ],
)
def test_pool_validation(patch: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ServingPoolSpec.model_validate({**POOL, **patch})


def test_snake_case_names_populate_and_dump_camel_case() -> None:
    spec = ServingPoolSpec(gpu={"type": "L4", "memory": "24Gi", "per_instance": 2}, instances={"max": 2})
    dumped = spec.to_json()
    assert dumped["gpu"]["perInstance"] == 2
    assert ServingPoolSpec.model_validate(dumped) == spec


def test_load_forecasting_reaches_chiron_from_the_pool_spec() -> None:
    from tessera.api.serving_pool import ServingPool
    from tessera.control.inputs import chiron_settings

    body = {
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "ServingPool",
        "metadata": {"name": "p"},
        "spec": {**POOL, "autoscaling": {"forecastWindowSeconds": 60, "forecastUtilization": 0.04}},
    }
    settings = chiron_settings(ServingPool.model_validate(body), 8)
    assert (settings.forecast_window_s, settings.forecast_utilization) == (60, 0.04)
    assert settings.band < settings.forecast_utilization  # the band is kept below the target it surrounds
    assert chiron_settings(ServingPool.model_validate({**body, "spec": POOL}), 8).forecast_window_s == 0
    with pytest.raises(ValidationError, match="forecastWindowSeconds"):
        ServingPoolSpec.model_validate({**POOL, "autoscaling": {"forecastWindowSeconds": -1}})


def test_just_in_time_batch_launches_reach_chiron_from_the_pool_spec() -> None:
    from tessera.api.serving_pool import ServingPool
    from tessera.control.inputs import chiron_settings

    auto = {"batchJustInTime": True}
    body = {"apiVersion": "tessera.dev/v1alpha1", "kind": "ServingPool", "metadata": {"name": "p"},
            "spec": {**POOL, "autoscaling": auto}}  # fmt: skip
    settings = chiron_settings(ServingPool.model_validate(body), 8)
    assert settings.just_in_time
    plain = chiron_settings(ServingPool.model_validate({**body, "spec": POOL}), 8)
    assert not plain.just_in_time
    with pytest.raises(ValidationError, match="batchJustInTime"):
        ServingPoolSpec.model_validate({**POOL, "autoscaling": {"batchJustInTime": "soon"}})

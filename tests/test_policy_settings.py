"""Typed policy settings: each policy's model validates and round-trips; the LLMService, the worker
configuration and `tessera local up` refuse an unknown field or a wrong type, naming the field, the
policy and what it accepts; the settings reach the worker's policy."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pydantic
import pytest

from tessera.api import SpecError, load_documents
from tessera.api.worker_config import ConfigError, parse_config
from tessera.cli import main
from tessera.core.policies.isrtf import DEFAULT_GUARD_CREDIT
from tessera.core.registry import (
    POLICIES,
    describe_settings,
    make_policy,
    policy_class,
    settings_model,
    validate_settings,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = (ROOT / "examples" / "multi-model.yaml").read_text()
ISRTF_BLOCK = "    policy: isrtf\n    settings:\n      windowTokens: 50\n"

# Settings other than the defaults, in the camelCase form of configuration files (others: defaults).
SAMPLES: dict[str, dict[str, Any]] = {
    "fcfs": {},
    "edf": {},
    "priority": {"batchDelayS": 60.0},
    "sjf-oracle": {},
    "srtf-oracle": {"recheckTokens": 20, "preemptMode": "recompute"},
    "isrtf": {"predictor": "constant", "windowTokens": 20, "agingTokensPerS": 0.5, "preemptMode": "swap"},
    "qoe": {
        "horizonS": 5.0,
        "kvWatermark": 0.8,
        "quantumIterations": 4,
        "preemption": "swap",
        "kvReserve": 0.02,
        "observeWindowS": 1.0,
    },
    "qlm": {
        "deltaRg": 2.0,
        "z": 1.0,
        "tailAware": False,
        "evictMode": "recompute",
        "mipGap": 0.05,
        "modelWeightsBytes": {"m": 1e9},
        "eps": 1.5,
        "defaultBatch": 32,
    },
    "seallm": {"services": {"m": {"meanExecS": 2.0, "stdExecS": 0.5}}, "defaultExecS": 3.0},
    "round-robin-sharing": {"turnTokens": 4},
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_settings_validate_round_trip_and_are_frozen(name: str) -> None:
    settings = validate_settings(name, SAMPLES.get(name, {}))
    dumped = settings.model_dump(mode="json", by_alias=True)
    assert validate_settings(name, dumped) == settings
    assert validate_settings(name, settings) is settings
    snake = settings.model_dump()  # field names are accepted too
    assert settings_model(name).model_validate(snake) == settings
    assert validate_settings(name, {}) == settings_model(name)()
    if settings_model(name).model_fields:
        field = next(iter(settings_model(name).model_fields))
        with pytest.raises(pydantic.ValidationError, match="frozen"):
            setattr(settings, field, getattr(settings, field))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_settings_are_constructor_keywords_with_the_same_defaults(name: str) -> None:
    params = inspect.signature(policy_class(name).__init__).parameters
    for field, info in settings_model(name).model_fields.items():
        assert field in params, f"{name}: setting {field} is not a constructor keyword"
        default = params[field].default
        expected = info.get_default(call_default_factory=True)
        assert default == expected or (default is None and expected in ({}, [])), (name, field)


def test_settings_reach_the_policy() -> None:
    isrtf = make_policy("isrtf", SAMPLES["isrtf"])
    assert (isrtf.window, isrtf.aging, isrtf.preempt_mode) == (20, 0.5, "swap")
    qoe = make_policy("qoe", horizon_s=5.0)
    assert qoe.horizon_s == 5.0
    qlm = make_policy("qlm", SAMPLES["qlm"])
    assert (qlm.delta_rg, qlm.evict_mode, qlm.eps_seed) == (2.0, "recompute", 1.5)
    assert qlm.model_weights_bytes == {"m": 1e9}
    seallm = make_policy("seallm", SAMPLES["seallm"])
    assert seallm.book.stats["m"].mean_exec_s == 2.0 and seallm.book.stats["m"].std_exec_s == 0.5


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"windowToken": 50}, "unknown setting 'windowToken'"),
        ({"windowTokens": "fifty"}, "setting 'windowTokens': Input should be a valid integer"),
        ({"windowTokens": "50"}, "setting 'windowTokens': Input should be a valid integer"),  # no coercion
        ({"windowTokens": 0}, "setting 'windowTokens': Input should be greater than or equal to 1"),
        (
            {"predictor": "oracle"},
            "setting 'predictor': Input should be 'text', 'running-mean' or 'constant'",
        ),
    ],
)
def test_bad_settings_name_the_field_the_policy_and_what_it_accepts(settings: dict, problem: str) -> None:
    with pytest.raises(ValueError) as err:
        make_policy("isrtf", settings)
    message = str(err.value)
    assert "policy 'isrtf'" in message and problem in message
    assert "windowTokens (integer >= 1, default 50)" in message
    assert "predictor ('text' | 'running-mean' | 'constant', default 'text')" in message


def test_an_optional_setting_says_its_bounds_and_null() -> None:
    # The bounds of an optional number sit inside its union: they were dropped ("lateSetBackS (number").
    assert "lateSetBackS (number >= 0 or null, default 30.0)" in describe_settings("qlm")
    assert "predictorCheckpoint (string or null, default None)" in describe_settings("isrtf")
    with pytest.raises(ValueError, match=r"'lateSetBackS': Input should be greater than or equal to 0"):
        validate_settings("qlm", {"lateSetBackS": -1})
    assert validate_settings("qlm", {"lateSetBackS": None}).late_set_back_s is None


def test_a_policy_without_settings_says_so() -> None:
    with pytest.raises(ValueError, match=r"unknown setting 'window'.*policy 'fcfs' takes no settings"):
        validate_settings("fcfs", {"window": 1})
    assert describe_settings("sjf-oracle") == "policy 'sjf-oracle' takes no settings"


def test_research_ablations_are_not_settings() -> None:
    for name, ablation in [
        ("qoe", "solver"),
        ("qoe", "refiner"),
        ("qlm", "reorder"),
        ("qlm", "tokenSeeds"),
        ("seallm", "doubling"),
    ]:
        with pytest.raises(ValueError, match=f"unknown setting '{ablation}'"):
            validate_settings(name, {ablation: "x"})


def _example(block: str) -> str:
    assert ISRTF_BLOCK in EXAMPLE
    return EXAMPLE.replace(ISRTF_BLOCK, block)


BAD = [
    ("    policy: isrtf\n    settings:\n      windowToken: 50\n", "unknown setting 'windowToken'"),
    ("    policy: isrtf\n    settings:\n      windowTokens: fifty\n", "setting 'windowTokens'"),
]


@pytest.mark.parametrize(("block", "problem"), BAD)
def test_llm_service_refuses_bad_settings(block: str, problem: str) -> None:
    with pytest.raises(SpecError) as err:
        load_documents(_example(block))
    message = str(err.value)
    assert (
        "LLMService 'qwen-7b'" in message
        and "spec.scheduling.settings: bad settings for policy 'isrtf'" in message
    )
    assert problem in message and "windowTokens (integer >= 1, default 50)" in message


def test_auto_takes_no_settings() -> None:
    text = EXAMPLE.replace("    policy: qlm\n", "    policy: auto\n    settings:\n      z: 1.0\n")
    with pytest.raises(SpecError, match=r"policy 'auto' takes no settings .*got z: name the policy"):
        load_documents(text)


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"windowToken": 50}, "unknown setting 'windowToken'"),
        ({"windowTokens": 1.5}, "setting 'windowTokens'"),
    ],
)
def test_worker_config_refuses_bad_settings(settings: dict, problem: str) -> None:
    config = {
        "models": [{"name": "m", "engine": "sim"}],
        "scheduling": {"policy": "isrtf", "settings": settings},
    }
    with pytest.raises(ConfigError) as err:
        parse_config(config)
    message = str(err.value)
    assert "scheduling.settings: bad settings for policy 'isrtf'" in message and problem in message
    guard = f"guardCredit (number >= 0 and <= 10, default {DEFAULT_GUARD_CREDIT})"
    aging = "agingTokensPerS (number >= 0, default 0.0)"
    assert "Value error" not in message and guard in message and aging in message


def test_worker_config_keeps_good_settings() -> None:
    config = {
        "models": [{"name": "m", "engine": "sim"}],
        "scheduling": {"policy": "qlm", "settings": SAMPLES["qlm"]},
    }
    assert parse_config(config).scheduling.settings == SAMPLES["qlm"]


@pytest.mark.parametrize(("block", "problem"), BAD)
def test_local_up_refuses_bad_settings_before_starting(
    block: str, problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(_example(block))
    assert main(["local", "up", "-f", str(path), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "bad settings for policy 'isrtf'" in err and problem in err
    assert not (tmp_path / "run").exists()


def test_service_settings_reach_the_worker_configuration() -> None:
    from tessera.local.control_plane import LocalEngine, plan_local

    plan = plan_local(load_documents(EXAMPLE), LocalEngine())
    by_policy = {i.config.scheduling.policy: i.config.scheduling.settings for i in plan.instances}
    # isrtf: the service's settings, plus its predictor block (the text predictor, its encoder, and
    # online learning, on by default)
    assert by_policy["isrtf"] == {
        "windowTokens": 50,
        "predictor": "text",
        "predictorEncoder": "sentence-transformers/all-MiniLM-L6-v2",
        "predictorOnline": True,
    }
    assert by_policy["qoe"] == {"horizonS": 10}


def test_the_scheduling_doc_explains_every_setting() -> None:
    text = (ROOT / "docs" / "scheduling.md").read_text()
    section = text[text.index("## Scheduling settings") :].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    listed, policy = set(), ""
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        policy = cells[0] or policy
        listed |= {(p.strip("` "), cells[1].strip("`")) for p in policy.split(",") if cells[1] != "—"}
    for name in POLICIES:
        for field, info in settings_model(name).model_fields.items():
            assert (name, info.alias or field) in listed, (
                f"docs/scheduling.md: {name} setting {info.alias} missing"
            )


def test_worker_file_settings_build_the_policy(tmp_path: Path) -> None:
    from tessera.api.worker_config import load_config

    path = tmp_path / "worker.yaml"
    path.write_text(
        "models: [{name: m, engine: sim}]\n"
        "scheduling:\n"
        "  policy: isrtf\n"
        "  settings: {predictor: constant, windowTokens: 20, agingTokensPerS: 0.5}\n"
    )
    policy = load_config(path).make_policy()
    assert (policy.window, policy.aging) == (20, 0.5)
    path.write_text("models: [{name: m, engine: sim}]\nscheduling: {policy: isrtf, settings: {window: 20}}\n")
    expected = f"invalid worker configuration {path}:\n  scheduling.settings: bad settings for policy 'isrtf'"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config(path)

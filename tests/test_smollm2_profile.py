"""The measured CPU step profile of SmolLM2: shipped by name, and what local workers launching it use."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import pytest

from tessera.api import load_documents
from tessera.api.worker_config import ProfileSpec
from tessera.commands import local as local_command
from tessera.commands import profile as profile_command
from tessera.core.profiles import PROFILES, load_profile
from tessera.local.control_plane import LocalEngine, plan_local
from tessera.models import cache
from tessera.models.registry import KNOWN

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_the_shipped_profile_loads_by_name_and_says_how_to_measure_it_again() -> None:
    profile = load_profile("smollm2-cpu")
    assert profile is PROFILES["smollm2-cpu"] == PROFILES[KNOWN["smollm2"].cpu_profile]
    assert "reproduce: tessera profile --launch smollm2" in profile.source
    # A CPU decode step of this model takes tens to hundreds of ms, not the GPU default's 4 ms.
    assert 0.03 < profile.decode_step(1, 200) < 1.0
    assert profile.decode_step(4, 800) > profile.decode_step(1, 200)
    assert profile.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4  # float32 K and V of 30 layers x 3 heads x 64


def _args(model: str) -> argparse.Namespace:
    return argparse.Namespace(model_dir=model, engine="vllm", vllm_url=None, dtype=None)


def test_local_workers_launching_smollm2_use_its_measured_profile(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(cache, "resolve_model", lambda value: cache.ResolvedModel(tmp_path, KNOWN[value]))
    folder, dtype, profile = local_command._launch_source(_args("smollm2"), [])
    assert (folder, dtype) == (str(tmp_path), "float32")
    assert profile == ProfileSpec.from_profile(PROFILES["smollm2-cpu"]).to_json()
    engine = LocalEngine("vllm", folder, kv_cache_gib=1, dtype=dtype, enforce_eager=True, profile=profile)
    plan = plan_local(load_documents(EXAMPLES / "demo-real.yaml"), engine)
    (model,) = plan.instances[0].config.models
    measured = PROFILES["smollm2-cpu"]
    assert model.profile.decode_c0 == measured.decode_c0 and model.profile.prefill_p1 == measured.prefill_p1
    assert model.profile != ProfileSpec()  # not the GPU-scale default


def test_a_model_folder_without_a_measured_profile_keeps_the_default(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(cache, "resolve_model", lambda value: cache.ResolvedModel(tmp_path))
    _, dtype, profile = local_command._launch_source(_args(str(tmp_path)), [])
    assert (dtype, profile) == ("auto", None)
    plan = plan_local(load_documents(EXAMPLES / "demo-real.yaml"), LocalEngine("vllm", str(tmp_path)))
    assert plan.instances[0].config.models[0].profile == ProfileSpec()


@pytest.mark.parametrize(
    "argv",
    [
        [
            "--launch",
            "smollm2",
            "--name",
            "smollm2-cpu",
            "--max-batch",
            "8",
            "--enforce-eager",
            "--out",
            "p.json",
        ],
        ["--endpoint", "http://127.0.0.1:8000", "--kv-capacity-tokens", "4096", "--max-model-len", "1024"],
    ],
)
def test_the_recorded_command_parses_back_to_the_same_measurement(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    profile_command.add_arguments(parser)
    args = parser.parse_args(argv)
    command = profile_command.reproduce_command(args)
    assert command.startswith("tessera profile ")
    assert vars(parser.parse_args(shlex.split(command)[2:])) == vars(args)


def test_profile_needs_the_kv_size_of_a_running_server(capsys) -> None:
    from tessera.cli import main

    assert main(["profile", "--endpoint", "http://127.0.0.1:9"]) == 2
    assert "--kv-capacity-tokens is required with --endpoint" in capsys.readouterr().err


def test_every_shipped_profile_reaches_a_worker_configuration() -> None:
    """Local mode hands a model's profile to its workers: the re-measured smollm2-cpu fit has no fixed
    prefill part (prefill_p0 0), which the worker configuration refused, so no SmolLM2 worker started."""
    from tessera.api.worker_config import ProfileSpec
    from tessera.core.profiles import PROFILES

    for profile in PROFILES.values():
        spec = ProfileSpec.from_profile(profile)
        assert spec.to_profile(profile.name, profile.kv_capacity_tokens).prefill(100) > 0
    with pytest.raises(ValueError, match="both 0"):
        ProfileSpec(prefill_p0=0, prefill_p1=0)

"""``tessera models pull`` for real: a build from the tiny-model builder (once, then only verified,
rebuilt when damaged, refused when its answer check fails), and one real SmolLM2 build (slow)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tessera.models.cache import MANIFEST, ModelCacheError, cached_model, inspect_folder, resolve_model
from tessera.models.pull import pull
from tessera.models.registry import SMOLLM2, KnownModel
from tessera.models.tiny import build_tiny_model

pytestmark = [pytest.mark.integration]


def _tiny(**check: str) -> KnownModel:
    return KnownModel(name="tiny", summary="random-weight tiny Llama", build=build_tiny_model,
                      dtype="float32", **check)  # fmt: skip


def test_pull_builds_once_verifies_after_and_rebuilds_a_corrupt_folder(tmp_path: Path) -> None:
    notes: list[str] = []
    first = pull(_tiny(), tmp_path, report=notes.append)
    assert first.built and first.folder == tmp_path / "tiny" and (first.folder / MANIFEST).exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tiny.building")] == []
    weights = first.folder / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    again = pull(_tiny(), tmp_path, report=notes.append)
    assert not again.built and again.seconds < 5 and weights.stat().st_mtime_ns == stamp
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelCacheError, match=r"corrupt in the cache.*`tessera models pull tiny`"):
        cached_model("tiny", tmp_path)
    notes.clear()
    fixed = pull(_tiny(), tmp_path, report=notes.append)
    assert fixed.built and notes[0].startswith("tiny: corrupt (") and notes[0].endswith("; rebuilding")
    assert inspect_folder(fixed.folder).ok


def test_a_build_that_answers_wrong_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    model = _tiny(check_prompt="What is the capital of France?", check_expect="Paris")
    with pytest.raises(ModelCacheError, match=r"answered .* to 'What is the capital of France\?', which "
                                              r"lacks 'Paris': the build is wrong"):  # fmt: skip
        pull(model, tmp_path, report=lambda _: None)
    assert [p.name for p in tmp_path.iterdir()] == [".tiny.lock"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_smollm2_pull_answers_paris_and_second_pull_only_verifies(tmp_path: Path) -> None:
    first = pull(SMOLLM2, tmp_path, report=lambda _: None)
    assert first.built and "Paris" in (first.answer or "")
    assert (first.folder / "config.json").exists() and (first.folder / "model.safetensors").exists()
    started = time.monotonic()
    second = pull(SMOLLM2, tmp_path, report=lambda _: None)
    assert not second.built and time.monotonic() - started < 15
    assert resolve_model("smollm2", tmp_path).path == first.folder


def test_a_random_adapter_of_the_tiny_model_changes_its_greedy_answer(tmp_path: Path) -> None:
    from tessera.models.check import greedy_answer
    from tessera.models.lora import build_random_adapter

    base = build_tiny_model(tmp_path / "tiny")
    adapter = build_random_adapter(base, tmp_path / "tiny-lora", rank=8)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["peft_type"]) == (8, "LORA") and (
        adapter / "adapter_model.safetensors"
    ).exists()
    assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert greedy_answer(adapter, "hello there", 8) != greedy_answer(base, "hello there", 8)
    again = build_random_adapter(base, tmp_path / "again", rank=8)  # the same seed, the same weights
    assert (again / "adapter_model.safetensors").read_bytes() == (
        adapter / "adapter_model.safetensors"
    ).read_bytes()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_smollm2_adapter_pull_trains_an_adapter_whose_answers_differ_from_the_base(
    tmp_path: Path,
) -> None:
    from tessera.models.check import greedy_answer
    from tessera.models.lora import STYLE_MARKER
    from tessera.models.registry import SMOLLM2_LORA

    result = pull(SMOLLM2_LORA, tmp_path, report=lambda _: None)
    assert result.built and (tmp_path / "smollm2").is_dir()  # its base was pulled into the same cache
    assert (result.answer or "").startswith(STYLE_MARKER)
    assert STYLE_MARKER not in greedy_answer(tmp_path / "smollm2", SMOLLM2_LORA.check_prompt or "")

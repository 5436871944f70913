"""The model cache without building a model: cache root, manifest checks, resolving ``--model``, the
KV-fit refusal, and the CLI's messages for a model that is missing, partial or corrupt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessera.cli import main
from tessera.models.cache import (
    CACHE_ENV,
    MANIFEST,
    ModelCacheError,
    cache_root,
    cached_model,
    inspect_folder,
    resolve_model,
    write_manifest,
)
from tessera.models.fit import ModelFitError, check_kv_fits
from tessera.models.registry import KNOWN, SMOLLM2, known_model

# SmolLM2-135M's shape: 30 layers, 3 KV heads of 64 (46,080 KV bytes per token in float32).
SMOLLM2_CONFIG = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                  "hidden_size": 576, "head_dim": 64}  # fmt: skip


def _folder(path: Path, weights: bytes = b"\x01\x02" * 5000) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    (path / "model.safetensors").write_bytes(weights)
    (path / "sub").mkdir()
    (path / "sub" / "tokenizer.json").write_text("{}")
    return path


@pytest.fixture
def built(tmp_path: Path) -> Path:
    """A complete smollm2 folder in a cache under tmp_path (files stand in for the weights)."""
    folder = _folder(tmp_path / "cache" / "smollm2")
    write_manifest(folder, SMOLLM2, "The capital of France is Paris.")
    return folder


def test_cache_root_is_the_flag_then_the_environment_then_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "tessera" / "models"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(tmp_path / "flag") == tmp_path / "flag"


def test_manifest_lists_every_file_and_a_complete_folder_resolves(built: Path) -> None:
    manifest = json.loads((built / MANIFEST).read_text())
    assert set(manifest["files"]) == {"config.json", "model.safetensors", "sub/tokenizer.json"}
    assert manifest["files"]["model.safetensors"]["bytes"] == 10000
    assert manifest["dtype"] == "float32" and "Paris" in manifest["check"]["answer"]
    assert inspect_folder(built).ok
    resolved = resolve_model("smollm2", built.parent)
    assert (resolved.path, resolved.known) == (built, SMOLLM2)


def test_a_flipped_byte_is_found_by_the_checksum_a_truncation_by_the_size(built: Path) -> None:
    weights = built / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[1234] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert inspect_folder(built, checksums=False).ok  # sizes alone cannot see it
    state = inspect_folder(built)
    assert state.state == "corrupt" and "checksum" in state.detail
    weights.write_bytes(bytes(data[:-10]))
    state = inspect_folder(built, checksums=False)
    assert state.state == "corrupt" and "9990 bytes, 10000 when built" in state.detail


@pytest.mark.parametrize(
    ("damage", "state", "detail"),
    [
        (lambda f: (f / MANIFEST).unlink(), "partial", "has no tessera-model.json"),
        (lambda f: (f / "sub" / "tokenizer.json").unlink(), "partial", "tokenizer.json is missing"),
        (lambda f: (f / MANIFEST).write_text("{not json"), "corrupt", "unreadable"),
        (lambda f: (f / MANIFEST).write_text('{"files": {}}'), "corrupt", "lists no files"),
    ],
    ids=["no-manifest", "file-missing", "manifest-garbage", "manifest-empty"],
)
def test_damaged_folders_name_the_problem_and_the_pull_command(
    built: Path, damage: object, state: str, detail: str
) -> None:
    damage(built)  # type: ignore[operator]
    with pytest.raises(ModelCacheError) as err:
        cached_model("smollm2", built.parent)
    message = str(err.value)
    assert f"is {state} in the cache" in message and detail in message
    assert message.endswith("build it with `tessera models pull smollm2`")


def test_resolve_model_known_names_folders_and_mistakes(tmp_path: Path) -> None:
    with pytest.raises(ModelCacheError, match=r"'smollm2' is missing in the cache: .* does not exist; "
                                              r"build it with `tessera models pull smollm2`"):  # fmt: skip
        resolve_model("smollm2", tmp_path / "empty-cache")
    folder = _folder(tmp_path / "my-model")
    resolved = resolve_model(str(folder), tmp_path / "empty-cache")
    assert (resolved.path, resolved.known) == (folder.resolve(), None)
    with pytest.raises(
        ModelCacheError, match="neither a model folder nor a known model; known models: smollm2"
    ):
        resolve_model(str(tmp_path / "nowhere"))
    (folder / "config.json").unlink()
    with pytest.raises(ModelCacheError, match=r"has no config\.json"):
        resolve_model(str(folder))
    with pytest.raises(ValueError, match="unknown model 'gpt-5'; known models: smollm2"):
        known_model("gpt-5")
    assert known_model("smollm2") is KNOWN["smollm2"]


def test_kv_fit_refuses_with_the_numbers(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "m")
    check_kv_fits("smollm2", folder, "float32", 8192, 1)  # 0.35 GiB: fits
    with pytest.raises(ModelFitError) as err:
        check_kv_fits("smollm2", folder, "float32", 30000, 1)
    message = str(err.value)
    assert "needs 1.29 GiB of KV cache for one request of 30000 tokens" in message
    assert "46,080 bytes per token: 30 layers x 3 KV heads x 64 x 2 (K, V) x 4 bytes (float32)" in message
    assert "room for 23,301 tokens" in message
    assert "raise --kv-cache-gib to 2 or lower --max-model-len to 23301 or less" in message
    check_kv_fits("smollm2", folder, "bfloat16", 30000, 1)  # half the bytes: fits
    (folder / "config.json").write_text("{}")
    with pytest.raises(ModelFitError, match="cannot read the model's shape"):
        check_kv_fits("smollm2", folder, "float32", 16, 1)


def test_cli_list_pull_and_local_up_messages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    assert main(["models", "list"]) == 0
    assert "not built (missing): run `tessera models pull smollm2`" in capsys.readouterr().out
    assert main(["models", "pull", "nosuch"]) == 2
    assert "unknown model 'nosuch'; known models: smollm2" in capsys.readouterr().err
    spec = str(Path(__file__).resolve().parents[1] / "examples" / "demo-real.yaml")
    up = ["local", "up", "-f", spec, "--engine", "vllm", "--run-dir", str(tmp_path / "run")]
    assert main([*up, "--model", "smollm2"]) == 2
    err = capsys.readouterr().err
    assert "model 'smollm2' is missing in the cache" in err and "`tessera models pull smollm2`" in err
    assert main(up) == 2  # the spec's LLMService names smollm2: the same resolution without --model
    assert "model 'smollm2' is missing in the cache" in capsys.readouterr().err
    folder = _folder(tmp_path / "cache" / "smollm2")  # built, but its manifest never written
    assert main([*up, "--model", "smollm2"]) == 2
    assert "is partial in the cache" in capsys.readouterr().err
    write_manifest(folder, SMOLLM2, None)
    assert main(["models", "list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert (
        "smollm2      built" in listed
        and "smollm2-lora not built (missing): run `tessera models pull smollm2-lora`" in listed
    )  # names aligned on the longest
    # The spec's adapter names the pulled smollm2-lora: refused with its pull command until it is built.
    assert main([*up, "--model", "smollm2"]) == 2
    err = capsys.readouterr().err
    assert "LLMService smollm2-tessera: model 'smollm2-lora' is missing in the cache" in err
    assert "`tessera models pull smollm2-lora`" in err
    adapter = tmp_path / "cache" / "smollm2-lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    write_manifest(adapter, KNOWN["smollm2-lora"], None)
    # A model whose KV for one request cannot fit is refused before any process starts.
    assert main([*up, "--model", "smollm2", "--max-model-len", "30000"]) == 2
    assert "needs 1.29 GiB of KV cache" in capsys.readouterr().err
    assert main([*up, "--max-model-len", "30000"]) == 2
    assert "needs 1.29 GiB of KV cache" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    # --compare-policy is checked before anything starts too.
    assert main([*up, "--model", "smollm2", "--compare-policy", "fcfs"]) == 2
    assert "--compare-policy needs --trace" in capsys.readouterr().err

"""`tessera profile` against the session's real vLLM server (tiny model on CPU)."""

from __future__ import annotations

import json

import pytest
from conftest import TINY_MAX_MODEL_LEN

from tessera.cli import main
from tessera.core.profiles import load_profile


@pytest.mark.integration
def test_profile_measures_and_fits_the_real_server(vllm_server, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "tiny.json"
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    rc = main(
        [
            "profile",
            "--endpoint",
            vllm_server.url,
            "--kv-capacity-tokens",
            "65536",
            "--max-batch",
            "4",
            "--out",
            str(out),
            "--name",
            "tiny-cpu",
            "--vocab",
            str(vocab),
        ]
    )
    assert rc == 0, capsys.readouterr().err
    profile = load_profile(str(out))
    assert profile.name == "tiny-cpu" and profile.kv_capacity_tokens == 65536
    printed = capsys.readouterr().out.splitlines()
    samples = json.loads(printed[0])
    # prompts stay below the max_model_len that /v1/models reports; batches 1, 2, 4 at two prompt lengths.
    expected = [n for n in (16, 128, 256, 512, 1024) if n < TINY_MAX_MODEL_LEN]
    assert [n for n, _ in samples["prefill"]] == expected
    assert sorted({b for b, _, _ in samples["decode"]}) == [1, 2, 4]
    assert len(samples["decode"]) == 6
    # A step of the tiny model takes between 0.1 ms and 1 s here, and longer prompts cost more.
    assert 1e-4 < profile.decode_step(1, 100) < 1.0
    assert profile.prefill_p1 > 0
    assert profile.request_overhead_s >= 0
    assert "per-request overhead" in printed[1]


def test_profile_rejects_bad_flags(capsys):
    assert main(["profile", "--endpoint", "localhost:8000", "--kv-capacity-tokens", "1024"]) == 2
    assert main(["profile", "--endpoint", "http://x", "--kv-capacity-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "http(s) URL" in err and "--kv-capacity-tokens" in err

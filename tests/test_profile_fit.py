"""Named profiles carry sources; fit_profile recovers known coefficients; JSON round trip and errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tessera.core.profiles import PROFILES, Measurements, fit_profile, load_profile, save_profile


def test_named_profiles_cover_a100_h100_and_three_sizes():
    for hw in ("a100", "h100"):
        sizes = [name for name in PROFILES if name.startswith(hw)]
        assert len(sizes) == 3
    for p in PROFILES.values():
        assert p.source and p.kv_capacity_tokens > 10_000
    # H100 decodes faster than A100 for the same model (bandwidth-bound).
    assert PROFILES["h100-llama3-8b"].decode_step(32, 30_000) < PROFILES["a100-llama3-8b"].decode_step(
        32, 30_000
    )
    assert PROFILES["a100-llama-70b-tp4"].gpus == 4


def test_fit_recovers_linear_model_from_noisy_samples():
    rng = np.random.default_rng(0)
    m = Measurements()
    for n in (16, 128, 256, 512, 1024):
        m.prefill.append((n, 0.004 + 2e-5 * n + rng.normal(0, 1e-5)))
    for b in (1, 2, 4, 8, 16):
        ctx = b * 112
        m.decode.append((b, ctx, 0.003 + 4e-4 * b + 1e-6 * ctx + rng.normal(0, 1e-6)))
        m.decode.append((b, ctx * 3, 0.003 + 4e-4 * b + 3e-6 * ctx + rng.normal(0, 1e-6)))
    p = fit_profile(m, "fit", kv_capacity_tokens=8192)
    assert p.prefill_p1 == pytest.approx(2e-5, rel=0.05)
    assert p.decode_c0 == pytest.approx(0.003, rel=0.05)
    assert p.decode_c1 == pytest.approx(4e-4, rel=0.05)
    assert p.decode_c2 == pytest.approx(1e-6, rel=0.1)
    assert p.prefill_p0 == pytest.approx(0.004, rel=0.05)
    assert p.request_overhead_s == 0.0  # no overhead samples


def test_fit_takes_the_median_overhead_and_clips_negative_noise():
    m = Measurements(prefill=[(n, 0.005 + 8e-5 * n) for n in (16, 256, 1024)])
    m.decode = [(b, b * c, 0.004 + 1e-4 * b + 1e-7 * b * c) for b in (1, 4, 16) for c in (300, 600)]
    m.overhead = [0.050, 0.055, 0.2, 0.052]
    p = fit_profile(m, "fit", kv_capacity_tokens=8192)
    assert p.request_overhead_s == pytest.approx(0.0535)
    assert p.prefill_p0 == pytest.approx(0.005) and p.prefill_p1 == pytest.approx(8e-5)
    m.overhead = [-0.001, -0.002]
    assert fit_profile(m, "fit", kv_capacity_tokens=8192).request_overhead_s == 0.0


def test_fit_needs_enough_points():
    with pytest.raises(ValueError, match="prefill"):
        fit_profile(Measurements(prefill=[(1, 0.1)]), "x", kv_capacity_tokens=100)


def test_json_round_trip_and_errors(tmp_path):
    path = tmp_path / "p.json"
    save_profile(PROFILES["a100-vicuna-13b"], path)
    assert load_profile(str(path)) == PROFILES["a100-vicuna-13b"]
    with pytest.raises(ValueError, match="unknown profile"):
        load_profile("no-such-profile")
    path.write_text(json.dumps({"name": "x", "decode_c0": 0.01}))
    with pytest.raises(ValueError, match="missing profile fields"):
        load_profile(str(path))
    path.write_text(json.dumps({"bogus": 1}))
    with pytest.raises(ValueError, match="unknown profile fields"):
        load_profile(str(path))


def test_coresident_factor_is_the_lockstep_models_and_refuses_bad_samples():
    from tessera.core.profiles import CORESIDENT_COSTS, coresident_factor

    # alone 10 and 30 ms per token; together both at 40 ms: the steps serialise exactly
    assert coresident_factor([0.010, 0.030], [0.040, 0.040]) == pytest.approx(1.0)
    assert coresident_factor([0.010, 0.010], [0.015, 0.013]) == pytest.approx(0.7)  # they overlap
    for alone, together in (([0.01], [0.01]), ([0.01, 0.01], [0.01]), ([0.01, 0.0], [0.02, 0.02])):
        with pytest.raises(ValueError, match="two engines"):
            coresident_factor(alone, together)
    assert CORESIDENT_COSTS["gpu-time-slicing"].factor(2) == 1.0
    assert all(c.source for c in CORESIDENT_COSTS.values())


def test_profile_coresident_needs_a_launched_model(capsys):
    from tessera.cli import main

    assert main(["profile", "--endpoint", "http://127.0.0.1:9", "--coresident"]) == 2
    assert "--coresident needs --launch" in capsys.readouterr().err

"""real-policy and fidelity on a known real model (--set model=smollm2): the pieces that run without vLLM."""

from __future__ import annotations

import pytest

from tessera.api.worker_config import ProfileSpec, WorkerConfig
from tessera.bench import real_policy as rp
from tessera.bench.scenarios import BenchConfig
from tessera.bench.scenarios.fidelity import _shipped
from tessera.core.profiles import PROFILES

PROFILE = PROFILES["smollm2-cpu"]


def _natural(**options: object) -> rp.Natural:
    return rp.Natural.from_options("smollm2", BenchConfig("real-policy", options=dict(options)))


def test_options_are_checked() -> None:
    assert _natural().chiron_max == 8 and _natural(batch=2).batch == 2
    with pytest.raises(ValueError, match="chat_share in"):
        _natural(chat_share=1.5)
    with pytest.raises(ValueError, match="chiron_max"):
        _natural(batch=8, chiron_max=4)
    with pytest.raises(ValueError, match="max_tokens"):
        _natural(max_tokens=0)


def test_workers_get_the_measured_profile_and_chiron_moves_the_batch_within_its_bounds() -> None:
    n = _natural()
    chiron = WorkerConfig.model_validate(
        rp._natural_worker_config("http://x:1", rp.CHIRON, n, "text", PROFILE, None)
    )
    assert chiron.scheduling.policy == "fcfs" and chiron.scheduling.autoscale.enabled
    assert (chiron.scheduling.batch.min, chiron.scheduling.batch.max, chiron.scheduling.batch.start) == (
        1,
        8,
        4,
    )
    assert chiron.models[0].profile == ProfileSpec.from_profile(PROFILE)
    assert chiron.classes["chat"].slo.itl_seconds == n.itl_slo
    fcfs = WorkerConfig.model_validate(
        rp._natural_worker_config("http://x:1", "fcfs", n, "text", PROFILE, None)
    )
    assert not fcfs.scheduling.autoscale.enabled and fcfs.scheduling.batch.start == 4
    isrtf = rp._natural_worker_config("http://x:1", "isrtf", n, "text", PROFILE, "/heads/smollm2")
    assert isrtf["scheduling"]["settings"]["predictor_checkpoint"] == "/heads/smollm2"


def test_simulated_requests_end_at_their_greedy_length_within_max_tokens() -> None:
    n = _natural()
    rows = {
        "mixed": [
            {"prompt_tokens": 30, "out": 17, "response": "a"},
            {"prompt_tokens": 9, "out": 64, "response": "b"},
        ]
    }
    plans = {"mixed": [(0.0, "p0", 64, "chat"), (1.0, "p1", 64, "batch")]}
    chat, batch = rp._sim_requests(plans, rows, n)["mixed"]
    assert (chat.max_tokens, chat.true_output_tokens, batch.true_output_tokens) == (64, 17, 64)
    assert (chat.service_class.ttft_slo_s, chat.service_class.itl_slo_s) == (n.ttft_slo, n.itl_slo)
    assert chat.service_class.reading_speed_tps == n.reading_tps and batch.service_class.kind == "batch"
    # the tiny model's plans keep their lengths exactly
    (tiny, _) = rp._sim_requests(plans, rows)["mixed"]
    assert tiny.true_output_tokens == 64 and tiny.service_class.itl_slo_s is None


def _rounds(values: list[float]) -> list[dict[str, float]]:
    return [{"mean_jct_s": v, "avg_qoe": v} for v in values]


def test_checks_pair_rounds_and_say_when_real_and_simulated_ratios_disagree() -> None:
    per_round = {"fcfs:mixed": _rounds([10, 20]), "isrtf:mixed": _rounds([8, 22]),
                 "fcfs:burst": _rounds([0.5, 0.5]), "qoe:burst": _rounds([0.5, 0.505])}  # fmt: skip
    sim = {"fcfs:mixed": {"mean_jct_s": 10}, "isrtf:mixed": {"mean_jct_s": 11},
           "fcfs:burst": {"avg_qoe": 0.5}, "qoe:burst": {"avg_qoe": 0.6}}  # fmt: skip
    isrtf, qoe = rp._natural_checks(per_round, sim, ["fcfs", "isrtf", "qoe"])
    # paired ratios 0.8 and 1.1: median 0.95 (JCT lower: better); the simulator says 1.1 (worse)
    assert "real 0.950x (rounds: 0.80, 1.10)" in isrtf and "sim 1.100x: OPPOSITE DIRECTIONS" in isrtf
    assert "isrtf better than fcfs" in isrtf
    assert "one shows no difference" in qoe and "qoe as good as fcfs" in qoe


def test_fidelity_takes_a_known_models_shipped_profile() -> None:
    assert _shipped("tiny") is None
    with pytest.raises(ValueError, match="neither a model folder nor a known model"):
        _shipped("no-such-model")

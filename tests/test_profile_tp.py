"""StepProfile's tensor-parallel scaling and isolated execution time."""

import pytest

from tessera.core.profile import StepProfile

P = StepProfile("p", 0.01, 2e-4, 1e-7, 0.005, 1e-4, 100_000, gpus=2)


def test_own_degree_is_the_profile_itself():
    assert P.at_tp(2) is P


def test_more_gpus_cut_compute_and_add_communication():
    p4 = P.at_tp(4)
    speedup = 2**P.tp_efficiency
    comm = 2 * P.tp_comm_s
    assert p4.gpus == 4
    assert p4.prefill(1000) == pytest.approx(0.005 + comm + 1e-4 * 1000 / speedup)
    assert p4.decode_step(8, 4000) == pytest.approx(0.01 + comm + (2e-4 * 8 + 1e-7 * 4000) / speedup)
    assert p4.prefill(10_000) < P.prefill(10_000)  # long prefills gain
    assert p4.decode_step(1, 10) > P.decode_step(1, 10)  # short decodes pay the communication
    # fewer GPUs than measured: compute grows, no communication is saved
    assert P.at_tp(1).prefill(1000) == pytest.approx(0.005 + 1e-4 * 1000 * 2**P.tp_efficiency)
    with pytest.raises(ValueError):
        P.at_tp(0)


def test_exec_time_is_prefill_plus_each_decode_step():
    prompt, out = 300, 97
    steps = sum(P.decode_step(1, prompt + j) for j in range(1, out))
    assert P.exec_time(prompt, out) == pytest.approx(P.prefill(prompt) + steps, rel=1e-12)
    assert P.exec_time(prompt, 1) == pytest.approx(P.prefill(prompt))

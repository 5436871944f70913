"""The command line the one vLLM launcher (worker, local mode, benches, tests) builds."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.worker.engines.vllm_process import CPU_DEFAULT_BATCHED_TOKENS, VLLMServer


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_a_batch_bound_above_vllms_cpu_token_budget_raises_the_budget_with_it() -> None:
    """vLLM refuses --max-num-seqs above --max-num-batched-tokens (CPU default 2048): QLM's batch bound
    of 8192 made every local vLLM worker of the quickstart fail to start."""
    big = VLLMServer(Path("/m"), max_model_len=2048, max_num_seqs=8192).command()
    assert _flag(big, "--max-num-seqs") == "8192" and _flag(big, "--max-num-batched-tokens") == "8192"
    small = VLLMServer(Path("/m"), max_model_len=4096, max_num_seqs=CPU_DEFAULT_BATCHED_TOKENS).command()
    assert _flag(small, "--max-num-batched-tokens") is None  # vLLM's own default stands
    given = VLLMServer(
        Path("/m"), max_model_len=2048, max_num_seqs=8192, extra_args=["--max-num-batched-tokens=16384"]
    ).command()
    assert "--max-num-batched-tokens" not in given and given[-1] == "--max-num-batched-tokens=16384"


def test_a_start_that_fails_inside_with_stops_what_it_launched() -> None:
    """``with VLLMServer(...)`` stops the process group when the start fails or is interrupted, as the
    fixtures' try/finally around start() did."""
    server = VLLMServer(Path("/m"), max_model_len=2048)
    stopped: list[bool] = []

    def fail() -> VLLMServer:
        raise KeyboardInterrupt

    server.start = fail  # type: ignore[method-assign]
    server.stop = lambda: stopped.append(True)  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt), server:
        pass
    assert stopped == [True]

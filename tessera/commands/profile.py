"""`tessera profile --endpoint URL`: measure a real OpenAI-compatible vLLM server and fit a step profile."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HELP = "Measure a vLLM server's prefill and decode step times and fit a simulator profile (JSON)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags."""
    parser.add_argument(
        "--endpoint", required=True, help="base URL of the server, e.g. http://127.0.0.1:8000"
    )
    parser.add_argument("--model", help="served model name (default: the first of /v1/models)")
    parser.add_argument("--out", type=Path, default=Path("profile.json"), help="where to write the profile")
    parser.add_argument("--name", default="measured", help="profile name")
    parser.add_argument(
        "--kv-capacity-tokens", type=int, required=True, help="KV cache size of the server, in tokens"
    )
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16)")
    parser.add_argument(
        "--vocab",
        type=int,
        default=1000,
        help="prompts use random token ids below this; must not exceed the model's vocabulary size",
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=16,
        help="largest concurrency measured: the server's --max-num-seqs or less (default 16)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        help="the server's context limit (default: what /v1/models reports, else 2048)",
    )


DECODE_TOKENS = 128  # tokens per decode stream; the steady middle of the run is timed
LONG_DECODE_PROMPT = 512  # the second decode series' prompt (separates per-context from per-sequence cost)


def served_models(endpoint: str) -> list[dict]:
    """The model cards of ``/v1/models`` (vLLM adds ``max_model_len`` to each)."""
    import httpx

    resp = httpx.get(f"{endpoint}/v1/models", timeout=30)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError(f"{endpoint}/v1/models lists no model; pass --model")
    return list(data)


def first_model(endpoint: str) -> str:
    """The first model the server lists."""
    return str(served_models(endpoint)[0]["id"])


def measure_and_fit(
    endpoint: str,
    model: str,
    name: str,
    kv_capacity_tokens: int,
    block_size: int,
    vocab: int,
    max_batch: int,
    max_model_len: int = 2048,
):
    """Measure the server and return ``(profile, measurements)``.

    Concurrency doubles from 1 up to ``max_batch`` (and ``max_batch`` itself), at a short and a
    long prompt; prompts stay within ``max_model_len``.
    """
    import asyncio

    from tessera.sim.measure import measure
    from tessera.sim.profiles import fit_profile

    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    batches = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= max_batch} | {max_batch})
    lengths = [n for n in (16, 128, 256, 512, 1024) if n < max_model_len]
    long_prompt = min(LONG_DECODE_PROMPT, max_model_len - DECODE_TOKENS - 1)
    if len(lengths) < 2 or long_prompt <= 64:
        raise ValueError(
            f"max_model_len {max_model_len} is too small to measure (needs > {DECODE_TOKENS + 65})"
        )
    m = asyncio.run(
        measure(
            endpoint,
            model,
            vocab=vocab,
            batches=batches,
            prompt_lengths=lengths,
            decode_prompts=(32, long_prompt),
            decode_tokens=DECODE_TOKENS,
        )
    )
    profile = fit_profile(
        m,
        name,
        kv_capacity_tokens=kv_capacity_tokens,
        block_size=block_size,
        source=f"measured by tessera profile against {endpoint} (model {model})",
    )
    return profile, m


def run(args: argparse.Namespace) -> int:
    """Measure, fit, write JSON, print the fitted coefficients."""
    import httpx

    from tessera.sim.profiles import describe_profile, save_profile

    endpoint = args.endpoint.rstrip("/")
    if not endpoint.startswith(("http://", "https://")):
        print(f"--endpoint {endpoint!r}: expected an http(s) URL", file=sys.stderr)
        return 2
    if args.kv_capacity_tokens < args.block_size or args.block_size < 1:
        print("--kv-capacity-tokens must hold at least one --block-size block", file=sys.stderr)
        return 2
    try:
        cards = served_models(endpoint)
        model = args.model or str(cards[0]["id"])
        card = next((c for c in cards if c.get("id") == model), None)
        if card is None:
            raise ValueError(
                f"{endpoint} does not serve model {model!r}; it serves {[c.get('id') for c in cards]}"
            )
        max_len = args.max_model_len or int(card.get("max_model_len") or 2048)
        profile, m = measure_and_fit(
            endpoint,
            model,
            args.name,
            args.kv_capacity_tokens,
            args.block_size,
            args.vocab,
            args.max_batch,
            max_len,
        )
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        print(f"tessera profile: {exc}", file=sys.stderr)
        return 1
    save_profile(profile, args.out)
    print(json.dumps({"prefill": m.prefill, "decode": m.decode}))
    print(f"{args.out}: {describe_profile(profile)}")
    return 0

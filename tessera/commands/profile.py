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
    parser.add_argument("--max-batch", type=int, default=16, help="largest concurrency measured (default 16)")


def first_model(endpoint: str) -> str:
    """The first model the server lists."""
    import httpx

    resp = httpx.get(f"{endpoint}/v1/models", timeout=30)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError(f"{endpoint}/v1/models lists no model; pass --model")
    return str(data[0]["id"])


def measure_and_fit(
    endpoint: str, model: str, name: str, kv_capacity_tokens: int, block_size: int, vocab: int, max_batch: int
):
    """Measure the server and return ``(profile, measurements)``."""
    import asyncio

    from tessera.sim.measure import measure
    from tessera.sim.profiles import fit_profile

    batches = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= max_batch]
    m = asyncio.run(measure(endpoint, model, vocab=vocab, batches=batches))
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

    from tessera.sim.profiles import save_profile

    endpoint = args.endpoint.rstrip("/")
    if not endpoint.startswith(("http://", "https://")):
        print(f"--endpoint {endpoint!r}: expected an http(s) URL", file=sys.stderr)
        return 2
    if args.kv_capacity_tokens < args.block_size or args.block_size < 1:
        print("--kv-capacity-tokens must hold at least one --block-size block", file=sys.stderr)
        return 2
    try:
        model = args.model or first_model(endpoint)
        profile, m = measure_and_fit(
            endpoint, model, args.name, args.kv_capacity_tokens, args.block_size, args.vocab, args.max_batch
        )
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        print(f"tessera profile: {exc}", file=sys.stderr)
        return 1
    save_profile(profile, args.out)
    print(json.dumps({"prefill": m.prefill, "decode": m.decode}))
    print(
        f"{args.out}: decode {profile.decode_c0 * 1e3:.3f} ms + {profile.decode_c1 * 1e3:.4f} ms/seq + "
        f"{profile.decode_c2 * 1e6:.4f} us/ctx-token; prefill {profile.prefill_p0 * 1e3:.3f} ms + "
        f"{profile.prefill_p1 * 1e6:.3f} us/token"
    )
    return 0

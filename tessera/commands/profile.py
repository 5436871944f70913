"""`tessera profile --endpoint URL`: measure a real OpenAI-compatible vLLM server and fit a step profile."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tessera.bench.measure import measure_and_fit, served_models

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


def run(args: argparse.Namespace) -> int:
    """Measure, fit, write JSON, print the fitted coefficients."""
    import httpx

    from tessera.core.profiles import describe_profile, save_profile

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

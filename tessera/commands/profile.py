"""`tessera profile`: measure a real OpenAI-compatible vLLM server and fit a step profile.

``--endpoint URL`` measures a running server; ``--launch MODEL`` starts one (a model folder or a
known model, as the worker launches it: tessera.worker.engines.vllm_process) and stops it after.
The profile's ``source`` records the command that reproduces it and the load average while it ran.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from tessera.bench.measure import measure_and_fit, served_models
from tessera.core.sharing import CoResidentCost

# A real model's server on a loaded 2-core machine can take over 5 minutes to start (the worker allows 10).
START_TIMEOUT_S = 900.0
HELP = "Measure a vLLM server's prefill and decode step times and fit a simulator profile (JSON)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags."""
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--endpoint", help="base URL of a running server, e.g. http://127.0.0.1:8000")
    where.add_argument(
        "--launch",
        metavar="MODEL",
        help="start vLLM on the CPU for this model folder or known model (`tessera models list`), measure "
        "it and stop it",
    )
    parser.add_argument("--model", help="served model name (default: the first of /v1/models)")
    parser.add_argument("--out", type=Path, default=Path("profile.json"), help="where to write the profile")
    parser.add_argument("--name", default="measured", help="profile name")
    parser.add_argument(
        "--kv-capacity-tokens",
        type=int,
        help="KV cache size of the server, in tokens (required with --endpoint; with --launch: what "
        "--kv-cache-gib holds)",
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
        help="largest concurrency measured: the server's --max-num-seqs or less (default 16; with "
        "--launch, the launched server's --max-num-seqs)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        help="the server's context limit (default: what /v1/models reports, else 2048; with --launch 2048)",
    )
    parser.add_argument(
        "--decode-tokens", type=int, default=128, help="tokens per decode probe stream (default 128)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="probes per point, median kept (default 3)")
    launch = parser.add_argument_group("with --launch")
    launch.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (default 1)")
    launch.add_argument(
        "--dtype",
        choices=("auto", "float16", "bfloat16", "float32"),
        help="vLLM --dtype (default: the known model's, else auto)",
    )
    launch.add_argument("--enforce-eager", action="store_true", help="vLLM --enforce-eager (as the demo)")
    launch.add_argument(
        "--coresident",
        action="store_true",
        help="instead of a step profile, measure two servers of the model side by side (decode with "
        "--max-batch streams each, alone and together, --repeats rounds) and write the co-resident cost "
        "(the simulator's CoResidentCost) to --out",
    )


def reproduce_command(args: argparse.Namespace) -> str:
    """The `tessera profile` command line that measures this profile again."""
    argv = ["tessera", "profile"]
    argv += ["--launch", args.launch] if args.launch else ["--endpoint", args.endpoint]
    flags = [
        ("--model", args.model), ("--name", args.name), ("--kv-capacity-tokens", args.kv_capacity_tokens),
        ("--block-size", args.block_size), ("--vocab", args.vocab), ("--max-batch", args.max_batch),
        ("--max-model-len", args.max_model_len), ("--decode-tokens", args.decode_tokens),
        ("--repeats", args.repeats),
    ]  # fmt: skip
    if args.launch:
        flags += [("--kv-cache-gib", args.kv_cache_gib), ("--dtype", args.dtype)]
    if args.coresident:
        argv.append("--coresident")
    argv += [str(x) for flag, value in flags if value is not None for x in (flag, value)]
    if args.launch and args.enforce_eager:
        argv.append("--enforce-eager")
    return shlex.join([*argv, "--out", str(args.out)])


def run(args: argparse.Namespace) -> int:
    """Measure (starting the server with --launch), fit, write JSON, print the fitted coefficients."""
    import httpx

    from tessera.core.profiles import describe_profile, save_profile
    from tessera.worker.engines.vllm_process import VLLMStartError

    if args.coresident and not args.launch:
        print("--coresident needs --launch MODEL (it starts both servers)", file=sys.stderr)
        return 2
    if args.endpoint is not None:
        args.endpoint = args.endpoint.rstrip("/")
        if not args.endpoint.startswith(("http://", "https://")):
            print(f"--endpoint {args.endpoint!r}: expected an http(s) URL", file=sys.stderr)
            return 2
        if args.kv_capacity_tokens is None:
            print("--kv-capacity-tokens is required with --endpoint (the server's KV size)", file=sys.stderr)
            return 2
    if args.kv_capacity_tokens is not None and (
        args.kv_capacity_tokens < args.block_size or args.block_size < 1
    ):
        print("--kv-capacity-tokens must hold at least one --block-size block", file=sys.stderr)
        return 2
    if args.max_batch < 1 or args.kv_cache_gib < 1:
        print("--max-batch and --kv-cache-gib must be >= 1", file=sys.stderr)
        return 2
    if args.coresident:
        try:
            cost = _coresident(args)
        except (httpx.HTTPError, RuntimeError, ValueError, VLLMStartError) as exc:
            print(f"tessera profile: {exc}", file=sys.stderr)
            return 1
        from tessera.core.profiles import coresident_cost_to_dict

        args.out.write_text(json.dumps(coresident_cost_to_dict(cost), indent=2) + "\n")
        print(f"{args.out}: co-resident factor {cost.factors[0]:.3f} (2 engines)")
        print(cost.source)
        return 0
    try:
        if args.launch:
            profile, m = _launched(args)
        else:
            profile, m = _measured(args, args.endpoint, args.kv_capacity_tokens)
    except (httpx.HTTPError, RuntimeError, ValueError, VLLMStartError) as exc:
        print(f"tessera profile: {exc}", file=sys.stderr)
        return 1
    save_profile(profile, args.out)
    print(json.dumps({"prefill": m.prefill, "decode": m.decode}))
    print(f"{args.out}: {describe_profile(profile)}")
    print(profile.source)
    return 0


def _measured(args: argparse.Namespace, endpoint: str, kv_tokens: int) -> tuple:
    """Measure the server at ``endpoint``; the profile's source says how, and the machine's load."""
    from dataclasses import replace

    from tessera.bench.machine import MachineWatch

    cards = served_models(endpoint)
    model = args.model or str(cards[0]["id"])
    card = next((c for c in cards if c.get("id") == model), None)
    if card is None:
        served = [c.get("id") for c in cards]
        raise ValueError(f"{endpoint} does not serve model {model!r}; it serves {served}")
    max_len = args.max_model_len or int(card.get("max_model_len") or 2048)
    with MachineWatch() as watch:
        profile, m = measure_and_fit(
            endpoint, model, args.name, kv_tokens, args.block_size, args.vocab, args.max_batch, max_len,
            decode_tokens=args.decode_tokens, repeats=args.repeats,
        )  # fmt: skip
    load = watch.describe_load()
    source = f"{profile.source}; {load} while measuring; reproduce: {reproduce_command(args)}"
    return replace(profile, source=source), m


def _launched(args: argparse.Namespace) -> tuple:
    """Start vLLM on ``--launch``'s model as the worker does, measure it, stop it."""
    from dataclasses import replace

    from tessera.models.cache import resolve_model
    from tessera.models.fit import check_kv_fits, kv_bytes_per_token
    from tessera.worker.engines.vllm_process import VLLMServer

    resolved = resolve_model(args.launch)
    dtype = args.dtype or (resolved.known.dtype if resolved.known is not None else "auto")
    max_len = args.max_model_len or 2048
    name = resolved.known.name if resolved.known is not None else resolved.path.name
    check_kv_fits(name, resolved.path, dtype, max_len, args.kv_cache_gib)
    kv_tokens = args.kv_capacity_tokens
    if kv_tokens is None:
        kv_tokens = args.kv_cache_gib * (1 << 30) // kv_bytes_per_token(resolved.path, dtype)[0]
    server = VLLMServer(
        resolved.path, served_model_name=name, max_model_len=max_len, max_num_seqs=args.max_batch,
        kv_cache_gib=args.kv_cache_gib, dtype=dtype, start_timeout_s=START_TIMEOUT_S,
        extra_args=["--enforce-eager"] if args.enforce_eager else [],
    )  # fmt: skip
    with server:
        profile, m = _measured(args, server.url, kv_tokens)
    # what the folder says of the model's memory (the simulator's swaps and cold starts read them)
    weights = sum(f.stat().st_size for f in resolved.path.glob("*.safetensors"))
    per_token = kv_bytes_per_token(resolved.path, dtype)[0]
    return replace(profile, kv_bytes_per_token=per_token, weights_bytes=weights or profile.weights_bytes), m


def _coresident(args: argparse.Namespace) -> CoResidentCost:
    """Two servers of ``--launch``'s model on this machine: each one's seconds per decode token of
    ``--max-batch`` streams started together (their last token's time over the tokens) alone, then both
    at once, in ``--repeats`` interleaved rounds; the factor is
    the median round's (``coresident_factor``). Prefill interference is not measured."""
    import asyncio
    import statistics

    import httpx

    from tessera.bench.machine import MachineWatch
    from tessera.bench.measure import stream_completion
    from tessera.core.profiles import coresident_factor
    from tessera.models.cache import resolve_model
    from tessera.worker.engines.vllm_process import VLLMServer

    resolved = resolve_model(args.launch)
    dtype = args.dtype or (resolved.known.dtype if resolved.known is not None else "float32")
    name = resolved.known.name if resolved.known is not None else resolved.path.name
    servers = [
        VLLMServer(
            resolved.path, served_model_name=name, max_model_len=args.max_model_len or 2048,
            max_num_seqs=args.max_batch, kv_cache_gib=args.kv_cache_gib, dtype=dtype,
            start_timeout_s=START_TIMEOUT_S, extra_args=["--enforce-eager"] if args.enforce_eager else [],
        )
        for _ in range(2)
    ]  # fmt: skip

    async def per_token(client: httpx.AsyncClient, url: str) -> float:
        prompt = [10 + i for i in range(32)]
        runs = await asyncio.gather(
            *(stream_completion(client, url, name, prompt, args.decode_tokens) for _ in range(args.max_batch))
        )
        # the batch's wall time per token: a busy server merges tokens into chunks, so chunk times and
        # a stream's own first-to-last token time understate it
        return max(r.jct for r in runs) / args.decode_tokens

    async def rounds(urls: list[str]) -> list[tuple[list[float], list[float]]]:
        out = []
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
            for url in urls:  # warm-up
                await stream_completion(client, url, name, [10, 11, 12, 13], 4)
            for _ in range(args.repeats):
                alone = [await per_token(client, url) for url in urls]
                together = list(await asyncio.gather(*(per_token(client, url) for url in urls)))
                out.append((alone, together))
        return out

    with servers[0], servers[1], MachineWatch() as watch:
        measured = asyncio.run(rounds([s.url for s in servers]))
    factors = [coresident_factor(alone, together) for alone, together in measured]

    def ms(times: list[float]) -> str:
        return "/".join(f"{t * 1e3:.2f}" for t in times)

    shown = "; ".join(f"alone {ms(a)} ms, together {ms(b)} ms" for a, b in measured)
    source = (
        f"tessera profile --coresident: two vLLM servers of {name} ({dtype}), {args.max_batch} decode "
        f"streams of {args.decode_tokens} tokens each, per-token decode time per round: {shown}; "
        f"factor median of {[round(f, 3) for f in factors]}; {watch.describe_load()} while measuring; "
        f"reproduce: {reproduce_command(args)}"
    )
    return CoResidentCost((statistics.median(factors),), source=source)

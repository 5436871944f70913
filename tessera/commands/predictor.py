"""`tessera predictor`: train and evaluate the ELIS response-length predictor."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tessera.commands import positive_int

HELP = "Train and evaluate the response-length predictor (ELIS)."


def _layers(text: str) -> int | None:
    if text == "all":
        return None
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"encoder layers must be 'all' or >= 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``gen-dataset``, ``train`` and ``eval`` subcommands."""
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    gen = sub.add_parser(
        "gen-dataset",
        help="serve a model with real vLLM and record its own answers (greedy and sampled) for training",
    )
    gen.add_argument("--model", required=True, help="a known model (tessera models list) or a model folder")
    gen.add_argument("--out", required=True, type=Path, help="JSONL(.gz) to write (the trainer's format)")
    gen.add_argument(
        "--prompts", type=Path, default=None, help="JSONL(.gz) with prompt_id and prompt (default AlpacaEval)"
    )
    gen.add_argument("--limit", type=positive_int, default=None, help="only the first N prompts")
    gen.add_argument("--max-tokens", type=positive_int, default=512, help="cap on each answer (tokens)")
    gen.add_argument("--no-greedy", action="store_true", help="skip the greedy (temperature 0) answers")
    gen.add_argument("--temperature", type=float, default=0.7, help="of the sampled answers")
    gen.add_argument(
        "--seed", action="append", type=int, default=None, help="one sampled answer per seed (default: 1)"
    )
    gen.add_argument(
        "--max-num-seqs", type=positive_int, default=128, help="vLLM batch bound and concurrency"
    )
    gen.add_argument("--kv-cache-gib", type=positive_int, default=4, help="vLLM's CPU KV cache (GiB)")
    gen.add_argument(
        "--stop-after",
        type=float,
        default=None,
        help="seconds of answering after which the run stops (answers kept; run again to resume)",
    )
    gen.add_argument(
        "--export-only",
        action="store_true",
        help="start no server: write --out from the answers a stopped run kept",
    )
    gen.add_argument("--summary", type=Path, default=None, help="write the run's summary as JSON here")
    tr = sub.add_parser("train", help="train the regression head on a prompt/response JSONL(.gz)")
    tr.add_argument("--data", required=True, type=Path, help="JSONL(.gz) with prompt and response fields")
    tr.add_argument("--out", required=True, type=Path, help="folder for head.pt and head.json")
    tr.add_argument(
        "--encoder", default="auto", help="auto (BGE if cached locally, else MiniLM), minilm, or a folder"
    )
    tr.add_argument(
        "--encoder-layers",
        type=_layers,
        default=0,
        help="transformer layers kept, or 'all' (default 0: mean-pooled static token embeddings)",
    )
    tr.add_argument(
        "--no-quantize", action="store_true", help="keep the encoder in fp32 (default int8 dynamic)"
    )
    tr.add_argument(
        "--tokenizer", default=None, help="served model's tokenizer.json or folder (default MiniLM's)"
    )
    tr.add_argument(
        "--rows-per-prompt",
        type=positive_int,
        default=None,
        help="training responses per prompt (default all)",
    )
    tr.add_argument(
        "--val-rows-per-prompt", type=positive_int, default=4, help="validation responses per prompt"
    )
    tr.add_argument(
        "--val-fraction", type=float, default=0.2, help="share of prompt ids held out (default 0.2)"
    )
    tr.add_argument(
        "--split-by",
        choices=("prompt", "row"),
        default="prompt",
        help="row: each response its own split group; leaks prompts, only to compare with ELIS' figure",
    )
    tr.add_argument(
        "--exclude-source", action="append", default=[], help="drop rows whose source contains this"
    )
    tr.add_argument("--window", type=positive_int, default=50, help="ELIS re-prediction window K (tokens)")
    # CPU-budget defaults (see tessera.predictor.train); ELIS' are 16 / 16 / 1e-4.
    tr.add_argument("--epochs", type=positive_int, default=6)
    tr.add_argument("--batch-size", type=positive_int, default=256)
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    tr.add_argument(
        "--keep-outliers",
        action="store_true",
        help="train on every row (default: drop responses outside 1.5 IQR of log length, as ELIS)",
    )
    tr.add_argument("--hidden", type=positive_int, default=512)
    tr.add_argument("--depth", type=positive_int, default=8)
    tr.add_argument("--dropout", type=float, default=0.3, help="head dropout in [0, 1) (training only)")
    tr.add_argument(
        "--dev-fraction",
        type=float,
        default=0.1,
        help="share of training prompt ids that pick the best epoch (default 0.1)",
    )
    tr.add_argument("--loss", choices=("mse", "huber"), default="huber")
    tr.add_argument(
        "--cap-class",
        action="store_true",
        help="add P(the answer runs to its token cap) to the head (rows need finish_reason, max_tokens)",
    )
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")

    ev = sub.add_parser("eval", help="MAE, RMSE, R², Kendall τ of a trained predictor on a JSONL(.gz)")
    ev.add_argument("--data", required=True, type=Path, help="JSONL(.gz) with prompt and response fields")
    ev.add_argument(
        "--model",
        default=None,
        help="artifact folder, or a shipped head by name (e.g. smollm2); default: the default head",
    )
    ev.add_argument(
        "--tokenizer", default=None, help="served model's tokenizer.json or folder (default MiniLM's)"
    )
    ev.add_argument(
        "--split",
        choices=("all", "heldout"),
        default="all",
        help="heldout: the artifact's validation prompts",
    )
    ev.add_argument("--source", action="append", default=[], help="only rows whose source contains this")
    ev.add_argument("--max-rows", type=positive_int, default=None, help="evaluate a seeded sample of rows")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--latency", action="store_true", help="also time predict_remaining on batches of 16")
    ev.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    ev.add_argument("--json", type=Path, default=None, help="write the metrics as JSON here")
    ev.add_argument(
        "--online",
        action="store_true",
        help="prequential replay of every row in a seeded arrival order: predict each request, then learn "
        "from it online (the head alone, the running mean and position alone beside it)",
    )
    ev.add_argument("--passes", type=positive_int, default=1, help="--online: replays of the file")
    ev.add_argument(
        "--after", type=int, default=0, help="--online: also score the requests after the learner saw N"
    )
    ev.add_argument("--one-per-prompt", action="store_true", help="--online: one answer per prompt id")
    ev.add_argument("--refit-every", type=positive_int, default=None, help="--online: finished requests")
    ev.add_argument("--min-samples", type=positive_int, default=None, help="--online: before the first refit")
    ev.add_argument("--prior-weight", type=float, default=None, help="--online: the head's prior, samples")
    ev.add_argument(
        "--arrival-prior-weight", type=float, default=None, help="--online: arrival scalars' penalty"
    )
    ev.add_argument(
        "--embedding-prior-weight", type=float, default=None, help="--online: arrival embedding's penalty"
    )
    ev.add_argument(
        "--arrival-blend",
        choices=("validated", "full"),
        default=None,
        help="--online: the arrival correction's weight chosen on the sample, or all of it",
    )
    ev.add_argument(
        "--memory-bandwidth", type=float, default=None, help="--online: the prompt memory's (0: none)"
    )


def _print_metrics(title: str, m: dict) -> None:
    print(
        f"{title:<10} n={m['n']:<7} MAE {m['mae']:7.1f}  RMSE {m['rmse']:7.1f}  "
        f"R² {m['r2']:6.3f}  Kendall τ {m['kendall_tau']:6.3f}"
    )


def _print_ranking(title: str, m: dict) -> None:
    """What ISRTF ranks by first: τ at step 0 and within a step, then the pooled τ and MAE."""
    print(
        f"{title:<13} τ step 0 {m['step0']['kendall_tau']:6.3f}  within step {m['within_step_tau']:6.3f}  "
        f"pooled {m['kendall_tau']:6.3f}  MAE {m['mae']:6.1f} (step 0 {m['step0']['mae']:6.1f})"
        + (
            f"  per refit: τ step 0 {m['step0_tau_per_refit']:6.3f}, within step "
            f"{m['within_step_tau_per_refit']:6.3f}"
            if "step0_tau_per_refit" in m
            else ""
        )
    )


def _eval_online(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from tessera.predictor.evaluate import prequential
    from tessera.predictor.model import TextLengthPredictor
    from tessera.predictor.online import OnlineSettings

    if args.split != "all" or args.source or args.latency:
        raise ValueError("--online replays every row: it takes no --split, --source or --latency")
    if args.after < 0:
        raise ValueError(f"--after must be >= 0, got {args.after}")
    settings = OnlineSettings()
    given = {
        "refit_every": args.refit_every,
        "min_samples": args.min_samples,
        "prior_weight": args.prior_weight,
        "arrival_prior_weight": args.arrival_prior_weight,
        "embedding_prior_weight": args.embedding_prior_weight,
        "arrival_blend": args.arrival_blend,
        "memory_bandwidth": args.memory_bandwidth,
    }
    settings = replace(settings, **{k: v for k, v in given.items() if v is not None})
    predictor = TextLengthPredictor(args.model, tokenizer=args.tokenizer, threads=args.threads, online=None)
    result = prequential(
        predictor, args.data, settings, args.seed, args.passes, args.after, args.one_per_prompt, args.max_rows
    )
    segments = [("all", f"all {result['requests']} requests")]
    if args.after:
        segments.append(("after_seen", f"after the learner saw {args.after}"))
    if result["after_seen_new_prompts"] is not None:
        n_new = result["new_prompt_requests"]
        segments.append(("after_seen_new_prompts", f"of those, the {n_new} whose prompt was new"))
    for key, title in segments:
        print(f"{title} (rows {result['rows']}, passes {result['passes']}):")
        seg = result[key]
        for name in ("online", "head", "running_mean"):
            _print_ranking(name, seg[name])
        pooled = seg["position_only"]["kendall_tau"]
        print(f"{'position only':<13} τ step 0  0.000  within step  0.000  pooled {pooled:6.3f}")
    learner = result["learner"]
    print(
        f"learner: {learner['seen']} finished requests, {learner['refits']} refits installed, "
        f"{learner['rejected']} kept the head's order, {learner['failed']} failed; last arrival blend "
        f"weight {learner['blend_weight_last']:.2f}; refit time "
        f"{learner['refit_wall_s_total']:.2f} s in all (CPU {learner['refit_cpu_s_total']:.2f} s, "
        f"max {learner['refit_wall_s_max'] * 1e3:.0f} ms)"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _gen_dataset(args: argparse.Namespace) -> int:
    from tessera.bench.responses import ALPACA_PROMPTS, decodings, generate, load_prompts
    from tessera.models.cache import resolve_model

    decs = decodings(not args.no_greedy, args.temperature, args.seed if args.seed is not None else [1])
    prompts = load_prompts(args.prompts or ALPACA_PROMPTS, args.limit)
    model = resolve_model(args.model)
    name = model.known.name if model.known is not None else model.path.name
    dtype = model.known.dtype if model.known is not None and model.known.dtype != "auto" else "float32"
    if args.stop_after is not None and args.stop_after <= 0:
        raise ValueError(f"--stop-after must be > 0 seconds, got {args.stop_after}")
    summary = generate(
        model.path, name, prompts, decs, args.out, args.max_tokens, args.max_num_seqs, args.kv_cache_gib,
        dtype, args.stop_after, serve=not args.export_only,
    )  # fmt: skip
    summary |= {
        "model": name,
        "prompts": len(prompts),
        "max_tokens_cap": args.max_tokens,
        "out": str(args.out),
    }
    for dec, s in summary["decodings"].items():
        print(
            f"{dec:<12} {s['answers']} answers, mean {s['mean_tokens']:.0f} tokens "
            f"(median {s['median_tokens']}, p90 {s['p90_tokens']}, max {s['max_tokens']}), "
            f"hit the {args.max_tokens}-token cap: {s['hit_cap']} ({s['hit_cap_share']:.1%})"
        )
    print(
        f"wrote {summary['rows']} rows to {args.out} ({summary['missing']} missing: run again to resume); "
        f"this run {summary['new_rows']} answers, {summary['output_tokens']} tokens in "
        f"{summary['seconds']:.0f} s"
        + (
            ""
            if summary["output_tokens_per_s"] is None
            else f" ({summary['output_tokens_per_s']:.1f} tokens/s)"
        )
    )
    if args.summary:
        args.summary.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def run(args: argparse.Namespace) -> int:
    """Dispatch to training or evaluation; errors in inputs exit 2 with the reason."""
    from tessera.predictor.samples import StepSettings

    try:
        if args.action == "gen-dataset":
            return _gen_dataset(args)
        if args.action == "train":
            from tessera.predictor.train import TrainConfig, train

            if args.weight_decay < 0:
                raise ValueError(f"--weight-decay must be >= 0, got {args.weight_decay}")
            if not 0.0 < args.val_fraction < 1.0:
                raise ValueError(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
            if not 0.0 < args.dev_fraction < 1.0:
                raise ValueError(f"--dev-fraction must be in (0, 1), got {args.dev_fraction}")
            if not 0.0 <= args.dropout < 1.0:
                raise ValueError(f"--dropout must be in [0, 1), got {args.dropout}")
            cfg = TrainConfig(
                data=str(args.data),
                out=str(args.out),
                encoder=args.encoder,
                encoder_layers=args.encoder_layers,
                quantize=not args.no_quantize,
                tokenizer=args.tokenizer,
                steps=StepSettings(window=args.window, chunk_tokens=args.window),
                val_fraction=args.val_fraction,
                split_by=args.split_by,
                dev_fraction=args.dev_fraction,
                rows_per_prompt=args.rows_per_prompt,
                val_rows_per_prompt=args.val_rows_per_prompt,
                exclude_sources=tuple(args.exclude_source),
                hidden=args.hidden,
                depth=args.depth,
                dropout=args.dropout,
                epochs=args.epochs,
                batch_size=args.batch_size,
                lr=args.lr,
                weight_decay=args.weight_decay,
                clean_outliers=not args.keep_outliers,
                loss=args.loss,
                cap_class=args.cap_class,
                seed=args.seed,
                threads=args.threads,
            )
            meta = train(cfg)
            _print_metrics("validation", meta["validation"])
            print("train time {total:.0f} s (embedding {embedding:.0f} s)".format(**meta["seconds"]))
            return 0
        if args.online:
            return _eval_online(args)
        from tessera.predictor.evaluate import evaluate, measure_latency
        from tessera.predictor.model import TextLengthPredictor

        predictor = TextLengthPredictor(
            args.model, tokenizer=args.tokenizer, threads=args.threads, online=None
        )
        result = evaluate(predictor, args.data, args.split, tuple(args.source), args.max_rows, args.seed)
        print(
            f"Kendall τ at step 0 {result['step0']['kendall_tau']:.3f}, within a step (mean) "
            f"{result['within_step_tau']:.3f}, pooled {result['kendall_tau']:.3f} "
            f"(position only: 0, 0, {result['position_only']['kendall_tau']:.3f})"
        )
        print("τ by step: " + ", ".join(f"{k}: {v:.3f}" for k, v in result["tau_by_step"].items()))
        _print_metrics("step 0", result["step0"])
        _print_metrics("all steps", result)
        print("MAE by step: " + ", ".join(f"{k}: {v:.1f}" for k, v in result["mae_by_step"].items()))
        if args.latency:
            result["latency"] = measure_latency(predictor, args.data, seed=args.seed)
            for name in ("arrival", "window", "cold"):
                lat = result["latency"][name]
                print(
                    "latency {name:<7} batch {batch}: p50 {p50_ms:.1f} ms, p90 {p90_ms:.1f} ms".format(
                        name=name, **lat
                    )
                )
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        return 0
    except ValueError as exc:
        print(f"tessera predictor {args.action}: {exc}", file=sys.stderr)
        return 2

"""`tessera bench SCENARIO`: run a benchmark scenario side by side (the contract: docs/bench.md)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from tessera.bench.scenarios import SCENARIOS
from tessera.commands import non_negative_int, positive_float

HELP = "Replay a trace through the simulator (or a real engine) and compare policies side by side."


class ScenarioHelp(argparse.Action):
    """``-h``: the flags, and after a scenario's name (``tessera bench elis -h``) its description with
    its ``--set`` options and what it does with ``--trace`` (the scenario module's docstring)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Any = None
    ) -> None:
        parser.print_help()
        name = getattr(namespace, "scenario", None)
        if name in SCENARIOS:
            try:
                doc = importlib.import_module(SCENARIOS[name]).__doc__ or ""
            except ModuleNotFoundError as exc:
                doc = f"(not available in this build: {exc})"
            print(f"\nscenario {name}:\n\n{doc.strip()}")
        parser.exit()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the benchmark contract."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "scenarios: "
        + ", ".join(SCENARIOS)
        + "\n`tessera bench SCENARIO -h` lists a scenario's --set options."
    )
    parser.add_argument("-h", "--help", action=ScenarioHelp, help="show this help (and SCENARIO's) and exit")
    parser.add_argument("scenario", metavar="SCENARIO", help="one of: " + ", ".join(SCENARIOS))
    parser.add_argument(
        "--trace",
        type=Path,
        help="trace file (CSV or JSONL, optionally .gz): requests, or a rate series "
        "window_start_s,rate_rps[,cv] (docs/bench.md)",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--rate", type=positive_float, help="arrival rate in requests/s")
    group.add_argument("--load", type=positive_float, help="offered load relative to the measured capacity")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="random seed (default 0)")
    parser.add_argument("--json", dest="json_path", type=Path, help="write the results as JSON here")
    parser.add_argument("--plot", dest="plot_dir", type=Path, help="write PNG plots into this folder")
    parser.add_argument("--requests-csv", type=Path, help="write one CSV line per request and row")
    parser.add_argument(
        "--set",
        dest="options",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="scenario option (repeatable), e.g. --set requests=500 --set profile=a100-llama3-8b",
    )


def parse_options(items: list[str]) -> dict[str, Any]:
    """``key=value`` strings to a dict; values parse as JSON numbers/booleans when they can."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        try:
            parsed = json.loads(value)
            if not isinstance(parsed, int | float | bool):
                parsed = value
        except json.JSONDecodeError:
            parsed = value
        out[key.strip()] = parsed
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return " ".join(f"{k}={_fmt(v)}" for k, v in value.items())
    return "-" if value is None else str(value)


TABLE_KEYS = (
    "step0_tau",  # a length-ranking policy's Kendall τ at arrival (bench elis), what its order rests on
    "within_step_tau",
    "requests",
    "gpus",  # bench lora-density: the fewest GPUs that hold the target
    "worst_adapter_slo_attainment",
    "mean_ttft_s",
    "p50_ttft_s",
    "p99_ttft_s",
    "mean_itl_s",
    "mean_jct_s",
    "p50_jct_s",
    "p99_jct_s",
    "normalized_latency_mean",
    "slo_attainment",
    "slo_attainment_by_class",
    "avg_qoe",
    "throughput_rps",
    "goodput_rps",
    "gpu_seconds",
    "preemptions",
    "adapter_loads_per_request",  # LoRA benches: adapters loaded per request (adapter-cache misses)
    "swaps",
    "wall_s",
)


def _plots(module: ModuleType) -> bool:
    return callable(getattr(module, "plot", None))


def _writes_requests_csv(module: ModuleType) -> bool:
    return bool(getattr(module, "WRITES_REQUESTS_CSV", False))


def run(args: argparse.Namespace) -> int:
    """Run the scenario, print the table and checks, write JSON/plots/CSV."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from tessera.bench.scenarios import BenchConfig, Options
    from tessera.sim.cluster import SimulationStalled

    err = Console(stderr=True)
    if args.scenario not in SCENARIOS:
        err.print(f"unknown scenario {args.scenario!r}; known: {', '.join(SCENARIOS)}")
        return 2
    try:
        module = importlib.import_module(SCENARIOS[args.scenario])
    except ModuleNotFoundError as exc:
        err.print(f"scenario {args.scenario!r} is not available in this build ({exc})")
        return 2
    try:
        options = parse_options(args.options)
    except ValueError as exc:
        err.print(str(exc))
        return 2
    if args.trace is not None and not args.trace.exists():
        err.print(f"--trace {args.trace}: no such file")
        return 2
    refused = getattr(module, "TRACE_REFUSED", None)
    if args.trace is not None and refused:
        err.print(f"tessera bench {args.scenario} takes no --trace: {refused}")
        return 2
    for flag, given, has in (
        ("--plot", args.plot_dir is not None, _plots),
        ("--requests-csv", args.requests_csv is not None, _writes_requests_csv),
    ):
        if given and not has(module):
            which = ", ".join(name for name, path in SCENARIOS.items() if has(importlib.import_module(path)))
            err.print(f"tessera bench {args.scenario} has no {flag} output; the scenarios that do: {which}")
            return 2
    if args.requests_csv is not None and args.requests_csv.exists():
        args.requests_csv.unlink()  # rows are appended per policy
    config = BenchConfig(
        scenario=args.scenario,
        trace=args.trace,
        rate=args.rate,
        load=args.load,
        seed=args.seed,
        json_path=args.json_path,
        plot_dir=args.plot_dir,
        requests_csv=args.requests_csv,
        options=Options(options),
    )
    with Progress(
        TextColumn(f"[bold]{args.scenario}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=False,
    ) as bar:
        task = bar.add_task(args.scenario, total=None)

        def progress(n: int = 1, total: int | None = None) -> None:
            if total is not None:
                bar.update(task, total=total)
            if n:
                bar.advance(task, n)

        try:
            report = module.run(config, progress)
        except ValueError as exc:
            err.print(f"tessera bench {args.scenario}: {exc}")
            return 2
        except SimulationStalled as exc:
            err.print(f"tessera bench {args.scenario}: {exc}")
            return 1
    keys = [k for k in TABLE_KEYS if any(k in row for row in report.results)]
    table = Table(title=f"tessera bench {args.scenario}")
    table.add_column("policy")
    for key in keys:
        table.add_column(key, justify="right")
    for row in report.results:
        label = f" ({row['baseline']})" if row.get("baseline") else ""  # paper / strongest baseline
        table.add_row(row["policy"] + label, *(_fmt(row.get(k)) for k in keys))
    out = Console(file=sys.stdout, width=max(160, 12 * (len(keys) + 2)))
    out.print(table)
    for line in report.checks:
        out.print(line)
    if args.json_path is not None:
        args.json_path.parent.mkdir(parents=True, exist_ok=True)
        args.json_path.write_text(json.dumps(report.to_json(), indent=2, default=str) + "\n")
    if args.plot_dir is not None:
        for path in module.plot(report, args.plot_dir):
            out.print(f"plot: {path}")
    unused = config.options.unused()
    if unused:
        err.print(
            f"tessera bench {args.scenario}: --set {', '.join(unused)} had no effect: not an option of "
            "this scenario (or not used by the parts that ran, or by this --trace); "
            f"`tessera bench {args.scenario} -h` lists its options"
        )
        return 2
    return 0

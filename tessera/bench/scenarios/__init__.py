"""Benchmark scenarios of `tessera bench` (the contract: docs/bench.md).

A scenario is a module exposing:

- ``DESCRIPTION: str`` — one line for ``tessera bench --help``;
- ``run(config: BenchConfig, progress: Progress) -> BenchReport`` — runs every
  policy (or autoscaler, or placement) of the scenario on the same requests,
  seed and engine, side by side;
- optionally ``plot(report: BenchReport, out_dir: Path) -> list[Path]`` — PNGs;
- optionally ``WRITES_REQUESTS_CSV = True`` — it writes ``--requests-csv`` (the CLI refuses the flag,
  and ``--plot`` without ``plot``, before a scenario that has no such output runs);
- optionally ``TRACE_REFUSED: str`` — why it takes no ``--trace`` and what it takes instead (the CLI
  refuses the flag with it). A scenario that takes ``--trace`` loads it with
  ``tessera.bench.runner.bench_trace`` (or ``trace_arrivals``) and says in its docstring what it does
  with a trace of requests and with a rate series, refusing (``ValueError``) the parts that cannot.

Rows name what they ran by configuration name, with a variant after a colon
(``isrtf:batch=4``). Metric keys follow the contract (``mean_ttft_s``, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# scenario name -> module. Each scenario adds one line here.
SCENARIOS: dict[str, str] = {
    "baseline": "tessera.bench.scenarios.baseline",
    "perf": "tessera.bench.scenarios.perf",
    "fidelity": "tessera.bench.scenarios.fidelity",
    "elis": "tessera.bench.scenarios.elis",
    "andes": "tessera.bench.scenarios.andes",
    "qlm": "tessera.bench.scenarios.qlm",
    "chiron": "tessera.bench.scenarios.chiron",
    "seallm": "tessera.bench.scenarios.seallm",
    "load-shift": "tessera.bench.scenarios.load_shift",
    "routing": "tessera.bench.scenarios.routing",
    "scale-to-zero": "tessera.bench.scenarios.scale_to_zero",
    "worker-overhead": "tessera.bench.overhead",
    "decision-time": "tessera.bench.decision_time",
    "real-policy": "tessera.bench.real_policy",
    "real-sharing": "tessera.bench.real_sharing",
    "real-lora": "tessera.bench.real_lora",
    "router": "tessera.bench.router_overhead",
    "fair-share": "tessera.bench.scenarios.fair_share",
    "batch-job": "tessera.bench.scenarios.batch_job",
    "batch-local": "tessera.bench.batch_local",
    "lora-density": "tessera.bench.scenarios.lora_density",
    "lora-routing": "tessera.bench.scenarios.lora_routing",
}

# Progress callback: advance the bar by ``n`` steps; ``total`` (re)sets the bar's length.
Progress = Callable[..., None]


class Options(dict[str, Any]):
    """``--set`` options that remember which keys the scenario looked at.

    After a run, keys nobody read are reported as an error: an option that changes nothing must not
    pass silently (a typo such as ``--set reqests=500`` would otherwise run the default).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)

    def get(self, key: str, default: Any = None) -> Any:
        """``dict.get``, recording the look-up."""
        self.read.add(key)
        return super().get(key, default)

    def items(self):  # type: ignore[override]
        """``dict.items``; a scenario that iterates its options has seen every key."""
        self.read.update(self.keys())
        return super().items()

    def unused(self) -> list[str]:
        """Keys given but never looked at."""
        return sorted(set(self.keys()) - self.read)


@dataclass(slots=True)
class BenchConfig:
    """The benchmark contract's common flags, validated by the CLI."""

    scenario: str
    trace: Path | None = None
    rate: float | None = None  # requests/s (scales the trace or sets the synthetic rate)
    load: float | None = None  # offered load relative to capacity
    seed: int = 0
    json_path: Path | None = None
    plot_dir: Path | None = None
    requests_csv: Path | None = None  # per-request CSV (one line per request and row)
    options: dict[str, Any] = field(default_factory=dict)  # scenario-specific --set key=value

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form for the report's ``config``."""
        return {
            "trace": str(self.trace) if self.trace else None,
            "rate": self.rate,
            "load": self.load,
            "seed": self.seed,
            **self.options,
        }


@dataclass(slots=True)
class BenchReport:
    """A scenario's result: one row per policy/variant, plus target checks for people."""

    scenario: str
    config: dict[str, Any]
    results: list[dict[str, Any]]
    # Target checks for people, e.g. "isrtf:batch=1 mean JCT 18.2% below fcfs (target >= 15%): PASS".
    checks: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The contract's JSON document."""
        return {
            "scenario": self.scenario,
            "config": self.config,
            "results": self.results,
            "checks": self.checks,
        }

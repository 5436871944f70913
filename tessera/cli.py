"""The one `tessera` command line: a thin dispatcher over subcommand modules.

Each subcommand lives in its own module that exposes ``HELP`` (one line),
``add_arguments(parser)`` and ``run(args) -> int``. Modules import their heavy
dependencies inside ``run`` so that ``tessera --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Subcommand name -> module implementing it. Order is the order shown in --help.
SUBCOMMANDS: dict[str, str] = {
    "crds": "tessera.commands.crds",
    "reference": "tessera.commands.reference",
    "operator": "tessera.commands.operator",
    "worker": "tessera.commands.worker",
    "local": "tessera.commands.local",
    "router": "tessera.commands.router",
    "batch": "tessera.commands.batch",
    "bench": "tessera.commands.bench",
    "profile": "tessera.commands.profile",
    "predictor": "tessera.commands.predictor",
    "models": "tessera.commands.models",
    "version": "tessera.commands.version",
}


def build_parser() -> argparse.ArgumentParser:
    """Build the full argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="tessera",
        description="Tessera: serve many LLMs on shared GPU pools under latency SLOs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module_name in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            sp = sub.add_parser(name, help="(not available in this build)")
            sp.set_defaults(_missing=name)
            continue
        # "resolve": a subcommand may replace -h (bench's also describes the scenario named before it)
        sp = sub.add_parser(name, help=module.HELP, description=module.HELP, conflict_handler="resolve")
        module.add_arguments(sp)
        sp.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tessera` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_missing", None):
        print(f"tessera {args._missing}: not available in this build", file=sys.stderr)
        return 2
    try:
        return int(args._module.run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

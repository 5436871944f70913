"""`tessera reference`: print, write or check the configuration reference (docs/reference.md)."""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

HELP = "Print the configuration reference generated from tessera.api and the policy registry."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--out FILE`` writes the reference; ``--check FILE`` compares it; neither prints to stdout."""
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--out", metavar="FILE", type=Path, help="write the reference to FILE")
    mode.add_argument(
        "--check", metavar="FILE", type=Path, help="exit 1 with a diff when FILE differs from the reference"
    )


def stale_diff(path: Path, text: str) -> str:
    """A unified diff from ``path`` to the generated ``text``; empty when they agree."""
    current = path.read_text() if path.is_file() else ""
    return "".join(
        difflib.unified_diff(
            current.splitlines(keepends=True),
            text.splitlines(keepends=True),
            str(path),
            f"{path} (generated)",
        )
    )


def run(args: argparse.Namespace) -> int:
    """Generate the reference and print, write or check it."""
    from tessera.api.reference import reference

    text = reference()
    if args.check is not None:
        diff = stale_diff(args.check, text)
        if diff:
            sys.stdout.write(diff)
            print(f"{args.check} is stale: run `tessera reference --out {args.check}`", file=sys.stderr)
            return 1
        return 0
    if args.out is None:
        sys.stdout.write(text)
        return 0
    if args.out.is_dir():
        print(f"tessera reference: --out {args.out} is a directory", file=sys.stderr)
        return 2
    args.out.write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0

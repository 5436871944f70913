"""Shared behaviour of subcommands whose implementation has not landed yet."""

from __future__ import annotations

import argparse
import sys


def not_yet(command: str, issue: str) -> int:
    """Say clearly that a subcommand is not implemented yet and return a non-zero exit code."""
    print(f"tessera {command}: not available yet ({issue}).", file=sys.stderr)
    return 2


def add_no_arguments(parser: argparse.ArgumentParser) -> None:
    """Placeholder argument builder for pending subcommands (accepts nothing)."""

"""`tessera worker`: Run the in-pod worker: OpenAI-compatible endpoint, scheduler and engine adapter."""

from __future__ import annotations

import argparse

from tessera.commands._pending import add_no_arguments, not_yet

HELP = "Run the in-pod worker: OpenAI-compatible endpoint, scheduler and engine adapter."
add_arguments = add_no_arguments


def run(args: argparse.Namespace) -> int:
    """Report that this subcommand has not landed yet."""
    return not_yet("worker", "the worker issue")

"""`tessera local`: Run the same custom resources on one machine, without a cluster."""

from __future__ import annotations

import argparse

from tessera.commands._pending import add_no_arguments, not_yet

HELP = "Run the same custom resources on one machine, without a cluster."
add_arguments = add_no_arguments


def run(args: argparse.Namespace) -> int:
    """Report that this subcommand has not landed yet."""
    return not_yet("local", "the local mode issue")

"""`tessera predictor`: Train and evaluate the response-length predictor."""

from __future__ import annotations

import argparse

from tessera.commands._pending import add_no_arguments, not_yet

HELP = "Train and evaluate the response-length predictor."
add_arguments = add_no_arguments


def run(args: argparse.Namespace) -> int:
    """Report that this subcommand has not landed yet."""
    return not_yet("predictor", "the ELIS issue")

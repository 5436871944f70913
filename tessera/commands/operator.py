"""`tessera operator`: Run the Kubernetes operator (kopf) for ServingPool, LLMService and RequestClass."""

from __future__ import annotations

import argparse

from tessera.commands._pending import add_no_arguments, not_yet

HELP = "Run the Kubernetes operator (kopf) for ServingPool, LLMService and RequestClass."
add_arguments = add_no_arguments


def run(args: argparse.Namespace) -> int:
    """Report that this subcommand has not landed yet."""
    return not_yet("operator", "the operator issue")

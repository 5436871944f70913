"""Subcommands of the `tessera` CLI, one module each (see tessera.cli.SUBCOMMANDS), and the argparse
types they share."""

from __future__ import annotations

import argparse


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value

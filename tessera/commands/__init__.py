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


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    return _whole(text, 1)


def non_negative_int(text: str) -> int:
    """An argparse type: a whole number >= 0 (a seed: numpy's generators take no negative one)."""
    return _whole(text, 0)


def _whole(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {text}")
    return value

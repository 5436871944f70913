"""`tessera version`: print the installed version."""

from __future__ import annotations

import argparse
from importlib.metadata import PackageNotFoundError, version

HELP = "Print Tessera's version."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options."""


def run(args: argparse.Namespace) -> int:
    """Print the distribution version."""
    try:
        print(version("tessera"))
    except PackageNotFoundError:
        print("tessera (not installed)")
    return 0

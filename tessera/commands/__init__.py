"""Subcommands of the `tessera` CLI, one module each (see tessera.cli.SUBCOMMANDS)."""

"""Tessera: serving many LLMs on shared GPU pools under latency SLOs (see docs/architecture.md)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path


def _operator_namespace() -> None:
    """Make ``tessera.operator`` importable from a source checkout installed in editable mode.

    Its modules live in the top-level folder ``operator/``, which has no ``__init__.py``: a folder
    without one is only a namespace portion, so from the repository root ``import operator`` still
    finds the standard library's module. setuptools' editable finder resolves mapped packages by their
    ``__init__.py`` and so misses this one; it is registered here as the namespace package it is. An
    installed wheel carries ``tessera/operator/`` itself and needs nothing.
    """
    folder = Path(__file__).resolve().parent.parent / "operator"
    if "tessera.operator" in sys.modules or not (folder / "controller.py").is_file():
        return
    if (Path(__file__).resolve().parent / "operator").is_dir():
        return
    spec = importlib.machinery.ModuleSpec("tessera.operator", None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    module = importlib.util.module_from_spec(spec)
    sys.modules["tessera.operator"] = module
    globals()["operator"] = module  # as the import system sets a parent's attribute for its child


_operator_namespace()

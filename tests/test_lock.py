"""The lock that `make venv` installs still satisfies pyproject.toml: a dependency added or a range
changed without `make lock` fails here, naming the package, instead of as an import error elsewhere."""

from __future__ import annotations

import platform
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
# The extras `make lock` compiles (LOCK_EXTRAS in the Makefile).
LOCKED_EXTRAS = ("dev", "predictor", "models", "vllm")
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def _lock_path() -> Path:
    return ROOT / "requirements" / f"lock-{platform.machine()}.txt"


def _locked() -> dict[str, tuple[str, list[str]]]:
    """Each locked package's version and the hashes its entry lists."""
    entries: dict[str, tuple[str, list[str]]] = {}
    name = ""
    for line in _lock_path().read_text().splitlines():
        if pin := PIN.match(line):
            name = canonicalize_name(pin[1])
            entries[name] = (pin[2], [])
        elif name and (digest := re.search(r"--hash=sha256:([0-9a-f]{64})", line)):
            entries[name][1].append(digest[1])
    return entries


def _wanted() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in LOCKED_EXTRAS:
        lines += project["optional-dependencies"][extra]
    for name in ("tools.in", "no-deps.in"):
        text = (ROOT / "requirements" / name).read_text()
        lines += [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    return [Requirement(line) for line in lines]


def test_the_lock_pins_every_package_with_its_hashes() -> None:
    locked = _locked()
    assert len(locked) > 100, f"{_lock_path()} locks only {len(locked)} packages"
    assert not [name for name, (_, hashes) in locked.items() if not hashes]


def test_every_dependency_of_pyproject_is_locked_within_its_range() -> None:
    locked = _locked()
    stale = []
    for req in _wanted():
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        entry = locked.get(canonicalize_name(req.name))
        if entry is None:
            stale.append(f"{req} is not in the lock")
        elif not req.specifier.contains(entry[0], prereleases=True):
            stale.append(f"{req}: the lock has {entry[0]}")
    assert not stale, f"{_lock_path().name} is out of step with pyproject.toml (run make lock): {stale}"


def test_the_packages_that_break_vllm_on_cpu_stay_out_of_the_lock() -> None:
    assert not {"torchvision", "torchaudio", "torchcodec"} & set(_locked())

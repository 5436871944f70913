"""The import contract: which of Tessera's packages may import which (docs/architecture.md).

A pure core owns every mechanism that two or more places use; the API models and the control
logic shared by the operator and local mode sit above it; the shells (worker, operator, simulator,
router, model cache) import those and never each other; local mode and the benches compose
shells; the CLI may import anything. Checked over every ``import`` statement and every
``"tessera.x:Name"`` string a registry loads lazily, so a hidden edge counts like a visible one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# import name -> folder (tessera.operator, .worker and .sim live in top-level folders)
FOLDERS = {"tessera": ROOT / "tessera", "tessera.operator": ROOT / "operator",
           "tessera.worker": ROOT / "worker", "tessera.sim": ROOT / "sim"}  # fmt: skip

BELOW_SHELLS = {"core", "api", "control", "predictor"}
SHELLS = {"worker", "operator", "sim", "router", "models", "batch"}
# package -> the packages it may import (besides itself)
MAY_IMPORT: dict[str, set[str]] = {
    "core": set(),
    "api": {"core"},
    "control": {"core", "api", "sim"},
    "predictor": {"core", "api"},
    "worker": {"core", "api", "predictor"},
    "operator": {"core", "api", "control"},
    "sim": {"core", "api"},
    "router": {"core", "api", "control"},
    "models": {"core", "api"},
    "batch": {"core", "api"},
    "local": BELOW_SHELLS | {"worker", "router", "models"},
    "bench": BELOW_SHELLS | SHELLS | {"local"},
    "commands": BELOW_SHELLS | SHELLS | {"local", "bench"},
    "cli": {"commands"},
}
# Named plugins a lower layer loads by name only when configured: ISRTF's text predictor (torch).
PLUGINS = {("core", "predictor")}


def _package(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "tessera":
        raise ValueError(module)
    if len(parts) == 1 or parts[1] in {"cli", "__main__"}:
        return "cli"
    return parts[1]


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for name, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("").parts
            parts = [p for p in rel if p != "__init__"]
            module = ".".join([name, *parts])
            if name == "tessera" and parts and parts[0] in {"operator", "worker", "sim"}:
                continue
            found[module] = path
    return found


def _edges(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported tessera module, by name only) for every import and registry string."""
    edges: list[tuple[int, str, bool]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "tessera":
                edges.append((node.lineno, node.module, False))
        elif isinstance(node, ast.Import):
            edges += [(node.lineno, a.name, False) for a in node.names if a.name.split(".")[0] == "tessera"]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if text.startswith("tessera.") and " " not in text and (":" in text or text.count(".") >= 2):
                edges.append((node.lineno, text.partition(":")[0], True))
    return edges


def violations() -> list[str]:
    """Every import that breaks the contract, as 'file:line: a -> b'."""
    found = []
    for module, path in sorted(_modules().items()):
        source = _package(module)
        allowed = MAY_IMPORT[source]
        for line, target, by_name in _edges(path):
            dest = _package(target)
            if dest == source or dest in allowed or (by_name and (source, dest) in PLUGINS):
                continue
            found.append(f"{path.relative_to(ROOT)}:{line}: {source} -> {dest} ({target})")
    return found


def test_every_package_is_in_the_contract() -> None:
    packages = {_package(m) for m in _modules()}
    assert packages <= set(MAY_IMPORT), f"add to MAY_IMPORT: {sorted(packages - set(MAY_IMPORT))}"


def test_no_import_breaks_the_layering() -> None:
    found = violations()
    assert not found, "imports against the layering (docs/architecture.md):\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("source", "target", "allowed"),
    [("worker", "tessera.core.policy", True), ("worker", "tessera.sim.engine", False),
     ("operator", "tessera.worker.scheduler", False), ("core", "tessera.api", False),
     ("router", "tessera.control.children", True), ("sim", "tessera.bench.runner", False)],
)  # fmt: skip
def test_the_contract_refuses_what_it_should(source: str, target: str, allowed: bool) -> None:
    dest = _package(target)
    assert (dest == source or dest in MAY_IMPORT[source]) is allowed

"""The README is the front door: its commands exist and its CRD example is valid."""

from __future__ import annotations

import re
from pathlib import Path

from tessera.api import load_documents
from tessera.cli import SUBCOMMANDS

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_readme_yaml_example_validates() -> None:
    # whole documents (with a kind); indented excerpts of a spec are not documents on their own
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", README, flags=re.S) if "kind:" in b]
    assert blocks, "README has no YAML example"
    kinds = {type(doc).__name__ for block in blocks for doc in load_documents(block)}
    assert {"ServingPool", "LLMService", "RequestClass"} <= kinds


def test_readme_names_both_commands_and_every_subcommand() -> None:
    assert "make demo" in README and "make test" in README
    for name in SUBCOMMANDS:
        assert f"`{name}`" in README, f"README does not mention subcommand {name}"
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, flags=re.M) and re.search(r"^test:", makefile, flags=re.M)

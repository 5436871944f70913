"""docs/reference.md is generated from the API models and the policy registry, complete and in step."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tessera.api.crd import RESOURCES, crd
from tessera.api.reference import reference
from tessera.cli import main
from tessera.core.registry import POLICIES, settings_model

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference.md"


def _fields(node: dict[str, Any], path: str) -> Iterator[str]:
    for name, sub in node.get("properties", {}).items():
        yield f"{path}.{name}".lstrip(".")
        yield from _fields(sub, f"{path}.{name}")
    if "items" in node:
        yield from _fields(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _fields(node["additionalProperties"], f"{path}{{}}")


def test_the_committed_reference_matches_the_models() -> None:
    stale = "docs/reference.md is stale: run `tessera reference --out docs/reference.md`"
    assert REFERENCE.read_text() == reference(), stale


@pytest.mark.parametrize("info", RESOURCES, ids=lambda info: info.plural)
def test_every_crd_field_is_in_the_reference(info: Any) -> None:
    definition = crd(info)
    root = definition["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    kind = definition["spec"]["names"]["kind"]
    text = reference()
    for part in ("spec", "status"):
        section = text.split(f"### {kind} `{part}`\n")[1].split("\n## ")[0].split("\n### ")[0]
        listed = set(re.findall(r"^\| `([^`]+)` \|", section, flags=re.M))
        assert set(_fields(root["properties"][part], "")) <= listed, (kind, part)


def test_every_policy_setting_is_in_the_reference() -> None:
    text = reference().split("## Policy settings\n")[1]
    for name in POLICIES:
        section = text.split(f"### `{name}`\n")[1].split("\n### ")[0]
        listed = set(re.findall(r"^\| `([^`]+)` \|", section, flags=re.M))
        wanted = {info.alias or field for field, info in settings_model(name).model_fields.items()}
        assert listed == wanted, name


def test_check_fails_on_a_stale_file_and_passes_on_a_fresh_one(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "reference.md"
    path.write_text(reference().replace("Fewest instances.", "Fewest."))
    assert main(["reference", "--check", str(path)]) == 1
    assert "-| `instances.min`" in capsys.readouterr().out
    assert main(["reference", "--out", str(path)]) == 0
    assert main(["reference", "--check", str(path)]) == 0

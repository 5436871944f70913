"""Generated CRDs: in sync with the models, structural, described, with rules, subresources and columns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tessera.api.crd import RESOURCES, crd, generated_files, structural_schema
from tessera.api.llm_service import LLMServiceSpec
from tessera.api.request_class import RequestClassSpec
from tessera.api.rules import (
    ExcludedWhen,
    KeysAllowed,
    LessOrEqual,
    ListedIn,
    MutuallyExclusive,
    NoFlags,
    RequiredWhen,
    cel_validations,
)
from tessera.api.serving_pool import BatchSizeBounds, InstanceBounds, ReplacementInterval, ServingPoolSpec
from tessera.cli import main
from tessera.commands.crds import stale_report

ROOT = Path(__file__).resolve().parents[1]
CRDS = {info.kind: crd(info) for info in RESOURCES}
FORBIDDEN_KEYS = {"$ref", "$defs", "anyOf", "allOf", "oneOf", "not", "title", "const"}


def _schema(kind: str) -> dict[str, Any]:
    return CRDS[kind]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _walk(schema: dict[str, Any], path: str = ""):
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def _at(schema: dict[str, Any], json_path: str) -> dict[str, Any]:
    for part in json_path.strip(".").split("."):
        schema = schema["properties"][part]
    return schema


def test_committed_crds_match_the_models() -> None:
    report = stale_report(ROOT / "crds", generated_files())
    assert report == "", f"crds/ is stale; run `tessera crds --out crds`:\n{report}"


@pytest.mark.parametrize("kind", sorted(CRDS))
def test_schema_is_structural_and_described(kind: str) -> None:
    for path, node in _walk(_schema(kind)):
        assert not FORBIDDEN_KEYS & node.keys(), f"{kind}{path}: {FORBIDDEN_KEYS & node.keys()}"
        assert node.get("additionalProperties") is not False, path
        assert "type" in node, f"{kind}{path} has no type"
        if path.count(".") and not path.endswith(("[]", "{}")):
            assert node.get("description"), f"{kind}{path} has no description"
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path


def test_cross_field_rules_are_emitted_as_cel() -> None:
    spool = _schema("ServingPool")["properties"]["spec"]
    assert spool["x-kubernetes-validations"] == cel_validations(ServingPoolSpec.RULES)
    assert _at(spool, "instances")["x-kubernetes-validations"] == cel_validations(InstanceBounds.RULES)
    assert _at(spool, "autoscaling.batchSize")["x-kubernetes-validations"] == cel_validations(
        BatchSizeBounds.RULES
    )
    assert _at(spool, "placement.replacementInterval")["x-kubernetes-validations"] == cel_validations(
        ReplacementInterval.RULES
    )
    service = _schema("LLMService")["properties"]["spec"]
    assert service["x-kubernetes-validations"] == cel_validations(LLMServiceSpec.RULES)
    rc = _schema("RequestClass")["properties"]["spec"]
    assert rc["x-kubernetes-validations"] == cel_validations(RequestClassSpec.RULES)


def test_nested_defaults_apply_on_the_server() -> None:
    spec = _schema("ServingPool")["properties"]["spec"]["properties"]
    assert spec["autoscaling"]["default"] == {}
    assert spec["autoscaling"]["properties"]["overProvisioning"]["default"] == pytest.approx(1 / 3)
    assert "default" not in spec["instances"]  # required: no default


def test_names_categories_and_subresources() -> None:
    names = {kind: c["spec"]["names"] for kind, c in CRDS.items()}
    assert "pool" in names["ServingPool"]["shortNames"]
    assert "llms" in names["LLMService"]["shortNames"]
    assert names["RequestClass"]["shortNames"] == ["rc"]
    for kind, c in CRDS.items():
        assert names[kind]["categories"] == ["tessera"]
        assert c["spec"]["scope"] == "Namespaced"
        assert c["spec"]["versions"][0]["subresources"]["status"] == {}
    scale = CRDS["ServingPool"]["spec"]["versions"][0]["subresources"]["scale"]
    schema = _schema("ServingPool")
    assert _at(schema, scale["specReplicasPath"])["type"] == "integer"
    assert _at(schema, scale["statusReplicasPath"])["type"] == "integer"
    assert _at(schema, scale["labelSelectorPath"])["type"] == "string"


@pytest.mark.parametrize("kind", sorted(CRDS))
def test_printer_columns_point_at_fields_of_their_type(kind: str) -> None:
    columns = CRDS[kind]["spec"]["versions"][0]["additionalPrinterColumns"]
    assert columns[-1]["jsonPath"] == ".metadata.creationTimestamp"
    for column in columns[:-1]:
        assert _at(_schema(kind), column["jsonPath"])["type"] == column["type"], column


def test_unsupported_union_is_refused() -> None:
    from pydantic import BaseModel

    from tessera.api.crd import SchemaError

    class Bad(BaseModel):
        value: int | str

    with pytest.raises(SchemaError, match="unions other than Optional"):
        structural_schema(Bad)


def test_cli_prints_writes_and_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crds"]) == 0
    printed = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert [d["spec"]["names"]["kind"] for d in printed] == ["ServingPool", "LLMService", "RequestClass"]

    out = tmp_path / "crds"
    assert main(["crds", "--out", str(out)]) == 0
    assert main(["crds", "--check", str(out)]) == 0
    capsys.readouterr()

    target = out / "servingpools.tessera.dev.yaml"
    target.write_text(target.read_text().replace("shortNames:", "shortNamez:"))
    (out / "old.yaml").write_text("kind: Old\n")
    assert main(["crds", "--check", str(out)]) == 1
    report = capsys.readouterr().out
    assert "-    shortNamez:" in report and "+    shortNames:" in report
    assert "old.yaml: not generated by tessera crds" in report


PARITY_CASES = [
    (
        LessOrEqual("min", "max"),
        [{}, {"min": 1}, {"min": 1, "max": 2}, {"min": 2, "max": 2}, {"min": 3, "max": 2}],
    ),
    (
        RequiredWhen("slo.deadlineSeconds", "kind", "batch"),
        [
            {},
            {"kind": "batch"},
            {"kind": "batch", "slo": {}},
            {"kind": "batch", "slo": {"deadlineSeconds": 1.0}},
            {"kind": "interactive"},
        ],
    ),
    (MutuallyExclusive("source", "volume"), [{}, {"source": "s3://x"}, {"source": "s3://x", "volume": {}}]),
    (
        ListedIn("defaultClass", "requestClasses"),
        [
            {},
            {"defaultClass": "a"},
            {"defaultClass": "a", "requestClasses": [{"name": "a"}]},
            {"defaultClass": "b", "requestClasses": [{"name": "a"}]},
        ],
    ),
    (
        NoFlags("args", ("--port", "--model")),
        [{}, {"args": ["--x"]}, {"args": ["--port=1"]}, {"args": ["--model"]}],
    ),
    (NoFlags("args", ("--port",)), [{"args": ["--portable"]}, {"args": ["--port"]}]),
    (
        KeysAllowed("settings", "policy", (("a", ("x", "y")), ("b", ()))),
        [
            {"policy": "a"},
            {"policy": "a", "settings": {}},
            {"policy": "a", "settings": {"x": 1, "y": {"z": 2}}},
            {"policy": "a", "settings": {"x": 1, "w": 2}},
            {"policy": "b", "settings": {}},
            {"policy": "b", "settings": {"x": 1}},
            {"policy": "c", "settings": {}},
            {"policy": "c", "settings": {"x": 1}},
        ],
    ),
    (
        ExcludedWhen("s.p", "text", "e", False),
        [
            {},
            {"e": False},
            {"e": False, "s": {"p": "mean"}},
            {"e": True, "s": {"p": "text"}},
            {"e": False, "s": {"p": "text"}},
        ],
    ),
]


@pytest.mark.parametrize(("rule", "objects"), PARITY_CASES, ids=lambda v: type(v).__name__)
def test_cel_and_python_agree(rule: Any, objects: list[dict[str, Any]]) -> None:
    """Each rule's CEL (evaluated by cel-python) and its Python check accept exactly the same objects."""
    import celpy

    env = celpy.Environment()
    program = env.program(env.compile(rule.cel()))
    verdicts = [
        (bool(program.evaluate({"self": celpy.json_to_cel(o)})), rule.violation(o) is None) for o in objects
    ]
    assert all(cel == python for cel, python in verdicts), list(zip(objects, verdicts, strict=True))
    assert {cel for cel, _ in verdicts} == {True, False} or len(objects) == 2

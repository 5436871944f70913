"""A pool refuses what would make a client's choice ambiguous: two services with one model name, or
one service whose classes share a header value (each refused with a condition, the rest served)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from tessera.api import load_documents
from tessera.control.pool_plan import DUPLICATE_MODEL, INVALID_SPEC, desired_pool

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _quickstart() -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    bodies = [d.to_json() for d in load_documents(EXAMPLES / "quickstart.yaml")]
    for b in bodies:
        b["metadata"]["uid"] = "u"
    pool = next(b for b in bodies if b["kind"] == "ServingPool")
    services = [b for b in bodies if b["kind"] == "LLMService"]
    classes = [b for b in bodies if b["kind"] == "RequestClass"]
    return pool, services, classes


def test_a_second_service_with_the_same_model_name_is_refused_and_the_older_kept() -> None:
    pool, services, classes = _quickstart()
    (first,) = services
    first["metadata"]["creationTimestamp"] = "2026-01-02T00:00:00Z"
    twin = copy.deepcopy(first)
    twin["metadata"]["name"] = "aaa-twin"  # sorts first by name, but is newer
    twin["metadata"]["creationTimestamp"] = "2026-03-01T00:00:00Z"
    desired = desired_pool(pool, [twin, first], classes, None, 0.0)
    assert list(desired.services) == [first["metadata"]["name"]]
    problem = desired.rejected["aaa-twin"]
    assert problem.reason == DUPLICATE_MODEL and "already serves model" in problem.message


def test_classes_sharing_a_header_value_make_the_service_invalid() -> None:
    pool, services, classes = _quickstart()
    assert len(classes) >= 2 and len(services[0]["spec"]["requestClasses"]) >= 2
    value = classes[0]["spec"].get("match", {}).get("value") or classes[0]["metadata"]["name"]
    classes[1]["spec"]["match"] = {**classes[1]["spec"].get("match", {}), "value": value}
    desired = desired_pool(pool, services, classes, None, 0.0)
    (problem,) = desired.rejected.values()
    assert problem.reason == INVALID_SPEC and f"header value {value!r}" in problem.message

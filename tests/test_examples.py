"""Examples pass the generated CRD schema (jsonschema + CEL) and the models; invalid specs fail both.

Each file under tests/data/invalid/ states in its header what the models must say
(``# expect:``) and what the API server would say (``# server:``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tessera.api import LLMService, RequestClass, ServingPool, SpecError, load_documents
from tessera.api.crd_check import server_side_problems

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
INVALID = sorted((ROOT / "tests" / "data" / "invalid").glob("*.yaml"))


def _header(path: Path, key: str) -> str:
    lines = [
        line.removeprefix(f"# {key}: ")
        for line in path.read_text().splitlines()
        if line.startswith(f"# {key}: ")
    ]
    assert len(lines) == 1, f"{path.name} needs exactly one '# {key}:' line"
    return lines[0]


def test_examples_exist() -> None:
    assert {p.name for p in EXAMPLES} >= {"quickstart.yaml", "multi-model.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_accepted_by_the_crd_schema_and_the_models(path: Path) -> None:
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    for document in documents:
        assert server_side_problems(document) == [], document["metadata"]["name"]
    resources = load_documents(path)
    assert len(resources) == len(documents)
    # The models' JSON round-trips through the schema unchanged in meaning.
    for resource in resources:
        assert server_side_problems(resource.to_json()) == []


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_consistent(path: Path) -> None:
    """Every service names an existing pool and existing classes, and fits on the pool's GPUs."""
    resources = load_documents(path)
    pools = {r.name: r for r in resources if isinstance(r, ServingPool)}
    classes = {r.name: r.spec for r in resources if isinstance(r, RequestClass)}
    services = [r for r in resources if isinstance(r, LLMService)]
    assert pools and classes and services
    for service in services:
        pool = pools[service.spec.pool_ref.name]
        runtime = service.spec.service_classes(classes)
        assert set(runtime) == {c.name for c in service.spec.request_classes}
        assert service.spec.model.tensor_parallel_size <= pool.spec.gpu.per_instance * pool.spec.instances.max


def test_quickstart_shape() -> None:
    resources = load_documents(ROOT / "examples" / "quickstart.yaml")
    kinds = [r.kind for r in resources]
    assert kinds.count("ServingPool") == 1 and kinds.count("LLMService") == 1
    assert sorted(r.spec.kind for r in resources if isinstance(r, RequestClass)) == ["batch", "interactive"]


def test_multi_model_shares_one_pool() -> None:
    resources = load_documents(ROOT / "examples" / "multi-model.yaml")
    services = [r for r in resources if isinstance(r, LLMService)]
    assert len(services) == 3
    assert len({s.spec.pool_ref.name for s in services}) == 1
    assert len({s.spec.model.name for s in services}) == 3


def test_there_are_invalid_fixtures() -> None:
    assert len(INVALID) >= 10


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_spec_is_rejected_by_the_models_with_a_clear_message(path: Path) -> None:
    with pytest.raises(SpecError) as err:
        load_documents(path)
    assert _header(path, "expect") in str(err.value)


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_spec_is_rejected_by_the_crd_schema(path: Path) -> None:
    (document,) = [d for d in yaml.safe_load_all(path.read_text()) if d]
    problems = server_side_problems(document)
    expected = _header(path, "server")
    assert any(expected in p for p in problems), problems

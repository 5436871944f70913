"""load_documents: YAML into typed resources, with errors naming document, field and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.api import LLMService, RequestClass, ServingPool, SpecError, load_documents

POOL = """\
apiVersion: tessera.dev/v1alpha1
kind: ServingPool
metadata:
  name: h100
spec:
  gpu: {type: H100, memory: 80Gi}
  instances: {max: 2}
"""
CLASS = """\
apiVersion: tessera.dev/v1alpha1
kind: RequestClass
metadata:
  name: chat
spec:
  slo: {ttftSeconds: 1}
"""


def test_loads_every_kind_in_order(tmp_path: Path) -> None:
    service = """\
apiVersion: tessera.dev/v1alpha1
kind: LLMService
metadata: {name: llama}
spec:
  model: {name: meta-llama/Llama-3.1-8B-Instruct}
  poolRef: {name: h100}
  requestClasses: [{name: chat}]
"""
    text = "---\n".join([POOL, CLASS, service]) + "---\n"  # trailing empty document is skipped
    path = tmp_path / "all.yaml"
    path.write_text(text)
    for source in (text, str(path), path):
        resources = load_documents(source)
        assert [type(r) for r in resources] == [ServingPool, RequestClass, LLMService]
        assert [r.name for r in resources] == ["h100", "chat", "llama"]


def test_kind_list_contributes_its_items() -> None:
    text = "apiVersion: v1\nkind: List\nitems:\n" + "".join(
        "- " + doc.replace("\n", "\n  ").rstrip() + "\n" for doc in (POOL, CLASS)
    )
    assert [r.kind for r in load_documents(text)] == ["ServingPool", "RequestClass"]


def test_error_names_document_object_field_line_and_allowed_values() -> None:
    bad = CLASS.replace("slo: {ttftSeconds: 1}", "slo: {ttftSeconds: 1}\n  kind: urgent\n  prio: 3")
    with pytest.raises(SpecError) as err:
        load_documents(POOL + "---\n" + bad)
    message = str(err.value)
    assert "document 2 (line 9)" in message
    assert "RequestClass 'chat'" in message
    assert "spec.kind: Input should be 'interactive' or 'batch' (got 'urgent') [line 15]" in message
    assert (
        "spec.prio: unknown field; allowed fields here: kind, match, priority, qoe, queue, slo [line 16]"
        in message
    )


def test_every_invalid_document_is_reported() -> None:
    with pytest.raises(SpecError) as err:
        load_documents(
            POOL.replace("80Gi", "80GB") + "---\n" + CLASS.replace("ttftSeconds: 1", "ttftSeconds: -1")
        )
    message = str(err.value)
    assert "spec.gpu.memory: '80GB' is not a Kubernetes quantity" in message
    assert "spec.slo.ttftSeconds: Input should be greater than or equal to 0.001 (got -1)" in message


def test_missing_field_is_named() -> None:
    with pytest.raises(SpecError, match=r"spec.instances: required field is missing"):
        load_documents(POOL.replace("  instances: {max: 2}\n", ""))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n", "allowed kinds: ServingPool, LLMService"),
        (
            POOL.replace("v1alpha1", "v1"),
            "apiVersion 'tessera.dev/v1' is not supported; use tessera.dev/v1alpha1",
        ),
        ("- just\n- a list\n", "expected a mapping"),
        ("kind: [unclosed\n", "not valid YAML"),
        (POOL.replace("name: h100", "name: H100_pool"), "metadata.name: String should match pattern"),
    ],
)
def test_document_level_errors(text: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        load_documents(text)


def test_unreadable_path_is_reported(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read"):
        load_documents(tmp_path)  # a directory, not a file
    with pytest.raises(SpecError, match=r"missing\.yaml: cannot read: No such file"):
        load_documents(str(tmp_path / "missing.yaml"))


def test_server_metadata_and_status_are_accepted() -> None:
    text = (
        POOL.replace("  name: h100\n", "  name: h100\n  uid: abc\n  resourceVersion: '7'\n  generation: 2\n")
        + "status:\n  replicas: 2\n  conditions:\n  - {type: Ready, status: 'True', reason: Placed}\n"
    )
    (pool,) = load_documents(text)
    assert isinstance(pool, ServingPool)
    assert pool.metadata.generation == 2
    assert pool.status is not None and pool.status.conditions[0].status == "True"


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("instances: {max: 2}", "instances: {max: 1000000}",
         "spec.instances.max: Input should be less than or equal to 1000"),
        ("instances: {max: 2}", "instances: {max: 2}\n  autoscaling: {intervalSeconds: 1.0e-9}",
         "spec.autoscaling.intervalSeconds: Input should be greater than or equal to 1"),
        ("instances: {max: 2}", "instances: {max: 2}\n  autoscaling: {batchSize: {max: 1000000000}}",
         "spec.autoscaling.batchSize.max: Input should be less than or equal to 65536"),
    ],
)  # fmt: skip
def test_pool_sizes_and_periods_have_upper_and_lower_bounds(old: str, new: str, message: str) -> None:
    assert old in POOL
    with pytest.raises(SpecError, match=message):
        load_documents(POOL.replace(old, new))


@pytest.mark.parametrize("value", ["1.0e-9", ".inf", "3.0e9"])
def test_slo_seconds_are_finite_and_within_a_millisecond_and_30_days(value: str) -> None:
    with pytest.raises(SpecError, match=r"spec\.slo\.ttftSeconds"):
        load_documents(CLASS.replace("ttftSeconds: 1", f"ttftSeconds: {value}"))

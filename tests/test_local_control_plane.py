"""Local mode's control plane runs the operator's reconcile decisions; only the engine differs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessera.api import load_documents
from tessera.api.worker_config import ProfileSpec
from tessera.control.children import CONFIG_KEY
from tessera.control.pool_plan import desired_pool
from tessera.core.planners import RoleCounts, assign_roles
from tessera.local.control_plane import (
    ADMIN_TOKEN_ENV,
    LocalEngine,
    LocalPlanError,
    plan_local,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_quickstart_plans_the_operators_instances_with_the_sim_engine() -> None:
    docs = load_documents(EXAMPLES / "quickstart.yaml")
    plan = plan_local(docs, LocalEngine())
    bodies = [d.to_json() for d in docs]
    for b in bodies:
        b["metadata"]["uid"] = "x"
    operator = desired_pool(bodies[0], bodies[3:], bodies[1:3], None, 0.0)
    (group,) = operator.plan.groups
    assert len(plan.instances) == group.replicas.total
    assert [i.ordinal for i in plan.instances] == list(range(group.replicas.total))
    (cm,) = [c for c in operator.children if c["kind"] == "ConfigMap"]
    expected = json.loads(cm["data"][CONFIG_KEY])
    got = plan.instances[0].config.to_json()
    # Everything but the engine source, the step-time profile (the pool's GPUs', where local workers run
    # on this machine) and the admin token's source is the operator's configuration.
    for entry in expected["models"]:
        entry.pop("url")
        assert entry["profile"] != ProfileSpec().to_json()
        entry["profile"] = ProfileSpec().to_json()
        entry["engine"] = "sim"
    expected["admin"] = {"tokenEnv": ADMIN_TOKEN_ENV}
    assert got == expected
    assert {i.config.models[0].engine for i in plan.instances} == {"sim"}


def test_cap_vllm_sources_and_context_override() -> None:
    docs = load_documents(EXAMPLES / "multi-model.yaml")
    engine = LocalEngine("vllm", model_dir="/m", max_model_len=512, dtype="float32", enforce_eager=True)
    plan = plan_local(docs, engine, max_instances_per_group=1)
    groups = {i.group for i in plan.instances}
    assert len(plan.instances) == len(groups) >= 2
    for inst in plan.instances:
        for m in inst.config.models:
            launch = (m.launch.model_dir, m.launch.dtype, m.launch.enforce_eager)
            assert (m.engine, m.url, m.max_model_len, launch) == ("vllm", None, 512, ("/m", "float32", True))
            assert m.profile == ProfileSpec()  # the worker's default, not the pool's GPUs' step times
    measured = ProfileSpec(decode_c0=0.05, prefill_p1=0.003)
    own = LocalEngine("vllm", model_dir="/m", profile=measured.to_json())
    planned = plan_local(docs, own, max_instances_per_group=1)
    assert all(m.profile == measured for i in planned.instances for m in i.config.models)
    url = plan_local(docs, LocalEngine("vllm", vllm_url="http://127.0.0.1:9"), max_instances_per_group=1)
    assert {m.url for i in url.instances for m in i.config.models} == {"http://127.0.0.1:9"}


def test_engine_options_are_checked() -> None:
    with pytest.raises(LocalPlanError, match="exactly one of --model DIR or --vllm-url"):
        LocalEngine("vllm")
    with pytest.raises(LocalPlanError, match="need --engine vllm"):
        LocalEngine("sim", model_dir="/m")
    with pytest.raises(LocalPlanError, match=">= 1"):
        plan_local(load_documents(EXAMPLES / "quickstart.yaml"), LocalEngine(), max_instances_per_group=0)


def test_nothing_to_serve_says_why() -> None:
    docs = [d for d in load_documents(EXAMPLES / "quickstart.yaml") if d.kind != "RequestClass"]
    with pytest.raises(LocalPlanError, match="RequestClass"):
        plan_local(docs, LocalEngine())
    with pytest.raises(LocalPlanError, match="no ServingPool"):
        plan_local([d for d in docs if d.kind != "ServingPool"], LocalEngine())


def test_a_new_group_orders_its_roles_interactive_mixed_batch() -> None:
    assert assign_roles(RoleCounts(batch=1, interactive=2, mixed=1)) == (
        "interactive", "interactive", "mixed", "batch"
    )  # fmt: skip

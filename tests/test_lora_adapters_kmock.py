"""LoRA adapter LLMServices applied to a cluster (the operator under kopf against KMock's emulator): the
base's group runs vLLM with the LoRA flags, its worker configuration lists the adapter as a model of
the pod, the adapter's status shows the base's group; an adapter of too high a rank is refused on its
own status while the base and the other adapter serve."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tessera.bench.cluster import Harness, emulated_cluster, load_example
from tessera.control.adapters import INVALID_ADAPTER
from tessera.control.children import CONFIG_KEY, ENGINE_CONTAINER

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NAMESPACE = "lora"


@pytest_asyncio.fixture(loop_scope="function")
async def cluster():
    async with emulated_cluster() as harness:
        yield harness


def _adapter(base: dict[str, Any], name: str, rank: int) -> dict[str, Any]:
    doc = json.loads(json.dumps(base))
    doc["metadata"].update(name=name, uid=f"{name}-uid")
    doc["spec"]["model"] = {
        "name": f"acme/{name}",
        "adapter": {"base": base["metadata"]["name"], "source": f"/adapters/{name}", "rank": rank},
    }
    return doc


def _condition(body: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    conditions = ((body or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == type_), {})


async def test_an_applied_adapter_rides_on_its_base_group(cluster: Harness) -> None:
    docs = load_example(EXAMPLES / "quickstart.yaml", NAMESPACE)
    (base,) = [d for d in docs if d["kind"] == "LLMService"]
    support, huge = _adapter(base, "support", 8), _adapter(base, "huge", 64)
    for doc in [*docs, support, huge]:
        await cluster.create(doc)

    async def rendered() -> tuple[dict[str, Any], dict[str, Any]] | None:
        children = await cluster.children(NAMESPACE)
        sets = [o for (kind, _), o in children.items() if kind == "StatefulSet"]
        maps = [
            o for (kind, _), o in children.items() if kind == "ConfigMap" and CONFIG_KEY in o.get("data", {})
        ]
        if len(sets) != 1 or len(maps) != 1 or ("Service", "support") not in children:
            return None
        return sets[0], json.loads(maps[0]["data"][CONFIG_KEY])

    sts, config = await cluster.eventually(rendered)
    (engine,) = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == ENGINE_CONTAINER]
    args = engine["args"]
    i = args.index("--enable-lora")
    assert args[i : i + 7] == [
        "--enable-lora",
        "--max-loras",
        "1",
        "--max-lora-rank",
        "16",
        "--max-cpu-loras",
        "1",
    ]
    assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in engine["env"]
    base_model = base["spec"]["model"]["name"]
    entries = {m["name"]: m for m in config["models"]}
    assert set(entries) == {base_model, "acme/support"}  # the refused adapter is not served
    assert entries["acme/support"]["adapterOf"] == base_model
    assert entries["acme/support"]["adapterSource"] == "/adapters/support"
    assert entries["acme/support"]["url"] == entries[base_model]["url"]

    async def placed(doc: dict[str, Any]) -> dict[str, Any] | None:
        body = await cluster.get(doc)
        return body if _condition(body, "Placed").get("status") == "True" else None

    base_body, support_body = (
        await cluster.eventually(lambda: placed(base)),
        await cluster.eventually(lambda: placed(support)),
    )
    assert support_body["status"]["placement"] == base_body["status"]["placement"]
    assert support_body["status"]["endpoint"] == f"http://support.{NAMESPACE}.svc:80"

    async def refused() -> dict[str, Any] | None:
        body = await cluster.get(huge)
        return body if _condition(body, "Ready").get("reason") == INVALID_ADAPTER else None

    huge_body = await cluster.eventually(refused)
    message = _condition(huge_body, "Placed")["message"]
    assert "rank 64 is above ServingPool 'h100-pool''s maxLoraRank 16" in message

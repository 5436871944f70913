"""`tessera router`: the OpenAI endpoint in front of every worker (route by model and class, balance by
least estimated waiting time)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tessera.commands import positive_int
from tessera.router.limits import RouterLimits

HELP = "Serve one OpenAI endpoint in front of the worker instances (local backends file or cluster)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `tessera router`."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--backends", type=Path, help="Backends file (JSON/YAML; see tessera.router.backends)."
    )
    source.add_argument("--kubernetes", action="store_true",
                        help="Discover the operator's worker pods from the API server.")  # fmt: skip
    parser.add_argument(
        "--namespace", action="append", default=None,
        help="With --kubernetes: a namespace whose worker pods it routes to (repeat for several; default: "
        "the router pod's own). Only these are trusted: whoever may create pods there may add backends.",
    )  # fmt: skip
    parser.add_argument(
        "--all-namespaces", action="store_true",
        help="With --kubernetes: discover in every namespace (trusts every namespace's pod creators).",
    )  # fmt: skip
    parser.add_argument("--host", default="0.0.0.0", help="Address to listen on (default 0.0.0.0).")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on (default 8000).")
    parser.add_argument(
        "--metrics-port", type=int, default=None, metavar="PORT",
        help="Serve /metrics and /router/status on this port only (for a NetworkPolicy that admits "
        "Prometheus alone there). Default: on --port, behind an API key when --api-keys is given.",
    )  # fmt: skip
    parser.add_argument("--poll-interval", type=float, default=1.0, help="Seconds between polls (default 1).")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    from tessera.core.routing import ROUTES

    parser.add_argument(
        "--route",
        default="least-wait",
        choices=list(ROUTES),
        help="How an instance is picked for a pool that does not autoscale (one that does runs Chiron's "
        "dispatch: the fullest instance with room, else held; see tessera.router.chiron_hold) "
        "(default least-wait: class roles, then least estimated wait; "
        "cache-aware: least expected time to first token (estimated wait, the prefill still ahead there, "
        "the prefill of the prompt the instance has not cached); slo-prefix: the same among the instances "
        "that meet the class's TTFT SLO, a session's own instance first while it is one of them, then the "
        "most cached prompt; "
        "precise-prefix: most prompt blocks the instance's engine reports "
        "holding, from the KV events of the backends' kvEvents publishers, for completion prompts sent as "
        "token ids, or as text where the model's tokenizer folder is readable here; see "
        "tessera.core.routing).",
    )
    d = RouterLimits()
    limits = parser.add_argument_group("client limits (each answered with an OpenAI-style error)")
    limits.add_argument(
        "--max-body-bytes", type=int, default=d.max_body_bytes,
        help=f"Largest request body; larger: 413 (default {d.max_body_bytes}).",
    )  # fmt: skip
    limits.add_argument(
        "--max-header-bytes", type=int, default=d.max_header_bytes,
        help=f"Largest request line + headers; larger: 431 (default {d.max_header_bytes}).",
    )  # fmt: skip
    limits.add_argument(
        "--header-timeout", type=float, default=d.header_timeout_s,
        help=f"Seconds for the request line + headers; slower: 408 (default {d.header_timeout_s:g}).",
    )  # fmt: skip
    limits.add_argument(
        "--body-timeout", type=float, default=d.body_timeout_s,
        help=f"Seconds for the body to arrive; slower: 408 (default {d.body_timeout_s:g}).",
    )  # fmt: skip
    limits.add_argument(
        "--keep-alive-timeout", type=int, default=d.keep_alive_s,
        help=f"Seconds an idle kept-alive connection stays open (default {d.keep_alive_s}).",
    )  # fmt: skip
    from tessera.router.chiron_hold import MAX_HELD, ORPHAN_WAIT_S

    hold = parser.add_argument_group(
        "Chiron's dispatch (requests of pools that autoscale wait for an instance with room)"
    )
    hold.add_argument(
        "--dispatch", choices=["chiron", "route"], default="chiron",
        help="chiron (default): requests of pools that autoscale go through Chiron's dispatch; route: every "
        "request is routed on arrival by --route (the autoscaler then sees no work held in the router).",
    )  # fmt: skip
    hold.add_argument(
        "--hold-max", type=int, default=MAX_HELD,
        help=f"Requests one model may hold until an instance has room; more: 429 (default {MAX_HELD}).",
    )  # fmt: skip
    hold.add_argument(
        "--batch-orphan-wait", type=float, default=ORPHAN_WAIT_S,
        help="Seconds a held batch request waits with no batch or mixed instance of its model ready or "
        f"starting before interactive instances lend it their room (default {ORPHAN_WAIT_S:g}).",
    )  # fmt: skip
    parser.add_argument(
        "--api-keys", type=Path, default=None,
        help="API keys file (JSON/YAML, e.g. a mounted Secret; see tessera.router.auth): requests need "
        "'Authorization: Bearer <key>', answered 401/403 otherwise. Default: no authentication.",
    )  # fmt: skip
    parser.add_argument(
        "--batch-url", default=None, metavar="URL",
        help="The batch component (`tessera batch`): /v1/files and /v1/batches go there, and its lines' "
        "deadlines are trusted; the shared secret comes from TESSERA_BATCH_TOKEN. Default: no Batch API.",
    )  # fmt: skip
    quota = parser.add_argument_group("tenant quotas (the API keys file's quota of each tenant)")
    quota.add_argument(
        "--quota-redis", default=os.environ.get("TESSERA_QUOTA_REDIS_URL"), metavar="URL",
        help="Redis that every router replica counts the tenants' quotas in (redis://host:6379/0; env "
        "TESSERA_QUOTA_REDIS_URL). Default: none, each router counts alone with the whole limits.",
    )  # fmt: skip
    quota.add_argument(
        "--quota-replicas", type=positive_int, default=1, metavar="N",
        help="Router replicas sharing the quotas: while Redis is unreachable each one enforces 1/N of every "
        "limit (default 1).",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT."""
    from tessera.api.batch_link import TOKEN_ENV
    from tessera.router.app import RouterState, create_router_app
    from tessera.router.auth import ApiKeys, ApiKeysError
    from tessera.router.backends import BackendsError, load_backends
    from tessera.router.batch_proxy import BatchLink
    from tessera.router.chiron_hold import ChironHold
    from tessera.router.protocol import (
        RouterServer,
        SideServer,
        router_server_config,
        run_beside,
        side_server_config,
    )
    from tessera.router.quota import QuotaStore

    for flag, port in (("--port", args.port), ("--metrics-port", args.metrics_port)):
        if port is not None and not 0 < port < 65536:
            print(f"tessera router: {flag} {port} is not a TCP port (1-65535)", file=sys.stderr)
            return 2
    if args.metrics_port == args.port:
        print("tessera router: --metrics-port must differ from --port", file=sys.stderr)
        return 2
    if args.poll_interval <= 0:
        print("tessera router: --poll-interval must be > 0 seconds", file=sys.stderr)
        return 2
    if (args.namespace is not None or args.all_namespaces) and not args.kubernetes:
        print("tessera router: --namespace and --all-namespaces go with --kubernetes", file=sys.stderr)
        return 2
    if args.namespace is not None and args.all_namespaces:
        print("tessera router: give --namespace or --all-namespaces, not both", file=sys.stderr)
        return 2
    try:
        limits = RouterLimits(args.max_body_bytes, args.max_header_bytes, args.header_timeout,
                              args.body_timeout, args.keep_alive_timeout)  # fmt: skip
        api_keys = ApiKeys(args.api_keys) if args.api_keys is not None else None
        hold = ChironHold(args.hold_max, args.batch_orphan_wait)
        quota = QuotaStore(args.quota_redis, args.quota_replicas) if api_keys is not None else None
        batch = BatchLink(args.batch_url, os.environ.get(TOKEN_ENV, "")) if args.batch_url else None
    except (ValueError, ApiKeysError) as exc:
        print(f"tessera router: {exc}", file=sys.stderr)
        return 2
    discovery = None
    if args.kubernetes:
        from tessera.router.discovery import KubeDiscovery, own_namespace

        namespaces = args.namespace or ([] if args.all_namespaces else [own_namespace()])
        if None in namespaces:
            print("tessera router: not in a pod: give --namespace NS (repeatable) or --all-namespaces",
                  file=sys.stderr)  # fmt: skip
            return 2
        discovery = KubeDiscovery(None if args.all_namespaces else namespaces)
        backends = []
    else:
        try:
            backends = load_backends(args.backends)
        except BackendsError as exc:
            print(f"tessera router: {exc}", file=sys.stderr)
            return 2
    state = RouterState(backends, route=args.route, hold=hold if args.dispatch == "chiron" else None)
    activator = waker = None
    if discovery is not None:
        from tessera.router.activator import Activator
        from tessera.router.cluster_wake import ClusterWaker

        # Scale to zero on a cluster: groups join the activator as discovery finds them.
        waker = ClusterWaker(state)
        activator = Activator({}, {}, waker, lambda model: 0)
    app = create_router_app(state, poll_interval_s=args.poll_interval, limits=limits, api_keys=api_keys,
                            discover=discovery.discover if discovery else None, activator=activator,
                            follow=waker.follow if waker else None, freeze_gc=True, quota=quota,
                            batch=batch, ops_apart=args.metrics_port is not None)  # fmt: skip
    if discovery is not None:
        app.state.metrics.registry.register(discovery.collector())
    server = RouterServer(router_server_config(app, host=args.host, port=args.port, log_level=args.log_level))
    if args.metrics_port is None:
        server.run()
    else:
        side = SideServer(side_server_config(app, host=args.host, port=args.metrics_port,
                                             log_level=args.log_level))  # fmt: skip
        run_beside(server, side)
    return 0 if server.started else 1

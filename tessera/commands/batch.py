"""`tessera batch`: the batch component (OpenAI's Files and Batch APIs), reached through the router."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tessera.commands import positive_int

HELP = "Serve OpenAI's Files and Batch APIs behind the router, feeding jobs through it (durable state)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `tessera batch`."""
    parser.add_argument("--state-dir", type=Path, required=True,
                        help="Its database and files (on a cluster: a persistent volume).")  # fmt: skip
    parser.add_argument("--router", required=True, help="Base URL of the router the lines go through.")
    parser.add_argument("--host", default="0.0.0.0", help="Address to listen on (default 0.0.0.0).")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on (default 8000).")
    parser.add_argument("--concurrency", type=positive_int, default=64,
                        help="Lines in flight at once over all batches (default 64); the router's hold "
                             "paces them further.")  # fmt: skip
    parser.add_argument("--class", dest="class_name", default=None,
                        help="Request class of the lines (default: the one batch class).")  # fmt: skip
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT. The router's shared secret comes from ``TESSERA_BATCH_TOKEN``."""
    import uvicorn

    from tessera.api.batch_link import TOKEN_ENV
    from tessera.batch.app import create_batch_app
    from tessera.batch.feeder import Feeder, FeederSettings
    from tessera.batch.store import BatchStore

    if not 0 < args.port < 65536:
        print(f"tessera batch: --port {args.port} is not a TCP port (1-65535)", file=sys.stderr)
        return 2
    if not args.router.startswith(("http://", "https://")):
        print(f"tessera batch: --router must be an http(s) URL, got {args.router!r}", file=sys.stderr)
        return 2
    token = os.environ.get(TOKEN_ENV, "")
    if len(token) < 16:
        print(f"tessera batch: set {TOKEN_ENV} to the secret the router shares (>= 16 characters)",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        store = BatchStore(args.state_dir)
    except OSError as exc:
        print(f"tessera batch: cannot use --state-dir {args.state_dir}: {exc}", file=sys.stderr)
        return 2
    settings = FeederSettings(args.router.rstrip("/"), token, args.concurrency)
    app = create_batch_app(store, Feeder(store, settings), token, args.class_name)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    try:
        server.run()
    finally:
        store.close()
    return 0 if server.started else 1

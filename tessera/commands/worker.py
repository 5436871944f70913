"""`tessera worker`: the in-pod worker: OpenAI-compatible endpoint, scheduler and engine adapters."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "Run the in-pod worker: OpenAI-compatible endpoint, scheduler and engine adapter."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `tessera worker`."""
    parser.add_argument(
        "--config", type=Path, required=True, help="Worker configuration file (JSON or YAML)."
    )
    parser.add_argument("--host", default="0.0.0.0", help="Address to listen on (default 0.0.0.0).")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on (default 8000).")
    parser.add_argument(
        "--grace-seconds",
        type=float,
        default=30.0,
        help="On SIGTERM, how long in-flight requests may take to finish (default 30).",
    )
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; then stop accepting, let in-flight requests finish, exit 0."""
    import uvicorn

    from tessera.api.worker_config import ConfigError, load_config
    from tessera.worker.runtime import Worker
    from tessera.worker.server.app import create_app

    if not 0 < args.port < 65536:
        print(f"tessera worker: --port {args.port} is not a TCP port (1-65535)", file=sys.stderr)
        return 2
    if args.grace_seconds < 0:
        print("tessera worker: --grace-seconds must be >= 0", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"tessera worker: {exc}", file=sys.stderr)
        return 2
    worker = Worker(config, config_path=args.config)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            worker.draining = True  # /ready fails at once; new requests get 503
            super().handle_exit(sig, frame)  # type: ignore[arg-type]
            # uvicorn re-raises captured signals after its graceful shutdown, which would end the
            # process by SIGTERM; a drained worker exits 0 instead.
            self._captured_signals.clear()

    server = _Server(
        uvicorn.Config(
            create_app(worker),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=args.grace_seconds,
        )
    )
    server.run()
    return 0 if server.started else 1

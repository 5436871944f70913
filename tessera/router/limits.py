"""How much and how slowly a client may send: the router's size and time limits.

The request head (request line and headers) is limited where it is parsed, in
``tessera.router.protocol``: larger than ``max_header_bytes`` answers 431, not complete within
``header_timeout_s`` of the connection opening (or of the previous answer on a kept-alive
connection) answers 408. The body is limited as it is read, in ``tessera.router.payload``: larger
than ``max_body_bytes`` answers 413, not complete within ``body_timeout_s`` answers 408. An idle
kept-alive connection closes after ``keep_alive_s``. Every answer is an OpenAI-style error that names
the limit and its setting.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024 * 1024
# The ``tessera router`` flag of each limit (errors name the setting to change).
FLAGS = {
    "max_body_bytes": "--max-body-bytes",
    "max_header_bytes": "--max-header-bytes",
    "header_timeout_s": "--header-timeout",
    "body_timeout_s": "--body-timeout",
    "keep_alive_s": "--keep-alive-timeout",
}


@dataclass(frozen=True, slots=True)
class RouterLimits:
    """The router's limits on what one client sends (each a ``tessera router`` flag)."""

    max_body_bytes: int = 10 * MIB
    max_header_bytes: int = 32 * 1024  # request line and headers together
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    # Idle time before a kept-alive connection closes. Longer than the idle time clients keep pooled
    # connections (httpx 5 s, aiohttp 15 s): a server that closes first races a client reusing the
    # connection, and a request sent as it closes is lost unanswered (tessera bench router's fault
    # run lost one that way at 5 s). nginx's default.
    keep_alive_s: int = 75

    def __post_init__(self) -> None:
        for name, flag in FLAGS.items():
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):
                raise ValueError(f"{flag} must be a finite number > 0, got {value!r}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"--max-header-bytes must be >= 1024 (a request head needs room), "
                             f"got {self.max_header_bytes}")  # fmt: skip

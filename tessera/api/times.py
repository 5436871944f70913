"""Times as Kubernetes objects carry them: RFC 3339 UTC strings, read back as Unix seconds."""

from __future__ import annotations

from datetime import UTC, datetime


def rfc3339(now: float, *, micro: bool = False) -> str:
    """A Unix time as the RFC 3339 UTC string Kubernetes uses: second precision (conditions, status
    times), or microseconds where two writes within a second must still order (``micro``)."""
    stamp = datetime.fromtimestamp(now, UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> float | None:
    """A Kubernetes RFC 3339 time as Unix seconds; None when absent or unreadable."""
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None

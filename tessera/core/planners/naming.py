"""Stable, Kubernetes-safe names for placement groups."""

from __future__ import annotations

import hashlib
import re

_MAX_NAME = 40  # leaves room for pool prefixes and pod ordinals within the 63-character label limit


def group_name(services: tuple[str, ...], tp: int) -> str:
    """A DNS-1123 label that depends only on the sorted services and the TP size.

    A group that survives a re-placement therefore keeps its name, its StatefulSet and its pods."""
    digest = hashlib.sha1(f"{','.join(sorted(services))}|{tp}".encode()).hexdigest()[:6]
    stem = re.sub(r"[^a-z0-9-]+", "-", "-".join(sorted(services)).lower()).strip("-")
    stem = stem[: _MAX_NAME - len(digest) - 6].rstrip("-")
    return f"g-{stem}-tp{tp}-{digest}" if stem else f"g-tp{tp}-{digest}"

"""Optional API-key authentication on the router (off unless ``tessera router --api-keys FILE``).

A keys file (JSON or YAML; on a cluster, a key of a Secret mounted as a file) maps each key to a
tenant and what it may use::

    keys:
      - key: sk-team-a-0123456789abcdef     # sent as "Authorization: Bearer <key>"; >= 16 characters
        tenant: team-a
        models: [meta-llama/Llama-3.1-8B-Instruct]   # optional; left out: every model
        classes: [chat]                               # optional, RequestClass names; left out: every class
        quota:                                        # optional, per tenant (every key of a tenant: the same)
          requestsPerMinute: 600                      # each optional; left out: not limited
          tokensPerMinute: 200000                     # prompt + output tokens, as OpenAI counts them
          concurrentRequests: 32
          weight: 2                                   # fair share inside the pods (default 1)

A request without a key, or with a key not in the file, gets 401; a key used for a model or class it
may not use gets 403 (OpenAI-style bodies); a request over its tenant's quota gets 429 with
``Retry-After`` and OpenAI's rate-limit headers (``tessera.router.quota``). The file is read again
when it changes (a rotated Secret), and a file that became invalid keeps the previous keys (logged).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import Field, ValidationError

from tessera.api.base import ApiModel
from tessera.api.files import read_json_or_yaml
from tessera.api.openai_errors import ApiError
from tessera.core.quota import Limits

log = logging.getLogger(__name__)
_BEARER = "bearer"


class ApiKeysError(ValueError):
    """The keys file is invalid; the message says where and how to fix it."""


class Quota(ApiModel):
    """A tenant's limits, shared by every router replica, and its fair-share weight."""

    requests_per_minute: int | None = Field(default=None, ge=1, description="Requests per minute.")
    tokens_per_minute: int | None = Field(
        default=None, ge=1, description="Prompt + output tokens per minute."
    )
    concurrent_requests: int | None = Field(default=None, ge=1, description="Requests in flight at once.")
    weight: float = Field(default=1.0, gt=0, le=1000, description="Fair-share weight (VTC) inside the pods.")

    def limits(self) -> Limits:
        """The core's limits of this quota."""
        return Limits(self.requests_per_minute, self.tokens_per_minute, self.concurrent_requests)


class ApiKey(ApiModel):
    """One key and what its tenant may use."""

    key: str = Field(min_length=16, max_length=256, pattern=r"^[\x21-\x7e]+$",
                     description="The secret (printable ASCII, no spaces).")  # fmt: skip
    tenant: str = Field(min_length=1, max_length=253, description="Who holds the key (logs, errors).")
    models: list[str] | None = Field(default=None, min_length=1, description="Models allowed; None: all.")
    classes: list[str] | None = Field(default=None, min_length=1, description="Classes allowed; None: all.")
    quota: Quota = Field(default_factory=Quota, description="The tenant's limits and fair-share weight.")


class ApiKeysFile(ApiModel):
    """The whole keys file."""

    keys: list[ApiKey] = Field(min_length=1, description="The keys.")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_api_keys(data: object, where: str) -> dict[bytes, ApiKey]:
    """Validated keys by the SHA-256 of the secret; ApiKeysError listing every problem."""
    try:
        keys = ApiKeysFile.model_validate(data).keys
    except ValidationError as exc:
        lines = [f"  {'.'.join(str(p) for p in e['loc']) or '(top level)'}: {e['msg']}" for e in exc.errors()]
        raise ApiKeysError(f"invalid {where}:\n" + "\n".join(lines)) from None
    by_digest: dict[bytes, ApiKey] = {}
    for n, entry in enumerate(keys):
        digest = _digest(entry.key)
        if digest in by_digest:
            raise ApiKeysError(f"invalid {where}: keys.{n}.key repeats the key of tenant "
                               f"{by_digest[digest].tenant!r}; every key must be unique")  # fmt: skip
        by_digest[digest] = entry
    quotas: dict[str, tuple[int, Quota]] = {}
    for n, entry in enumerate(keys):
        first, quota = quotas.setdefault(entry.tenant, (n, entry.quota))
        if quota != entry.quota:  # the counts are per tenant: two keys cannot give it two limits
            raise ApiKeysError(f"invalid {where}: keys.{n}.quota differs from keys.{first}.quota, both "
                               f"of tenant {entry.tenant!r}; one tenant, one quota")  # fmt: skip
    return by_digest


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated request's key."""

    tenant: str
    models: frozenset[str] | None
    classes: frozenset[str] | None
    limits: Limits = field(default_factory=Limits)
    weight: float = 1.0

    def may_use(self, model: str) -> bool:
        """Whether the key may use ``model``."""
        return self.models is None or model in self.models

    def check_model(self, model: str) -> None:
        """ApiError 403 when the key may not use ``model`` (checked before the router says whether the
        model exists: a tenant learns nothing about models it may not use)."""
        if not self.may_use(model):
            allowed = ", ".join(sorted(self.models or ()))
            raise ApiError(403, f"the API key of tenant {self.tenant!r} may not use the model {model!r}; "
                           f"it may use: {allowed}", code="model_not_allowed", param="model")  # fmt: skip

    def check_class(self, class_name: str, class_header: str) -> None:
        """ApiError 403 when the key may not use the request class ``class_name``."""
        if self.classes is not None and class_name not in self.classes:
            allowed = ", ".join(sorted(self.classes))
            raise ApiError(403, f"the API key of tenant {self.tenant!r} may not use the request class "
                           f"{class_name!r} (header {class_header}); it may use: {allowed}",
                           code="class_not_allowed", param=class_header)  # fmt: skip


class ApiKeys:
    """The keys of a keys file, read again when the file changes."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int] | None = None
        self._keys: dict[bytes, ApiKey] = {}
        self.reload()

    def _read(self) -> tuple[tuple[int, int], dict[bytes, ApiKey]]:
        try:
            stat = os.stat(self.path)
        except OSError as exc:
            raise ApiKeysError(f"cannot read API keys file {self.path}: {exc.strerror}") from None
        data = read_json_or_yaml(self.path, "API keys file", ApiKeysError)
        return (stat.st_mtime_ns, stat.st_size), parse_api_keys(data, f"API keys file {self.path}")

    def reload(self) -> None:
        """Read the file; ApiKeysError when it is invalid (the keys stay as they were)."""
        self._stamp, self._keys = self._read()

    def refresh(self) -> None:
        """Read the file again if it changed; an unreadable or invalid file keeps the current keys."""
        try:
            stamp = os.stat(self.path)
        except OSError as exc:
            log.warning("API keys file %s: %s; keeping the current keys", self.path, exc.strerror)
            return
        if (stamp.st_mtime_ns, stamp.st_size) == self._stamp:
            return
        try:
            self.reload()
        except ApiKeysError as exc:
            log.warning("%s; keeping the current keys", exc)

    def tenant_caller(self, tenant: str) -> Caller | None:
        """The caller that work done for ``tenant`` counts against (its quota and fair-share weight; its
        models and classes unchecked: the batch component checked them when the job was created), or
        None when no key of ``tenant`` is left."""
        entry = next((e for e in self._keys.values() if e.tenant == tenant), None)
        if entry is None:
            return None
        return Caller(entry.tenant, None, None, entry.quota.limits(), entry.quota.weight)

    def authenticate(self, headers: Mapping[str, str]) -> Caller:
        """The caller of a request with ``Authorization: Bearer <key>``; ApiError 401 otherwise."""
        challenge = {"www-authenticate": "Bearer"}
        value = headers.get("authorization")
        if value is None:
            raise ApiError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                           code="missing_api_key", param="Authorization", headers=challenge)  # fmt: skip
        # Split on the first whitespace rather than matching "bearer " with its space: servers differ in
        # whether they strip trailing whitespace from header values, and "Bearer" with nothing after it
        # is an empty key (invalid), not another scheme.
        scheme, _, key = value.strip().partition(" ")
        if scheme.lower() != _BEARER:
            raise ApiError(401, "the Authorization header must be 'Bearer <key>'",
                           code="invalid_api_key", param="Authorization", headers=challenge)  # fmt: skip
        # Looked up by digest: a dict probe does not compare the secret itself byte by byte.
        entry = self._keys.get(_digest(key.strip()))
        if entry is None:
            raise ApiError(401, "invalid API key (sent in the Authorization header)",
                           code="invalid_api_key", param="Authorization", headers=challenge)  # fmt: skip
        return Caller(
            entry.tenant,
            frozenset(entry.models) if entry.models is not None else None,
            frozenset(entry.classes) if entry.classes is not None else None,
            entry.quota.limits(),
            entry.quota.weight,
        )

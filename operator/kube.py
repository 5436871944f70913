"""Thin adapter over the kubernetes client: plain dicts in and out, retries on transient API errors.

Transient: 409 conflicts, 429 throttling, 5xx and lost connections; they are retried with capped
exponential backoff. A create that meets 409 AlreadyExists becomes a patch (an earlier attempt may
have succeeded server-side before its response was lost) when the existing object is owned by the
desired one's owner; any other object raises ``OwnershipError`` untouched. Everything else raises at
once.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import urllib3.exceptions
from kubernetes import client

from tessera.api import GROUP, VERSION
from tessera.operator.reconcile import Action, Conflict, adoptable, conflict

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRY_STATUSES = frozenset({409, 429, 500, 502, 503, 504})
MERGE_PATCH = "application/merge-patch+json"
# Kind -> (API class attribute, method suffix) of the namespaced child objects the operator owns.
CHILD_KINDS: dict[str, tuple[str, str, str]] = {
    "ConfigMap": ("core", "config_map", "v1"),
    "Service": ("core", "service", "v1"),
    "StatefulSet": ("apps", "stateful_set", "apps/v1"),
    "PodDisruptionBudget": ("policy", "pod_disruption_budget", "policy/v1"),
}


class OwnershipError(Exception):
    """A child's name is held by an object the operator did not create."""

    def __init__(self, found: Conflict) -> None:
        super().__init__(f"{found.kind} {found.name} is not ours")
        self.conflict = found


def rejection(error: BaseException) -> str | None:
    """The API server's message when it refused an object as invalid (400, 422: sending it again cannot
    succeed), else None."""
    if not isinstance(error, client.ApiException) or error.status not in (400, 422):
        return None
    try:
        return str(json.loads(error.body or "{}").get("message") or error.reason)
    except (ValueError, AttributeError):
        return str(error.body or error.reason)


def backoff_delays(attempts: int, base_s: float = 0.2, cap_s: float = 5.0) -> list[float]:
    """Sleeps between ``attempts`` tries: base, 2·base, 4·base, ... capped at ``cap_s``."""
    return [min(cap_s, base_s * 2**i) for i in range(max(0, attempts - 1))]


def is_transient(error: BaseException, statuses: frozenset[int] = RETRY_STATUSES) -> bool:
    """Whether an API call that raised ``error`` is worth retrying."""
    if isinstance(error, client.ApiException):
        return error.status in statuses
    return isinstance(error, urllib3.exceptions.HTTPError | ConnectionError)


class Kube:
    """The few API calls the operator makes, on plain dicts, with retries."""

    def __init__(
        self,
        api: client.ApiClient,
        attempts: int = 6,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.apps = client.AppsV1Api(api)
        self.policy = client.PolicyV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.attempts = attempts
        self.sleep = sleep

    def _retry(self, what: str, call: Callable[[], T], statuses: frozenset[int] = RETRY_STATUSES) -> T:
        delays = backoff_delays(self.attempts)
        for attempt in range(self.attempts):
            try:
                return call()
            except Exception as error:
                if not is_transient(error, statuses) or attempt == len(delays):
                    raise
                status = getattr(error, "status", type(error).__name__)
                log.warning("%s failed (%s), retry %d in %.1fs", what, status, attempt + 1, delays[attempt])
                self.sleep(delays[attempt])
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    def _json(response: Any) -> dict[str, Any]:
        return json.loads(response.data) if response.data else {}

    def _child_call(self, kind: str, verb: str) -> Callable[..., Any]:
        api_name, suffix, _ = CHILD_KINDS[kind]
        return getattr(getattr(self, api_name), f"{verb}_namespaced_{suffix}")

    # -- children -----------------------------------------------------------------------------------

    def list_children(self, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        """Every child (``CHILD_KINDS``) in ``namespace`` carrying all of ``labels``."""
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        found: list[dict[str, Any]] = []
        for kind, (_, _, api_version) in CHILD_KINDS.items():
            call = self._child_call(kind, "list")
            listing = self._retry(
                f"list {kind}",
                lambda call=call: self._json(
                    call(namespace=namespace, label_selector=selector, _preload_content=False)
                ),
            )
            for item in listing.get("items", []):
                item_labels = item.get("metadata", {}).get("labels") or {}
                # Filter here too: selectors are the server's job, but a lax server must not make the
                # operator delete what it does not own.
                if all(item_labels.get(k) == v for k, v in labels.items()):
                    found.append({**item, "kind": kind, "apiVersion": api_version})
        return found

    def apply(self, namespace: str, action: Action) -> None:
        """Create, patch (JSON merge patch) or delete one child."""
        what = f"{action.describe()} in {namespace}"
        if action.verb == "delete":
            call = self._child_call(action.kind, "delete")
            try:
                self._retry(what, lambda: call(name=action.name, namespace=namespace, _preload_content=False))
            except client.ApiException as error:
                if error.status != 404:  # already gone is what we wanted
                    raise
            return
        body = dict(action.body or {})
        if action.verb == "create":
            call = self._child_call(action.kind, "create")
            try:
                # 409 here is AlreadyExists, not a conflict to wait out: patch instead.
                self._retry(
                    what,
                    lambda: call(namespace=namespace, body=body, _preload_content=False),
                    RETRY_STATUSES - {409},
                )
                return
            except client.ApiException as error:
                if error.status != 409:
                    raise
            # It exists but was not listed (no labels of ours, or made since): patch only our own.
            existing = self.get_child(namespace, action.kind, action.name)
            if existing is not None and not adoptable(existing, body):
                raise OwnershipError(conflict(existing, body))
        try:
            self.patch_child(namespace, action.kind, action.name, body)
        except client.ApiException as error:
            if error.status != 404:
                raise
            # Deleted since it was seen (another pool's pass released it, e.g. a moved service's
            # endpoint): create it, or this pass fails and nothing retries it until the next mark.
            call = self._child_call(action.kind, "create")
            self._retry(what, lambda: call(namespace=namespace, body=body, _preload_content=False))

    def get_child(self, namespace: str, kind: str, name: str) -> dict[str, Any] | None:
        """One child object; None when it does not exist."""
        call = self._child_call(kind, "read")
        try:
            return self._retry(
                f"get {kind} {name}",
                lambda: self._json(call(name=name, namespace=namespace, _preload_content=False)),
            )
        except client.ApiException as error:
            if error.status == 404:
                return None
            raise

    def patch_child(self, namespace: str, kind: str, name: str, body: Mapping[str, Any]) -> None:
        """JSON merge patch of one child: the operator owns its fields and lists whole."""
        call = self._child_call(kind, "patch")
        self._retry(
            f"patch {kind} {name}",
            lambda: call(
                name=name,
                namespace=namespace,
                body=dict(body),
                _content_type=MERGE_PATCH,
                _preload_content=False,
            ),
        )

    # -- Tessera custom resources -------------------------------------------------------------------

    def get_custom(self, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        """One Tessera object, None when it does not exist."""
        try:
            return self._retry(
                f"get {plural}/{name}",
                lambda: self._json(
                    self.custom.get_namespaced_custom_object(
                        GROUP, VERSION, namespace, plural, name, _preload_content=False
                    )
                ),
            )
        except client.ApiException as error:
            if error.status == 404:
                return None
            raise

    def patch_status(self, plural: str, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        """Merge ``status`` into a Tessera object's status subresource; a vanished object is ignored."""
        try:
            self._retry(
                f"patch {plural}/{name}/status",
                lambda: self.custom.patch_namespaced_custom_object_status(
                    GROUP,
                    VERSION,
                    namespace,
                    plural,
                    name,
                    {"status": dict(status)},
                    _content_type=MERGE_PATCH,
                    _preload_content=False,
                ),
            )
        except client.ApiException as error:
            if error.status != 404:
                raise

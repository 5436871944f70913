"""The activator on a cluster: it follows the groups the operator scales to zero, and asks it to wake one.

The operator puts a group to sleep (``tessera.control.scale_to_zero``); a router never does, since it sees
only its own share of the traffic. Each discovery (``tessera.router.discovery``) tells which groups scale
to zero, which of them are cold (no pod role) and which serve; ``ClusterWaker.follow`` hands that to the
activator and keeps the cold groups' models listed (``RouterState.dormant``). A request for a cold
group's model is held by the activator, whose wake-up (``ClusterWaker.wake``) writes the time into
``status.wakeRequestedAt`` of each of the group's LLMServices (the status subresource: the router's
role may not change a spec) and returns once one of the group's instances is healthy in the router. A
wake-up that does not see a ready pod within ``ready_timeout_s`` fails, and the activator tries again
with backoff, writing a new request each time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tessera.api import GROUP, VERSION
from tessera.api.times import rfc3339
from tessera.control.scale_to_zero import WAKE_FIELD
from tessera.router.activator import Activator
from tessera.router.discovery import Discovered, SleepingGroup, kube_client

if TYPE_CHECKING:
    from tessera.router.app import RouterState

# A cold start on a GPU node (an image pull, weights loaded) takes minutes.
READY_TIMEOUT_S = 600.0
POLL_S = 0.5


class ClusterWaker:
    """The activator's actuator on a cluster, and what keeps it in step with discovery."""

    def __init__(
        self,
        state: RouterState,
        custom: Any = None,
        ready_timeout_s: float = READY_TIMEOUT_S,
        poll_s: float = POLL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``custom``: the Kubernetes CustomObjectsApi (built from the pod's service account if None)."""
        self.state = state
        self.custom = custom if custom is not None else kube_client().CustomObjectsApi()
        self.ready_timeout_s = ready_timeout_s
        self.poll_s = poll_s
        self.clock = clock
        self.groups: dict[str, SleepingGroup] = {}

    def follow(self, found: Discovered, activator: Activator) -> None:
        """Take one discovery's scale-to-zero groups: the activator's units, and the models of those
        without a ready pod listed as dormant (still served, through the activator)."""
        self.groups = {g.unit: g for g in found.sleeping}
        activator.follow(
            {g.unit: tuple(g.models) for g in found.sleeping},
            {m: s.policy for g in found.sleeping for m, s in g.models.items()},
            {g.unit for g in found.sleeping if g.cold},
            {g.unit for g in found.sleeping if g.ready},
        )
        self.state.dormant = {m: g.config for g in found.sleeping if not g.ready for m in g.models}

    async def sleep(self, unit: str) -> None:
        """Never called: on a cluster the units have no idle time in the router (``Activator.follow``)."""
        raise RuntimeError(f"{unit}: on a cluster the operator puts groups to sleep, not the router")

    async def wake(self, unit: str) -> None:
        """Ask the operator to wake ``unit`` and return once one of its instances is healthy here;
        TimeoutError after ``ready_timeout_s``, or the API server's refusal of the request."""
        group = self.groups.get(unit)
        if group is None:
            raise LookupError(f"{unit} is no longer a scale-to-zero group")
        body = {"status": {WAKE_FIELD: rfc3339(self.clock(), micro=True)}}
        for service in sorted({m.service for m in group.models.values()}):
            await asyncio.to_thread(
                self.custom.patch_namespaced_custom_object_status,
                GROUP, VERSION, group.namespace, "llmservices", service, body,
                _content_type="application/merge-patch+json",
            )  # fmt: skip
        deadline = time.monotonic() + self.ready_timeout_s
        while not any(x.healthy and x.model in group.models for x in self.state.loads.values()):
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no instance of {unit} was ready {self.ready_timeout_s:.0f} s after the wake request"
                )
            await asyncio.sleep(self.poll_s)

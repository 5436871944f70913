"""Which worker instance gets a request: route by model and class, balance by least estimated wait.

Pure logic, no I/O and no clock. The router keeps one ``InstanceLoad`` per (instance, model) and asks
``choose`` for every request.

Routing by class (Chiron's instance roles, qlm_chiron_spec B3): an interactive request goes to
interactive instances, else to mixed ones; a batch request to batch instances, else to mixed ones.
When the model has no instance of an eligible role (a pool planned all-interactive, as the quickstart
is), every instance of the model is eligible (CHOICE: serve rather than refuse).

Balancing (QLM's load-balancing LSO, qlm_chiron_spec A5): among eligible instances, the one with the
least estimated waiting time of the new request, with QLM's request-level RWT estimate
(``tessera.core.policies.qlm.estimator.request_wait``): the output tokens of the requests that must
leave the batch before this one starts, over the instance's token throughput Theta (Eq. 15), at the
z-quantile of their normal sum. Requests ahead = outstanding requests beyond the batch size (an
instance with a free batch slot starts the request at once: wait 0). Ties go to the class's own role,
then to the instance with fewer outstanding requests, then by name (deterministic).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from tessera.core.policies.qlm.estimator import EngineRates, TokenStats, request_wait
from tessera.core.profile import StepProfile

Role = Literal["interactive", "mixed", "batch"]
ClassKind = Literal["interactive", "batch"]

# Eligible roles of a class, most preferred first (Chiron B3).
ELIGIBLE_ROLES: dict[str, tuple[Role, ...]] = {
    "interactive": ("interactive", "mixed"),
    "batch": ("batch", "mixed"),
}
DEFAULT_Z = 1.0  # quantile of the RWT estimate (QLM's default confidence, about the 84th percentile)


class NoInstance(LookupError):
    """No healthy instance serves the requested model."""


@dataclass(slots=True)
class InstanceLoad:
    """What the router knows about one model on one instance."""

    instance: str
    model: str
    role: Role
    profile: StepProfile
    batch_size: int  # most requests in flight (the worker's current batch size)
    outstanding: int = 0  # requests the router sent there that have not ended
    healthy: bool = True


def seed_stats() -> TokenStats:
    """Token statistics of a model before any request finished (QLM seeds them offline; CHOICE: 512 in,
    128 +- 128 out); the router updates them by EWMA from the requests it relays."""
    return TokenStats(mu_in=512.0, mu_out=128.0, var_out=128.0**2)


def estimated_wait(load: InstanceLoad, stats: TokenStats, z: float = DEFAULT_Z) -> float:
    """Estimated seconds before a new request starts on ``load``'s instance (QLM RWT)."""
    ahead = max(0, load.outstanding + 1 - load.batch_size)
    if ahead == 0:
        return 0.0
    rates = EngineRates(load.profile, max(1, load.batch_size))
    return request_wait([(ahead, stats, rates.theta(stats))], z)


def eligible(loads: Sequence[InstanceLoad], kind: str) -> list[InstanceLoad]:
    """Healthy instances a request of class ``kind`` may go to (see the module doc)."""
    healthy = [x for x in loads if x.healthy]
    roles = ELIGIBLE_ROLES.get(kind, ("interactive", "mixed", "batch"))
    preferred = [x for x in healthy if x.role in roles]
    return preferred or healthy


def choose(
    loads: Sequence[InstanceLoad], model: str, kind: str, stats: TokenStats, z: float = DEFAULT_Z
) -> InstanceLoad:
    """The instance for a request of ``model`` and class kind ``kind``; NoInstance when none serves it."""
    candidates = eligible([x for x in loads if x.model == model], kind)
    if not candidates:
        raise NoInstance(f"no healthy instance serves model {model!r}")
    roles = ELIGIBLE_ROLES.get(kind, ())

    def rank(x: InstanceLoad) -> tuple[float, int, int, str]:
        role_rank = roles.index(x.role) if x.role in roles else len(roles)
        return (round(estimated_wait(x, stats, z), 9), role_rank, x.outstanding, x.instance)

    return min(candidates, key=rank)

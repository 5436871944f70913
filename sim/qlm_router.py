"""QLM's load balancing LSO for the simulator's cluster: groups are assigned to instances' VQs.

An arrival that joins an open group goes where that group is (groups are never split
across instances, and a started group never migrates). A new group goes to the VQ
with the smallest estimated start of a tail append, ``wt_tail + S [tail model differs]``
(our choice; QLM leaves it to the MILP), preferring a VQ whose tail has the same model on ties; the chosen
instance's agent then runs the violation check and reorders its VQ.
"""

from __future__ import annotations

from tessera.core.policies.qlm.policy import QLMPolicy
from tessera.core.request import Request
from tessera.sim.cluster import ClusterRouter, ClusterView
from tessera.sim.engine import SimInstance


class QLMRouter(ClusterRouter):
    """Assigns request groups to the virtual queues of instances running ``QLMPolicy``."""

    name = "qlm"

    def route(self, req: Request, view: ClusterView) -> SimInstance:
        """The instance whose VQ gets ``req``'s group."""
        cands = view.serving(req.model)
        if not cands:
            raise RuntimeError(f"no instance serves model {req.model!r} (request {req.id})")
        policies = []
        for inst in cands:
            if not isinstance(inst.policy, QLMPolicy):
                raise TypeError(
                    f"QLMRouter needs QLMPolicy on every instance; {inst.name} runs {inst.policy.name}"
                )
            policies.append((inst, inst.policy))
        for inst, policy in policies:
            if policy.has_open_group(req):
                return inst
        if all(p.rates is None for _, p in policies):  # no engine view yet: spread by outstanding work
            return min(cands, key=lambda i: (i.outstanding, i.name))
        # An instance whose policy has seen no engine view yet has never been scheduled: nothing runs
        # there, so a new group would start at once. Leaving such instances out (as an earlier version
        # did) kept every group on the instance that took the first request and the others idle.
        return min(
            policies,
            key=lambda ip: (
                round(ip[1].tail_start(req.model, view.now), 6) if ip[1].rates is not None else 0.0,
                ip[1].tail_model() != req.model,
                ip[0].outstanding,
                ip[0].name,
            ),
        )[0]

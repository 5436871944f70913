"""Fair share between tenants: the Virtual Token Counter (VTC) around any policy.

Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024). Each tenant of a request class
has a counter of the weighted service it received: ``input_weight`` per prompt token when one of its
requests is admitted, ``output_weight`` per token generated (the paper's defaults, 1 and 2), each
divided by the tenant's weight (``Request.tenant_weight``: a tenant of weight 2 is owed twice the
service). Among the requests of one class, the next admitted comes from the backlogged tenant (one
with requests waiting) whose counter is least; a tenant that becomes backlogged is lifted to the
least counter among the backlogged ones (to the counter of the tenant admitted last when none is),
so a tenant that was idle cannot bank service and then starve the others.

The lift's credit (CHOICE ``lift_credit``, default 0: the paper's lift). The paper lifts a tenant
whenever it has no request waiting, even while its requests run. A tenant sending less than its
share then loses, at each of its arrivals, the service the others got ahead of it while its own
requests ran, and waits behind them in the order though it is the one served less: at its share's
critical load that is most of its TTFT. With ``lift_credit`` c, a tenant that still has requests
running (so was not idle) is lifted only to c below the least backlogged counter; an idle tenant gets
the paper's lift. What a tenant can bank is thus at most c, and the bound below becomes ``2U + c``.

``FairShare`` wraps an inner policy, as ``tessera.core.chiron.ChironPolicy`` does: the inner policy
holds every running and preempted request and, per class, the waiting requests of one tenant only,
the least served; its own order decides among them and between classes. The other tenants' waiting
requests are held here and handed over when their tenant becomes the least served (the inner policy
sees them arrive then). Within one decision, the admissions of a class stop once the admitted
tenant has passed another backlogged tenant's counter, and the wrapper asks to decide again after
one iteration, so a burst of free slots is shared as the paper's one-at-a-time admission would.

Preemption (CHOICE ``preempt``, off by default: the paper's VTC admits one request at a time into
free slots and never preempts). With continuous batching a slot frees only when a running request
ends, so at full utilisation the least served tenant waits for the others' requests to finish. With
``preempt`` on, when the least served backlogged tenant of a class has waiting requests that the free
slots cannot take, it takes slots from the class's running requests of tenants that hold more than
their weighted share of the class's running requests and whose counters are above its own: the most
served tenant's latest admitted first, at most as many as it lacks of its own share. The preempted
requests go back to their tenant's waiting ones (held here until their tenant is the least served
again; they resume without a second charge), leaving the batch with the engine's preemption mode.
The order of admissions is still the counters' (only the least served tenant takes a slot, and only
from tenants served more), so the bound below is kept; the share guard keeps two tenants from
preempting each other by turns.

The paper's bound (its Theorem 4.1): over any interval during which two tenants are both
backlogged, the weighted service each receives differs by at most ``2 * U``, ``U`` the largest
weighted tokens of one request (``input_weight * prompt + output_weight * output``).
``max_service_gap`` is the largest difference this wrapper saw, at its decision points; with
``lift_credit`` c the bound is ``2U + c``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tessera.core.policy import Decision, InstanceView, Policy, resident_kv_tokens
from tessera.core.request import Phase, Request

Key = tuple[str, str]  # (class name, tenant)


@dataclass(slots=True)
class _Class:
    """One request class's tenants: their waiting requests, held here or handed to the inner policy."""

    waiting: dict[str, dict[int, Request]] = field(default_factory=dict)  # tenant -> never-started requests
    held: dict[str, list[Request]] = field(default_factory=dict)  # tenant -> waiting, not in the inner policy
    active: str | None = None  # the tenant whose waiting requests the inner policy holds
    last: str | None = None  # the tenant admitted last

    def backlogged(self) -> list[str]:
        return [t for t, reqs in self.waiting.items() if reqs]


class FairShare(Policy):
    """VTC fair share between tenants around ``inner`` (module docstring)."""

    def __init__(
        self,
        inner: Policy,
        *,
        input_weight: float = 1.0,
        output_weight: float = 2.0,
        preempt: bool = False,
        lift_credit: float = 0.0,
    ) -> None:
        if not (input_weight >= 0 and output_weight >= 0 and input_weight + output_weight > 0):
            raise ValueError(f"VTC weights must be >= 0, not both 0; got input {input_weight}, "
                             f"output {output_weight}")  # fmt: skip
        if not 0 <= lift_credit < math.inf:
            raise ValueError(f"VTC's lift_credit must be finite and >= 0; got {lift_credit}")
        self.lift_credit = lift_credit
        self.inner = inner
        # The wrapper reports the policy it wraps (metrics, logs, the oracle check of benchmarks).
        self.name = inner.name
        self.oracle = inner.oracle
        self.input_weight, self.output_weight = input_weight, output_weight
        self.preempt = preempt
        self.preempted = 0  # requests this wrapper took out of the batch (``preempt``)
        self._weights: dict[Key, float] = {}  # each tenant's weight, as its latest request carried it
        self.counters: dict[Key, float] = {}  # the VTC counters (lifts included)
        self.service: dict[Key, float] = {}  # weighted service received (no lifts): the bound's measure
        self.max_service_gap = 0.0
        self.max_request_service = 0.0  # U: the largest weighted tokens of one finished request
        self._classes: dict[str, _Class] = {}
        self._started: set[int] = set()  # id(req) of requests whose admission was charged
        self._live: dict[Key, int] = {}  # per tenant, its requests charged and not yet removed
        self._charged_out: dict[int, int] = {}  # id(req) -> generated tokens charged so far
        self._given: set[int] = set()  # id(req) of waiting requests handed to the inner policy
        self._since: dict[tuple[str, str, str], tuple[float, float]] = {}  # pair backlogged: services then
        # The prompt service of the admissions the latest decision proposed, charged once the engine
        # shows them running: a tenant arriving before that is lifted with them counted, wherever the
        # shell's next decision falls (the worker and the simulator decide at different instants).
        self._proposed: dict[Key, float] = {}

    # ---------------------------------------------------------------- the Policy hooks

    def add(self, req: Request, now: float) -> None:
        """A request arrived: its tenant is lifted if it was not backlogged; the request goes to the
        inner policy when its tenant is the class's active one, else it is held."""
        name, tenant = req.service_class.name, req.tenant
        self._weights[name, tenant] = req.tenant_weight
        cls = self._classes.setdefault(name, _Class())
        waiting = cls.waiting.setdefault(tenant, {})
        if not waiting:
            self._lift(name, cls, tenant)
        waiting[id(req)] = req
        if cls.active is None:
            cls.active = tenant
        if cls.active == tenant:
            self._give(req, now)
        else:
            cls.held.setdefault(tenant, []).append(req)

    def remove(self, req: Request, now: float) -> None:
        """A request left (finished or cancelled): its service is counted, then it is forgotten."""
        cls = self._classes[req.service_class.name]
        rid = id(req)
        waiting = cls.waiting.get(req.tenant, {})
        # It ran if its admission was charged, or if it ran and finished between two decisions.
        ran = rid in self._started or req.generated > 0 or req.phase is Phase.FINISHED
        if ran:
            self._charge(req)
            self.max_request_service = max(self.max_request_service, self._request_service(req))
        self._charged_out.pop(rid, None)
        if rid in self._started:
            self._started.discard(rid)
            self._live[req.service_class.name, req.tenant] -= 1
        if rid in waiting and rid not in self._given:  # held here (the inner policy does not hold it)
            del waiting[rid]
            cls.held[req.tenant].remove(req)
            return
        waiting.pop(rid, None)
        self._given.discard(rid)
        self.inner.remove(req, now)

    def __len__(self) -> int:
        return len(self.inner) + sum(len(h) for c in self._classes.values() for h in c.held.values())

    def observe(self, view: InstanceView) -> None:
        """The inner policy takes in the engine's progress."""
        self.inner.observe(view)

    def prepare(self, view: InstanceView) -> Callable[[], None] | None:
        """The inner policy's work ahead of a decision, if it has any."""
        return self.inner.prepare(view)

    def schedule(self, view: InstanceView) -> Decision:
        """Charge what ran, hand each class's least served tenant to the inner policy, and keep its
        admissions within the counters' order."""
        self._proposed = {}
        for req in view.running:
            self._charge(req)
        self._track_gaps()
        for name, cls in self._classes.items():
            self._activate(name, cls, view.now)
        if self.preempt:
            view = self._take_slots(view)
        decision = self.inner.schedule(view)
        run, cut = self._share_admissions(decision.run, view)
        if not cut:
            return decision
        decision.run = run
        decision.recheck_after_tokens = 1  # the next tenant's admission, after one iteration
        return decision

    # ---------------------------------------------------------------- read-only state

    def counter(self, class_name: str, tenant: str) -> float:
        """A tenant's VTC counter in a class (lifts included; 0 before its first request)."""
        return self.counters.get((class_name, tenant), 0.0)

    def least_served(self, class_name: str) -> str | None:
        """The tenant of ``class_name`` whose waiting requests the inner policy holds now: the least
        served backlogged one as of the latest decision (None: no request of the class seen)."""
        cls = self._classes.get(class_name)
        return cls.active if cls is not None else None

    # ---------------------------------------------------------------- VTC

    def _lift(self, name: str, cls: _Class, tenant: str) -> None:
        """The counter of a tenant becoming backlogged: at least the least backlogged counter (the last
        admitted tenant's when none is backlogged), less ``lift_credit`` while its requests run."""
        others = [self._counted((name, t)) for t in cls.backlogged() if t != tenant]
        floor = min(others) if others else self._counted((name, cls.last)) if cls.last else 0.0
        key = (name, tenant)
        if self._live.get(key, 0):
            floor -= self.lift_credit
        self.counters[key] = max(self.counters.get(key, 0.0), floor)

    def _counted(self, key: Key) -> float:
        """A tenant's counter with the admissions proposed for it and not yet seen running."""
        return self.counters.get(key, 0.0) + self._proposed.get(key, 0.0)

    def _charge(self, req: Request) -> None:
        """Count ``req``'s admission (once) and its tokens generated since the last count."""
        rid, key = id(req), (req.service_class.name, req.tenant)
        weight = req.tenant_weight
        amount = 0.0
        cls = self._classes[key[0]]
        if rid in self._started:
            # Resumed after this wrapper preempted it (``preempt``): no longer among the waiting.
            if req.phase is Phase.RUNNING and cls.waiting.get(req.tenant, {}).pop(rid, None):
                self._given.discard(rid)
        else:
            self._started.add(rid)
            self._live[key] = self._live.get(key, 0) + 1
            cls.waiting.get(req.tenant, {}).pop(rid, None)
            self._given.discard(rid)
            cls.last = req.tenant
            amount += self.input_weight * req.prompt_tokens
        done = self._charged_out.get(rid, 0)
        if req.generated > done:
            amount += self.output_weight * (req.generated - done)
            self._charged_out[rid] = req.generated
        if amount:
            self.counters[key] = self.counters.get(key, 0.0) + amount / weight
            self.service[key] = self.service.get(key, 0.0) + amount / weight

    def _request_service(self, req: Request) -> float:
        return (
            self.input_weight * req.prompt_tokens + self.output_weight * req.generated
        ) / req.tenant_weight

    def _least(self, name: str, cls: _Class) -> str | None:
        backlogged = cls.backlogged()
        if not backlogged:
            return None
        return min(backlogged, key=lambda t: (self.counters.get((name, t), 0.0), t))

    def _activate(self, name: str, cls: _Class, now: float) -> None:
        """Hand the least served backlogged tenant's waiting requests to the inner policy, taking back
        those of the tenant that was active."""
        chosen = self._least(name, cls)
        if chosen is None or chosen == cls.active:
            return
        old = cls.active
        if old is not None:
            back = [r for r in cls.waiting.get(old, {}).values() if id(r) in self._given]
            for req in back:
                self._given.discard(id(req))
                self.inner.remove(req, now)  # still waiting: to the inner policy, a cancellation
            cls.held.setdefault(old, []).extend(back)
            cls.held[old].sort(key=lambda r: r.arrival)
        cls.active = chosen
        for req in cls.held.pop(chosen, []):
            self._give(req, now)

    def _give(self, req: Request, now: float) -> None:
        self._given.add(id(req))
        self.inner.add(req, now)

    def _take_slots(self, view: InstanceView) -> InstanceView:
        """``preempt``: take the slots the least served tenants lack from the tenants over their share
        (module docstring); the view the inner policy then decides on, without those requests."""
        free = view.max_batch - len(view.running)
        victims: list[Request] = []
        for name, cls in self._classes.items():
            least = cls.active
            want = sum(1 for r in cls.waiting.get(least, {}).values() if id(r) in self._given) if least else 0
            if want <= free:
                continue
            mine = [r for r in view.running if r.service_class.name == name]
            held: dict[str, list[Request]] = {}
            for r in mine:
                held.setdefault(r.tenant, []).append(r)
            tenants = set(held) | set(cls.backlogged())
            total = sum(self._weights.get((name, t), 1.0) for t in tenants)

            def share(tenant: str, name: str = name, total: float = total, n: int = len(mine)) -> float:
                return n * self._weights.get((name, tenant), 1.0) / total

            lacks = math.floor(share(least) + 1e-9) - len(held.get(least, ()))
            floor = self._counted((name, least))
            over = [
                (self._counted((name, t)), r.first_scheduled_at or 0.0, r)
                for t, rs in held.items()
                if t != least and self._counted((name, t)) > floor
                for r in sorted(rs, key=lambda r: r.first_scheduled_at or 0.0)[math.ceil(share(t) - 1e-9) :]
            ]
            over.sort(key=lambda c: (c[0], c[1]), reverse=True)  # the most served, latest admitted first
            victims += [r for *_, r in over[: max(0, min(want - free, lacks))]]
        if not victims:
            return view
        now, gone = view.now, set(map(id, victims))
        for req in victims:
            cls = self._classes[req.service_class.name]
            waiting = cls.waiting.setdefault(req.tenant, {})
            if not waiting:
                self._lift(req.service_class.name, cls, req.tenant)
            waiting[id(req)] = req
            cls.held.setdefault(req.tenant, []).append(req)
            self.inner.remove(req, now)  # back among its tenant's waiting requests, held here
        self.preempted += len(victims)
        freed = resident_kv_tokens(victims, view.profile.block_size)
        return replace(view, running=tuple(r for r in view.running if id(r) not in gone),
                       kv_used_tokens=view.kv_used_tokens - freed)  # fmt: skip

    def _share_admissions(self, run: list[Request], view: InstanceView) -> tuple[list[Request], bool]:
        """``run`` without the admissions of a class past the point where its admitted tenant's counter
        (with those admissions charged) passes another backlogged tenant's; whether any was cut."""
        running = set(map(id, view.running))
        virtual: dict[Key, float] = {}
        closed: set[str] = set()
        kept: list[Request] = []
        cut = False
        for req in run:
            rid = id(req)
            if rid in running or rid in self._started:  # running, or resumed: not a new admission
                kept.append(req)
                continue
            name = req.service_class.name
            if name in closed:
                cut = True
                continue
            kept.append(req)
            key = (name, req.tenant)
            virtual[key] = virtual.get(key, self.counters.get(key, 0.0)) + (
                self.input_weight * req.prompt_tokens / req.tenant_weight
            )
            others = [self.counters.get((name, t), 0.0) for t in self._classes[name].backlogged()
                      if t != req.tenant]  # fmt: skip
            if others and virtual[key] > min(others):
                closed.add(name)
        for key, value in virtual.items():
            self._proposed[key] = value - self.counters.get(key, 0.0)
        return kept, cut

    def _track_gaps(self) -> None:
        """The largest service difference between two tenants over an interval both were backlogged."""
        seen: set[tuple[str, str, str]] = set()
        for name, cls in self._classes.items():
            backlogged = sorted(cls.backlogged())
            for i, a in enumerate(backlogged):
                for b in backlogged[i + 1 :]:
                    pair = (name, a, b)
                    seen.add(pair)
                    now = (self.service.get((name, a), 0.0), self.service.get((name, b), 0.0))
                    start = self._since.setdefault(pair, now)
                    gap = abs((now[0] - start[0]) - (now[1] - start[1]))
                    self.max_service_gap = max(self.max_service_gap, gap)
        for pair in [p for p in self._since if p not in seen]:  # an interval ended
            del self._since[pair]

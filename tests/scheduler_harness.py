"""A pod scheduler over one engine, as the tests of one-model behaviour build it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tessera.core.policy import InstanceView, Policy
from tessera.core.profile import StepProfile
from tessera.worker.engines.base import Engine, TokenDelta
from tessera.worker.scheduler import InstanceScheduler


def one_model_scheduler(
    engine: Engine,
    policy: Policy,
    *,
    profile: StepProfile,
    class_limits: dict[str, int | None] | None = None,
    class_queue_times: dict[str, float | None] | None = None,
    **kwargs: Any,
) -> InstanceScheduler:
    """``InstanceScheduler`` of a pod serving ``engine``'s model alone (class bounds of that model)."""
    model = engine.model
    return InstanceScheduler(
        {model: engine},
        policy,
        profiles={model: profile},
        class_limits={model: dict(class_limits or {})},
        class_queue_times={model: dict(class_queue_times or {})},
        **kwargs,
    )


def run_iterations(sched: InstanceScheduler, iterations: int) -> None:
    """Drive ``sched`` as the simulator's instance runs ``iterations`` iterations: each gives every
    in-flight stream one token, and the streams at their ``max_tokens`` end."""
    for _ in range(iterations):
        streaming = list(sched.inflight)
        for job in streaming:
            sched._on_tokens(job, TokenDelta([7]))
        for job in streaming:
            if job.req.generated >= job.req.max_tokens:
                sched._end(job, "length", None)


class SetClock:
    """A clock the test sets (``now``), read by the scheduler it is given to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def replay_decisions(
    sched: InstanceScheduler,
    sim_views: Sequence[InstanceView],
    sim_snapshots: Sequence[Any],
    worker_snapshots: Sequence[Any],
    clock: SetClock,
) -> None:
    """Bring ``sched`` to each of the simulator's decision points in turn (its iterations run, the clock
    at the view's time) and decide there; the view the worker's policy recorded (its last of
    ``worker_snapshots``) must equal the simulator's. Stops ``sched`` at the end."""
    iteration = 0
    for n, (view, snapshot) in enumerate(zip(sim_views, sim_snapshots, strict=True), start=1):
        run_iterations(sched, view.iteration - iteration)
        iteration = view.iteration
        clock.now = view.now
        sched.decide()
        assert worker_snapshots[-1] == snapshot, f"decision {n}"

"""Chiron's global autoscaler (Chiron §5): interactive, mixed and batch instance counts.

See docs/papers.md, "Chiron: global autoscaler, interactive" and "..., batch".

- Interactive (§5.2): IBP = instances with interactive work / (interactive + mixed, pending included).
  Above Θ_op + δ_op: grow to N_IM* = ceil(U/Θ_op) at once, split into N_I* = ceil(Θ_op·N_IM*) interactive
  and the rest mixed (the over-provisioned spare). Below Θ_op − δ_op for ``scale_down_evaluations``
  consecutive evaluations and past the scale-down cooldown: shrink to N_IM*, mixed first.
- Batch (§5.3, Alg. 2 corrected as docs/papers.md says): the fewest extra batch instances k with
  BBP(k) = 0, where BBP counts deadline groups whose QLM-style waiting estimate exceeds their slack.
  A group past its deadline counts against one more batch SLO from now, and takes every free slot
  when even they leave it late (``overdue_fills_cap``; our choices). Batch instances
  retire all together once no batch request is queued or running; while batch work is queued, not
  deferred, and no batch or mixed instance would pull it, one batch instance is kept (our choice).
  With ``just_in_time`` (our choice, off by default: Chiron's rule) the fewest instances that meet the
  deadlines launch only at the latest evaluation that still meets them.

- Load forecasting (our extension, ``forecast_window_s`` > 0): the target share Θ follows the
  interactive arrival rate's trend one load time ahead (``forecast_theta``) instead of the fixed Θ_op.

Pure: the caller passes a metrics snapshot, the previous state and the time; it gets desired counts,
reasons and the next state.
"""

from __future__ import annotations

import math
from dataclasses import replace

from tessera.core.planners.types import (
    AutoscalerState,
    BatchGroup,
    ChironSettings,
    MetricsSnapshot,
    RoleCounts,
    ScalingDecision,
)


def interactive_targets(busy: int, settings: ChironSettings, theta: float | None = None) -> tuple[int, int]:
    """(N_I*, N_M*) for ``busy`` instances with interactive work (our concrete rule for §5.2) at the
    over-provisioning target ``theta`` (default Θ_op)."""
    theta = settings.over_provisioning if theta is None else theta
    n_im = max(settings.min_interactive, math.ceil(busy / theta - 1e-9))
    n_i = max(settings.min_interactive, math.ceil(theta * n_im - 1e-9))
    return n_i, max(0, n_im - n_i)


def forecast_theta(
    snapshot: MetricsSnapshot, state: AutoscalerState, settings: ChironSettings, now: float
) -> tuple[float, AutoscalerState]:
    """Load forecasting (our extension of §5.2; ``forecast_window_s`` > 0): the over-provisioning target
    from the interactive arrival rate instead of the fixed Θ_op, and the state with the new rate.

    The rate's trend over the last ``forecast_window_s`` (its change since the oldest measurement kept,
    once that is at least half a window old) extrapolated one load time ahead gives the growth g >= 1
    that instances starting now must absorb; the target is Θ = forecast_utilization / g (kept above the
    band), so the spare follows the forecast: little on a flat or falling rate, more ahead of a rise.
    Without a measured rate: Θ_op."""
    rate = snapshot.interactive_arrival_rps
    if settings.forecast_window_s <= 0 or rate is None:
        return settings.over_provisioning, state
    window = settings.forecast_window_s
    history = (*(h for h in state.arrival_history if now - h[0] <= window), (now, rate))
    then, old = history[0]
    trend = (rate - old) / (now - then) if now - then >= window / 2 else 0.0
    growth = 1.0 + max(0.0, trend) * settings.load_time_s / rate if rate > 0 else 1.0
    theta = max(settings.band + 0.01, settings.forecast_utilization / growth)
    return theta, replace(state, arrival_history=history)


def waiting_time(
    tokens_ahead: float, rate_now: float, extra_instances: int, per_instance: float, load_s: float
) -> float:
    """Least τ with capacity(τ) = rate_now·τ + extra·per_instance·max(0, τ − load_s) ≥ tokens_ahead."""
    if tokens_ahead <= 0:
        return 0.0
    if rate_now * load_s >= tokens_ahead:
        return tokens_ahead / rate_now
    total = rate_now + extra_instances * per_instance
    if total <= 0:
        return math.inf
    return load_s + (tokens_ahead - rate_now * load_s) / total


def batch_backpressure(
    groups: tuple[BatchGroup, ...],
    *,
    now: float,
    mean_tokens: float,
    std_tokens: float,
    rate_now: float,
    per_instance: float,
    extra_instances: int,
    settings: ChironSettings,
    overdue_only: bool = False,
    launch_delay_s: float = 0.0,
) -> int:
    """BBP(k) (Eq. 2 with slack): groups, in deadline order, whose last request would start after its
    deadline with ``extra_instances`` more batch instances launched ``launch_delay_s`` from now (QLM
    Eq. 2-3 estimate). ``overdue_only``: count only the groups already past their deadline."""
    late = 0
    ahead_n = 0
    horizon = settings.defer_horizon_fraction * settings.batch_slo_s
    for g in sorted(groups, key=lambda g: g.deadline):
        if g.count == 0:
            continue
        n_before_last = ahead_n + g.count - 1
        tokens = n_before_last * mean_tokens + settings.z * std_tokens * math.sqrt(n_before_last)
        ahead_n += g.count
        slack = g.deadline - now
        if overdue_only and slack > 0:
            continue
        if slack <= 0:
            # Missed already: the rest should still finish within one more batch SLO (our choice; late
            # whatever is launched, it would otherwise never call for an instance). Never deferred.
            slack = settings.batch_slo_s
        elif settings.defer and slack > horizon:
            continue
        load_s = settings.load_time_s + launch_delay_s
        if waiting_time(tokens, rate_now, extra_instances, per_instance, load_s) > slack:
            late += 1
    return late


def _deferred(groups: tuple[BatchGroup, ...], settings: ChironSettings, now: float) -> bool:
    """Whether ``defer`` holds back every queued group (each further than the horizon from its deadline)."""
    horizon = settings.defer_horizon_fraction * settings.batch_slo_s
    return settings.defer and all(g.deadline - now > horizon for g in groups if g.count)


def _batch_instances_needed(
    snapshot: MetricsSnapshot, settings: ChironSettings, per_instance: float, now: float, free: int
) -> tuple[int, int, int, bool]:
    """(k, BBP(0), BBP(k), wait): the fewest extra batch instances (≤ free) reaching the least
    achievable BBP, and, with ``just_in_time``, whether the same k launched one evaluation later
    reaches it still (then the launch waits; never for a group past its deadline).

    Alg. 2 adds instances while BBP(k) > 0; a group whose slack is shorter than the load time can
    never be saved, and the literal loop would then launch every free slot for nothing. BBP(k) does not
    grow with k, so we binary-search the smallest k with BBP(k) = BBP(free) (which is 0 whenever 0 is
    reachable: Alg. 2's answer).

    A group past its deadline that stays late with every free slot launched (the rest of it cannot
    finish within one more batch SLO) takes every free slot: Alg. 2's loop runs to the cap, and so do
    we (k = free; ``ChironSettings.overdue_fills_cap``, our choice). Every request of such a group is
    late whatever is launched, so the least BBP says nothing; what is left is finishing the backlog, and
    an instance launched then pulls its work once ready, costing its cold start. Stopping at the least
    BBP left the slots of retiring interactive and mixed instances empty while the backlog waited
    (Mooncake prompts, 30,000 batch requests on a 25-instance cap: the paper's row ran on 3 instances
    for 240 s, the lean row left up to 7 slots empty for 700 s). Before the deadline the fewest k
    stands: there the estimate can read a group late at the cap that the mixed spare still finishes
    in time, and launching every free slot then was measured at up to 19% more GPU-seconds (Azure
    code, paper's row, with interactive and mixed instances holding the cap first)."""
    mean = snapshot.mean_output_tokens or 0.0
    std = snapshot.std_output_tokens or 0.0
    pending_batch = snapshot.pending.batch
    rate_now = snapshot.batch_tokens_per_s
    if rate_now is None:
        rate_now = snapshot.ready.batch * per_instance

    def bbp(k: int, overdue_only: bool = False, delay_s: float = 0.0) -> int:
        return batch_backpressure(
            snapshot.batch_queue,
            now=now,
            mean_tokens=mean,
            std_tokens=std,
            rate_now=rate_now,
            per_instance=per_instance,
            extra_instances=pending_batch + k,
            settings=settings,
            overdue_only=overdue_only,
            launch_delay_s=delay_s,
        )

    base = bbp(0)
    if base == 0 or free <= 0:
        return 0, base, base, False
    best = bbp(free)
    if settings.overdue_fills_cap and bbp(free, overdue_only=True) > 0:
        return free, base, best, False
    if best == base:
        return 0, base, base, False
    lo, hi = 1, free
    while lo < hi:
        mid = (lo + hi) // 2
        if bbp(mid) <= best:
            hi = mid
        else:
            lo = mid + 1
    # Just in time: the same k launched at the next evaluation still reaches the least BBP, and no
    # group has missed its deadline already.
    overdue = any(g.count and g.deadline <= now for g in snapshot.batch_queue)
    wait = settings.just_in_time and not overdue and bbp(lo, delay_s=settings.eval_interval_s) <= best
    return lo, base, best, wait


def chiron_decide(
    snapshot: MetricsSnapshot, state: AutoscalerState, settings: ChironSettings, now: float
) -> ScalingDecision:
    """One evaluation of the global autoscaler: desired instance counts by role, with reasons."""
    reasons: list[str] = []
    current = RoleCounts(
        interactive=snapshot.ready.interactive + snapshot.pending.interactive,
        mixed=snapshot.ready.mixed + snapshot.pending.mixed,
        batch=snapshot.ready.batch + snapshot.pending.batch,
    )
    per_instance = state.instance_tokens_per_s or settings.default_instance_tokens_per_s
    if snapshot.batch_instance_tokens_per_s:
        a = settings.throughput_ewma
        measured = snapshot.batch_instance_tokens_per_s
        per_instance = (
            measured if state.instance_tokens_per_s is None else a * measured + (1 - a) * per_instance
        )

    # --- interactive and mixed (Chiron §5.2) ---
    theta, state = forecast_theta(snapshot, state, settings, now)
    im_now = current.interactive + current.mixed
    busy = snapshot.instances_with_interactive + (1 if snapshot.interactive_queued > 0 else 0)
    ibp = busy / im_now if im_now else (math.inf if busy else 0.0)
    n_i, n_m = interactive_targets(busy, settings, theta)
    interactive, mixed = current.interactive, current.mixed
    low = state.low_evaluations
    last_up = dict(state.last_scale_up)
    last_scaling = state.last_scaling
    hi_band = theta + settings.band
    lo_band = theta - settings.band
    if ibp > hi_band or im_now < settings.min_interactive:
        low = 0
        want_i, want_m = max(interactive, n_i), max(mixed, n_m)
        if (want_i, want_m) != (interactive, mixed):
            cooled = [
                r
                for r in ("interactive", "mixed")
                if now - last_up.get(r, -math.inf) < settings.scale_up_cooldown_s
            ]
            if cooled:
                reasons.append(f"IBP {ibp:.2f} > {hi_band:.2f} but scale-up cooldown holds {cooled}")
                want_i = interactive if "interactive" in cooled else want_i
                want_m = mixed if "mixed" in cooled else want_m
            else:
                reasons.append(
                    f"IBP {ibp:.2f} > {hi_band:.2f}: {busy} busy, target {n_i} interactive + {n_m} mixed"
                )
        interactive, mixed = want_i, want_m
    elif ibp < lo_band:
        low += 1
        target_total = n_i + n_m
        if low < settings.scale_down_evaluations:
            reasons.append(
                f"IBP {ibp:.2f} < {lo_band:.2f} ({low}/{settings.scale_down_evaluations} evaluations)"
            )
        elif last_scaling is not None and now - last_scaling < settings.scale_down_cooldown_s:
            reasons.append(
                f"IBP {ibp:.2f} < {lo_band:.2f} but scale-down cooldown "
                f"({now - last_scaling:.0f}s of {settings.scale_down_cooldown_s:.0f}s)"
            )
        elif target_total < im_now:
            # Drain mixed first (the over-provisioned spare), then interactive, never below the targets.
            mixed = max(n_m, mixed - (im_now - target_total))
            interactive = max(n_i, target_total - mixed)
            low = 0
            reasons.append(
                f"IBP {ibp:.2f} < {lo_band:.2f}: shrink to {interactive} interactive + {mixed} mixed"
            )
    else:
        low = 0

    # --- batch (Chiron §5.3) ---
    batch = current.batch
    queued = sum(g.count for g in snapshot.batch_queue)
    free = settings.max_instances - (interactive + mixed + batch)
    bbp_now = 0
    if queued > 0:
        k, bbp_now, bbp_after, wait = _batch_instances_needed(snapshot, settings, per_instance, now, free)
        held = snapshot.pending.batch > 0 and bbp_now <= state.last_batch_launch_backpressure
        if k > 0 and wait:
            reasons.append(
                f"batch backpressure: {bbp_now} groups late; +{k} batch instances launched at the next "
                "evaluation still meet them (just in time): wait"
            )
        elif k > 0 and not held:
            batch += k
            reasons.append(
                f"batch backpressure: {bbp_now} groups late; +{k} batch instances (BBP then {bbp_after})"
            )
        elif bbp_now > 0 and free <= 0:
            reasons.append(
                f"batch backpressure {bbp_now} but the pool is at its cap of {settings.max_instances}"
            )
        if batch == 0 and mixed == 0 and not _deferred(snapshot.batch_queue, settings, now):
            # No instance would ever pull the queue (BBP 0 with no batch capacity: a group of one
            # request has nothing ahead of it), and held work must still run.
            batch = 1
            reasons.append(f"{queued} batch requests queued, no batch or mixed instance: +1 batch instance")
    elif snapshot.batch_running == 0 and batch > 0:
        reasons.append(f"batch queue empty and idle: retire {batch} batch instances")
        batch = 0

    # --- bounds ---
    total = interactive + mixed + batch
    if total > settings.max_instances:
        # Interactive capacity comes first: trim batch, then mixed.
        over = total - settings.max_instances
        cut = min(over, max(0, batch - current.batch))
        batch -= cut
        over -= cut
        cut = min(over, max(0, mixed - current.mixed))
        mixed -= cut
        over -= cut
        interactive -= min(over, max(0, interactive - current.interactive))
    if interactive + mixed + batch < settings.min_instances:
        interactive += settings.min_instances - (interactive + mixed + batch)
    desired = RoleCounts(interactive=interactive, mixed=mixed, batch=batch)

    for role in ("interactive", "mixed", "batch"):
        if desired.get(role) > current.get(role):
            last_up[role] = now
    # Only interactive/mixed changes restart the scale-down stabilisation: retiring idle batch instances
    # says nothing about interactive load, and restarting it there would hold interactive
    # over-provisioning for another full cooldown.
    if (desired.interactive, desired.mixed) != (current.interactive, current.mixed):
        last_scaling = now
    new_state = replace(
        state,
        low_evaluations=low,
        last_scale_up=last_up,
        last_scaling=last_scaling,
        instance_tokens_per_s=per_instance
        if (state.instance_tokens_per_s or snapshot.batch_instance_tokens_per_s)
        else None,
        last_batch_launch_backpressure=bbp_now
        if desired.batch > current.batch
        else state.last_batch_launch_backpressure,
    )
    return ScalingDecision(
        desired=desired, reasons=tuple(reasons), state=new_state, ibp=ibp, batch_backpressure=bbp_now
    )

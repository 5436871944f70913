"""Local mode end to end: plan, start the workers, serve the router, optionally drive a trace and report.

The thin, I/O-owning layer over the pure pieces (``control_plane``, ``load``, ``report``, the core's
routing).
``compare_policies`` replays the same workload twice on the same running engines, the second time
under another policy (switched in place), and prints the two reports side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import httpx

from tessera.core.activation import Backoff, unit_idle_after
from tessera.core.routing import ROUTES, uses_engine_blocks
from tessera.local.autoscaler import LocalAutoscaler
from tessera.local.batch_job import JobWatch, follow, job_endpoint, job_lines, submit
from tessera.local.batch_process import BatchProcess
from tessera.local.control_plane import LocalPlan
from tessera.local.load import (
    LiveCounters,
    Outcome,
    Workload,
    WorkloadError,
    drive,
    endpoint_info,
    outstanding_of,
    same_prompts,
)
from tessera.local.report import (
    class_rows,
    render_answers,
    render_comparison,
    render_report,
    render_same_prompts,
    summarize_outcomes,
    write_comparison_plot,
    write_plots,
)
from tessera.local.scale_to_zero import LocalActuator, idle_units
from tessera.local.supervisor import Death, RestartBackoff, Supervisor
from tessera.router.activator import TICK_S, Activator
from tessera.router.app import ClassInfo, RouterState, create_router_app, router_status
from tessera.router.auth import ApiKeys
from tessera.router.chiron_hold import ChironHold
from tessera.router.protocol import RouterServer, router_server_config
from tessera.router.quota import QuotaStore

LIVE_PERIOD_S = 1.0
JOB_WINDOW = "1h"  # the completion window of a job beside a load (its lines' deadline)
RATE_WINDOW_S = 5.0
REAP_PERIOD_S = 0.5  # how often the stack looks for workers that died


@dataclass(frozen=True, slots=True)
class LoadSettings:
    """Where the load report goes, and what it shows."""

    json_path: Path | None = None
    plot_dir: Path | None = None
    live: bool = True
    answers: int = 0  # print this many answers to text prompts
    label: str | None = None  # the policy the run measures (titles, the report's "policy" key)


def describe_plan(plan: LocalPlan, autoscale: bool = True) -> str:
    """One line per instance to start, the problems, and which groups autoscale."""
    lines = [f"{len(plan.instances)} worker instance(s):"]
    for inst in plan.instances:
        models = ", ".join(m.name for m in inst.config.models)
        engine = inst.config.models[0].engine
        lines.append(f"  {inst.name}  role={inst.role}  policy={inst.config.scheduling.policy}  "
                     f"engine={engine}  models: {models}")  # fmt: skip
    lines += [f"  not served: {p}" for p in plan.problems]
    scaled = [g for g in plan.groups if autoscale and g.desired.pool.spec.autoscaling.enabled]
    if scaled:
        every = [
            f"{g.group.name} every {g.desired.pool.spec.autoscaling.interval_seconds:g} s" for g in scaled
        ]
        lines.append("autoscaling (Chiron, as the operator does): " + ", ".join(every))
    idle = idle_units(plan.groups)
    for group, models in idle.units.items():
        after = unit_idle_after([idle.policies[m] for m in models])
        lines.append(f"scale to zero: group {group} stops after {after:g} s without requests")
    lines += idle.problems
    return "\n".join(lines)


def live_table(
    counters: LiveCounters,
    status: dict[str, Any] | None,
    label: str | None = None,
    job: JobWatch | None = None,
) -> Any:
    """The live table: elapsed, rate, sent, outstanding at the router, finished, failed, SLO by class,
    and the progress of a Batch API job running beside the load (``job``)."""
    from rich.table import Table

    now = time.monotonic() - (counters.t0 or time.monotonic())
    recent = [t for t in counters.sent_times if t > now - RATE_WINDOW_S]
    rate = len(recent) / min(RATE_WINDOW_S, max(now, 1e-9))
    ok = sum(1 for o in counters.ended if o.ok)
    title = "tessera local load" if label is None else f"tessera local load, policy {label}"
    table = Table(title=title, show_edge=False)
    for col in ("elapsed", "rate", "sent", "queue", "finished", "failed"):
        table.add_column(col, justify="right")
    queue = "-" if status is None else str(outstanding_of(status))
    table.add_row(f"{now:.0f} s", f"{rate:.1f}/s", str(counters.sent), queue, str(ok),
                  str(len(counters.ended) - ok))  # fmt: skip
    rows = class_rows(counters.ended)
    if job is not None:
        table.caption = job.describe()
    if rows:
        slo = Table(show_edge=False)
        for col in ("class", "finished", "TTFT mean", "SLO met"):
            slo.add_column(col, justify="right")
        for name, row in rows.items():
            att = row["slo_attainment"]
            ttft = row["mean_ttft_s"]
            slo.add_row(name, str(row["finished"]), "-" if ttft is None else f"{ttft:.2f} s",
                        "-" if att is None else f"{att:.1%}")  # fmt: skip
        outer = Table.grid()
        outer.add_row(table)
        outer.add_row(slo)
        return outer
    return table


async def run_load(
    endpoint: str,
    workload: Workload,
    classes: dict[str, ClassInfo],
    class_header: str,
    settings: LoadSettings,
    status_fn: Callable[[], Awaitable[dict[str, Any] | None]],
    out: TextIO = sys.stdout,
) -> dict[str, Any]:
    """Drive ``workload`` with a live table; print and return the report (JSON and plots if asked)."""
    summary, _ = await _measure(endpoint, workload, classes, class_header, settings, status_fn, out)
    if settings.json_path is not None:
        _write_json(settings.json_path, [summary], out)
    return summary


async def compare_policies(
    stack: LocalStack,
    workload: Workload,
    classes: dict[str, ClassInfo],
    settings: LoadSettings,
    policy: str,
    baseline: str,
    out: TextIO = sys.stdout,
) -> dict[str, dict[str, Any]]:
    """Run ``workload`` under the workers' ``policy``, then again under ``baseline``; both reports by policy.

    The policy is switched in every running worker without a restart, so both runs see the same
    engines (a launched vLLM server keeps running). The second run follows the first: prompts it
    repeats may be served from vLLM's prefix cache, which favours ``baseline`` if anything.
    """
    assert stack.state is not None, "start the stack first"
    summaries: dict[str, dict[str, Any]] = {}
    outcomes: dict[str, list[Outcome]] = {}
    for name in (policy, baseline):
        if name != policy:
            await asyncio.to_thread(stack.supervisor.set_policy, name)
            print(f"\npolicy switched to {name} in every worker (engines keep running); "
                  "the same load again:", file=out, flush=True)  # fmt: skip
        run = LoadSettings(plot_dir=None if settings.plot_dir is None else settings.plot_dir / name,
                           live=settings.live, answers=settings.answers if name == policy else 0,
                           label=name)  # fmt: skip
        header = stack.state.class_header
        summaries[name], outcomes[name] = await _measure(stack.endpoint, workload, classes, header, run,
                                                         stack.status, out)  # fmt: skip
    print("\n" + render_comparison(summaries), file=out)
    if settings.json_path is not None:
        _write_json(settings.json_path, list(summaries.values()), out)
    if settings.plot_dir is not None:
        path = write_comparison_plot(outcomes, settings.plot_dir)
        print(f"plot written to {path}", file=out)
    return summaries


@dataclass(frozen=True, slots=True)
class JobRound:
    """One round of ``compare_batch_job``: the chat load alone, then (or before) with the job."""

    alone: dict[str, Any]
    with_job: dict[str, Any]
    job: JobWatch


async def compare_batch_job(
    stack: LocalStack,
    workload: Workload,
    classes: dict[str, ClassInfo],
    settings: LoadSettings,
    size: int,
    *,
    rounds: int = 1,
    window: str = JOB_WINDOW,
    out: TextIO = sys.stdout,
) -> list[JobRound]:
    """The interactive requests of ``workload`` alone and with a Batch API job of ``size`` lines (made
    from its batch requests, else from all of them: ``tessera.local.batch_job``) submitted at the
    load's start, in ``rounds`` interleaved rounds (the job first in every second round); each run with
    the job waits for the job's end. Prints each round's side-by-side report; returns the rounds.
    WorkloadError without interactive requests; BatchJobError when the router refuses the job."""
    assert stack.state is not None and stack.batch is not None, "start the stack with its batch component"
    kinds = {n: c.service_class.kind for n, c in classes.items()}
    chat = Workload(tuple(i for i in workload.items if kinds[i.class_name] == "interactive"), 0)
    if not chat.items:
        raise WorkloadError("the trace has no interactive request to measure beside the batch job")
    source = [i for i in workload.items if kinds[i.class_name] == "batch"] or list(workload.items)
    endpoint = job_endpoint(source)
    data = job_lines(source, size, endpoint)
    header = stack.state.class_header
    policy = "/".join(sorted({i.config.scheduling.policy for i in stack.plan.instances}))
    done: list[JobRound] = []
    async with httpx.AsyncClient(timeout=30.0) as client:
        for r in range(rounds):
            summaries: dict[str, dict[str, Any]] = {}
            watch = JobWatch()
            for with_job in (False, True) if r % 2 == 0 else (True, False):
                name = "+ batch job" if with_job else "alone"
                run = replace(
                    settings, json_path=None, plot_dir=None, answers=0, label=f"{policy}, chat {name}"
                )
                if not with_job:
                    summaries[name], _ = await _measure(stack.endpoint, chat, classes, header, run,
                                                        stack.status, out)  # fmt: skip
                    continue
                await submit(client, stack.endpoint, data, endpoint, window, watch)
                following = asyncio.create_task(follow(client, stack.endpoint, watch))
                try:
                    summaries[name], _ = await _measure(stack.endpoint, chat, classes, header, run,
                                                        stack.status, out, job=watch)  # fmt: skip
                    await following
                finally:
                    following.cancel()
                print(f"{watch.describe()}, {watch.makespan_s:.1f} s from submission to its end", file=out)
            print("\n" + render_comparison(summaries, title="same chat load"), file=out, flush=True)
            done.append(JobRound(summaries["alone"], summaries["+ batch job"], watch))
    return done


def adapter_families(plan: LocalPlan) -> list[list[str]]:
    """Each base model that adapters share, then its adapters: the model names, by base."""
    models = {m.name: m.adapter_of for i in plan.instances for m in i.config.models}
    bases = sorted({b for b in models.values() if b is not None})
    return [[b, *sorted(a for a, of in models.items() if of == b)] for b in bases]


async def ask_adapters(
    stack: LocalStack, workload: Workload, classes: dict[str, ClassInfo], count: int, out: TextIO = sys.stdout
) -> list[Outcome]:
    """The models the router lists (``/v1/models``), then the first ``count`` interactive text prompts
    of ``workload`` sent at once to each base model with adapters and to its adapters, through the
    router as the load sends them, and their answers side by side; the outcomes."""
    assert stack.state is not None, "start the stack first"
    async with httpx.AsyncClient(timeout=30.0) as client:
        _, _, served = await endpoint_info(stack.endpoint, client)
    print(f"\nmodels the router lists (/v1/models): {', '.join(sorted(served))}", file=out)
    outcomes: list[Outcome] = []
    for family in adapter_families(stack.plan):
        asked, wall = await drive(stack.endpoint, same_prompts(workload, classes, family, count), classes,
                                  stack.state.class_header)  # fmt: skip
        print(render_same_prompts(asked, wall), file=out, flush=True)
        outcomes += asked
    return outcomes


def _write_json(path: Path, results: list[dict[str, Any]], out: TextIO) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"scenario": "local-load", "results": results}, indent=2))
    print(f"report written to {path}", file=out)


async def _measure(
    endpoint: str,
    workload: Workload,
    classes: dict[str, ClassInfo],
    class_header: str,
    settings: LoadSettings,
    status_fn: Callable[[], Awaitable[dict[str, Any] | None]],
    out: TextIO,
    job: JobWatch | None = None,
) -> tuple[dict[str, Any], list[Outcome]]:
    """Drive ``workload`` with a live table (with ``job``'s progress) and print its report; the summary
    and the outcomes."""
    counters = LiveCounters()
    task = asyncio.create_task(drive(endpoint, workload, classes, class_header, counters=counters))
    if settings.live and out.isatty():
        from rich.console import Console
        from rich.live import Live

        first = live_table(counters, None, settings.label, job)
        with Live(first, console=Console(file=out), refresh_per_second=4) as live:
            while not task.done():
                await asyncio.wait({task}, timeout=LIVE_PERIOD_S)
                live.update(live_table(counters, await status_fn(), settings.label, job))
    elif settings.live:  # not a terminal: a progress line every few seconds
        while not task.done():
            await asyncio.wait({task}, timeout=5.0)
            status = await status_fn()
            ok = sum(1 for o in counters.ended if o.ok)
            queue = "-" if status is None else outstanding_of(status)
            line = (
                f"  sent {counters.sent}/{len(workload.items)}  queue {queue}  finished {ok}  "
                f"failed {len(counters.ended) - ok}"
            )
            print(line if job is None else f"{line}  {job.describe()}", file=out, flush=True)
    outcomes, wall = await task
    summary = summarize_outcomes(outcomes, wall)
    if settings.label is not None:
        summary = {"policy": settings.label, **summary}
    if workload.clipped:
        summary["clipped_to_context"] = workload.clipped
    if settings.label is not None:
        print(f"policy {settings.label}:", file=out)
    print(render_report(summary), file=out)
    if workload.clipped:
        print(f"({workload.clipped} request(s) shortened to fit the model's context length)", file=out)
    if settings.answers:
        print(render_answers(outcomes, settings.answers), file=out)
    if settings.plot_dir is not None:
        for path in write_plots(outcomes, settings.plot_dir):
            print(f"plot written to {path}", file=out)
    return summary, outcomes


class LocalStack:
    """Workers (processes) plus the in-process router, started and stopped together. While it runs, a
    worker that dies is reaped, dropped from the router and restarted after the supervisor's backoff
    (``tessera.local.supervisor``), each step reported."""

    def __init__(
        self,
        plan: LocalPlan,
        run_dir: Path,
        host: str,
        port: int,
        *,
        autoscale: bool = True,
        report: Callable[[str], None] = print,
        wake_backoff: Backoff | None = None,
        activation_tick_s: float = TICK_S,
        route: str = "least-wait",
        restart_backoff: RestartBackoff | None = None,
        batch: bool = False,
        api_keys: ApiKeys | None = None,
    ) -> None:
        """``wake_backoff`` and ``activation_tick_s``: the activator's retries of a failed wake-up and how
        often it looks for idle groups (services with ``spec.scaleToZero``). ``route``: the router's
        (``tessera.core.routing.ROUTES``); one that reads what the engines hold has every vLLM server the
        workers launch publish its KV events. ``batch``: also run the batch component (``tessera batch``,
        its state under ``<run_dir>/batch``) behind the router's /v1/files and /v1/batches. ``api_keys``:
        the router authenticates every request and enforces each tenant's quota (``tessera.router.auth``).
        ``restart_backoff``: how long a worker that died waits for its restart (default:
        ``RestartBackoff()``, the kubelet's)."""
        self.plan = plan
        self.route = route
        self.supervisor = Supervisor(run_dir, kv_events=uses_engine_blocks(ROUTES[route]),
                                     backoff=restart_backoff)  # fmt: skip
        self.host = host
        self.port = port
        self.autoscale = autoscale
        self.report = report
        self.state: RouterState | None = None
        self.autoscaler: LocalAutoscaler | None = None
        self.actuator: LocalActuator | None = None
        self.activator: Activator | None = None
        self.wake_backoff = wake_backoff
        self.activation_tick_s = activation_tick_s
        self.api_keys = api_keys
        self.batch = BatchProcess(run_dir, self.endpoint) if batch else None
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None
        self._scaling: asyncio.Task[None] | None = None
        self._reaping: asyncio.Task[None] | None = None
        self._restarts: set[asyncio.Task[None]] = set()

    @property
    def endpoint(self) -> str:
        """The router's base URL."""
        return f"http://{self.host}:{self.port}"

    async def start(self, ready_timeout_s: float) -> None:
        """Start every worker (waiting until ready), then the router on ``host:port``."""
        await asyncio.to_thread(self.supervisor.start_all, self.plan.instances, ready_timeout_s)
        # Chiron's dispatch holds work for instances with room: only where the autoscaler starts them.
        hold = ChironHold() if self.autoscale else None
        self.state = state = RouterState([w.backend() for w in self.supervisor.workers], route=self.route,
                                         hold=hold)  # fmt: skip
        idle = idle_units(self.plan.groups)
        if idle.units:
            # A wake-up starts the same processes as this start: it gets as long to be ready.
            self.actuator = LocalActuator(self.plan.groups, self.supervisor, state, ready_timeout_s)
            self.activator = Activator(
                idle.units,
                idle.policies,
                self.actuator,
                lambda model: sum(x.outstanding for x in state.loads.values() if x.model == model),
                backoff=self.wake_backoff,
                tick_s=self.activation_tick_s,
            )
        # One router process: the tenants' quotas are counted in its own windows, as a lone replica's.
        quota = QuotaStore(None) if self.api_keys is not None else None
        app = create_router_app(self.state, activator=self.activator, api_keys=self.api_keys, quota=quota,
                                batch=self.batch.link if self.batch is not None else None)  # fmt: skip
        self._server = _RouterServer(router_server_config(app, host=self.host, port=self.port))
        self._task = asyncio.create_task(self._serve(self._server), name="router")
        while not self._server.started:
            if self._task.done():
                await asyncio.to_thread(self.supervisor.stop_all)
                raise OSError(f"the router could not listen on {self.host}:{self.port} (port in use?); "
                              "pick another with --port")  # fmt: skip
            await asyncio.sleep(0.05)
        if self.batch is not None:
            try:
                await asyncio.to_thread(self.batch.start)
            except BaseException:
                await self.stop()
                raise
        self._reaping = asyncio.create_task(self._reap(), name="reaper")
        if self.autoscale:
            groups = self.plan.groups
            paused = self.actuator.asleep if self.actuator is not None else set()
            batch_url = self.batch.link.url if self.batch is not None else None
            self.autoscaler = LocalAutoscaler(groups, self.supervisor, self.state, report=self.report,
                                              paused=paused, batch_url=batch_url)  # fmt: skip
            self._scaling = asyncio.create_task(self.autoscaler.run(), name="autoscaler")

    async def _reap(self) -> None:
        """Until cancelled: reap the workers that died, drop them from the router, restart each after
        its backoff."""
        while True:
            await asyncio.sleep(REAP_PERIOD_S)
            deaths = self.supervisor.reap()
            if not deaths:
                continue
            for death in deaths:
                self.report(death.describe())
            self._refresh_router()
            for death in deaths:
                task = asyncio.create_task(self._restart(death), name=f"restart-{death.worker.instance.name}")
                self._restarts.add(task)
                task.add_done_callback(self._restarts.discard)

    async def _restart(self, death: Death) -> None:
        await asyncio.sleep(death.restart_in_s)
        worker = death.worker
        if self.supervisor.restart(worker):
            pid = worker.proc.pid if worker.proc is not None else "?"
            self.report(f"worker {worker.instance.name} restarted (pid {pid}, port {worker.port}); the "
                        "router takes it once it answers /ready")  # fmt: skip
            self._refresh_router()

    def _refresh_router(self) -> None:
        assert self.state is not None
        self.state.update(self.supervisor.backends())

    @staticmethod
    async def _serve(server: RouterServer) -> None:
        """Serve until stopped. uvicorn ends a failed start (the port taken) with ``sys.exit``, which
        asyncio raises out of the event loop, past ``start``'s clear message and the workers' stop:
        here it ends the task instead."""
        with contextlib.suppress(SystemExit):
            await server.serve()

    async def wait(self) -> None:
        """Serve until the router stops (Ctrl-C / SIGTERM)."""
        if self._task is not None:
            await self._task

    async def status(self) -> dict[str, Any] | None:
        """The router's status (in process), with the activator's view of every unit that may sleep."""
        return router_status(self.state, self.activator) if self.state is not None else None

    async def stop(self) -> None:
        """Stop the batch component, the reaper, the autoscaler, the router, then the workers (those
        draining too)."""
        if self.batch is not None:
            await asyncio.to_thread(self.batch.stop)
        for task in [t for t in (self._reaping, self._scaling) if t is not None] + list(self._restarts):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.autoscaler is not None:
            await self.autoscaler.close()
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await self._task
        await asyncio.to_thread(self.supervisor.stop_all)


class _RouterServer(RouterServer):
    """The router's server (``tessera.router.protocol.RouterServer``), except that a SIGTERM or Ctrl-C
    only ends serving: uvicorn re-raises the signal after its shutdown, which would end the process
    before local mode stops its workers."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


async def remote_status(endpoint: str) -> dict[str, Any] | None:
    """A router's status over HTTP (None when it does not answer it: down, or behind an API key)."""
    try:
        async with httpx.AsyncClient(timeout=2.0) as client:
            response = await client.get(f"{endpoint}/router/status")
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, json.JSONDecodeError):
        return None

"""`tessera local`: run the same custom resources on one machine, without a cluster.

``tessera local up -f FILE...`` plans the pools as the operator does, starts one worker process per
instance (engine ``sim`` by default; ``--engine vllm --model DIR|NAME`` or ``--vllm-url URL`` for real
vLLM, NAME being a model built by ``tessera models pull NAME``) and serves the router's OpenAI endpoint
on ``--host:--port`` (``--route`` picks how it ranks instances: with ``precise-prefix`` every launched
vLLM publishes its KV events and the router follows them). Pools with autoscaling enabled run the
operator's Chiron global autoscaler over the local workers (``--no-autoscale`` keeps the planned counts).
With ``--trace FILE`` it also drives that trace, prints the report and exits (``--compare-policy P``:
then the same trace again under policy P, switched in place, and both side by side; ``--batch-job N``:
first the trace's interactive requests alone and beside a Batch API job of N lines made from its batch
requests, with the job's progress in the live table and both side by side); without, it serves until
Ctrl-C.

``tessera local load --trace FILE`` drives a trace against a running endpoint (``--endpoint``) with a
live table, and ends with the report (``--json``, ``--plot``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tessera.commands import non_negative_int, positive_float, positive_int

if TYPE_CHECKING:
    from tessera.local.control_plane import LocalPlan

HELP = "Run the same custom resources on one machine, without a cluster."


def _add_load_flags(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--trace", type=Path, required=required, help="Trace to replay (CSV/JSONL, gz ok).")
    p.add_argument("--time-scale", type=positive_float, default=1.0,
                   help="Replay speed-up (2 = twice as fast).")  # fmt: skip
    p.add_argument("--duration", type=positive_float, default=None,
                   help="Only arrivals within this many seconds.")  # fmt: skip
    p.add_argument("--max-requests", type=int, default=None, help="At most this many requests.")
    p.add_argument("--batch-share", type=float, default=0.0,
                   help="Share of unclassed trace requests sent as the batch class.")  # fmt: skip
    p.add_argument("--seed", type=non_negative_int, default=0, help="Seed of the class draw (default 0).")
    p.add_argument("--target-model", default=None, help="Send every request to this model.")
    p.add_argument("--max-input-tokens", type=int, default=None, help="Cap of prompt tokens.")
    p.add_argument("--max-output-tokens", type=int, default=None, help="Cap of output tokens.")
    p.add_argument("--json", type=Path, default=None, help="Write the report as JSON here.")
    p.add_argument("--plot", type=Path, default=None, help="Write PNG plots into this folder.")
    p.add_argument("--no-live", action="store_true", help="No live table (only the final report).")
    p.add_argument("--answers", type=int, default=0,
                   help="Print this many answers to the trace's text prompts (default 0); `up` with "
                        "LoRA adapters then also asks each base and its adapters this many of the "
                        "trace's chat prompts and prints their answers side by side.")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Subcommands `up` and `load`."""
    from tessera.core.routing import ROUTES

    sub = parser.add_subparsers(dest="local_command", metavar="SUBCOMMAND")
    sub.required = True
    up = sub.add_parser("up", help="Start workers and the router for the given custom resources.")
    up.add_argument("-f", "--file", dest="files", type=Path, action="append", required=True,
                    help="YAML file of ServingPool / LLMService / RequestClass (repeatable).")  # fmt: skip
    up.add_argument("--engine", choices=["sim", "vllm"], default="sim", help="Engine of the workers.")
    up.add_argument("--model", dest="model_dir", default=None,
                    help="vLLM: model folder to launch, or the name of a model built by `tessera models "
                         "pull NAME` (default: the LLMServices' model when it is such a name).")  # fmt: skip
    up.add_argument("--vllm-url", default=None, help="vLLM: use this running server instead.")
    up.add_argument("--vllm-kv-events", default=None, metavar="ENDPOINT",
                    help="vLLM: where the server at --vllm-url publishes its KV events (its "
                         "--kv-events-config endpoint, tcp://HOST:PORT), for --route "
                         "precise-prefix.")  # fmt: skip
    up.add_argument("--tokenizer", default=None, metavar="DIR",
                    help="vLLM: the tokenizer folder of the model at --vllm-url; the workers tokenize "
                         "with it, and --route precise-prefix matches text completion prompts "
                         "exactly.")  # fmt: skip
    up.add_argument("--dtype", choices=["auto", "float16", "bfloat16", "float32"], default=None,
                    help="vLLM: --dtype of a launched server (default: a named model's; auto).")  # fmt: skip
    up.add_argument("--enforce-eager", action="store_true",
                    help="vLLM: skip the torch.compile warm-up (starts about 3x sooner on a small CPU, "
                         "decodes about a quarter slower).")  # fmt: skip
    up.add_argument("--kv-cache-gib", type=positive_int, default=1,
                    help="vLLM: CPU KV cache per server (GiB).")  # fmt: skip
    up.add_argument("--max-model-len", type=positive_int, default=None,
                    help="Override every model's context length.")  # fmt: skip
    up.add_argument("--max-instances", type=int, default=None,
                    help="Instances per placement group at most (default: the plan's; vllm: 1).")  # fmt: skip
    up.add_argument("--no-autoscale", action="store_true",
                    help="Keep the planned instance counts (default: pools with autoscaling.enabled run "
                         "the operator's Chiron autoscaler over the local workers).")  # fmt: skip
    up.add_argument("--route", default="least-wait", choices=list(ROUTES),
                    help="How the router picks an instance (as `tessera router --route`; default "
                         "least-wait). precise-prefix: by the prompt blocks each engine reports holding "
                         "(each launched vLLM then publishes its KV events on a free port).")  # fmt: skip
    up.add_argument("--no-batch", action="store_true",
                    help="Do not run the batch component (default: `tessera batch` serves /v1/files and "
                         "/v1/batches behind the router, its state in RUN_DIR/batch).")  # fmt: skip
    up.add_argument("--api-keys", type=Path, default=None,
                    help="API keys file (as `tessera router --api-keys`): every request needs a key, "
                         "each tenant's quota is enforced, and each key's tenant sees only its own files "
                         "and batches.")  # fmt: skip
    up.add_argument("--host", default="127.0.0.1", help="Router address (default 127.0.0.1).")
    up.add_argument("--port", type=int, default=8000, help="Router port (default 8000).")
    up.add_argument("--run-dir", type=Path, default=Path(".tessera-local"),
                    help="Worker configurations and logs go here (default .tessera-local).")  # fmt: skip
    up.add_argument("--ready-timeout", type=positive_float, default=None,
                    help="Seconds for workers to get ready (default 60 sim, 900 vllm).")  # fmt: skip
    up.add_argument("--compare-policy", default=None, metavar="POLICY",
                    help="With --trace: then replay it under POLICY (switched in place, engines keep "
                         "running) and print both runs side by side.")  # fmt: skip
    up.add_argument("--batch-job", type=positive_int, default=None, metavar="N",
                    help="With --trace: first run its interactive requests alone and beside a Batch API "
                         "job of N lines (the trace's batch prompts, through /v1/batches; the job's "
                         "progress in the live table) and print both side by side.")  # fmt: skip
    _add_load_flags(up, required=False)
    load = sub.add_parser("load", help="Drive a trace against a running endpoint; live table and report.")
    load.add_argument("--endpoint", default="http://127.0.0.1:8000", help="Router base URL.")
    _add_load_flags(load, required=True)


def _fail(message: str) -> int:
    print(f"tessera local: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Dispatch `up` / `load`."""
    from tessera.api import SpecError
    from tessera.local.batch_job import BatchJobError
    from tessera.local.batch_process import BatchStartError
    from tessera.local.control_plane import LocalPlanError
    from tessera.local.load import WorkloadError
    from tessera.local.supervisor import PolicySwitchError, WorkerStartError
    from tessera.models.cache import ModelCacheError
    from tessera.models.fit import ModelFitError
    from tessera.router.auth import ApiKeysError

    if args.answers < 0:
        return _fail(f"--answers must be >= 0, got {args.answers}")
    try:
        if args.local_command == "up":
            return asyncio.run(_up(args))
        return asyncio.run(_load(args))
    except (SpecError, LocalPlanError, WorkloadError, WorkerStartError, PolicySwitchError, ModelCacheError,
            ModelFitError, OSError, BatchStartError, BatchJobError, ApiKeysError) as exc:  # fmt: skip
        return _fail(str(exc))


def _workload(args: argparse.Namespace, classes: dict, models: dict) -> object:
    from tessera.api.traces import load_trace
    from tessera.local.load import WorkloadError, WorkloadOptions, build_workload

    options = WorkloadOptions(
        time_scale=args.time_scale, duration_s=args.duration, max_requests=args.max_requests,
        batch_share=args.batch_share, seed=args.seed, model=args.target_model,
        max_input_tokens=args.max_input_tokens, max_output_tokens=args.max_output_tokens,
    )  # fmt: skip
    try:
        rows = load_trace(args.trace)
    except ValueError as exc:
        raise WorkloadError(f"cannot read trace: {exc}") from None
    return build_workload(rows, classes, models, options)


def _settings(args: argparse.Namespace) -> object:
    from tessera.local.runner import LoadSettings

    return LoadSettings(json_path=args.json, plot_dir=args.plot, live=not args.no_live, answers=args.answers)


def _launch_source(
    args: argparse.Namespace, resources: Sequence[object]
) -> tuple[str | None, str, dict[str, float] | None]:
    """The model folder to launch (a named model resolved to its verified cache folder), its dtype, and
    the step profile its workers use (a known model's measured CPU profile, as worker JSON; else None).

    Without --model (and --vllm-url), vLLM launches the one model the LLMServices name when it is a
    known model (``tessera models list``).
    """
    from tessera.api import LLMService
    from tessera.models.cache import resolve_model
    from tessera.models.registry import KNOWN

    value = args.model_dir
    if value is None and args.engine == "vllm" and args.vllm_url is None:
        services = [r for r in resources if isinstance(r, LLMService) and r.spec.model.adapter is None]
        named = {r.spec.model.name for r in services}
        value = named.pop() if len(named) == 1 and named <= KNOWN.keys() else None
    if value is None:
        return None, args.dtype or "auto", None
    resolved = resolve_model(value)
    return str(resolved.path), args.dtype or resolved.dtype, resolved.worker_profile()


def adapter_folders(resources: Sequence[object]) -> dict[str, str]:
    """The cache folder of each adapter source that names an adapter of ``tessera models pull``, checked
    against the model of the adapter's base (ModelCacheError: unknown, of another base, or not built).
    An adapter whose base is not among ``resources`` is left to the plan, which names that fault."""
    from tessera.api import LLMService
    from tessera.models.cache import ModelCacheError, resolve_adapter

    services = {r.name: r for r in resources if isinstance(r, LLMService)}
    folders: dict[str, str] = {}
    for service in services.values():
        adapter = service.spec.model.adapter
        if adapter is None or not adapter.pulled or adapter.base not in services:
            continue
        try:
            folder = resolve_adapter(adapter.source, services[adapter.base].spec.model.name)
        except ModelCacheError as exc:
            raise ModelCacheError(f"LLMService {service.name}: {exc}") from None
        folders[adapter.source] = str(folder)
    return folders


def _check_launches(plan: LocalPlan) -> None:
    """Refuse, before anything starts, a launched model whose KV for one request cannot fit."""
    from tessera.models.fit import check_kv_fits

    for inst in plan.instances:
        for m in inst.config.models:
            if m.launch is not None:
                check_kv_fits(m.name, Path(m.launch.model_dir), m.launch.dtype, m.max_model_len,
                              m.launch.kv_cache_gib)  # fmt: skip


def _check_compare(args: argparse.Namespace, policies: set[str]) -> None:
    from tessera.core.registry import POLICIES, policy_class
    from tessera.local.control_plane import LocalPlanError

    if args.batch_job is not None and (args.trace is None or args.no_batch):
        raise LocalPlanError("--batch-job needs --trace (its interactive requests are the chat load) and "
                             "the batch component (leave out --no-batch)")  # fmt: skip
    if args.compare_policy is None:
        return
    if args.trace is None:
        raise LocalPlanError("--compare-policy needs --trace (the load both policies run)")
    if args.compare_policy not in POLICIES or policy_class(args.compare_policy).oracle:
        usable = ", ".join(sorted(p for p in POLICIES if not policy_class(p).oracle))
        raise LocalPlanError(f"--compare-policy {args.compare_policy!r} is not a policy a worker can run; "
                             f"use one of: {usable}")  # fmt: skip
    if len(policies) != 1 or args.compare_policy in policies:
        running = ", ".join(sorted(policies))
        raise LocalPlanError(f"--compare-policy needs every worker on one policy other than "
                             f"{args.compare_policy!r}; the workers run {running}")  # fmt: skip


async def _up(args: argparse.Namespace) -> int:
    from tessera.api import load_documents
    from tessera.local.control_plane import LocalEngine, plan_local
    from tessera.local.runner import (
        LocalStack,
        adapter_families,
        ask_adapters,
        compare_batch_job,
        compare_policies,
        describe_plan,
        run_load,
    )
    from tessera.router.app import class_infos
    from tessera.router.auth import ApiKeys

    if not 0 < args.port < 65536:
        return _fail(f"--port {args.port} is not a TCP port (1-65535)")
    resources = [r for path in args.files for r in load_documents(path)]
    model_dir, dtype, profile = _launch_source(args, resources)
    folders = adapter_folders(resources)
    engine = LocalEngine(args.engine, model_dir, args.vllm_url, args.kv_cache_gib, args.max_model_len, dtype,
                         args.enforce_eager, profile, args.vllm_kv_events, args.tokenizer)  # fmt: skip
    cap = args.max_instances if args.max_instances is not None else (1 if args.engine == "vllm" else None)
    plan = plan_local(resources, engine, max_instances_per_group=cap, adapter_folders=folders)
    _check_launches(plan)
    policies = {i.config.scheduling.policy for i in plan.instances}
    _check_compare(args, policies)
    print(describe_plan(plan, not args.no_autoscale), flush=True)
    api_keys = ApiKeys(args.api_keys) if args.api_keys is not None else None
    stack = LocalStack(plan, args.run_dir, args.host, args.port, autoscale=not args.no_autoscale,
                       report=lambda line: print(line, flush=True), route=args.route,
                       batch=not args.no_batch, api_keys=api_keys)  # fmt: skip
    timeout = args.ready_timeout or (900.0 if model_dir else 60.0)  # the worker's vLLM gets 900 s to start
    workload = None
    if args.trace is not None:
        classes = {n: c for i in plan.instances for n, c in class_infos(i.config).items()}
        models = {m.name: m.max_model_len for i in plan.instances for m in i.config.models}
        workload = _workload(args, classes, models)  # checked before anything starts
    started = time.monotonic()
    await stack.start(timeout)
    try:
        print(f"workers ready in {time.monotonic() - started:.1f} s (logs in {args.run_dir}/)")
        print(f"OpenAI endpoint: {stack.endpoint}/v1  (class header {stack.state.class_header}; "
              f"status {stack.endpoint}/router/status)", flush=True)  # fmt: skip
        if stack.batch is not None:
            print(f"Batch API: {stack.endpoint}/v1/batches (state in {stack.batch.state_dir}/)", flush=True)
        if workload is None:
            print("serving; Ctrl-C stops", flush=True)
            await stack.wait()
            return 0
        if args.batch_job is not None:  # first: under the workers' own policy
            print(f"the chat requests alone, then beside a Batch API job of {args.batch_job} lines:",
                  flush=True)  # fmt: skip
            await compare_batch_job(stack, workload, classes, _settings(args), args.batch_job)
            print("\nthe whole load:", flush=True)
        if args.compare_policy is not None:
            policy = policies.pop()
            await compare_policies(stack, workload, classes, _settings(args), policy, args.compare_policy)
        else:
            await run_load(stack.endpoint, workload, classes, stack.state.class_header, _settings(args),
                           stack.status)  # fmt: skip
        if args.answers and adapter_families(plan):  # after the load: its figures leave these out
            await ask_adapters(stack, workload, classes, args.answers)
        return 0
    finally:
        await stack.stop()


async def _load(args: argparse.Namespace) -> int:
    import httpx

    from tessera.local.load import endpoint_info
    from tessera.local.runner import remote_status, run_load

    async with httpx.AsyncClient() as client:
        classes, header, models = await endpoint_info(args.endpoint.rstrip("/"), client)
    workload = _workload(args, classes, models)
    endpoint = args.endpoint.rstrip("/")
    await run_load(endpoint, workload, classes, header, _settings(args), lambda: remote_status(endpoint))
    return 0

"""Scenario ``fidelity``: the simulator against real vLLM on this machine (target: within 15%).

1. Build the offline tiny random-weight Llama and start a real vLLM OpenAI server on it.
2. Measure it with ``tessera profile``'s logic and fit a step profile (decode slopes over
   concurrency 1..max_num_seqs at two prompt lengths; prefill slope; per-request API overhead),
   once before the replay (it sets the rate) and once after; the simulator uses the fit of
   both sample sets, and the drift between the two fits is reported.
3. Replay the same ``requests`` (default 200) through the real server (async streaming client)
   and through the simulator with the fitted profile, configured as the server's engine is:
   vLLM 0.32 runs the V1 engine (``enable_chunked_prefill=True`` in its logged config; async
   scheduling is off on CPU). Every V1 step schedules the running requests first (one decode
   token each, or their next prompt chunk), then admits waiting requests FCFS while the token
   budget ``max_num_batched_tokens`` (2048: vLLM's CPU default for the API server) and
   ``max_num_seqs`` allow; prompts longer than the budget left are chunked. That is the
   simulator's ``chunked_prefill`` engine with ``token_budget`` = the server's budget and
   ``max_batch`` = its max_num_seqs.
4. Report mean JCT and mean TTFT of both and their relative error (target within 15%).
   The target is checked on the server's own means (vLLM's ``vllm:e2e_request_latency_seconds``
   and ``vllm:time_to_first_token_seconds`` histograms over the replay: arrival at the API
   server to last / first token). The client's means are reported too, but the client shares
   the 2 loaded cores with the server and reads streamed tokens late and in bursts, which is a
   property of this machine, not of the engine the simulator models.

Arrivals (``arrivals``): ``trace`` (default), the Azure conversation trace's first rows (or
``--trace``'s: a trace of requests, a lengths file whose lengths the Azure rows take, or a rate series
whose sampled arrivals they take,
``rate_dist``: poisson | gamma), rescaled to ``rate``; or ``burst``, every request at time 0, which
compares the engine's capacity (makespan, throughput) without the queueing that makes mean TTFT at
high load swing with small capacity errors. For ``trace`` the rate is ``--rate``, or by default
``load`` (0.7) × the capacity the simulator predicts with the fitted profile for these requests,
so the server is busy enough for queueing and batching to matter (the point of fidelity; an idle
server only shows its idle latency). Lengths are scaled down to fit the tiny model
(``input/in_div`` clipped to [4, 1024], ``output/out_div`` clipped to [1, 512]; defaults 4 and 2).
The machine is shared: the load average before and after the replay is reported, because other
processes' load slows the real server and not the simulator; so is how late the client sent each
request after its trace time (the client shares the 2 cores with the server, and a late client
offers the server a different arrival pattern than the one the simulator replays).
Besides the targets, the report splits a request's time into the server's own phases (vLLM's
queue, prefill and decode histograms: queue = arrival at the engine to scheduled, prefill =
scheduled to first token, decode = first to last token) next to the simulator's, to show where
a gap comes from.
Options: requests (200), load (0.7), arrivals (trace), max_num_seqs (16), kv_cache_gib (1),
token_budget (2048), in_div (4), out_div (2), rate_dist, model (tiny).

``--set model=smollm2`` (a known model, `tessera models pull`) replays the same kind of requests through
vLLM serving that model (float32, eager, as the demo) against the simulator with the model's shipped
CPU profile (``smollm2-cpu``, not refitted: the profile the workers use is what is judged); 40
requests by default. Lengths are still the trace's (random-token prompts, ``ignore_eos``): this
scenario measures the engine's timing, `tessera bench real-policy --set model=smollm2` the policies
on the model's own answer lengths.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from tessera.api.traces import TraceRow
from tessera.bench.machine import MachineWatch
from tessera.bench.measure import E2E, ITL, PREFILL, QUEUE, TTFT, MetricsDelta
from tessera.bench.runner import AZURE_CONV, bench_trace, option, run_one
from tessera.bench.scenarios import BenchConfig, BenchReport, Progress
from tessera.bench.scenarios._common import saturation_rate
from tessera.core.profile import StepProfile
from tessera.core.profiles import Measurements, describe_profile, fit_profile, profile_to_dict
from tessera.core.registry import make_policy
from tessera.sim.cluster import ClusterConfig
from tessera.sim.engine import EngineConfig
from tessera.sim.workloads import build_requests, scale_to_rate

DESCRIPTION = "simulator vs real vLLM (tiny model on this CPU): mean JCT and TTFT error"


def _kv_bytes_per_token(model_dir: Path) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 4  # float32


def _shipped(model: str) -> tuple[Path, StepProfile] | None:
    """A known model's verified folder and its shipped CPU profile; None for the tiny model."""
    if model == "tiny":
        return None
    from tessera.core.profiles import PROFILES
    from tessera.models.cache import resolve_model

    resolved = resolve_model(model)
    if resolved.known is None or resolved.known.cpu_profile is None:
        raise ValueError(f"--set model={model}: not a known model with a shipped CPU profile; or model=tiny")
    return resolved.path, PROFILES[resolved.known.cpu_profile]


def _error_check(what: str, real: float, sim: float, *, target: bool = True) -> str:
    err = abs(sim - real) / real
    verdict = f"(target <= 15%): {'PASS' if err <= 0.15 else 'FAIL'}" if target else ""
    return f"{what}: real {real:.3f}s, sim {sim:.3f}s, error {err:.1%} {verdict}".rstrip()


def _phases(server: MetricsDelta, simulated: list) -> str:
    """The server's mean queue, prefill and decode-per-token times next to the simulator's."""
    queue = float(np.mean([r.first_scheduled_at - r.arrival for r in simulated]))
    prefill = float(np.mean([r.first_token_at - r.first_scheduled_at for r in simulated]))
    decoded = [r for r in simulated if r.generated > 1]
    decode = sum(r.finished_at - r.first_token_at for r in decoded) / sum(r.generated - 1 for r in decoded)
    return (
        f"phases, real vs sim (informative): queue {server.mean(QUEUE):.3f} vs {queue:.3f} s, "
        f"prefill {server.mean(PREFILL) * 1e3:.1f} vs {prefill * 1e3:.1f} ms, "
        f"decode {server.decode_seconds_per_token() * 1e3:.2f} vs {decode * 1e3:.2f} ms/token"
    )


def other_vllm_servers(own_pid: int | None = None) -> int:
    """vLLM OpenAI servers running on this machine besides ``own_pid`` (from /proc; 0 where unreadable)."""
    count = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == own_pid:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        count += b"vllm.entrypoints.openai.api_server" in cmdline
    return count


def replay_rows(
    config: BenchConfig, n: int, in_div: float, out_div: float
) -> tuple[list[TraceRow], np.ndarray, np.ndarray]:
    """The first ``n`` rows of ``--trace`` (or the Azure conversation trace) and their prompt and
    output lengths scaled down to the tiny model (``/in_div`` in [4, 1024], ``/out_div`` in [1, 512])."""
    rows = bench_trace(config, AZURE_CONV, n).rows
    inp = np.clip(np.round(np.array([r.input_tokens for r in rows]) / in_div), 4, 1024).astype(int)
    out = np.clip(np.round(np.array([r.output_tokens for r in rows]) / out_div), 1, 512).astype(int)
    return rows, inp, out


def run(config: BenchConfig, progress: Progress) -> BenchReport:
    """Real and simulated replay of the same requests."""
    from tessera.bench.measure import measure_and_fit, replay
    from tessera.models.tiny import build_tiny_model
    from tessera.worker.engines.vllm_process import VLLMServer

    opts = config.options
    model = str(option(opts, "model", "tiny", str))
    shipped = _shipped(model)
    n = option(opts, "requests", 200 if shipped is None else 40, int)
    load = config.load if config.load is not None else option(opts, "load", 0.7, float)
    if load <= 0:
        raise ValueError(f"load must be > 0, got {load}")
    seqs = option(opts, "max_num_seqs", 16, int)
    gib = option(opts, "kv_cache_gib", 1, int)
    budget = option(opts, "token_budget", 2048, int)
    in_div = option(opts, "in_div", 4.0, float)
    pattern = option(opts, "arrivals", "trace", str)
    if pattern not in ("trace", "burst"):
        raise ValueError(f"--set arrivals must be trace or burst, got {pattern!r}")
    out_div = option(opts, "out_div", 2.0, float)
    rows, inp, out = replay_rows(config, n, in_div, out_div)
    progress(0, total=4)  # model, server, profile + rate, replay + second profile
    with tempfile.TemporaryDirectory(prefix="tessera-fidelity-") as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny") if shipped is None else shipped[0]
        kvb = _kv_bytes_per_token(model_dir)
        vocab = min(1000, int(json.loads((model_dir / "config.json").read_text())["vocab_size"]))
        kv_tokens = gib * (1 << 30) // kvb
        progress(1)
        # a named model is served as its profile was measured, and as the demo serves it (eager)
        eager = [] if shipped is None else ["--enforce-eager"]
        server = VLLMServer(
            model_dir,
            served_model_name=None if shipped is None else model,
            max_num_seqs=seqs,
            kv_cache_gib=gib,
            enable_prefix_caching=False,
            extra_args=["--max-num-batched-tokens", str(budget), *eager],
            start_timeout_s=300 if shipped is None else 900,  # a real model starts slower on a loaded CPU
        )
        with server:
            server.start()
            progress(1)
            fit_args = (
                server.url,
                server.model_name,
                "tiny-cpu",
                kv_tokens,
                16,
                vocab,
                seqs,
                server.max_model_len,
            )
            if shipped is None:
                before, samples_before = measure_and_fit(*fit_args)
            else:
                before = replace(shipped[1], kv_capacity_tokens=kv_tokens)
            engine = EngineConfig(max_batch=seqs, chunked_prefill=True, token_budget=budget)
            cluster = ClusterConfig({"default": before}, 1, engine)
            if pattern == "burst":
                rate, arrivals = None, np.zeros(n)
            else:
                if config.rate is not None:
                    rate = config.rate
                else:
                    probe = build_requests(np.zeros(n), inp, out, np.random.default_rng(config.seed))
                    rate = load * saturation_rate(probe, cluster)
                arrivals = scale_to_rate([r.arrival for r in rows], rate)
            progress(1)
            others = other_vllm_servers(server.pid)
            with MachineWatch() as watch:
                replayed = asyncio.run(
                    replay(
                        server.url,
                        server.model_name,
                        [(float(a), int(p), int(o)) for a, p, o in zip(arrivals, inp, out, strict=True)],
                        vocab=vocab,
                    )
                )
            stalls = watch.stalls()
            after, samples_after = measure_and_fit(*fit_args) if shipped is None else (before, None)
            progress(1)
    probe_b, probe_ctx = seqs // 2, seqs // 2 * int(np.mean(inp) + np.mean(out) / 2)
    step_before, step_after = before.decode_step(probe_b, probe_ctx), after.decode_step(probe_b, probe_ctx)
    drift = abs(step_after - step_before) / step_before
    if samples_after is None:
        profile, samples = before, None  # the shipped profile, as measured by its own command
        how = [
            f"shipped profile {profile.name} (not refitted here; what the workers use): "
            f"{describe_profile(profile)}; {profile.source}"
        ]
    else:
        # The machine's other load drifts within minutes: the simulator gets the profile fitted on the
        # samples from both sides of the replay, and the drift between the two is reported.
        samples = Measurements(
            samples_before.prefill + samples_after.prefill,
            samples_before.decode + samples_after.decode,
            samples_before.overhead + samples_after.overhead,
        )
        profile = fit_profile(
            samples, "tiny-cpu", kv_capacity_tokens=kv_tokens, block_size=16, source=before.source
        )
        how = [
            f"fitted profile (samples before + after the replay): {describe_profile(profile)}",
            f"profile drift: a decode step at batch {probe_b} with {probe_ctx} context tokens fits to "
            f"{step_before * 1e3:.2f} ms before and {step_after * 1e3:.2f} ms after the replay "
            f"({drift:.0%}); when that exceeds the 15% target, this machine's load, not the simulator, "
            "decides the errors",
        ]
    cluster = ClusterConfig({"default": profile}, 1, engine)
    reqs = build_requests(arrivals, inp, out, np.random.default_rng(config.seed))
    simulated, sim = run_one(reqs, lambda: make_policy("fcfs"), cluster)
    client = replayed.requests
    # The client shares the machine: when it cannot get a core it sends late, and the server sees
    # a different (smoothed or bunched) arrival pattern than the trace the simulator replays.
    late = np.array([r.sent for r in client]) - arrivals
    real_span = float(np.max(arrivals + np.array([r.jct for r in client])) - arrivals[0])
    server_jct, server_ttft = replayed.server.mean(E2E), replayed.server.mean(TTFT)
    client_jct = float(np.mean([r.jct for r in client]))
    client_ttft = float(np.mean([r.ttft for r in client]))
    results = [
        {
            "policy": "fcfs:engine=vllm",
            "requests": n,
            "mean_jct_s": server_jct,
            "mean_ttft_s": server_ttft,
            "mean_itl_s": replayed.server.mean(ITL),
            "client_mean_jct_s": client_jct,
            "client_mean_ttft_s": client_ttft,
            "p99_jct_s": float(np.percentile([r.jct for r in client], 99)),
            "p99_ttft_s": float(np.percentile([r.ttft for r in client], 99)),
            "throughput_rps": n / real_span,
        },
        {"policy": "fcfs:engine=sim", **sim},
    ]
    checks = [
        _error_check("mean JCT (server-side)", server_jct, sim["mean_jct_s"]),
        _error_check("mean TTFT (server-side)", server_ttft, sim["mean_ttft_s"]),
        _error_check("mean JCT (client-side, informative)", client_jct, sim["mean_jct_s"], target=False),
        _error_check("mean TTFT (client-side, informative)", client_ttft, sim["mean_ttft_s"], target=False),
        _phases(replayed.server, simulated),
        *how,
        (
            f"offered rate {rate:.2f} req/s (load {load:g} of the simulated capacity unless --rate); "
            if pattern == "trace"
            else f"all {n} requests at time 0 (arrivals=burst); "
        )
        + f"makespan real {real_span:.2f} s, sim {max(r.finished_at for r in simulated):.2f} s; "
        f"{watch.describe_load()} during the replay; stalls of the bench process (the machine "
        f"stopped it for >= 0.1 s): {stalls.describe()}; "
        f"{others} other vLLM server(s) running when the replay started",
        f"requests sent late by the client (after their trace time): mean {late.mean() * 1e3:.1f} ms, "
        f"p99 {np.percentile(late, 99) * 1e3:.1f} ms, max {late.max() * 1e3:.1f} ms; the simulator "
        "replays the trace's times",
    ]
    cfg = {
        **config.as_dict(),
        "requests": n,
        "arrivals": pattern,
        "rate": rate,
        "load_avg_range": list(watch.load_range()),
        "stalls": stalls.count,
        "stalled_s": stalls.total_s,
        "longest_stall_s": stalls.longest_s,
        "send_late_mean_s": float(late.mean()),
        "send_late_p99_s": float(np.percentile(late, 99)),
        "other_vllm_servers": others,
        "profile": profile_to_dict(profile),
        "samples": None
        if samples is None
        else {"prefill": samples.prefill, "decode": samples.decode, "overhead": samples.overhead},
        "profile_before": profile_to_dict(before),
        "profile_after": profile_to_dict(after),
        "profile_drift": None if samples is None else drift,
        "max_num_seqs": seqs,
        "kv_tokens": kv_tokens,
        "token_budget": budget,
    }
    return BenchReport("fidelity", cfg, results, checks)

"""A served model's own answers to a prompt set, as training data for the ELIS length predictor.

The model is served by real vLLM on this machine (``VLLMServer``, ``--enforce-eager``); every prompt
is sent once per decoding: ``greedy`` (temperature 0) and ``sampled`` at ``temperature`` for each
seed. Each answer is one row of the prompt/response JSONL(.gz) that ``tessera predictor train``
reads: ``prompt_id`` (the split key), ``prompt``, ``response``, ``source``, ``model``, plus
``decoding``, ``temperature``, ``seed``, ``prompt_tokens`` and ``response_tokens`` (vLLM's usage
counts, in the served model's tokens), ``finish_reason`` (``length`` when the answer hit
``max_tokens``) and ``max_tokens``.

Reproducibility: rows are written sorted by prompt id and decoding, gzipped with a fixed header, so
the same answers give the same bytes. Greedy answers depend only on the prompt, up to the engine's
batch-dependent float rounding. Sampled answers are not reproducible: vLLM 0.32 on CPU fails on a
per-request ``seed`` ("CPU Generator does not use offset", when a seeded request's prefill is split),
so they draw from the engine's shared generator and depend on the batching; the seed only names the
run (``t0.7-s1``), and the shipped file is the record of what the model answered.

Stopping and resuming: every answer is appended to ``<out>.partial.jsonl`` as it finishes; a run
stopped (``stop_after_s``, or killed) resumes from it. Jobs are sent greedy first, in prompt order, and
``out`` holds the answers before the first job still unanswered (``answered_prefix``), so that a
stopped run does not ship the short answers to late prompts without the long ones.
"""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tessera.api.traces import read_jsonl
from tessera.bench.runner import SHARED_DATA

ALPACA_PROMPTS = SHARED_DATA / "alpacaeval_prompts.jsonl.gz"


@dataclass(frozen=True, slots=True)
class Decoding:
    """One way of answering every prompt: greedy, or sampled at a temperature with a run seed."""

    name: str
    temperature: float
    seed: int | None = None  # names a sampled run (see the module doc: not sent to vLLM)


def decodings(greedy: bool, temperature: float, seeds: list[int]) -> list[Decoding]:
    """The decodings of a run: greedy (when asked) then one sampled decoding per seed."""
    if temperature <= 0:
        raise ValueError(f"--temperature must be > 0 (greedy is its own decoding), got {temperature}")
    out = [Decoding("greedy", 0.0)] if greedy else []
    out += [Decoding(f"t{temperature:g}-s{s}", temperature, s) for s in seeds]
    if not out:
        raise ValueError("nothing to generate: keep greedy or give at least one --seed")
    return out


def load_prompts(path: Path, limit: int | None = None) -> list[dict[str, str]]:
    """``prompt_id``, ``prompt`` and ``source`` of each row (the first ``limit``); ValueError on bad rows."""
    if not path.is_file():
        raise ValueError(f"prompts file {path} does not exist: give a JSONL(.gz) with prompt_id and prompt")
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    for lineno, rec in read_jsonl(path):
        for key in ("prompt_id", "prompt"):
            if not isinstance(rec.get(key), str) or not rec[key]:
                raise ValueError(f"{path}:{lineno}: field {key!r} must be a non-empty string")
        if rec["prompt_id"] in seen:
            raise ValueError(f"{path}:{lineno}: prompt_id {rec['prompt_id']!r} appears twice")
        seen.add(rec["prompt_id"])
        rows.append(
            {"prompt_id": rec["prompt_id"], "prompt": rec["prompt"], "source": str(rec.get("source", ""))}
        )
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


async def _answer_all(
    url: str,
    model: str,
    jobs: list[tuple[dict[str, str], Decoding]],
    max_tokens: int,
    concurrency: int,
    on_row: Callable[[dict[str, Any]], None],
    stop_after_s: float | None,
) -> list[dict[str, Any]]:
    """One chat completion per job, at most ``concurrency`` in flight, sent in job order; each row is
    handed to ``on_row`` as it finishes. After ``stop_after_s`` the unfinished ones are cancelled.
    Returns the finished rows."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(3600.0), limits=limits) as client:

        async def one(prompt: dict[str, str], dec: Decoding) -> dict[str, Any]:
            body: dict[str, Any] = {
                "model": model,
                "messages": [{"role": "user", "content": prompt["prompt"]}],
                "max_tokens": max_tokens,
                "temperature": dec.temperature,
            }
            async with sem:
                resp = await client.post("/v1/chat/completions", json=body)
            if resp.status_code != 200:
                raise RuntimeError(
                    f"{prompt['prompt_id']} ({dec.name}): HTTP {resp.status_code}: {resp.text[:300]}"
                )
            data = resp.json()
            choice = data["choices"][0]
            row = {
                "id": f"{prompt['prompt_id']}__{model}__{dec.name}",
                "prompt_id": prompt["prompt_id"],
                "source": prompt["source"],
                "model": model,
                "decoding": dec.name,
                "temperature": dec.temperature,
                "seed": dec.seed,
                "max_tokens": max_tokens,
                "prompt": prompt["prompt"],
                "response": choice["message"]["content"] or "",
                "prompt_tokens": int(data["usage"]["prompt_tokens"]),
                "response_tokens": int(data["usage"]["completion_tokens"]),
                "finish_reason": choice["finish_reason"],
            }
            on_row(row)
            return row

        tasks = [asyncio.create_task(one(p, d)) for p, d in jobs]
        if not tasks:
            return []
        done, pending = await asyncio.wait(tasks, timeout=stop_after_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return [task.result() for task in tasks if task in done]  # re-raises a failed request


def answered_prefix(rows: list[dict[str, Any]], order: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """The answers to the jobs (prompt id, decoding) before the first one without an answer, in ``order``.

    A stopped run has its short answers to late prompts and lacks the long ones still in flight;
    keeping those would bias the lengths short. The jobs before the first unanswered one are all answered,
    whatever their length."""
    by_job = {(r["prompt_id"], r["decoding"]): r for r in rows}
    out: list[dict[str, Any]] = []
    for job in order:
        if job not in by_job:
            break
        out.append(by_job[job])
    return out


def partial_path(out: Path) -> Path:
    """Where a run appends each answer as it finishes, so that a stopped run resumes."""
    return out.with_name(out.name + ".partial.jsonl")


def load_partial(path: Path, max_tokens: int, model: str) -> list[dict[str, Any]]:
    """The answers a stopped run already has; ValueError when they were made with other settings."""
    if not path.is_file():
        return []
    rows = [rec for _, rec in read_jsonl(path)]
    for row in rows:
        if row.get("max_tokens") != max_tokens or row.get("model") != model:
            raise ValueError(
                f"{path} holds answers of model {row.get('model')!r} at max_tokens {row.get('max_tokens')}, "
                f"not {model!r} at {max_tokens}: delete it or resume with the same --model and --max-tokens"
            )
    return rows


def write_rows(rows: list[dict[str, Any]], out: Path) -> None:
    """Rows sorted by (prompt id, decoding) as JSONL, gzipped when ``out`` ends in .gz (fixed header:
    equal rows give equal bytes)."""
    rows = sorted(rows, key=lambda r: (r["prompt_id"], r["decoding"]))
    text = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows).encode()
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".gz":
        buf = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
            gz.write(text)
        out.write_bytes(buf.getvalue())
    else:
        out.write_bytes(text)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per decoding: answers, mean/median/p90/max response tokens, and how many hit ``max_tokens``."""
    out: dict[str, Any] = {}
    for name in sorted({r["decoding"] for r in rows}):
        lens = sorted(r["response_tokens"] for r in rows if r["decoding"] == name)
        finish = Counter(r["finish_reason"] for r in rows if r["decoding"] == name)
        out[name] = {
            "answers": len(lens),
            "mean_tokens": sum(lens) / len(lens),
            "median_tokens": lens[len(lens) // 2],
            "p90_tokens": lens[min(len(lens) - 1, int(0.9 * len(lens)))],
            "max_tokens": lens[-1],
            "hit_cap": finish.get("length", 0),
            "hit_cap_share": finish.get("length", 0) / len(lens),
        }
    return out


def generate(
    model_dir: Path,
    model_name: str,
    prompts: list[dict[str, str]],
    decs: list[Decoding],
    out: Path,
    max_tokens: int,
    max_num_seqs: int,
    kv_cache_gib: int,
    dtype: str,
    stop_after_s: float | None = None,
    serve: bool = True,
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    """Serve ``model_dir`` with real vLLM, answer every prompt under every decoding (greedy ones first),
    write ``out``; return the summary (per-decoding lengths, cap hits, tokens per second).

    Answers already in ``partial_path(out)`` (from a stopped run) are kept and not asked again; after
    ``stop_after_s`` seconds of answering the run stops and ``out`` holds ``answered_prefix`` of the
    answers so far. ``serve`` False only writes ``out`` from the answers kept."""
    from tessera.worker.engines.vllm_process import VLLMServer

    if max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {max_tokens}")
    if max_num_seqs < 1:
        raise ValueError(f"--max-num-seqs must be >= 1, got {max_num_seqs}")
    partial = partial_path(out)
    rows = load_partial(partial, max_tokens, model_name)
    have = {(r["prompt_id"], r["decoding"]) for r in rows}
    order = [(p, d) for d in decs for p in prompts]
    jobs = [(p, d) for p, d in order if (p["prompt_id"], d.name) not in have] if serve else []
    server = VLLMServer(
        model_dir,
        served_model_name=model_name,
        max_model_len=4096,
        max_num_seqs=max_num_seqs,
        kv_cache_gib=kv_cache_gib,
        dtype=dtype,
        extra_args=["--enforce-eager"],
        start_timeout_s=1200.0,  # a 2-core machine shared with other servers took over 5 minutes
    )
    t0 = time.perf_counter()
    new: list[dict[str, Any]] = []
    seconds = 0.0
    if jobs:
        with server, partial.open("a", encoding="utf-8") as sink:
            log(f"vLLM up in {time.perf_counter() - t0:.0f} s (log {server.log_path}); {len(rows)} answers "
                f"kept from {partial}, {len(jobs)} to go")  # fmt: skip
            t1 = time.perf_counter()
            step = max(1, len(jobs) // 40)

            def keep(row: dict[str, Any]) -> None:
                sink.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")
                sink.flush()
                new.append(row)
                if len(new) % step == 0 or len(new) == len(jobs):
                    took = time.perf_counter() - t1
                    tokens = sum(r["response_tokens"] for r in new)
                    log(f"  {len(new)}/{len(jobs)} answers in {took:.0f} s ({tokens / took:.1f} tokens/s)")

            asyncio.run(
                _answer_all(server.url, model_name, jobs, max_tokens, max_num_seqs, keep, stop_after_s)
            )
            seconds = time.perf_counter() - t1
    rows = answered_prefix(rows + new, [(p["prompt_id"], d.name) for p, d in order])
    write_rows(rows, out)
    complete = len(rows) == len(order)
    if complete:
        partial.unlink(missing_ok=True)
    tokens = sum(r["response_tokens"] for r in new)
    return {
        "rows": len(rows),
        "complete": complete,
        "missing": len(order) - len(rows),
        "new_rows": len(new),
        "seconds": seconds,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / seconds if seconds > 0 else None,  # JSON has no NaN
        "decodings": summarize(rows),
    }

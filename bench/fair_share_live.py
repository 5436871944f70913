"""Live fair share: two tenants through ``tessera local up`` (sim engine), tenant a's TTFT with and without
VTC (docs/bench.md, "Fair share between tenants").

    .venv/bin/python bench/fair_share_live.py --fair on  [--rate-a 3.5 --flood 10 --seconds 30]
    .venv/bin/python bench/fair_share_live.py --fair on --lift-credit 65536
    .venv/bin/python bench/fair_share_live.py --fair off
    .venv/bin/python bench/fair_share_live.py --fair off --flood 0   # a alone

One instance (batch 8, fcfs, chat TTFT SLO 2 s, the chat class's queue bound ``--max-queued``, 5000),
two API keys; a sends streamed chat requests of ``--max-tokens`` tokens as Poisson arrivals at
``--rate-a``, b at ``--flood`` times that, for ``--seconds`` (``--flood 0``: a alone); prints one JSON
line (a's TTFT p50/p99 and share within 2 s, answers of each tenant, seconds until the last answer).
The default 3.5 req/s is a's fair share on an idle machine: half of what the sim engine serves at
batch 8 with the worker's default step times (200 tokens at 4 + 0.2 x 8 ms a step: 7.1 req/s). On a
busy one the pod streams fewer tokens than that: ``--rate-a`` half the answers per second it served.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
KEYS = {"a": "sk-tenant-a-0123456789", "b": "sk-tenant-b-0123456789"}
SPEC = """apiVersion: tessera.dev/v1alpha1
kind: ServingPool
metadata: {{name: pool}}
spec:
  gpu: {{type: H100, perInstance: 1, memory: 80Gi}}
  instances: {{min: 1, max: 1}}
  autoscaling: {{enabled: false, batchSize: {{min: 1, max: 8, initial: 8}}}}
---
apiVersion: tessera.dev/v1alpha1
kind: RequestClass
metadata: {{name: chat}}
spec: {{kind: interactive, slo: {{ttftSeconds: 2, itlSeconds: 0.2}}, queue: {{maxQueued: {max_queued}}},
        match: {{value: chat}}}}
---
apiVersion: tessera.dev/v1alpha1
kind: LLMService
metadata: {{name: llama-8b}}
spec:
  model: {{name: {model}, maxModelLength: 8192, weightsSize: 16Gi}}
  poolRef: {{name: pool}}
  requestClasses: [{{name: chat}}]
  scheduling: {{policy: fcfs, fairShare: {{enabled: {fair}, liftCredit: {credit}}}}}
"""


async def _one(client: httpx.AsyncClient, key: str, max_tokens: int, ttfts: list[float], codes: list) -> None:
    start = time.perf_counter()
    body = {"model": MODEL, "max_tokens": max_tokens, "stream": True,
            "messages": [{"role": "user", "content": "Tell me a long story about the sea."}]}  # fmt: skip
    headers = {"authorization": f"Bearer {key}", "x-tessera-class": "chat"}
    try:
        async with client.stream("POST", "/v1/chat/completions", headers=headers, json=body) as answer:
            codes.append(answer.status_code)
            first = answer.status_code == 200
            async for line in answer.aiter_lines():
                if first and line.startswith("data: ") and '"content"' in line:
                    ttfts.append(time.perf_counter() - start)
                    first = False
    except httpx.HTTPError as exc:
        codes.append(type(exc).__name__)


async def _tenant(client: httpx.AsyncClient, key: str, rate: float, args: argparse.Namespace, seed: int,
                  ttfts: list[float], codes: list) -> None:  # fmt: skip
    rng, at, tasks, start = np.random.default_rng(seed), 0.0, [], time.perf_counter()
    while rate > 0 and (at := at + rng.exponential(1 / rate)) <= args.seconds:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        tasks.append(asyncio.create_task(_one(client, key, args.max_tokens, ttfts, codes)))
    await asyncio.gather(*tasks)


async def _load(port: int, args: argparse.Namespace) -> dict:
    limits = httpx.Limits(max_connections=5000, max_keepalive_connections=200)
    got = {t: ([], []) for t in KEYS}
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=900, limits=limits) as client:
        await asyncio.gather(*(_tenant(client, KEYS[t], args.rate_a * (args.flood if t == "b" else 1), args,
                                       seed, *got[t]) for seed, t in enumerate(KEYS)))  # fmt: skip
    ttfts, codes = got["a"]
    return {"fair": args.fair, "lift_credit": args.lift_credit, "rate_a": args.rate_a, "flood": args.flood,
            "seconds": args.seconds, "max_queued": args.max_queued,
            "a_requests": len(codes), "a_ok": codes.count(200),
            "a_p50_ttft_s": float(np.percentile(ttfts, 50)), "a_p99_ttft_s": float(np.percentile(ttfts, 99)),
            "a_within_2s": float(np.mean([x <= 2 for x in ttfts])),
            "b_requests": len(got["b"][1]), "b_ok": got["b"][1].count(200),
            "elapsed_s": time.perf_counter() - start}  # fmt: skip


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> int:
    """Start local mode, run the two tenants' load, print the result, stop."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fair", choices=["on", "off"], required=True)
    parser.add_argument("--rate-a", type=float, default=3.5)
    parser.add_argument("--flood", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--max-queued", type=int, default=5000, help="the chat class's queue bound")
    parser.add_argument("--lift-credit", type=float, default=0.0, help="VTC's fairShare.liftCredit")
    parser.add_argument("--port", type=int, default=18431)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        fair = str(args.fair == "on").lower()
        spec = SPEC.format(model=MODEL, fair=fair, max_queued=args.max_queued, credit=args.lift_credit)
        (folder / "spec.yaml").write_text(spec)
        (folder / "keys.yaml").write_text("keys:\n" + "".join(
            f"  - {{key: {k}, tenant: team-{t}}}\n" for t, k in KEYS.items()))  # fmt: skip
        command = [sys.executable, "-m", "tessera", "local", "up", "-f", str(folder / "spec.yaml"),
                   "--no-autoscale", "--no-batch", "--api-keys", str(folder / "keys.yaml"),
                   "--port", str(args.port), "--run-dir", str(folder / "run")]  # fmt: skip
        with open(folder / "up.log", "w") as log:
            up = subprocess.Popen(
                command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            deadline = time.monotonic() + 120
            while not _ready(args.port):
                if up.poll() is not None or time.monotonic() > deadline:
                    print((folder / "up.log").read_text(), file=sys.stderr)
                    return 1
                time.sleep(0.5)
            print(json.dumps(asyncio.run(_load(args.port, args))))
        finally:
            os.killpg(up.pid, signal.SIGINT)
            up.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())

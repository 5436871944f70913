"""A base request batched beside an adapter's on real vLLM (CPU) gets the base's own answer, also once
every LoRA slot holds an adapter: vLLM's CPU LoRA ops then gave it the last slot's delta, which the
worker's ``vllm_fixes`` mends in every server it starts. The unit half checks the fixed ops against
vLLM's own on tensors; the integration half asks the session's tiny-model server."""

from __future__ import annotations

import asyncio
import importlib
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import TINY_MAX_LORAS, TINY_MODEL_NAME

from tessera.worker.engines.vllm_fixes import GATHERING_OPS, LORA_TORCH_OPS, skip_unadapted_tokens
from tessera.worker.engines.vllm_process import VLLM_SITE, VLLMServer

PROMPT = {
    "messages": [{"role": "user", "content": "Name three colours."}],
    "temperature": 0,
    "max_tokens": 12,
}


def test_the_pinned_vllm_gives_an_unadapted_token_the_last_slots_delta_and_the_fix_none() -> None:
    import torch

    ops = importlib.import_module(LORA_TORCH_OPS)
    torch.manual_seed(0)
    x = torch.randn(3, 16)
    a = torch.randn(1, 1, 4, 16)  # one slot, full: rank 4
    indices = torch.tensor([0, -1, 0])
    for op in (ops.bgmv_shrink, skip_unadapted_tokens(ops.bgmv_shrink)):
        y = torch.zeros(3, 4)
        op(x, a, y, indices, 1.0)
        assert torch.allclose(y[[0, 2]], x[[0, 2]] @ a[0, 0].T, atol=1e-5)  # adapted tokens: their delta
        unadapted = y[1]
        if op is ops.bgmv_shrink:  # the bug this fix exists for: -1 is the last slot
            assert torch.allclose(unadapted, x[1] @ a[0, 0].T, atol=1e-5)
        else:
            assert torch.equal(unadapted, torch.zeros(4))
    b = torch.randn(1, 1, 16, 4)
    base = torch.randn(3, 16)
    y = base.clone()
    skip_unadapted_tokens(ops.bgmv_expand)(torch.ones(3, 4), b, y, indices, True)
    assert torch.equal(y[1], base[1]) and not torch.equal(y[0], base[0])
    y = torch.zeros(3, 32)
    skip_unadapted_tokens(ops.bgmv_expand_slice)(torch.ones(3, 4), b, y, indices, 16, 16, True)
    assert torch.equal(y[1], torch.zeros(32)) and torch.equal(y[0, :16], torch.zeros(16))


def test_the_servers_processes_load_vllms_lora_ops_fixed_where_its_cpu_backend_binds_them() -> None:
    check = (
        "import vllm.lora.punica_wrapper.punica_cpu as cpu, vllm.lora.ops.torch_ops.lora_ops as ops\n"
        f"names = {GATHERING_OPS!r}\n"
        "print(all(getattr(getattr(ops, n), '__tessera_fixed__', False) for n in names),\n"
        "      all(getattr(cpu, n) is getattr(ops, n) for n in names))\n"
    )
    env = VLLMServer("unused").environment()
    assert env["PYTHONPATH"].split(os.pathsep)[0] == VLLM_SITE
    fixed = subprocess.run(
        [sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=300
    )
    plain = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert fixed.stdout.split() == ["True", "True"], fixed.stderr[-2000:]
    assert plain.stdout.split() == ["False", "True"], plain.stderr[-2000:]


async def _ask(client: httpx.AsyncClient, model: str) -> str:
    reply = await client.post("/v1/chat/completions", json={"model": model, **PROMPT})
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["message"]["content"])


@pytest.mark.integration
@pytest.mark.timeout(600)
async def test_a_base_request_beside_adapters_filling_every_slot_gets_the_bases_answer(
    vllm_server: VLLMServer, tiny_adapter_dir: Path
) -> None:
    names = [f"slot-filler-{k}" for k in range(TINY_MAX_LORAS)]
    async with httpx.AsyncClient(base_url=vllm_server.url, timeout=120) as client:
        try:
            for name in names:
                body = {"lora_name": name, "lora_path": str(tiny_adapter_dir)}
                loaded = await client.post("/v1/load_lora_adapter", json=body)
                assert loaded.status_code == 200, loaded.text
            alone = [await _ask(client, m) for m in names]  # each adapter takes a slot: all are full
            own_base = await _ask(client, TINY_MODEL_NAME)
            together = await asyncio.gather(
                *(_ask(client, m) for m in [TINY_MODEL_NAME, *names, TINY_MODEL_NAME])
            )
        finally:
            for name in names:  # the shared server is left as found
                await client.post("/v1/unload_lora_adapter", json={"lora_name": name})
    assert alone == [alone[0]] * len(names) and alone[0] != own_base
    assert together == [own_base, *alone, own_base]

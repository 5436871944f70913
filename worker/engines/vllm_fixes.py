"""Fixes to the installed vLLM, applied in every process of a vLLM server the worker starts.

vLLM's PyTorch LoRA ops (``vllm.lora.ops.torch_ops.lora_ops``, the ones its CPU backend runs) gather
each token's adapter weights with ``weights[indices]``, where an index of -1 means "no adapter". In
Python -1 is the last slot, so once every LoRA slot holds an adapter (the usual state with
``--max-loras 1``), a base-model request batched beside an adapter's request gets that adapter's
delta: wrong answers, no error. The GPU kernels skip -1, so only CPU serving is affected. The fix
zeroes those tokens' inputs and gathers slot 0 for them: the ops are linear in their inputs (no bias),
so the delta of a -1 token is exactly zero and every other token's result is unchanged. (A known
upstream bug, still open for the vLLM this project pins.)

``install`` registers an import hook, so the fix lands when vLLM first imports the module and a process
that never does pays nothing; vLLM's CPU backend spawns its engine processes, which is why the hook is
installed by a ``sitecustomize`` that ``VLLMServer`` puts on the server's ``PYTHONPATH``.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

LORA_TORCH_OPS = "vllm.lora.ops.torch_ops.lora_ops"
# The gathering ops; the sgmv_* ones call these through the module's globals, so they are fixed too.
GATHERING_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


def skip_unadapted_tokens(op: Callable[..., Any]) -> Callable[..., Any]:
    """``op(inputs, weights, output, indices, ...)`` with the tokens whose index is -1 left without a
    LoRA delta (zero), as vLLM's GPU kernels leave them; other tokens' results are unchanged."""

    @functools.wraps(op)
    def fixed(inputs: Any, weights: Any, output: Any, indices: Any, *args: Any, **kwargs: Any) -> Any:
        unadapted = indices < 0
        if bool(unadapted.any()):
            inputs = inputs.masked_fill(unadapted.unsqueeze(-1), 0)
            indices = indices.clamp_min(0)
        return op(inputs, weights, output, indices, *args, **kwargs)

    fixed.__tessera_fixed__ = True  # type: ignore[attr-defined]
    return fixed


def fix_lora_torch_ops(module: ModuleType) -> None:
    """Wrap the gathering ops of ``module`` (vLLM's ``lora_ops``) once."""
    for name in GATHERING_OPS:
        op = getattr(module, name)
        if not getattr(op, "__tessera_fixed__", False):
            setattr(module, name, skip_unadapted_tokens(op))


class _FixAfterImport(importlib.abc.MetaPathFinder):
    """Finds ``LORA_TORCH_OPS`` as the normal finders do and fixes it right after it runs, before the
    package that re-exports its ops (``torch_ops/__init__``) binds their names."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != LORA_TORCH_OPS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def run_and_fix(module: ModuleType) -> None:
            run(module)
            fix_lora_torch_ops(module)

        spec.loader.exec_module = run_and_fix  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Apply the fixes in this process when vLLM imports the modules they fix; call it before vLLM is
    imported (the modules that import the ops bind them at their own import)."""
    if not any(isinstance(f, _FixAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _FixAfterImport())

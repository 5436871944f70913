"""Whether a model folder's KV cache for one full-length request fits the configured KV space.

vLLM finds out only after loading and compiling the model (minutes on a small CPU); the numbers are
in the folder's ``config.json``, so a start that cannot work is refused at once, with them.
"""

from __future__ import annotations

import json
from pathlib import Path

GIB = 1 << 30
# Bytes per element as vLLM serves it: ``auto`` downcasts float32 checkpoints to 16 bits.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "auto": 2}


class ModelFitError(ValueError):
    """The model does not fit the configured KV space; the message has the numbers and the fix."""


def kv_bytes_per_token(folder: Path, dtype: str) -> tuple[int, str]:
    """KV bytes one token takes in every layer, and how that number is made (for messages)."""
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelFitError(f"cannot read the model's shape from {path}: {exc}") from None
    elem = DTYPE_BYTES[dtype]
    how = f"{layers} layers x {kv_heads} KV heads x {head_dim} x 2 (K, V) x {elem} bytes ({dtype})"
    return 2 * layers * kv_heads * head_dim * elem, how


def check_kv_fits(name: str, folder: Path, dtype: str, max_model_len: int, kv_cache_gib: int) -> None:
    """ModelFitError when one request of ``max_model_len`` tokens needs more KV than ``kv_cache_gib``."""
    per_token, how = kv_bytes_per_token(folder, dtype)
    need = per_token * max_model_len
    space = kv_cache_gib * GIB
    if need > space:
        raise ModelFitError(
            f"model {name!r} needs {need / GIB:.2f} GiB of KV cache for one request of {max_model_len} "
            f"tokens ({per_token:,} bytes per token: {how}), more than the {kv_cache_gib} GiB configured "
            f"(room for {space // per_token:,} tokens): raise --kv-cache-gib to "
            f"{-(-need // GIB)} or lower --max-model-len to {space // per_token} or less"
        )

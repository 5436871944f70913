"""Step-time profile: how long one engine iteration takes on given hardware.

Used by the simulator to advance time and by policies that estimate service
(Andes' TGL(B), QLM's waiting-time estimator). Decode step time follows the
linear model of docs/papers.md, "Engine: step-time model":
``c0 + c1*B + c2*context_tokens``; prefill ``p0 + p1*tokens``.

A profile is measured at ``gpus`` GPUs (its tensor-parallel degree). ``at_tp(p)`` gives the same
model on ``p`` GPUs: the compute part is divided by ``(p/gpus)**tp_efficiency`` and each extra rank
adds ``tp_comm_s`` of communication to every iteration, so a larger TP cuts long prefills and can
slow short decodes (SeaLLM's c_tp; its Fig. 3).

``request_overhead_s`` is latency a request spends outside engine iterations on
the serving path (HTTP, validation, IPC to the engine, detokenising and
streaming back); measured profiles of a real server carry it, the roofline
tables leave it 0. The simulator charges it once per request, on entry.

Bringing a model back costs one of three times (``wake_time``): a cold start (``cold_start_s``: a new
server process, CUDA initialisation, weight load, CUDA-graph capture; 30 s, the low end of the
30-100+ s full reloads vLLM's sleep-mode blog post of 2025-10-26 reports), a wake from vLLM sleep
level 1 (weights kept in host memory: ``wake_l1_s``, by default the weights over the host link,
``weights_bytes / host_link_bytes_per_s``, 0.64 s for 16 GB over 25 GB/s; the same post measures
0.1-6 s from 0.6B to 235B models) or from sleep level 2 (weights dropped, the process kept:
``wake_l2_s``, by default the weights read again at ``WEIGHTS_READ_BYTES_PER_S``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# CHOICE: how fast a sleeping (level 2) server reads its weights back: one NVMe drive's sequential read,
# 2 GB/s (8 s for 16 GB; the page cache, when the file is still there, is faster).
WEIGHTS_READ_BYTES_PER_S = 2e9


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
    tp_efficiency: float = 0.85  # compute speed-up exponent of tensor parallelism (at_tp)
    tp_comm_s: float = 0.0015  # communication added to each iteration per extra rank (at_tp)
    wake_l1_s: float | None = None  # wake from sleep level 1; None: weights over the host link
    wake_l2_s: float | None = None  # wake from sleep level 2; None: weights at WEIGHTS_READ_BYTES_PER_S

    def at_tp(self, tp: int) -> StepProfile:
        """The same model on ``tp`` GPUs (this profile itself at its own degree). The KV capacity is
        left as is: it depends on the memory next to the model, which the caller knows."""
        if tp == self.gpus:
            return self
        if tp < 1:
            raise ValueError(f"profile {self.name}: tensor-parallel degree must be >= 1, got {tp}")
        speedup = (tp / self.gpus) ** self.tp_efficiency
        comm = self.tp_comm_s * max(0, tp - self.gpus)
        return replace(
            self,
            decode_c0=self.decode_c0 + comm,
            decode_c1=self.decode_c1 / speedup,
            decode_c2=self.decode_c2 / speedup,
            prefill_p0=self.prefill_p0 + comm,
            prefill_p1=self.prefill_p1 / speedup,
            gpus=tp,
        )

    def slowed(self, factor: float) -> StepProfile:
        """The same model with every prefill and decode step taking ``factor`` times as long (a share of
        the accelerator, or work added to each step)."""
        return replace(
            self,
            decode_c0=self.decode_c0 * factor,
            decode_c1=self.decode_c1 * factor,
            decode_c2=self.decode_c2 * factor,
            prefill_p0=self.prefill_p0 * factor,
            prefill_p1=self.prefill_p1 * factor,
        )

    def exec_time(self, prompt_tokens: int, output_tokens: int) -> float:
        """Isolated execution time of one request (batch 1, no queueing): its prefill plus
        ``output_tokens - 1`` decode steps, in closed form (the context grows one token a step)."""
        n = max(0, output_tokens - 1)
        context_sum = n * prompt_tokens + n * (n + 1) / 2
        decode = n * (self.decode_c0 + self.decode_c1) + self.decode_c2 * context_sum
        return self.prefill(prompt_tokens) + decode

    def service_time(
        self, context_tokens: int, output_tokens: float, batch: int, *, prefill: bool = True
    ) -> float:
        """Instance time that ``output_tokens`` more tokens of one request take in a full batch of
        ``batch``: the prefill of its ``context_tokens`` (prompt plus tokens generated so far) when it
        holds no KV (``prefill``; that iteration gives its first token), then its share of each decode
        iteration: the fixed cost split ``batch`` ways, the per-sequence cost and its own context, one
        token longer each step. A full batch's shares add up to its iteration's time, so these times
        add up to the instance's busy time (``exec_time`` is the isolated case: batch 1)."""
        steps = max(0, output_tokens - 1) if prefill else max(0, output_tokens)
        first = context_tokens + 1 if prefill else context_tokens  # context of the first decode step
        context_sum = steps * first + steps * (steps - 1) / 2
        decode = steps * (self.decode_c0 / max(1, batch) + self.decode_c1) + self.decode_c2 * context_sum
        return (self.prefill(context_tokens) if prefill else 0.0) + decode

    def decode_step(self, batch: int, context_tokens: int) -> float:
        """Time of one decode iteration for ``batch`` sequences holding ``context_tokens`` in total."""
        return self.decode_c0 + self.decode_c1 * batch + self.decode_c2 * context_tokens

    def prefill(self, tokens: int) -> float:
        """Time of a prefill iteration over ``tokens`` prompt tokens."""
        return self.prefill_p0 + self.prefill_p1 * tokens

    def kv_swap_time(self, tokens: int) -> float:
        """Time to move ``tokens`` of KV cache over the host link (one direction)."""
        return tokens * self.kv_bytes_per_token / self.host_link_bytes_per_s

    def wake_time(self, level: int) -> float:
        """Seconds until a model is back: ``level`` 1 or 2 is a wake from that vLLM sleep level, 0 a cold
        start (module docstring)."""
        if level == 0:
            return self.cold_start_s
        if level == 1:
            return self.model_load_time() if self.wake_l1_s is None else self.wake_l1_s
        if level == 2:
            return self.weights_bytes / WEIGHTS_READ_BYTES_PER_S if self.wake_l2_s is None else self.wake_l2_s
        raise ValueError(f"profile {self.name}: wake level must be 0 (cold), 1 or 2, got {level}")

    def model_load_time(self) -> float:
        """Time to load the model's weights over the host link (model swap)."""
        return self.weights_bytes / self.host_link_bytes_per_s

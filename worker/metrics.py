"""Prometheus metrics of one worker (``tessera_`` prefix; labels ``model`` and ``class``).

Every worker owns its own registry, so several workers can live in one process (tests).
Per-engine quantities (batch size, swaps, decision time) carry only ``model``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)
_QOE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
_DECISION_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1)
_ERROR_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)

MC = ("model", "class")


class WorkerMetrics:
    """The worker's metric families in their own registry."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.queue_length = Gauge(
            "tessera_queue_length", "Requests waiting (queued or preempted).", MC, registry=r
        )
        self.inflight = Gauge("tessera_inflight", "Requests running in the engine.", MC, registry=r)
        self.batch_size = Gauge(
            "tessera_batch_size", "Most requests in flight (batch size).", ["model"], registry=r
        )
        self.ttft = Histogram(
            "tessera_ttft_seconds", "Time to first token.", MC, buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_wait = Histogram(
            "tessera_queue_wait_seconds",
            "Arrival at the scheduler to the first submission to the engine.",
            MC,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.engine_ttft = Histogram(
            "tessera_engine_ttft_seconds",
            "First submission to the engine to its first token (the engine TTFT the worker sees).",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tessera_itl_seconds", "Inter-token latency.", MC, buckets=_ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "tessera_e2e_seconds", "Arrival to last token.", MC, buckets=_LATENCY_BUCKETS, registry=r
        )
        # Counted at the finish, with e2e: per finished request, so over e2e's count it is a mean prompt.
        self.prompt_tokens = Counter(
            "tessera_prompt_tokens", "Prompt tokens of finished requests.", MC, registry=r
        )
        # Judged by tessera.core.slo.slo_met: requests of a class without an SLO count in neither.
        self.slo_met = Counter(
            "tessera_slo_met", "Finished requests that met their class's SLO.", MC, registry=r
        )
        self.slo_missed = Counter(
            "tessera_slo_missed", "Finished requests that missed their class's SLO.", MC, registry=r
        )
        self.qoe = Histogram(
            "tessera_qoe", "Andes QoE of finished requests.", MC, buckets=_QOE_BUCKETS, registry=r
        )
        self.preemptions = Counter(
            "tessera_preemptions", "Requests preempted by the scheduler.", MC, registry=r
        )
        self.evictions = Counter(
            "tessera_evictions", "Requests evicted (moved off this engine).", MC, registry=r
        )
        self.swaps = Counter("tessera_swaps", "Model swaps (sleep / wake-up).", ["model"], registry=r)
        self.rejected = Counter(
            "tessera_rejected", "Requests refused at admission.", [*MC, "reason"], registry=r
        )
        self.failed = Counter("tessera_failed", "Accepted requests that ended with an error.", MC, registry=r)
        self.predictor_error = Histogram(
            "tessera_predictor_error_tokens",
            "Absolute error of the first output-length prediction, in tokens.",
            MC,
            buckets=_ERROR_BUCKETS,
            registry=r,
        )
        self.decision_failures = Counter(
            "tessera_decision_failures",
            "Policy decisions that raised; the worker served in arrival order instead.",
            ["model"],
            registry=r,
        )
        self.engine_kv_capacity = Gauge(
            "tessera_engine_kv_capacity_tokens",
            "KV cache capacity the policies see, in tokens (the engine's, or the configured one).",
            ["model"],
            registry=r,
        )
        self.engine_kv_used = Gauge(
            "tessera_engine_kv_used_tokens", "KV cache in use as the engine last reported, tokens.",
            ["model"], registry=r,
        )  # fmt: skip
        self.engine_running = Gauge(
            "tessera_engine_running", "Requests the engine last reported running.", ["model"], registry=r
        )
        self.engine_waiting = Gauge(
            "tessera_engine_waiting",
            "Requests the engine last reported holding in its own queue.",
            ["model"],
            registry=r,
        )
        self.engine_start_time = Gauge(
            "tessera_engine_start_time_seconds",
            "Unix time the engine last started, its caches empty (the engine's own process start where it "
            "reports one, else when this worker started it): a change means the engine restarted.",
            ["model"],
            registry=r,
        )
        self.engine_stats_fallback = Gauge(
            "tessera_engine_stats_fallback",
            "1 when the engine reports no KV cache figures and the configured kvCapacityTokens is used.",
            ["model"],
            registry=r,
        )
        self.config_reloads = Counter(
            "tessera_config_reloads",
            "Configuration reloads by result: applied, invalid (refused), restart_required (refused).",
            ["result"],
            registry=r,
        )
        self.policy_faults = Counter(
            "tessera_policy_faults",
            "Decisions that named a request or a model this pod does not hold (logged; nothing changed).",
            ["model"],
            registry=r,
        )
        self.adapter_loads = Counter(
            "tessera_lora_adapter_loads",
            "LoRA adapters loaded into their base's engine on demand (the adapter's swap), by adapter.",
            ["model"],
            registry=r,
        )
        self.engine_busy = Counter(
            "tessera_engine_busy_seconds",
            "Seconds the model's engine had requests in flight (its share of the pod's engine time).",
            ["model"],
            registry=r,
        )
        self.decision_time = Histogram(
            "tessera_decision_seconds",
            "Time of one scheduling decision of the pod's policy (the label: the pod's models joined "
            "by '+').",
            ["model"],
            buckets=_DECISION_BUCKETS,
            registry=r,
        )

        self.lora_resident = Gauge(
            "tessera_lora_adapter_resident",
            "1 while the LoRA adapter (model) is loaded in its base's engine (base), 0 once unloaded or "
            "when its load failed: a router prefers the instance that holds it.",
            ["model", "base"],
            registry=r,
        )
        self.lora_requests = Gauge(
            "tessera_lora_adapter_requests",
            "Requests of the LoRA adapter (model) of a base's engine (base) running in its batch or "
            "waiting (state): an adapter running holds one of the engine's GPU slots (vLLM's "
            "lora_requests_info); the adapter-affinity route reads them.",
            ["model", "base", "state"],
            registry=r,
        )
        self.lora_slots = Gauge(
            "tessera_lora_slots",
            "Adapters one batch of the base model's engine may mix (vLLM's --max-loras, as the engine "
            "reports it).",
            ["model"],
            registry=r,
        )
        self.lora_load = Histogram(
            "tessera_lora_load_seconds",
            "Time to load a LoRA adapter into its base's engine (/v1/load_lora_adapter).",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def exposition(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)

"""The worker: configuration -> engines and the pod's scheduler, classes, hot reload, readiness.

Several models per pod, each with its own engine (one vLLM server each), all scheduled by one
``InstanceScheduler`` under one policy (``tessera.worker.scheduler``). Model swapping
(``tessera.worker.swap.ModelSwapper``): where the platform supports vLLM's sleep mode
(CUDA/ROCm, server started with ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``) the
sleep-capable models share the accelerator one at a time and a policy's ``Decision.load_model``
swaps them through the engines' ``sleep``/``wake_up``; vLLM 0.32 on CPU has no sleep mode, so there
(the documented fallback) every model stays resident and no swap happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from tessera.api.worker_config import ConfigError, ModelEntry, WorkerConfig, load_config
from tessera.core.profile import StepProfile
from tessera.core.request import ServiceClass
from tessera.worker.engines.base import Engine, EngineError
from tessera.worker.metrics import WorkerMetrics
from tessera.worker.scheduler import InstanceScheduler
from tessera.worker.swap import ModelSwapper
from tessera.worker.tool_calls import ToolCallParser

if TYPE_CHECKING:
    from tessera.worker.engines.vllm import VLLMEngine

log = logging.getLogger(__name__)


class RestartRequired(ConfigError):
    """The new configuration changes what only a restart applies (the model list)."""


def _class_limits(config: WorkerConfig) -> dict[str, dict[str, int | None]]:
    """Model -> class -> its queue bound."""
    return {
        m.name: {name: config.class_spec(m, name).queue.max_queued for name in config.classes}
        for m in config.models
    }


def _class_queue_times(config: WorkerConfig) -> dict[str, dict[str, float | None]]:
    """Model -> class -> its maximum queue time."""
    return {
        m.name: {name: config.class_spec(m, name).queue.max_queue_time_seconds for name in config.classes}
        for m in config.models
    }


def _profiles(config: WorkerConfig) -> dict[str, StepProfile]:
    return {m.name: m.profile.to_profile(m.name, m.kv_capacity_tokens) for m in config.models}


class Worker:
    """Everything the HTTP layer drives: the models' engines and the pod's one scheduler."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        config_path: Path | None = None,
        engines: dict[str, Engine] | None = None,
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.metrics = WorkerMetrics()
        self.engines: dict[str, Engine] = dict(engines or {})
        self._scheduler: InstanceScheduler | None = None
        self.classes = self._service_classes(config)
        self.draining = False
        self.swapper: ModelSwapper | None = None
        self.tool_parsers: dict[str, ToolCallParser] = {}  # model -> its toolParser, built at start
        self._servers: list[object] = []  # vLLM servers this worker launched itself
        self._max_num_seqs: dict[str, int] = {}  # model -> --max-num-seqs of the vLLM launched here
        self._watch_task: asyncio.Task[None] | None = None
        self._slots_task: asyncio.Task[None] | None = None
        self._file_digest: bytes | None = None  # of the configuration file content last seen

    @staticmethod
    def _service_classes(config: WorkerConfig) -> dict[str, dict[str, ServiceClass]]:
        """Model -> class name -> runtime class (a model's ``classSpecs`` replace the pod's)."""
        return {
            m.name: {name: config.class_spec(m, name).to_service_class(name) for name in config.classes}
            for m in config.models
        }

    async def start(self) -> None:
        """Create engines (launching vLLM where asked), put all but one swappable model to sleep,
        then start the scheduler."""
        # Bases first: an adapter without url runs in the server its base launched.
        for entry in sorted(self.config.models, key=lambda m: m.adapter_of is not None):
            if entry.name not in self.engines:
                self.engines[entry.name] = await self._make_engine(entry)
            await self.engines[entry.name].start()
        # Each base's engine holds its first maxCpuLoras adapters from the start (what the scheduler's
        # adapter cache starts with); the others load on demand.
        room = {m.name: m.adapter_cache_size for m in self.config.models if m.max_loras}
        for entry in self.config.models:
            if entry.tool_parser is not None:
                await self._load_tool_parser(entry)
            if entry.adapter_of is not None and room.get(entry.adapter_of, 0) > 0:
                room[entry.adapter_of] -= 1
                if entry.engine == "vllm":
                    await self._load_at_start(entry.name)
        for entry in self.config.models:  # what the server starts with, until it reports its own
            if entry.max_loras:
                self.metrics.lora_slots.labels(entry.name).set(entry.max_loras)
        self._slots_task = asyncio.create_task(self._watch_lora_slots(), name="lora-slots")
        self.swapper = ModelSwapper(self.engines, self.metrics)
        await self.swapper.start()
        self._scheduler = InstanceScheduler(
            {entry.name: self.engines[entry.name] for entry in self.config.models},
            self.config.make_policy(),
            profiles=_profiles(self.config),
            batch=self.config.scheduling.batch,
            autoscale=self.config.scheduling.autoscale,
            max_queued=self.config.scheduling.max_queued,
            class_limits=_class_limits(self.config),
            class_queue_times=_class_queue_times(self.config),
            max_running=self._max_num_seqs,
            metrics=self.metrics,
            swapper=self.swapper,
            stats_interval_s=self.config.polling.engine_stats_seconds,
            adapter_of=self.config.adapter_of,
            max_loras={m.name: m.max_loras for m in self.config.models if m.max_loras},
            adapter_cache={m.name: m.adapter_cache_size for m in self.config.models if m.max_loras},
            adapter_loader=self.swap_adapter,
            unload_after={
                m.name: m.unload_after_seconds for m in self.config.models if m.unload_after_seconds
            },
        )
        log.info("serving %s in %s mode under policy %s", ", ".join(self.scheduler.models),
                 self.scheduler.mode, self.config.scheduling.policy)  # fmt: skip
        await self.scheduler.start()
        if self.config_path is not None:
            self._file_digest = _digest(self.config_path)
            self._watch_task = asyncio.create_task(self._watch_file(), name="config-watch")

    @property
    def scheduler(self) -> InstanceScheduler:
        """The pod's scheduler (from ``start`` on)."""
        if self._scheduler is None:
            raise RuntimeError("the worker has not started")
        return self._scheduler

    def _adapter(self, name: str) -> tuple[ModelEntry, VLLMEngine] | None:
        """The entry and the vLLM engine of the adapter ``name``; None for an engine the caller gave
        (tests) or an adapter without a source. ValueError when ``name`` is no adapter of the pod."""
        from tessera.worker.engines.vllm import VLLMEngine

        entry = next((m for m in self.config.models if m.name == name and m.adapter_of is not None), None)
        if entry is None:
            raise ValueError(f"{name!r} is not a LoRA adapter of this pod")
        engine = self.engines[entry.name]
        if not isinstance(engine, VLLMEngine) or entry.adapter_source is None:
            return None
        return entry, engine

    async def swap_adapter(self, name: str, load: bool) -> None:
        """Load (``load``) or unload the LoRA adapter ``name`` in its base's vLLM server: the pod
        scheduler's adapter swap (``AdapterLoader``). A load's time is logged and observed in
        ``tessera_lora_load_seconds``; ``tessera_lora_adapter_resident`` says whether the engine holds it.
        EngineError when the server refuses (a failed load leaves it not resident)."""
        found = self._adapter(name)
        if found is None:
            return
        entry, engine = found
        resident = self.metrics.lora_resident.labels(entry.name, entry.adapter_of)
        if not load:
            await engine.unload_lora_adapter()
            resident.set(0)
            log.info("unloaded the LoRA adapter %s of %s", entry.name, entry.adapter_of)
            return
        started = time.monotonic()
        try:
            await engine.load_lora_adapter(str(entry.adapter_source))
        except EngineError:
            resident.set(0)
            raise
        seconds = time.monotonic() - started
        resident.set(1)
        self.metrics.lora_load.labels(entry.name).observe(seconds)
        log.info("loaded the LoRA adapter %s of %s from %s in %.3f s", entry.name, entry.adapter_of,
                 entry.adapter_source, seconds)  # fmt: skip

    async def _load_at_start(self, name: str) -> None:
        """Load an adapter as the pod starts. A failure is logged and leaves the adapter's requests
        answered with the engine's error; the base and the pod's other models keep serving."""
        try:
            await self.swap_adapter(name, True)
        except EngineError as exc:
            log.error("could not load the LoRA adapter %s: %s; its requests fail until it loads", name, exc)

    async def _watch_lora_slots(self) -> None:
        """Publish each base's adapter slots as its vLLM server reports them (``tessera_lora_slots``).
        vLLM's /metrics shows its --max-loras only once it has run a step, so the bases are asked
        every stats interval until each has answered (a server's slots are fixed for its life)."""
        from tessera.worker.engines.vllm import VLLMEngine

        waiting = {m.adapter_of for m in self.config.models if m.adapter_of is not None}
        waiting = {b for b in waiting if isinstance(self.engines.get(str(b)), VLLMEngine)}
        while waiting:
            for base in sorted(str(b) for b in waiting):
                engine = self.engines[base]
                assert isinstance(engine, VLLMEngine)
                slots = await engine.lora_slots()
                if slots is not None:
                    self.metrics.lora_slots.labels(base).set(slots)
                    waiting.discard(base)
            await asyncio.sleep(self.config.polling.engine_stats_seconds or 1.0)

    async def _load_tool_parser(self, entry: ModelEntry) -> None:
        """vLLM's tool parser of the model (``toolParser``) over its tokenizer; ConfigError naming the
        field when it cannot be built."""
        assert entry.tool_parser is not None
        try:
            tokenizer = await self.engines[entry.name].parser_tokenizer()
        except EngineError as exc:
            raise ConfigError(f"model {entry.name!r}: toolParser {entry.tool_parser!r}: {exc}") from None
        self.tool_parsers[entry.name] = await asyncio.to_thread(
            ToolCallParser, entry.tool_parser, entry.name, tokenizer
        )

    async def _make_engine(self, entry: ModelEntry) -> Engine:
        if entry.engine == "sim":
            from tessera.worker.engines.sim_realtime import SimEngine

            return SimEngine(
                entry.name,
                entry.profile.to_profile(entry.name, entry.kv_capacity_tokens),
                entry.max_model_len,
                supports_sleep=entry.sleep_mode == "on",
            )
        from tessera.worker.engines.vllm import VLLMEngine

        url = entry.url
        tokenizer = entry.tokenizer_dir()
        base = self.engines.get(entry.adapter_of) if entry.adapter_of is not None else None
        if url is None and isinstance(base, VLLMEngine):  # an adapter in the server its base launched
            url, tokenizer = base.url, tokenizer or base.tokenizer_path
        if entry.launch is not None:
            from tessera.worker.engines.vllm_process import VLLMServer

            seqs = self._max_num_seqs[entry.name] = (
                entry.launch.max_num_seqs or self.config.scheduling.batch.max
            )
            server = VLLMServer(
                entry.launch.model_dir,
                served_model_name=entry.name,
                max_model_len=entry.max_model_len,
                max_num_seqs=seqs,
                kv_cache_gib=entry.launch.kv_cache_gib,
                dtype=entry.launch.dtype,
                extra_args=["--enforce-eager"] * entry.launch.enforce_eager + entry.launch.extra_args,
                env=dict(entry.launch.env),
                kv_events_port=entry.launch.kv_events_port,
                enable_sleep_mode=entry.sleep_mode == "on",
                dev_mode=entry.sleep_mode == "on",
                # a CPU build on a loaded 2-core machine was seen taking over 5 minutes to start
                start_timeout_s=900.0,
            )
            self._servers.append(server)
            await asyncio.to_thread(server.start)
            url = server.url
        assert url is not None  # the configuration guarantees url or launch
        return VLLMEngine(
            entry.name, url, entry.max_model_len, sleep_mode=entry.sleep_mode, tokenizer=tokenizer
        )

    async def stop(self) -> None:
        """Stop the scheduler and the engines, and any vLLM server launched here."""
        for task in (self._watch_task, self._slots_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._scheduler is not None:
            await self._scheduler.stop()
        for engine in self.engines.values():
            with contextlib.suppress(Exception):
                await engine.close()
        for server in self._servers:
            await asyncio.to_thread(server.stop)  # type: ignore[attr-defined]

    def policy_needs_true_length(self) -> bool:
        """Whether the policy is an oracle (reads ``Request.true_output_tokens``: benchmarks only)."""
        return self._scheduler is not None and self._scheduler.policy.oracle

    def ready(self) -> bool:
        """Ready for traffic: not draining, every engine healthy and the policy not failing repeatedly."""
        sched = self._scheduler
        return not self.draining and sched is not None and sched.engine_ok and sched.policy_ok

    def resolve_class(self, model: ModelEntry, headers: Mapping[str, str]) -> ServiceClass:
        """The class the request's class headers select (each class's own ``match.header``), else the
        model's default class; ClassHeaderError for an unknown value or two headers naming different
        classes."""
        name = self.config.class_from_headers(headers)
        return self.classes[model.name][name if name is not None else self.config.default_class(model)]

    def reload(self, new: WorkerConfig | None = None) -> WorkerConfig:
        """Apply a new configuration (default: re-read the file) without a restart; the outcome is
        counted in ``tessera_config_reloads_total``.

        Policy, settings, classes, queue and batch bounds, profiles and polling change in place;
        requests in flight keep running and move to the new policy. The model list may not change
        (RestartRequired); anything invalid is refused (ConfigError) and the old configuration stays.
        """
        try:
            applied = self._reload(new)
        except RestartRequired:
            self.metrics.config_reloads.labels("restart_required").inc()
            raise
        except ConfigError:
            self.metrics.config_reloads.labels("invalid").inc()
            raise
        self.metrics.config_reloads.labels("applied").inc()
        return applied

    def _reload(self, new: WorkerConfig | None) -> WorkerConfig:
        if new is None:
            if self.config_path is None:
                raise ConfigError(
                    "this worker was started without a configuration file; send one in the body"
                )
            new = load_config(self.config_path)

        def fixed(config: WorkerConfig) -> list[tuple]:
            return [(m.name, m.engine, m.url, m.launch, m.sleep_mode, m.tokenizer, m.max_model_len,
                     m.tool_parser) for m in config.models]  # fmt: skip

        if fixed(self.config) != fixed(new):
            raise RestartRequired(
                "the model list (names, engines, URLs, launch settings, sleep mode, tokenizers, context "
                "lengths, tool parsers) cannot change without a restart; restart the worker pod"
            )
        batch_max = new.scheduling.batch.max
        for model, seqs in self._max_num_seqs.items():
            if batch_max > seqs:
                raise RestartRequired(
                    f"scheduling.batch.max {batch_max} exceeds the --max-num-seqs {seqs} that the vLLM "
                    f"of model {model} was started with; restart the worker pod to raise it"
                )
        try:
            policy = new.make_policy()  # fail before changing anything
        except ValueError as exc:
            raise ConfigError(f"scheduling: {exc}") from None
        self.config = new
        self.classes = self._service_classes(new)
        if self._scheduler is not None:
            self._scheduler.reconfigure(
                policy,
                batch=new.scheduling.batch,
                autoscale=new.scheduling.autoscale,
                max_queued=new.scheduling.max_queued,
                class_limits=_class_limits(new),
                class_queue_times=_class_queue_times(new),
                profiles=_profiles(new),
                stats_interval_s=new.polling.engine_stats_seconds,
            )
        return new

    async def _watch_file(self) -> None:
        """Apply the configuration file when its content changes. Kubernetes updates a mounted
        ConfigMap by swapping a symlink, which need not change the file's mtime: the content's digest
        is compared. A refused content is logged once and not retried until the file changes again."""
        assert self.config_path is not None
        path = self.config_path
        while (interval := self.config.polling.config_file_seconds) > 0:
            await asyncio.sleep(interval)
            try:
                digest = await asyncio.to_thread(_digest, path)
            except OSError as exc:
                log.warning("cannot read the configuration file %s: %s; keeping the running one", path, exc)
                continue
            if digest == self._file_digest:
                continue
            self._file_digest = digest
            try:
                self.reload()
            except RestartRequired as exc:
                log.error("the configuration file %s changed what needs a restart; the worker keeps its "
                          "configuration until the pod restarts: %s", path, exc)  # fmt: skip
            except ConfigError as exc:
                log.error("refused the new content of the configuration file %s; the worker keeps its "
                          "configuration: %s", path, exc)  # fmt: skip
            else:
                log.warning("applied the new configuration file %s (policy %s)", path,
                            self.config.scheduling.policy)  # fmt: skip
        log.info("polling.configFileSeconds is 0: the worker stops watching %s", path)


def _digest(path: Path) -> bytes:
    """SHA-256 of the file's content (through any symlinks)."""
    return hashlib.sha256(path.read_bytes()).digest()

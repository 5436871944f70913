"""LoRA adapters inside one engine: the rules vLLM applies to them, shared by the pod's scheduler and
the simulator so that both hold the same adapters and admit the same batches.

An adapter is a model of its base's instance (an LLMService with ``spec.model.adapter``) and runs in
the base's engine; requests name the adapter as their ``model``. vLLM bounds two things:

- **GPU slots** (``--max-loras``): one batch mixes requests of at most that many distinct adapters
  (``admits``). Requests of the base model itself take no slot.
- **Resident adapters** (``--max-cpu-loras``): adapters whose weights the engine holds in memory. One
  that is not resident is read from its source first (``AdapterCache.use`` says so, and which resident
  adapter made room): that load is the adapter's swap, measured, far cheaper than a model's.

Pure: no clock and no I/O; the shells say when an adapter was used or loaded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from tessera.core.profile import StepProfile
from tessera.core.request import Request


def batch_adapters(requests: Iterable[Request], adapter_of: Mapping[str, str]) -> frozenset[str]:
    """The distinct adapters among ``requests`` (``adapter_of``: adapter -> its base; a request whose
    model is not there is a base model's and takes no slot)."""
    return frozenset(r.model for r in requests if r.model in adapter_of)


def admits(in_batch: Collection[str], model: str, adapter_of: Mapping[str, str], max_loras: int) -> bool:
    """Whether a request of ``model`` may join a batch that holds the adapters ``in_batch``: a base
    model's always; an adapter's when it is in the batch already or a GPU slot of its base's engine is
    free (each engine has ``max_loras`` slots; adapters of another base hold none of them)."""
    if model not in adapter_of or model in in_batch:
        return True
    base = adapter_of[model]
    return sum(1 for a in in_batch if adapter_of.get(a) == base) < max_loras


def engine_batch(
    run: Sequence[Request], running: Collection[Request], adapter_of: Mapping[str, str], max_loras: int
) -> tuple[list[Request], list[Request]]:
    """The engine's side of a decision's ``run``: (the requests it runs, those it leaves waiting).
    Requests ``running`` already keep their slots; a new one joins while ``admits`` allows, in the
    decision's order, and one that finds no GPU slot waits while the others go on (vLLM's scheduler
    skips such a request and keeps scheduling). ``max_loras`` 0: no LoRA, everything runs."""
    if max_loras <= 0 or not adapter_of:
        return list(run), []
    kept = [r for r in run if r in running]
    in_batch = set(batch_adapters(kept, adapter_of))
    out: list[Request] = []
    deferred: list[Request] = []
    for req in run:
        if req in running:
            out.append(req)
        elif admits(in_batch, req.model, adapter_of, max_loras):
            out.append(req)
            if req.model in adapter_of:
                in_batch.add(req.model)
        else:
            deferred.append(req)
    return out, deferred


class AdapterCache:
    """The adapters an engine holds in memory, least recently used first (vLLM's ``--max-cpu-loras``
    LRU). ``capacity`` is at least one."""

    def __init__(self, capacity: int, resident: Iterable[str] = ()) -> None:
        if capacity < 1:
            raise ValueError(f"an adapter cache holds at least one adapter, not {capacity}")
        self.capacity = capacity
        self._lru: OrderedDict[str, None] = OrderedDict()
        for name in resident:
            self.use(name)

    @property
    def resident(self) -> frozenset[str]:
        """The adapters held now."""
        return frozenset(self._lru)

    def __contains__(self, adapter: object) -> bool:
        return adapter in self._lru

    def use(self, adapter: str, busy: Collection[str] = ()) -> tuple[bool, str | None]:
        """Mark ``adapter`` used now: (whether it had to be loaded, the adapter evicted to make room or
        None). Adapters in ``busy`` (in the running batch) are never evicted; when every resident one is
        busy the cache grows past its capacity for the moment, as vLLM keeps an adapter a running
        request uses."""
        if adapter in self._lru:
            self._lru.move_to_end(adapter)
            return False, None
        evicted = None
        if len(self._lru) >= self.capacity:
            evicted = next((a for a in self._lru if a not in busy), None)
            if evicted is not None:
                del self._lru[evicted]
        self._lru[adapter] = None
        return True, evicted

    def drop(self, adapter: str) -> bool:
        """Forget ``adapter`` (unloaded: scale to zero of the adapter, or a failed load); whether it was
        held."""
        if adapter not in self._lru:
            return False
        del self._lru[adapter]
        return True


# Loading an adapter the engine does not hold, in seconds (CHOICE for a GPU: a rank-16 adapter of an 8B
# model is about 40 MB of safetensors, read from a local disk or the page cache and copied to the
# device; the adapter-affinity scorer prices a load at the same value by default). Measured on CPU vLLM
# (`tessera bench real-lora`): 64-100 ms median for SmolLM2's rank-8 adapter, the same order.
ADAPTER_LOAD_S = 0.1
# Extra time of an engine step whose batch holds adapter requests, as a fraction of the base's step
# (ASSUMED until measured: a rank-16 adapter adds under 1% of an 8B model's FLOPs, but the batched
# multi-adapter kernels cost more than their FLOPs; S-LoRA and Punica report per-token slowdowns of this
# order against the base model alone). CPU vLLM runs LoRA through plain torch versions of those kernels
# and measured 1.41-1.58x the base's throughput cost for SmolLM2, and no extra cost for mixing two
# adapters (`tessera bench real-lora`): a figure for CPU pods, not for a GPU's kernels.
LORA_STEP_OVERHEAD = 0.2


@dataclass(frozen=True, slots=True)
class LoraCost:
    """What adapters cost an engine: ``load_s`` seconds to load one it does not hold (its
    ``AdapterCache`` misses; vLLM loads synchronously, so the engine's next step waits), and
    ``step_overhead``, the fraction a step whose batch holds adapter requests takes beyond the base's
    step. ``source`` says where the numbers come from."""

    load_s: float = ADAPTER_LOAD_S
    step_overhead: float = LORA_STEP_OVERHEAD
    source: str = (
        "CHOICE: 0.1 s per load (64-100 ms measured on CPU vLLM) and an ASSUMED 20% GPU step overhead"
    )

    def __post_init__(self) -> None:
        if not 0 <= self.load_s <= 60:
            raise ValueError(f"an adapter load takes 0 to 60 seconds, not {self.load_s}")
        if not 0 <= self.step_overhead <= 10:
            raise ValueError(f"the LoRA step overhead is a fraction from 0 to 10, not {self.step_overhead}")

    def step_factor(self, adapters_in_batch: bool) -> float:
        """The factor on a base step's time: ``1 + step_overhead`` when the batch holds adapter
        requests, else 1."""
        return 1.0 + self.step_overhead if adapters_in_batch else 1.0


def adapter_sets(
    running: Iterable[Request], waiting: Iterable[Request], adapter_of: Mapping[str, str]
) -> tuple[frozenset[str], frozenset[str]]:
    """(the adapters of an engine's ``running`` requests: those holding its GPU slots, the adapters of
    its ``waiting`` ones): what vLLM reports as its running and waiting adapters, and what routing
    reads (``InstanceLoad.resident_adapters`` and ``waiting_adapters``)."""
    return batch_adapters(running, adapter_of), batch_adapters(waiting, adapter_of)


def charged_profile(profile: StepProfile, cost: LoraCost) -> StepProfile:
    """``profile`` with every step of a batch holding adapter requests charged (``cost.step_factor``):
    what the estimators price a base's engine at when its adapters have load. CHOICE: every step pays,
    as the engine's nearly always holds one of their requests once they carry a real share of its load
    (a batch of ``B`` holds none with probability ``(1 - share) ** B``)."""
    k = cost.step_factor(True)
    return profile if k == 1.0 else profile.slowed(k)

"""Prefix-cache block hashes and where they are cached, for cache-aware routing.

An engine with prefix caching (vLLM's automatic prefix caching) keeps the KV cache of full blocks of
``block_size`` tokens, each identified by a hash chained over every block before it: a request
reuses the longest run of leading blocks whose hashes the instance still holds, and computes only
the rest of its prompt.

- ``token_block_hashes`` computes vLLM's own chain (its ``hash_block_tokens`` with the default
  ``sha256`` algorithm: SHA-256 over the pickled ``(parent hash, block token ids, extra keys)``, the
  first parent being the hash of the seed ``PYTHONHASHSEED`` or ``"vllm-none-hash"``), so the
  hashes match the KV events a vLLM server publishes for the same tokens.
- ``text_block_hashes`` chains fixed-size blocks of prompt characters, for a router that does not
  tokenize (an approximate prefix index, as llm-d's approximate prefix scorer keeps).
- ``PrefixIndex`` remembers which instance holds which blocks, with least-recently-used eviction per
  instance at its capacity (an estimate of the engine's own eviction).
- ``EngineBlockIndex`` holds what each instance's engine itself reports holding: vLLM's KV events
  (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) applied in order, for precise prefix
  affinity. A restarted engine (its publisher numbers batches from 0 again) or lost events (a gap in
  the numbers) drop what the instance was believed to hold; so does ``forget``, which the router
  calls when the engine's start time changed (a restart whose first batches never arrived).

Pure: time is passed in.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from collections import Counter, OrderedDict
from collections.abc import Container, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

VLLM_DEFAULT_SEED = "vllm-none-hash"  # vLLM's seed of the first parent hash without PYTHONHASHSEED
DEFAULT_TEXT_BLOCK_CHARS = 64  # characters per block of the approximate (text) index


def _sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def first_parent_hash(seed: str = VLLM_DEFAULT_SEED) -> bytes:
    """The parent hash of a chain's first block (vLLM's ``NONE_HASH``)."""
    return _sha256(seed)


def block_hash(parent: bytes, block_token_ids: Sequence[int], extra_keys: Any = None) -> bytes:
    """vLLM's hash of one full block after the block whose hash is ``parent``."""
    return _sha256((parent, tuple(block_token_ids), extra_keys))


def token_block_hashes(
    token_ids: Sequence[int], block_size: int, *, seed: str = VLLM_DEFAULT_SEED, extra_keys: Any = None
) -> list[bytes]:
    """vLLM's block hashes of the full ``block_size``-token blocks of ``token_ids`` (a partial last
    block is not cached, so it has none). ``seed``: the server's ``PYTHONHASHSEED`` when it sets one."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    parent = first_parent_hash(seed)
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes


def text_block_hashes(text: str, block_chars: int = DEFAULT_TEXT_BLOCK_CHARS) -> list[bytes]:
    """Chained hashes of the full ``block_chars``-character blocks of ``text``."""
    if block_chars < 1:
        raise ValueError(f"block_chars must be >= 1, got {block_chars}")
    parent = b""
    hashes: list[bytes] = []
    for start in range(0, len(text) - block_chars + 1, block_chars):
        parent = hashlib.sha256(parent + text[start : start + block_chars].encode("utf-8")).digest()
        hashes.append(parent)
    return hashes


def leading_run(hashes: Iterable[Hashable], held: Container[Hashable]) -> int:
    """How many of ``hashes``' leading blocks ``held`` holds: a prefix cache serves only an unbroken
    run from the first block."""
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


class PrefixIndex:
    """Which instance holds which blocks (hashes, or a trace's block ids): the longest cached run of a
    request's leading blocks per instance, with each instance's blocks evicted least recently used
    beyond its capacity."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: dict[str, OrderedDict[Hashable, float]] = {}  # instance -> block -> last use

    def matched(self, hashes: Sequence[Hashable], instances: Iterable[str]) -> dict[str, int]:
        """Per instance, how many of ``hashes``' leading blocks it holds (0 when none)."""
        return {name: leading_run(hashes, self._blocks.get(name) or ()) for name in instances}

    def record(self, instance: str, hashes: Sequence[Hashable], now: float) -> None:
        """``instance`` now holds ``hashes`` (the request was sent there), most recently used."""
        held = self._blocks.setdefault(instance, OrderedDict())
        for h in hashes:
            held[h] = now
            held.move_to_end(h)
        while len(held) > self.capacity_blocks:
            held.popitem(last=False)

    def forget(self, instance: str) -> None:
        """Drop everything recorded for ``instance`` (it restarted: its cache is empty)."""
        self._blocks.pop(instance, None)

    def blocks(self, instance: str) -> int:
        """How many blocks ``instance`` is believed to hold."""
        return len(self._blocks.get(instance, ()))


# ---- what the engine reports holding (vLLM's KV events) ---------------------------------------------

KV_EVENTS_TOPIC = "kv-events"  # the topic Tessera launches vLLM's KV-event publisher with and subscribes to


def kv_events_config(port: int) -> str:
    """vLLM's ``--kv-events-config`` value: a ZMQ publisher on ``port`` of every interface, topic
    ``KV_EVENTS_TOPIC`` (local mode's launched servers and the operator's pods both start it so).
    "*": vLLM binds an endpoint with a wildcard host and connects to any other."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": KV_EVENTS_TOPIC,
              "endpoint": f"tcp://*:{port}"}  # fmt: skip
    return json.dumps(config)


ENGINE_MEDIA = (None, "GPU")  # vLLM's own KV pool publishes "GPU" (on CPU builds too); offload tiers others


@dataclass(frozen=True, slots=True)
class BlockStored:
    """The engine cached full blocks (vLLM's ``BlockStored``): their hashes in chain order, the hash of
    the block before the first (None: the first is a prompt's first block), their token ids in order."""

    block_hashes: tuple[Hashable, ...]
    parent_block_hash: Hashable | None
    token_ids: tuple[int, ...]
    block_size: int
    extra_keys: tuple[Any, ...] | None = None  # per block: LoRA, multimodal, cache salt keys (None: none)
    medium: str | None = None
    group_idx: int | None = None  # KV cache group (hybrid models have several)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The engine evicted blocks (vLLM's ``BlockRemoved``)."""

    block_hashes: tuple[Hashable, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine emptied its prefix cache (vLLM's ``AllBlocksCleared``: a prefix-cache reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
Dropped = Literal["restart", "gap"]


class EngineBlockIndex:
    """Which blocks each instance's engine reports holding, from its KV events, and how many of a
    request's leading blocks each holds (the same question as ``PrefixIndex.matched``, answered from
    the engine's own cache instead of where the router sent prompts).

    CHOICE: blocks are keyed by this index's own chain over the events' token ids (``block_hash``
    from ``seed``), not by the engine's hashes, which serve only to find a stored block's parent and
    the blocks a removal names. The engine's hashes equal that chain only while it runs vLLM's default
    ``sha256`` algorithm without ``PYTHONHASHSEED``; ``xxhash`` (a random per-process seed), another
    seed or 64-bit integer hashes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``) would make every lookup
    miss, while the token ids match whatever the engine hashes with, for one SHA-256 per stored block.
    A block whose hash carries extra keys (LoRA, multimodal input, cache salt) cannot be matched from
    tokens alone and is not indexed, nor are blocks of another block size, of a KV cache group other
    than the first, of an offload tier, or whose parent the index never saw (stored before it
    subscribed); ``skipped`` counts them.

    ``block_size`` None: the engine's own, taken from the first block it reports storing (vLLM picks it
    by platform and model: 16 on most GPUs, 128 on CPUs, 16 or 256 for some attention kernels, so a
    launcher that sets none cannot know it); until then no request matches any block."""

    def __init__(self, block_size: int | None = None, *, seed: str = VLLM_DEFAULT_SEED) -> None:
        if block_size is not None and block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._root = first_parent_hash(seed)
        self._held: dict[str, dict[Hashable, bytes]] = {}  # instance -> engine hash -> own chain hash
        self._own: dict[str, Counter[bytes]] = {}  # instance -> own chain hash -> engine blocks with it
        self._seq: dict[str, int] = {}  # instance -> number of its last batch applied
        self.skipped: Counter[str] = Counter()  # instance -> stored blocks not indexed

    def apply(self, instance: str, seq: int, events: Iterable[KVEvent]) -> Dropped | None:
        """Apply one batch of ``instance``'s events, numbered ``seq`` by its publisher (vLLM numbers
        batches from 0 in each process). A number at or below the last one comes from a new publisher:
        the engine restarted with an empty cache. A number past the next one means batches were lost,
        so what the instance holds is unknown (CHOICE: forget rather than keep blocks it may have
        evicted, which would draw requests to it for nothing). Either drops what the instance was
        believed to hold before the batch is applied, and is returned; None otherwise."""
        last = self._seq.get(instance)
        dropped: Dropped | None = None
        if last is not None and seq <= last:
            dropped = "restart"
        elif last is not None and seq > last + 1:
            dropped = "gap"
        if dropped is not None:
            self.forget(instance)
        self._seq[instance] = seq
        held = self._held.setdefault(instance, {})
        own = self._own.setdefault(instance, Counter())
        for event in events:
            if isinstance(event, AllBlocksCleared):
                held.clear()
                own.clear()
            elif isinstance(event, BlockRemoved):
                if event.medium in ENGINE_MEDIA and event.group_idx in (None, 0):
                    for engine_hash in event.block_hashes:
                        chain = held.pop(engine_hash, None)
                        if chain is not None:
                            own[chain] -= 1
                            if own[chain] <= 0:
                                del own[chain]
            else:
                self._store(instance, event, held, own)
        return dropped

    def _store(
        self, instance: str, event: BlockStored, held: dict[Hashable, bytes], own: Counter[bytes]
    ) -> None:
        usable = event.medium in ENGINE_MEDIA and event.group_idx in (None, 0)
        if usable and self.block_size is None:
            self.block_size = event.block_size
        size = event.block_size
        usable = usable and size == self.block_size
        parent = self._root if event.parent_block_hash is None else held.get(event.parent_block_hash)
        for i, engine_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[i * size : (i + 1) * size]
            keyed = (
                event.extra_keys is not None and i < len(event.extra_keys) and event.extra_keys[i] is not None
            )
            if not usable or parent is None or keyed or len(tokens) < size:
                self.skipped[instance] += len(event.block_hashes) - i  # their children cannot chain either
                return
            parent = block_hash(parent, tokens)
            if engine_hash not in held:
                own[parent] += 1
                held[engine_hash] = parent

    def forget(self, instance: str) -> None:
        """Drop what ``instance`` was believed to hold (its cache is empty or unknown); its feed stays
        known, holding nothing until new events arrive."""
        if instance in self._held:
            self._held[instance] = {}
            self._own[instance] = Counter()
        self._seq.pop(instance, None)

    def untrack(self, instance: str) -> None:
        """``instance`` has no event feed any more (it left): requests fall back to other evidence."""
        for table in (self._held, self._own, self._seq):
            table.pop(instance, None)
        self.skipped.pop(instance, None)

    def tracks(self, instance: str) -> bool:
        """Whether events of ``instance`` arrived since it was last untracked."""
        return instance in self._held

    def matched(self, hashes: Sequence[bytes], instances: Iterable[str]) -> dict[str, int]:
        """Per tracked instance among ``instances``, how many of ``hashes``' leading blocks (this index's
        chain: ``token_block_hashes`` with its block size and seed) its engine holds. Instances without
        an event feed are left out, so that a caller can tell "holds none" from "unknown"."""
        return {name: leading_run(hashes, self._own[name]) for name in instances if name in self._own}

    def blocks(self, instance: str) -> int:
        """How many blocks ``instance``'s engine reports holding."""
        return len(self._held.get(instance, ()))

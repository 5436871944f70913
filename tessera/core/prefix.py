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

Pure: time is passed in.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

VLLM_DEFAULT_SEED = "vllm-none-hash"  # vLLM's seed of the first parent hash without PYTHONHASHSEED
DEFAULT_TEXT_BLOCK_CHARS = 64  # characters per block of the approximate (text) index


def _sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def token_block_hashes(
    token_ids: Sequence[int], block_size: int, *, seed: str = VLLM_DEFAULT_SEED, extra_keys: Any = None
) -> list[bytes]:
    """vLLM's block hashes of the full ``block_size``-token blocks of ``token_ids`` (a partial last
    block is not cached, so it has none). ``seed``: the server's ``PYTHONHASHSEED`` when it sets one."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    parent = _sha256(seed)
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = _sha256((parent, tuple(token_ids[start : start + block_size]), extra_keys))
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
        out: dict[str, int] = {}
        for name in instances:
            held = self._blocks.get(name)
            n = 0
            if held:
                for h in hashes:
                    if h not in held:
                        break
                    n += 1
            out[name] = n
        return out

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

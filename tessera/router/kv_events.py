"""What a vLLM engine holds in its prefix cache, from its own KV events: a ZMQ subscriber that applies
them to the core's ``EngineBlockIndex`` (``tessera.core.prefix``), for precise prefix affinity.

vLLM publishes them when started with ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:PORT", "topic": "kv-events"}'`` (``VLLMServer.kv_events_port``
adds it): on a PUB socket, one message per engine step that changed the cache, of three frames: the
topic, the batch's number (8 bytes big-endian, counted from 0 by each engine process) and the batch in
msgpack, ``[ts, events, data_parallel_rank]``, each event a map tagged by its ``type``
(``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``). The vLLM CPU build publishes them too.
Decoded here without importing vLLM (the router's image has none); event types this module does not
know are skipped.

A PUB socket sends nothing to a subscriber before its subscription arrived (ZMQ's slow joiner), and
an engine that restarts numbers its batches from 0 again: the index sees either as a gap or a restart
and forgets what the instance held. An idle engine publishes nothing, so silence alone is not a
restart; a dead one fails the router's health polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tessera.core.prefix import (
    KV_EVENTS_TOPIC,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockIndex,
    KVEvent,
)

log = logging.getLogger(__name__)


def _hash(value: Any) -> Hashable:
    # vLLM publishes a block hash as bytes, or as an int (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, its default)
    if isinstance(value, bytes | int):
        return value
    raise ValueError(f"a block hash must be bytes or an int, got {type(value).__name__}")


def _hashes(values: Any) -> tuple[Hashable, ...]:
    if not isinstance(values, list):
        raise ValueError("block_hashes must be a list")
    return tuple(_hash(v) for v in values)


def _keys(values: Any) -> tuple[Any, ...] | None:
    if values is None:
        return None
    return tuple(None if v is None else tuple(v) if isinstance(v, list) else v for v in values)


def decode_batch(payload: bytes) -> list[KVEvent]:
    """The events of one msgpack ``KVEventBatch``; ValueError when it is not one."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("a KV event batch is [ts, events, data_parallel_rank]")
    events: list[KVEvent] = []
    for raw in batch[1]:
        if not isinstance(raw, dict):
            raise ValueError("a KV event is a map tagged by its 'type'")
        kind = raw.get("type")
        try:
            if kind == "BlockStored":
                parent = raw.get("parent_block_hash")
                events.append(
                    BlockStored(
                        block_hashes=_hashes(raw["block_hashes"]),
                        parent_block_hash=None if parent is None else _hash(parent),
                        token_ids=tuple(int(t) for t in raw["token_ids"]),
                        block_size=int(raw["block_size"]),
                        extra_keys=_keys(raw.get("extra_keys")),
                        medium=raw.get("medium"),
                        group_idx=raw.get("group_idx"),
                    )
                )
            elif kind == "BlockRemoved":
                events.append(
                    BlockRemoved(_hashes(raw["block_hashes"]), raw.get("medium"), raw.get("group_idx"))
                )
            elif kind == "AllBlocksCleared":
                events.append(AllBlocksCleared())
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed {kind} event: {exc!r}") from None
    return events


class KVEventSubscriber:
    """Applies one instance's KV events (``endpoint``: its vLLM publisher, e.g. ``tcp://10.0.0.5:5557``)
    to ``index`` under the instance's name, while ``run()`` runs (on the event loop that reads the index,
    so no lock is needed)."""

    def __init__(
        self,
        instance: str,
        endpoint: str,
        index: EngineBlockIndex,
        *,
        topic: str = KV_EVENTS_TOPIC,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.instance = instance
        self.endpoint = endpoint
        self.index = index
        self.topic = topic
        self._context = context
        self.batches = 0  # batches applied
        self.dropped: Counter[str] = Counter()  # why its blocks were forgotten: restart, gap, undecodable

    async def run(self) -> None:
        """Receive and apply batches until cancelled; ZMQ reconnects to a restarted publisher by itself."""
        context = self._context or zmq.asyncio.Context.instance()
        sock = context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sock.connect(self.endpoint)
        try:
            while True:
                self.receive(await sock.recv_multipart())
        finally:
            sock.close(linger=0)

    def receive(self, frames: Sequence[bytes]) -> None:
        """Apply one message (topic, number, batch)."""
        if len(frames) != 3:
            log.warning("KV events of %s: a message of %d frames (topic, number, batch expected)",
                        self.instance, len(frames))  # fmt: skip
            return
        _, number, payload = frames
        seq = int.from_bytes(number, "big", signed=True)
        try:
            events = decode_batch(payload)
        except ValueError as exc:
            # the batch changed the cache in a way that cannot be known: as lost events
            log.warning("KV events of %s: batch %d undecodable (%s); its blocks are forgotten",
                        self.instance, seq, exc)  # fmt: skip
            self.index.forget(self.instance)
            self.dropped["undecodable"] += 1
            return
        dropped = self.index.apply(self.instance, seq, events)
        if dropped is not None:
            log.info(
                "KV events of %s: %s at batch %d, what it held is forgotten", self.instance, dropped, seq
            )
            self.dropped[dropped] += 1
        self.batches += 1


class Subscriptions:
    """One running subscriber per wanted feed, on the running event loop: ``sync`` starts those of new
    feeds and stops those of feeds no longer wanted (an instance that left), whose blocks the index
    then no longer reports."""

    def __init__(self) -> None:
        self._running: dict[tuple[str, str], tuple[str, EngineBlockIndex, asyncio.Task[None]]] = {}

    def sync(self, wanted: Iterable[tuple[str, str, str, EngineBlockIndex]]) -> None:
        """Make the running subscribers those of ``wanted`` (instance, model, endpoint, the model's index)."""
        keep: set[tuple[str, str]] = set()
        for instance, model, endpoint, index in wanted:
            keep.add((instance, model))
            running = self._running.get((instance, model))
            if (
                running is not None
                and running[0] == endpoint
                and running[1] is index
                and not running[2].done()
            ):
                continue
            if running is not None:
                self._stop(instance, model)
            task = asyncio.create_task(KVEventSubscriber(instance, endpoint, index).run(),
                                       name=f"kv-events-{instance}-{model}")  # fmt: skip
            self._running[(instance, model)] = (endpoint, index, task)
        for instance, model in [k for k in self._running if k not in keep]:
            self._stop(instance, model)

    def _stop(self, instance: str, model: str) -> None:
        _, index, task = self._running.pop((instance, model))
        if task.done() and not task.cancelled() and task.exception() is not None:
            log.warning("KV events of %s (%s): the subscriber failed: %r; restarted",
                        instance, model, task.exception())  # fmt: skip
        task.cancel()
        index.untrack(instance)

    async def aclose(self) -> None:
        """Stop every subscriber."""
        tasks = [task for _, _, task in self._running.values()]
        self._running.clear()
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

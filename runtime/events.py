"""KV events: what each tier holds, told to KV-aware routers in vLLM's format.

The native core logs a STORED entry whenever a block's page becomes
published in a tier (a commit, a move landing, recovery) and a REMOVED entry
whenever it stops being so (a move leaving, a drop, a subtree drop, a
corrupt read). This module drains that log off the hot path (a flush every
``flush_interval`` seconds, and whenever a caller takes events): the core
encodes the events as msgpack itself (runtime/core/kv_event_codec.hpp, no
Python object per block), and each batch's bytes go to the ZMQ publisher and
to Python readers (decoded only when they read). Nothing here blocks on a consumer: buffers are bounded and
what does not fit is counted as dropped.

A batch is ``[ts, [event, ...], data_parallel_rank]``; each event is a map
tagged ``"type"`` with vLLM's field names, fields at their default (``None``)
omitted as vLLM's encoder omits them::

    {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | None,
     "token_ids": [t, ...], "block_size": tokens_per_block, "lora_id": None,
     "medium": "GPU" | "CPU_PINNED" | "DISK" | "EXTERNAL", "lora_name": None,
     "group_idx": life cycle index, "kv_cache_spec_kind": "full_attention" |
     "sliding_window" | "mamba", ["kv_cache_spec_sliding_window": window tokens]}
    {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": ..., "group_idx": ...}
    {"type": "AllBlocksCleared"}

A BlockStored's hashes form a chain: the first block's parent is
``parent_block_hash``, each later block's parent the one before it.
``token_ids`` holds ``block_size`` tokens per block when the blocks' tokens
are known (sequences opened with ``tokens=``), else it is empty (``block_keys=``
sequences, and pages recovered from disk: the journal keeps keys, not tokens).
With ``positional = true`` events are arrays in the older vLLM layout:
``["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium]``,
``["BlockRemoved", hashes, medium]``, ``["AllBlocksCleared"]``.

Block hashes are unsigned 64-bit: an int block key in [0, 2**64) is its own
hash, any other key is mixed to 64 bits the same way in every process
(runtime/core/kv_events.hpp, ``external_hash``).
"""
from __future__ import annotations

import asyncio
import collections
import os
import socket
import time
from typing import TYPE_CHECKING, AsyncIterator, Awaitable

import msgpack
import numpy as np

from .loop import every
from .pages import DISK, GPU, HOST

if TYPE_CHECKING:
    from tiers.config import EventsConfig
    from .store import Store


EVENT = np.dtype([("hash", "<u8"), ("parent", "<u8"), ("token_at", "<i4"), ("kind", "u1"), ("tier", "i1"),
                  ("lc", "u1"), ("has_parent", "u1")])
assert EVENT.itemsize == 24                 # kv_events.hpp's KvEvent (the raw log, for tests and tools)
REMOTE = 3
MEDIUM = {GPU: "GPU", HOST: "CPU_PINNED", DISK: "DISK", REMOTE: "EXTERNAL"}
_PACKER = msgpack.Packer()                  # for array headers around events the core encoded
FLUSH_ENTRIES = 4096                        # log entries encoded per loop turn (0.1-1 ms)
HOLD_BYTES = 64 << 20                       # events held back while the publisher's queue is full
EMIT_BYTES = 1 << 20                        # a flush's chunks go out as one batch, sent once this big: each
                                            # batch wakes the publisher's thread (268 a replay were 15 % of
                                            # the events' cost with a host tier)


def default_topic(worker_id: str | None, model: str) -> str:
    return f"kv@{worker_id or f'{socket.gethostname()}-{os.getpid()}'}@{model}"


def _spec_kind(lc) -> tuple[str, int | None]:
    if lc.kind == "ssm":
        return "mamba", None
    if lc.window_tokens:
        return "sliding_window", int(lc.window_tokens)
    return "full_attention", None


class KvEvents:
    """The store's event stream: drains the core's log into batches (see the
    module docstring) for the publisher and for ``take``/``batches`` readers."""

    def __init__(self, store: "Store", cfg: "EventsConfig") -> None:
        self.store, self.cfg = store, cfg
        self.publisher = None
        # Python readers: buffered (as bytes) from the start when there is no ZMQ endpoint, else from the first read
        self.local: collections.deque | None = collections.deque() if cfg.endpoint is None else None
        self.wakeup: asyncio.Event | None = None
        self.pending: list[bytes] = []      # encoded events not yet in a batch, in order
        self.n_pending = 0
        self.pending_bytes = 0
        self.n_batches = 0
        self.n_events = 0
        self.local_dropped = 0
        self._rank = msgpack.packb(cfg.data_parallel_rank)
        self._flusher: asyncio.Task | None = None

    # -- life -----------------------------------------------------------------------
    def open(self) -> None:
        """Bind the sockets (before the store builds anything: a bad endpoint fails the start)."""
        if self.cfg.endpoint is not None:
            from .zmq_publisher import ZmqEventPublisher
            from tiers.errors import ConfigError
            c = self.cfg
            try:
                self.publisher = ZmqEventPublisher(
                    c.endpoint, replay_endpoint=c.replay_endpoint,
                    topic=default_topic(c.worker_id, c.model) if c.topic is None else c.topic,
                    buffer_batches=c.buffer_batches, queue_batches=c.buffer_batches, hwm=c.buffer_batches)
            except ConfigError as e:
                raise ConfigError(f"events.{e.field}", e.problem) from None

    def start(self) -> None:
        """The store's contents start empty: AllBlocksCleared, before recovery's BlockStored."""
        core, store = self.store.core, self.store
        specs = [_spec_kind(lc) for lc in store.lcs]
        core.set_kv_event_format(store.tpb, self.cfg.positional, [MEDIUM[t] for t in sorted(MEDIUM)],
                                 [k for k, _ in specs], [-1 if w is None else w for _, w in specs])
        core.set_kv_events(True)
        self.pending.append(msgpack.packb(["AllBlocksCleared"] if self.cfg.positional
                                          else {"type": "AllBlocksCleared"}))
        self.n_pending += 1

    def run(self) -> None:
        """Start the flusher (recovery's events go out a chunk per loop turn from here)."""
        self._flusher = asyncio.ensure_future(self._flush_loop())

    async def stop(self) -> None:
        """The last batches (persisting's moves included), then no more."""
        if self._flusher is not None:
            self._flusher.cancel()
            await asyncio.wait([self._flusher])
            self._flusher = None
        if self.store.core is not None:
            await self._flush_async(force=True)

    def close(self) -> None:
        """Blocking: flush the publisher's queue and close its sockets (run off the loop)."""
        if self.publisher is not None:
            self.publisher.close()

    def _flush_loop(self) -> Awaitable[None]:
        return every(self.cfg.flush_interval, self._flush_async, "kv events: a flush")

    async def _flush_async(self, force: bool = False) -> None:
        """Everything logged so far, encoded a chunk per loop turn (a recovery logs millions),
        sent as one batch (sent once it reaches ``EMIT_BYTES``: at most one chunk more)."""
        while self._take(force):
            await asyncio.sleep(0)
        self._emit(force)

    # -- the log into batches -----------------------------------------------------------
    def flush(self) -> None:
        """Everything the core logged so far becomes batches, now, in one go."""
        while self._take(True):
            pass
        self._emit(True)

    def _take(self, force: bool) -> bool:
        """At most ``FLUSH_ENTRIES`` log entries, encoded, onto the pending batch (sent once it
        reaches ``EMIT_BYTES``); True while more remain."""
        core = self.store.core
        if core.kv_event_count():
            n, body = core.take_kv_event_payload(FLUSH_ENTRIES)
            self.pending.append(body)
            self.n_pending += n
            self.pending_bytes += len(body)
            if self.pending_bytes >= EMIT_BYTES:
                self._emit(force)
        return core.kv_event_count() > 0

    def _emit(self, force: bool = False) -> None:
        if not self.n_pending:
            return
        pub = self.publisher
        if pub is not None and not force and not pub.has_room() and self.pending_bytes < HOLD_BYTES:
            return          # the publisher is behind: the events wait here and go out merged in one batch
        n, body = self.n_pending, b"".join(self.pending)
        self.pending_bytes = 0
        self.pending, self.n_pending = [], 0
        # [ts, [events...], rank], the events already encoded: msgpack concatenates
        head = _PACKER.pack_array_header
        payload = b"".join((head(3), msgpack.packb(time.time()), head(n), body, self._rank))
        self.n_batches += 1
        self.n_events += n
        if self.publisher is not None:
            self.publisher.publish(payload)
        if self.local is not None:
            if len(self.local) >= self.cfg.buffer_batches:
                self.local.popleft()
                self.local_dropped += 1
            self.local.append(payload)
            if self.wakeup is not None:
                self.wakeup.set()

    def tokens(self, sid: int, first: int, tokens: np.ndarray) -> None:
        """The tokens of a sequence's key positions from ``first`` on, for its BlockStored
        events; ids beyond int32 are not kept (those events carry no tokens)."""
        if not len(tokens):
            return
        if int(tokens.min()) < -(1 << 31) or int(tokens.max()) >= 1 << 31:
            return
        self.store.core.set_tokens(sid, first, np.ascontiguousarray(tokens, dtype=np.int32), self.store.tpb)

    # -- readers ------------------------------------------------------------------------
    def take(self) -> list[list]:
        """Every batch buffered for Python readers since the last take (oldest first);
        what the core logged meanwhile is encoded first, in one go."""
        if not self.store.closed:
            self.flush()
        if self.local is None:
            self.local = collections.deque()
            return []
        out = [msgpack.unpackb(p) for p in self.local]
        self.local.clear()
        return out

    async def batches(self) -> AsyncIterator[list]:
        """Batches as they are made, until the store closes."""
        if self.local is None:
            self.local = collections.deque()
        if self.wakeup is None:
            self.wakeup = asyncio.Event()
        while True:
            if not self.store.closed:
                await self._flush_async()
            while self.local:
                yield msgpack.unpackb(self.local.popleft())
            if self.store.closed:
                return
            self.wakeup.clear()
            try:
                await asyncio.wait_for(self.wakeup.wait(), timeout=max(self.cfg.flush_interval, 0.05))
            except asyncio.TimeoutError:
                pass

    def holdings(self) -> set[tuple[int, str, int]]:
        """(block hash, medium, group_idx) of every page the tiers hold now, as the
        events describe them (tests check the events against it)."""
        h, t, g = self.store.core.published_hashes()
        return set(zip(np.frombuffer(h, np.uint64).tolist(), (MEDIUM[x] for x in np.frombuffer(t, np.int8).tolist()),
                       np.frombuffer(g, np.uint8).tolist()))

    def stats(self) -> dict:
        """``batches`` and ``events`` made; ``published`` and ``dropped`` count batches
        (handed to ZMQ, or lost to a full queue or a full reader buffer)."""
        pub = self.publisher.stats() if self.publisher is not None else {}
        return {"batches": self.n_batches, "events": self.n_events,
                "published": pub.get("published", 0),
                "dropped": pub.get("dropped", 0) + self.local_dropped,
                "buffered": len(self.local) if self.local is not None else 0,
                "endpoint": self.publisher.endpoint if self.publisher is not None else None,
                "replay_endpoint": self.publisher.replay_endpoint if self.publisher is not None else None}

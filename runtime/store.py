"""The Store: the asyncio side of kvtier's control plane.

The page table, prefix index, slot allocators, LRU queues and every decision
over them live in the native core (``runtime.core``), called once per request
operation or migration batch. This module owns what waits: claims' futures,
copies through the migration engine, readiness events, cancellation, and the
disk tier's I/O (frees and relabels the core asks for are submitted on the
disk's write stream, in order with the writes that may reuse those slots).

Rules the code keeps:
- after every core call that can free disk slots or publish disk pages,
  ``_sync`` submits them before anything awaits;
- a claimed page (in flight) is awaited through its claim's future; the
  operation that claimed it settles that future when it lands or fails.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
from typing import Any, Callable, Coroutine, Sequence as Seq

import numpy as np
import torch

from tiers.config import StoreConfig
from tiers.device import Device, host_available_bytes
from tiers.errors import CorruptPageError, DiskFullError, KvtierError, OutOfPagesError, StoreClosedError, UsageError
from tiers.grouping import Layout
from tiers.native import keep_gil_below
from tiers.journal import RECORD
from tiers.pools import SlabPool
from tiers.policy import ReusePolicy
from tiers.streams import CudaEvent

from .core import COMMIT_PAST_BLOCKS, Core, CoreError, Pages
from .events import KvEvents
from .handles import ClaimTable, EventTable
from .keys import BlockKey, check_block_keys, hash_blocks, token_array_async
from .loop import short_switch_interval, start_eagerly
from .migration import Batch, MigrationEngine
from .pages import DISK, GPU, HOST, TIER_NAMES
from .readiness import ended, wait_events
from .reclaim import DISK_SHARE, MAX_BATCH, REFILL_BYTES, STEP_SHARE, Reclaimer
from .recovery import index_recovered, persist
from .remote import RemoteLink
from .sequence import Sequence
from .views import IndexView
from .write_through import WriteThrough, off_stats as write_through_off

log = logging.getLogger("kvtier")
HASH_ON_LOOP_TOKENS = 1 << 16       # longer prompts hash off the loop (about a millisecond per 64 Ki tokens)
# at most this many pages (of the GPU and host tiers) have their native table entries written when
# the store opens, not by the requests that fill them (None: the core's default, a million; see
# runtime/core/page_table.hpp, PageTable::prefault)
CORE_PREFAULT_PAGES: int | None = None

_REUSE_CODE = {ReusePolicy.REQUIRED: 0, ReusePolicy.SINK_REQUIRED_ONLY: 1, ReusePolicy.OPTIONAL: 2,
               ReusePolicy.PRIVATE: 3}

# The loop's thread keeps the GIL through native copies and checksums smaller than this (workers
# below 64 KiB): giving it up for a copy of a few hundred KiB cost a wait to get it back that was
# longer than the copy (tiers/native/module.cpp). The loop's own copies go up to 2 MiB inline and
# 4 MiB gathered (migration.INLINE_BYTES, BEHIND_BYTES), and those above this give the GIL up: a
# 2 MiB copy took 0.14 ms alone and 8.7 ms at p99 against a spinning Python thread (review,
# session 15). Keeping it through 4 MiB cost the three-tier replay 16 % at concurrency 1 (1 of 5
# pairs) and 4 % at 32 (2 of 5): the disk write thread then waits for it instead. The replay's loop
# lag p99 at concurrency 32 stays 3.2-3.7 ms.
LOOP_KEEPS_GIL_BELOW = 1 << 20   # (the thread keeps the setting after close; only kvtier's kernels read it)
REFILL_WAITS = 2                 # landings the first in line waits for before it evicts for itself


class _FreeBatch:
    """The disk frees of one job on the write stream. The loop joins frees to it until the
    job starts; the lock makes "not started yet, so joined" and "started, so taken" exclusive."""

    __slots__ = ("frees", "lock", "started", "mark")

    def __init__(self, group: int, slots: list[int]) -> None:
        self.frees = [(group, slots)]
        self.lock = threading.Lock()
        self.started = False
        self.mark = -1                  # the stream's submission count just after this job was queued

    def join(self, group: int, slots: list[int]) -> bool:
        with self.lock:
            if self.started:
                return False
            self.frees.append((group, slots))
            return True

    def take(self) -> list[tuple[int, list[int]]]:
        with self.lock:
            self.started = True
            return self.frees


class _InLine:
    """A request waiting in a (tier, group)'s line for slots: ``turn`` is set when it comes first."""
    __slots__ = ("need", "turn")

    def __init__(self, need: int) -> None:
        self.need = need
        self.turn: asyncio.Future | None = None


class Store:
    def __init__(self, cfg: StoreConfig) -> None:
        self.cfg = cfg
        self.layout: Layout = cfg.layout
        self.lcs = self.layout.life_cycles
        self.tpb = cfg.tokens_per_block
        self.closed = False
        self.started = False
        self.tier_ids = [t for t, name in enumerate(TIER_NAMES) if name in cfg.tiers()]
        self.next_tier = {t: (self.tier_ids[i + 1] if i + 1 < len(self.tier_ids) else None)
                          for i, t in enumerate(self.tier_ids)}
        self.last_tier = self.tier_ids[-1]
        self.group_of = [[self.layout.group_map(name).get(lc.index, -1) for lc in self.lcs] for name in TIER_NAMES]
        self.layer_lc: dict[int, int] = {}
        self.pool_index: dict[tuple[int, str], int] = {}
        for lc in self.lcs:
            for i, (layer, role, _) in enumerate(lc.buffers):
                self.layer_lc[layer] = lc.index
                self.pool_index[(layer, role)] = i
        # pages of each GPU group per block of extension
        self.lcs_per_gpu_group: dict[int, int] = {}
        for lc in self.lcs:
            g = self.group_of[GPU][lc.index]
            self.lcs_per_gpu_group[g] = self.lcs_per_gpu_group.get(g, 0) + 1
        self.max_extend = 0                         # the most blocks one extend can place (set at start)
        self.gpu_reclaimers: list[tuple[int, Reclaimer]] = []
        self.events = EventTable()
        self.claims = ClaimTable()
        self._tasks: set[asyncio.Task] = set()
        self._free_batch: _FreeBatch | None = None      # the last free job's batch (see _disk_free)
        self.reclaimers: dict[tuple[int, int], Reclaimer] = {}
        # (tier, group) -> slots that demotions in flight will give back to the free pool (the
        # reclaimer's batches and on-demand evictions' extra): what refills the reserve already
        self.refilling: dict[tuple[int, int], int] = {}
        self._refill_waiters: dict[tuple[int, int], asyncio.Future] = {}
        # (tier, group) -> the requests short of slots there, first come first served (see _obtain)
        self._lines: dict[tuple[int, int], collections.deque[_InLine]] = {}
        self._line_batch: dict[int, int] = {}      # tier -> most slots a demotion batch takes beyond its own need
        self.core: Core | None = None
        self._loop: asyncio.AbstractEventLoop | None = None     # the loop the store started on
        self._loop_thread = -1                                  # and its thread (threading.get_ident)
        self.device: Device | None = None
        self.cuda = False                   # the GPU tier is a CUDA device (else emulated in host memory)
        self.disk = None
        self.engine: MigrationEngine | None = None
        self.nodes = IndexView(self)
        self._starting: asyncio.Future | None = None
        self._closing: asyncio.Future | None = None
        self.corrupt_pages = 0             # pages a read found damaged: dropped, their blocks recomputed
        self.disk_full_events = 0          # spills the full filesystem refused ...
        self.disk_full_dropped = 0         # ... and the evicted pages dropped instead
        self.behind_failures = 0           # spills written behind whose write failed (not a full disk)
        self._said: dict[str, float] = {}  # warning kind -> when it was last logged (_once_a_minute)
        self.kv_events = KvEvents(self, cfg.events) if cfg.events is not None else None
        self.remote = RemoteLink(self, cfg.remote) if cfg.remote is not None else None
        self.write_through = WriteThrough(self, cfg.disk) \
            if cfg.disk is not None and cfg.disk.write == "through" else None
        self._recounted = [0, 0, 0, 0]     # lookups and hits of first opens that a remote import re-matched

    # -- life of the store ------------------------------------------------------------
    @classmethod
    def open(cls, cfg: StoreConfig) -> "Store":
        """``async with Store.open(cfg) as store`` (or ``store = await Store.open(cfg)``)."""
        return cls(cfg)

    def __await__(self):
        return self._started().__await__()

    async def _started(self) -> "Store":
        await self.__aenter__()
        return self

    async def __aenter__(self) -> "Store":
        try:
            await self.start()
        except BaseException:
            await self.close()          # a failed start lets go of what it opened (the disk's lock too)
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        """Build the tiers and rebuild the index from disk; concurrent calls
        share one start, and the store is usable only once it finished."""
        if self.started:
            return
        if self.closed or self._closing is not None:
            raise StoreClosedError("store is closed: open a new one")
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)

    async def _start(self) -> None:
        # the store's loop, kept: on Python 3.11 every asyncio.get_running_loop() is a getpid()
        # system call, which cost the loop 3 % of its time in the three-tier replay
        loop = self._loop = self.claims.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        keep_gil_below(LOOP_KEEPS_GIL_BELOW)     # this (the loop's) thread: small inline copies keep the GIL
        with short_switch_interval():           # the loop keeps its turn while a worker replays the journal
            await loop.run_in_executor(None, self._build)
            self.engine.attach(loop)
            self.engine.on_behind_failure = self._behind_failed
            if self.write_through is not None:
                self.engine.staged = None       # a promoted page's disk copy must be written when it lands
            if self.kv_events is not None:
                self.kv_events.start()          # AllBlocksCleared, then what recovery finds
            if self.disk is not None:
                await index_recovered(self)     # the core is rebuilt off the loop: nothing may use it meanwhile
        if self.write_through is not None:
            self.core.set_write_through(True)   # from here on every page published off the disk is queued
            self.write_through.start()
            self._warn_small_write_through_disk()
        if self.remote is not None:
            await self.remote.open()            # an unreachable server is a tier with its circuit open
        self._start_reclaimers()
        if self.kv_events is not None:
            self.kv_events.run()
        self.started = True

    def _start_reclaimers(self) -> None:
        """Background demotion (runtime/reclaim.py) for every group with a reserve.

        A free slot holds no page, so the reserve costs hits in proportion to the whole store:
        a tier's reserve is its share of its slots, but of no more than a third of the store's
        (spread over its groups by their size). The last tier keeps none (dropping early would
        only lose hits), unless it is the disk: it keeps two spill batches free, refilled by
        one step, where that is at most DISK_SHARE of the disk. Its allocator skips the slots
        freed lately (allocator.hpp), so the slots a spill takes had their frees journaled by an
        earlier commit; on a full disk without it, most spills first appended and synced the frees of
        the pages they overwrote (DiskTier.write, step 1). A disk too small for that share
        keeps none: the hits it would cost outweigh the syncs. Elsewhere the step is at least
        the reserve."""
        core = self.core
        tier_slots = {t: sum(core.capacity(t, g) for g in range(core.n_groups(t))) for t in self.tier_ids}
        total = sum(tier_slots.values())
        third = total / 3
        for t in self.tier_ids:
            cfg = self.cfg.tier_config(TIER_NAMES[t])
            last = t == self.last_tier
            if last and t != DISK:
                continue
            scale = min(1.0, third / tier_slots[t]) if tier_slots[t] else 1.0
            for g in range(core.n_groups(t)):
                cap = core.capacity(t, g)
                # the refill step: REFILL_BYTES of pages, within STEP_SHARE of the store (spread
                # over the tier's groups by size) and an eighth of the group
                page = self.slabs[t][g].spec.slot_bytes if t != DISK else self.engine.cold_bytes[g]
                step = min(-(-REFILL_BYTES // page), int(STEP_SHARE * total * cap / tier_slots[t]), cap // 8)
                if not last:
                    low = int(cap * scale * cfg.reserve)
                    step = max(low, step)
                elif cfg.reserve > 0 and len(self.tier_ids) > 1:    # two spill batches
                    low = min(2 * self._line_batch[self.tier_ids[-2]], cap // 8)
                    if low + step > DISK_SHARE * cap:
                        continue
                else:
                    continue
                if low > 0 and step > 0:
                    r = self.reclaimers[(t, g)] = Reclaimer(self, t, g, low, step)
                    r.start()
                    if t == GPU:
                        self.gpu_reclaimers.append((self.lcs_per_gpu_group.get(g, 0), r))

    def _build(self) -> None:
        """Allocate slabs and open the disk tier (blocking: run off the loop)."""
        cfg = self.cfg
        host_cfg = cfg.host
        if self.kv_events is not None:
            self.kv_events.open()               # binds its sockets: a bad endpoint fails the start first
        self.device = Device(cfg.gpu.device, host_cfg.pinned if host_cfg else None)
        self.cuda = self.device.is_cuda
        cfg.check_memory(self.device.free_bytes(), host_available_bytes())
        n = {name: cfg.slots_per_group(name) for name in TIER_NAMES}
        gpu = [SlabPool(g, s, self.device) for g, s in zip(self.layout.groups["gpu"], n["gpu"])]
        host = [SlabPool(g, s, self.device) for g, s in zip(self.layout.groups["host"], n["host"])] \
            if host_cfg is not None else []
        cold_bytes = [g.slot_bytes for g in self.layout.groups["host"]]
        if cfg.disk is not None:
            from tiers.disk import DiskTier
            d = cfg.disk
            self.disk = DiskTier.open(d.path, self.layout.fingerprint(self.tpb, cfg.hash_salt),
                                      list(zip(cold_bytes, n["disk"])), on_mismatch=d.on_mismatch,
                                      o_direct=d.o_direct, min_free=d.min_free, fsync=d.fsync)
        self.slabs = [gpu, host]
        capacity = [[p.slots for p in gpu], [p.slots for p in host],
                    list(n["disk"]) if cfg.disk is not None else []]
        lcs = [(lc.kind == "ssm", lc.window_tokens or 0, lc.sink_tokens, _REUSE_CODE[lc.reuse]) for lc in self.lcs]
        group_of = [[g if capacity[t] else -1 for g in row] for t, row in enumerate(self.group_of)]
        self.core = Core(self.tpb, lcs, group_of, capacity, prefault_pages=CORE_PREFAULT_PAGES)
        for t in self.tier_ids:
            # a demotion batch beyond a request's own need (the reserve's, the line's) is at most a
            # quarter of the next tier's smallest group (MAX_BATCH at most), so that the next tier
            # can make room for it from its own evictable pages
            nxt = self.next_tier[t]
            self._line_batch[t] = MAX_BATCH if nxt is None else \
                min([MAX_BATCH] + [max(1, c // 4) for c in capacity[nxt]])
        self.max_extend = min(capacity[GPU][g] // k for g, k in self.lcs_per_gpu_group.items())
        self.engine = MigrationEngine(self.device, self.lcs, gpu, host, self.disk, cold_bytes)

    async def close(self) -> None:
        """Wait for in-flight moves, optionally persist, release everything.
        A close whose caller is cancelled goes on to the end in the
        background (a later close waits for it): stopping half-way would
        leave moves, persisting and the disk tier in between."""
        if self._closing is not None:            # a close under way (or done): wait for its end
            await asyncio.shield(self._closing)
            return
        if self.closed:
            return
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        if self._starting is not None and not self._starting.done():
            await asyncio.wait([self._starting])        # a start in flight finishes (or fails) first
        for r in getattr(self, "reclaimers", {}).values():
            await r.stop()
        if self.write_through is not None:
            await self.write_through.stop()     # its batch in flight lands; persisting covers the rest
        await self._wait_tasks()
        if self.started and self.disk is not None and self.cfg.persist_on_close:
            try:
                await persist(self)
            except Exception as exc:   # noqa: BLE001 - closing must finish; the pages stay unpersisted
                log.warning("persisting pages at close failed: %s", exc)
        if self.engine is not None:
            await self._behind_written()        # a write that fails is still handled while the store is open
        if self.remote is not None:
            while self._tasks:                  # write-through started by persisting, imports of late opens
                await self._wait_tasks()
            await self.remote.close()
        if self.kv_events is not None and self.core is not None:
            await self.kv_events.stop()         # the last batches, persisting's moves included
        self.closed = True
        if self.engine is not None or self.disk is not None or self.kv_events is not None:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self._shutdown)
        for pools in getattr(self, "slabs", ()):
            for pool in pools:
                pool.release()

    def _warn_small_write_through_disk(self) -> None:
        """Write-through keeps a copy of every page above the disk on it: a disk no larger than
        GPU + host evicts copies to make copies, and holds fewer distinct pages than write-back."""
        core = self.core
        above = sum(core.capacity(t, g) for t in (GPU, HOST) if t in self.tier_ids for g in range(core.n_groups(t)))
        disk = sum(core.capacity(DISK, g) for g in range(core.n_groups(DISK)))
        if disk <= above:
            log.warning("disk write = \"through\" with %d disk slots for %d GPU and host slots: the disk cannot "
                        "hold a copy of what is above it, so copies will evict each other (and pages only the "
                        "disk has); give the disk several times the slots above it, or use write = \"back\"",
                        disk, above)

    def _shutdown(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
        if self.engine is not None:
            self.engine.close()
        if self.disk is not None:
            self.disk.close()

    def _check(self) -> None:
        if self.closed:
            raise StoreClosedError("store is closed")
        if not self.started:
            raise UsageError("store is not started: use `async with Store.open(cfg)`")

    # -- public queries -------------------------------------------------------------------
    def pool_tensor(self, layer_id: int, role: str):
        """The GPU pool ``[slots, bytes]`` a kernel indexes by ``page_indices``."""
        self._check()
        lc = self._lc_of_layer(layer_id)
        try:
            pool = self.pool_index[(layer_id, role)]
        except KeyError:
            raise UsageError(f"layer {layer_id} has no buffer {role!r}") from None
        return self.slabs[GPU][self.group_of[GPU][lc]].pool_view(pool)

    def pool_groups(self, tier: str) -> dict[int, int]:
        """Life cycle index -> pool group index in ``tier``."""
        if tier not in TIER_NAMES:
            raise UsageError(f"unknown tier {tier!r} (expected one of {', '.join(TIER_NAMES)})")
        return self.layout.group_map(tier)

    def _lc_of_layer(self, layer_id: int) -> int:
        try:
            return self.layer_lc[layer_id]
        except (KeyError, TypeError):
            raise UsageError(f"unknown layer id {layer_id!r}") from None

    def _check_stream(self, stream) -> None:
        """A caller's stream must be a CUDA stream on a CUDA store (checked before anything changes)."""
        if stream is None:
            return
        if not self.device.is_cuda:
            raise UsageError("stream= needs a CUDA device; this store's GPU tier is emulated in host memory")
        if not isinstance(stream, torch.cuda.Stream):
            raise UsageError(f"stream must be a torch.cuda.Stream, got {type(stream).__name__}")

    # -- sequences -------------------------------------------------------------------------
    async def open_sequence(self, tokens: Seq[int] | None = None, block_keys: Seq[BlockKey] | None = None,
                            priority: int | None = None) -> Sequence:
        if self.closed or not self.started or self._closing is not None:
            self._check()
            raise StoreClosedError("store is closing")
        if (tokens is None) == (block_keys is None):
            raise UsageError("pass exactly one of tokens= or block_keys=")
        # on the store's thread with its loop running, that loop is the running one: no
        # get_running_loop (a getpid() system call on Python 3.11) per request
        if (threading.get_ident() != self._loop_thread or not self._loop.is_running()) \
                and asyncio.get_running_loop() is not self._loop:
            raise UsageError("the store runs on the event loop it was opened on: use it from that loop "
                             "(asyncio.run_coroutine_threadsafe from other threads)")
        if priority is None:
            priority = self.cfg.default_priority
        elif not isinstance(priority, int) or isinstance(priority, bool) or not 0 <= priority <= 100:
            raise UsageError(f"priority must be an integer in 0..100, got {priority!r}")
        core = self.core
        if tokens is not None:
            token_arr = await token_array_async(tokens)
            if len(token_arr) <= HASH_ON_LOOP_TOKENS:
                keys = hash_blocks(token_arr, self.tpb, self.cfg.hash_salt)
            else:                           # a long prompt hashes on a worker (the hashing releases the GIL)
                keys = await self._loop.run_in_executor(None, hash_blocks, token_arr, self.tpb, self.cfg.hash_salt)
            self._check()                   # the store may have closed meanwhile
            sid, matched, by_tier = core.open(keys, priority)
            self._keep_tokens(sid, token_arr, len(keys))
        else:
            token_arr = None
            keys = list(block_keys) if isinstance(block_keys, (list, tuple)) else check_block_keys(block_keys)
            try:
                sid, matched, by_tier = core.open(keys, priority)     # checks ints and bytes in C++
                failed = False
            except (ValueError, TypeError):
                failed = True
            if failed:
                # numpy ints, bools, mixed kinds...: the Python check names the problem or
                # normalises the keys (nothing changed in the core); outside the handler, so that
                # its UsageError does not carry the core's message as its context
                keys = check_block_keys(block_keys)
                try:
                    sid, matched, by_tier = core.open(keys, priority)
                except (ValueError, TypeError) as exc:
                    raise UsageError(str(exc)) from None
        remote = None
        if self.remote is not None:
            remote = 0
            if matched < len(keys):
                remote, again = await self._remote_import(sid, keys, matched)
                if again:                       # matched again, over the imported blocks (or another's)
                    core.close(sid)
                    self._recounted[0] += len(keys)
                    for t in range(3):
                        self._recounted[1 + t] += by_tier[t]
                    sid, matched, by_tier = core.open(keys, priority)
                    self._recounted[1 + HOST] += remote     # the imported blocks count as remote hits, not host
                    self._keep_tokens(sid, token_arr, len(keys))
        return Sequence(self, sid, keys, token_arr, priority, matched, by_tier, remote)

    def _keep_tokens(self, sid: int, token_arr: np.ndarray | None, n_keys: int) -> None:
        """KV events: the blocks' tokens, for their BlockStored (a sequence opened with tokens)."""
        if token_arr is not None and self.kv_events is not None:
            self.kv_events.tokens(sid, 0, token_arr[:n_keys * self.tpb])

    async def _remote_import(self, sid: int, keys: list, matched: int) -> tuple[int, bool]:
        """The remote run after sequence ``sid``'s match, imported by a task of the store's
        own: a caller cancelled meanwhile leaves it to finish (its moves and slots settle),
        and the sequence is closed then."""
        task = self._spawn(self.remote.extend_match(sid, keys, matched))
        try:
            out = await asyncio.shield(task)
        except BaseException:
            def _close_seq(_: asyncio.Task) -> None:
                if not self.closed:
                    self.core.close(sid)
            if task.done():
                _close_seq(task)
            else:
                task.add_done_callback(_close_seq)
            raise
        try:
            self._check()               # the store may have closed meanwhile
        except BaseException:
            self.core.close(sid)
            raise
        return out

    # -- running sequence operations so that cancellation leaks nothing ----------------------
    async def _run_exclusive(self, seq: Sequence, coro: Coroutine, undo: Callable[[Sequence, Any], None]) -> None:
        if seq.busy:
            coro.close()
            raise UsageError("another acquire or extend of this sequence is running")
        seq.busy = True
        try:
            # most finish without waiting (pages promoted from host memory by an inline copy, free
            # slots): run them here; a task (which a cancelled caller leaves running) only from the
            # first wait on, where a cancellation could come
            done, task = start_eagerly(coro, self._loop)
        except BaseException:
            seq.busy = False
            raise
        if done:
            seq.busy = False
            return
        seq.task = task
        self._track(task)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():         # it finished just as its caller was cancelled: the caller sees no effect
                seq.busy = False
                if not task.cancelled() and task.exception() is None and not seq.closed:
                    undo(seq, task.result())
                raise

            def _after(t: asyncio.Task) -> None:
                seq.busy = False
                if not t.cancelled() and t.exception() is None and not seq.closed:
                    undo(seq, t.result())
            task.add_done_callback(_after)
            raise
        except BaseException:
            seq.busy = False
            raise
        seq.busy = False

    def _spawn(self, coro: Coroutine) -> asyncio.Task:
        return self._track(self._loop.create_task(coro))

    def _track(self, task: asyncio.Task) -> asyncio.Task:
        """Count ``task`` among the store's (close and drain wait for them)."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- extend ------------------------------------------------------------------------------
    def _extend_counts(self, n: int) -> dict[int, int]:
        counts = {g: n * k for g, k in self.lcs_per_gpu_group.items()}
        for g, c in counts.items():
            cap = self.core.capacity(GPU, g)
            if c > cap:
                raise UsageError(f"extending by {n} blocks needs {c} pages of GPU pool group {g}, which holds {cap}")
        return counts

    def _extend_now(self, seq: Sequence, n: int) -> list | None:
        """The common case, without a task: every GPU group has the free
        slots. Returns the fences to wait for, or None to take the slow path.
        (The sequence checked that it and the store are open.)"""
        if n > self.max_extend:
            self._extend_counts(n)              # raises, naming the group
        core = self.core
        fences = core.extend_now(seq.sid, n)
        if fences is None and self.last_tier == GPU and self._drop_for(n):
            fences = core.extend_now(seq.sid, n)
        for per_block, reclaimer in self.gpu_reclaimers:    # wake below the reserve (counting what is still needed)
            reclaimer.kick_after(0 if fences is not None else n * per_block)
        return fences and self.events.all(fences)

    def _drop_for(self, n: int) -> bool:
        """A GPU-only store makes room for ``n`` more blocks by dropping its
        least recent pages, synchronously (a drop waits for nothing): the
        common eviction of such a store without a task. False, with nothing
        dropped, where some group lacks the victims (the slow path reports it)."""
        core = self.core
        short = {g: n * k - core.free(GPU, g) for g, k in self.lcs_per_gpu_group.items()}
        short = {g: k for g, k in short.items() if k > 0}
        if any(core.queue_len(GPU, g) < k for g, k in short.items()):
            return False
        for g, k in short.items():
            victims, _ = core.pick_victims(GPU, g, k, 0)     # no futures: nothing can wait on them
            claims, freed = core.drop_victims(GPU, victims)
            self.claims.settle(claims)
            core.give_back(GPU, g, freed)                    # each with the fence of its last reader
        return True

    async def _extend(self, seq: Sequence, n: int) -> int:
        self._check()
        if n == 0:
            return 0
        slots = await self._obtain_many(GPU, self._extend_counts(n))
        await wait_events(self.events.all(self.core.place_extension(seq.sid, n, slots)))
        return n

    def _undo_extend(self, seq: Sequence, n: int) -> None:
        self.core.undo_extend(seq.sid, n)
        self._sync()

    # -- acquire / release -------------------------------------------------------------------
    async def _acquire(self, seq: Sequence) -> Pages:
        self._check()
        if seq.acquired:
            raise UsageError("sequence is already acquired")
        core = self.core
        while True:       # every await may change pages: re-check until a pass needs none
            holes, claims = core.acquire_scan(seq.sid)
            if holes:
                await self._fill_holes(seq, holes)
                continue
            if claims:
                waits = self.claims.pending(claims)
                if not waits:
                    raise CoreError(f"pages claimed by settled operations {claims}")
                await asyncio.wait(waits)
                for f in waits:
                    exc = None if f.cancelled() else f.exception()
                    if exc is not None and f.to_gpu and not isinstance(exc, CorruptPageError):
                        raise exc
                continue
            pages = core.lock_needed(seq.sid)
            try:
                cold = core.cold_pages(pages)
                if cold:
                    self._claim(cold, GPU)
                    try:
                        slots = await self._obtain_many(GPU, core.group_counts(cold, GPU))
                    except BaseException as exc:
                        self._unclaim(cold, exc)
                        raise
                    await self._move_claimed(cold, GPU, slots, handoff=False)
            except CorruptPageError:
                # The bad pages were dropped (with the rest of their prefix where it is critical): the
                # next pass finds their blocks empty and gives them fresh pages to recompute.
                core.unlock(pages)
                self._sync()
                continue
            except BaseException:
                core.unlock(pages)
                self._sync()
                raise
            break
        core.finish_acquire(seq.sid, pages)
        return pages

    def _prefetch(self, seq: Sequence) -> asyncio.Task | None:
        """Start promoting the cold pages the next acquire needs, unlocked.
        A failure only logs: the acquire that follows does the work itself."""
        self._check()
        pages = self.core.prefetch_pages(seq.sid)
        if not pages:
            return None
        self._claim(pages, GPU, propagate=False)

        async def promote() -> None:
            try:
                slots = await self._obtain_many(GPU, self.core.group_counts(pages, GPU))
            except BaseException as exc:
                self._unclaim(pages, None)
                if not isinstance(exc, (OutOfPagesError, asyncio.CancelledError)):
                    log.warning("prefetch failed: %r", exc)
                return
            try:
                await self._move_claimed(pages, GPU, slots, handoff=False)
            except (OSError, KvtierError) as exc:
                log.warning("prefetch failed: %r", exc)
        return self._spawn(promote())

    async def _fill_holes(self, seq: Sequence, holes: list[int]) -> None:
        """New (empty) GPU pages for needed pages that no tier holds; the
        caller recomputes them (``recompute_blocks``)."""
        counts: dict[int, int] = {}
        gpu_group = self.group_of[GPU]
        for lc in holes[1::2]:
            g = gpu_group[lc]
            counts[g] = counts.get(g, 0) + 1
        slots = await self._obtain_many(GPU, counts)
        await wait_events(self.events.all(self.core.fill_holes(seq.sid, holes, slots)))

    def _undo_acquire(self, seq: Sequence, pages: Pages) -> None:
        self.core.undo_acquire(seq.sid, pages)
        self._sync()

    def _release(self, seq: Sequence, stream=None) -> None:
        """Unlock exactly the pages this sequence locked (others may share them), fenced by
        the caller's stream (the Sequence releases unfenced itself when there is none)."""
        if seq.closed:                              # its id may be another sequence's now
            return
        if not seq.acquired:
            return
        ev = stream_event(self._caller_stream(stream))
        self.core.release(seq.sid, self.events.id(ev))

    def _caller_stream(self, stream):
        """The stream a caller's kernels use: the one given, else (on CUDA)
        the current one, so pages are fenced by the caller's work either way."""
        if stream is None and self.device.is_cuda:
            return torch.cuda.current_stream(self.device.torch_device)
        return stream

    def _stream_wait(self, seq: Sequence, stream) -> None:
        stream = self._caller_stream(stream)
        if stream is None:
            return
        for ev in self.events.all(self.core.ready_events(seq.sid)):
            if isinstance(ev, CudaEvent):
                stream.wait_event(ev._event)

    # -- commit / close ------------------------------------------------------------------------
    def _commit_refused(self, seq: Sequence, n: int, code: int) -> None:
        """The UsageError for a commit the core refused (``code``: its answer; nothing changed)."""
        if code >= 0:
            raise UsageError(f"block key {seq.keys[code]!r} at position {code} is already indexed at "
                             "another position")
        if code == COMMIT_PAST_BLOCKS:
            raise UsageError(f"cannot commit {n} blocks: only {self.core.num_blocks(seq.sid)} have pages")
        raise UsageError(f"cannot commit {n} blocks: only {len(seq.keys)} have keys (append the tokens first)")

    def _close_sequence(self, seq: Sequence) -> None:
        if self.cuda:
            self._release(seq)          # the caller's current stream fences what it locked
        seq.final_committed = self.core.close(seq.sid)      # (it releases what is still locked, unfenced)
        seq.closed = True
        if self.disk is not None:
            self._sync()

    def _drop(self, page) -> None:
        """Drop a published page (a ``PageView``) as the last tier's eviction
        would, its subtree too when it is prefix-critical (tests and tools)."""
        self.core.drop_page(page.id)
        self._sync()

    # -- what the core asks of the disk ---------------------------------------------------------
    def _sync(self) -> None:
        """Submit the disk frees and relabels the core decided on, in order
        with the writes that may reuse those slots (before anything awaits)."""
        if self.disk is None:
            return
        core = self.core
        for g, slots in core.take_disk_frees():
            self._disk_free(g, slots)
        for g, slots, pages in core.take_relabels():
            records = self.records(pages)
            self.engine.io_write.submit(lambda g=g, slots=slots, records=records:
                                        self.disk.relabel(g, slots, records, durable=False), event=False)

    def _disk_free(self, group: int, slots: list[int]) -> None:
        """Forget disk slots, in order with the other work of the write stream. Frees gather
        into one job: a free joins the last free job while that job has not started and
        nothing else was submitted to the stream after it (a relabel or a write queued since
        must keep running before the frees made after it). So the disk thread takes the GIL
        once for many frees, each time a wait behind a busy loop."""
        stream = self.engine.io_write
        batch = self._free_batch
        if batch is not None and stream.queued == batch.mark and batch.join(group, slots):
            return
        batch = _FreeBatch(group, slots)
        stream.submit(lambda: self._apply_disk_frees(batch), event=False)
        batch.mark = stream.queued
        self._free_batch = batch

    def _apply_disk_frees(self, batch: "_FreeBatch") -> None:
        """On the disk write thread: one batch of frees (see _disk_free), one ``DiskTier.free``
        per group (each call's checks cost more than its slots: 1,100 calls of 100 us a replay).
        A call that fails has changed nothing; its frees then go one by one, as before."""
        per_group: dict[int, list[list[int]]] = {}
        for group, slots in batch.take():
            per_group.setdefault(group, []).append(slots)
        for group, parts in per_group.items():
            if len(parts) > 1:
                try:
                    self.disk.free(group, [s for part in parts for s in part])
                    continue
                except Exception as exc:    # noqa: BLE001 - the parts alone say which one is wrong
                    log.debug("merged disk free of group %d failed (%r): freeing its %d parts one by one",
                              group, exc, len(parts))
            for slots in parts:
                try:
                    self.disk.free(group, slots)
                except Exception as exc:    # noqa: BLE001 - as a job of its own would: logged, the rest go on
                    log.warning("%s: background job failed: %r", self.engine.io_write.name, exc)

    def records(self, pages: Pages) -> np.ndarray:
        """The disk journal records of ``pages`` (anonymous for uncommitted ones), one array."""
        return np.frombuffer(self.core.disk_records(pages), dtype=RECORD)

    # -- claims, eviction and moves ------------------------------------------------------------
    def _claim(self, pages: Pages, to_tier: int, propagate: bool = True) -> None:
        """Mark pages as moving: one claim per batch the move will run
        (source tier and group, destination group); waiters on a promotion
        get its error when ``propagate``."""
        self.claims.open(self.core.claim(pages, to_tier, False), to_tier == GPU and propagate)

    def _unclaim(self, pages: Pages, exc: BaseException | None) -> None:
        self.claims.settle(self.core.unclaim(pages), exc)
        self._sync()

    async def _obtain_many(self, tier: int, counts) -> dict[int, list[int]]:
        """Slots in several groups of one tier, all or none; ``counts`` is a
        {group: n} dict or (group, n) pairs."""
        got: dict[int, list[int]] = {}
        items = counts.items() if isinstance(counts, dict) else counts
        try:
            for g, n in sorted(items):      # one order for every caller: no two wait on each other's line
                got[g] = await self._obtain(tier, g, n)
        except BaseException:
            for g, slots in got.items():
                self.core.give_back(tier, g, slots)
            raise
        return got

    async def _obtain(self, tier: int, group: int, n: int) -> list[int]:
        """``n`` free slots, evicting (and cascading) as needed.

        A request that finds enough slots free takes them at once (as the Sequence's fast
        paths do). Requests short of slots wait in line, first come first served: only the
        head evicts, for itself and, in the same batch, for some of the demand behind it.
        Without the line, concurrent requests each took what was free (none got enough), each
        ran a small eviction of its own and all woke on every landing: at concurrency 32 that
        was 64 k wake-ups and 2.4x the batches of concurrency 1 for the same moves."""
        core = self.core
        reclaimer = self.reclaimers.get((tier, group))
        if reclaimer is not None:
            reclaimer.kick_after(n)
        if n <= core.free(tier, group):
            return core.allocate(tier, group, n)
        key = (tier, group)
        line = self._lines.get(key)
        if line is None:
            line = self._lines[key] = collections.deque()
        me = _InLine(n)
        line.append(me)
        try:
            if len(line) > 1:
                me.turn = self._loop.create_future()
                await me.turn
            return await self._obtain_first(tier, group, n, reclaimer, line)
        finally:
            head = line[0] is me
            line.remove(me)
            if head and line and line[0].turn is not None and not line[0].turn.done():
                line[0].turn.set_result(None)

    async def _obtain_first(self, tier: int, group: int, n: int, reclaimer: Reclaimer | None,
                            line: collections.deque[_InLine]) -> list[int]:
        """_obtain for the head of the line."""
        core = self.core
        key = (tier, group)
        got = core.allocate(tier, group, min(n, core.free(tier, group)))
        landings = 0
        try:
            while len(got) < n:
                short = n - len(got)
                if self.refilling.get(key, 0) >= short and landings < REFILL_WAITS:
                    # demotions in flight will give back enough: wait for them rather than run a
                    # small batch of our own (a few times: requests that find slots free take
                    # them too, so landed slots may go elsewhere; then it evicts its own)
                    await self._refill_landed(key)
                    landings += 1
                else:
                    # evicting on demand: for the requests behind in line too, and to refill the
                    # background reserve, less what demotions in flight will give back. The
                    # extra is capped (_line_batch): a batch larger than the next tier can make
                    # room for would skip that tier whole, dropping newer pages where a smaller
                    # batch would have pushed out the next tier's oldest
                    behind = sum(w.need for w in line) - n
                    extra = min(max(0, behind + (reclaimer.high if reclaimer is not None and reclaimer.running else 0)
                                    - self.refilling.get(key, 0)), self._line_batch[tier])
                    # pages the background demotion or a write-through copy has claimed are not
                    # evictable, but they are again when it finishes: wait for that rather than fail
                    wt = self.write_through if tier != DISK else None
                    busy = reclaimer.idle if reclaimer is not None and reclaimer.busy else \
                        wt.idle if wt is not None and not wt.idle.is_set() else None
                    victims = self._pick_victims(tier, group, short, extra, raise_=busy is None)
                    if victims is None:
                        await busy.wait()
                    else:
                        spare = len(victims) - short
                        self.refilling_add(key, spare)
                        try:
                            freed = await self._evict(tier, victims)
                            if len(freed) > short:      # back to the pool, each with the fence of its last reader
                                core.give_back(tier, group, freed[short:])
                        finally:
                            self.refilling_add(key, -spare)
                        return got + freed[:short]
                got += core.allocate(tier, group, min(core.free(tier, group), n - len(got)))
            return got
        except BaseException:
            core.give_back(tier, group, got)
            raise

    def refilling_add(self, key: tuple[int, int], n: int) -> None:
        """Count ``n`` more (or, negative, fewer) slots that demotions in flight will give back
        to (tier, group)'s pool; when it falls, wake the requests waiting for them."""
        if not n:
            return
        self.refilling[key] = self.refilling.get(key, 0) + n
        if n < 0:
            fut = self._refill_waiters.pop(key, None)
            if fut is not None and not fut.done():
                fut.set_result(None)

    async def _refill_landed(self, key: tuple[int, int]) -> None:
        """Wait until a demotion in flight for (tier, group) lands (or fails)."""
        fut = self._refill_waiters.get(key)
        if fut is None or fut.done():
            fut = self._refill_waiters[key] = self._loop.create_future()
        await asyncio.shield(fut)       # a cancelled waiter leaves the others' future alone

    def _pick_victims(self, tier: int, group: int, need: int, extra: int = 0, raise_: bool = True) -> Pages | None:
        """Claim ``need`` victims plus up to ``extra`` more if the queue has
        them; if fewer than ``need`` are evictable, nothing is claimed and
        OutOfPagesError is raised (None without ``raise_``).

        A demotion in a group with a background reserve takes at least one refill step
        (within the line batch) where the queue has it: each batch costs the loop fixed
        work and thread hand-offs, and at concurrency 32 demand evictions of a few pages
        each had made 1.5x the batches of concurrency 1. The pages demoted early live on
        in the next tier; their slots wait free, as the reserve's do."""
        core = self.core
        reclaimer = self.reclaimers.get((tier, group))
        if reclaimer is not None and reclaimer.running and self.next_tier[tier] is not None:
            extra = max(extra, min(reclaimer.step, self._line_batch[tier]) - need)
        picked = core.pick_victims(tier, group, need, extra)
        if picked is None:
            if not raise_:
                return None
            raise OutOfPagesError(f"{TIER_NAMES[tier]} pool group {group}: need {need} more slots, "
                                  f"{core.free(tier, group)} free of {core.capacity(tier, group)} "
                                  f"and only {core.queue_len(tier, group)} evictable")
        victims, claims = picked
        self.claims.open(claims, False)
        return victims

    async def _evict(self, tier: int, victims: Pages) -> list[int]:
        """Demote (or, in the last tier, drop) claimed victims; their slots go to the caller.
        Under write-through, victims bound for the disk that have a clean copy there take over
        their copy's slot: no bytes move."""
        if self.write_through is None or self.next_tier[tier] != DISK:
            return await self._evict_claimed(tier, victims)
        group = self.core.page_info(victims.slice(0, 1).tolist()[0])["group"] if victims else 0
        claims, handed, victims = self.core.swap_to_copies(victims)
        self.claims.settle(claims)
        self._sync()
        if not victims:
            return handed
        try:
            return handed + await self._evict_claimed(tier, victims)
        except BaseException:
            self.core.give_back(tier, group, handed)    # the moved victims' slots: nobody takes them now
            raise

    async def _evict_claimed(self, tier: int, victims: Pages) -> list[int]:
        nxt = self.next_tier[tier]
        while nxt is not None:
            try:
                slots = await self._obtain_many(nxt, self.core.group_counts(victims, nxt))
            except OutOfPagesError:
                # the next tier is full of locked, held or in-flight pages: skip to a colder one
                # (cold groups are the same in host and disk); drop only when none can take them
                nxt = self.next_tier[nxt]
                if nxt is None and not self.core.droppable(victims):
                    self._unclaim(victims, None)
                    raise
            except BaseException:
                self._unclaim(victims, None)
                raise
            else:
                try:
                    return await self._move_claimed(victims, nxt, slots, handoff=True)
                except DiskFullError as exc:
                    # the filesystem takes no more: the disk keeps what it has, and victims that are
                    # only cached copies are dropped instead of spilled (a later spill retries)
                    if nxt != DISK or not self.core.droppable(victims):
                        raise
                    self._disk_full(exc, len(victims))
                    # the failed move ended their claims: claim them again, so that the drop below
                    # frees each slot once (a subtree drop must not free a victim's slot under it)
                    self._claim(victims, DISK)
                break
        if self.remote is not None and self.remote.settings.write == "back" and tier != GPU:
            try:
                await self.remote.write_back(victims)   # to the server before the drop (still claimed)
            except BaseException:
                self._unclaim(victims, None)
                raise
        claims, freed = self.core.drop_victims(tier, victims)
        self.claims.settle(claims)
        self._sync()
        return freed

    def _behind_failed(self, exc: BaseException, batch: Batch) -> None:
        """A spill written behind failed after its pages landed (migration._spill_behind): the
        disk tier forgot their slots; the pages are dropped (a miss from now on, as after a
        refused spill), but for any a read has claimed meanwhile, which that read drops."""
        if self.closed:
            return                      # closing waited for the writes: nothing is served any more
        self.core.discard_unwritten(batch.pages, batch.ready_id)
        self._sync()
        if isinstance(exc, DiskFullError):
            self._disk_full(exc, len(batch))
            return
        self.behind_failures += 1
        if self._once_a_minute("write behind failed"):
            log.warning("a disk write of %d spilled page(s) failed after they landed: %r; they are dropped "
                        "(%d such write(s) so far)", len(batch), exc, self.behind_failures)

    def _once_a_minute(self, kind: str) -> bool:
        """Whether a warning of ``kind`` may be logged now (at most once a minute each)."""
        now = self._loop.time()
        if now - self._said.get(kind, float("-inf")) < 60.0:
            return False
        self._said[kind] = now
        return True

    def _disk_full(self, exc: DiskFullError, dropped: int) -> None:
        """Count a spill the full filesystem refused, and say so (once a minute at most)."""
        self.disk_full_events += 1
        self.disk_full_dropped += dropped
        if self._once_a_minute("disk full"):
            log.warning("disk tier is full (%s): evicted pages are dropped instead of spilled until it has "
                        "room again; %d spill(s) refused so far", exc, self.disk_full_events)

    async def _move_claimed(self, pages: Pages, dst_tier: int, slots: dict[int, list[int]],
                            handoff: bool) -> list[int]:
        """Move claimed pages into ``slots`` (per destination group). Batches
        run concurrently, one per (source tier, source group, destination
        group). With ``handoff`` the source slots are returned to the caller
        instead of freed. On failure every batch's claims are settled and the
        first error is raised (after the others finish)."""
        batches = self.core.split_batches(pages, dst_tier)
        if len(batches) == 1:           # the common case, one batch: no task, no gather
            _, _, g, batch = batches[0]
            return await self._move_batch(batch, dst_tier, g, sorted(slots[g][:len(batch)]), handoff)
        jobs = []
        for _, _, g, batch in batches:
            mine = sorted(slots[g][:len(batch)])
            del slots[g][:len(batch)]
            jobs.append(self._spawn(self._move_batch(batch, dst_tier, g, mine, handoff)))
        results = await asyncio.gather(*jobs, return_exceptions=True)
        freed, error = [], None
        for r in results:
            if isinstance(r, BaseException):
                error = error or r
            else:
                freed.extend(r)
        if error is not None:
            if handoff and freed:     # source slots of the batches that did move: nobody takes them now
                src_tier, src_group = batches[0][0], batches[0][1]
                self.core.give_back(src_tier, src_group, freed)
            raise error
        return freed

    async def _move_batch(self, batch: Pages, dst_tier: int, g: int, dst_slots: list[int],
                          handoff: bool) -> list[int]:
        core = self.core
        src_tier, src_group, src_slots, lcs, ready = core.batch_view(batch)
        fences = self.events.all(core.slot_fences(dst_tier, g, dst_slots))
        self._sync()
        job = Batch(src_tier, src_group, src_slots, lcs, set(self.events.all(ready)), lambda: self.records(batch))
        # a spill of pages the store may lose is written behind (migration._spill_behind); not with
        # a remote tier, whose write-back reads disk victims before their drop
        job.behind = src_tier == HOST and dst_tier == DISK and self.remote is None and core.droppable(batch)
        reserved = 0
        if self.remote is not None and self.remote.settings.write == "through" and src_tier == GPU:
            # leaving the GPU: write-through to the remote tier
            nbytes = len(src_slots) * self.engine.cold_bytes[g]
            if self.remote.reserve(nbytes):
                reserved = nbytes
                records = self.records(batch)           # now: the claim keeps these pages as they are

                def tee(rows: torch.Tensor) -> None:
                    nonlocal reserved
                    reserved = 0                # write_through owns the reservation from here, and releases it
                    try:
                        self.remote.write_through(records, rows, nbytes)
                    except Exception:           # noqa: BLE001 - it never got to its own release
                        self.remote.release(nbytes)
                        raise
                job.tee = tee
            else:
                self.remote.skipped_pages += len(src_slots)
        try:
            ev = await self.engine.run(job, dst_tier, g, dst_slots, fences)
        except BaseException as exc:
            if reserved:
                self.remote.release(reserved)
                reserved = 0
            self.engine.stats.failures[f"{TIER_NAMES[src_tier]}->{TIER_NAMES[dst_tier]}"] += 1
            core.give_back(dst_tier, g, dst_slots)
            self._unclaim(batch, exc)
            if isinstance(exc, CorruptPageError):
                depths = core.discard_corrupt(batch, list(getattr(exc, "slots", ())))
                self.corrupt_pages += len(depths)
                log.warning("dropped %d corrupt disk page(s) at depths %s: their blocks will be recomputed",
                            len(depths), sorted(depths)[:16])
                self._sync()
            raise
        if reserved:                            # the tee never ran (its copy failed): nothing to write
            self.remote.release(reserved)
            self.remote.skipped_pages += len(src_slots)
        ready = self.events.id(ev, keep=job.released)     # a write behind may have failed already
        if job.released:
            job.pages, job.ready_id = batch, ready
        claims, freed = core.land(batch, dst_tier, g, dst_slots, ready, handoff, 0 if job.released else None)
        self.claims.settle(claims)
        self._sync()
        return freed

    # -- stats ------------------------------------------------------------------------------------
    def stats(self) -> dict:
        self._check()
        core = self.core
        counters = core.counters()
        states = core.state_counts()
        tiers = {}
        hits = dict(zip(TIER_NAMES, counters["hits"]))
        for t in self.tier_ids:
            groups = []
            for g in range(core.n_groups(t)):
                locked, held, droppable = states[t][g]
                groups.append({
                    "index": g, "slots": core.capacity(t, g), "free": core.free(t, g), "used": core.used(t, g),
                    "evictable": core.queue_len(t, g), "locked": locked, "held": held, "droppable": droppable,
                    "slot_bytes": (self.slabs[t][g].spec.slot_bytes if t < DISK else self.engine.cold_bytes[g]),
                })
            tiers[TIER_NAMES[t]] = {"groups": groups, "hits": hits[TIER_NAMES[t]]}
        out = {
            "tiers": tiers,
            "hits": hits,
            "lookup_blocks": counters["lookup_blocks"],
            "indexed_blocks": core.indexed_blocks(),
            "moves": self.engine.stats.as_dict(),
            "drops": counters["drops"],
            "recovered_pages": counters["recovered"],
            "orphaned_pages": counters["orphaned"],
            "discarded_pages": counters["discarded"] + (len(self.disk.discarded) if self.disk is not None else 0),
            "corrupt_pages": self.corrupt_pages,
            "disk_full": {"refused_spills": self.disk_full_events, "dropped_pages": self.disk_full_dropped},
            "write_through": self.write_through.stats() if self.write_through is not None else write_through_off(),
            "core": {"live_pages": core.live_pages(), "live_blocks": core.live_blocks(),
                     "memory_bytes": core.memory_bytes()},
        }
        if self.disk is not None:
            out["disk"] = dict(self.disk.stats)
        if self.kv_events is not None:
            out["events"] = self.kv_events.stats()
        if self.remote is not None:
            out["remote"] = self.remote.stats()
            out["lookup_blocks"] -= self._recounted[0]
            for t, name in enumerate(TIER_NAMES):
                out["hits"][name] -= self._recounted[1 + t]
                if name in out["tiers"]:
                    out["tiers"][name]["hits"] = out["hits"][name]
            out["hits"]["remote"] = self.remote.imported_blocks
        return out

    # -- KV events (runtime/events.py) ------------------------------------------------------
    def take_events(self) -> list[list]:
        """KV event batches ``[ts, events, dp_rank]`` made since the last call,
        oldest first (with an ``[events] endpoint`` they are buffered from the
        first call on). Needs ``[events]`` in the config. After close it still
        returns the last batches (persisting's moves)."""
        if not self.started:
            self._check()
        return self._kv().take()

    def event_batches(self):
        """``async for batch in store.event_batches()``: batches as they are made,
        until the store closes. One reader: two iterators would share the batches."""
        self._check()
        return self._kv().batches()

    def _kv(self) -> KvEvents:
        if self.kv_events is None:
            raise UsageError("KV events are off: add [events] to the config (StoreConfig(events=EventsConfig()))")
        return self.kv_events

    async def drain(self) -> None:
        """Wait until no move, eviction or background demotion is in flight,
        and (write-through) every page that can be copied to disk now is."""
        def background() -> bool:       # a stopped reclaimer (the store closed) runs nothing, woken or not
            return any(r.busy or (r.wake.is_set() and r.task is not None) for r in self.reclaimers.values())

        while True:
            while self._tasks or background() or self.engine.behind:
                await self._wait_tasks()
                await self._behind_written()
                await asyncio.sleep(0.001)
            if self.write_through is None or self.closed:
                return
            # a pass of our own (or the running one, then ours): it ends when nothing it can copy is left
            running = self.write_through.flush_pass()
            await asyncio.wait([running])
            await asyncio.wait([self.write_through.flush_pass()])
            if not self._tasks and not background():
                return

    async def _behind_written(self) -> None:
        """Wait until no spill written behind is in flight (each written or failed)."""
        while self.engine.behind:
            await ended(next(iter(self.engine.behind)), self._loop)
            await asyncio.sleep(0)      # its _behind_done (scheduled before the waiter woke) ran

    async def _wait_tasks(self) -> None:
        """Wait for the store's tasks to end. ``asyncio.wait``, not ``gather``:
        a waiter that is cancelled must not cancel the moves it waits for."""
        if self._tasks:
            await asyncio.wait(list(self._tasks))

    def check_consistency(self) -> None:
        """Assert the bookkeeping invariants (tests and ``kvtier stress`` call it)."""
        try:
            self.core.check()
        except CoreError as exc:
            raise AssertionError(str(exc)) from None


def stream_event(stream) -> CudaEvent | None:
    """An event recorded on a caller's CUDA stream (None for no stream)."""
    return None if stream is None else CudaEvent.on(stream)

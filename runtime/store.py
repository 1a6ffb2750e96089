"""The Store: the asyncio side of kvtier's control plane, and its request API.

The page table, prefix index, slot allocators, LRU queues and every decision
over them live in the native core (``runtime.core``), called once per request
operation or migration batch. This module keeps the store's life (start, close,
drain), ``open_sequence``, queries and stats. A sequence's operations (extend,
acquire, prefetch, commit, release, close) and the cancellation that leaks
nothing are ``runtime/sequence.py``'s. What moves pages - claims, slots obtained
with eviction, the demotion cascade, batch moves through the migration engine,
the disk work the core asks for - is ``runtime/moves.py``, reached as
``store.moves`` by sequences, background demotion, recovery, write-through and
the remote tier.

Rules the code keeps:
- after every core call that can free disk slots or publish disk pages,
  ``moves.sync`` submits them before anything awaits;
- a claimed page (in flight) is awaited through its claim's future; the
  operation that claimed it settles that future when it lands or fails.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Sequence as Seq

import numpy as np

from tiers.config import StoreConfig
from tiers.device import Device, host_available_bytes
from tiers.errors import StoreClosedError, UsageError
from tiers.grouping import Layout
from tiers.native import keep_gil_below
from tiers.pools import SlabPool
from tiers.policy import ReusePolicy

from .core import Core, CoreError
from .events import KvEvents
from .handles import ClaimTable, EventTable
from .keys import BlockKey, check_block_keys, hash_blocks, token_array_async
from .loop import short_switch_interval
from .moves import Moves
from .migration import MigrationEngine
from .pages import DISK, GPU, HOST, TIER_NAMES
from .reclaim import DISK_SHARE, MAX_BATCH, REFILL_BYTES, STEP_SHARE, Reclaimer
from .recovery import index_recovered, persist
from .scrub import Scrubber
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
        self.reclaimers: dict[tuple[int, int], Reclaimer] = {}
        self.core: Core | None = None
        self.loop: asyncio.AbstractEventLoop | None = None      # the loop the store started on
        self._loop_thread = -1                                  # and its thread (threading.get_ident)
        self.device: Device | None = None
        self.cuda = False                   # the GPU tier is a CUDA device (else emulated in host memory)
        self.disk = None
        self.scrubber: Scrubber | None = None   # the disk tier's scrubs (runtime/scrub.py)
        self.engine: MigrationEngine | None = None
        self.nodes = IndexView(self)
        self.moves = Moves(self)            # claims, slots, evictions and moves, and the store's tasks
        self._starting: asyncio.Future | None = None
        self._closing: asyncio.Future | None = None
        self.kv_events = KvEvents(self, cfg.events) if cfg.events is not None else None
        self.remote = RemoteLink(self, cfg.remote) if cfg.remote is not None else None
        # clean copies, per cold tier that writes through (the disk's first: it is closed first)
        self.write_throughs = {t: WriteThrough(self, c, t) for t, c in ((DISK, cfg.disk), (HOST, cfg.host))
                               if c is not None and c.write == "through"}
        self._recounted = [0, 0, 0, 0]     # lookups and hits of first opens that a remote import re-matched
        self._recounted_pages: list[list[int]] = []     # and their hit_pages, [tier][group] (made in _build)

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
        loop = self.loop = self.claims.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        keep_gil_below(LOOP_KEEPS_GIL_BELOW)     # this (the loop's) thread: small inline copies keep the GIL
        with short_switch_interval():           # the loop keeps its turn while a worker replays the journal
            await loop.run_in_executor(None, self._build)
            self.engine.attach(loop)
            self.engine.on_behind_failure = self.moves.behind_failed
            if DISK in self.write_throughs:
                self.engine.staged = None       # a promoted page's disk copy must be written when it lands
            if self.kv_events is not None:
                self.kv_events.start()          # AllBlocksCleared, then what recovery finds
            if self.disk is not None:
                await index_recovered(self)     # the core is rebuilt off the loop: nothing may use it meanwhile
        for tier, wt in self.write_throughs.items():
            self.core.set_write_through(tier, True)     # from here on every page published above it is queued
            wt.start()
            self._warn_small_write_through(tier)
        if self.remote is not None:
            await self.remote.open()            # an unreachable server is a tier with its circuit open
        self._start_reclaimers()
        if self.kv_events is not None:
            self.kv_events.run()
        self.started = True
        if self.scrubber is not None and self.cfg.disk.scrub == "on_open":
            self.scrubber.start()

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
                    low = min(2 * self.moves.line_batch[self.tier_ids[-2]], cap // 8)
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
            self.scrubber = Scrubber(self, d.scrub_rate)
        self.slabs = [gpu, host]
        capacity = [[p.slots for p in gpu], [p.slots for p in host],
                    list(n["disk"]) if cfg.disk is not None else []]
        lcs = [(lc.kind == "ssm", lc.window_tokens or 0, lc.sink_tokens, _REUSE_CODE[lc.reuse]) for lc in self.lcs]
        group_of = [[g if capacity[t] else -1 for g in row] for t, row in enumerate(self.group_of)]
        self.core = Core(self.tpb, lcs, group_of, capacity, prefault_pages=CORE_PREFAULT_PAGES)
        self._recounted_pages = [[0] * len(row) for row in capacity]
        for t in self.tier_ids:
            # a demotion batch beyond a request's own need (the reserve's, the line's) is at most a
            # quarter of the next tier's smallest group (MAX_BATCH at most), so that the next tier
            # can make room for it from its own evictable pages
            nxt = self.next_tier[t]
            self.moves.line_batch[t] = MAX_BATCH if nxt is None else \
                min([MAX_BATCH] + [max(1, c // 4) for c in capacity[nxt]])
        self.max_extend = min(capacity[GPU][g] // k for g, k in self.lcs_per_gpu_group.items())
        self.engine = MigrationEngine(self.device, self.lcs, gpu, host, self.disk, cold_bytes)

    @property
    def closing(self) -> bool:
        """A close has begun (or ended): the store takes no new sequences."""
        return self._closing is not None

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
        if self.scrubber is not None:
            await self.scrubber.stop()                  # its piece's read ends, its claim with it
        for r in getattr(self, "reclaimers", {}).values():
            await r.stop()
        for wt in self.write_throughs.values():
            await wt.stop()                     # its batch in flight lands; persisting covers the rest
        await self.moves.wait_tasks()
        if self.started and self.disk is not None and self.cfg.persist_on_close:
            try:
                await persist(self)
            except Exception as exc:   # noqa: BLE001 - closing must finish; the pages stay unpersisted
                log.warning("persisting pages at close failed: %s", exc)
        if self.engine is not None:
            await self.moves.behind_written()        # a write that fails is still handled while the store is open
        if self.remote is not None:
            while self.moves.tasks:             # write-through started by persisting, imports of late opens
                await self.moves.wait_tasks()
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

    def _warn_small_write_through(self, tier: int) -> None:
        """Write-through keeps a copy of every page above the tier in it: a tier no larger than
        the tiers above evicts copies to make copies, and holds fewer distinct pages than
        write-back."""
        core = self.core
        above = sum(core.capacity(t, g) for t in self.tier_ids if t < tier for g in range(core.n_groups(t)))
        own = sum(core.capacity(tier, g) for g in range(core.n_groups(tier)))
        if own <= above:
            name = TIER_NAMES[tier]
            log.warning("%s write = \"through\" with %d %s slots for %d slots above it: the %s cannot hold a "
                        "copy of what is above it, so copies will evict each other (and pages only the %s "
                        "has); give the %s several times the slots above it, or use write = \"back\"",
                        name, own, name, above, name, name, name)

    def _shutdown(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
        if self.engine is not None:
            self.engine.close()
        if self.disk is not None:
            self.disk.close()

    def check_open(self) -> None:
        """Raise unless the store has started and is not closed."""
        if self.closed:
            raise StoreClosedError("store is closed")
        if not self.started:
            raise UsageError("store is not started: use `async with Store.open(cfg)`")

    # -- public queries -------------------------------------------------------------------
    def pool_tensor(self, layer_id: int, role: str):
        """The GPU pool ``[slots, bytes]`` a kernel indexes by ``page_indices``."""
        self.check_open()
        lc = self.lc_of_layer(layer_id)
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

    def lc_of_layer(self, layer_id: int) -> int:
        """The life cycle index of ``layer_id`` (a UsageError names an unknown layer)."""
        try:
            return self.layer_lc[layer_id]
        except (KeyError, TypeError):
            raise UsageError(f"unknown layer id {layer_id!r}") from None

    # -- sequences -------------------------------------------------------------------------
    async def open_sequence(self, tokens: Seq[int] | None = None, block_keys: Seq[BlockKey] | None = None,
                            priority: int | None = None) -> Sequence:
        if self.closed or not self.started or self._closing is not None:
            self.check_open()
            raise StoreClosedError("store is closing")
        if (tokens is None) == (block_keys is None):
            raise UsageError("pass exactly one of tokens= or block_keys=")
        # on the store's thread with its loop running, that loop is the running one: no
        # get_running_loop (a getpid() system call on Python 3.11) per request
        if (threading.get_ident() != self._loop_thread or not self.loop.is_running()) \
                and asyncio.get_running_loop() is not self.loop:
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
                keys = await self.loop.run_in_executor(None, hash_blocks, token_arr, self.tpb, self.cfg.hash_salt)
            self._check_still_open()            # the store may have closed, or begun to, meanwhile
            sid, matched, by_tier, counted = self._open_in_core(keys, priority)
            self._keep_tokens(sid, token_arr, len(keys))
        else:
            token_arr = None
            keys = list(block_keys) if isinstance(block_keys, (list, tuple)) else check_block_keys(block_keys)
            try:
                sid, matched, by_tier, counted = self._open_in_core(keys, priority)     # checks ints and bytes in C++
                failed = False
            except (ValueError, TypeError):
                failed = True
            if failed:
                # numpy ints, bools, mixed kinds...: the Python check names the problem or
                # normalises the keys (nothing changed in the core); outside the handler, so that
                # its UsageError does not carry the core's message as its context
                keys = check_block_keys(block_keys)
                try:
                    sid, matched, by_tier, counted = self._open_in_core(keys, priority)
                except (ValueError, TypeError) as exc:
                    raise UsageError(str(exc)) from None
        remote = None
        if self.remote is not None:
            remote = 0
            if matched < len(keys):
                imported, again = await self._remote_import(sid, keys, matched)
                if again:                       # matched again, over the imported blocks (or another's)
                    core.close(sid)
                    before, after = counted
                    for t, (b, a) in enumerate(zip(before, after)):
                        row = self._recounted_pages[t]
                        for g in range(len(a)):
                            row[g] += a[g] - b[g]
                    self._recounted[0] += len(keys)
                    for t in range(3):
                        self._recounted[1 + t] += by_tier[t]
                    first = matched
                    sid, matched, by_tier = core.open(keys, priority)
                    # the imported blocks this match reached (a window's page the server lacked can
                    # end it early) count as remote hits, not host, and so do their pages
                    reached = imported[:max(0, matched - first)]
                    remote = len(reached)
                    self._recounted[1 + HOST] += remote
                    row = self._recounted_pages[HOST]
                    for pages in reached:
                        for g, n in pages.items():
                            row[g] += n
                    self.remote.count_matched(reached)
                    self._keep_tokens(sid, token_arr, len(keys))
        return Sequence(self, sid, keys, token_arr, priority, matched, by_tier, remote)

    def _open_in_core(self, keys: list, priority: int) -> tuple:
        """``core.open``'s (sid, matched, by_tier) and, with a remote tier, ``hit_pages`` just
        before and after it: the pages this open counted, which a re-match after an import takes
        back out (None without a remote tier)."""
        if self.remote is None:
            return (*self.core.open(keys, priority), None)
        before = self.core.hit_pages()
        sid, matched, by_tier = self.core.open(keys, priority)
        return sid, matched, by_tier, (before, self.core.hit_pages())

    def _keep_tokens(self, sid: int, token_arr: np.ndarray | None, n_keys: int) -> None:
        """KV events: the blocks' tokens, for their BlockStored (a sequence opened with tokens)."""
        if token_arr is not None and self.kv_events is not None:
            self.kv_events.tokens(sid, 0, token_arr[:n_keys * self.tpb])

    async def _remote_import(self, sid: int, keys: list, matched: int) -> tuple[list, bool]:
        """The remote run after sequence ``sid``'s match, imported by a task of the store's
        own: a caller cancelled meanwhile leaves it to finish (its moves and slots settle),
        and the sequence is closed then."""
        task = self.moves.spawn(self.remote.extend_match(sid, keys, matched))
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
            self._check_still_open()        # the store may have closed, or begun to, meanwhile
        except BaseException:
            self.core.close(sid)
            raise
        return out

    def _check_still_open(self) -> None:
        """After an await in ``open_sequence``: a close that began meanwhile refuses the
        sequence too (it would persist and close with the sequence's pages held)."""
        self.check_open()
        if self._closing is not None:
            raise StoreClosedError("store is closing")

    # -- tools ----------------------------------------------------------------------------------
    def _drop(self, page) -> None:
        """Drop a published page (a ``PageView``) as the last tier's eviction
        would, its subtree too when it is prefix-critical (tests and tools)."""
        self.core.drop_page(page.id)
        self.moves.sync()

    # -- stats ------------------------------------------------------------------------------------
    def stats(self) -> dict:
        self.check_open()
        core = self.core
        counters = core.counters()
        states = core.state_counts()
        tiers = {}
        hits = dict(zip(TIER_NAMES, counters["hits"]))
        hit_pages = core.hit_pages()
        for t, row in enumerate(self._recounted_pages):
            for g, n in enumerate(row):
                hit_pages[t][g] -= n
        moves = self.engine.stats
        for t in self.tier_ids:
            groups = []
            for g in range(core.n_groups(t)):
                locked, held, droppable = states[t][g]
                groups.append({
                    "index": g, "slots": core.capacity(t, g), "free": core.free(t, g), "used": core.used(t, g),
                    "evictable": core.queue_len(t, g), "locked": locked, "held": held, "droppable": droppable,
                    "slot_bytes": (self.slabs[t][g].spec.slot_bytes if t < DISK else self.engine.cold_bytes[g]),
                    "hit_pages": hit_pages[t][g], **moves.of_group(TIER_NAMES[t], g),
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
            "corrupt_pages": self.moves.corrupt_pages,
            "disk_full": {"refused_spills": self.moves.disk_full_events, "dropped_pages": self.moves.disk_full_dropped},
            "write_through": self.write_throughs[DISK].stats() if DISK in self.write_throughs else write_through_off(),
            "host_write_through": self.write_throughs[HOST].stats() if HOST in self.write_throughs
            else write_through_off(),
            "core": {"live_pages": core.live_pages(), "live_blocks": core.live_blocks(),
                     "memory_bytes": core.memory_bytes()},
        }
        if self.disk is not None:
            out["disk"] = dict(self.disk.stats)
            out["scrub"] = self.scrubber.stats()
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
        else:
            out["hits"]["remote"] = 0       # the same keys with or without a remote tier
        return out

    # -- KV events (runtime/events.py) ------------------------------------------------------
    def take_events(self) -> list[list]:
        """KV event batches ``[ts, events, dp_rank]`` made since the last call,
        oldest first (with an ``[events] endpoint`` they are buffered from the
        first call on). Needs ``[events]`` in the config. After close it still
        returns the last batches (persisting's moves)."""
        if not self.started:
            self.check_open()
        return self._kv().take()

    def event_batches(self):
        """``async for batch in store.event_batches()``: batches as they are made,
        until the store closes. One reader: two iterators would share the batches."""
        self.check_open()
        return self._kv().batches()

    def _kv(self) -> KvEvents:
        if self.kv_events is None:
            raise UsageError("KV events are off: add [events] to the config (StoreConfig(events=EventsConfig()))")
        return self.kv_events

    async def scrub(self) -> dict:
        """Check every disk page's checksum now, in the background of requests (at most
        ``tiers.disk.scrub_rate`` bytes a second), and drop the bad ones from the index, as a read
        that found them would (runtime/scrub.py). Joins a pass already running. Returns the pass's
        ``checked_pages``, ``discarded_pages``, ``seconds`` and ``error`` (None, or what stopped it)."""
        self.check_open()
        if self.scrubber is None:
            raise UsageError("scrub: this store has no disk tier")
        if self._closing is not None:
            raise StoreClosedError("store is closing: no scrub")
        return await asyncio.shield(self.scrubber.start())

    async def drain(self) -> None:
        """Wait until no move, eviction or background demotion is in flight,
        and (write-through) every page that can be copied down now is."""
        def background() -> bool:       # a stopped reclaimer (the store closed) runs nothing, woken or not
            return any(r.busy or (r.wake.is_set() and r.task is not None) for r in self.reclaimers.values())

        while True:
            while self.moves.tasks or background() or self.engine.behind:
                await self.moves.wait_tasks()
                await self.moves.behind_written()
                await asyncio.sleep(0.001)
            if not self.write_throughs or self.closed:
                return
            # a pass of our own (or the running one, then ours): it ends when nothing it can copy is left
            for wt in self.write_throughs.values():
                running = wt.flush_pass()
                await asyncio.wait([running])
                await asyncio.wait([wt.flush_pass()])
            if not self.moves.tasks and not background():
                return

    def check_consistency(self) -> None:
        """Assert the bookkeeping invariants (tests and ``kvtier stress`` call it) at rest:
        after ``drain()``, as a move in flight holds slots no page owns yet."""
        try:
            self.core.check()
        except CoreError as exc:
            raise AssertionError(str(exc)) from None


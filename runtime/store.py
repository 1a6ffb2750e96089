"""The Store: pages of every tier, the prefix index, eviction and the
claims that keep concurrent moves consistent. All bookkeeping runs on the
event loop (no locks needed); bytes move on streams (runtime.migration).

Invariants the code keeps:
- every live page is owned by exactly one slot of one tier (``owners``);
- a page with ``moving`` set is claimed by one in-flight operation and is in
  no eviction queue; its waiters await that future (one move per page);
- a queue holds exactly the pages that may be evicted from its (tier, group):
  unlocked, not moving, and in the last tier also published and unheld;
- every prefix-critical page of an indexed block is present (dropping one
  drops the block's subtree), so matching only checks the other pages.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import operator
from typing import Any, Awaitable, Callable, Sequence as Seq

import torch

from tiers.config import StoreConfig
from tiers.device import Device
from tiers.errors import CorruptPageError, KvtierError, OutOfPagesError, StoreClosedError, UsageError
from tiers.grouping import Layout
from tiers.pools import SlabPool
from tiers.policy import ReusePolicy
from tiers.slots import SlotAllocator
from tiers.streams import CudaEvent

from .eviction import EvictionQueue
from .keys import BlockKey, check_block_keys, check_tokens, hash_blocks
from .migration import MigrationEngine
from .pages import DISK, GPU, TIER_NAMES, Block, Page
from .readiness import wait_events
from .reclaim import Reclaimer
from .recovery import index_recovered, persist
from .sequence import Sequence

log = logging.getLogger("kvtier")
_STAMP = operator.attrgetter("stamp")
_SLOT = operator.attrgetter("slot")


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
        # per tier, the one pool group every life cycle maps to (the common single-group layout), else None
        self.sole_group = [row[0] if len(set(row)) == 1 else None for row in self.group_of]
        self.layer_lc: dict[int, int] = {}
        self.pool_index: dict[tuple[int, str], int] = {}
        for lc in self.lcs:
            for i, (layer, role, _) in enumerate(lc.buffers):
                self.layer_lc[layer] = lc.index
                self.pool_index[(layer, role)] = i
        # every life cycle is full attention: an acquire needs every page (the common case, a fast path)
        self.reads_all = all(lc.kind != "ssm" and lc.window_tokens is None for lc in self.lcs)
        # every life cycle PRIVATE: no page is ever shared, so no block is indexed or matched
        self.private = [lc.reuse is ReusePolicy.PRIVATE for lc in self.lcs]
        self.shares_nothing = all(self.private)
        # windowed/ssm REQUIRED life cycles: the only pages a match must look at
        self.check_lcs = [lc for lc in self.lcs if lc.reuse is ReusePolicy.REQUIRED
                          and (lc.window_tokens is not None or lc.kind == "ssm")]
        self.nodes: dict[BlockKey, Block] = {}
        self.clock = 0
        self.hits = collections.Counter()
        self.lookup_blocks = 0
        self.drops = 0
        self.recovered = 0
        self.discarded = 0
        self.orphaned = 0
        self._tasks: set[asyncio.Task] = set()
        self._relabel_at_unclaim: set[Page] = set()   # published while a claim held them (see _published_cold)
        self.reclaimers: dict[tuple[int, int], Reclaimer] = {}
        self.device: Device | None = None
        self.disk = None
        self.engine: MigrationEngine | None = None

    # -- life of the store ------------------------------------------------------------
    @classmethod
    def open(cls, cfg: StoreConfig) -> "Store":
        """``async with Store.open(cfg) as store`` (or ``store = await Store.open(cfg)``)."""
        return cls(cfg)

    def __await__(self):
        return self._started().__await__()

    async def _started(self) -> "Store":
        await self.start()
        return self

    async def __aenter__(self) -> "Store":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        if self.started:
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._build)
        self.started = True
        if self.disk is not None:
            index_recovered(self)
        for t in self.tier_ids:
            cfg = self.cfg.tier_config(TIER_NAMES[t])
            if t == self.last_tier:
                continue
            for g, alloc in enumerate(self.allocs[t]):
                low = int(alloc.capacity * cfg.reserve)
                if low > 0:
                    r = self.reclaimers[(t, g)] = Reclaimer(self, t, g, low)
                    r.start()

    def _build(self) -> None:
        """Allocate slabs and open the disk tier (blocking: run off the loop)."""
        cfg = self.cfg
        host_cfg = cfg.host
        self.device = Device(cfg.gpu.device, host_cfg.pinned if host_cfg else None)
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
        self.allocs: list[list[SlotAllocator]] = [
            [p.allocator for p in gpu], [p.allocator for p in host],
            [SlotAllocator(s) for s in n["disk"]] if cfg.disk is not None else []]
        self.owners: list[list[list[Page | None]]] = [[[None] * a.capacity for a in t] for t in self.allocs]
        self.queues = [[EvictionQueue() for _ in t] for t in self.allocs]
        self.engine = MigrationEngine(self.device, self.lcs, gpu, host, self.disk, cold_bytes)

    async def close(self) -> None:
        """Wait for in-flight moves, optionally persist, release everything."""
        if self.closed:
            return
        for r in getattr(self, "reclaimers", {}).values():
            await r.stop()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if self.started and self.disk is not None and self.cfg.persist_on_close:
            try:
                await persist(self)
            except Exception as exc:   # noqa: BLE001 - closing must finish; the pages stay unpersisted
                log.warning("persisting pages at close failed: %s", exc)
        self.closed = True
        if self.started:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self._shutdown)

    def _shutdown(self) -> None:
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
        self._check()
        if (tokens is None) == (block_keys is None):
            raise UsageError("pass exactly one of tokens= or block_keys=")
        if priority is None:
            priority = self.cfg.default_priority
        if not isinstance(priority, int) or isinstance(priority, bool) or not 0 <= priority <= 100:
            raise UsageError(f"priority must be an integer in 0..100, got {priority!r}")
        if tokens is not None:
            token_list = check_tokens(tokens)
            keys = hash_blocks(token_list, self.tpb, self.cfg.hash_salt)
        else:
            token_list, keys = None, check_block_keys(block_keys)
        seq = Sequence(self, keys, token_list, priority)
        path = [] if self.shares_nothing else self._match(keys)
        seq.matched_blocks = len(path)
        seq.blocks = list(path)
        by_tier = [0] * (len(TIER_NAMES) + 1)     # blocks by their coldest page's tier; [-1]: no page
        held = []
        last = self.last_tier
        for node in path:
            row = [p if p is not None and not p.dead and p.published else None for p in node.pages]
            seq.pages.append(row)
            coldest = -1
            for p in row:
                if p is not None:
                    p.holders += 1
                    if p.tier == last:
                        self._requeue(p)    # a held page leaves the last tier's drop queue
                    held.append(p)
                    if p.tier > coldest:
                        coldest = p.tier
            by_tier[coldest] += 1
        seq.committed = len(path)
        seq.matched_by_tier = dict(zip(TIER_NAMES, by_tier))
        self.hits.update(seq.matched_by_tier)
        self.lookup_blocks += len(keys)
        self._touch(reversed(held))
        return seq

    def _match(self, keys: Seq[BlockKey]) -> list[Block]:
        path: list[Block] = []
        parent = None
        for i, k in enumerate(keys):
            node = self.nodes.get(k)
            if node is None or node.parent is not parent or node.depth != i:
                break
            path.append(node)
            parent = node
        for k in range(len(path), 0, -1):
            if self._reusable(path, k):
                return path[:k]
        return []

    def _reusable(self, path: list[Block], k: int) -> bool:
        h = k * self.tpb
        for lc in self.check_lcs:
            for b in lc.required_blocks(h, self.tpb):
                p = path[b].pages[lc.index]
                if p is None or p.dead:
                    return False
        return True

    # -- running sequence operations so that cancellation leaks nothing ----------------------
    async def _run_exclusive(self, seq: Sequence, coro: Awaitable, undo: Callable[[Sequence, Any], None]) -> None:
        if seq.busy:
            coro.close()
            raise UsageError("another acquire or extend of this sequence is running")
        seq.busy = True
        task = seq.task = self._spawn(coro)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                seq.busy = False
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

    def _spawn(self, coro: Awaitable) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- extend ------------------------------------------------------------------------------
    def _extend_counts(self, n: int) -> dict[int, int]:
        per_group = collections.Counter()
        for lc in self.lcs:
            per_group[self.group_of[GPU][lc.index]] += n
        for g, c in per_group.items():
            if c > self.allocs[GPU][g].capacity:
                raise UsageError(f"extending by {n} blocks needs {c} pages of GPU pool group {g}, "
                                 f"which holds {self.allocs[GPU][g].capacity}")
        return per_group

    def _extend_now(self, seq: Sequence, n: int) -> list | None:
        """The common case, without a task: every GPU group has the free
        slots. Returns the fences to wait for, or None to take the slow path."""
        self._check()
        counts = self._extend_counts(n)
        allocs = self.allocs[GPU]
        for g, c in counts.items():
            reclaimer = self.reclaimers.get((GPU, g))
            if reclaimer is not None:
                reclaimer.kick_after(c)
        if any(allocs[g].free < c for g, c in counts.items()):
            return None
        return self._place_extension(seq, n, {g: allocs[g].allocate(c) for g, c in counts.items()})

    async def _extend(self, seq: Sequence, n: int) -> int:
        self._check()
        if n == 0:
            return 0
        slots = await self._obtain_many(GPU, self._extend_counts(n))
        await wait_events(self._place_extension(seq, n, slots))
        return n

    def _place_extension(self, seq: Sequence, n: int, slots: dict[int, list[int]]) -> list:
        """Pages for ``n`` new blocks in ``slots`` (per GPU group); returns
        the fences of those slots."""
        start = len(seq.blocks)
        n_lcs = len(self.lcs)
        locks = 1 if seq.acquired else 0
        # stamped as a touch of the new blocks deepest first would (they are in no queue yet)
        stamp = self.clock + n * n_lcs
        self.clock = stamp
        place = self._place_blocks if n_lcs > 1 else self._place_blocks_one_lc
        fences = place(seq, start, n, slots, locks, stamp)
        new = seq.pages[start:]
        if locks:
            seq.locked.extend(p for row in new for p in row)
        else:                                           # oldest stamp first: the queue's cheap path
            self._queue_all([p for row in reversed(new) for p in row])
        return fences

    def _place_blocks(self, seq: Sequence, start: int, n: int, slots: dict[int, list[int]], locks: int,
                      stamp: int) -> list:
        """Blocks ``start..start+n`` of ``seq`` with a GPU page per life
        cycle, stamped down from ``stamp``; returns the slots' fences."""
        n_lcs, keys, priority = len(self.lcs), seq.keys, seq.priority
        gpu_group = self.group_of[GPU]
        owners, gpu_fences = self.owners[GPU], [a.fences for a in self.allocs[GPU]]
        parent = seq.blocks[start - 1] if start else None
        fences = []
        for i in range(start, start + n):
            block = Block(keys[i] if i < len(keys) else None, parent, i, n_lcs)
            row = block.pages
            stamp -= n_lcs
            for lc in range(n_lcs):
                g = gpu_group[lc]
                slot = slots[g].pop()
                fence = gpu_fences[g][slot]
                if fence is not None:
                    fences.append(fence)
                row[lc] = owners[g][slot] = Page(block, lc, GPU, g, slot, priority, 1, locks, stamp + lc + 1)
            seq.blocks.append(block)
            seq.pages.append(list(row))
            parent = block
        return fences

    def _place_blocks_one_lc(self, seq: Sequence, start: int, n: int, slots: dict[int, list[int]], locks: int,
                             stamp: int) -> list:
        """``_place_blocks`` for the common layout, one life cycle, unrolled."""
        keys, priority = seq.keys, seq.priority
        g = self.group_of[GPU][0]
        mine, own, fence_of = slots[g], self.owners[GPU][g], self.allocs[GPU][g].fences
        taken = mine[len(mine) - n:]            # the slots the loop pops, in reverse
        fences = [f for f in map(fence_of.__getitem__, reversed(taken)) if f is not None]
        blocks, rows, n_keys = seq.blocks, seq.pages, len(keys)
        parent = blocks[start - 1] if start else None
        for i in range(start, start + n):
            slot = mine.pop()
            block = Block(keys[i] if i < n_keys else None, parent, i, 1)
            stamp -= 1
            block.pages[0] = own[slot] = p = Page(block, 0, GPU, g, slot, priority, 1, locks, stamp + 1)
            blocks.append(block)
            rows.append([p])
            parent = block
        return fences

    def _undo_extend(self, seq: Sequence, n: int) -> None:
        for _ in range(min(n, len(seq.blocks) - seq.committed)):
            seq.blocks.pop()
            for p in seq.pages.pop():
                if p is not None:
                    self._free_page(p)

    # -- acquire / release -------------------------------------------------------------------
    def _needed(self, seq: Sequence) -> list[tuple[int, int]]:
        """(block, life cycle) of the pages an acquire locks, deepest first."""
        n = len(seq.blocks)
        if self.reads_all:
            lcs = range(len(self.lcs) - 1, -1, -1)
            return [(b, lc) for b in range(n - 1, -1, -1) for lc in lcs]
        h = n * self.tpb
        out = set()
        for lc in self.lcs:
            out.update((b, lc.index) for b in lc.needed_blocks(h, self.tpb))
            out.update((b, lc.index) for b in range(seq.committed, len(seq.blocks)))
        return sorted(out, reverse=True)

    def _acquire_now(self, seq: Sequence) -> bool:
        """The common case, without a task: every needed page is on the GPU
        and still. Locks them and returns True; else False (slow path)."""
        self._check()
        if seq.acquired:
            raise UsageError("sequence is already acquired")
        pages = []
        for b, lc in self._needed(seq):
            p = seq.pages[b][lc]
            if p is None or p.dead or p.tier != GPU or p.moving is not None:
                return False
            pages.append(p)
        for p in pages:
            p.locks += 1
            self._unqueue(p)
        self._touch(pages)
        seq.acquired = True
        seq.locked = pages
        return True

    async def _acquire(self, seq: Sequence) -> list[Page]:
        self._check()
        if seq.acquired:
            raise UsageError("sequence is already acquired")
        while True:       # every await may change pages: re-check until a pass needs none
            needed = self._needed(seq)
            holes = [(b, lc) for b, lc in needed if seq.pages[b][lc] is None or seq.pages[b][lc].dead]
            if holes:
                await self._fill_holes(seq, holes)
                continue
            pages = [seq.pages[b][lc] for b, lc in needed]
            waits = [p.moving for p in pages if p.moving is not None]
            if not waits:
                break
            await asyncio.wait(waits)
            for f in waits:
                if not f.cancelled() and f.exception() is not None and getattr(f, "to_gpu", False):
                    raise f.exception()
        for p in pages:
            p.locks += 1
            self._unqueue(p)
        try:
            cold = [p for p in pages if p.tier != GPU]
            if cold:
                self._claim(cold, GPU)
                by_group: dict[int, list[Page]] = collections.defaultdict(list)
                for p in cold:
                    by_group[self.group_of[GPU][p.lc]].append(p)
                try:
                    slots = await self._obtain_many(GPU, {g: len(v) for g, v in by_group.items()})
                except BaseException as exc:
                    self._unclaim(cold, exc)
                    raise
                await self._move_claimed(cold, GPU, slots, handoff=False)
        except BaseException:
            self._unlock(pages)
            raise
        self._touch(pages)
        seq.acquired = True
        seq.locked = list(pages)
        return pages

    def _prefetch(self, seq: Sequence) -> asyncio.Task | None:
        """Start promoting the cold pages the next acquire needs, unlocked.
        A failure only logs: the acquire that follows does the work itself."""
        self._check()
        pages = []
        for b, lc in self._needed(seq):
            p = seq.pages[b][lc]
            if p is not None and not p.dead and p.tier != GPU and p.moving is None:
                pages.append(p)
        if not pages:
            return None
        self._claim(pages, GPU, propagate=False)

        async def promote() -> None:
            counts = collections.Counter(self.group_of[GPU][p.lc] for p in pages)
            try:
                slots = await self._obtain_many(GPU, counts)
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

    async def _fill_holes(self, seq: Sequence, holes: list[tuple[int, int]]) -> None:
        per_group = collections.Counter(self.group_of[GPU][lc] for _, lc in holes)
        slots = await self._obtain_many(GPU, per_group)
        fences = []
        for b, lc in holes:
            g = self.group_of[GPU][lc]
            slot = slots[g].pop()
            fences.append(self.allocs[GPU][g].fences[slot])
            p = self._new_page(seq.blocks[b], lc, GPU, g, slot, seq.priority)
            p.holders = 1
            self._requeue(p)
            seq.pages[b][lc] = p
            seq.recompute.add((b, lc))
        await wait_events(fences)

    def _undo_acquire(self, seq: Sequence, pages: list[Page]) -> None:
        seq.acquired = False
        seq.locked = []
        self._unlock(pages)

    def _unlock(self, pages: Seq[Page]) -> None:
        for p in pages:
            p.locks -= 1
            if not p.dead:
                self._requeue(p)

    def _release(self, seq: Sequence, stream=None) -> None:
        """Unlock exactly the pages this sequence locked (others may share them)."""
        if not seq.acquired:
            return
        ev = stream_event(self._caller_stream(stream))
        seq.acquired = False
        locked, seq.locked = seq.locked, []
        locked.sort(key=_STAMP)                 # requeued oldest first: the queue's cheap path
        for p in locked:
            if ev is not None and p.tier == GPU:
                p.ready = ev
            p.locks -= 1
        self._queue_all(locked)

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
        for b, lc in self._needed(seq):
            p = seq.pages[b][lc]
            if p is not None and isinstance(p.ready, CudaEvent):
                stream.wait_event(p.ready._event)

    # -- commit / close ------------------------------------------------------------------------
    def _check_commit_keys(self, seq: Sequence, n: int) -> None:
        """Raise, with nothing changed, if committing blocks up to ``n`` would
        index a key at a second position (keys not chained, or repeated)."""
        keys = seq.keys[seq.committed:n]
        if self.nodes.keys().isdisjoint(keys) and len(set(keys)) == len(keys):
            return                      # the common case, checked in C: all new, none repeated
        parent = seq.blocks[seq.committed - 1] if seq.committed else None
        new_keys: set[BlockKey] = set()
        new_blocks: set[int] = set()    # by identity: a block extended before its key was known has none yet
        for i in range(seq.committed, n):
            if parent is not None and not parent.indexed and id(parent) not in new_blocks:
                return                  # an ancestor was dropped: the commit stops there
            key = seq.keys[i]
            node = self.nodes.get(key)
            if key in new_keys or (node is not None and (node.parent is not parent or node.depth != i)):
                raise UsageError(f"block key {key!r} at position {i} is already indexed at another position")
            if node is None:
                parent = seq.blocks[i]
                new_keys.add(key)
                new_blocks.add(id(parent))
            else:
                parent = node

    def _commit(self, seq: Sequence, n: int) -> None:
        self._check_commit_keys(seq, n)
        start = seq.committed
        on_disk: list[Page] = []
        try:
            self._commit_blocks(seq, n, on_disk)
        finally:
            if on_disk:
                self._relabel(on_disk)
            if seq.recompute and seq.committed > start:     # the newly committed blocks have their data now
                seq.recompute = {(b, lc) for b, lc in seq.recompute if not start <= b < seq.committed}
        self._touch(p for row in reversed(seq.pages[:n]) for p in row if p is not None)

    def _commit_blocks(self, seq: Sequence, n: int, on_disk: list[Page]) -> None:
        """Index blocks ``[0, n)``; pages published while resting on disk go to ``on_disk``."""
        if self.shares_nothing:         # the sequence keeps its pages; an index entry would serve nothing
            seq.committed = max(seq.committed, n)
            return
        private = self.private
        for i in range(n):
            block = seq.blocks[i]
            row = seq.pages[i]
            if i < seq.committed:
                if block.indexed:
                    self._adopt(block, row, seq, i, on_disk)
                continue
            parent = seq.blocks[i - 1] if i else None
            if parent is not None and not parent.indexed:
                break           # an ancestor was dropped meanwhile: nothing deeper can be reused
            key = seq.keys[i]
            node = self.nodes.get(key)
            if node is not None and (node.parent is not parent or node.depth != i):
                raise UsageError(f"block key {key!r} at position {i} is already indexed at another position")
            if node is None:
                block.key, block.parent, block.indexed = key, parent, True
                self.nodes[key] = block
                if parent is not None:
                    parent.children[key] = block
                node = block
                for p in row:
                    if p is None:
                        continue
                    if private[p.lc] or p.dead:
                        block.pages[p.lc] = None        # the sequence keeps it; the index never sees it
                    else:
                        p.published = True
                        if not p.locks:         # a locked page stays out of the queues either way
                            self._requeue(p)
                        self._published_cold(p, on_disk)
            else:
                seq.blocks[i] = node
                self._adopt(node, row, seq, i, on_disk)
            seq.committed = max(seq.committed, i + 1)

    def _adopt(self, node: Block, row: list[Page | None], seq: Sequence, i: int, on_disk: list[Page]) -> None:
        """Publish ``row``'s pages into ``node`` where it has none (or only an idle colder copy)."""
        for lc, p in enumerate(row):
            if p is None or p.dead or p.published or self.private[lc]:
                continue
            if (i, lc) in seq.recompute and self.lcs[lc].reuse is not ReusePolicy.OPTIONAL:
                continue
            theirs = node.pages[lc]
            if theirs is not None and not theirs.dead:
                if theirs.holders or theirs.locks or theirs.moving is not None or theirs.tier <= p.tier:
                    continue
                theirs.published = False
                node.pages[lc] = None
                self._free_page(theirs)
            p.block = node
            p.published = True
            node.pages[lc] = p
            self._requeue(p)
            self._published_cold(p, on_disk)

    def _published_cold(self, p: Page, on_disk: list[Page]) -> None:
        """``p`` was just published. If it rests on disk, its journal record
        is the anonymous one it was written with: relabel it (``on_disk``).
        If a claim holds it, whatever the move does, relabel it when the
        claim ends (``_unclaim``) in case it is on disk then."""
        if p.moving is not None:
            self._relabel_at_unclaim.add(p)
        elif p.tier == DISK:
            on_disk.append(p)

    def _relabel(self, pages: Seq[Page]) -> None:
        """Pages published after they reached the disk carry anonymous
        journal records, which recovery never serves: give them their
        keys, in order with the writes and frees on the disk stream."""
        by_group: dict[int, list[Page]] = collections.defaultdict(list)
        for p in pages:
            if p.tier == DISK and not p.dead:
                by_group[p.group].append(p)
        for g, ps in by_group.items():
            slots, records = [p.slot for p in ps], self.engine.records_of(ps)
            self.engine.io_write.submit(lambda g=g, slots=slots, records=records:
                                        self.disk.relabel(g, slots, records), event=False)

    def _close_sequence(self, seq: Sequence) -> None:
        self._release(seq)
        seq.closed = True
        last, unheld = self.last_tier, []
        for row in reversed(seq.pages):         # deepest (oldest stamp) first
            for p in row:
                if p is None or p.dead:
                    continue
                p.holders -= 1
                if not p.published:
                    self._free_page(p)
                elif p.tier == last:            # holders only gate the last tier's queue
                    unheld.append(p)
        self._queue_all(unheld)                 # none is queued: it was held until now
        seq.pages = []
        seq.blocks = []

    # -- page bookkeeping ----------------------------------------------------------------------
    def _new_page(self, block: Block, lc: int, tier: int, group: int, slot: int, priority: int) -> Page:
        p = Page(block, lc, tier, group, slot, priority)
        self.owners[tier][group][slot] = p
        return p

    def _touch(self, pages) -> None:
        """Stamp pages in the order given (callers pass deepest first)."""
        clock, queues = self.clock, self.queues
        for p in pages:
            clock += 1
            p.stamp = clock
            if p.qentry is not None:
                queues[p.tier][p.group].touch(p)
        self.clock = clock

    def _evictable(self, p: Page) -> bool:
        return (not p.locks and p.moving is None and not p.dead
                and (p.tier != self.last_tier or (p.published and not p.holders)))

    def _requeue(self, p: Page) -> None:
        """Make queue membership match evictability (``_evictable``, inlined:
        this runs several times per page per request). A queued page keeps
        its place, which its stamp decides."""
        evictable = (not p.locks and p.moving is None and not p.dead
                     and (p.tier != self.last_tier or (p.published and not p.holders)))
        if p.qentry is not None:
            if evictable:
                return
            self.queues[p.tier][p.group].remove(p)
        elif evictable:
            self.queues[p.tier][p.group].push(p)

    def _queue_all(self, pages: list[Page]) -> None:
        """Queue the evictable pages among ``pages`` (none queued, ascending
        stamps): one ``push_many`` per run bound for the same queue, instead
        of a ``_requeue`` per page (a move or a release does this by the batch)."""
        queues, q, run = self.queues, None, []
        evictable = self._evictable
        for p in pages:
            if p.qentry is not None or not evictable(p):
                continue
            dst = queues[p.tier][p.group]
            if dst is not q:
                if run:
                    q.push_many(run)
                q, run = dst, []
            run.append(p)
        if run:
            q.push_many(run)

    def _unqueue(self, p: Page) -> None:
        if p.qentry is not None:
            self.queues[p.tier][p.group].remove(p)

    def _release_slot(self, tier: int, group: int, slot: int, fence) -> None:
        self.owners[tier][group][slot] = None
        self.allocs[tier][group].release([slot], fence)
        if tier == DISK:
            self._disk_free(group, [slot])

    def _disk_free(self, group: int, slots: list[int]) -> None:
        """Forget disk slots, in order with the writes that may reuse them."""
        self.engine.io_write.submit(lambda: self.disk.free(group, slots), event=False)

    def _give_back(self, tier: int, group: int, slots: Seq[int]) -> None:
        alloc = self.allocs[tier][group]
        for s in slots:
            alloc.release([s], alloc.fences[s])

    def _free_page(self, p: Page, release_slot: bool = True) -> None:
        """The page leaves the store (its slot is freed once no move holds it)."""
        if p.dead:
            return
        p.dead = True
        self._unqueue(p)
        if p.block is not None and p.block.pages[p.lc] is p:
            p.block.pages[p.lc] = None
        if p.moving is None and release_slot:
            self._release_slot(p.tier, p.group, p.slot, p.ready)

    def _drop(self, p: Page, release_slot: bool = True) -> None:
        """Drop a published page from the index (the last tier's eviction)."""
        if not p.dead:
            self.drops += 1
        block = p.block
        lc = self.lcs[p.lc]
        p.published = False
        self._free_page(p, release_slot)
        if block.indexed and lc.is_prefix_critical(block.depth, self.tpb):
            self._drop_subtree(block)
        elif block.indexed and not block.children and all(q is None for q in block.pages):
            self._unindex(block)

    def _drop_subtree(self, root: Block) -> None:
        stack = [root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            for q in node.pages:
                if q is None or q.dead:
                    continue
                q.published = False
                if q.holders:
                    self._requeue(q)       # a live sequence keeps it; freed when it closes
                else:
                    self._free_page(q)
            self._unindex(node)

    def _unindex(self, node: Block) -> None:
        node.indexed = False
        if self.nodes.get(node.key) is node:
            del self.nodes[node.key]
        if node.parent is not None and node.parent.children.get(node.key) is node:
            del node.parent.children[node.key]
        node.children = {}

    # -- claims, eviction and moves ------------------------------------------------------------
    def _claim(self, pages: Seq[Page], to_tier: int, propagate: bool = True, one_queue: bool = False) -> None:
        """Mark pages as moving: one future per batch the move will run
        (source tier and group, destination group), none per page; waiters
        on a promotion get its error when ``propagate``. A waiter thus
        learns the fate of its own pages' batch, not of the whole claim.
        ``one_queue``: the pages were just popped from one queue (one source,
        none queued), so a destination with one group makes one batch."""
        loop = asyncio.get_running_loop()
        to_gpu = to_tier == GPU and propagate
        if one_queue and self.sole_group[to_tier] is not None:
            fut = loop.create_future()
            fut.to_gpu = to_gpu
            for p in pages:
                p.moving = fut
                p.moving_to = to_tier
            return
        dst_group = self.group_of[to_tier]    # drops (-1) key by the disk's groups: any stable key does
        futs: dict[tuple[int, int, int], asyncio.Future] = {}
        key = None
        for p in pages:
            assert not p.dead, f"claiming a freed page {p}"
            if key is None or p.tier != key[0] or p.group != key[1] or dst_group[p.lc] != key[2]:
                key = (p.tier, p.group, dst_group[p.lc])    # batch pages mostly share the previous one's
                fut = futs.get(key)
                if fut is None:
                    fut = futs[key] = loop.create_future()
                    fut.to_gpu = to_gpu
            p.moving = fut
            p.moving_to = to_tier
            if p.qentry is not None:
                self.queues[p.tier][p.group].remove(p)

    def _unclaim(self, pages: Seq[Page], exc: BaseException | None) -> None:
        self._queue_all(self._end_claims(pages, exc))
        if self._relabel_at_unclaim:
            self._relabel_later(pages)

    def _end_claims(self, pages: Seq[Page], exc: BaseException | None) -> list[Page]:
        """Settle the claims' futures and clear them; free the slots of pages
        freed meanwhile. Returns the live pages, oldest stamp first (the
        queue's cheap path when they are requeued)."""
        fut, live = None, []
        for p in sorted(pages, key=_STAMP):
            if p.moving is not fut:
                fut = p.moving
                _settle(fut, exc)
            p.moving, p.moving_to = None, -1
            if p.dead:
                self._release_slot(p.tier, p.group, p.slot, p.ready)
            else:
                live.append(p)
        return live

    def _relabel_later(self, pages: Seq[Page]) -> None:
        """Claims on ``pages`` ended: relabel those published meanwhile that ended on disk."""
        later = [p for p in pages if p in self._relabel_at_unclaim]
        self._relabel_at_unclaim.difference_update(later)
        self._relabel(later)

    async def _obtain_many(self, tier: int, counts: dict[int, int]) -> dict[int, list[int]]:
        """Slots in several groups of one tier, all or none."""
        got: dict[int, list[int]] = {}
        try:
            for g, n in counts.items():
                got[g] = await self._obtain(tier, g, n)
        except BaseException:
            for g, slots in got.items():
                self._give_back(tier, g, slots)
            raise
        return got

    async def _obtain(self, tier: int, group: int, n: int) -> list[int]:
        """``n`` free slots, evicting (and cascading) as needed."""
        alloc = self.allocs[tier][group]
        reclaimer = self.reclaimers.get((tier, group))
        if reclaimer is not None:
            reclaimer.kick_after(n)
        if n <= alloc.free:
            return alloc.allocate(n)
        got = alloc.allocate(alloc.free)
        try:
            # evicting on demand: refill the background reserve in the same batch
            extra = reclaimer.high if reclaimer is not None else 0
            while True:
                try:
                    victims = self._pick_victims(tier, group, n - len(got), extra)
                    break
                except OutOfPagesError:
                    # pages the background demotion has claimed are not evictable, but their slots
                    # come free when it finishes: wait for that rather than fail
                    if reclaimer is None or not reclaimer.busy:
                        raise
                    await reclaimer.idle.wait()
                    got += alloc.allocate(min(alloc.free, n - len(got)))
                    if len(got) == n:
                        return got
            freed = await self._evict(tier, victims)
        except BaseException:
            self._give_back(tier, group, got)
            raise
        need = n - len(got)
        if len(freed) > need:
            alloc.release(freed[need:])
        return got + freed[:need]

    def _pick_victims(self, tier: int, group: int, need: int, extra: int = 0) -> list[Page]:
        """Claim ``need`` victims (or raise, nothing claimed), plus up to
        ``extra`` more if the queue has them."""
        q = self.queues[tier][group]
        victims = q.pop_many(need + extra)
        if len(victims) < need:
            for p in victims:
                q.push(p)
            a = self.allocs[tier][group]
            raise OutOfPagesError(f"{TIER_NAMES[tier]} pool group {group}: need {need} more slots, "
                                  f"{a.free} free of {a.capacity} and only {len(victims)} evictable")
        nxt = self.next_tier[tier]
        self._claim(victims, nxt if nxt is not None else -1, one_queue=True)
        return victims

    async def _evict(self, tier: int, victims: list[Page]) -> list[int]:
        """Demote (or, in the last tier, drop) claimed victims; their slots go to the caller."""
        nxt = self.next_tier[tier]
        while nxt is not None:
            sole = self.sole_group[nxt]
            counts = {sole: len(victims)} if sole is not None else \
                collections.Counter(self.group_of[nxt][v.lc] for v in victims)
            try:
                slots = await self._obtain_many(nxt, counts)
            except OutOfPagesError:
                # the next tier is full of locked, held or in-flight pages: skip to a colder one
                # (cold groups are the same in host and disk); drop only when none can take them
                nxt = self.next_tier[nxt]
                if nxt is None and not all(v.published and not v.holders for v in victims):
                    self._unclaim(victims, None)
                    raise
            except BaseException:
                self._unclaim(victims, None)
                raise
            else:
                return await self._move_claimed(victims, nxt, slots, handoff=True)
        freed = []
        self._relabel_at_unclaim.difference_update(victims)
        for v in sorted(victims, key=lambda v: -v.block.depth):
            _settle(v.moving, None)
            v.moving, v.moving_to = None, -1
            self.owners[v.tier][v.group][v.slot] = None
            freed.append(v.slot)
            self._drop(v, release_slot=False)
        if tier == DISK:
            self._disk_free(victims[0].group, freed)
        return freed

    async def _move_claimed(self, pages: list[Page], dst_tier: int, slots: dict[int, list[int]],
                            handoff: bool) -> list[int]:
        """Move claimed pages into ``slots`` (per destination group). Batches
        run concurrently, one per (source tier, source group, destination
        group). With ``handoff`` the source slots are returned to the caller
        instead of freed. On failure every batch's claims are settled and the
        first error is raised (after the others finish). ``_claim`` made one
        future per batch, which the batch settles when it lands or fails."""
        src_tier, src_group = pages[0].tier, pages[0].group     # handoff: one source (tier, group)
        pages = sorted(pages, key=_SLOT)
        dst_of = self.group_of[dst_tier]
        if len(slots) == 1:
            (g, mine), = slots.items()     # the common case, one batch: no task, no gather
            if dst_of[pages[0].lc] == g and (handoff or all(p.tier == src_tier and p.group == src_group
                                                             for p in pages)):
                return await self._move_batch(pages, dst_tier, g, sorted(mine[:len(pages)]), handoff)
        batches: dict[tuple[int, int, int], list[Page]] = collections.defaultdict(list)
        for p in pages:
            batches[(p.tier, p.group, dst_of[p.lc])].append(p)
        jobs = []
        for (_, _, g), batch in batches.items():
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
                self.allocs[src_tier][src_group].release(freed)
            raise error
        return freed

    async def _move_batch(self, batch: list[Page], dst_tier: int, g: int, dst_slots: list[int],
                          handoff: bool) -> list[int]:
        alloc = self.allocs[dst_tier][g]
        fences = [alloc.fences[s] for s in dst_slots]
        try:
            ev = await self.engine.run(batch, dst_tier, g, dst_slots, fences)
        except BaseException as exc:
            self.engine.stats.failures[f"{TIER_NAMES[batch[0].tier]}->{TIER_NAMES[dst_tier]}"] += 1
            self._give_back(dst_tier, g, dst_slots)
            self._unclaim(batch, exc)
            if isinstance(exc, CorruptPageError):
                self._discard_corrupt(batch, set(getattr(exc, "slots", ())))
            raise
        src_tier, src_group = batch[0].tier, batch[0].group
        src_owners, dst_owners = self.owners[src_tier][src_group], self.owners[dst_tier][g]
        freed = [p.slot for p in batch]
        for p, s in zip(batch, dst_slots):
            src_owners[p.slot] = None
            p.tier, p.group, p.slot, p.ready = dst_tier, g, s, ev
            dst_owners[s] = p
        if src_tier == DISK:
            self._disk_free(src_group, freed)
        if not handoff:
            self.allocs[src_tier][src_group].release(freed, ev)
            freed = []
        self._land(batch, dst_tier, g)
        return freed

    def _land(self, batch: list[Page], tier: int, group: int) -> None:
        """``_unclaim`` for a batch that landed in ``(tier, group)``, all of
        it bound for one queue: evictability tested inline, one push."""
        last = tier == self.last_tier
        back = [p for p in self._end_claims(batch, None)
                if p.qentry is None and not p.locks and (not last or (p.published and not p.holders))]
        if back:
            self.queues[tier][group].push_many(back)
        if self._relabel_at_unclaim:
            self._relabel_later(batch)

    def _discard_corrupt(self, batch: list[Page], bad: set[int]) -> None:
        """Pages the disk tier found corrupt are never served: drop them."""
        for p in batch:
            if p.tier == DISK and p.slot in bad and not p.dead:
                self.discarded += 1
                log.warning("discarding corrupt disk page (lc %d, depth %d)", p.lc, p.block.depth)
                if p.published:
                    self._drop(p)
                else:
                    self._free_page(p)

    # -- stats ------------------------------------------------------------------------------------
    def stats(self) -> dict:
        self._check()
        tiers = {}
        for t in self.tier_ids:
            groups = []
            for g, alloc in enumerate(self.allocs[t]):
                owners = self.owners[t][g]
                states = collections.Counter(p.state for p in owners if p is not None)
                groups.append({
                    "index": g, "slots": alloc.capacity, "free": alloc.free, "used": alloc.used,
                    "evictable": len(self.queues[t][g]), "locked": states["LOCKED"], "held": states["HELD"],
                    "droppable": states["DROPPABLE"],
                    "slot_bytes": (self.slabs[t][g].spec.slot_bytes if t < DISK else self.engine.cold_bytes[g]),
                })
            tiers[TIER_NAMES[t]] = {"groups": groups, "hits": self.hits[TIER_NAMES[t]]}
        out = {
            "tiers": tiers,
            "hits": {name: self.hits[name] for name in TIER_NAMES},
            "lookup_blocks": self.lookup_blocks,
            "indexed_blocks": len(self.nodes),
            "moves": self.engine.stats.as_dict(),
            "drops": self.drops,
            "recovered_pages": self.recovered,
            "orphaned_pages": self.orphaned,
            "discarded_pages": self.discarded + (len(self.disk.discarded) if self.disk is not None else 0),
        }
        if self.disk is not None:
            out["disk"] = dict(self.disk.stats)
        return out

    async def drain(self) -> None:
        """Wait until no move, eviction or background demotion is in flight."""
        while self._tasks or any(r.busy or r.wake.is_set() for r in self.reclaimers.values()):
            if self._tasks:
                await asyncio.gather(*list(self._tasks), return_exceptions=True)
            await asyncio.sleep(0.001)

    def check_consistency(self) -> None:
        """Assert the bookkeeping invariants (tests and ``kvtier stress`` call it)."""
        for t in self.tier_ids:
            for g, alloc in enumerate(self.allocs[t]):
                owners = self.owners[t][g]
                for s, p in enumerate(owners):
                    if p is not None:
                        assert not alloc.is_free(s), f"{TIER_NAMES[t]}[{g}] slot {s} owned and free"
                        assert (p.tier, p.group, p.slot) == (t, g, s), f"{p} misfiled at {TIER_NAMES[t]}[{g}:{s}]"
                        assert not p.dead
                used = sum(1 for p in owners if p is not None)
                assert used == alloc.used, f"{TIER_NAMES[t]}[{g}]: {used} owned, {alloc.used} allocated"
                for p in owners:
                    if p is not None:
                        assert (p.qentry is not None) == self._evictable(p), f"queue membership of {p}"
        for node in self.nodes.values():
            assert node.indexed and (node.parent is None or node.parent.indexed), f"stale node at {node.depth}"
            for p in node.pages:
                if p is not None:
                    assert p.published and not p.dead, f"{p} in the index"
                    assert self.owners[p.tier][p.group][p.slot] is p, f"{p} does not own its slot"


def _settle(fut: asyncio.Future | None, exc: BaseException | None) -> None:
    """Resolve a claim's future once. An error is marked retrieved here: the
    failed operation raises it itself, and waiters still see it."""
    if fut is None or fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)
        fut.exception()


def stream_event(stream) -> CudaEvent | None:
    """An event recorded on a caller's CUDA stream (None for no stream)."""
    return None if stream is None else CudaEvent.on(stream)

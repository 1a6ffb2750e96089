"""Background demotion: keep a reserve of free slots in the GPU and host
tiers so that requests allocate without waiting on evictions, and demote in
large batches off the request path.

One task per (tier, pool group) with a reserve; it wakes when an allocation
takes the free count below the low watermark (the reserve) and demotes the
usual eviction victims (prioritised LRU, cascading) until the free count is
back at the reserve plus one refill step. The last tier keeps no reserve
(dropping early would only lose hits), except the disk: a small one, so that
spills write over slots whose frees are journaled already (see
Store._start_reclaimers).

The step is at least the reserve, and for small pages up to REFILL_BYTES:
each batch costs the loop a fixed ~0.1 ms of bookkeeping and a thread
hand-off (a spill to disk three fdatasyncs), which a 1 % reserve of 4 KiB
pages (40 pages, 160 KiB) does not amortise. A free slot holds no page, so
the step is also capped at STEP_SHARE of the whole store (see Store._start_reclaimers).
Every demotion batch of a group with a reserve, on demand too, takes at least
one step (Moves.pick_victims).
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from tiers.errors import OutOfPagesError

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("kvtier")
MAX_BATCH = 512          # the most pages one demotion batch takes: fewer, larger spills (each costs thread hand-offs)
REFILL_BYTES = 2 << 20      # a refill step is up to this many bytes of pages (at least the reserve) ...
STEP_SHARE = 0.004          # ... and at most this share of the store's slots per tier, and an eighth of the group
DISK_SHARE = 0.03           # the disk keeps a reserve (two spill batches, refilled by a step) only within this share of it


class Reclaimer:
    __slots__ = ("store", "tier", "group", "low", "step", "high", "wake", "task", "busy", "idle")

    def __init__(self, store: "Store", tier: int, group: int, low: int, step: int) -> None:
        self.store = store
        self.tier = tier
        self.group = group
        self.low = low
        self.step = step                    # the fewest pages a demotion batch of this group takes
        self.high = low + step              # refilled to this (the low watermark plus one step)
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.busy = False
        self.idle = asyncio.Event()             # set whenever no background batch is in flight
        self.idle.set()

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._run())

    @property
    def running(self) -> bool:
        """Started and not stopped: a store that is closing keeps no reserve (persisting at close
        would otherwise drop disk pages to refill one)."""
        return self.task is not None

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None

    def kick_after(self, n: int) -> None:
        """Called before ``n`` slots are taken: wake if that goes below the reserve."""
        if self.store.core.free(self.tier, self.group) - n < self.low:
            self.wake.set()

    async def _run(self) -> None:
        store = self.store
        while True:
            await self.wake.wait()
            self.wake.clear()
            self.busy = True
            self.idle.clear()
            try:
                await self._refill(store)
            finally:
                self.busy = False
                self.idle.set()

    async def _refill(self, store: "Store") -> None:
        core, tier, group = store.core, self.tier, self.group
        key = (tier, group)
        refilling = store.moves.refilling
        while core.free(tier, group) + refilling.get(key, 0) < self.high and not store.closed:
            # at most what the next tier can make room for in one batch (Moves.line_batch)
            want = min(self.high - core.free(tier, group) - refilling.get(key, 0),
                       store.moves.line_batch[tier], core.queue_len(tier, group))
            if want <= 0:
                return
            victims = store.moves.pick_victims(tier, group, want, raise_=False)
            if victims is None:
                return
            n = len(victims)
            store.moves.refilling_add(key, n)
            task = store.moves.spawn(store.moves.evict(self.tier, victims))

            def settled(t: asyncio.Task, n: int = n) -> None:
                if not t.cancelled() and t.exception() is None:
                    core.give_back(tier, group, t.result())     # each with the fence of the copy that read it
                store.moves.refilling_add(key, -n)
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:      # the store is closing: the slots still go back (settled)
                task.add_done_callback(settled)
                raise
            except OutOfPagesError:
                settled(task)
                return                          # colder tiers are full of held pages: requests evict on demand
            except Exception as exc:            # noqa: BLE001 - the reclaimer must outlive any one failure
                settled(task)
                log.warning("background demotion from tier %d failed: %r", self.tier, exc)
                await asyncio.sleep(0.05)
                return
            settled(task)

"""Write-through to the disk tier: clean copies of committed pages.

With ``[tiers.disk] write = "through"`` every page published outside the disk
is also copied down in the background, so that a process killed without a
clean close loses at most the commits of the last ``write_interval``, and a
later demotion of a page whose copy is on disk moves no bytes (the core swaps
the page onto its copy).

The core keeps the queue of pages to copy and decides (``take_copies``,
``land_copies``); this task moves the bytes, one batch of at most
``max_inflight_bytes`` after another, through the migration engine. A copy
claim never holds a page away from its readers: an acquire of a GPU page does
not wait for it, and the page cannot move or be freed while its bytes are read.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from tiers.config import DiskConfig
from tiers.errors import DiskFullError, OutOfPagesError

from .migration import Batch
from .pages import DISK

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("kvtier")


class WriteThrough:
    __slots__ = ("store", "interval", "max_bytes", "task", "wake", "stopping", "copied_pages", "copied_bytes",
                 "batches", "failures", "_logged", "idle", "_flushing")

    def __init__(self, store: "Store", cfg: DiskConfig) -> None:
        self.store = store
        self.interval = float(cfg.write_interval)
        self.max_bytes = int(cfg.max_inflight_bytes)
        self.task: asyncio.Task | None = None
        self.wake = asyncio.Event()
        self.stopping = False
        self.copied_pages = 0
        self.copied_bytes = 0
        self.batches = 0
        self.failures = 0
        self._logged = float("-inf")
        self.idle = asyncio.Event()         # set while no copy batch is in flight (its pages are claimed)
        self.idle.set()
        self._flushing = 0

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Let the batch in flight land, then end (no copy is cut half-way)."""
        self.stopping = True
        self.wake.set()
        if self.task is not None:
            await asyncio.wait([self.task])
            self.task = None

    async def _run(self) -> None:
        while not self.stopping:
            try:
                await self.flush()
            except Exception as exc:        # noqa: BLE001 - the task must outlive any one failure
                self._failed(exc)
            try:
                await asyncio.wait_for(self.wake.wait(), self.interval)
            except asyncio.TimeoutError:
                pass
            self.wake.clear()

    async def flush(self) -> None:
        """Copy every page that can be read now, in bounded batches. Pages
        locked by an acquired sequence wait for a later flush (their bytes
        are final only once it releases them)."""
        store = self.store
        core = store.core
        per_page = max(store.engine.cold_bytes) if store.engine.cold_bytes else 1
        max_pages = max(1, self.max_bytes // max(1, per_page))
        self._flushing += 1
        self.idle.clear()
        try:
            while not store.closed:
                pages, claims = core.take_copies(max_pages)
                if not pages:
                    return
                store.claims.open(claims, False)
                batches = core.split_batches(pages, DISK)
                if len(batches) == 1:
                    await self._batch(batches[0][3], batches[0][2])
                else:
                    results = await asyncio.gather(*(store._spawn(self._batch(b, g)) for _, _, g, b in batches),
                                                   return_exceptions=True)
                    for r in results:
                        if isinstance(r, BaseException):
                            raise r
        finally:
            self._flushing -= 1
            if not self._flushing:
                self.idle.set()

    async def _batch(self, batch, group: int) -> None:
        store = self.store
        core = store.core
        try:
            slots = await store._obtain(DISK, group, len(batch))
        except OutOfPagesError:             # the disk is full of pages held or in flight: later
            store._unclaim(batch, None)
            return
        except BaseException:
            store._unclaim(batch, None)
            raise
        src_tier, src_group, src_slots, lcs, ready = core.batch_view(batch)
        fences = store.events.all(core.slot_fences(DISK, group, slots))
        store._sync()
        job = Batch(src_tier, src_group, src_slots, lcs, set(store.events.all(ready)), lambda: store.records(batch))
        try:
            ev = await store.engine.run(job, DISK, group, slots, fences, record=False)
        except BaseException as exc:
            core.give_back(DISK, group, slots)
            store._unclaim(batch, None)
            self.failures += 1
            if isinstance(exc, DiskFullError):
                store._disk_full(exc, 0)    # the disk keeps what it has; the pages stay queued for later
                return
            raise
        store.claims.settle(core.land_copies(batch, group, slots, store.events.id(ev)))
        store._sync()
        self.copied_pages += len(slots)
        self.copied_bytes += len(slots) * store.engine.cold_bytes[group]
        self.batches += 1

    def _failed(self, exc: BaseException) -> None:
        self.failures += 1
        now = asyncio.get_running_loop().time()
        if now - self._logged >= 60.0:
            self._logged = now
            log.warning("write-through to the disk tier failed (%r); the pages stay queued and are retried", exc)

    def stats(self) -> dict:
        c = self.store.core.counters()
        return {"on": True, "copied_pages": self.copied_pages, "copied_bytes": self.copied_bytes,
                "batches": self.batches, "pending": self.store.core.copies_pending(),
                "free_demotions": c["copy_swaps"], "kept_on_promotion": c["copies_kept"],
                "evicted_copies": c["copies_evicted"], "copies": c["copies"], "failures": self.failures,
                "interval_s": self.interval, "max_inflight_bytes": self.max_bytes}


def off_stats() -> dict:
    """``stats()["write_through"]`` of a store without it."""
    return {"on": False, "copied_pages": 0, "copied_bytes": 0, "batches": 0, "pending": 0, "free_demotions": 0,
            "kept_on_promotion": 0, "evicted_copies": 0, "copies": 0, "failures": 0}

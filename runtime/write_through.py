"""Write-through to a cold tier (host or disk): clean copies of committed pages.

With ``write = "through"`` in ``[tiers.host]`` or ``[tiers.disk]``, every page
published in a warmer tier is also copied into that tier in the background,
so that a later demotion of a page whose copy is there moves no bytes (the
core swaps the page onto its copy), a promoted page keeps its cold slot as a
copy, and (the disk) a process killed without a clean close loses at most
the commits of the last ``write_interval``.

The core keeps each tier's queue of pages to copy and decides (``take_copies``,
``land_copies``); one task per tier moves the bytes, one batch of at most
``max_inflight_bytes`` after another, through the migration engine. A copy
claim never holds a page away from its readers: an acquire of a GPU page does
not wait for it, and the page cannot move or be freed while its bytes are read.
Copies compete for their tier's slots like any page there: making room for
one may evict older pages (or copies) of the tier.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from tiers.config import ColdTierConfig
from tiers.errors import DiskFullError, OutOfPagesError

from .migration import Batch
from .pages import GPU, TIER_NAMES

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("kvtier")


class WriteThrough:
    __slots__ = ("store", "tier", "interval", "max_bytes", "task", "wake", "stopping", "copied_pages", "copied_bytes",
                 "batches", "failures", "disk_full", "_logged", "idle", "_flush")

    def __init__(self, store: "Store", cfg: ColdTierConfig, tier: int) -> None:
        self.store = store
        self.tier = tier                    # HOST or DISK: where the copies go
        self.interval = float(cfg.write_interval)
        self.max_bytes = int(cfg.max_inflight_bytes)
        self.task: asyncio.Task | None = None
        self.wake = asyncio.Event()
        self.stopping = False
        self.copied_pages = 0
        self.copied_bytes = 0
        self.batches = 0
        self.failures = 0                   # batches that failed (retried at the next interval)
        self.disk_full = 0                  # ... of them because the filesystem was full
        self._logged = float("-inf")
        self.idle = asyncio.Event()         # set while no copy batch is in flight (its pages are claimed)
        self.idle.set()
        self._flush: asyncio.Task | None = None     # the one flush pass running, a store task

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Let the batch in flight land, then end: the pages still queued are
        left to persisting (no copy is cut half-way)."""
        self.stopping = True
        self.wake.set()
        if self.task is not None:
            await asyncio.wait([self.task])
            self.task = None
        if self._flush is not None:
            await asyncio.wait([self._flush])

    async def _run(self) -> None:
        while not self.stopping:
            await asyncio.wait([self.flush_pass()])     # never raises: a failure is logged and retried
            try:
                await asyncio.wait_for(self.wake.wait(), self.interval)
            except asyncio.TimeoutError:
                pass
            self.wake.clear()

    def flush_pass(self) -> asyncio.Task:
        """The running flush pass, or a new one: a store task, so a caller
        that is cancelled while it waits (``drain()``) cancels no copy."""
        if self._flush is None or self._flush.done():
            self._flush = self.store.moves.spawn(self._pass())
        return self._flush

    async def _pass(self) -> None:
        """Copy what can be copied now, one bounded batch after another, until
        nothing is queued or a batch fails (the rest waits for the next
        interval: a full or failing disk is not retried in a loop)."""
        store = self.store
        core = store.core
        self.idle.clear()
        try:
            while not store.closed and not self.stopping:
                pages, claims = core.take_copies(self.tier, self._max_pages())
                if not pages:
                    return
                store.claims.open(claims, False)
                batches = core.split_batches(pages, self.tier)
                jobs = [store.moves.spawn(self._batch(b, g)) for _, _, g, b in batches]
                await asyncio.wait(jobs)
                landed = True
                for j in jobs:              # every outcome retrieved, the first error raised
                    landed = landed and not j.cancelled() and j.exception() is None and j.result()
                for j in jobs:
                    if not j.cancelled() and j.exception() is not None:
                        raise j.exception()
                if not landed:
                    return
        except Exception as exc:            # noqa: BLE001 - the pages are queued again; the next pass retries
            self._failed(exc)
        finally:
            self.idle.set()

    def _max_pages(self) -> int:
        """Pages per take: the byte bound, and a quarter of the tier's smallest
        group, so that one batch never needs more slots than the tier can free."""
        store = self.store
        per_page = max(store.engine.cold_bytes) if store.engine.cold_bytes else 1
        n = self.max_bytes // max(1, per_page)
        for g in range(store.core.n_groups(self.tier)):
            n = min(n, store.core.capacity(self.tier, g) // 4)
        return max(1, n)

    async def _batch(self, batch, group: int) -> bool:
        """One batch to (tier, group); False if it failed (its pages are queued again)."""
        store = self.store
        core = store.core
        tier = self.tier
        try:
            slots = await store.moves.obtain(tier, group, len(batch))
        except BaseException as exc:
            store.moves.unclaim(batch, None)
            if isinstance(exc, OutOfPagesError):    # the tier is full of held or moving pages: later
                return False
            if isinstance(exc, Exception):
                self._failed(exc)
                return False
            raise
        src_tier, src_group, src_slots, lcs, ready = core.batch_view(batch)
        fences = store.events.all(core.slot_fences(tier, group, slots))
        store.moves.sync()
        job = Batch(src_tier, src_group, src_slots, lcs, set(store.events.all(ready)),
                    lambda: store.moves.records(batch))
        # copies in the tier the GPU demotes to: a later demotion onto one moves no bytes, so the
        # remote's write-through (which writes pages as they leave the GPU) sees them now; a disk
        # copy below a host tier is not teed: the page's demotion to the host still is
        tee = store.moves.tee_to_remote(job, batch, group) if store.next_tier[GPU] == tier else None
        try:
            ev = await store.engine.run(job, tier, group, slots, fences, record=False)
        except BaseException as exc:        # as a failed move: the slots go back, the claims end
            if tee is not None:
                tee.release()
            core.give_back(tier, group, slots)
            store.moves.unclaim(batch, None)
            if not isinstance(exc, Exception):
                raise
            self._failed(exc)
            return False
        if tee is not None:
            tee.landed()
        store.claims.settle(core.land_copies(batch, tier, group, slots, store.events.id(ev)))
        store.moves.sync()
        self.copied_pages += len(slots)
        self.copied_bytes += len(slots) * store.engine.cold_bytes[group]
        self.batches += 1
        return True

    def _failed(self, exc: BaseException) -> None:
        self.failures += 1
        full = isinstance(exc, DiskFullError)
        self.disk_full += full
        now = asyncio.get_running_loop().time()
        if now - self._logged >= 60.0:
            self._logged = now
            log.warning("write-through to the %s tier failed (%s%r); the pages stay queued and are retried "
                        "every write_interval; %d batch(es) failed so far", TIER_NAMES[self.tier],
                        "the filesystem is full: " if full else "", exc, self.failures)

    def stats(self) -> dict:
        c = self.store.core.counters()
        t = self.tier
        return {"on": True, "copied_pages": self.copied_pages, "copied_bytes": self.copied_bytes,
                "batches": self.batches, "pending": self.store.core.copies_pending(t),
                "free_demotions": c["copy_swaps"][t], "kept_on_promotion": c["copies_kept"][t],
                "evicted_copies": c["copies_evicted"][t], "copies": c["copies"][t], "failures": self.failures,
                "disk_full": self.disk_full, "interval_s": self.interval, "max_inflight_bytes": self.max_bytes}


def off_stats() -> dict:
    """``stats()["write_through"]`` (or ``["host_write_through"]``) of a store without it."""
    return {"on": False, "copied_pages": 0, "copied_bytes": 0, "batches": 0, "pending": 0, "free_demotions": 0,
            "kept_on_promotion": 0, "evicted_copies": 0, "copies": 0, "failures": 0, "disk_full": 0,
            "interval_s": None, "max_inflight_bytes": None}

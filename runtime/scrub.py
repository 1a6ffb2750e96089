"""Scrubbing the disk tier: reading every page the store holds there and checking its checksum,
in the background, so that a damaged page leaves the index (and the routers' view, through KV
events) before a request matches it. Reads already check every page they serve (the disk tier
verifies lazily, ``tiers/disk.py``): a scrub changes what is matched and reported, never what
bytes are served.

A pass walks each disk group's slots a piece (``PIECE_BYTES``) at a time. The core claims the
piece's pages (``claim_resident``, clean copies too), so they neither move nor go while a
worker thread reads and checks them under the group's lock (``DiskTier.verify``). A page
written behind is checked once its write has ended. The bad pages are dropped as a read that
found them drops them (their prefix-critical subtrees with them); a bad clean copy is only
freed, its primary (on the GPU or host) stays, so a later demotion writes the page's bytes
again instead of taking over the bad ones. The rest are unclaimed. A request that needs a claimed page waits for its piece, about a
millisecond. ``rate`` caps the bytes read per second, so the scrub leaves the disk to requests.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from tiers.errors import KvtierError, StoreClosedError, UsageError

from .pages import DISK
from .readiness import ended

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("kvtier")
PIECE_BYTES = 1 << 20           # the pages one claim holds and one locked read checks


class Scrubber:
    """One store's scrubs: a pass at a time (``start``), one at open with ``scrub = "on_open"``;
    none once the store closes (``stop``)."""

    __slots__ = ("store", "rate", "task", "stopped", "passes", "checked_pages", "discarded_pages", "seconds")

    def __init__(self, store: "Store", rate: int) -> None:
        self.store = store
        self.rate = rate                    # bytes read per second at most
        self.task: asyncio.Task | None = None
        self.stopped = False
        self.passes = 0                     # passes finished
        self.checked_pages = 0
        self.discarded_pages = 0
        self.seconds = 0.0

    def start(self) -> asyncio.Task:
        """The pass in progress, or a new one."""
        if self.stopped:
            raise StoreClosedError("store is closing: no scrub")
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._pass())
        return self.task

    async def stop(self) -> None:
        """End the pass in progress (after its piece's read) and start none again."""
        self.stopped = True
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None

    def stats(self) -> dict:
        """``running``, ``passes`` (finished), ``checked_pages`` and ``discarded_pages`` of every
        pass so far (a piece at a time), ``seconds`` of the finished ones."""
        return {"running": self.task is not None and not self.task.done(), "passes": self.passes,
                "checked_pages": self.checked_pages, "discarded_pages": self.discarded_pages,
                "seconds": round(self.seconds, 3)}

    async def _pass(self) -> dict:
        store = self.store
        t0 = time.perf_counter()
        checked = discarded = 0
        read = 0
        error = None
        try:
            for g, grp in enumerate(store.disk.groups):
                span = max(1, PIECE_BYTES // grp.slot_bytes)
                for lo in range(0, store.core.capacity(DISK, g), span):
                    n, bad = await self._piece(g, lo, lo + span)
                    checked += n
                    discarded += bad
                    self.checked_pages += n
                    self.discarded_pages += bad
                    read += n * grp.slot_bytes
                    ahead = read / self.rate - (time.perf_counter() - t0)
                    await asyncio.sleep(max(0.0, ahead))    # a turn of the loop at least, between pieces
        except (OSError, KvtierError) as exc:               # an I/O error, the store closing: this pass ends
            error = exc
            log.warning("disk scrub stopped after %d page(s): %r", checked, exc)
        except asyncio.CancelledError:
            if not self.stopped:
                raise
            error = StoreClosedError("the store closed during the scrub")   # its waiters get the pass's figures
        seconds = time.perf_counter() - t0
        self.passes += 1
        self.seconds += seconds
        if discarded:
            log.warning("disk scrub: %d of %d page(s) were bad (damaged, or their write failed) and were dropped",
                        discarded, checked)
        elif error is None:
            log.info("disk scrub: %d page(s) checked in %.1f s, none bad", checked, seconds)
        return {"checked_pages": checked, "discarded_pages": discarded, "seconds": round(seconds, 3),
                "error": None if error is None else repr(error)}

    async def _piece(self, g: int, lo: int, hi: int) -> tuple[int, int]:
        """Check the pages in slots [lo, hi) of disk group ``g``: (pages checked, pages dropped)."""
        store = self.store
        core, moves = store.core, store.moves
        claim, pages = core.claim_resident(DISK, g, lo, hi)
        if not claim:
            return 0, 0
        store.claims.open([claim], False)
        bad: list[int] = []
        try:
            _, _, slots, _, ready = core.batch_view(pages)
            for ev in set(store.events.all(ready)):         # a page written behind: its write first
                if ev is not None:
                    await ended(ev, store.loop)             # (a failed one's slot: verify names it bad)
            for again in (False, True):
                job = store.loop.run_in_executor(None, store.disk.verify, g, slots)
                try:
                    found = await asyncio.shield(job)
                    break
                except asyncio.CancelledError:
                    await asyncio.gather(job, return_exceptions=True)   # the read ends before the claim does
                    if not job.cancelled() and job.exception() is None:
                        bad = [s for _, s, _ in job.result()]       # what it found is dropped all the same
                    raise
                except UsageError:
                    # a slot neither holding its page nor forgotten yet: a write behind that never
                    # ran (a wait before it failed) has its forget queued on the write stream
                    if again:
                        raise
                    await ended(store.engine.io_write.record(), store.loop)
            bad = [s for _, s, _ in found]
        finally:
            moves.unclaim(pages, None)
            if bad:                                         # the disk tier forgot them; now the index does
                core.discard_corrupt(pages, bad)
                moves.sync()
        return len(pages), len(bad)

"""The disk tier across restarts: spilling the index's pages at close, and
rebuilding the index from the pages the disk tier recovered at open.

Both are driven through the native core's public calls; they live apart
because they are the only code that reasons about a previous process's state.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from tiers.errors import KvtierError, OutOfPagesError

from .pages import DISK

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("kvtier")
PERSIST_CHUNK = 64


async def persist(store: "Store") -> None:
    """Spill published pages that are not on disk, most recently used
    first, evicting colder disk pages to make room, so that a restart
    finds the hottest prefixes whole."""
    core = store.core
    # The disk pages above what the disk keeps are pinned while persisting: the evictions that make
    # room then take only leaves, never an ancestor that would strand its subtree after a restart.
    candidates = core.persist_candidates()
    anchors = core.persist_anchors(candidates)
    if anchors:
        store.moves.claim(anchors, DISK)
    try:
        await _persist_candidates(store, candidates)
    finally:
        if anchors:
            store.moves.unclaim(anchors, None)
    await store.moves.behind_written()        # spills written behind are journaled by this flush too
    await asyncio.get_running_loop().run_in_executor(None, store.disk.flush)


async def _persist_candidates(store: "Store", candidates: list) -> None:
    core = store.core
    failed, first = 0, None                 # pages whose chunk failed, and the first error: said once
    try:
        for g, pages in enumerate(candidates):
            for i in range(0, len(pages), PERSIST_CHUNK):
                # ids taken before earlier chunks' awaits: keep those still the index's pages for this group
                chunk = core.still_persistable(pages.slice(i, i + PERSIST_CHUNK), g)
                if not chunk:
                    continue
                store.moves.claim(chunk, DISK)        # before evicting: a drop must not free them under us
                try:
                    slots = await store.moves.obtain(DISK, g, len(chunk))
                except BaseException as exc:     # out of pages, or the close was cancelled: settle the claims
                    store.moves.unclaim(chunk, exc)
                    if isinstance(exc, OutOfPagesError):
                        break
                    raise
                try:
                    await store.moves.move(chunk, DISK, {g: slots}, handoff=False)
                except (OSError, KvtierError) as exc:     # those pages stay unpersisted; go on
                    failed += len(chunk)
                    first = first or exc
    finally:
        if failed:              # one line, not one per chunk (a full disk refuses them all)
            log.warning("persisting %d page(s) at close failed (they are not kept); the first error: %s",
                        failed, first)


async def index_recovered(store: "Store") -> None:
    """Rebuild the index from the pages the disk tier recovered, off the
    loop (the records are arrays, and the core releases the GIL while it
    reads and indexes them): unrecoverable and unreachable pages are
    forgotten on disk."""
    disk, core = store.disk, store.core
    t0 = time.perf_counter()

    def rebuild():
        for groups, records in disk.recovered_records():
            core.recover_add(records.view(np.uint8), groups)
        return core.recover()
    forget = await asyncio.get_running_loop().run_in_executor(None, rebuild)
    for g, slots in enumerate(forget):
        if slots:
            disk.free(g, slots)
    counters = core.counters()
    damaged = len(disk.discarded)          # found by the disk tier: checksums, segment size, bad records
    log.info("disk tier %s: recovered %d pages in %.2f s; %d orphaned (an ancestor's page never reached the "
             "disk: unreachable, freed); %d discarded by the index (records that do not fit this layout or "
             "tree); %d discarded by the disk tier (damaged records or pages); %d journal error(s)",
             disk.path, counters["recovered"], time.perf_counter() - t0, counters["orphaned"],
             counters["discarded"], damaged, len(disk.journal_errors))

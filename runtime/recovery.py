"""The disk tier across restarts: spilling the index's pages at close, and
rebuilding the index from the pages the disk tier recovered at open.

They work on the Store's tables directly; they live apart because they are
the only code that reasons about a previous process's state.
"""
from __future__ import annotations

import asyncio
import collections
import logging
from typing import TYPE_CHECKING

from tiers.errors import KvtierError, OutOfPagesError

from .migration import ANONYMOUS_KEY
from .pages import DISK, Block, Page

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("kvtier")


async def persist(store: "Store") -> None:
    """Spill published pages that are not on disk, most recently used
    first, evicting colder disk pages to make room, so that a restart
    finds the hottest prefixes whole."""
    pending = [p for node in store.nodes.values() for p in node.pages
               if p is not None and not p.dead and p.published and p.tier != DISK and p.moving is None
               and not p.locks]
    pending.sort(key=lambda p: -p.stamp)
    by_group: dict[int, list[Page]] = collections.defaultdict(list)
    for p in pending:
        g = store.group_of[DISK][p.lc]
        if len(by_group[g]) < store.allocs[DISK][g].capacity:
            by_group[g].append(p)
    for g, pages in by_group.items():
        for i in range(0, len(pages), 64):
            chunk = [p for p in pages[i:i + 64] if not p.dead and p.moving is None and p.tier != DISK]
            if not chunk:
                continue
            store._claim(chunk, DISK)        # before evicting: a drop must not free them under us
            try:
                slots = await store._obtain(DISK, g, len(chunk))
            except OutOfPagesError as exc:
                store._unclaim(chunk, exc)
                break
            try:
                await store._move_claimed(chunk, DISK, {g: slots}, handoff=False)
            except (OSError, KvtierError) as exc:     # those pages stay unpersisted; go on
                log.warning("persisting %d pages at close failed: %s", len(chunk), exc)
    await asyncio.get_running_loop().run_in_executor(None, store.disk.flush)


def index_recovered(store: "Store") -> None:
    """Rebuild the index from the pages the disk tier recovered."""
    disk = store.disk
    allocs = store.allocs[DISK]
    taken = collections.defaultdict(set)
    for rp in sorted(disk.recovered, key=lambda r: r.record.depth):
        rec = rp.record
        if rec.key in (None, ANONYMOUS_KEY):        # a page no index knew: nothing to recover
            disk.free(rp.group, [rp.slot])
            continue
        ok = (0 <= rec.life_cycle < len(store.lcs)
              and store.group_of[DISK][rec.life_cycle] == rp.group and 0 <= rp.slot < allocs[rp.group].capacity)
        parent = store.nodes.get(rec.parent) if rec.parent is not None else None
        if ok and rec.depth > 0 and (parent is None or parent.depth != rec.depth - 1):
            ok = False
        if ok and rec.depth == 0 and rec.parent is not None:
            ok = False
        node = store.nodes.get(rec.key) if ok else None
        if ok and node is not None and (node.parent is not parent or node.pages[rec.life_cycle] is not None):
            ok = False
        if not ok:
            store.discarded += 1
            disk.free(rp.group, [rp.slot])
            continue
        if node is None:
            node = Block(rec.key, parent, rec.depth, len(store.lcs))
            node.indexed = True
            store.nodes[rec.key] = node
            if parent is not None:
                parent.children[rec.key] = node
        p = Page(node, rec.life_cycle, DISK, rp.group, rp.slot, rec.priority)
        p.published = True
        node.pages[rec.life_cycle] = p
        store.owners[DISK][rp.group][rp.slot] = p
        taken[rp.group].add(rp.slot)
    for g, alloc in enumerate(allocs):
        all_slots = alloc.allocate(alloc.capacity)
        # highest first, so the lowest free slots are handed out first and the segment stays compact
        alloc.release(sorted((s for s in all_slots if s not in taken[g]), reverse=True))
    # blocks missing a prefix-critical page can never match: drop them with their subtrees
    before = sum(1 for o in store.owners[DISK] for p in o if p is not None)
    for node in sorted(store.nodes.values(), key=lambda n: n.depth):
        if node.indexed and any(lc.is_prefix_critical(node.depth, store.tpb) and node.pages[lc.index] is None
                                for lc in store.lcs):
            store._drop_subtree(node)
    store.orphaned = before - sum(1 for o in store.owners[DISK] for p in o if p is not None)
    if store.orphaned:
        log.warning("disk tier: %d recovered pages are unreachable (an ancestor's page was not on disk) "
                    "and were freed", store.orphaned)
    # Recency is not journaled. Deepest first, then in write order: a block is never older than its
    # descendants (evicting an ancestor first would drop its whole subtree), and shallow blocks, which
    # more requests share, go last.
    gen = {(rp.group, rp.slot): rp.generation for rp in disk.recovered}
    pages = [p for owners in store.owners[DISK] for p in owners if p is not None]
    pages.sort(key=lambda p: (-p.block.depth, gen.get((p.group, p.slot), 0)))
    for p in pages:
        store.clock += 1
        p.stamp = store.clock
        store._requeue(p)
    store.recovered = sum(1 for o in store.owners[DISK] for p in o if p is not None)

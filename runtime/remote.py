"""The Store's side of the remote tier (``tiers/remote.py``): what lets a page
written by one store be a hit for another.

- **Lookup at open.** Where the local match stops, one pipelined existence
  query for the next blocks' pages (every life cycle that is not PRIVATE);
  the run found is fetched (one round trip per node, every host group at
  once) into a buffer, copied into host slots on a worker thread, and the
  core publishes it there (``Core.import_pages``). The sequence is then
  matched again, so the rest of the request sees ordinary host hits.
- **Write-through as pages leave the GPU** (to host or disk). The move
  copies its cold rows once more (``Batch.tee``), and a background task
  writes the committed ones with ``NX``, bounded by ``max_inflight_bytes``
  (past the bound a batch is skipped and counted, never waited for).

Every remote failure is a miss (the backend counts it); nothing here raises
into a request because the server is slow, gone or lying.
"""
from __future__ import annotations

import asyncio
import collections
import logging
from typing import TYPE_CHECKING

import msgpack
import numpy as np
import torch

from tiers.errors import KvtierError
from tiers.journal import TAG_ANONYMOUS
from tiers.native import copy_rows
from tiers.policy import ReusePolicy
from tiers.remote import RemoteSettings, RemoteTier, block_key_bytes, record_key_bytes

from .pages import DISK, HOST
from .readiness import wait_events

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("kvtier")
MAX_LOOKUP_BLOCKS = 1024            # blocks past the local match one open asks the server about
PUT_PIECE_BYTES = 8 << 20           # a write-through batch goes out in puts this big (each hashes on the loop)


class RemoteLink:
    def __init__(self, store: "Store", settings: RemoteSettings) -> None:
        self.store, self.settings = store, settings
        self.tier: RemoteTier | None = None
        self.lcs = [lc.index for lc in store.lcs if lc.reuse is not ReusePolicy.PRIVATE]
        self.inflight = 0               # bytes reserved by write-through batches, from the move to the put's end
        self.imported_blocks = 0
        self.imported_pages = 0
        self.written_pages = 0
        self.skipped_pages = 0          # write-through past max_inflight_bytes

    async def open(self) -> None:
        store = self.store
        fingerprint = msgpack.packb([self.settings.model, store.layout.fingerprint(store.tpb, store.cfg.hash_salt)])
        self.tier = await RemoteTier.open(self.settings, fingerprint)
        if self.tier.circuit_state() != "closed":        # a typo in the URL must not look like an empty cache
            st = self.tier.stats()
            log.warning("remote tier %s unreachable at open (failures %s): requests go on without it, "
                        "retrying every %.1f s", self.settings.url or self.settings.urls,
                        {k: v for k, v in st["failures"].items() if v}, self.settings.breaker_cooldown)

    async def close(self) -> None:
        if self.tier is not None:
            await self.tier.close()

    # -- reads ------------------------------------------------------------------------------
    async def extend_match(self, sid: int, keys: list, matched: int) -> tuple[list, bool]:
        """Import the remote run after the local match of sequence ``sid``: (each imported
        block's pages per host group, whether the sequence should be matched again: blocks may
        have arrived meanwhile). The match again may stop short of them (a window's page the
        server lacked): ``count_matched`` counts those it reached."""
        try:
            return await self._extend_match(sid, keys, matched)
        except (KvtierError, OSError) as exc:      # making room failed (all locked, disk full, I/O): a miss
            log.debug("remote tier: import skipped: %r", exc)
            return [], True

    async def _extend_match(self, sid: int, keys: list, matched: int) -> tuple[list, bool]:
        store, tier = self.store, self.tier
        n = min(len(keys) - matched, MAX_LOOKUP_BLOCKS)
        if n <= 0 or tier is None or not self.lcs or tier.circuit_state() == "open":
            return [], False
        per = len(self.lcs)
        idents = [(bk, lc) for bk in map(block_key_bytes, keys[matched:matched + n]) for lc in self.lcs]
        have = await tier.exists(tier.page_keys(idents))
        run = self._run(have, matched, n)
        if run == 0 or store.closed or store.closing:
            return [], False
        core, groups = store.core, [store.group_of[HOST][lc] for lc in self.lcs]
        per_group = collections.Counter(groups)
        # at most half of each host group: the import must not evict what this request needs
        run = min([run] + [core.capacity(HOST, g) // (2 * k) for g, k in per_group.items()])
        if run <= 0:
            return [], False
        counts = {g: run * k for g, k in per_group.items()}
        slots = await store.moves.obtain_many(HOST, counts)      # evicts (and cascades) as a promotion would
        try:
            ok = await self._fetch(idents[:run * per], groups, slots)
            by_lc = [[-1] * run for _ in store.lcs]       # PRIVATE life cycles stay -1
            taken = dict.fromkeys(counts, 0)
            for idx in range(run * per):                  # ident order: the k-th page of group g has slots[g][k]
                i, j = divmod(idx, per)
                g = groups[j]
                if ok[idx]:
                    by_lc[self.lcs[j]][i] = slots[g][taken[g]]
                taken[g] += 1
            imported = 0 if store.closed else core.import_pages(sid, matched, run, HOST, by_lc)
        except BaseException:
            for g, s in slots.items():
                core.give_back(HOST, g, s)
            raise
        for g, s in slots.items():                        # groups have their own slot numbers: per group
            mine = {by_lc[lc][i] for j, lc in enumerate(self.lcs) if groups[j] == g for i in range(imported)}
            rest = [x for x in s if x not in mine]        # (-1 in mine: a page the server lacked)
            if rest:
                core.give_back(HOST, g, rest)
        # the pages of each imported block per host group: the match again counts the blocks it
        # reaches as host hits, which the store counts as remote instead
        pages = [collections.Counter(groups[j] for j, lc in enumerate(self.lcs) if by_lc[lc][i] >= 0)
                 for i in range(imported)]
        return pages, True

    def count_matched(self, pages: list[collections.Counter]) -> None:
        """The imported blocks the sequence's match reached (their pages per host group): the
        remote tier's hits."""
        self.imported_blocks += len(pages)
        self.imported_pages += sum(sum(c.values()) for c in pages)

    def _run(self, have: list[bool], matched: int, n: int) -> int:
        """The blocks the server can continue the match with (``have``: its pages, block by block,
        ``self.lcs`` within each): up to the first block that lacks a prefix-critical page or
        every page. An OPTIONAL or window page it lacks (evicted by the server's maxmemory, or
        expired) never limits a match: it is recomputed, as a local miss of it is."""
        per = len(self.lcs)
        lcs, tpb = self.store.lcs, self.store.tpb
        for i in range(n):
            row = have[i * per:(i + 1) * per]
            if all(row):
                continue
            if not any(row) or any(not ok and lcs[lc].is_prefix_critical(matched + i, tpb)
                                   for ok, lc in zip(row, self.lcs)):
                return i
        return n

    async def _fetch(self, idents: list, groups: list[int], slots: dict[int, list[int]]) -> list[bool]:
        """Each ident's page into its host slot (the i-th page of group g into slots[g][i], in
        ident order); one get per host group (a round trip per server node each)."""
        store, tier = self.store, self.tier
        per = len(self.lcs)
        ok = [False] * len(idents)
        order = sorted(set(groups))
        mine = {g: [i for i in range(len(idents)) if groups[i % per] == g] for g in order}
        outs = {g: np.empty((len(mine[g]), store.engine.cold_bytes[g]), dtype=np.uint8) for g in order}
        # the groups' fetches at once: the request waits one round trip, not one per group
        got = await asyncio.gather(*(tier.get(tier.page_keys([idents[i] for i in mine[g]]),
                                              [idents[i] for i in mine[g]], outs[g]) for g in order))
        for g, hits in zip(order, got):
            good = [k for k, hit in enumerate(hits) if hit]
            if good and not store.closed:
                slab = store.slabs[HOST][g].tensor.numpy()
                dst = np.asarray(slots[g], dtype=np.int64)[good]
                await asyncio.to_thread(copy_rows, outs[g], np.asarray(good, dtype=np.int64), slab, dst)
                for k in good:
                    ok[mine[g][k]] = True
        return ok

    # -- writes -----------------------------------------------------------------------------
    def reserve(self, pages: int, page_bytes: int) -> int:
        """Reserve write-through room for up to ``pages`` pages of ``page_bytes`` about to be
        sent: how many got it (the caller skips and counts the rest, as ``send`` does). Write-through
        never waits and keeps at most ``max_inflight_bytes`` in flight (a single page larger
        than that goes when nothing else is). All or nothing, a demotion batch of pages of
        megabytes (512 of 2 MiB: 1 GiB) never fitted the default bound."""
        if self.tier is None or pages <= 0:
            return 0
        k = min(pages, (self.settings.max_inflight_bytes - self.inflight) // max(1, page_bytes))
        if k <= 0 and not self.inflight:
            k = 1
        if k <= 0:
            return 0
        self.inflight += k * page_bytes
        return k

    def send(self, records: np.ndarray, page_bytes: int) -> np.ndarray | None:
        """Of a batch about to be sent (its journal records), the rows that got write-through
        room, ascending: its committed pages, the shallowest first when not all fit (a match
        needs a prefix whole, and the server's copy of a deep block is no hit without its
        parents). None: none got room. The uncommitted pages are never sent; the committed
        ones left out count as skipped."""
        committed = np.flatnonzero(records["ktag"] != TAG_ANONYMOUS)
        k = self.reserve(len(committed), page_bytes)
        self.skipped_pages += len(committed) - k
        if not k:
            return None
        if k < len(committed):
            committed = np.sort(committed[np.argsort(records["depth"][committed], kind="stable")[:k]])
        return committed

    def release(self, nbytes: int) -> None:
        self.inflight -= nbytes

    def write_through(self, records: np.ndarray, rows: torch.Tensor, nbytes: int) -> None:
        """Pages that just left the GPU (their journal records, their cold rows, the bytes
        reserved for them): the committed ones go to the server in the background."""
        keep = records["ktag"] != TAG_ANONYMOUS
        if not keep.any():
            self.release(nbytes)
            return
        recs = records[keep]
        data = rows.numpy()[keep] if not keep.all() else rows.numpy()
        idents = list(zip(record_key_bytes(recs), recs["lc"].tolist()))
        self.store.moves.spawn(self._put(idents, data, nbytes))

    async def _put(self, idents: list, data: np.ndarray, nbytes: int) -> None:
        tier = self.tier
        step = max(1, PUT_PIECE_BYTES // max(1, data.shape[1]))
        try:
            for a in range(0, len(idents), step):       # pieces: each put hashes its values on the loop
                part = idents[a:a + step]
                self.written_pages += await tier.put(tier.page_keys(part), part, data[a:a + step],
                                                     skip_existing=True)
        except Exception as exc:      # noqa: BLE001 - a write is best effort; the backend counts failures
            log.warning("remote tier: a write-through failed: %r", exc)
        finally:
            self.release(nbytes)

    async def write_back(self, victims) -> None:
        """Victims the last local tier is about to drop (claimed, so their slots hold still):
        their committed pages' bytes go to the server first (``write = "back"``). Best
        effort: a read or a reservation that fails leaves the drop to go on."""
        store = self.store
        core = store.core
        records = store.moves.records(victims)
        committed = int((records["ktag"] != TAG_ANONYMOUS).sum())
        if not committed or self.tier is None:
            return
        src_tier, group, src_slots, _, ready = core.batch_view(victims)
        if src_tier not in (HOST, DISK):     # a GPU drop (no colder tier could take them): hot layout, not sent
            return
        width = store.engine.cold_bytes[group]
        rows = self.send(records, width)
        if rows is None:
            return
        k = len(rows)
        nbytes, records, src_slots = k * width, records[rows], [src_slots[i] for i in rows.tolist()]
        try:
            await wait_events(store.events.all(ready))      # the last copy into them has landed
            out = torch.empty((k, width), dtype=torch.uint8)
            if src_tier == HOST:
                slab = store.slabs[HOST][group].tensor.numpy()
                await asyncio.to_thread(copy_rows, slab, np.asarray(src_slots, dtype=np.int64), out.numpy(), None)
            else:
                await asyncio.to_thread(store.disk.read, group, src_slots, out)
        except BaseException as exc:   # a corrupt or unreadable page is just not written; a cancel goes on
            self.release(nbytes)
            if not isinstance(exc, Exception):
                raise
            log.debug("remote tier: write-back skipped: %r", exc)
            return
        self.write_through(records, out, nbytes)

    def stats(self) -> dict:
        out = dict(self.tier.stats()) if self.tier is not None else {}
        out.update(imported_blocks=self.imported_blocks, imported_pages=self.imported_pages,
                   written_pages=self.written_pages,
                   skipped_pages=self.skipped_pages, inflight_bytes=self.inflight)
        return out

"""Where spills land on the disk: in runs of adjacent slots (the allocator's sweep and the
spill's least-recently-used order, allocator.hpp), so that a spill is a few sequential writes,
and every page the store keeps still reads back exact. And how the disk write thread applies
a batch of frees."""
from __future__ import annotations

import logging
import random

import numpy as np

from runtime import Store
from tiers.disk import DiskTier

from helpers import config, fill, read_all, toks


async def test_spills_land_in_runs_of_adjacent_slots_and_read_back_exact(tmp_path, monkeypatch):
    """Three disks' worth of spills: sequences are written, some read again (a hit moves the
    page off the disk, leaving a hole that a later lap of the sweep fills), the rest age out.
    Every page the store still matches reads back exact. The spills come in runs of 6.9 pages
    (36-page spills); a random slot order would give about 1."""
    runs, pages = [], []
    write = DiskTier.write

    def spy(self, group, slots, rows, records, index=None, durable=True):
        s = np.sort(np.asarray(slots))
        runs.append(1 + int((np.diff(s) != 1).sum()))
        pages.append(len(s))
        return write(self, group, slots, rows, records, index=index, durable=durable)
    monkeypatch.setattr(DiskTier, "write", spy)
    rng = random.Random(16)
    cfg = config(gpu=16, host=64, disk=2560, disk_dir=tmp_path)
    cfg.host.reserve = 0.25                     # the host spills in steps of many sequences
    async with Store.open(cfg) as store:
        written = []
        for base in range(1, 2000):
            await fill(store, toks(base, 4))
            written.append(base)
            if rng.random() < 0.3:                 # a hit on an older sequence: promoted, a hole left
                again = rng.choice(written[-700:])
                seq = await store.open_sequence(tokens=toks(again, 4))
                await seq.acquire()
                await seq.release()
                await seq.close()
        await store.drain()
        assert sum(pages) > 2 * 2560
        assert sum(pages) / sum(runs) >= 5, (sum(pages), sum(runs))
        kept = 0
        for base in written:
            matched, redo = await read_all(store, base)     # every page kept reads back exact
            kept += sum(b not in redo for b in range(matched))
        assert kept >= 2000          # the disk's pages, and the host's and GPU's
        store.check_consistency()


def test_a_batch_of_frees_is_one_call_per_group_and_a_bad_part_fails_alone(tmp_path, caplog):
    """The disk write thread frees a batch of queued frees with one DiskTier.free per group; if
    that call fails (it then changed nothing), each part goes alone, so only the bad one is lost
    and logged, as when each free was a call of its own."""
    from types import SimpleNamespace

    from runtime.moves import Moves, _FreeBatch
    from test_disk import open_tier, rec, rows_for

    tier = open_tier(tmp_path)
    try:
        width = tier.groups[0].slot_bytes
        keys = list(range(1, 11))
        tier.write(0, list(range(10)), rows_for(keys, width), [rec(k) for k in keys])
        calls = []
        free = tier.free

        def counted(group, slots):
            calls.append(list(slots))
            return free(group, slots)
        tier.free = counted
        owner = SimpleNamespace(disk=tier, engine=SimpleNamespace(io_write=SimpleNamespace(name="kvtier-disk-write")))
        batch = _FreeBatch(0, [1, 2])
        for part in ([3], [4, 5]):
            assert batch.join(0, part)
        Moves._apply_disk_frees(owner, batch)
        assert calls == [[1, 2, 3, 4, 5]]
        assert tier.live_slots(0) == [0, 6, 7, 8, 9]

        calls.clear()
        batch = _FreeBatch(0, [6])
        for part in ([3], [7]):                  # 3 is free already: that part alone fails
            assert batch.join(0, part)
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            Moves._apply_disk_frees(owner, batch)
        assert calls == [[6, 3, 7], [6], [3], [7]]
        assert tier.live_slots(0) == [0, 8, 9]
        warned = [r for r in caplog.records if "background job failed" in r.getMessage()]
        assert len(warned) == 1 and "slot 3" in warned[0].getMessage()
    finally:
        tier.close()

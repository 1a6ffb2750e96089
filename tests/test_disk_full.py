"""A full filesystem degrades the disk tier; it never fails requests (issue 12.8)."""
from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os

import torch

from runtime import DiskConfig, GpuConfig, HostConfig, LayerSpec, ReusePolicy, Store, StoreConfig
from runtime.pages import DISK, GPU, HOST
from tiers.codecs import get_codec
from tiers.errors import DiskFullError

from helpers import DEVICE, config, expected_block, fill, read_block, toks

PAGE = (("k", 2048), ("v", 2048))        # 4 KiB pages: one page per 4 KiB of segment


def _cfg(path, min_free: int) -> StoreConfig:
    return StoreConfig(layers=[LayerSpec(0, PAGE)], tokens_per_block=4, gpu=GpuConfig(slots=8, device=DEVICE),
                       host=HostConfig(slots=8), disk=DiskConfig(path=str(path), slots=4096, fsync=False,
                                                                 min_free=min_free),
                       persist_on_close=False)


def _own_writes_only(monkeypatch, path) -> int:
    """Make ``os.statvfs`` of ``path``'s filesystem report its free space as it was now, less what
    the files under ``path`` grew by since: other processes writing to the same filesystem (a
    parallel build, CI's own logs) no longer move the point where the tier finds it full.
    Returns the free bytes now."""
    real = os.statvfs
    st0 = real(path)
    free0 = st0.f_bavail * st0.f_frsize

    def used() -> int:
        return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, files in os.walk(path) for f in files)
    base = used()

    class Stat:
        def __init__(self, st) -> None:
            self.f_frsize, self.f_blocks = st.f_frsize, st.f_blocks
            self.f_bavail = max(0, free0 - (used() - base)) // st.f_frsize

    def statvfs(p):
        st = real(p)
        return Stat(st) if os.path.commonpath([os.path.abspath(p), str(path)]) == str(path) else st
    monkeypatch.setattr(os, "statvfs", statvfs)
    return free0


async def test_spills_past_a_full_disk_drop_instead_of_failing(tmp_path, caplog, monkeypatch):
    room = 24 * 4096                      # the filesystem "fills" after about 24 pages of segment
    cfg = _cfg(tmp_path, _own_writes_only(monkeypatch, tmp_path) - room)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        async with Store.open(cfg) as store:
            for base in range(40):                       # 160 blocks through 8 + 8 + (24 that fit) pages
                await fill(store, toks(base, 4))
            await store.drain()                          # spills written behind count when their write ends
            stats = store.stats()
            assert stats["disk_full"]["refused_spills"] > 0 and stats["disk_full"]["dropped_pages"] > 0
            served = 0
            for base in range(40):                       # every re-read succeeds: a hit is exact, the rest miss
                seq = await store.open_sequence(tokens=toks(base, 4))
                await seq.acquire()
                redo = seq.recompute_blocks(0)          # pages of a refused write a read had claimed
                for b in range(seq.matched_blocks):
                    if b not in redo:
                        assert torch.equal(read_block(store, seq, 0, b), expected_block(store, seq, 0, b))
                served += seq.matched_blocks - len(redo)
                await seq.extend(4 - seq.num_blocks)
                await seq.release()
                await seq.close()
            assert served > 16                           # the disk kept serving what it holds
            assert store.disk.stats["pages_read"] > 0
            await store.drain()
            store.check_consistency()
    assert "disk tier is full" in caplog.text
    assert sum("disk tier is full" in r.getMessage() for r in caplog.records) == 1     # said once, not per spill


async def test_a_full_disk_with_two_life_cycles_in_one_group(tmp_path):
    """Review find: the refused spill ended the victims' claims, then the drop of one life cycle's
    page (prefix-critical: a subtree drop) freed its sibling's slot, which was handed out again: a
    slot owned and free, and a crash in the core."""
    from helpers import two_life_cycles
    cfg = config(gpu=8, host=8, disk=256, disk_dir=tmp_path, layers=two_life_cycles(), persist_on_close=False)
    async with Store.open(cfg) as store:
        store.disk.inject_fault("write", errno.ENOSPC, count=10**6)
        for base in range(30):
            await fill(store, toks(base, 3))
            store.check_consistency()
        await store.drain()
        assert store.stats()["disk_full"]["refused_spills"] > 0
        for base in range(30):
            seq = await store.open_sequence(tokens=toks(base, 3))
            await seq.acquire()
            for lc in range(2):
                redo = seq.recompute_blocks(lc)     # pages of a refused write a read had claimed
                for b in range(seq.matched_blocks):
                    if b not in redo:
                        assert torch.equal(read_block(store, seq, lc, b), expected_block(store, seq, lc, b))
            await seq.release()
            await seq.close()
        store.check_consistency()


@contextlib.asynccontextmanager
async def two_batch_demotion(tmp_path):
    """A GPU group whose life cycles have different codecs, so two cold groups: 8 blocks filled,
    the host then full of pages in flight, and the disk's next write refused (ENOSPC). Yields the
    store, 4 claimed GPU victims, whose demotion skips to the disk in two batches, and
    ``let_go()``, which frees the host and checks consistency (called at the end if not before)."""
    kv = (("k", 256), ("v", 256))
    layers = [LayerSpec(0, kv), LayerSpec(1, kv, window_tokens=8, sink_tokens=4, codec="int8",
                                          reuse=ReusePolicy.SINK_REQUIRED_ONLY)]
    cfg = config(gpu=8, host=8, disk=64, disk_dir=tmp_path, layers=layers, persist_on_close=False)
    async with Store.open(cfg) as store:
        core, moves = store.core, store.moves
        for base in range(4):
            await fill(store, toks(base, 2))
            await store.drain()
        held = [moves.pick_victims(HOST, g, core.queue_len(HOST, g)) for g in range(2)]
        held_slots = [core.allocate(HOST, g, core.free(HOST, g)) for g in range(2)]
        victims = moves.pick_victims(GPU, 0, 4)
        store.disk.inject_fault("write", errno.ENOSPC, count=1)     # the first batch's write
        holding = [True]

        def let_go() -> None:
            if holding[0]:
                holding[0] = False
                for g in range(2):
                    moves.unclaim(held[g], None)
                    core.give_back(HOST, g, held_slots[g])
            store.check_consistency()
        yield store, victims, let_go
        let_go()


async def test_a_full_disk_refusing_one_of_a_demotions_batches(tmp_path):
    """Review find: a GPU group whose life cycles have different codecs spans two cold groups, so
    a GPU -> disk demotion runs two batches. When the disk refused one and took the other, the
    refusal re-claimed and dropped every victim, the landed ones too, whose GPU slots had gone
    back to the pool already: a slot released twice. Now the landed batch stays on the disk and
    every victim's GPU slot goes to the caller once."""
    async with two_batch_demotion(tmp_path) as (store, victims, let_go):
        core = store.core
        assert (core.n_groups(GPU), core.n_groups(DISK)) == (1, 2)
        freed = await store.moves.evict(GPU, victims)
        assert sorted(freed) == sorted(set(freed)) and len(freed) >= 4
        core.give_back(GPU, 0, freed)
        assert store.stats()["disk_full"]["refused_spills"] == 1
        let_go()
        int8, lc1 = get_codec("int8"), store.layout.life_cycles[1]
        for base in range(4):       # whatever is still matched reads back exact (life cycle 1: as int8 decodes it)
            seq = await store.open_sequence(tokens=toks(base, 2))
            await seq.acquire()
            for lc in range(2):
                redo = seq.recompute_blocks(lc)
                for b in range(seq.matched_blocks):
                    if b not in redo:
                        got, want = read_block(store, seq, lc, b), expected_block(store, seq, lc, b)
                        assert torch.equal(got, want) or lc == 1 and torch.equal(
                            got, int8.decode(int8.encode(want[None], lc1), lc1)[0])
            await seq.release()
            await seq.close()
        store.check_consistency()


async def test_refused_victims_stay_claimed_while_the_other_batch_runs(tmp_path):
    """Review find: while the demotion's other batch was still copying, the refused batch's
    pages were already unclaimed, so another eviction could claim (or a request lock) them
    before they were claimed again and dropped: a claim error, leaked slots, host slots handed
    out as GPU slots. A refused batch now keeps its claims until the demotion settles it."""
    async with two_batch_demotion(tmp_path) as (store, victims, _let_go):
        core, moves = store.core, store.moves
        real, calls, refused = moves._move_batch, [0], []

        async def second_is_slow(batch, *args):
            calls[0] += 1
            if calls[0] == 2:
                await asyncio.sleep(0.2)            # the first batch is refused meanwhile
            try:
                return await real(batch, *args)
            except DiskFullError:
                refused.extend(batch.tolist())
                raise

        moves._move_batch = second_is_slow
        evicting = asyncio.ensure_future(moves.evict(GPU, victims))
        while not refused:
            await asyncio.sleep(0.01)
        assert all(core.page_info(i)["claim"] for i in refused)
        other = moves.pick_victims(GPU, 0, core.queue_len(GPU, 0), raise_=False)   # the rest of the GPU
        assert other is None or not set(other.tolist()) & set(refused)
        freed = await evicting
        assert sorted(freed) == sorted(set(freed)) and len(freed) == 4
        core.give_back(GPU, 0, freed)
        if other is not None:
            moves.unclaim(other, None)

"""The disk scrub (runtime/scrub.py): pages damaged on disk leave the index before a request
matches them; good pages stay and read back exact, also while requests and spills run beside it."""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading

import pytest

from runtime import (ConfigError, DiskConfig, GpuConfig, HostConfig, Store, StoreClosedError, StoreConfig,
                     UsageError)
from runtime import scrub as scrub_mod
from runtime.pages import DISK

from helpers import DEVICE, check_seq, config, fill, toks


def disk_cfg(tmp_path, host: int | None = None, **disk) -> StoreConfig:
    """helpers.config's 8 GPU and 64 disk slots (and ``host`` slots), with ``disk`` settings of
    DiskConfig."""
    base = config(gpu=8)
    return StoreConfig(layers=base.layers, tokens_per_block=4, gpu=GpuConfig(slots=8, device=DEVICE),
                       host=HostConfig(slots=host) if host else None,
                       disk=DiskConfig(path=str(tmp_path), slots=64, fsync=False, **disk))


async def persisted(tmp_path, bases=range(1, 7)) -> None:
    """Chains toks(base, 4) for each base, all on disk after close."""
    async with Store.open(disk_cfg(tmp_path)) as store:
        for base in bases:
            await fill(store, toks(base, 4))


async def disk_slot(store, base: int, block: int) -> int:
    return await disk_slot_of(store, base, 4, block)


async def disk_slot_of(store, base: int, n: int, block: int) -> int:
    """The disk slot of block ``block`` of chain ``toks(base, n)`` (found by its key)."""
    seq = await store.open_sequence(tokens=toks(base, n))
    try:
        key = seq.keys[block]
    finally:
        await seq.close()
    for pid in store.core.tier_pages(DISK, 0).tolist():
        info = store.core.page_info(pid)
        if info["key"] == key:
            return info["slot"]
    raise AssertionError(f"chain {base} block {block} is not on disk")


def damage(store, slot: int) -> None:
    """Flip a byte in the middle of ``slot``'s page, in the segment file (bit rot under the store)."""
    grp = store.disk.groups[0]
    fd = os.open(grp.seg_path, os.O_RDWR)
    try:
        off = slot * grp.stride + grp.slot_bytes // 2
        b = os.pread(fd, 1, off)
        os.pwrite(fd, bytes([b[0] ^ 0xFF]), off)
        os.fsync(fd)
    finally:
        os.close(fd)


async def test_a_scrub_drops_the_damaged_pages_and_keeps_the_rest_exact(tmp_path, caplog):
    await persisted(tmp_path)
    async with Store.open(disk_cfg(tmp_path)) as store:
        for base in (2, 5):
            damage(store, await disk_slot(store, base, 3))          # the last block of two chains
        damage(store, await disk_slot(store, 4, 1))                 # a middle block: its child goes too
        assert store.stats()["discarded_pages"] == 0
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            got = await store.scrub()
        assert got["checked_pages"] == 24 and got["discarded_pages"] == 3 and got["error"] is None
        assert "3 of 24 page(s) were bad" in caplog.text
        st = store.stats()
        assert st["discarded_pages"] == 3 and st["disk"]["verified_pages"] == 24
        assert st["scrub"] == {"running": False, "passes": 1, "checked_pages": 24, "discarded_pages": 3,
                               "seconds": st["scrub"]["seconds"]}
        store.check_consistency()
        for base, matched in ((1, 4), (2, 3), (3, 4), (4, 1), (5, 3), (6, 4)):
            seq = await store.open_sequence(tokens=toks(base, 4))
            assert seq.matched_by_tier["disk"] == matched, base      # what the index says is what holds
            await seq.close()
            assert await check_seq(store, base) == matched
        assert store.stats()["corrupt_pages"] == 0                   # no read found a bad page: the scrub did
        on_disk = len(store.core.tier_pages(DISK, 0).tolist())        # the reads promoted some
        again = await store.scrub()
        assert again["discarded_pages"] == 0 and again["checked_pages"] == on_disk


async def test_routers_see_the_scrub_drop_what_it_found_bad(tmp_path):
    """KV events: the damaged page's block leaves the disk in the routers' view too."""
    from runtime import EventsConfig
    from test_kv_events import RouterIndex
    await persisted(tmp_path)
    cfg = disk_cfg(tmp_path)
    cfg.events = EventsConfig()
    async with Store.open(cfg) as store:
        index = RouterIndex()
        index.feed(store)
        on_disk = {h for h, medium, _ in index.held if medium == "DISK"}
        assert len(on_disk) == 24
        damage(store, await disk_slot(store, 1, 3))
        assert (await store.scrub())["discarded_pages"] == 1
        index.feed(store)
        assert index.held == store.kv_events.holdings()
        assert len({h for h, medium, _ in index.held if medium == "DISK"}) == 23


async def test_a_bad_clean_copy_is_freed_and_its_primary_stays(tmp_path):
    """Write-through: a damaged disk copy leaves (routers see the disk lose the block), its
    primary stays on the GPU, and a later demotion writes the page again instead of taking
    over the bad bytes (without the scrub it was read back bad and dropped)."""
    from runtime import EventsConfig
    from test_kv_events import RouterIndex
    cfg = disk_cfg(tmp_path, write="through")
    cfg.events = EventsConfig()
    async with Store.open(cfg) as store:
        index = RouterIndex()
        for base in (1, 2):
            await fill(store, toks(base, 4))
        await store.drain()
        copies = [pid for pid in store.core.tier_pages(DISK, 0).tolist() if store.core.page_info(pid)["copy"]]
        assert len(copies) == 8                                       # both chains, still on the GPU
        seq = await store.open_sequence(tokens=toks(1, 4))
        key = seq.keys[3]
        await seq.close()
        bad = next(pid for pid in copies if store.core.page_info(pid)["key"] == key)
        damage(store, store.core.page_info(bad)["slot"])
        index.feed(store)
        got = await store.scrub()
        assert got["checked_pages"] == 8 and got["discarded_pages"] == 1
        store.check_consistency()
        index.feed(store)
        assert index.held == store.kv_events.holdings()
        assert sum(medium == "DISK" for _, medium, _ in index.held) == 7
        seq = await store.open_sequence(tokens=toks(1, 4))
        assert seq.matched_by_tier["gpu"] == 4                         # the primaries stay
        await seq.close()
        for base in range(3, 7):                                      # push chains 1 and 2 to the disk
            await fill(store, toks(base, 4))
        assert await check_seq(store, 1) == 4
        assert await check_seq(store, 2) == 4
        assert store.stats()["corrupt_pages"] == 0
        store.check_consistency()


async def test_scrub_on_open_runs_in_the_background(tmp_path):
    await persisted(tmp_path)
    async with Store.open(disk_cfg(tmp_path)) as store:
        damage(store, await disk_slot(store, 3, 2))
    async with Store.open(disk_cfg(tmp_path, scrub="on_open")) as store:
        assert store.stats()["scrub"]["running"]
        got = await store.scrub()                                   # joins the pass open started
        assert got["discarded_pages"] == 1 and store.stats()["scrub"]["passes"] == 1
        seq = await store.open_sequence(tokens=toks(3, 4))
        assert seq.matched_by_tier["disk"] == 2
        await seq.close()


async def test_requests_and_spills_beside_a_scrub_stay_exact(tmp_path, monkeypatch):
    """Pieces of 2 pages, so the scrub's claims interleave with acquires of disk pages, spills
    from the host (written behind: the scrub waits for each write) and drops of disk victims."""
    monkeypatch.setattr(scrub_mod, "PIECE_BYTES", 2 * 512)
    await persisted(tmp_path)
    async with Store.open(disk_cfg(tmp_path, host=8, scrub_rate="1GB")) as store:
        damage(store, await disk_slot(store, 6, 3))

        async def load() -> None:
            for rnd in range(3):
                for base in range(1, 16):
                    await fill(store, toks(base, 4))
                    await asyncio.sleep(0)
        results = await asyncio.gather(load(), store.scrub(), return_exceptions=True)
        assert results == [None, results[1]] and results[1]["error"] is None, results
        await store.drain()
        store.check_consistency()
        assert store.stats()["scrub"]["discarded_pages"] <= 1        # chain 6 may have been rewritten first
        again = await store.scrub()
        assert again["discarded_pages"] == 0
        for base in range(1, 16):
            await check_seq(store, base)                             # every page it serves, exact
        store.check_consistency()


async def scrub_held_in_its_read(store, monkeypatch) -> tuple[asyncio.Future, threading.Event]:
    """A scrub started and held in its first piece's read (its pages claimed) until the returned
    event is set."""
    gate, entered = threading.Event(), threading.Event()
    real = store.disk.verify

    def held(g, slots):
        entered.set()
        gate.wait(10)
        return real(g, slots)
    monkeypatch.setattr(store.disk, "verify", held)
    scrub = asyncio.ensure_future(store.scrub())
    assert await asyncio.to_thread(entered.wait, 10)
    return scrub, gate


async def test_a_request_waits_for_the_piece_the_scrub_holds(tmp_path, monkeypatch):
    """The piece's pages are claimed while a thread checks them: an acquire of one waits, then
    finds the damaged page gone (a recompute) instead of reading it itself."""
    await persisted(tmp_path)
    async with Store.open(disk_cfg(tmp_path)) as store:
        damage(store, await disk_slot(store, 2, 3))
        scrub, gate = await scrub_held_in_its_read(store, monkeypatch)
        seq = await store.open_sequence(tokens=toks(2, 4))
        acquire = asyncio.ensure_future(seq.acquire())
        await asyncio.sleep(0.05)
        assert not acquire.done()
        gate.set()
        got = await scrub
        await acquire
        assert got["discarded_pages"] == 1 and seq.recompute_blocks(0) == [3]
        assert store.stats()["corrupt_pages"] == 0                   # the acquire never read it
        await seq.close()
        store.check_consistency()


async def test_an_eviction_never_takes_the_pages_a_scrub_holds(tmp_path, monkeypatch):
    """Review find: the scrub's claim left its pages on the disk's eviction queue, so a spill into
    a full disk dropped them under the read (their ids recycled, the scrub's unclaim then ended
    other pages' claims: a crash)."""
    await persisted(tmp_path)                               # 24 pages
    cfg = disk_cfg(tmp_path)
    cfg.disk.slots = 24                                     # the disk full of them
    async with Store.open(cfg) as store:
        core = store.core
        scrub, gate = await scrub_held_in_its_read(store, monkeypatch)
        held_pages = core.tier_pages(DISK, 0).tolist()
        assert len(held_pages) == 24 and core.queue_len(DISK, 0) == 0
        store.check_consistency()                           # claimed pages are off the queue
        for base in range(20, 24):
            await fill(store, toks(base, 4))                # GPU victims cannot spill: dropped instead
        assert core.tier_pages(DISK, 0).tolist() == held_pages
        gate.set()
        assert (await scrub)["checked_pages"] == 24
        store.check_consistency()
        assert core.queue_len(DISK, 0) == 24                # back on the queue
        for base in range(1, 7):
            await check_seq(store, base)                    # what is matched reads back exact
        store.check_consistency()


async def test_closing_during_a_scrub_ends_it_and_keeps_every_page(tmp_path, monkeypatch):
    monkeypatch.setattr(scrub_mod, "PIECE_BYTES", 512)
    await persisted(tmp_path)
    async with Store.open(disk_cfg(tmp_path, scrub="on_open", scrub_rate="4KB")) as store:
        waiter = asyncio.ensure_future(store.scrub())               # joins the pass open started
        await asyncio.sleep(0.05)                                   # a few pieces in, then close
        assert store.stats()["scrub"]["running"]
    got = await waiter              # second review: the close cancelled the waiter, which nobody had
    assert 0 < got["checked_pages"] < 24 and "StoreClosedError" in got["error"]
    async with Store.open(disk_cfg(tmp_path)) as store:
        got = await store.scrub()
        assert got["checked_pages"] == 24 and got["discarded_pages"] == 0
        for base in range(1, 7):
            assert await check_seq(store, base) == 4


async def nothing_left_unwritten(store, got: dict) -> None:
    """After a scrub that met failed writes behind: it ended well and dropped their pages, no
    indexed disk page names a slot without a page, and the chains still read back exact."""
    assert got["error"] is None and got["discarded_pages"] > 0, got
    await store.drain()
    store.check_consistency()
    live = set(store.disk.live_slots(0))
    assert all(store.core.page_info(p)["slot"] in live for p in store.core.tier_pages(DISK, 0).tolist())
    for base in (1, 2, 3, 4, 9):
        await check_seq(store, base)


async def test_a_scrub_drops_what_a_failed_write_behind_left(tmp_path):
    """Review find: a page whose write behind failed while the scrub held it (so the store's
    failure handler left it to the holder) stayed in the index, and the error ended the pass."""
    cfg = disk_cfg(tmp_path, host=8)
    async with Store.open(cfg) as store:
        for base in range(1, 5):
            await fill(store, toks(base, 4))
        await store.drain()
        gate, entered = threading.Event(), threading.Event()
        real = store.disk.write

        def write(group, slots, rows, records, durable=True, **kw):
            if not durable:                                 # a write behind
                entered.set()
                gate.wait(10)
                raise OSError(errno.EIO, "injected")
            return real(group, slots, rows, records, durable=durable, **kw)
        store.disk.write = write
        await fill(store, toks(9, 4))                       # spills host pages, written behind
        assert await asyncio.to_thread(entered.wait, 5)
        scrub = asyncio.ensure_future(store.scrub())
        await asyncio.sleep(0.05)                           # it holds the pages whose write is failing
        gate.set()
        got = await scrub
        store.disk.write = real
        await nothing_left_unwritten(store, got)


async def test_a_write_behind_that_never_ran_is_a_bad_page_too(tmp_path):
    """Second review find: a write behind whose wait failed (a CUDA fence's device error,
    emulated) never ran; its event failed before its slot was forgotten (the forget is queued on
    the write stream), so the scrub found the slot neither live nor forgotten: a UsageError that
    ended the pass, its pages left indexed. It now lets the stream run the forget and checks again."""
    from tiers.streams import HostEvent
    cfg = disk_cfg(tmp_path, host=8)
    async with Store.open(cfg) as store:
        for base in range(1, 5):
            await fill(store, toks(base, 4))
        await store.drain()
        io = store.engine.io_write

        class FailingFence(HostEvent):
            def synchronize(self, timeout=None):
                super().synchronize(timeout)
                if self.error is not None:
                    raise self.error
        fence = FailingFence()
        io.wait_event(fence)                                # the spills' writes queue behind it
        await fill(store, toks(9, 4))                       # spills host pages, written behind
        gate = threading.Event()
        io.submit(lambda: gate.wait(10), event=False)       # work ahead of the forget to come
        scrub = asyncio.ensure_future(store.scrub())
        await asyncio.sleep(0.05)                           # it holds the pages, waits for their write
        fence.set(OSError(errno.EIO, "injected: the fence failed"))
        await asyncio.sleep(0.05)
        gate.set()
        got = await scrub
        await nothing_left_unwritten(store, got)


async def test_no_scrub_starts_once_the_store_closes(tmp_path):
    await persisted(tmp_path)
    store = Store.open(disk_cfg(tmp_path))
    await store.__aenter__()
    closing = asyncio.ensure_future(store.close())
    await asyncio.sleep(0)
    with pytest.raises(StoreClosedError):
        await store.scrub()
    await closing


async def test_an_acquire_whose_fresh_pages_outnumber_the_gpu_is_too_large(tmp_path):
    """Review find: an acquire whose matched pages were all dropped (here by the scrub) needs
    fresh pages for each; more than the GPU group holds was an OutOfPagesError a server retries."""
    from runtime import RequestTooLargeError
    cfg = disk_cfg(tmp_path)
    cfg.gpu.slots = 16
    async with Store.open(cfg) as store:
        await fill(store, toks(1, 12))
    async with Store.open(disk_cfg(tmp_path)) as store:    # 8 GPU slots
        for b in range(12):
            damage(store, await disk_slot_of(store, 1, 12, b))
        seq = await store.open_sequence(tokens=toks(1, 12))
        assert seq.matched_by_tier["disk"] == 12
        assert (await store.scrub())["discarded_pages"] == 12
        with pytest.raises(RequestTooLargeError, match="12 new pages of GPU pool group 0, which holds 8"):
            await seq.acquire()
        await seq.close()
        store.check_consistency()


async def test_scrub_config_and_misuse(tmp_path):
    with pytest.raises(ConfigError, match="tiers.disk.scrub: expected 'off' or 'on_open'"):
        disk_cfg(tmp_path, scrub="always")
    with pytest.raises(ConfigError, match="tiers.disk.scrub_rate"):
        disk_cfg(tmp_path, scrub_rate="-1MB")
    async with Store.open(config(gpu=8)) as store:
        with pytest.raises(UsageError, match="no disk tier"):
            await store.scrub()

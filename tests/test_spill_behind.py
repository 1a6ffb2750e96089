"""Spills written behind (migration.MigrationEngine._spill_behind): a small spill of pages the
store may lose lands before its disk write; reads wait for the write; a write that fails loses
only those pages, each dropped when next read."""
from __future__ import annotations

import asyncio
import errno
import logging
import threading
import time

import numpy as np
import pytest
import torch

from runtime import Store, TierIOError, migration
from runtime.stats import MoveStats
from tiers.streams import HostEvent

from helpers import config, expected_block, fill, fill_and_hold_writer, read_all, read_block, toks, write_blocks


@pytest.mark.parametrize("staged", [True, False])
async def test_a_spill_lands_before_its_write_and_a_read_waits_for_the_write(tmp_path, staged):
    """A read of a page whose write is queued copies the write's staged rows (or, with that off,
    as under write-through, waits for the write on the read thread)."""
    async with Store.open(config(gpu=4, host=4, disk=64, disk_dir=tmp_path)) as store:
        if not staged:
            store.engine.staged = None
        for base in range(1, 3):
            await fill(store, toks(base, 4))
        await store.drain()
        gate = threading.Event()
        held = store.engine.io_write.submit(gate.wait)      # the disk writer is busy
        try:
            # base 3 pushes base 1 from the host to the disk: done while the writer is held
            await asyncio.wait_for(fill(store, toks(3, 4)), 10)
            assert store.engine.behind and not held.query()
            assert store.stats()["tiers"]["disk"]["groups"][0]["used"] == 4
            seq = await store.open_sequence(tokens=toks(1, 4))
            assert seq.matched_blocks == 4 and seq.matched_by_tier["disk"] == 4
            reading = asyncio.ensure_future(seq.acquire())
            await asyncio.sleep(0.05)
            assert reading.done() == staged                 # from the staged rows, or after the write
            assert not held.query()
        finally:
            gate.set()
        await asyncio.wait_for(reading, 10)
        for b in range(4):
            assert torch.equal(read_block(store, seq, 0, b), expected_block(store, seq, 0, b))
        await seq.release()
        await seq.close()
        await store.drain()
        assert not store.engine.behind
        store.check_consistency()
        moves = store.stats()["moves"]["host->disk"]
        assert moves["pages"] >= 4 and moves["failures"] == 0 and moves["bandwidth_gbps"] > 0


async def test_a_demotion_takes_the_host_slots_of_a_spill_whose_write_is_queued(tmp_path):
    """The point of writing behind: host slots come free when the rows are copied out, so a
    GPU demotion behind a spill does not wait for the disk."""
    async with Store.open(config(gpu=4, host=4, disk=64, disk_dir=tmp_path)) as store:
        await fill(store, toks(1, 4))
        await fill(store, toks(2, 4))
        await store.drain()
        gate = threading.Event()
        store.engine.io_write.submit(gate.wait)
        try:
            for base in range(3, 7):                        # four spills of four pages queue up
                await asyncio.wait_for(fill(store, toks(base, 4)), 10)
            assert len(store.engine.behind) >= 3
        finally:
            gate.set()
        await store.drain()
        store.check_consistency()
        for base in range(1, 7):
            matched, redo = await read_all(store, base)
            assert matched == 4 and not redo


@pytest.mark.parametrize("err,full", [(errno.EIO, False), (errno.ENOSPC, True)])
async def test_a_failed_write_behind_loses_only_its_pages(tmp_path, err, full):
    async with Store.open(config(gpu=4, host=4, disk=64, disk_dir=tmp_path)) as store:
        for base in range(1, 5):
            await fill(store, toks(base, 4))                # bases 1..2 on the disk
        await store.drain()
        store.disk.inject_fault("write", err)
        await fill(store, toks(5, 4))                       # base 3 spills; its write fails: no error here
        await store.drain()
        st = store.stats()
        assert st["moves"]["host->disk"]["failures"] == 1
        assert st["disk"]["discarded"] == 4
        assert st["disk_full"]["refused_spills"] == (1 if full else 0)
        store.check_consistency()
        for base in (1, 2, 4, 5):                           # everything else reads back exact
            matched, redo = await read_all(store, base)
            assert matched == 4 and not redo
        matched, redo = await read_all(store, 3)           # the lost pages were dropped: a miss
        assert matched == 0 and store.stats()["corrupt_pages"] == 0
        store.check_consistency()
        await fill(store, toks(3, 4))                       # recomputed, and the tier takes spills again
        for base in range(6, 9):
            await fill(store, toks(base, 4))
        await store.drain()
        matched, redo = await read_all(store, 3)
        assert matched == 4 and not redo
        store.check_consistency()


async def _spill_failing_behind_a_held_writer(store) -> threading.Event:
    """Bases 1 and 2 committed, then base 1 spilled to the disk behind a held write thread, its
    write set to fail; returns the gate that lets the thread go (the caller sets it)."""
    gate = await fill_and_hold_writer(store, range(1, 3))
    store.disk.inject_fault("write", errno.EIO)
    await fill(store, toks(3, 4))
    return gate


async def test_a_read_waiting_for_a_write_behind_that_fails_recomputes_its_blocks(tmp_path):
    """A page claimed by a read when its write fails is not dropped under the read: the read
    finds the slot forgotten (CorruptPageError) and drops it, and the acquire recomputes. (With
    reads from the staged rows on, as by default without write-through, the read would not wait:
    test_a_read_from_the_staged_rows_keeps_a_page_whose_write_then_fails.)"""
    async with Store.open(config(gpu=4, host=4, disk=64, disk_dir=tmp_path)) as store:
        store.engine.staged = None
        gate = await _spill_failing_behind_a_held_writer(store)
        try:
            seq = await store.open_sequence(tokens=toks(1, 4))
            assert seq.matched_by_tier["disk"] == 4
            reading = asyncio.ensure_future(seq.acquire())
            await asyncio.sleep(0.05)
            assert not reading.done()
        finally:
            gate.set()
        await asyncio.wait_for(reading, 10)
        assert seq.recompute_blocks(0) == [0, 1, 2, 3]
        await seq.extend(0)
        await seq.release()
        await seq.close()
        await store.drain()
        st = store.stats()
        assert st["corrupt_pages"] == 4 and st["moves"]["host->disk"]["failures"] == 1
        store.check_consistency()
        for base in (2, 3):
            matched, redo = await read_all(store, base)
            assert matched == 4 and not redo


async def test_a_read_from_the_staged_rows_keeps_a_page_whose_write_then_fails(tmp_path):
    async with Store.open(config(gpu=4, host=4, disk=64, disk_dir=tmp_path)) as store:
        gate = await _spill_failing_behind_a_held_writer(store)
        try:
            matched, redo = await read_all(store, 1)       # back on the GPU from the staged rows
            assert matched == 4 and not redo
        finally:
            gate.set()
        await store.drain()
        st = store.stats()
        assert st["moves"]["host->disk"]["failures"] == 1 and st["corrupt_pages"] == 0
        store.check_consistency()
        for base in (1, 2, 3):                              # base 1 was promoted before the write failed
            matched, redo = await read_all(store, base)
            assert matched == 4 and not redo


async def test_a_spill_above_the_limit_waits_for_its_write(tmp_path, monkeypatch):
    """Spills above BEHIND_BYTES are not written behind (their gather would hold the loop); nor
    are pages the store may not lose (test_uncommitted_pages_are_not_written_behind...)."""
    monkeypatch.setattr(migration, "BEHIND_BYTES", 4 * 512 - 1)     # under one spill of 4 pages
    async with Store.open(config(gpu=4, host=4, disk=64, disk_dir=tmp_path)) as store:
        gate = await fill_and_hold_writer(store, range(1, 3))
        try:
            more = asyncio.ensure_future(fill(store, toks(3, 4)))
            await asyncio.sleep(0.05)
            assert not more.done() and not store.engine.behind      # the spill waits for the writer
        finally:
            gate.set()
        await asyncio.wait_for(more, 10)
        await store.drain()
        store.check_consistency()
        for base in range(1, 4):
            matched, redo = await read_all(store, base)
            assert matched == 4 and not redo


async def test_uncommitted_pages_are_not_written_behind_and_survive_a_failed_spill(tmp_path):
    """A released sequence's uncommitted pages may not be lost (Core.droppable): their spill
    waits for its write, whose failure leaves them where they were (found in review: with the
    gate forced open they were dropped and recomputed)."""
    async with Store.open(config(gpu=4, host=4, disk=64, disk_dir=tmp_path)) as store:
        a = await store.open_sequence(tokens=toks(100, 4))
        await a.acquire()
        await a.extend(4)
        write_blocks(store, a, range(4))
        a.commit(2)
        await a.release()                                   # open and released: blocks 2, 3 uncommitted
        store.disk.inject_fault("write", errno.EIO)
        for base in range(1, 4):                            # a's pages go down; one spill fails
            try:
                await fill(store, toks(base, 4))
            except TierIOError:
                pass                                        # the spill that waited for its write
        await store.drain()
        await a.acquire()
        assert a.recompute_blocks(0) == [] and a.num_blocks == 4
        for b in range(4):
            assert torch.equal(read_block(store, a, 0, b), expected_block(store, a, 0, b))
        await a.release()
        await a.close()
        store.check_consistency()


async def test_a_write_that_fails_before_its_pages_land_still_drops_them(tmp_path, monkeypatch):
    """The write thread may finish (and fail) before the loop lands the batch: the pages' ready
    event must still be registered for Core.discard_unwritten to find them (found in review)."""
    async with Store.open(config(gpu=4, host=4, disk=64, disk_dir=tmp_path)) as store:
        for base in range(1, 5):
            await fill(store, toks(base, 4))
        await store.drain()
        record = MoveStats.record

        def slow_record(self, src, dst, *a):                # the loop is slow to land a spill
            if (src, dst) == ("host", "disk"):
                time.sleep(0.05)
            record(self, src, dst, *a)
        monkeypatch.setattr(MoveStats, "record", slow_record)
        store.disk.inject_fault("write", errno.EIO)
        await fill(store, toks(5, 4))                       # base 3's spill fails before it lands
        await store.drain()
        assert store.stats()["moves"]["host->disk"]["failures"] == 1
        matched, redo = await read_all(store, 3)
        assert matched == 0 and not redo                    # dropped: a miss, not a recompute
        store.check_consistency()


async def test_closing_with_failing_writes_behind_queued_is_clean(tmp_path, caplog):
    """Closing waits for the writes behind even without persisting; one that fails then is
    handled while the store is still open (found in review: a free submitted to a closed stream)."""
    cfg = config(gpu=4, host=4, disk=64, disk_dir=tmp_path, persist_on_close=False)
    with caplog.at_level(logging.WARNING):
        async with Store.open(cfg) as store:
            for base in range(1, 3):
                await fill(store, toks(base, 4))
            await store.drain()
            gate = threading.Event()
            store.engine.io_write.submit(gate.wait)
            store.disk.inject_fault("write", errno.EIO, count=10)
            for base in range(3, 6):
                await fill(store, toks(base, 4))            # spills queue behind the held writer
            assert store.engine.behind
            asyncio.get_running_loop().call_later(0.05, gate.set)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    async with Store.open(config(gpu=4, host=4, disk=64, disk_dir=tmp_path)) as store:
        store.check_consistency()


async def test_persisting_at_close_journals_the_spills_written_behind(tmp_path):
    """An end-to-end check: every page of a store closed with writes behind queued is there after
    a restart (closing runs the queued writes, and the disk tier's close journals them)."""
    cfg = config(gpu=4, host=4, disk=64, disk_dir=tmp_path)
    async with Store.open(cfg) as store:
        for base in range(1, 9):
            await fill(store, toks(base, 4))
    async with Store.open(config(gpu=4, host=4, disk=64, disk_dir=tmp_path)) as store:
        assert store.stats()["recovered_pages"] == 32
        for base in range(1, 9):
            matched, redo = await read_all(store, base)
            assert matched == 4 and not redo


async def test_a_slot_two_queued_writes_fill_is_never_read_from_staged_rows(tmp_path):
    """Page A written behind to slot 3 (with C to slot 7), A promoted from the staged rows, slot 3
    reused by B's write behind: a promotion of B and C together names both writes, and the rows
    of slot 3 in the first would be A's (found in review). It reads the disk instead."""
    async with Store.open(config(gpu=4, host=4, disk=64, disk_dir=tmp_path)) as store:
        eng, width = store.engine, store.engine.cold_bytes[0]
        old, new = HostEvent(), HostEvent()             # two writes, still queued
        rows_old = np.full((2, width), 0xAA, np.uint8)
        rows_old[1] = 0xCC
        eng.staged[old] = (0, np.array([3, 7], dtype=np.int64), rows_old, lambda: None)
        eng.staged[new] = (0, np.array([3], dtype=np.int64), np.full((1, width), 0xBB, np.uint8), lambda: None)
        try:
            out = np.zeros((2, width), np.uint8)
            for deps in ([old, new], [new, old]):
                assert not eng._read_staged(0, [3, 7], out, deps)
            assert eng._read_staged(0, [7], out[:1], [old]) and (out[0] == 0xCC).all()
            assert eng._read_staged(0, [3], out[:1], [new]) and (out[0] == 0xBB).all()
            old.set()                                   # written: the disk has it, not the record
            assert not eng._read_staged(0, [7], out[:1], [old])
        finally:
            eng.staged.clear()

"""Cancellation never wedges the store (issue 12.9): a caller that gives up
on drain, close or acquire takes nothing down with it."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from runtime import OutOfPagesError, Store, StoreClosedError, migration
from runtime.sequence import Sequence

from helpers import (DEVICE, check_seq, config, expected_block, fill, fill_and_hold_writer, half_inline_layers, read_block,
                     toks, write_blocks)
from runtime.pages import GPU

pytestmark = pytest.mark.skipif(DEVICE == "cuda", reason="gates the emulated streams' worker threads")


async def _check_all(store, bases) -> None:
    for base in bases:
        seq = await store.open_sequence(tokens=toks(base, 4))
        assert seq.matched_blocks == 4, base
        await seq.acquire()
        for b in range(4):
            assert torch.equal(read_block(store, seq, 0, b), expected_block(store, seq, 0, b))
        await seq.release()
        await seq.close()


async def test_a_cancelled_drain_cancels_no_move(tmp_path, monkeypatch):
    """drain() used to gather the store's tasks: cancelling it cancelled the moves it waited for,
    and later operations failed with 'slot ... holds a live page'."""
    monkeypatch.setattr(migration, "BEHIND_BYTES", 0)   # spills wait for their writes (none behind)
    async with Store.open(config(gpu=4, host=4, disk=64, disk_dir=tmp_path)) as store:
        for base in range(1, 3):
            await fill(store, toks(base, 4))
        gate = threading.Event()
        store.engine.io_write.submit(gate.wait)          # the disk writer is busy: spills queue up
        more = asyncio.ensure_future(fill(store, toks(3, 4)))      # needs a spill to disk
        await asyncio.sleep(0.02)
        assert store.moves.tasks and not more.done()
        drain = asyncio.ensure_future(store.drain())
        await asyncio.sleep(0.02)
        drain.cancel()
        with pytest.raises(asyncio.CancelledError):
            await drain
        assert store.moves.tasks and not any(t.cancelled() for t in store.moves.tasks)
        gate.set()
        await asyncio.wait_for(more, 10)                 # (it used to wedge here)
        await fill(store, toks(4, 4))
        await asyncio.wait_for(store.drain(), 10)
        store.check_consistency()
        for base in range(5, 12):
            await fill(store, toks(base, 4))
        await _check_all(store, range(1, 12))
    async with Store.open(config(gpu=4, host=4, disk=64, disk_dir=tmp_path)) as store:
        assert store.stats()["recovered_pages"] == 44
        await _check_all(store, range(1, 12))


async def test_a_cancelled_close_still_closes(tmp_path, monkeypatch):
    """Cancelling close() used to cancel the store's tasks: a request that cancelled nothing got
    CancelledError, and pages in flight were lost to the restart."""
    monkeypatch.setattr(migration, "BEHIND_BYTES", 0)   # spills wait for their writes (none behind)
    store = await Store.open(config(gpu=8, host=8, disk=64, disk_dir=tmp_path))
    for base in range(1, 8):
        await fill(store, toks(base, 4))
    gate = threading.Event()
    store.engine.io_write.submit(gate.wait)
    other = asyncio.ensure_future(fill(store, toks(8, 4)))     # another caller's request, waiting on a spill
    await asyncio.sleep(0.02)
    assert not other.done()
    closing = asyncio.ensure_future(store.close())
    await asyncio.sleep(0.02)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    gate.set()
    await other                                          # it completes: nobody cancelled it
    await store.close()                                  # waits for the close under way
    assert store.closed
    async with Store.open(config(gpu=8, host=8, disk=64, disk_dir=tmp_path)) as again:
        assert again.stats()["recovered_pages"] == 32    # every committed page was persisted
        await _check_all(again, range(1, 9))


async def test_an_acquire_cancelled_as_it_finishes_leaves_nothing_locked(monkeypatch):
    """The acquire's task finished in the same loop iteration as its caller was cancelled: the
    caller saw CancelledError but the sequence stayed acquired with its pages locked. (Its copy
    goes to the copy thread, so that the acquire waits and runs on as a task.)"""
    monkeypatch.setattr(migration, "INLINE_BYTES", 0)
    async with Store.open(config(gpu=4, host=16)) as store:
        await fill(store, toks(1, 4))
        await fill(store, toks(2, 4))                    # sequence 1's pages went to the host
        seq = await store.open_sequence(tokens=toks(1, 4))
        task = asyncio.ensure_future(seq.acquire())
        while seq.task is None or not seq.task.done():   # run until the inner task is done ...
            await asyncio.sleep(0)
        task.cancel()                                    # ... and cancel the caller before it resumes
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not seq.acquired and not seq.busy
        assert all(p.locks == 0 for row in seq.pages for p in row)
        await seq.acquire()                              # and it can be acquired again
        for b in range(4):
            assert torch.equal(read_block(store, seq, 0, b), expected_block(store, seq, 0, b))
        await seq.release()
        await seq.close()
        store.check_consistency()


async def test_start_after_close_is_refused_and_holds_no_lock(tmp_path):
    store = Store.open(config(gpu=4, disk=16, disk_dir=tmp_path))
    await store.close()                                  # never started
    with pytest.raises(StoreClosedError):
        await store.start()
    async with Store.open(config(gpu=4, disk=16, disk_dir=tmp_path)):
        pass                                             # the directory's lock is free


async def test_drain_after_close_returns_even_if_a_reclaimer_was_woken(tmp_path):
    """A reclaimer stopped by close() keeps its wake flag if it was set just before: drain() must
    not wait for a task that no longer runs (found in review)."""
    cfg = config(gpu=64, host=64)
    cfg.gpu.reserve = 0.05                  # a reserve of 3 slots: the GPU group gets a reclaimer
    store = await Store.open(cfg)
    await fill(store, toks(1, 4))
    await store.close()
    assert store.reclaimers
    for r in store.reclaimers.values():
        r.wake.set()
    await asyncio.wait_for(store.drain(), 2)


async def test_a_long_sequence_cancelled_at_its_yield_changed_nothing():
    """A call on a sequence of LONG_BLOCKS or more yields to the loop before its core call, so
    one long request does not hold the loop through all its operations; a caller cancelled at
    that yield has changed nothing (and the sequence goes on). close() yields after closing."""
    from runtime.sequence import LONG_BLOCKS
    n = LONG_BLOCKS + 8
    async with Store.open(config(gpu=n, tpb=1, layers=None)) as store:
        seq = await store.open_sequence(block_keys=list(range(1, n + 1)))
        for call in (lambda: seq.extend(n), lambda: seq.acquire()):
            task = asyncio.ensure_future(call())
            await asyncio.sleep(0)                # the task runs to its yield
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert seq.num_blocks == 0 and not seq.acquired and not seq.busy
        await seq.extend(n)
        seq.commit(n)
        await seq.acquire()
        task = asyncio.ensure_future(seq.release())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seq.acquired                       # still locked: the release never ran
        task = asyncio.ensure_future(seq.close())           # close yields after closing, not before
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seq.closed                                    # a cancelled close still closed: no leak
        assert store.stats()["tiers"]["gpu"]["groups"][0]["locked"] == 0
        again = await store.open_sequence(block_keys=list(range(1, n + 1)))
        assert again.matched_blocks == n
        await again.close()


async def test_an_extend_cancelled_while_its_slots_fences_are_pending_changed_nothing():
    """Review finds: the fast path's extend, cancelled while it waited for its new slots' fences
    (the copies still reading them, on CUDA), left the sequence extended where the slow path
    undoes it; undone at once, its slots went back unfenced and another extend took them while
    the copy still read them. The undo now waits for the fences. Here a job held on a copy
    stream is the fence of every free GPU slot."""
    async with Store.open(config(gpu=8)) as store:
        gate = threading.Event()
        reading = store.engine.down.submit(gate.wait)       # a copy still reading the slots
        try:
            slots = store.core.allocate(GPU, 0, store.core.free(GPU, 0))
            store.core.release_slots(GPU, 0, slots, store.events.id(reading))
            seq = await store.open_sequence(tokens=toks(1, 2))
            task = asyncio.ensure_future(seq.extend(2))
            await asyncio.sleep(0.05)
            assert not task.done()                          # waiting for the fence
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert seq.busy                                 # its undo waits for the copy
            assert all(store.core.slot_fences(GPU, 0, [s]) for s in range(8))     # no slot lost its fence
            other = await store.open_sequence(tokens=toks(2, 2))
            taking = asyncio.ensure_future(other.extend(2))
            await asyncio.sleep(0.05)
            assert not taking.done()                        # the copy still reads whatever slots it got
        finally:
            gate.set()
        await asyncio.wait_for(taking, 10)
        await other.close()
        await asyncio.sleep(0.05)
        assert seq.num_blocks == 0 and not seq.busy
        store.check_consistency()
        await seq.extend(2)
        write_blocks(store, seq, range(2))
        seq.commit(2)
        await seq.close()
        assert await check_seq(store, 1, 2) == 2
        store.check_consistency()


def _run_now(coro):
    """Run a coroutine that must finish without suspending (a store fast path)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    raise AssertionError("it suspended")


async def test_a_release_waiting_out_a_cancelled_acquire_does_not_touch_a_sequence_closed_meanwhile(
        tmp_path, monkeypatch):
    """release() waits for a cancelled acquire to settle; a close() that ran meanwhile frees the
    sequence's id, and another request may take it before the release resumes. The release
    used to go on with the stale id and unlock that request's pages (found in review)."""
    # pages too large to read from the page cache on the loop: the promotion waits on the gated thread
    big = half_inline_layers()
    async with Store.open(config(gpu=4, host=4, disk=64, disk_dir=tmp_path, layers=big)) as store:
        for base in range(1, 5):
            await fill(store, toks(base, 4))
        await store.drain()
        seq = await store.open_sequence(tokens=toks(1, 4))
        others = []
        close_now = Sequence._close_now

        def close_then_reuse(q):          # another request takes the id right after the close
            close_now(q)
            if q is seq:
                other = _run_now(store.open_sequence(tokens=toks(1, 4)))
                _run_now(other.acquire())
                others.append(other)
        monkeypatch.setattr(Sequence, "_close_now", close_then_reuse)
        gate = threading.Event()
        store.engine.io_read.submit(gate.wait)          # the promotion from disk waits
        try:
            acquiring = asyncio.ensure_future(seq.acquire())
            await asyncio.sleep(0.05)
            assert not acquiring.done()
            acquiring.cancel()
            await asyncio.gather(acquiring, return_exceptions=True)
            closing = asyncio.ensure_future(seq.close())
            releasing = asyncio.ensure_future(seq.release())
            await asyncio.sleep(0.05)
        finally:
            gate.set()
        await asyncio.wait_for(asyncio.gather(closing, releasing), 10)
        other, = others
        assert other.sid == seq.sid and seq.closed          # the id was reused
        assert other.acquired and all(s >= 0 for s in other.locked_indices(0))   # its locks are its own
        await other.release()
        await other.close()
        store.check_consistency()


async def test_start_eagerly_runs_to_the_first_wait_then_hands_on_to_a_task():
    """The eager start of a store operation: finished without a wait, it is done with no task;
    else the task continues it where it stopped, values and exceptions (a cancellation too)
    passed through to the coroutine as if it had run in the task from the start."""
    from runtime.loop import start_eagerly
    loop = asyncio.get_running_loop()
    log = []

    async def quick():
        log.append("ran")
        return 7
    assert start_eagerly(quick(), loop) == (True, 7) and log == ["ran"]

    async def fails():
        raise KeyError("now")
    with pytest.raises(KeyError, match="now"):
        start_eagerly(fails(), loop)

    gate = loop.create_future()

    async def waits():
        log.append("before")
        got = await gate
        await asyncio.sleep(0)                  # a bare yield after the first wait
        return got + 1
    done, task = start_eagerly(waits(), loop)
    assert not done and log[-1] == "before"
    gate.set_result(41)
    assert await task == 42

    hold = loop.create_future()

    async def cancelled():
        try:
            await hold
        except asyncio.CancelledError:
            log.append("saw the cancel")
            raise
    done, task = start_eagerly(cancelled(), loop)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled() and log[-1] == "saw the cancel"     # cancelled before its first step
    assert hold.cancelled()                         # as a task cancelled while it waits on a future
    assert "cancelled" in task.get_name()

    shared = loop.create_future()                   # another task awaits the same future first

    async def wait_shared():
        return await shared
    other = loop.create_task(wait_shared())
    done, task = start_eagerly(wait_shared(), loop)
    await asyncio.sleep(0)
    shared.set_result(5)
    assert await task == 5 and await other == 5

    hold = loop.create_future()
    done, task = start_eagerly(cancelled(), loop)
    await asyncio.sleep(0)                      # the task waits on the coroutine's future now
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled() and log.count("saw the cancel") == 2 and hold.cancelled()


async def test_an_acquire_promoting_from_host_memory_needs_no_task():
    """Pages brought back from the host by an inline copy: the acquire finishes on the caller's
    stack (no task, no loop turn), with the right bytes."""
    async with Store.open(config(gpu=4, host=16)) as store:
        await fill(store, toks(1, 4))
        await fill(store, toks(2, 4))                    # sequence 1's pages went to the host
        seq = await store.open_sequence(tokens=toks(1, 4))
        assert seq.matched_by_tier.get("host") == 4
        tasks = set(store.moves.tasks)
        await seq.acquire()
        assert seq.task is None and not seq.busy and set(store.moves.tasks) <= tasks
        for b in range(4):
            assert torch.equal(read_block(store, seq, 0, b), expected_block(store, seq, 0, b))
        await seq.release()
        await seq.close()
        store.check_consistency()


async def test_a_move_cancelled_while_its_copy_is_queued_hands_its_slots_on_only_after_the_copy():
    """A move cancelled while its copy job is still queued used to give its destination slots
    back at once; another promotion, copied inline past the queued job, could take one, and the
    stale copy then overwrote it (found in review). The cancelled move now waits for its job."""
    big = half_inline_layers()                          # four pages too large to copy inline, one not
    async with Store.open(config(gpu=4, host=16, layers=big, tpb=4)) as store:
        store.engine.stop_copier()                          # large copies on the stream's thread, held here
        await fill(store, toks(1, 4))
        await fill(store, toks(2, 1))
        for base in range(3, 8):                            # push both down to the host
            await fill(store, toks(base, 1))
        await store.drain()
        a = await store.open_sequence(tokens=toks(1, 4))
        b = await store.open_sequence(tokens=toks(2, 1))
        assert a.matched_by_tier["host"] == 4 and b.matched_by_tier["host"] == 1
        gate = threading.Event()
        store.engine.up.submit(gate.wait)                   # the copy thread is held
        try:
            moving = asyncio.ensure_future(a._acquire())     # its copy queues behind the gate
            await asyncio.sleep(0.05)
            moving.cancel()
            acquiring = asyncio.ensure_future(b.acquire())
            await asyncio.sleep(0.05)
        finally:
            gate.set()
        # the GPU's four slots are the cancelled move's until its copy ends: none was handed on
        with pytest.raises(OutOfPagesError):
            await asyncio.wait_for(acquiring, 10)
        await asyncio.wait_for(asyncio.gather(moving, return_exceptions=True), 10)
        assert moving.cancelled()
        await b.acquire()
        await asyncio.sleep(0.05)
        assert torch.equal(read_block(store, b, 0, 0), expected_block(store, b, 0, 0))
        await b.release()
        await b.close()
        await a.close()
        await store.drain()
        store.check_consistency()


async def test_a_drain_cancelled_while_writes_behind_are_queued_leaves_them_to_finish(tmp_path):
    """Spills written behind land at once; a drain waits for their writes, and cancelling it
    cancels only the wait: the writes finish, and a restart finds every page."""
    async with Store.open(config(gpu=4, host=4, disk=64, disk_dir=tmp_path)) as store:
        gate = await fill_and_hold_writer(store, range(1, 3))
        try:
            await asyncio.wait_for(fill(store, toks(3, 4)), 5)      # landed; its write queued
            assert store.engine.behind
            drain = asyncio.ensure_future(store.drain())
            await asyncio.sleep(0.02)
            assert not drain.done()
            drain.cancel()
            with pytest.raises(asyncio.CancelledError):
                await drain
            assert store.engine.behind                              # the write is still queued
        finally:
            gate.set()
        await asyncio.wait_for(store.drain(), 10)
        assert not store.engine.behind and store.engine.behind_bytes == 0
        store.check_consistency()
        await _check_all(store, range(1, 4))
    async with Store.open(config(gpu=4, host=4, disk=64, disk_dir=tmp_path)) as store:
        assert store.stats()["recovered_pages"] == 12
        await _check_all(store, range(1, 4))


async def test_a_close_cancelled_while_writes_behind_are_queued_still_persists_every_page(tmp_path):
    store = await Store.open(config(gpu=8, host=8, disk=64, disk_dir=tmp_path))
    gate = await fill_and_hold_writer(store, range(1, 8))
    try:
        await asyncio.wait_for(fill(store, toks(8, 4)), 5)
        assert store.engine.behind
        closing = asyncio.ensure_future(store.close())
        await asyncio.sleep(0.05)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
    finally:
        gate.set()
    await asyncio.wait_for(store.close(), 20)
    async with Store.open(config(gpu=8, host=8, disk=64, disk_dir=tmp_path)) as again:
        assert again.stats()["recovered_pages"] == 32
        await _check_all(again, range(1, 9))

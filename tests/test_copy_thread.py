"""The native copy thread (runtime/copy_thread.py, tiers/native/copy_worker.hpp): emulated copies
too large for the loop run there without the GIL, and complete their events on the loop."""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from runtime import Store
from runtime.copy_thread import CopyThread
from runtime.migration import MigrationEngine
from runtime.readiness import wait_event

from helpers import DEVICE, config, fill, half_inline_layers, read_all, toks

pytestmark = pytest.mark.skipif(DEVICE == "cuda", reason="the emulated GPU's copies")


async def test_copies_arrive_exact_and_complete_on_the_loop():
    loop = asyncio.get_running_loop()
    copier = CopyThread(loop)
    try:
        rng = np.random.default_rng(16)
        src = rng.integers(0, 256, size=(512, 4096), dtype=np.uint8)
        dst = np.zeros((1024, 4096), dtype=np.uint8)
        jobs = []
        for k in range(8):                      # scattered rows, many jobs in flight at once
            si = rng.permutation(512)[:64].astype(np.int64)
            di = np.arange(k * 64, (k + 1) * 64, dtype=np.int64)[::-1].copy()
            jobs.append((si, di, copier.submit(src, si, dst, di)))
        seen = []
        for si, di, ev in jobs:
            ev.add_done_callback(lambda error: seen.append(threading.get_ident()))
            await wait_event(ev, loop)
            assert np.array_equal(dst[di], src[si])
        assert set(seen) <= {threading.get_ident()}      # completed on the loop's thread
        with pytest.raises(IndexError, match="source row out of range"):
            copier.submit(src, np.array([512], dtype=np.int64), dst, None)
        with pytest.raises(ValueError, match="different widths"):
            copier.submit(src, None, np.zeros((512, 8), dtype=np.uint8), None)
    finally:
        copier.close()
    copier.close()                              # idempotent
    with pytest.raises(ValueError, match="closed"):
        copier.submit(src, None, dst, None)


async def test_close_from_another_thread_runs_what_is_queued():
    loop = asyncio.get_running_loop()
    copier = CopyThread(loop)
    src = np.full((256, 1 << 16), 7, dtype=np.uint8)      # 16 MiB a job: some still queued at close
    outs = [np.zeros_like(src) for _ in range(4)]
    events = [copier.submit(src, None, out, None) for out in outs]
    await loop.run_in_executor(None, copier.close)
    assert all(ev.query() and ev.error is None for ev in events)
    assert all((out == 7).all() for out in outs)
    await asyncio.sleep(0)                       # the reader goes on the loop's next turn


async def test_a_cancelled_copy_returns_only_once_its_rows_are_written():
    """The caller's cleanup hands the destination slots on: a cancelled move must not return
    while the thread may still write them."""
    loop = asyncio.get_running_loop()
    engine = MigrationEngine.__new__(MigrationEngine)      # only the copy path: no pools, no streams
    engine.loop, engine.copier, engine.copier_up = loop, CopyThread(loop), None
    try:
        src = np.full((4096, 1 << 16), 3, dtype=np.uint8)      # 256 MiB: tens of ms
        dst = np.zeros_like(src)
        done_at_cancel = []

        async def move():
            try:
                await engine._copy_off_loop(engine.copier, [0.0], src, range(4096), dst, range(4096), [])
            except asyncio.CancelledError:
                done_at_cancel.append(bool((dst[-1] == 3).all()))
                raise
        task = asyncio.ensure_future(move())
        await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert done_at_cancel == [True]
    finally:
        engine.copier.close()


async def test_large_pages_move_through_the_copy_thread_and_read_back_exact(tmp_path, monkeypatch):
    """Pages too large to copy on the loop go down to the host and back up on the native thread
    (not the copy streams' worker threads), and every page reads back exact."""
    jobs = []
    submit = CopyThread.submit

    def spy(self, src, si, dst, di):
        jobs.append(len(si))
        return submit(self, src, si, dst, di)
    monkeypatch.setattr(CopyThread, "submit", spy)
    async with Store.open(config(gpu=8, host=32, layers=half_inline_layers())) as store:
        streams = (store.engine.up, store.engine.down)
        queued = [s.queued for s in streams]           # what went to the streams' worker threads
        for base in range(1, 6):
            await fill(store, toks(base, 4))
        await store.drain()
        for base in range(1, 6):
            matched, redo = await read_all(store, base)
            assert matched == 4 and not redo
        moves = store.stats()["moves"]
        assert moves["gpu->host"]["pages"] >= 4 and moves["host->gpu"]["pages"] >= 4
        assert jobs and all(n >= 3 for n in jobs)
        assert [s.queued for s in streams] == queued
        store.check_consistency()


async def test_a_copy_thread_dropped_unclosed_stops_copying_before_its_arrays_go():
    """The queued jobs' arrays may be held only by the CopyThread: dropping it unclosed must stop
    the thread first (it wrote into freed memory, a segfault, found in review)."""
    loop = asyncio.get_running_loop()
    copier = CopyThread(loop)
    fd = copier._fd
    events = []
    for _ in range(8):
        src = np.full((512, 1 << 16), 7, dtype=np.uint8)       # 32 MiB each, held only by the job
        events.append(copier.submit(src, None, np.zeros_like(src), None))
    loop.remove_reader(fd)
    del copier, src
    assert all(ev.query() for ev in events)                   # finished, with the thread, before the arrays

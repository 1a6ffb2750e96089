"""Staging buffers are reused, bounded, never shared by two borrowers, and
never reused after a failed move."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from runtime import Store
from tiers.device import aligned_empty
from tiers.staging import MIN_BYTES, StagingPool

from helpers import config, expected_block, fill, read_block, toks


def pool(limit: int = 64 << 20) -> StagingPool:
    return StagingPool(lambda n: aligned_empty(1, n).view(-1), limit)


def test_a_returned_buffer_serves_the_next_batch_of_that_size_or_smaller():
    p = pool()
    with p.borrow(10, 4096) as a:
        assert a.shape == (10, 4096) and a.dtype == torch.uint8 and a.data_ptr() % 4096 == 0
        a.fill_(7)
        first = a.data_ptr()
    with p.borrow(3, 4096) as b:
        assert b.data_ptr() == first
    with p.borrow(100, 4096) as c:          # larger than any idle buffer: a new one
        assert c.data_ptr() != first
    assert p.allocated == 2 and p.idle_bytes == MIN_BYTES + (1 << 19)


def test_a_buffer_is_dropped_not_reused_after_an_error():
    p = pool()
    with pytest.raises(OSError):
        with p.borrow(4, 4096):
            raise OSError("the move failed; a copy may still be writing the buffer")
    assert p.idle_bytes == 0
    with p.borrow(4, 4096):
        pass
    assert p.allocated == 2


def test_idle_buffers_stay_under_the_limit():
    p = pool(limit=1 << 20)
    held = [p.borrow(1, 1 << 19) for _ in range(4)]
    for cm in held:
        cm.__enter__()
    for cm in held:
        cm.__exit__(None, None, None)
    assert p.idle_bytes == 1 << 20          # two of the four 512 KiB buffers kept, two let go


def test_concurrent_borrowers_never_share_a_buffer():
    p = pool()
    spans, lock, errors = [], threading.Lock(), []

    def worker(k: int) -> None:
        try:
            for i in range(200):
                with p.borrow(1 + (k + i) % 7, 4096) as buf:
                    span = (buf.data_ptr(), buf.data_ptr() + buf.numel())
                    with lock:
                        assert all(span[1] <= s[0] or s[1] <= span[0] for s in spans), "two borrowers share memory"
                        spans.append(span)
                    buf.fill_(k)
                    assert int(buf.min()) == int(buf.max()) == k
                    with lock:
                        spans.remove(span)
        except AssertionError as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert p.allocated <= 6


async def test_spills_and_recalls_reuse_staging_and_read_back_exact(tmp_path):
    """Scattered host rows gathered for disk, and disk pages staged for the
    GPU, go through a few reused buffers; every page still reads back exact."""
    store = await Store.open(config(gpu=8, host=8, disk=128, disk_dir=tmp_path))
    try:
        seqs = [toks(i, 3) for i in range(24)]
        for t in seqs:
            await fill(store, t)
        await store.drain()
        moves = store.stats()["moves"]
        assert moves["host->disk"]["batches"] >= 4
        for t in seqs[:6]:                          # the oldest: on disk now, recalled straight to the GPU
            seq = await store.open_sequence(tokens=t)
            assert seq.matched_blocks == 3 and seq.matched_by_tier["disk"] > 0
            await seq.acquire()
            for b in range(3):
                assert torch.equal(read_block(store, seq, 0, b), expected_block(store, seq, 0, b))
            await seq.close()
        moves = store.stats()["moves"]
        staged = moves["host->disk"]["batches"] + moves["disk->gpu"]["batches"]   # spills are written behind
        assert moves["disk->gpu"]["batches"] >= 2
        assert 1 <= store.engine.staging.allocated < staged, (store.engine.staging.allocated, staged)   # reused
        await store.drain()                         # every buffer of a write behind went back
        assert not store.engine.behind and not store.engine.staged and store.engine.behind_bytes == 0
    finally:
        await store.close()


def test_a_numpy_borrow_shares_the_buffers_of_tensor_borrows():
    p = pool()
    with p.borrow(4, 4096) as t:
        t.fill_(3)
        ptr = t.data_ptr()
    with p.borrow_array(2, 4096) as a:
        assert a.shape == (2, 4096) and a.dtype == np.uint8 and a.ctypes.data == ptr
        assert (a == 3).all()
        a[:] = 9
    with p.borrow(2, 4096) as t:
        assert t.data_ptr() == ptr and bool((t == 9).all())
    assert p.allocated == 1

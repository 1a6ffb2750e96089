"""``DiskTier.read_cached``: a read the event loop may do itself, because it never waits - not for
the device (only what the page cache holds, preadv2 RWF_NOWAIT) and not for a lock (the group's is
only tried; while another thread holds it, the read goes on unlocked and validated). Whatever it
declines, ``read`` does on a thread; whatever it does, it verifies as ``read`` does."""
from __future__ import annotations

import errno
import os
import threading
import time

import numpy as np
import pytest
import torch

from runtime import Store
from tiers.disk import CACHED_READ_MAX, DiskTier, PageRecord
from tiers.errors import CorruptPageError, TierIOError, UsageError

from helpers import acquire_while_held, config, expected_block, fill, read_block, toks

FP = {"test": "cached-read"}
GROUPS = [(4096, 512)]


def page_bytes(key: int) -> np.ndarray:
    return np.random.default_rng(key).integers(0, 256, 4096, dtype=np.uint8)


def put(tier: DiskTier, slots: list[int]) -> None:
    rows = torch.from_numpy(np.stack([page_bytes(s) for s in slots]))
    tier.write(0, slots, rows, [PageRecord(s + 1, None, 0, 0) for s in slots])


def out_for(n: int) -> torch.Tensor:
    return torch.zeros((n, 4096), dtype=torch.uint8)


@pytest.fixture
def tier(tmp_path):
    t = DiskTier.open(str(tmp_path / "d"), FP, GROUPS, o_direct="off")
    yield t
    t.close()


def test_pages_in_the_page_cache_read_back_exact(tier):
    put(tier, list(range(40)))
    slots = [7, 3, 30, 31, 32, 0]
    out = out_for(len(slots))
    assert tier.read_cached(0, slots, out) is True
    assert all(np.array_equal(out[i].numpy(), page_bytes(s)) for i, s in enumerate(slots))
    assert tier.stats["cached_reads"] == 1


def resident(fd: int, nbytes: int) -> list[bool]:
    """Which 4 KiB pages of the file's first ``nbytes`` the page cache holds (mincore(2) on a
    mapping: unlike a probing read, it starts no readahead)."""
    import ctypes
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    addr = libc.mmap(None, nbytes, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    try:
        vec = ctypes.create_string_buffer(-(-nbytes // mmap.PAGESIZE))
        assert libc.mincore(addr, nbytes, vec) == 0, os.strerror(ctypes.get_errno())
        return [b & 1 == 1 for b in vec.raw]
    finally:
        libc.munmap(addr, nbytes)


def test_pages_not_in_the_page_cache_are_left_to_a_thread(tier):
    """A miss fails rather than wait for the device, but the readahead it starts may bring the
    pages in before the kernel gives up, so one try can succeed: of a dozen tries on evicted
    pages some must decline, and every read, either way, gets the right bytes."""
    put(tier, list(range(96)))
    g = tier.groups[0]
    declined = 0
    for k in range(12):
        slots = [8 * k + i for i in range(4)]
        os.posix_fadvise(g.read_fd, 0, 0, os.POSIX_FADV_DONTNEED)     # written and synced: clean, so dropped
        if any(resident(g.read_fd, 96 * g.stride)[slots[0]:slots[-1] + 1]):
            continue                                                # the kernel kept them: no trial
        out = out_for(4)
        if not tier.read_cached(0, slots, out):
            declined += 1
            tier.read(0, slots, out)                                # the thread's read gets them
        assert all(np.array_equal(out[i].numpy(), page_bytes(s)) for i, s in enumerate(slots))
    if declined == 0 and tier.stats["cached_reads"] == 0:
        pytest.skip("the kernel kept the pages cached here")
    assert declined > 0 and tier.discarded == []


@pytest.mark.parametrize("err", [errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS])
def test_a_kernel_or_filesystem_without_nowait_reads_sends_every_read_to_the_thread(tier, monkeypatch, err):
    from tiers import disk as disk_mod
    real = disk_mod.pread_rows

    def refusing(fd, out, index, offsets, stride, nowait=False):
        if nowait:
            raise OSError(err, os.strerror(err))
        return real(fd, out, index, offsets, stride)
    monkeypatch.setattr(disk_mod, "pread_rows", refusing)
    put(tier, [0, 1])
    out = out_for(2)
    assert tier.read_cached(0, [0, 1], out) is False                # declined, not an error
    assert tier.read_cached(0, [0, 1], out) is False                # and not tried again
    tier.read(0, [0, 1], out)
    assert np.array_equal(out[1].numpy(), page_bytes(1)) and tier.discarded == []


class LockHolder:
    """Another thread holding the group's lock (as a write's or a commit's bookkeeping does) until
    ``release``; ``run(fn)`` has it drop the lock, run ``fn`` (which may take the lock itself) and
    take the lock again, while the caller waits (``fn``'s exception is raised to the caller)."""

    def __init__(self, tier: DiskTier) -> None:
        self.lock = tier.groups[0].lock
        self.jobs: list = []
        self.wake = threading.Condition()
        self.held = threading.Event()
        self.thread = threading.Thread(target=self._main)
        self.thread.start()
        assert self.held.wait(5)

    def _main(self) -> None:
        self.lock.acquire()
        self.held.set()
        try:
            with self.wake:
                while True:
                    self.wake.wait_for(lambda: self.jobs)
                    fn, box, done = self.jobs.pop(0)
                    if fn is None:
                        break
                    self.lock.release()
                    try:
                        fn()
                    except BaseException as exc:        # noqa: BLE001 - handed to the caller
                        box.append(exc)
                    finally:
                        self.lock.acquire()
                        done.set()
        finally:
            self.lock.release()

    def run(self, fn) -> None:
        done, box = threading.Event(), []
        with self.wake:
            self.jobs.append((fn, box, done))
            self.wake.notify()
        assert done.wait(5)
        if box:
            raise box[0]

    def release(self) -> None:
        with self.wake:
            self.jobs.append((None, None, None))
            self.wake.notify()
        self.thread.join(5)
        assert not self.thread.is_alive()


def test_a_held_group_lock_is_never_waited_for_and_the_read_goes_on(tier):
    """The lock's holder does bookkeeping of other slots: the read of live pages goes on without
    the lock, exact, without waiting for it."""
    put(tier, [0, 1, 2])
    holder = LockHolder(tier)
    try:
        out = out_for(2)
        t0 = time.perf_counter()
        assert tier.read_cached(0, [2, 0], out) is True
        assert time.perf_counter() - t0 < 0.5
        assert np.array_equal(out[0].numpy(), page_bytes(2)) and np.array_equal(out[1].numpy(), page_bytes(0))
        assert tier.stats["unlocked_reads"] == 1 and tier.stats["pages_read"] == 2
    finally:
        holder.release()
    assert tier.read_cached(0, [0, 1], out_for(2)) is True
    assert tier.stats["unlocked_reads"] == 1


@pytest.mark.parametrize("change", ["relabel", "free", "free and write again"])
def test_a_read_without_the_lock_declines_a_page_changed_under_it(tier, monkeypatch, change):
    """While the bytes are read, the lock's holder changes page 1 (a relabel gives it a new
    generation; a free ends it, and a write may fill the slot again): the read declines (the
    thread redoes it under the lock), never hands back rows checked against another record."""
    from tiers import disk as disk_mod
    put(tier, [0, 1, 2])
    holder = LockHolder(tier)
    real = disk_mod.pread_rows

    def changing(fd, out, index, offsets, stride, nowait=False):
        got = real(fd, out, index, offsets, stride, nowait)
        if change == "relabel":
            holder.run(lambda: tier.relabel(0, [1], [PageRecord(99, None, 0, 0)], durable=False))
        else:
            holder.run(lambda: tier.free(0, [1]))
            if change != "free":                    # other bytes in the slot: the read may have got either
                holder.run(lambda: tier.write(0, [1], torch.from_numpy(page_bytes(1001)[None]),
                                              [PageRecord(1001, None, 0, 0)]))
        return got
    monkeypatch.setattr(disk_mod, "pread_rows", changing)
    try:
        assert tier.read_cached(0, [0, 1, 2], out_for(3)) is False
    finally:
        holder.release()
    monkeypatch.setattr(disk_mod, "pread_rows", real)
    assert tier.stats["unlocked_reads"] == 0 and tier.discarded == []
    if change == "free":
        with pytest.raises(UsageError):
            tier.read_cached(0, [1], out_for(1))
    else:
        out = out_for(1)
        assert tier.read_cached(0, [1], out) is True
        assert np.array_equal(out[0].numpy(), page_bytes(1 if change == "relabel" else 1001))
        assert tier.record(0, 1).key == (99 if change == "relabel" else 1001)


def test_a_read_without_the_lock_declines_a_page_gone_before_it_started(tier):
    put(tier, [0, 1])
    holder = LockHolder(tier)
    try:
        holder.run(lambda: tier.free(0, [1]))
        assert tier.read_cached(0, [0, 1], out_for(2)) is False
    finally:
        holder.release()
    with pytest.raises(UsageError):
        tier.read_cached(0, [0, 1], out_for(2))


@pytest.mark.parametrize("err", [errno.EBADF, errno.EIO])
def test_a_read_without_the_lock_declines_an_io_error(tier, monkeypatch, err):
    """A close may close the fd under an unlocked read (EBADF), or the device fail: the read
    declines, and the locked read on the thread says what is wrong."""
    from tiers import disk as disk_mod
    put(tier, [0, 1])
    real = disk_mod.pread_rows

    def failing(fd, out, index, offsets, stride, nowait=False):
        raise OSError(err, os.strerror(err))
    monkeypatch.setattr(disk_mod, "pread_rows", failing)
    holder = LockHolder(tier)
    try:
        assert tier.read_cached(0, [0, 1], out_for(2)) is False
    finally:
        holder.release()
    with pytest.raises(TierIOError):
        tier.read_cached(0, [0, 1], out_for(2))             # under the lock: raised
    monkeypatch.setattr(disk_mod, "pread_rows", real)
    assert tier.read_cached(0, [0, 1], out_for(2)) is True and tier.discarded == []


def test_an_injected_fault_is_left_for_the_read_under_the_lock(tier):
    put(tier, [0, 1])
    tier.inject_fault("read", errno.EIO)
    holder = LockHolder(tier)
    try:
        out = out_for(2)
        assert tier.read_cached(0, [0, 1], out) is True      # unlocked: the fault stays queued
        assert np.array_equal(out[1].numpy(), page_bytes(1))
    finally:
        holder.release()
    with pytest.raises(TierIOError):
        tier.read_cached(0, [0, 1], out_for(2))


def test_damaged_bytes_found_without_the_lock_are_left_to_the_locked_read(tier):
    """Only a read under the lock discards pages: one without it declines, and the thread's read
    then finds the damage and discards the page."""
    put(tier, [0, 1, 2])
    g = tier.groups[0]
    os.pwrite(g.seg_fd, b"\xff\x00\xff", 1 * g.stride + 100)
    holder = LockHolder(tier)
    try:
        assert tier.read_cached(0, [0, 1, 2], out_for(3)) is False
        assert tier.discarded == []
    finally:
        holder.release()
    with pytest.raises(CorruptPageError) as ei:
        tier.read(0, [0, 1, 2], out_for(3))
    assert ei.value.slots == [1]


def test_damaged_bytes_are_caught_as_by_read(tier):
    put(tier, [0, 1, 2])
    g = tier.groups[0]
    os.pwrite(g.seg_fd, b"\xff\x00\xff", 1 * g.stride + 100)        # page 1's bytes, in the page cache
    with pytest.raises(CorruptPageError) as ei:
        tier.read_cached(0, [0, 1, 2], out_for(3))
    assert ei.value.slots == [1]
    assert [d[:2] for d in tier.discarded] == [(0, 1)]
    assert tier.read_cached(0, [0, 2], out_for(2)) is True


def test_bad_input_and_faults_are_typed(tier):
    put(tier, [0])
    with pytest.raises(UsageError):
        tier.read_cached(0, [5], out_for(1))                         # no page there
    with pytest.raises(UsageError):
        tier.read_cached(0, [0], torch.zeros((1, 100), dtype=torch.uint8))
    tier.inject_fault("read", errno.EIO)
    with pytest.raises(TierIOError):
        tier.read_cached(0, [0], out_for(1))
    assert tier.read_cached(0, [], out_for(0)) is True
    big = CACHED_READ_MAX // 4096 + 1
    put(tier, list(range(1, big + 1)))
    assert tier.read_cached(0, list(range(big)), out_for(big)) is False   # too much for the loop


async def test_store_promotions_from_disk_read_on_the_loop_and_exact(tmp_path):
    cfg = config(gpu=8, host=8, disk=256, disk_dir=str(tmp_path))
    async with Store.open(cfg) as store:
        for base in range(12):                          # 48 blocks: most go down to the disk
            await fill(store, toks(base, 4))
        await store.drain()                             # written (a read of a write behind copies its rows)
        before = store.disk.stats["cached_reads"]
        for base in range(4):                           # the oldest: on disk
            seq = await store.open_sequence(tokens=toks(base, 4))
            assert seq.matched_by_tier["disk"] > 0
            await seq.acquire()
            for i in range(seq.matched_blocks):
                assert torch.equal(read_block(store, seq, 0, i), expected_block(store, seq, 0, i))
            await seq.release()
            await seq.close()
        assert store.disk.stats["cached_reads"] > before


async def test_a_promotion_reads_from_the_page_cache_while_the_read_thread_is_busy(tmp_path):
    """The read thread's queue holds reads of other pages (a page is claimed while it moves):
    a cached read of pages that depend on nothing pending goes ahead on the loop."""
    cfg = config(gpu=8, host=8, disk=256, disk_dir=str(tmp_path))
    async with Store.open(cfg) as store:
        for base in range(12):
            await fill(store, toks(base, 4))
        await store.drain()
        store.engine.io_write.synchronize()                # frees applied: nothing else takes the group's lock
        store.disk.flush()                                  # and nothing left for the committer
        before = store.disk.stats["cached_reads"]
        assert (await acquire_while_held(store, store.engine.io_read, toks(0, 4)))["disk"] > 0
        assert store.disk.stats["cached_reads"] > before

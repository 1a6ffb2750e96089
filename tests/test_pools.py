"""The native core's slot allocators (all-or-nothing, ready slots first,
fences as event ids) and SlabPool views."""
from __future__ import annotations

import pytest
import torch

from runtime.core import Core
from tiers.device import Device
from tiers.grouping import DISK, GPU, HOST, PoolGroupSpec
from tiers.policy import ReusePolicy
from tiers.pools import SlabPool


G = 0                   # the core numbers tiers: 0 is the GPU


def core(slots: int) -> Core:
    """A core with one GPU pool group of ``slots`` slots and one life cycle."""
    return Core(4, [(False, 0, 0, 0)], [[0], [-1], [-1]], [[slots], [], []])


def test_fresh_allocator_hands_out_slots_in_order():
    c = core(6)
    assert c.allocate(G, 0, 2) == [0, 1] and c.allocate(G, 0, 3) == [2, 3, 4]
    assert (c.free(G, 0), c.used(G, 0), c.capacity(G, 0)) == (1, 5, 6)


def test_all_or_nothing():
    c = core(4)
    c.allocate(G, 0, 3)
    assert c.allocate(G, 0, 2) is None and c.free(G, 0) == 1
    assert c.allocate(G, 0, 1) == [3] and c.allocate(G, 0, 0) == []


def test_release_errors_leave_state_unchanged():
    c = core(4)
    got = c.allocate(G, 0, 2)
    for bad in ([got[0], got[0]], [2], [got[1], 9], [-1]):
        with pytest.raises(ValueError, match="released twice or never allocated"):
            c.release_slots(G, 0, bad, 0)
        assert c.free(G, 0) == 2 and not c.is_free(G, 0, got[0]) and not c.is_free(G, 0, got[1])
    c.release_slots(G, 0, got, 0)
    assert c.free(G, 0) == 4
    with pytest.raises(IndexError):
        c.allocate(G, 1, 1)


def test_ready_slots_come_before_fenced_ones_and_fences_are_kept():
    c = core(4)
    a = c.allocate(G, 0, 4)
    c.release_slots(G, 0, a[:2], 7)           # fenced by event 7: handed out last, oldest first
    c.release_slots(G, 0, a[2:], 0)
    assert c.allocate(G, 0, 3) == [a[3], a[2], a[0]]
    assert c.slot_fences(G, 0, [a[0], a[2], a[3]]) == [7]
    c.give_back(G, 0, [a[0]])                 # taken, never used: it keeps its fence
    assert c.allocate(G, 0, 2) == [a[1], a[0]] and c.slot_fences(G, 0, [a[0], a[1]]) == [7]


def test_memory_tiers_reuse_the_slot_freed_last():
    """A GPU or host slot just freed is likely still cached: it goes next."""
    from runtime.core.model import ModelCore
    gpu, host = 0, 1        # the core's tier numbers
    for make in (Core, ModelCore):
        c = make(4, [(False, 0, 0, 0)], [[0], [0], [0]], [[6], [6], [6]])
        for tier in (gpu, host):
            got = c.allocate(tier, 0, 6)
            c.release_slots(tier, 0, [got[1]], 0)
            c.release_slots(tier, 0, [got[0]], 0)
            assert c.allocate(tier, 0, 2) == [0, 1]


def test_the_disk_sweeps_free_slots_in_address_order_from_a_cursor():
    """A spill's pages land in runs of adjacent slots (one pwritev, one device write each):
    free disk slots go out in address order from where the last allocation stopped, not in
    the order they were freed (which scattered a spill's pages over the whole file). A first
    pass skips the slots freed lately (their free may not be journaled yet: a write over one
    would append and sync it first); a second takes them when the rest falls short."""
    from runtime.core.model import ModelCore
    disk = 2
    for make in (Core, ModelCore):
        c = make(4, [(False, 0, 0, 0)], [[0], [0], [0]], [[4], [4], [64]])
        assert c.allocate(disk, 0, 64) == list(range(64))       # the cursor wraps to 0
        for s in (50, 20, 21, 5, 51):
            c.release_slots(disk, 0, [s], 0)
        # 5 free: the last 2 freed (5, 51) wait for a second pass
        assert c.allocate(disk, 0, 2) == [20, 21]
        assert c.allocate(disk, 0, 2) == [50, 5]                 # on from 22, wrapping; 51 still skipped
        assert c.allocate(disk, 0, 1) == [51]                    # the second pass
        assert c.allocate(disk, 0, 1) is None


def test_a_disk_segment_stays_within_the_live_pages_plus_the_window_under_churn():
    """The sweep takes never-used slots (growing the extent) only while fewer than an eighth
    of the extent, and fewer than WINDOW slots, are free: under churn the pages stay in low
    slots, and the segment (preallocated to the highest slot written, never shrunk) does not
    walk the whole quota (it did, found in review: 29 MB against 4). A freed slot is not taken
    again before WINDOW more frees."""
    from runtime.core.model import WINDOW, ModelCore
    disk = 2
    for make in (Core, ModelCore):
        c = make(4, [(False, 0, 0, 0)], [[0], [0], [0]], [[4], [4], [1 << 16]])
        live = c.allocate(disk, 0, 8)
        assert live == list(range(8))
        first_reuse = None
        for i in range(20_000):                             # free the oldest, take one
            freed = live.pop(0)
            c.release_slots(disk, 0, [freed], 0)
            got, = c.allocate(disk, 0, 1)
            live.append(got)
            if first_reuse is None and got < 8:
                first_reuse = i
        assert max(live) < 8 + WINDOW, max(live)
        assert first_reuse >= WINDOW - 8, first_reuse


# -- slab pools ----------------------------------------------------------------------------

def spec(tier=GPU, sizes=(16, 32, 8)):
    key = (ReusePolicy.REQUIRED, sizes, None) if tier == GPU else (ReusePolicy.REQUIRED, sum(sizes))
    return PoolGroupSpec(tier, 0, key, (0,), sizes)


def test_pool_views_alias_the_slab():
    pool = SlabPool(spec(), 4, Device("cpu"))
    assert pool.slots == 4
    assert pool.tensor.shape == (4, 56) and pool.tensor.dtype == torch.uint8
    assert pool.offsets == (0, 16, 48)
    views = [pool.pool_view(i) for i in range(3)]
    assert [tuple(v.shape) for v in views] == [(4, 16), (4, 32), (4, 8)]
    assert views[1].untyped_storage().data_ptr() == pool.tensor.untyped_storage().data_ptr()
    # write through a view: the right bytes of the right row change, nothing else
    views[1][2] = torch.arange(32, dtype=torch.uint8) + 100
    expected = torch.zeros((4, 56), dtype=torch.uint8)
    expected[2, 16:48] = torch.arange(32, dtype=torch.uint8) + 100
    assert torch.equal(pool.tensor, expected)
    views[2][3] = 7
    expected[3, 48:56] = 7
    assert torch.equal(pool.tensor, expected)
    # and a row write (a whole-page copy) shows through every view
    pool.tensor[0] = torch.arange(56, dtype=torch.uint8)
    assert torch.equal(views[0][0], torch.arange(0, 16, dtype=torch.uint8))
    assert torch.equal(views[1][0], torch.arange(16, 48, dtype=torch.uint8))
    assert torch.equal(views[2][0], torch.arange(48, 56, dtype=torch.uint8))


@pytest.mark.parametrize("tier", [HOST, DISK])
def test_cold_slab_is_one_pool_of_whole_pages(tier):
    pool = SlabPool(spec(tier, sizes=(1088,)), 3, Device("cpu"))
    assert pool.tensor.shape == (3, 1088) and pool.offsets == (0,)
    assert not pool.tensor.is_pinned()
    v = pool.pool_view(0)
    v[1, 5] = 9
    assert int(pool.tensor[1, 5]) == 9 and int(pool.tensor.sum()) == 9

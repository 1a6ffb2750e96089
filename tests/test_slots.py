"""SlotAllocator (all-or-nothing, ready slots first, fences) and SlabPool views."""
from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tiers.device import Device
from tiers.errors import UsageError
from tiers.grouping import DISK, GPU, HOST, PoolGroupSpec
from tiers.policy import ReusePolicy
from tiers.pools import SlabPool
from tiers.slots import SlotAllocator
from tiers.streams import HostEvent


def test_fresh_allocator_hands_out_slots_in_order():
    a = SlotAllocator(5)
    assert (a.capacity, a.free, a.used) == (5, 5, 0)
    assert a.allocate(2) == [0, 1]
    assert a.allocate(0) == []
    assert a.allocate(3) == [2, 3, 4]
    assert (a.free, a.used) == (0, 5)
    assert a.allocate(1) is None
    assert [a.is_free(s) for s in range(5)] == [False] * 5


def test_all_or_nothing():
    a = SlotAllocator(4)
    assert a.allocate(3) == [0, 1, 2]
    assert a.allocate(2) is None                 # one free: nothing taken
    assert (a.free, a.used) == (1, 3) and a.is_free(3)
    assert a.allocate(1) == [3]


def test_capacity_zero_and_argument_errors():
    a = SlotAllocator(0)
    assert (a.free, a.used) == (0, 0)
    assert a.allocate(0) == [] and a.allocate(1) is None
    with pytest.raises(UsageError):
        SlotAllocator(-1)
    with pytest.raises(UsageError):
        SlotAllocator(3).allocate(-1)


def test_release_errors_leave_state_unchanged():
    a = SlotAllocator(4)
    assert a.allocate(3) == [0, 1, 2]
    for bad in ([3], [4], [-1], [0, 3], [1, 1], [2, 0, 2]):
        with pytest.raises(UsageError):
            a.release(bad)
        assert (a.free, a.used) == (1, 3)
        assert [a.is_free(s) for s in range(4)] == [False, False, False, True]
    a.release([1])
    with pytest.raises(UsageError):
        a.release([1])                           # double release
    assert a.allocate(2) == [1, 3]               # most recently released first, each slot once
    assert a.allocate(1) is None


def test_ready_slots_come_before_fenced_ones():
    a = SlotAllocator(4)
    assert a.allocate(4) == [0, 1, 2, 3]
    pending0, pending2 = HostEvent(), HostEvent()
    a.release([0], fence=pending0)
    a.release([1])                               # no fence: ready
    a.release([2], fence=pending2)
    a.release([3], fence=HostEvent(done=True))   # fence already passed: ready
    assert a.fences == [pending0, None, pending2, None]
    assert sorted(a.allocate(2)) == [1, 3]       # both ready slots before any fenced one
    pending2.set()                               # slot 2's copy finishes later
    assert a.allocate(1) == [2]                  # now ready: preferred over slot 0
    assert a.fences[2] is None
    assert a.allocate(1) == [0]                  # only a fenced slot left: handed out with its fence
    assert a.fences[0] is pending0               # the new owner must wait on it before writing
    a.release([0])
    assert a.fences[0] is None


def test_fenced_slots_are_handed_out_oldest_fence_first():
    a = SlotAllocator(3)
    a.allocate(3)
    evs = [HostEvent() for _ in range(3)]
    for s in (2, 0, 1):
        a.release([s], fence=evs[s])
    assert a.allocate(3) == [2, 0, 1]
    assert [a.fences[s] for s in range(3)] == evs


# -- stateful model -------------------------------------------------------------------

class AllocatorMachine(RuleBasedStateMachine):
    @initialize(capacity=st.integers(0, 8))
    def setup(self, capacity):
        self.alloc = SlotAllocator(capacity)
        self.capacity = capacity
        self.used: set[int] = set()
        self.fence: dict[int, HostEvent | None] = {s: None for s in range(capacity)}   # free slots only
        self.pending: list[HostEvent] = []

    def _done(self, s):
        ev = self.fence[s]
        return ev is None or ev.query()

    @rule(n=st.integers(0, 9))
    def allocate(self, n):
        free_before = dict(self.fence)
        got = self.alloc.allocate(n)
        if n > len(free_before):
            assert got is None                                   # all or nothing
            assert self.alloc.free == len(free_before)
            return
        assert got is not None and len(got) == n
        assert len(set(got)) == n                                # no slot twice in one call
        assert set(got) <= set(free_before)                      # only free slots
        assert not (set(got) & self.used)                        # never a slot someone holds
        ready = [s for s in free_before if self._done(s)]
        took_ready = [s for s in got if self._done(s)]
        assert len(took_ready) == min(n, len(ready))             # ready slots first
        for s in got:
            if self._done(s):
                assert self.alloc.fences[s] is None
            else:
                assert self.alloc.fences[s] is free_before[s]    # the new owner waits on this
            del self.fence[s]
            self.used.add(s)

    @precondition(lambda self: self.used)
    @rule(data=st.data(), kind=st.sampled_from(["none", "done", "pending"]))
    def release(self, data, kind):
        slots = data.draw(st.lists(st.sampled_from(sorted(self.used)), min_size=1, unique=True))
        fence = {"none": None, "done": HostEvent(done=True), "pending": HostEvent()}[kind]
        self.alloc.release(slots, fence=fence)
        for s in slots:
            self.used.discard(s)
            self.fence[s] = fence
        if kind == "pending":
            self.pending.append(fence)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def complete_fence(self, data):
        ev = data.draw(st.sampled_from(self.pending))
        self.pending.remove(ev)
        ev.set()

    @precondition(lambda self: self.fence)
    @rule(data=st.data())
    def double_release(self, data):
        s = data.draw(st.sampled_from(sorted(self.fence)))
        extra = sorted(self.used)[:1]
        before = (self.alloc.free, [self.alloc.is_free(i) for i in range(self.capacity)])
        with pytest.raises(UsageError):
            self.alloc.release(extra + [s])
        assert (self.alloc.free, [self.alloc.is_free(i) for i in range(self.capacity)]) == before

    @precondition(lambda self: self.used)
    @rule(data=st.data())
    def duplicate_in_one_release(self, data):
        s = data.draw(st.sampled_from(sorted(self.used)))
        with pytest.raises(UsageError):
            self.alloc.release([s, s])
        assert not self.alloc.is_free(s)

    @rule(s=st.integers(-3, 12))
    def release_out_of_range_or_free(self, s):
        if s in self.used:
            return
        with pytest.raises(UsageError):
            self.alloc.release([s])

    @invariant()
    def counts(self):
        assert self.alloc.free + self.alloc.used == self.capacity
        assert self.alloc.free == len(self.fence)
        assert self.alloc.used == len(self.used)
        assert all(self.alloc.is_free(s) == (s in self.fence) for s in range(self.capacity))
        assert not (self.used & set(self.fence))


AllocatorMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase


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

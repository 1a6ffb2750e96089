"""The benchmarks' references: the bare LRU and the lean tiered bound."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from runtime.oracle import LruPrefixCache, TieredLruBound

# requests as a walk over a small key tree: shared prefixes, as in a trace
requests = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=12), min_size=1, max_size=60)


def chain(path: list[int]) -> list[tuple[int, ...]]:
    return [tuple(path[:i + 1]) for i in range(len(path))]


@settings(max_examples=150, derandomize=True, deadline=None)
@given(requests, st.tuples(st.integers(12, 20), st.integers(1, 20), st.integers(1, 30)))
def test_tiers_hold_every_record_once_and_fill_before_evicting(paths, caps):
    bound = TieredLruBound(caps)
    created = 0
    for path in paths:
        keys = chain(path)
        matched = bound.request(keys)
        created += len(keys) - matched
        assert all(bound.nodes[k].key == k for k in keys)
        for tier, cap in enumerate(caps):
            lru, free, owner = bound.lru[tier], bound.free[tier], bound.owner[tier]
            assert len(lru) + len(free) == cap
            assert all(owner[r.slot] is r and r.tier == tier for r in lru)
            assert sorted(free + [r.slot for r in lru]) == list(range(cap))
        # the request's blocks are the first tier's newest, touched deepest-first
        assert [r.key for r in list(bound.lru[0])[-len(keys):]] == keys[::-1]
    held = sum(len(lru) for lru in bound.lru)
    assert created == held + bound.drops
    assert bound.hits <= bound.lookups == sum(len(p) for p in paths)


@settings(max_examples=100, derandomize=True, deadline=None)
@given(requests)
def test_with_room_for_everything_the_bound_hits_as_the_bare_lru(paths):
    bound, bare = TieredLruBound((40, 200, 600)), LruPrefixCache(840)
    for path in paths:
        assert bound.request(chain(path)) == bare.request(chain(path))
    assert bound.drops == 0


def test_bad_capacities_and_oversized_requests_are_refused():
    with pytest.raises(ValueError, match="at least one block"):
        TieredLruBound((4, 0, 8))
    bound = TieredLruBound((2, 4))
    bound.request([1, 2])
    with pytest.raises(ValueError, match="exceeds the first tier"):
        bound.request([7, 8, 9])
    assert bound.request([1, 2]) == 2         # the refused request changed nothing

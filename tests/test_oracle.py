"""The benchmarks' references: the bare LRU and the lean tiered bound."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from runtime import LayerSpec, Store
from runtime.tools.oracle import LruPrefixCache, TieredLruBound

from helpers import config, prefill_keys

# requests as walks over a small key tree: shared prefixes, as in a trace
requests = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=12), min_size=1, max_size=60)


def chain(path: list[int]) -> list[tuple[int, ...]]:
    return [tuple(path[:i + 1]) for i in range(len(path))]


def check_tiers(bound: TieredLruBound) -> None:
    """Every indexed record sits in exactly one tier's LRU, on a slot of its own."""
    held = set()
    for tier, cap in enumerate(bound.capacity):
        lru, free = bound.lru[tier], bound.free[tier]
        assert len(lru) + len(free) == cap
        assert all(r.tier == tier for r in lru)
        assert sorted(free + [r.slot for r in lru]) == list(range(cap))
        held.update(id(r) for r in lru)
    assert held == {id(r) for r in bound.nodes.values()}


@settings(max_examples=150, derandomize=True, deadline=None)
@given(requests, st.tuples(st.integers(12, 20), st.integers(1, 20), st.integers(1, 30)))
def test_tiers_hold_every_record_once(paths, caps):
    bound = TieredLruBound(caps)
    created = 0
    for path in paths:
        keys = chain(path)
        matched = bound.request(keys)
        created += len(keys) - matched
        assert all(bound.nodes[k].key == k for k in keys)
        check_tiers(bound)
        # the request's blocks are the first tier's newest, touched deepest-first
        assert [r.key for r in list(bound.lru[0])[-len(keys):]] == keys[::-1]
    assert created - len(bound.nodes) >= bound.drops      # a drop also forgets the block's descendants
    assert bound.hits <= bound.lookups == sum(len(p) for p in paths)


@settings(max_examples=100, derandomize=True, deadline=None)
@given(requests)
def test_with_room_for_everything_the_bound_hits_as_the_bare_lru(paths):
    bound, bare = TieredLruBound((40, 200, 600)), LruPrefixCache(840)
    for path in paths:
        assert bound.request(chain(path)) == bare.request(chain(path))
    assert bound.drops == 0


def test_bad_requests_change_nothing():
    with pytest.raises(ValueError, match="at least one block"):
        TieredLruBound((4, 0, 8))
    bound = TieredLruBound((2, 4))
    bound.request([1, 2])
    bound.request([3, 4])                     # 1 and 2 go to the second tier
    with pytest.raises(ValueError, match="exceeds the first tier"):
        bound.request([1, 2, 9])
    check_tiers(bound)
    assert bound.request([5, 5]) == 0 and 5 not in bound.nodes     # a repeated key: nothing added
    assert bound.request([3, 1]) == 1 and 1 in bound.nodes and bound.nodes[1].parent is None
    check_tiers(bound)
    assert bound.request([1, 2]) == 2


@pytest.mark.parametrize("caps", [(8, 2, 50), (8, 3, 3), (6, 6, 1), (10, 40, 5)])
async def test_the_bound_makes_the_stores_decisions(tmp_path, caps):
    """Small and lopsided tiers: batches skip a tier too small for them,
    promotions come before extensions, a drop takes the block's subtree.
    Not to the page: a page the store demotes keeps its recency in the
    colder tier, where the bound files it as the newest."""
    rng = random.Random(3)
    reqs = []
    for _ in range(300):
        root = rng.randint(0, 12)
        reqs.append([root * 1000 + i for i in range(rng.randint(1, 6))])
    bound = TieredLruBound(caps)
    g, h, d = caps
    cfg = config(gpu=g, host=h, disk=d, disk_dir=tmp_path, tpb=512, layers=[LayerSpec(0, (("k", 64),))],
                 persist_on_close=False)
    cfg.gpu.reserve = cfg.host.reserve = 0.0
    hits = 0
    async with Store.open(cfg) as store:
        for keys in reqs:
            bound.request(keys)
            hits += await prefill_keys(store, keys)
        await store.drain()
        stats = store.stats()
    moved = sum(m["pages"] for m in stats["moves"].values())
    assert bound.hits > 0 and bound.moves > 0
    assert abs(hits - bound.hits) <= 0.01 * bound.hits
    assert abs(moved - bound.moves) <= 0.01 * bound.moves
    assert abs(stats["drops"] - bound.drops) <= 0.1 * max(bound.drops, 20)

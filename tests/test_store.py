"""Store semantics: content through tiers, reuse policies, eviction, errors."""
from __future__ import annotations

import asyncio

import pytest
import torch

from runtime import (LayerSpec, OutOfPagesError, ReusePolicy, Store, StoreClosedError, UsageError)
from runtime.tools.content import matches
from runtime.keys import hash_blocks

from helpers import config, expected_block, fill, prefill_keys, read_block, toks, two_life_cycles, write_blocks


async def test_pages_survive_host_and_disk_bit_exact(tmp_path):
    cfg = config(gpu=4, host=4, disk=32, disk_dir=tmp_path)
    async with Store.open(cfg) as store:
        a = await fill(store, toks(1, 4))
        await fill(store, toks(2, 4))             # pushes A to host
        seq = await store.open_sequence(tokens=toks(1, 4))
        assert seq.matched_blocks == 4 and seq.matched_by_tier["host"] == 4
        await seq.close()
        await fill(store, toks(3, 4))             # A: host -> disk
        await fill(store, toks(4, 4))
        seq = await store.open_sequence(tokens=toks(1, 4))
        assert seq.matched_blocks == 4 and seq.matched_by_tier["disk"] == 4
        await seq.acquire()
        for b in range(4):
            assert torch.equal(read_block(store, seq, 0, b), expected_block(store, seq, 0, b))
        await seq.release()
        await seq.close()
        moves = store.stats()["moves"]
        assert moves["gpu->host"]["pages"] >= 8 and moves["host->disk"]["pages"] >= 4
        assert moves["disk->gpu"]["pages"] == 4
        await store.drain()
        store.check_consistency()
    del a


async def test_int8_pages_within_bound(tmp_path):
    layers = [LayerSpec(0, (("k", 256), ("v", 256)), dtype="float16")]
    cfg = config(gpu=4, host=4, disk=16, disk_dir=tmp_path, layers=layers, codec="int8")
    async with Store.open(cfg) as store:
        await fill(store, toks(1, 4))
        await fill(store, toks(2, 4))
        await fill(store, toks(3, 4))
        seq = await store.open_sequence(tokens=toks(1, 4))
        assert seq.matched_by_tier["disk"] == 4
        await seq.acquire()
        got = torch.stack([read_block(store, seq, 0, b) for b in range(4)])
        want = torch.stack([expected_block(store, seq, 0, b) for b in range(4)])
        assert matches(got, want, lossless=False).all()
        assert not torch.equal(got, want)         # it really went through the lossy codec
        assert store.stats()["tiers"]["host"]["groups"][0]["slot_bytes"] == 256 + 4 * 4


def _window_pages(store, tokens, lc):
    keys = hash_blocks(tokens, store.tpb)
    return [store.nodes[k].pages[lc] for k in keys]


@pytest.mark.parametrize("policy,expected", [(ReusePolicy.SINK_REQUIRED_ONLY, 6), (ReusePolicy.REQUIRED, 1)])
async def test_window_pages_evicted(policy, expected):
    cfg = config(gpu=32, layers=two_life_cycles(policy, window=8, sinks=4))
    async with Store.open(cfg) as store:
        await fill(store, toks(1, 6))
        pages = _window_pages(store, toks(1, 6), 1)
        for p in pages[1:]:                        # every window page but the sink's
            store._drop(p)
        seq = await store.open_sequence(tokens=toks(1, 6))
        assert seq.matched_blocks == expected
        await seq.acquire()
        # the needed window pages that were dropped come back empty, to be recomputed
        assert seq.recompute_blocks(1) == ([4, 5] if expected == 6 else [])
        assert seq.recompute_blocks(0) == []
        await seq.release()
        await seq.close()
        await store.drain()
        store.check_consistency()


async def test_optional_pages_never_limit_a_match():
    cfg = config(gpu=32, layers=two_life_cycles(ReusePolicy.OPTIONAL, window=8, sinks=4))
    async with Store.open(cfg) as store:
        assert store.pool_groups("gpu") == {0: 0, 1: 1}     # OPTIONAL keeps its own pools
        await fill(store, toks(1, 6))
        for p in _window_pages(store, toks(1, 6), 1):
            store._drop(p)
        seq = await store.open_sequence(tokens=toks(1, 6))
        assert seq.matched_blocks == 6
        await seq.acquire()
        assert seq.recompute_blocks(1) == [0, 4, 5]
        write_blocks(store, seq, [0, 4, 5])
        seq.commit(6)                               # recomputed pages fill the index's holes
        await seq.release()
        await seq.close()
        assert sum(p is not None for p in _window_pages(store, toks(1, 6), 1)) == 3


async def test_private_pages_are_never_published():
    layers = [LayerSpec(0, (("k", 128),)), LayerSpec(1, (("k", 128),), reuse=ReusePolicy.PRIVATE)]
    cfg = config(gpu=16, layers=layers)
    async with Store.open(cfg) as store:
        await fill(store, toks(1, 4))
        assert all(p is None for p in _window_pages(store, toks(1, 4), 1))
        gpu = store.stats()["tiers"]["gpu"]["groups"]
        assert [g["used"] for g in gpu] == [4, 0]          # private pages freed at close
        seq = await store.open_sequence(tokens=toks(1, 4))
        assert seq.matched_blocks == 4
        await seq.acquire()
        assert seq.recompute_blocks(1) == [0, 1, 2, 3]
        await seq.close()


async def test_dropping_a_prefix_critical_page_drops_the_subtree():
    cfg = config(gpu=32)
    async with Store.open(cfg) as store:
        await fill(store, toks(1, 6))
        await fill(store, toks(1, 4) + toks(9, 3))          # a sibling branch after block 3
        assert store.stats()["indexed_blocks"] == 9
        keys = hash_blocks(toks(1, 6), 4)
        store._drop(store.nodes[keys[2]].pages[0])
        assert store.stats()["indexed_blocks"] == 2
        assert store.stats()["tiers"]["gpu"]["groups"][0]["used"] == 2
        seq = await store.open_sequence(tokens=toks(1, 6))
        assert seq.matched_blocks == 2
        await seq.close()
        await store.drain()
        store.check_consistency()


async def test_locked_pages_never_move_and_out_of_pages_changes_nothing():
    async with Store.open(config(gpu=8)) as store:
        seq = await store.open_sequence(tokens=toks(1, 6))
        await seq.acquire()
        await seq.extend(6)
        write_blocks(store, seq, range(6))
        before = store.stats()
        other = await store.open_sequence(tokens=toks(2, 4))
        await other.acquire()
        with pytest.raises(OutOfPagesError):
            await other.extend(4)
        assert other.num_blocks == 0
        assert store.stats()["tiers"] == before["tiers"]
        for b in range(6):
            assert torch.equal(read_block(store, seq, 0, b), expected_block(store, seq, 0, b))
        await other.close()
        seq.commit(6)
        await seq.release()
        # HELD (released, not closed) pages may not be dropped from the last tier either
        third = await store.open_sequence(tokens=toks(3, 4))
        with pytest.raises(OutOfPagesError):
            await third.extend(4)
        await third.close()
        await seq.close()
        await fill(store, toks(3, 4))                        # now they are DROPPABLE
        await store.drain()
        store.check_consistency()


async def test_lowest_priority_then_lru_is_evicted_first():
    async with Store.open(config(gpu=8)) as store:
        await fill(store, toks(1, 2), priority=80)
        await fill(store, toks(2, 2), priority=10)
        await fill(store, toks(3, 2), priority=35)
        await fill(store, toks(4, 2), priority=35)
        await fill(store, toks(5, 2), priority=35)            # evicts the priority-10 pages
        assert (await store.open_sequence(tokens=toks(2, 2))).matched_blocks == 0
        await fill(store, toks(6, 2), priority=35)            # then the least recent at 35
        assert (await store.open_sequence(tokens=toks(3, 2))).matched_blocks == 0
        assert (await store.open_sequence(tokens=toks(1, 2))).matched_blocks == 2


async def test_descendants_are_evicted_before_ancestors():
    async with Store.open(config(gpu=6)) as store:
        await fill(store, toks(1, 4))
        await fill(store, toks(2, 1))
        await fill(store, toks(3, 2))                         # needs 1 more slot: block 3 of seq 1 goes
        seq = await store.open_sequence(tokens=toks(1, 4))
        assert seq.matched_blocks == 3
        await seq.close()


async def test_misuse_raises_and_changes_nothing():
    async with Store.open(config(gpu=8)) as store:
        with pytest.raises(UsageError):
            await store.open_sequence(tokens=[1, 2], block_keys=[1])
        with pytest.raises(UsageError):
            await store.open_sequence(block_keys=[1.5, 2.0])
        with pytest.raises(UsageError):
            await store.open_sequence(block_keys=[1, b"x"])
        with pytest.raises(UsageError):
            await store.open_sequence(block_keys=[1], priority=101)
        seq = await store.open_sequence(tokens=toks(1, 2))
        with pytest.raises(UsageError):
            seq.commit(1)                                   # nothing written yet
        await seq.extend(2)
        with pytest.raises(UsageError):
            seq.commit(3)
        with pytest.raises(UsageError):
            await seq.extend(-1)
        with pytest.raises(UsageError):
            seq.page_indices(7)
        with pytest.raises(UsageError):
            store.pool_tensor(0, "q")
        await seq.close()
        with pytest.raises(StoreClosedError):
            await seq.extend(1)
        with pytest.raises(StoreClosedError):
            await seq.close()
        assert store.stats()["tiers"]["gpu"]["groups"][0]["used"] == 0
    with pytest.raises(StoreClosedError):
        await store.open_sequence(tokens=[1])
    with pytest.raises(StoreClosedError):
        store.stats()


async def test_block_keys_and_append():
    async with Store.open(config(gpu=8)) as store:
        seq = await store.open_sequence(block_keys=[11, 12])
        await seq.extend(3)
        with pytest.raises(UsageError):
            seq.commit(3)
        seq.append(block_keys=[13])
        seq.commit(3)
        await seq.close()
        seq = await store.open_sequence(block_keys=[11, 12, 13, 14])
        assert seq.matched_blocks == 3
        await seq.close()
        t = await store.open_sequence(tokens=list(range(6)))
        assert len(t.keys) == 1
        with pytest.raises(UsageError):
            t.append(tokens=[6, "x"])                        # nothing half-applied
        with pytest.raises(UsageError):
            await store.open_sequence(tokens=[1.7, 2])
        t.append(tokens=[6, 7])
        assert t.keys == hash_blocks(list(range(8)), 4)
        await t.close()


def test_block_keys_are_stable_across_processes():
    import subprocess
    import sys
    code = "from runtime.keys import hash_blocks; print(hash_blocks(list(range(64)), 16, b's')[-1].hex())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == hash_blocks(list(range(64)), 16, b"s")[-1].hex()
    assert hash_blocks(list(range(64)), 16, b"s") != hash_blocks(list(range(64)), 16, b"t")


def test_a_store_used_from_another_event_loop_says_so(tmp_path):
    """The store's tasks and futures live on the loop it started on: another loop gets a
    UsageError that says so, not asyncio's "attached to a different loop" half-way through."""
    store = Store.open(config(gpu=64, host=64, disk=512, disk_dir=tmp_path, persist_on_close=False))
    first, second = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        first.run_until_complete(store.start())
        with pytest.raises(UsageError, match="event loop it was opened on"):
            second.run_until_complete(store.open_sequence(block_keys=[1, 2]))
        assert first.run_until_complete(prefill_keys(store, [1, 2])) == 0    # its own loop still serves
        first.run_until_complete(store.close())
    finally:
        first.close()
        second.close()


async def test_stats_count_hits_and_moves_per_pool_group(tmp_path):
    """DESIGN.md's stats() are per tier and pool group: hits (pages matched there), and moves,
    bytes and bandwidth each way; the groups' figures add up to the tier's and direction's."""
    from runtime import ReusePolicy
    from helpers import two_life_cycles
    cfg = config(gpu=12, host=24, disk=64, disk_dir=tmp_path,
                 layers=two_life_cycles(ReusePolicy.OPTIONAL, window=8, sinks=4))
    async with Store.open(cfg) as store:
        assert store.pool_groups("gpu") == {0: 0, 1: 1}
        for rnd in range(2):
            for base in range(12):
                await fill(store, toks(base, 3))
        await store.drain()
        st = store.stats()
        blocks = sum(st["hits"].values())
        for name, tier in st["tiers"].items():
            groups = tier["groups"]
            assert len(groups) == 2
            assert sum(g["hit_pages"] for g in groups) >= tier["hits"]      # a block hit has a page or more
            for way, end in (("out", 0), ("in", 1)):
                moved = sum(m["pages"] for d, m in st["moves"].items() if d.split("->")[end] == name)
                nbytes = sum(m["bytes"] for d, m in st["moves"].items() if d.split("->")[end] == name)
                assert sum(g[f"moved_{way}"]["pages"] for g in groups) == moved, (name, way)
                assert sum(g[f"moved_{way}"]["bytes"] for g in groups) == nbytes, (name, way)
        assert blocks > 0 and st["tiers"]["host"]["groups"][1]["hit_pages"] > 0      # the OPTIONAL group's own
        assert st["tiers"]["disk"]["groups"][0]["moved_in"]["pages"] > 0
        g = st["tiers"]["gpu"]["groups"][0]["moved_out"]
        assert g["bandwidth_gbps"] > 0 and g["bytes"] == g["pages"] * st["tiers"]["gpu"]["groups"][0]["slot_bytes"]

"""Regression tests for bugs found in review: each failed before its fix."""
from __future__ import annotations

import asyncio
import errno
import time

import pytest
import torch

from runtime import LayerSpec, ReusePolicy, Store, StoreClosedError, TierIOError, UsageError
from runtime.pages import DISK, GPU, HOST

from helpers import (check_seq, config, expected_block, fill, prefill_keys, read_block, toks, two_life_cycles,
                     write_blocks)


async def test_held_pages_in_the_last_tier_are_never_dropped(tmp_path):
    async with Store.open(config(gpu=4, host=4, disk=12, disk_dir=tmp_path)) as store:
        for base in (1, 2, 3):
            await fill(store, toks(base, 4))                   # toks(1) now on disk, the last tier
        seq = await store.open_sequence(tokens=toks(1, 4))
        assert seq.matched_by_tier["disk"] == 4
        await store.drain()
        store.check_consistency()
        for base in range(10, 18):
            await fill(store, toks(base, 4))                   # disk pressure while seq holds its pages
        assert not any(p.dead for row in seq.pages for p in row)
        await seq.acquire()
        assert seq.recompute_blocks(0) == []
        await seq.close()


@pytest.mark.parametrize("failing_batch", [1, 2])
async def test_partly_failed_demotion_returns_slots_to_the_right_allocator(failing_batch):
    kv = (("k", 128), ("v", 128))
    layers = [LayerSpec(0, kv, codec="concat"),     # one GPU group feeding two cold groups
              LayerSpec(1, kv, window_tokens=8, sink_tokens=4, reuse=ReusePolicy.SINK_REQUIRED_ONLY, codec="int8")]
    async with Store.open(config(gpu=8, host=16, layers=layers)) as store:
        assert len(set(store.pool_groups("host").values())) == 2
        await fill(store, toks(1, 4))
        calls = {"n": 0}

        def fault(src, dst):
            if (src, dst) == (GPU, HOST):
                calls["n"] += 1
                if calls["n"] == failing_batch:
                    raise TierIOError("injected")
        store.engine.fault = fault
        with pytest.raises(TierIOError):
            await fill(store, toks(2, 4))
        await store.drain()
        store.check_consistency()


async def test_a_move_whose_setup_raises_settles_its_claims_and_slots(monkeypatch):
    """A batch failing before its copy starts (here the remote tee's setup) gives its slots back
    and ends its claims, as one failing in the copy does: before, its claims stayed and its
    pages could never move, be dropped or close cleanly."""
    async with Store.open(config(gpu=8, host=16)) as store:
        await fill(store, toks(1, 8))                           # the GPU full of committed pages
        free_host = store.core.free(HOST, 0)

        def broken(job, batch, group):
            raise RuntimeError("injected in a batch's setup")
        monkeypatch.setattr(store.moves, "tee_to_remote", broken)
        with pytest.raises(RuntimeError, match="injected"):
            await fill(store, toks(2, 8))                       # must demote toks(1) to the host
        await store.drain()
        store.check_consistency()
        assert store.core.free(HOST, 0) == free_host      # the destination slots went back
        monkeypatch.undo()
        assert await check_seq(store, 1, 8) == 8                # the pages stayed, unclaimed, intact
        await fill(store, toks(2, 8))                           # and they can move now
        assert (await check_seq(store, 1, 8)) == 8


async def test_a_page_found_bad_is_counted_once_in_discarded_pages(tmp_path):
    """Audit find: a disk page failing its checksum at read counted twice in
    ``stats()["discarded_pages"]`` (and the metric), by the disk tier and by the core."""
    async with Store.open(config(gpu=8, disk=16, disk_dir=tmp_path)) as store:
        await fill(store, toks(1, 3))                           # persisted at close
    seg = tmp_path / "group-0.seg"
    data = bytearray(seg.read_bytes())
    data[:] = bytes(len(data))                                  # every page zeroed
    seg.write_bytes(bytes(data))
    async with Store.open(config(gpu=8, disk=16, disk_dir=tmp_path)) as store:
        assert store.stats()["discarded_pages"] == 0            # checked when read, not at open
        seq = await store.open_sequence(tokens=toks(1, 3))
        assert seq.matched_by_tier["disk"] == 3
        await seq.acquire()
        assert seq.recompute_blocks(0) == [0, 1, 2]
        await seq.close()
        st = store.stats()
        assert st["corrupt_pages"] == 3 and st["discarded_pages"] == 3


async def test_matched_by_tier_and_hits_name_all_four_tiers_without_a_remote():
    """Audit find: DESIGN.md's ``matched_by_tier`` names "remote" too; without a remote tier the
    key was missing (a server reading it got a KeyError), as it was from ``stats()["hits"]``."""
    async with Store.open(config(gpu=8, host=8)) as store:
        await fill(store, toks(1, 2))
        seq = await store.open_sequence(tokens=toks(1, 2))
        assert seq.matched_by_tier == {"gpu": 2, "host": 0, "disk": 0, "remote": 0}
        await seq.close()
        assert store.stats()["hits"] == {"gpu": 2, "host": 0, "disk": 0, "remote": 0}


async def test_a_request_larger_than_the_gpu_pool_is_one_error_type_for_acquire_and_extend(tmp_path):
    """Audit find: DESIGN.md names OutOfPagesError for a request that cannot fit; an extend past
    the GPU pool's size raised a UsageError, an acquire past it an OutOfPagesError a server would
    retry for ever. Both now raise RequestTooLargeError, which is both, and change nothing."""
    from runtime import OutOfPagesError, RequestTooLargeError
    async with Store.open(config(gpu=16, disk=64, disk_dir=tmp_path)) as store:
        await fill(store, toks(1, 12))                          # persisted at close
    async with Store.open(config(gpu=8, disk=64, disk_dir=tmp_path)) as store:
        seq = await store.open_sequence(tokens=toks(2, 12))
        with pytest.raises(RequestTooLargeError, match="holds 8") as e:
            await seq.extend(12)
        assert isinstance(e.value, OutOfPagesError) and isinstance(e.value, UsageError)
        assert seq.num_blocks == 0
        await seq.close()
        free = store.core.free(GPU, 0)
        seq = await store.open_sequence(tokens=toks(1, 12))
        assert seq.matched_by_tier["disk"] == 12
        with pytest.raises(RequestTooLargeError, match="acquiring needs 12 pages of GPU pool group 0, which holds 8"):
            await seq.acquire()
        assert not seq.acquired
        await seq.close()
        store.check_consistency()
        assert store.core.free(GPU, 0) >= free
        assert await check_seq(store, 1, 8) == 8                # the pages stayed, intact


async def test_an_extend_past_the_gpu_beside_the_pages_it_holds_is_too_large():
    """New-user find: only the new pages were compared with the group's size; with the pages the
    sequence already holds locked, the extend can never fit either."""
    from runtime import RequestTooLargeError
    async with Store.open(config(gpu=16)) as store:
        await fill(store, toks(1, 6))
        seq = await store.open_sequence(tokens=toks(1, 14))
        await seq.acquire()
        await seq.extend(2)                                     # 8 held
        with pytest.raises(RequestTooLargeError, match="10 new pages of GPU pool group 0 beside the 8"):
            await seq.extend(10)
        assert seq.num_blocks == 8
        await seq.extend(6)                                     # 16: fits exactly
        await seq.close()
        store.check_consistency()


async def test_release_unlocks_only_what_this_sequence_locked():
    async with Store.open(config(gpu=24, host=32, layers=two_life_cycles())) as store:
        await fill(store, toks(1, 6))
        y = await store.open_sequence(tokens=toks(1, 3))        # its window needs blocks 0..2
        await y.acquire()
        x = await store.open_sequence(tokens=toks(1, 6))        # holds blocks 1..2 without locking them
        await x.acquire()
        await x.release()
        assert [row[1].locks for row in y.pages] == [1, 1, 1]
        for base in range(10, 16):
            await fill(store, toks(base, 4))                    # GPU pressure
        assert all(i >= 0 for i in y.page_indices(1))
        await y.release()
        await x.close()
        await y.close()
        await store.drain()
        store.check_consistency()


async def test_private_pages_are_never_shared_through_the_index():
    kv = (("k", 128), ("v", 128))
    layers = [LayerSpec(0, kv), LayerSpec(1, kv, reuse=ReusePolicy.PRIVATE)]
    async with Store.open(config(gpu=16, layers=layers)) as store:
        a = await store.open_sequence(tokens=toks(1, 2))
        await a.acquire()
        await a.extend(2)
        write_blocks(store, a, range(2))
        a.commit(2)
        assert store.nodes[a.keys[0]].pages[1] is None
        b = await store.open_sequence(tokens=toks(1, 2))
        assert all(row[1] is None for row in b.pages)
        await b.acquire()
        assert b.recompute_blocks(1) == [0, 1]
        slots_b = b.page_indices(1)
        await a.close()
        c = await store.open_sequence(tokens=toks(2, 2))
        await c.acquire()
        await c.extend(2)
        assert not set(c.page_indices(1)) & set(slots_b)
        for s in (b, c):
            await s.close()
        await store.drain()
        store.check_consistency()


async def test_commit_after_the_shared_prefix_was_dropped_does_not_index_orphans():
    async with Store.open(config(gpu=12)) as store:
        prompt = toks(1, 3)
        a = await store.open_sequence(tokens=prompt)
        b = await store.open_sequence(tokens=prompt)            # the same prompt, concurrently
        for s in (a, b):
            await s.acquire()
            await s.extend(3)
            write_blocks(store, s, range(3))
        b.commit(2)
        await b.release()
        await b.close()
        a.commit(2)                                             # dedupes onto b's blocks
        await fill(store, toks(9, 8))                           # b's blocks are dropped
        a.commit(3)
        assert a.keys[2] not in store.nodes
        await a.close()
        c = await store.open_sequence(tokens=prompt)
        await c.acquire()
        await c.extend(3 - c.num_blocks)
        write_blocks(store, c, range(3))
        c.commit(3)                                             # no "indexed at another position"
        await c.close()
        await store.drain()
        store.check_consistency()


async def test_a_claim_split_into_batches_completes_page_by_page(tmp_path):
    """Host and disk pages promoted by one acquire move in two batches. A page
    still on disk must read as moving until its own batch lands, though the
    host batch finished (a shared future made waiters see it done early)."""
    store = await Store.open(config(gpu=8, host=4, disk=32, disk_dir=tmp_path))
    try:
        a = toks(1, 8)
        await fill(store, a)
        await fill(store, toks(2, 4))            # A's deeper half goes to host ...
        await fill(store, toks(3, 4))            # ... then its first half, pushing the deeper half to disk
        await store.drain()
        seq = await store.open_sequence(tokens=a)

        def pages():                            # a fresh snapshot of the sequence's pages
            return [row[0] for row in seq.pages]
        tiers = {p.tier for p in pages()}
        assert tiers == {HOST, DISK}, tiers
        read = store.disk.read

        def slow_read(*args):
            time.sleep(0.3)
            return read(*args)
        store.disk.read = slow_read
        store.disk.read_cached = lambda *args: False     # a slow disk: nothing in the page cache
        task = asyncio.ensure_future(seq.acquire())
        for _ in range(200):
            await asyncio.sleep(0.005)
            if any(p.tier == GPU for p in pages()):
                break
        now = pages()
        still_on_disk = [p for p in now if p.tier == DISK]
        assert any(p.tier == GPU for p in now) and still_on_disk
        assert all(p.claim and not store.claims.futures[p.claim].done() for p in still_on_disk)
        await task
        assert all(p.tier == GPU for p in pages())
        for b in range(8):
            assert torch.equal(read_block(store, seq, 0, b), expected_block(store, seq, 0, b))
        await seq.close()
    finally:
        await store.close()


async def test_a_waiter_on_a_split_promotion_gets_only_its_own_batchs_error(tmp_path):
    """B waits on host pages that A's acquire is promoting together with disk
    pages whose read fails. B's batch succeeded: B must not get A's error."""
    store = await Store.open(config(gpu=8, host=4, disk=32, disk_dir=tmp_path))
    seqs = []
    try:
        a = toks(1, 8)
        await fill(store, a)
        await fill(store, toks(2, 4))
        await fill(store, toks(3, 4))
        await store.drain()
        seq_a = await store.open_sequence(tokens=a)
        seq_b = await store.open_sequence(tokens=a[:16])      # A's first half only: on host
        seqs += [seq_a, seq_b]
        def b_pages():                          # a fresh snapshot of B's pages
            return [row[0] for row in seq_b.pages]
        assert {p.tier for p in b_pages()} == {HOST}
        assert {row[0].tier for row in seq_a.pages} == {HOST, DISK}
        write = store.disk.write

        def slow_write(*args, **kw):    # A's demotions take a while, so B joins before any batch runs
            time.sleep(0.2)
            return write(*args, **kw)
        store.disk.write = slow_write
        store.disk.inject_fault("read", errno.EIO, count=10)   # A's disk batch fails
        ta = asyncio.ensure_future(seq_a.acquire())
        for _ in range(100):
            await asyncio.sleep(0.001)
            if all(p.claim for p in b_pages()):
                break
        assert all(p.claim for p in b_pages())
        tb = asyncio.ensure_future(seq_b.acquire())
        (res_a,) = await asyncio.gather(ta, return_exceptions=True)
        await tb                                               # raised A's TierIOError before the fix
        assert isinstance(res_a, TierIOError)
        assert all(p.tier == GPU for p in b_pages())
        for b in range(4):
            assert torch.equal(read_block(store, seq_b, 0, b), expected_block(store, seq_b, 0, b))
    finally:
        for seq in seqs:
            if not seq.closed:
                await seq.close()
        await store.close()


async def test_closing_a_sequence_after_its_store_closed_is_quiet(tmp_path):
    """Its uncommitted pages went to disk; the store is gone. close() used to
    try to free them on the closed disk stream (RuntimeError)."""
    store = await Store.open(config(gpu=4, host=4, disk=32, disk_dir=tmp_path))
    seq = await store.open_sequence(tokens=toks(0, 4))
    await seq.acquire()
    await seq.extend(4)
    write_blocks(store, seq, range(4))
    await seq.release()
    for base in (1, 2, 3):
        await fill(store, toks(base, 4))
    await store.drain()
    assert any(p.tier == DISK for row in seq.pages for p in row)
    await store.close()
    await seq.close()
    assert seq.closed
    with pytest.raises(StoreClosedError):
        await seq.acquire()


async def test_closing_a_sequence_leaves_a_shared_unpublished_page_to_its_other_holder():
    """A's and B's shared prefix loses its block-2 page (a drop, as for a
    corrupt disk page): block 3 becomes unpublished but both still hold it,
    and B has it locked. A's close freed it under B's lock (found in review)."""
    async with Store.open(config(gpu=16)) as store:
        await fill(store, toks(1, 4))
        a = await store.open_sequence(tokens=toks(1, 4))
        b = await store.open_sequence(tokens=toks(1, 4))
        await b.acquire()
        locked = b.locked_indices(0)
        assert min(locked) >= 0
        store._drop(a.pages[2][0])
        await a.close()
        p3 = b.pages[3][0]
        assert not p3.dead and p3.locks == 1 and b.locked_indices(0)[3] == locked[3]
        c = await store.open_sequence(tokens=toks(99, 4))
        await c.extend(4)
        assert locked[3] not in c.page_indices(0)         # B's locked slot is not handed out
        await b.release()
        await b.close()
        await c.close()
        store.check_consistency()
        assert store.stats()["tiers"]["gpu"]["groups"][0]["used"] == 2      # blocks 0 and 1 stay indexed


async def test_a_second_start_waits_for_recovery(tmp_path):
    """Recovery rebuilds the core off the loop; a second start() (or any use)
    must not reach the core meanwhile (found in review: it returned at once)."""
    cfg = lambda: config(gpu=16, host=16, disk=8192, disk_dir=tmp_path)     # noqa: E731
    async with Store.open(cfg()) as store:
        for base in range(300):
            await prefill_keys(store, [base * 100 + i for i in range(8)])
    store = Store.open(cfg())
    first = asyncio.ensure_future(store.start())
    await asyncio.sleep(0)
    with pytest.raises(UsageError, match="not started"):
        await store.open_sequence(block_keys=[1, 2])
    await store.start()
    assert first.done() and store.started
    seq = await store.open_sequence(block_keys=list(range(8)))
    assert seq.matched_blocks == 8
    await seq.close()
    await store.close()


def test_a_page_held_by_65535_sequences_is_not_matched_by_one_more():
    """The core counts holders in 16 bits: the 65536th sequence must not wrap
    the count (the page became droppable under its holders, found in review)."""
    from runtime.core import Core
    c = Core(4, [(False, 0, 0, 0)], [[0], [-1], [-1]], [[4], [], []])
    s, _, _ = c.open([1], 35)
    c.extend_now(s, 1)
    c.commit(s, 1)
    c.close(s)
    sids = [c.open([1], 35) for _ in range(65535)]
    assert all(m == 1 for _, m, _ in sids)
    _, matched, _ = c.open([1], 35)
    assert matched == 0
    assert c.pick_victims(0, 0, 1, 0) is None              # still held: never a victim
    for sid, _, _ in sids:
        c.close(sid)
    c.check()


@pytest.mark.parametrize("layers", [None, "two"])
async def test_a_gpu_only_store_drops_in_line_and_serves_only_exact_pages(layers):
    """A GPU-only store makes room by dropping without a task (_drop_for):
    every page a later request matches must still be the bytes written."""
    from runtime.tools.replay import replay
    from runtime.tools.trace import TraceRequest
    import random
    rng = random.Random(5)
    reqs = []
    for i in range(120):
        base = rng.randrange(12)
        reqs.append(TraceRequest(float(i), 0, 0, [base * 1000 + j for j in range(rng.randrange(1, 7))]
                                 + [100000 + i * 10 + j for j in range(rng.randrange(0, 3))]))
    cfg = config(gpu=24 if layers else 12, layers=two_life_cycles() if layers else None)   # 2 pages a block
    async with Store.open(cfg) as store:
        res = await replay(store, reqs, content=True, verify=True)
        store.check_consistency()
        assert res.corrupt_pages == 0 and res.verified_pages > 50 and res.hit_blocks > 0
        assert store.stats()["drops"] > 0 and not res.errors

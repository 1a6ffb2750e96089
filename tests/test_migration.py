"""Migration: shared moves, no redundant copies, failures, cancellation,
tier equivalence with a plain LRU, and concurrent sequences under pressure."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import threading
from collections import OrderedDict

import pytest
import torch

from runtime import LayerSpec, ReusePolicy, Store, TierIOError, migration
from runtime.tools.oracle import TieredLruBound
from runtime.pages import DISK, GPU, HOST
from runtime.tools.trace import read_trace
from tiers.streams import HostEvent

from helpers import (DEVICE, acquire_while_held, config, expected_block, fill, half_inline_layers, prefill_keys,
                     read_block, toks, two_life_cycles, write_blocks)

TRACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "traces",
                     "synthetic_trace.jsonl")


@contextlib.asynccontextmanager
async def _gpu_of_64_committed():
    """A store of 64 GPU slots (a reserve of 8) and 512 host slots, with 64 pages committed."""
    cfg = config(gpu=64, host=512, tpb=1)
    cfg.gpu.reserve = 0.125
    async with Store.open(cfg) as store:
        for i in range(8):
            seq = await store.open_sequence(block_keys=list(range(i * 100, i * 100 + 8)))
            await seq.extend(8)
            seq.commit(8)
            await seq.close()
        await store.drain()
        yield store


async def _push_to_host(store, tokens):
    await fill(store, tokens)
    await fill(store, toks(99, 4))
    seq = await store.open_sequence(tokens=tokens)
    assert seq.matched_by_tier["host"] == 4
    await seq.close()


async def test_a_small_promotion_passes_a_busy_copy_stream_and_reads_back_exact():
    """A small promotion whose pages depend on nothing queued runs on the loop even while the
    copy stream's thread is busy with other work (at concurrency 32 the streams were seldom
    idle, and each such promotion hopped to the thread); the bytes arrive exact."""
    async with Store.open(config(gpu=4, host=16)) as store:
        await _push_to_host(store, toks(1, 4))
        assert (await acquire_while_held(store, store.engine.up, toks(1, 4)))["host"] == 4
        assert store.stats()["moves"]["host->gpu"]["pages"] == 4


@pytest.mark.skipif(DEVICE == "cuda", reason="the emulated copy streams' inline jobs")
async def test_a_copy_with_a_pending_dependency_never_runs_inline_past_queued_work():
    """Inline past queued work only when nothing a job depends on is pending: with a pending
    dependency the job queues behind the wait for it, on the worker, and cached disk reads
    decline."""
    async with Store.open(config(gpu=4, host=16)) as store:
        engine = store.engine
        gate = threading.Event()
        engine.up.submit(gate.wait)                         # the stream is busy
        dep = HostEvent()                                   # a copy that has not finished
        ran = []
        job = asyncio.ensure_future(engine._stage([0.0], engine.up, lambda: ran.append(threading.get_ident()),
                                                  [dep], inline=True))
        await asyncio.sleep(0.05)
        assert not ran and not job.done()
        free = asyncio.ensure_future(engine._stage([0.0], engine.up, lambda: ran.append("free"), [], inline=True))
        await asyncio.sleep(0)
        assert ran == ["free"]                              # nothing pending: inline, past the queue
        gate.set()
        dep.set()
        await asyncio.wait_for(asyncio.gather(job, free), 5)
        assert ran[1] != threading.get_ident()              # ran on the worker, after its dependency

        class NoDisk:
            def read_cached(self, *a):
                raise AssertionError("read with a dependency pending")
        disk, engine.disk = engine.disk, NoDisk()
        try:
            assert engine._read_cached([0.0], 0, [0], None, [HostEvent()]) is False
        finally:
            engine.disk = disk


async def test_a_demotion_takes_at_least_a_refill_step():
    """At concurrency 32 demand evictions of a few pages each made 1.5x the batches of
    concurrency 1: a demotion from a group with a reserve takes at least one refill step (the
    last tier, which drops, takes only what it needs)."""
    async with _gpu_of_64_committed() as store:       # keep 8 free, refill by a step of 8
        r = store.reclaimers[(GPU, 0)]
        assert r.step == 8 and store.core.queue_len(GPU, 0) > 8
        victims = store.moves.pick_victims(GPU, 0, 1)
        assert len(victims) == 8
        store.moves.unclaim(victims, None)
        assert (HOST, 0) not in store.reclaimers                 # the last tier: no floor
        store.check_consistency()


async def test_concurrent_acquires_share_one_move():
    async with Store.open(config(gpu=4, host=16)) as store:
        await _push_to_host(store, toks(1, 4))
        seqs = [await store.open_sequence(tokens=toks(1, 4)) for _ in range(5)]
        await asyncio.gather(*(s.acquire() for s in seqs))
        assert store.stats()["moves"]["host->gpu"]["pages"] == 4
        slots = {tuple(s.page_indices(0)) for s in seqs}
        assert len(slots) == 1
        for b in range(4):
            assert torch.equal(read_block(store, seqs[0], 0, b), expected_block(store, seqs[0], 0, b))
        before = store.stats()["moves"]
        again = await store.open_sequence(tokens=toks(1, 4))
        await again.acquire()                              # already on the GPU: no copy
        assert store.stats()["moves"] == before
        for s in seqs + [again]:
            await s.close()
        await store.drain()
        store.check_consistency()


class FailsOnce:
    """A copy stream whose first job fails 0.2 s after it is submitted, without running."""

    def __init__(self, stream) -> None:
        self.stream, self.kind, self.failed = stream, stream.kind, 0

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def submit(self, fn, *args, **kw):
        if self.failed:
            return self.stream.submit(fn, *args, **kw)
        self.failed += 1
        ev = HostEvent()
        threading.Timer(0.2, ev.set, args=(TierIOError("injected EIO"),)).start()
        return ev


async def test_failed_move_keeps_the_source_and_reaches_every_waiter():
    async with Store.open(config(gpu=4, host=16)) as store:
        await _push_to_host(store, toks(1, 4))
        # the host->gpu copy job fails, late enough that every acquire is waiting on it (a hook that
        # raised at once could fail the move before the other acquires joined it: on CUDA the eviction
        # ahead of it can finish without the loop ever yielding)
        store.engine.up = FailsOnce(store.engine.up)
        seqs = [await store.open_sequence(tokens=toks(1, 4)) for _ in range(3)]
        results = await asyncio.gather(*(s.acquire() for s in seqs), return_exceptions=True)
        assert all(isinstance(r, TierIOError) for r in results), results
        assert store.stats()["moves"]["host->gpu"]["failures"] == 1
        await store.drain()
        store.check_consistency()
        for s in seqs:
            assert not s.acquired
            await s.close()
        seq = await store.open_sequence(tokens=toks(1, 4))
        assert seq.matched_by_tier["host"] == 4             # nothing lost, still scheduled
        await seq.acquire()                                  # the fault is spent: now it moves
        for b in range(4):
            assert torch.equal(read_block(store, seq, 0, b), expected_block(store, seq, 0, b))
        await seq.close()
        await store.drain()
        store.check_consistency()


@pytest.mark.skipif(DEVICE == "cuda", reason="gates the emulated copy stream's worker thread")
async def test_cancelled_acquire_leaks_nothing():
    # pages too large to copy on the loop: the promotion waits on the gated copy thread
    big = half_inline_layers()
    async with Store.open(config(gpu=4, host=16, layers=big)) as store:
        store.engine.stop_copier()                           # large copies on the stream's thread, held here
        await _push_to_host(store, toks(1, 4))
        gate = threading.Event()
        store.engine.up.submit(gate.wait)                    # the copy stream is busy
        try:
            seq = await store.open_sequence(tokens=toks(1, 4))
            task = asyncio.ensure_future(seq.acquire())
            await asyncio.sleep(0.05)
            assert not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            gate.set()
        await asyncio.gather(*store.moves.tasks)
        await asyncio.sleep(0)
        await store.drain()
        store.check_consistency()
        assert not seq.acquired and not seq.busy
        assert all(p.locks == 0 for row in seq.pages for p in row)
        tiers = {p.tier for row in seq.pages for p in row}
        assert tiers == {GPU}                                # the move completed; each page in one tier
        await seq.close()
        used = sum(g["used"] for t in store.stats()["tiers"].values() for g in t["groups"])
        assert used == 8                                     # 2 committed sequences x 4 blocks
        seq = await store.open_sequence(tokens=toks(1, 4))
        await seq.acquire()
        for b in range(4):
            assert torch.equal(read_block(store, seq, 0, b), expected_block(store, seq, 0, b))
        await seq.close()


class PlainLru:
    """The oracle: one LRU of G+H+D blocks; requests touch blocks deepest-first."""

    def __init__(self, capacity):
        self.capacity, self.lru, self.hits, self.blocks = capacity, OrderedDict(), 0, 0

    def request(self, keys):
        n = 0
        while n < len(keys) and keys[n] in self.lru:
            n += 1
        self.hits += n
        self.blocks += len(keys)
        for k in reversed(keys):
            self.lru[k] = True
            self.lru.move_to_end(k)
        while len(self.lru) > self.capacity:
            self.lru.popitem(last=False)


@pytest.mark.skipif(not os.path.exists(TRACE), reason="needs ../shared/traces beside the checkout")
async def test_tier_equivalence_with_plain_lru(tmp_path):
    requests, _ = read_trace(TRACE)
    g, h, d = 800, 2400, 6000
    oracle = PlainLru(g + h + d)
    bound = TieredLruBound((g, h, d))     # the benchmark's lean bound: it must make the store's moves
    cfg = config(gpu=g, host=h, disk=d, disk_dir=tmp_path, tpb=512,
                 layers=[LayerSpec(0, (("k", 64),))], persist_on_close=False)
    cfg.gpu.reserve = cfg.host.reserve = cfg.disk.reserve = 0.0     # the background reserve shrinks capacity by design
    hits = blocks = 0
    async with Store.open(cfg) as store:
        for r in requests:
            keys = list(r.hash_ids)
            oracle.request(keys)
            bound.request(keys)
            hits += await prefill_keys(store, keys)
            blocks += len(keys)
        await store.drain()
        store.check_consistency()
        moves = store.stats()["moves"]
        drops = store.stats()["drops"]
    assert moves["host->disk"]["pages"] > 0 and moves["disk->gpu"]["pages"] > 0
    ours, theirs = hits / blocks, oracle.hits / oracle.blocks
    print(f"hit rate: store {ours:.4f}, plain LRU {theirs:.4f}, lean bound {bound.hits / bound.lookups:.4f}")
    assert theirs > 0.2
    assert abs(ours - theirs) <= 0.005, (ours, theirs)
    assert abs(bound.hits / bound.lookups - theirs) <= 0.005
    moved = sum(m["pages"] for m in moves.values())
    print(f"moves: store {moved}, lean bound {bound.moves}; drops: {drops}, {bound.drops}")
    assert abs(moved - bound.moves) <= 0.005 * bound.moves and abs(drops - bound.drops) <= 0.005 * bound.drops


async def test_concurrent_sequences_under_pressure(tmp_path):
    rng = random.Random(7)
    cfg = config(gpu=112, host=48, disk=96, disk_dir=tmp_path, layers=two_life_cycles(window=8, sinks=4))
    prefixes = [toks(i, 3) for i in range(6)]
    verified = 0

    async with Store.open(cfg) as store:
        async def worker(wid):
            nonlocal verified
            for _ in range(12):
                tokens = rng.choice(prefixes) + toks(100 + rng.randrange(8), rng.randrange(1, 4))
                seq = await store.open_sequence(tokens=tokens, priority=rng.randrange(0, 101))
                try:
                    await seq.acquire()
                    for lc in (0, 1):
                        layer = lc
                        idx = seq.page_indices(layer)
                        skip = set(seq.recompute_blocks(layer))
                        for b in range(seq.matched_blocks):
                            if idx[b] >= 0 and b not in skip:
                                assert torch.equal(read_block(store, seq, lc, b), expected_block(store, seq, lc, b))
                                verified += 1
                    start = seq.num_blocks
                    await seq.extend(len(seq.keys) - start)
                    write_blocks(store, seq, list(range(start, len(seq.keys))) + seq.recompute_blocks(1))
                    await asyncio.sleep(0)
                    seq.commit(len(seq.keys))
                    await seq.release()
                    if rng.random() < 0.3:                      # suspend and resume
                        await asyncio.sleep(0)
                        await seq.acquire()
                        await seq.release()
                finally:
                    await seq.close()

        await asyncio.gather(*(worker(i) for i in range(8)))
        await store.drain()
        store.check_consistency()
        stats = store.stats()
        assert all(g["locked"] == 0 and g["held"] == 0 for t in stats["tiers"].values() for g in t["groups"])
        assert stats["moves"]["gpu->host"]["pages"] > 0 and stats["moves"]["host->disk"]["pages"] > 0
    assert verified > 100


async def test_prefetch_brings_pages_back_before_acquire():
    async with Store.open(config(gpu=4, host=16)) as store:
        await _push_to_host(store, toks(1, 4))
        seq = await store.open_sequence(tokens=toks(1, 4))
        seq.prefetch()
        await store.drain()
        assert store.stats()["moves"]["host->gpu"]["pages"] == 4
        assert not any(p.locks for row in seq.pages for p in row)      # prefetched pages stay unlocked
        before = store.stats()["moves"]
        await seq.acquire()                                            # nothing left to move
        assert store.stats()["moves"] == before
        for b in range(4):
            assert torch.equal(read_block(store, seq, 0, b), expected_block(store, seq, 0, b))
        await seq.close()
        other = await store.open_sequence(tokens=toks(99, 4))         # a prefetch racing an acquire
        other.prefetch()
        await other.acquire()
        assert store.stats()["moves"]["host->gpu"]["pages"] == 8
        await other.close()
        await store.drain()
        store.check_consistency()


async def test_concurrent_demand_evictions_do_not_overshoot_the_reserve():
    """Requests short of slots at once used to each evict their need plus the whole reserve,
    leaving far more free slots than the reserve (free slots hold no page: lost hits, and
    more moves). Now a request waits for demotions in flight that will give back enough,
    and the extra refills the reserve once (each batch at least a refill step)."""
    async with _gpu_of_64_committed() as store:       # keep 8 free, refill to 16
        free = store.stats()["tiers"]["gpu"]["groups"][0]["free"]
        before = store.stats()["moves"]["gpu->host"]["pages"]

        async def request(j: int) -> None:
            seq = await store.open_sequence(block_keys=list(range(10_000 + 10 * j, 10_004 + 10 * j)))
            await seq.extend(4)
            seq.commit(4)
            await seq.close()
        await asyncio.gather(*(request(j) for j in range(16)))     # 64 new pages, 16 requests at once
        await store.drain()
        st = store.stats()
        moved = st["moves"]["gpu->host"]["pages"] - before
        # a demotion batch takes at least one refill step (8), so the refill may end up to a
        # step short of another: at most one step beyond the target
        assert st["tiers"]["gpu"]["groups"][0]["free"] <= 16 + 8
        assert moved <= 64 - free + 16 + 8, moved    # what the requests took, one refill and a step (76 before)
        store.check_consistency()


async def test_requests_short_of_slots_wait_in_line_and_the_first_evicts_for_all():
    """Requests short of GPU slots at once queue: they are served in arrival order, the first
    evicts in one batch for itself and for those behind it (each used to take what was free,
    evict its own small batch and wake on every landing), and a request cancelled while in
    line leaves nothing behind."""
    cfg = config(gpu=64, host=512, tpb=1)
    cfg.gpu.reserve = 0                           # no background demotion: every eviction is on demand
    async with Store.open(cfg) as store:
        seq = await store.open_sequence(block_keys=list(range(64)))
        await seq.extend(64)                      # the GPU is full of evictable pages
        seq.commit(64)
        await seq.close()
        assert store.stats()["tiers"]["gpu"]["groups"][0]["free"] == 0
        assert "gpu->host" not in store.stats()["moves"]
        order: list[int] = []
        started, go = asyncio.Event(), asyncio.Event()
        evict = store.moves.evict

        async def held_evict(tier, victims):        # the first eviction waits until all are in line
            await go.wait()
            return await evict(tier, victims)
        store.moves.evict = held_evict

        async def request(j: int) -> None:
            seq = await store.open_sequence(block_keys=list(range(1000 + 10 * j, 1006 + 10 * j)))
            if j == 0:
                started.set()
            try:
                await seq.extend(6)
                order.append(j)
                seq.commit(6)
            finally:
                await seq.close()
        tasks = [asyncio.ensure_future(request(j)) for j in range(8)]
        await started.wait()
        for _ in range(100):
            line = store.moves.lines.get((0, 0), ())
            if len(line) == 8:
                break
            await asyncio.sleep(0)
        assert [w.need for w in line] == [6] * 8          # all eight in line, the first evicting
        tasks[5].cancel()                                 # one leaves the line while it waits
        await asyncio.sleep(0)
        go.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(results[5], asyncio.CancelledError) and not any(results[:5] + results[6:])
        assert order == [0, 1, 2, 3, 4, 6, 7]
        st = store.stats()
        # the first evicted before the others came; the next evicted once for all behind it
        assert st["moves"]["gpu->host"]["batches"] == 2
        assert st["moves"]["gpu->host"]["pages"] == 48
        assert not line and st["tiers"]["gpu"]["groups"][0]["free"] == 6     # the cancelled request's share
        store.check_consistency()


async def test_the_line_batch_fits_the_next_tier_and_fitting_requests_do_not_queue():
    """(From review.) The first in line evicts for those behind it at most a quarter of the next
    tier: a batch larger than the host can make room for skipped it whole, and 42 newer pages
    were dropped while 10 older host pages stayed. And a request that finds its slots free
    takes them without waiting behind another's eviction."""
    cfg = config(gpu=64, host=16, tpb=1)
    cfg.gpu.reserve = 0
    cfg.host.reserve = 0

    async def one(store, keys):
        seq = await store.open_sequence(block_keys=keys)
        await seq.extend(len(keys) - seq.num_blocks)
        seq.commit(len(keys))
        await seq.close()

    async with Store.open(cfg) as store:
        old, hot = list(range(10_000, 10_016)), list(range(20_000, 20_064))
        for k in old + hot:                     # the 16 old pages end up filling the host tier
            await one(store, [k])
        go = asyncio.Event()
        evict = store.moves.evict

        async def held_evict(tier, victims):    # the first eviction waits until all are in line
            await go.wait()
            return await evict(tier, victims)
        store.moves.evict = held_evict
        tasks = [asyncio.ensure_future(one(store, list(range(30_000 + 10 * j, 30_006 + 10 * j))))
                 for j in range(8)]
        for _ in range(100):
            await asyncio.sleep(0)
        assert len(store.moves.lines[(0, 0)]) == 8
        go.set()
        await asyncio.gather(*tasks)
        store.moves.evict = evict
        kept = 0
        for k in old:
            seq = await store.open_sequence(block_keys=[k])
            kept += seq.matched_blocks
            await seq.close()
        assert kept == 0, f"{kept} old pages kept while newer ones were dropped"

        # a request that fits in the free pool does not wait for the evicting head
        seq = await store.open_sequence(block_keys=list(range(40_000, 40_003)))
        await seq.extend(3)                         # holds 3 slots, uncommitted
        store.moves.evict = held_evict
        go.clear()
        head = asyncio.ensure_future(one(store, list(range(50_000, 50_006))))
        for _ in range(20):
            await asyncio.sleep(0)
        await seq.close()                           # its 3 slots are free again
        slots = await asyncio.wait_for(store.moves.obtain(0, 0, 2), 1.0)
        store.core.give_back(0, 0, slots)
        go.set()
        await head
        store.moves.evict = evict
        store.check_consistency()


async def test_reserve_batches_fit_the_next_tier():
    """(From review.) With the largest reserve and a host smaller than a refill batch, the GPU
    reclaimer's batches skipped the host whole and were dropped while the host kept its oldest
    pages for good. Batches beyond a request's own need are capped at a quarter of the next
    tier, so the host makes room for them: what is dropped is the oldest."""
    cfg = config(gpu=64, host=16, tpb=1)
    cfg.gpu.reserve = 0.5
    cfg.host.reserve = 0
    async with Store.open(cfg) as store:
        keys = []
        for j in range(20):
            ks = list(range(1000 * j, 1000 * j + 6))
            keys += ks
            seq = await store.open_sequence(block_keys=ks)
            await seq.extend(6)
            seq.commit(6)
            await seq.close()
            await asyncio.sleep(0.005)
        await store.drain()
        have = [store.nodes.get(k) is not None and store.nodes[k].pages[0] is not None for k in keys]
        oldest_kept = have.index(True)
        newest_dropped = max(i for i, h in enumerate(have) if not h)
        assert newest_dropped < oldest_kept + 6, (oldest_kept, newest_dropped)
        store.check_consistency()


async def test_the_first_in_line_is_not_starved_by_requests_that_fit():
    """(From review.) The first in line waiting for background demotions got its slots from the
    free pool, where requests that fit (the Sequence's fast path) took them first, landing after
    landing. It now waits for at most a couple of landings, then evicts for itself."""
    cfg = config(gpu=64, host=4096, tpb=1)
    cfg.gpu.reserve = 0.1
    cfg.host.reserve = 0
    async with Store.open(cfg) as store:
        core = store.core
        keys = itertools.count(1_000_000)
        for _ in range(64):
            seq = await store.open_sequence(block_keys=[next(keys)])
            await seq.extend(1)
            seq.commit(1)
            await seq.close()
            await asyncio.sleep(0)
        await store.drain()
        go = asyncio.Event()
        evict = store.moves.evict

        async def gated(tier, victims):             # demotions land only when the test says
            await go.wait()
            return await evict(tier, victims)
        store.moves.evict = gated
        stop = False

        async def newcomers() -> None:              # requests that fit in the free pool as they arrive
            while not stop:
                await asyncio.sleep(0)
                f = core.free(0, 0)
                if f:
                    seq = await store.open_sequence(block_keys=[next(keys) for _ in range(f)])
                    await seq.extend(f)
                    seq.commit(f)
                    await seq.close()
        nc = asyncio.ensure_future(newcomers())
        for _ in range(20):
            await asyncio.sleep(0)
        head = asyncio.ensure_future(store.moves.obtain(0, 0, 8))
        for _ in range(40):                         # 40 landings of the background demotion
            for _ in range(5):
                await asyncio.sleep(0)
            go.set()
            await asyncio.sleep(0)
            go.clear()
            for _ in range(5):
                await asyncio.sleep(0)
            if head.done():
                break
        stop = True
        go.set()
        store.moves.evict = evict
        await nc
        assert head.done(), "the first in line got nothing in 40 landings"
        core.give_back(0, 0, head.result())
        await store.drain()
        store.check_consistency()


@pytest.mark.skipif(not os.path.exists(TRACE), reason="needs ../shared/traces beside the checkout")
@pytest.mark.parametrize("trace, n, split", [
    ("synthetic", 2000, (3000, 1000, 500)), ("synthetic", 2000, (4000, 4000, 4000)),
    ("synthetic", 2000, (6000, 200, 200)),
    pytest.param("conversation", 4000, (1000, 3000, 6000), marks=pytest.mark.skipif(
        not os.path.exists(os.path.join(os.path.dirname(TRACE), "conversation_trace.jsonl")),
        reason="needs ../shared/traces/conversation_trace.jsonl"))])
async def test_the_default_reserve_costs_almost_no_hits(tmp_path, trace, n, split):
    """Issue 12, item 7: with default settings (the background reserve on) the hit rate stays
    within 0.3 percentage points of one LRU of the summed capacity, at GPU-heavy splits too
    (the old 3 % reserve, refilled to 6 %, cost up to a point). The conversation split is the
    worst measured since the reserve refills in larger steps (0.23-0.24 points)."""
    requests = read_trace(os.path.join(os.path.dirname(TRACE), f"{trace}_trace.jsonl"))[0][:n]
    g, h, d = split
    oracle = PlainLru(g + h + d)
    cfg = config(gpu=g, host=h, disk=d, disk_dir=tmp_path, tpb=512,
                 layers=[LayerSpec(0, (("k", 64),))], persist_on_close=False)
    assert cfg.gpu.reserve > 0 and cfg.host.reserve > 0          # the defaults: background demotion on
    hits = blocks = 0
    async with Store.open(cfg) as store:
        assert store.reclaimers
        for r in requests:
            keys = list(r.hash_ids)
            oracle.request(keys)
            hits += await prefill_keys(store, keys)
            blocks += len(keys)
    ours, theirs = hits / blocks, oracle.hits / oracle.blocks
    assert theirs - ours <= 0.003, (ours, theirs)


async def test_the_reserve_is_capped_by_the_whole_store_across_groups(tmp_path):
    """A tier's reserve is its share of at most a third of the store's slots, spread over its
    groups by size: a GPU-heavy store keeps fewer free GPU slots, one group or two alike."""
    two = two_life_cycles(window_reuse=ReusePolicy.OPTIONAL)     # OPTIONAL keeps its own pool group
    for layers, groups in ((None, 1), (two, 2)):
        (tmp_path / str(groups)).mkdir()
        cfg = config(gpu=10_000, host=100, disk=100, disk_dir=tmp_path / str(groups), layers=layers,
                     persist_on_close=False)
        async with Store.open(cfg) as store:
            gpu = [r.low for (t, _), r in store.reclaimers.items() if t == GPU]
            host = [r.low for (t, _), r in store.reclaimers.items() if t == HOST]
            disk = [r.low for (t, _), r in store.reclaimers.items() if t == DISK]
            assert len(gpu) == groups and len(host) == groups
            assert gpu == [34] * groups             # 1 % of 10000 * (10200 / 3) / 10000, per group
            assert host == [1] * groups             # the host is under a third: 1 % of its own 100
            assert disk == []                       # two spill batches and a step are far over 3 % of 100 slots


async def test_the_disk_keeps_two_spill_batches_free_where_the_store_affords_it(tmp_path, monkeypatch):
    """The disk hands out the slot free longest, and keeps two spill batches free (a background
    drop), so that a spill writes over slots whose frees an earlier commit journaled instead of
    appending and syncing them first. A disk where that and a refill step are over 3 % of it
    keeps none, as does a disk reserve of 0. Spills that wait for their writes: written behind,
    the loop runs ahead of the write thread and the commits, and 20-21 of 169 append frees first
    (off the request's path: nothing waits for a write behind). Requests 2 ms apart, as on a
    server not saturated, so that the committer gets its turns: back to back, how many spills
    beat the commits to their slots was a race (2-30 of 169 on one machine)."""
    monkeypatch.setattr(migration, "BEHIND_BYTES", 0)
    page = [LayerSpec(0, (("k", 2048), ("v", 2048)))]
    overwrites: dict[float, tuple[int, int]] = {}
    for i, (sizes, reserve, low) in enumerate([((4096, 16384, 65536), 0.01, 1024), ((4096, 16384, 65536), 0.0, None),
                                               ((1000, 3000, 6000), 0.01, None)]):
        g, h, d = sizes
        (tmp_path / str(i)).mkdir()
        cfg = config(gpu=g, host=h, disk=d, disk_dir=tmp_path / str(i), tpb=1, layers=page,
                     persist_on_close=False)
        cfg.disk.fsync, cfg.disk.reserve = True, reserve
        async with Store.open(cfg) as store:
            r = store.reclaimers.get((DISK, 0))
            assert (r and r.low) == low, (sizes, reserve)
            if d != 65536:
                continue
            if r is not None:
                assert r.high == low + 344 <= 0.03 * d     # refilled by one step (0.4 % of the store)
            # fill the disk and more, 256 pages a request: a spill writes over slots freed earlier
            appends = []
            append_frees = store.disk._append_frees
            store.disk._append_frees = lambda grp, slots: (appends.append(len(slots)), append_frees(grp, slots))
            for a in range(0, g + h + d + 20_000, 256):
                await prefill_keys(store, list(range(a, a + 256)))
                await asyncio.sleep(0.002)
            await store.drain()
            st = store.stats()
            assert st["moves"]["host->disk"]["pages"] > d + 10_000
            assert st["tiers"]["disk"]["groups"][0]["free"] >= (low or 0)
            overwrites[reserve] = (len(appends), st["moves"]["host->disk"]["batches"])
            store.check_consistency()
    (with_reserve, spills), (without, spills0) = overwrites[0.01], overwrites[0.0]
    # measured: 0 of 169 spills (2-30 with no pause between requests: the background drop and
    # the commits race the spills) against 41-42 without the reserve (the allocator's order alone)
    assert with_reserve <= spills // 20, (with_reserve, spills)
    assert without >= spills0 // 6, (without, spills0)


async def test_persisting_at_close_drops_no_disk_page_to_refill_the_disk_reserve(tmp_path):
    """A closing store keeps no reserve: persisting its GPU and host pages to a full disk
    drops only the disk pages they need room for (it dropped 187 more to refill the disk's
    reserve, found in review)."""
    tiny = [LayerSpec(0, (("k", 32), ("v", 32)))]
    g, h, d = 4096, 16384, 65536
    cfg = config(gpu=g, host=h, disk=d, disk_dir=tmp_path, tpb=1, layers=tiny, persist_on_close=True)
    async with Store.open(cfg) as store:
        assert store.reclaimers[(DISK, 0)].low == 1024
        for a in range(0, g + h + d + 8192, 2048):
            await prefill_keys(store, list(range(a, a + 2048)))
        await store.drain()
    async with Store.open(cfg) as store:
        assert store.stats()["recovered_pages"] == d       # every disk slot holds a page


@pytest.mark.parametrize("page, gpu_high, host_high", [(4096, 40 + 344, 163 + 344), (16384, 40 + 128, 163 + 163)])
async def test_small_pages_refill_the_reserve_in_larger_steps(tmp_path, page, gpu_high, host_high):
    """The reserve refills to its low watermark plus one step: REFILL_BYTES of pages (a batch
    of 40 pages of 4 KiB costs the loop as much as one of 2 MiB pages), but at most STEP_SHARE
    of the store's slots (a free slot holds no page: 344 here) and never less than the reserve."""
    from runtime.reclaim import REFILL_BYTES, STEP_SHARE
    assert int(STEP_SHARE * (4096 + 16384 + 65536)) == 344
    assert REFILL_BYTES // 4096 > 344 and REFILL_BYTES // 16384 == 128
    half = (("k", page // 2), ("v", page // 2))
    cfg = config(gpu=4096, host=16384, disk=65536, disk_dir=tmp_path, layers=[LayerSpec(0, half)],
                 persist_on_close=False)
    async with Store.open(cfg) as store:
        gpu, host = store.reclaimers[(GPU, 0)], store.reclaimers[(1, 0)]
        assert (gpu.low, host.low) == (40, 163)
        assert (gpu.high, host.high) == (gpu_high, host_high)

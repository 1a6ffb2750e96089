"""The disk tier through the Store: restart recovery, crashes, corruption,
I/O faults, layout changes and the directory lock."""
from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from runtime import ConfigError, LayerSpec, Store, TierIOError, UsageError, migration
from runtime.pages import DISK
from runtime.views import page_view

from helpers import config, expected_block, fill, read_block, toks, write_blocks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(d, gpu=16, host=16, disk=4096, **kw):
    return config(gpu=gpu, host=host, disk=disk, disk_dir=d, **kw)


async def _check_prefix(store, base, n):
    seq = await store.open_sequence(tokens=toks(base, n))
    matched, tier = seq.matched_blocks, dict(seq.matched_by_tier)
    await seq.acquire()
    ok = all(torch.equal(read_block(store, seq, 0, b), expected_block(store, seq, 0, b))
             for b in range(matched))
    await seq.close()
    return matched, tier, ok


async def test_thousands_of_pages_survive_a_restart(tmp_path):
    async with Store.open(_cfg(tmp_path)) as store:
        for base in range(500):
            await fill(store, toks(base, 6))                  # 3000 pages
        assert store.stats()["moves"]["host->disk"]["pages"] > 2000
    async with Store.open(_cfg(tmp_path)) as store:
        assert store.stats()["recovered_pages"] == 3000
        for base in range(0, 500, 7):
            matched, tier, ok = await _check_prefix(store, base, 6)
            assert matched == 6 and tier["disk"] == 6 and ok
        await store.drain()
        store.check_consistency()


CRASH = textwrap.dedent("""
    import asyncio, sys
    sys.path[:0] = [{root!r}, {tests!r}]
    from runtime import Store
    from helpers import config, fill, toks
    async def main():
        cfg = config(gpu=8, host=8, disk=4096, disk_dir={d!r})
        cfg.disk.fsync = True
        async with Store.open(cfg) as store:
            for base in range(100000):
                await fill(store, toks(base, 4))
                if base % 5 == 4:
                    await asyncio.to_thread(store.disk.flush)
                    print(base - 4, flush=True)     # bases <= this one had reached disk or were recent
    asyncio.run(main())
""")


def test_sigkill_mid_spill_then_every_served_page_is_correct(tmp_path):
    code = CRASH.format(root=ROOT, tests=os.path.join(ROOT, "tests"), d=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(int(line))
        if len(seen) >= 40:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL

    async def check():
        async with Store.open(_cfg(tmp_path, disk=4096)) as store:
            recovered = store.stats()["recovered_pages"]
            served = 0
            for base in range(seen[-1] + 10):
                matched, tier, ok = await _check_prefix(store, base, 4)
                assert ok, f"prefix {base}: wrong bytes served"
                served += matched
            return recovered, served
    recovered, served = asyncio.run(check())
    # everything but the last few requests (still in GPU/host when killed) was spilled durably
    assert recovered >= 4 * (seen[-1] - 8)
    assert served >= recovered


async def _spill(tmp_path, n=40):
    async with Store.open(_cfg(tmp_path, gpu=8, host=8)) as store:
        for base in range(n):
            await fill(store, toks(base, 4))


async def test_flipped_bytes_cost_a_recompute_never_an_exception(tmp_path):
    """A corrupt page read at acquire used to raise CorruptPageError (129 of 400 sequences in one
    run); now the acquire completes, the damaged blocks (and the rest of their prefix) get fresh
    pages listed in recompute_blocks, and every other page reads back exact."""
    await _spill(tmp_path)
    seg = sorted(p for p in os.listdir(tmp_path) if p.endswith(".seg"))[0]
    path = os.path.join(tmp_path, seg)
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        for off in range(100, len(data), 4096 * 3):        # corrupt every third slot
            data[off] ^= 0xFF
        f.seek(0)
        f.write(data)
    async with Store.open(_cfg(tmp_path)) as store:
        recomputed = 0
        for base in range(40):
            seq = await store.open_sequence(tokens=toks(base, 4))
            matched = seq.matched_blocks
            await seq.acquire()
            redo = seq.recompute_blocks(0)
            assert redo == list(range(redo[0], matched)) if redo else True    # a suffix of the match
            for b in range(matched):
                if b not in redo:
                    assert torch.equal(read_block(store, seq, 0, b), expected_block(store, seq, 0, b))
            recomputed += len(redo)
            await seq.release()
            await seq.close()
        st = store.stats()
        assert recomputed > 0 and st["corrupt_pages"] > 0 and st["discarded_pages"] >= st["corrupt_pages"]
        await store.drain()
        store.check_consistency()


async def test_truncated_segment_and_journal(tmp_path):
    await _spill(tmp_path)
    seg = sorted(p for p in os.listdir(tmp_path) if p.endswith(".seg"))[0]
    journal = sorted(p for p in os.listdir(tmp_path) if p.endswith(".journal"))[0]
    os.truncate(os.path.join(tmp_path, seg), 4096 * 20)
    jpath = os.path.join(tmp_path, journal)
    os.truncate(jpath, os.path.getsize(jpath) - 7)
    async with Store.open(_cfg(tmp_path)) as store:
        assert store.stats()["discarded_pages"] > 0 or store.stats()["recovered_pages"] < 160
        for base in range(40):
            matched, _, ok = await _check_prefix(store, base, 4)
            assert ok


async def test_deleted_segment(tmp_path):
    await _spill(tmp_path)
    for p in os.listdir(tmp_path):
        if p.endswith(".seg"):
            os.unlink(os.path.join(tmp_path, p))
    async with Store.open(_cfg(tmp_path)) as store:
        assert store.stats()["recovered_pages"] == 0
        assert (await _check_prefix(store, 3, 4))[0] == 0
        await fill(store, toks(3, 4))                          # and the tier works again


@pytest.mark.parametrize("op,err,typ", [("write", errno.EIO, TierIOError), ("read", errno.EIO, TierIOError),
                                        ("write", errno.ENOSPC, None)])
async def test_io_faults_are_typed_and_lose_nothing(tmp_path, monkeypatch, op, err, typ):
    """An I/O error is typed and moves nothing; a full disk (ENOSPC) fails nothing: the evicted
    cached pages are dropped instead of spilled (test_disk_full.py). Spills that wait for their
    write; one written behind loses its pages instead (test_spill_behind.py)."""
    monkeypatch.setattr(migration, "BEHIND_BYTES", 0)
    async with Store.open(_cfg(tmp_path, gpu=8, host=4, disk=64)) as store:
        for base in range(5):
            await fill(store, toks(base, 4))                   # bases 0..1 on disk
        store.disk.inject_fault(op, err)
        with pytest.raises(typ) if typ is not None else contextlib.nullcontext():
            if op == "write":
                await fill(store, toks(10, 4))                 # its eviction spills to disk
            else:
                seq = await store.open_sequence(tokens=toks(0, 4))
                try:
                    await seq.acquire()
                finally:
                    await seq.close()
        await store.drain()
        store.check_consistency()
        if typ is None:
            assert store.stats()["disk_full"]["refused_spills"] == 1
        other = asyncio.ensure_future(fill(store, toks(20, 2)))   # the loop keeps serving
        for base in range(5):
            matched, tier, ok = await _check_prefix(store, base, 4)
            assert ok and (matched == 4 or typ is None)     # after ENOSPC a dropped prefix is a miss
        await other


async def test_layout_mismatch_and_wipe(tmp_path):
    await _spill(tmp_path, n=10)
    other = [LayerSpec(0, (("k", 512), ("v", 512)))]
    with pytest.raises(ConfigError) as e:
        async with Store.open(_cfg(tmp_path, layers=other)):
            pass
    assert "layout" in str(e.value) or "tiers.disk" in str(e.value)
    cfg = _cfg(tmp_path, layers=other)
    cfg.disk.on_mismatch = "wipe"
    async with Store.open(cfg) as store:
        assert store.stats()["recovered_pages"] == 0


async def test_two_stores_on_one_directory_are_refused(tmp_path):
    async with Store.open(_cfg(tmp_path)):
        with pytest.raises(ConfigError) as e:
            async with Store.open(_cfg(tmp_path)):
                pass
        assert "tiers.disk.path" in str(e.value)
    async with Store.open(_cfg(tmp_path)):
        pass


async def test_a_new_disk_quota_keeps_the_pages_that_fit(tmp_path):
    await _spill(tmp_path)                                      # 4096 disk slots, 160 pages on disk
    async with Store.open(_cfg(tmp_path, disk=8192)) as store:  # grown: everything is still there
        assert store.stats()["recovered_pages"] == 160
        assert (await _check_prefix(store, 3, 4))[2]
    async with Store.open(_cfg(tmp_path, disk=64)) as store:    # shrunk: slots past the quota are gone
        st = store.stats()
        assert 0 < st["recovered_pages"] <= 64
        for base in range(40):
            assert (await _check_prefix(store, base, 4))[2]
        segs = [os.path.getsize(os.path.join(tmp_path, p)) for p in os.listdir(tmp_path) if p.endswith(".seg")]
        assert max(segs) <= 64 * 4096


async def test_a_block_committed_after_its_pages_reached_disk_survives_a_restart(tmp_path):
    """Released uncommitted pages went down to disk with anonymous records;
    the commit that follows must relabel them, or the restart loses the
    prefix (found in review)."""
    cfg = lambda: config(gpu=4, host=4, disk=64, disk_dir=tmp_path)    # noqa: E731
    async with Store.open(cfg()) as store:
        seq = await store.open_sequence(tokens=toks(0, 4))
        await seq.acquire()
        await seq.extend(4)
        write_blocks(store, seq, range(4))
        await seq.release()                        # held, not committed yet
        for base in (1, 2, 3):                     # pushes its pages GPU -> host -> disk
            await fill(store, toks(base, 4))
        await store.drain()
        assert all(p.tier == DISK for row in seq.pages for p in row)
        seq.commit(4)
        await seq.close()
    async with Store.open(cfg()) as store:
        seq = await store.open_sequence(tokens=toks(0, 4))
        assert seq.matched_blocks == 4
        await seq.acquire()
        for b in range(4):
            assert torch.equal(read_block(store, seq, 0, b), expected_block(store, seq, 0, b))
        await seq.close()


async def test_buffers_in_another_order_or_another_hash_salt_are_a_layout_mismatch(tmp_path):
    """Same sizes, roles swapped: the old K bytes would be served as V. A new
    salt: every recovered key would be a permanent miss."""
    kv = [LayerSpec(0, (("k", 256), ("v", 256)))]
    await _spill(tmp_path, n=4)                  # the default layout is this kv one
    for kw in ({"layers": [LayerSpec(0, (("v", 256), ("k", 256)))]}, {"layers": kv, "hash_salt": b"tenant-2"}):
        with pytest.raises(ConfigError) as e:
            async with Store.open(_cfg(tmp_path, **kw)):
                pass
        assert "tiers.disk" in str(e.value) or "layout" in str(e.value)
    async with Store.open(_cfg(tmp_path, layers=kv)) as store:
        assert store.stats()["recovered_pages"] > 0


async def test_the_empty_bytes_key_is_refused():
    async with Store.open(config()) as store:
        with pytest.raises(UsageError, match="reserved"):
            await store.open_sequence(block_keys=[b"a", b""])


async def test_recovered_pages_are_evicted_deepest_first(tmp_path):
    """Recency is not journaled: after a restart no block may be evicted
    before its descendants (that would drop a whole subtree at once)."""
    async with Store.open(_cfg(tmp_path, gpu=8, host=8)) as store:
        for base in range(12):
            await fill(store, toks(base, 4))
        for base in range(0, 12, 3):                  # shared prefixes: longer chains on the first blocks
            await fill(store, toks(base, 4) + toks(100 + base, 3))
    async with Store.open(_cfg(tmp_path, gpu=8, host=8)) as store:
        core = store.core
        victims, _ = core.pick_victims(DISK, 0, core.queue_len(DISK, 0), 0)     # the eviction order, claimed
        order = [page_view(core, i) for i in victims.tolist()]
        assert len(order) == store.stats()["recovered_pages"] > 40
        gone = set()
        for p in order:
            node = store.nodes[p.key]
            while node.parent is not None:
                assert node.parent not in gone, "an ancestor left before its descendant"
                node = store.nodes[node.parent]
            gone.add(p.key)
        core.unclaim(victims)                         # back in the queue, so the store closes cleanly


async def test_pages_committed_while_a_claim_holds_them_get_their_keys_when_it_ends(tmp_path):
    """A prefetch claims disk pages, the commit publishes them, and the
    prefetch then gives up (the GPU is all locked): the claim's end must
    relabel them, or the restart loses the prefix (found in review)."""
    cfg = lambda: config(gpu=4, disk=64, disk_dir=tmp_path)    # noqa: E731
    async with Store.open(cfg()) as store:
        a = await store.open_sequence(tokens=toks(0, 2))
        await a.acquire()
        await a.extend(2)
        write_blocks(store, a, range(2))
        await a.release()                             # held, not committed
        b = await store.open_sequence(tokens=toks(1, 4))
        await b.acquire()
        await b.extend(4)                             # pushes a's pages to disk, anonymous
        await store.drain()
        assert all(p.tier == DISK for row in a.pages for p in row)
        a.prefetch()                                  # claims them; its task has not run yet
        a.commit(2)                                   # published while claimed
        await store.drain()                           # the prefetch finds every GPU slot locked and lets go
        assert all(p.tier == DISK and p.published for row in a.pages for p in row)
        await b.release()
        await b.close()
        await a.close()
    async with Store.open(cfg()) as store:
        seq = await store.open_sequence(tokens=toks(0, 2))
        assert seq.matched_blocks == 2
        await seq.close()


async def test_closing_while_a_request_holds_a_prefix_persists_no_unreachable_page(tmp_path):
    """A request still acquired at close keeps its prefix locked on the GPU, so persisting cannot
    write it. Pages below that prefix (another request's, released) must not be written either:
    after a restart they would be unreachable, counted as orphaned and freed (found by the stress
    review: 1-5 orphaned pages after a close mid-run)."""
    prefix, tail = toks(0, 4), toks(1, 4)
    async with Store.open(_cfg(tmp_path, gpu=32, host=None)) as store:
        await fill(store, prefix)
        holder = await store.open_sequence(tokens=prefix)
        await holder.acquire()                    # the prefix stays locked through the close
        await fill(store, prefix + tail)          # its own 4 blocks below the prefix: released
        assert store.core.persist_candidates()[0].tolist() == []
    async with Store.open(_cfg(tmp_path, gpu=32, host=None)) as store:
        st = store.stats()
        assert (st["recovered_pages"], st["orphaned_pages"]) == (0, 0)
    async with Store.open(_cfg(tmp_path, gpu=32, host=None)) as store:
        await fill(store, prefix + tail)          # nothing held at close: the whole chain persists
    async with Store.open(_cfg(tmp_path, gpu=32, host=None)) as store:
        st = store.stats()
        assert (st["recovered_pages"], st["orphaned_pages"]) == (8, 0)
        assert await _check_prefix(store, 0, 4) == (4, {"gpu": 0, "host": 0, "disk": 4, "remote": 0}, True)

"""Disk write-through (DESIGN.md, "Clean copies"): with ``[tiers.disk] write = "through"`` committed
pages are copied to disk in the background, so they survive a SIGKILL once ``write_interval`` has
passed; a later demotion of a page with a copy below costs no copy; a full disk evicts copies like any
page; ``write = "back"`` (the default) behaves as before.

The crash tests run a child process (a real SIGKILL, no persist at close) and reopen its directory:
page bytes are a function of the block key (``tests.helpers.write_blocks``), so whatever the new
store serves is checked against ``expected_block``.
"""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from runtime import (ConfigError, DiskConfig, GpuConfig, HostConfig, KvtierError, LayerSpec, Store,
                     StoreConfig)
from runtime.migration import MigrationEngine
from runtime.pages import DISK

from helpers import DEVICE, check_seq, config, expected_block, fill, read_block, run_until_killed, toks, write_blocks
NB = 4                          # blocks per sequence
INTERVAL = 0.02                 # write_interval of the write-through stores


def wt_config(disk_dir, gpu=16, host=32, disk=512, write="through", interval=INTERVAL, fsync=False,
              persist_on_close=False, **disk_kw) -> StoreConfig:
    """The helpers' layout (one life cycle, k/v of 256, 4 tokens per block) with a write policy.
    Built in one go, so StoreConfig validates the disk's write settings."""
    return StoreConfig(
        layers=[LayerSpec(0, (("k", 256), ("v", 256)))], tokens_per_block=4,
        gpu=GpuConfig(slots=gpu, device=DEVICE), host=HostConfig(slots=host, codec="concat"),
        disk=DiskConfig(path=str(disk_dir), slots=disk, fsync=fsync, write=write, write_interval=interval,
                        **disk_kw),
        persist_on_close=persist_on_close)


def wt_stats(store) -> dict:
    return store.stats()["write_through"]


def moved_bytes(store, direction: str) -> int:
    return store.stats()["moves"].get(direction, {}).get("bytes", 0)


def disk_used(store) -> int:
    return sum(g["used"] for g in store.stats()["tiers"]["disk"]["groups"])


# -- the child process ------------------------------------------------------------------------

CHILD = r"""
import asyncio, sys, time
from runtime import DiskConfig, GpuConfig, HostConfig, LayerSpec, Store, StoreConfig
from tests.helpers import DEVICE, fill, toks

d, write, fsync, mode, n, nb, gpu, host, disk = sys.argv[1:]
n, nb, gpu, host, disk = int(n), int(nb), int(gpu), int(host), int(disk)
cfg = StoreConfig(
    layers=[LayerSpec(0, (("k", 256), ("v", 256)))], tokens_per_block=4,
    gpu=GpuConfig(slots=gpu, device=DEVICE), host=HostConfig(slots=host, codec="concat"),
    disk=DiskConfig(path=d, slots=disk, fsync=fsync == "1", write=write, write_interval=%(interval)r),
    persist_on_close=False)

async def main():
    store = await Store.open(cfg)
    if mode == "idle":                      # n sequences, then idle in the loop (the write-through runs)
        for i in range(n):
            await fill(store, toks(i, nb))
            print("C", i, flush=True)
        print("IDLE", flush=True)
        await asyncio.sleep(3600)
    else:                                   # "run": commit until killed, paced
        i = 0
        while True:
            await fill(store, toks(i, nb))  # open, acquire, extend, write, commit, release, close
            print("C", i, repr(time.monotonic()), flush=True)
            i += 1
            await asyncio.sleep(0.03)

asyncio.run(main())
""" % {"interval": INTERVAL}


def run_and_kill(disk_dir, write, *, mode, n=0, fsync=False, gpu=16, host=32, disk=512,
                 stop=lambda lines: False, delay=0.0, deadline=60.0) -> tuple[list[str], float]:
    """Run CHILD until ``stop(lines)`` holds for the lines read so far, sleep ``delay``, SIGKILL it.
    Returns every complete line it printed and the (parent's) monotonic time of the kill."""
    args = [str(disk_dir), write, "1" if fsync else "0", mode, str(n), str(NB), str(gpu), str(host), str(disk)]
    return run_until_killed(CHILD, args, stop, delay, deadline)


def committed(lines: list[str]) -> list[tuple[int, float | None]]:
    out = []
    for ln in lines:
        parts = ln.split()
        if parts and parts[0] == "C":
            out.append((int(parts[1]), float(parts[2]) if len(parts) > 2 else None))
    return out


async def reopen_and_count_full(disk_dir, n, **kw) -> int:
    """Reopen the directory (write-back reader, same layout and sizes): every matched block of the n
    sequences must read back exact; returns how many are fully matched."""
    async with Store.open(wt_config(disk_dir, write="back", **kw)) as store:
        assert store.stats()["corrupt_pages"] == 0
        full = 0
        for base in range(n):
            full += await check_seq(store, base) == NB
        await store.drain()
        store.check_consistency()
    return full


# -- 1. SIGKILL after idle ----------------------------------------------------------------------

N_IDLE = 40         # 160 pages; GPU + host hold 48 of them, the disk all


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fsync", [False, True], ids=["nofsync", "fsync"])
async def test_sigkill_after_idle_every_committed_sequence_survives(tmp_path, fsync):
    d = tmp_path / "through"
    d.mkdir()
    lines, _ = run_and_kill(d, "through", mode="idle", n=N_IDLE, fsync=fsync,
                            stop=lambda ls: bool(ls) and ls[-1].startswith("IDLE"), delay=0.5)
    assert [i for i, _ in committed(lines)] == list(range(N_IDLE))
    full = await reopen_and_count_full(d, N_IDLE)
    assert full == N_IDLE, f"write-through: only {full} of {N_IDLE} committed sequences survived the SIGKILL"

    if fsync:
        return
    # what the feature buys: the same run with write-back loses what GPU and host held
    d = tmp_path / "back"
    d.mkdir()
    lines, _ = run_and_kill(d, "back", mode="idle", n=N_IDLE,
                            stop=lambda ls: bool(ls) and ls[-1].startswith("IDLE"), delay=0.5)
    assert [i for i, _ in committed(lines)] == list(range(N_IDLE))
    full_back = await reopen_and_count_full(d, N_IDLE)
    assert full_back < N_IDLE, "write-back kept every sequence through a SIGKILL without persisting"


# -- 2. SIGKILL mid-run --------------------------------------------------------------------------

@pytest.mark.timeout(120)
async def test_sigkill_mid_run_old_commits_survive_and_nothing_is_wrong(tmp_path):
    lines, killed_at = run_and_kill(tmp_path, "through", mode="run", disk=2048,
                                    stop=lambda ls: len(ls) >= 60, delay=0.011)
    done = committed(lines)
    assert [i for i, _ in done] == list(range(len(done))) and len(done) >= 60
    old = [i for i, t in done if t < killed_at - 1.0]       # generous margin over write_interval
    assert len(old) >= 10, f"only {len(old)} commits were over 1 s old at the kill (child too fast?)"
    async with Store.open(wt_config(tmp_path, write="back", disk=2048)) as store:
        assert store.stats()["corrupt_pages"] == 0
        matched = {}
        for base in range(len(done) + 1):                   # + the one that may have been in flight
            matched[base] = await check_seq(store, base)    # every matched block is bit-exact
        lost = [i for i in old if matched[i] != NB]
        assert not lost, f"sequences committed over 1 s before the SIGKILL came back incomplete: {lost}"
        await store.drain()
        store.check_consistency()


# -- 3. free demotions, in-process --------------------------------------------------------------

@pytest.mark.timeout(60)
async def test_demoting_pages_with_clean_copies_costs_no_copy(tmp_path):
    async with Store.open(wt_config(tmp_path, gpu=16, host=32, disk=1024)) as store:
        s = wt_stats(store)
        assert s["on"] is True
        for base in range(30):                              # 120 pages, 48 fit GPU + host
            await fill(store, toks(base, NB))
        await store.drain()
        s1 = wt_stats(store)
        assert s1["pending"] == 0 and s1["failures"] == 0
        assert s1["copied_pages"] > 0 and s1["copied_bytes"] > 0 and s1["batches"] > 0 and s1["copies"] > 0
        assert disk_used(store) == 30 * NB, "after drain every committed page has a disk slot (primary or copy)"
        host_disk_1 = moved_bytes(store, "host->disk")
        slot_bytes = store.stats()["tiers"]["host"]["groups"][0]["slot_bytes"]

        # re-read everything: disk hits are promoted (their slot stays a copy), GPU victims go to host,
        # host victims go to disk - where every one of them already has a copy
        for base in range(30):
            assert await check_seq(store, base) == NB
        await store.drain()
        s2 = wt_stats(store)
        free = s2["free_demotions"] - s1["free_demotions"]
        paid = moved_bytes(store, "host->disk") - host_disk_1
        assert free > 0, s2
        assert s2["kept_on_promotion"] > s1["kept_on_promotion"], s2
        assert paid * 4 < free * slot_bytes, f"host->disk moved {paid} bytes for {free} free demotions"
        assert disk_used(store) == 30 * NB

        # more new work pushes the old pages down again
        for base in range(30, 60):
            await fill(store, toks(base, NB))
        await store.drain()
        s3 = wt_stats(store)
        assert s3["free_demotions"] > s2["free_demotions"], s3
        assert s3["pending"] == 0 and s3["failures"] == 0
        for base in range(60):
            assert await check_seq(store, base) == NB
        await store.drain()
        store.check_consistency()


# -- 4. a disk smaller than the data --------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("disk", [32, 96], ids=["disk-below-gpu+host", "disk-above-gpu+host"])
async def test_full_disk_evicts_copies_and_serves_exact_pages(tmp_path, disk):
    """240 pages; GPU + host hold 48. A disk of 32 cannot even hold copies of what is above it, so
    new copies evict older ones; a disk of 96 holds copies of GPU + host and the newest primaries."""
    async with Store.open(wt_config(tmp_path, gpu=16, host=32, disk=disk)) as store:
        for base in range(60):
            await fill(store, toks(base, NB), priority=0 if base % 3 == 0 else None)
            if base % 4 == 3:
                await store.drain()                         # let the write-through catch up (and fill the disk)
        await store.drain()
        s = wt_stats(store)
        if disk < 16 + 32:
            assert s["evicted_copies"] > 0, s
        assert s["pending"] == 0
        assert disk_used(store) <= disk
        hits = 0
        for base in range(60):
            hits += await check_seq(store, base)            # whatever is matched is exact
        assert hits > 0
        await store.drain()
        store.check_consistency()


# -- drain, held and uncommitted pages ----------------------------------------------------------

@pytest.mark.timeout(60)
async def test_drain_copies_what_it_can_and_leaves_locked_and_uncommitted_pages(tmp_path):
    """A page is copied once its bytes are final: when the sequence that committed it releases it
    (another request holding it acquired to read it does not stop the copy)."""
    async with Store.open(wt_config(tmp_path, gpu=16, host=32, disk=512)) as store:
        await fill(store, toks(0, NB))
        held = await store.open_sequence(tokens=toks(1, NB))
        await held.acquire()
        await held.extend(NB)
        write_blocks(store, held, range(NB))
        held.commit(NB)                                     # committed, still acquired: locked on the GPU
        await asyncio.wait_for(store.drain(), 10)           # does not wait for the locked pages
        s = wt_stats(store)
        assert s["copies"] == NB and s["pending"] == 0, s  # queued when released: bytes final only then

        part = await store.open_sequence(tokens=toks(2, NB))
        await part.acquire()
        await part.extend(NB)
        write_blocks(store, part, range(NB))
        part.commit(2)                                      # two of its four blocks are published
        await held.release()
        await part.release()
        await asyncio.wait_for(store.drain(), 10)
        s = wt_stats(store)
        assert s["pending"] == 0 and s["failures"] == 0, s
        assert s["copies"] == 2 * NB + 2, f"only committed pages get copies: {s}"
        await held.close()
        await part.close()
        await store.drain()
        assert disk_used(store) == 2 * NB + 2
        for base, n in ((0, NB), (1, NB), (2, 2)):
            assert await check_seq(store, base) == n
        store.check_consistency()


# -- a slow disk --------------------------------------------------------------------------------

@pytest.mark.timeout(60)
async def test_a_slow_disk_never_fails_a_request(tmp_path, monkeypatch):
    """Every move to the disk takes 0.2 s. The write-through's batch in flight holds the GPU's
    committed pages (they are being read); a request that needs those GPU slots must wait for the
    batch to land (or evict around it), not fail with OutOfPagesError - write-back never does."""
    run = MigrationEngine.run

    async def slow(self, batch, dst_tier, *args, **kw):
        if dst_tier == DISK:
            await asyncio.sleep(0.2)
        return await run(self, batch, dst_tier, *args, **kw)

    monkeypatch.setattr(MigrationEngine, "run", slow)
    async with Store.open(wt_config(tmp_path, gpu=16, host=32, disk=512)) as store:
        for base in range(4):                               # the GPU's 16 slots, all committed
            await fill(store, toks(base, NB))
        await asyncio.sleep(0.05)                           # the write-through has taken them: a batch in flight
        for base in range(4, 12):
            await fill(store, toks(base, NB))
        await store.drain()
        s = wt_stats(store)
        assert s["pending"] == 0 and s["failures"] == 0, s
        for base in range(12):
            assert await check_seq(store, base) == NB
        store.check_consistency()


# -- 5. config errors -----------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [{"write": "sideways"}, {"write_interval": -1}, {"write_interval": 0},
                                 {"max_inflight_bytes": 0}],
                         ids=["write", "interval-negative", "interval-zero", "inflight-zero"])
async def test_bad_write_settings_are_config_errors(tmp_path, bad):
    kw = {"write": "through", "interval": INTERVAL}
    extra = dict(bad)
    if "write" in extra:
        kw["write"] = extra.pop("write")
    if "write_interval" in extra:
        kw["interval"] = extra.pop("write_interval")
    with pytest.raises(ConfigError) as ei:
        cfg = wt_config(tmp_path, **kw, **extra)
        async with Store.open(cfg):
            pass
    assert isinstance(ei.value, KvtierError)
    assert ei.value.field.startswith("tiers.disk."), ei.value.field

    # the TOML shape: the same value under [tiers.disk]
    d = {"tokens_per_block": 4, "layers": [{"ids": "0", "buffers": {"k": 256, "v": 256}}],
         "tiers": {"gpu": {"slots": 8, "device": "cpu"}, "host": {"slots": 8},
                   "disk": {"slots": 64, "path": str(tmp_path), "write": "through", **bad}}}
    with pytest.raises(ConfigError) as ei:
        StoreConfig.from_dict(d)
    assert ei.value.field.startswith("tiers.disk."), ei.value.field


def test_write_settings_from_toml(tmp_path):
    d = {"tokens_per_block": 4, "layers": [{"ids": "0", "buffers": {"k": 256, "v": 256}}],
         "tiers": {"gpu": {"slots": 8, "device": "cpu"}, "host": {"slots": 8},
                   "disk": {"slots": 64, "path": str(tmp_path)}}}
    assert StoreConfig.from_dict(d).disk.write == "back"              # the default
    d["tiers"]["disk"].update(write="through", write_interval=0.1, max_inflight_bytes="1MiB")
    cfg = StoreConfig.from_dict(d)
    assert (cfg.disk.write, cfg.disk.write_interval) == ("through", 0.1)


# -- 6. write = "back" is unchanged ---------------------------------------------------------------

@pytest.mark.timeout(60)
async def test_write_back_makes_no_copies(tmp_path):
    cfg = config(gpu=16, host=32, disk=512, disk_dir=tmp_path, persist_on_close=False)
    assert cfg.disk.write == "back"
    async with Store.open(cfg) as store:
        for base in range(40):
            await fill(store, toks(base, NB))
        await store.drain()
        for base in range(40):
            assert await check_seq(store, base) == NB
        await store.drain()
        s = wt_stats(store)
        assert s["on"] is False
        assert (s["copies"], s["copied_pages"], s["free_demotions"], s["kept_on_promotion"], s["pending"]) \
            == (0, 0, 0, 0, 0), s
        assert moved_bytes(store, "host->disk") > 0        # demotions still copy, as before
        store.check_consistency()


@pytest.mark.timeout(60)
async def test_a_prefix_always_held_by_readers_is_still_copied(tmp_path):
    """A hot shared prefix (a system prompt) is nearly always acquired by some request: its pages
    must be copied anyway, or every copy below it would be unreachable after a crash."""
    async with Store.open(wt_config(tmp_path, gpu=64, host=32, disk=512)) as store:
        await fill(store, toks(0, NB))                      # the prefix: committed and released
        reader = await store.open_sequence(tokens=toks(0, NB))
        await reader.acquire()                              # held from here on by a reader
        await fill(store, toks(0, NB) + toks(5, NB))        # a request below it
        await asyncio.wait_for(store.drain(), 10)
        s = wt_stats(store)
        assert s["copies"] == 2 * NB and s["pending"] == 0, s
        await reader.close()


@pytest.mark.timeout(60)
async def test_a_disk_that_refuses_copies_is_retried_each_interval_never_in_a_loop(tmp_path):
    """A full filesystem (ENOSPC on every copy), and then a disk whose every slot is held by open
    sequences: the copies wait for the next interval, the loop stays responsive, requests go on,
    and close() returns (found in review: both spun the event loop forever)."""
    from tiers.errors import DiskFullError, OutOfPagesError
    (tmp_path / "held").mkdir()
    async with Store.open(wt_config(tmp_path, gpu=16, host=16, disk=64, interval=0.05)) as store:
        def full(src, dst):
            if dst == DISK:
                raise DiskFullError("no space left on device (injected)")
        store.engine.fault = full
        for base in range(6):
            await fill(store, toks(base, NB))
        t0 = time.monotonic()
        await asyncio.sleep(0.5)                            # about 10 intervals
        assert time.monotonic() - t0 < 1.0                  # the loop was not held
        s = wt_stats(store)
        assert 1 <= s["failures"] <= 20 and s["disk_full"] == s["failures"] and s["copies"] == 0, s
        assert store.stats()["disk_full"]["refused_spills"] == 0    # copies are not spills
        store.engine.fault = None
        await asyncio.wait_for(store.drain(), 10)
        assert wt_stats(store)["pending"] == 0 and wt_stats(store)["copies"] > 0
    async with Store.open(wt_config(tmp_path / "held", gpu=16, host=16, disk=64, interval=0.05)
                          ) as store:
        real, calls = store.moves.obtain, [0]

        async def no_disk_slot(tier, group, n):        # every disk slot held by open sequences
            if tier == DISK:
                calls[0] += 1
                raise OutOfPagesError("disk pool group 0: nothing evictable (test)")
            return await real(tier, group, n)
        store.moves.obtain = no_disk_slot
        for base in range(6):
            await fill(store, toks(base, NB))
        t0 = time.monotonic()
        await asyncio.sleep(0.3)
        assert time.monotonic() - t0 < 1.0 and calls[0] <= 12, calls
        store.moves.obtain = real
        await asyncio.wait_for(store.drain(), 10)
        assert wt_stats(store)["pending"] == 0
        store.check_consistency()


@pytest.mark.timeout(60)
async def test_a_recycled_page_id_is_not_copied_before_its_writer_releases_it(tmp_path):
    """Queue entries are page ids. Pages dropped before a pass leave stale entries, and a writer's
    new page can take such an id: a pass must not copy that page while its writer still holds it
    (its bytes may not be written yet); a later demotion onto the early copy would serve them
    (found in review)."""
    cfg = StoreConfig(layers=[LayerSpec(0, (("k", 256), ("v", 256)))], tokens_per_block=4,
                      gpu=GpuConfig(slots=8, device=DEVICE), host=HostConfig(slots=8, codec="concat"),
                      disk=DiskConfig(path=str(tmp_path), slots=8, fsync=False, write="through",
                                      write_interval=60.0),
                      persist_on_close=False)
    async with Store.open(cfg) as store:
        await asyncio.sleep(0.05)                       # the first (empty) background pass is done
        core = store.core
        for base in range(40):                          # pages cascade to the disk and drop: ids recycled
            await fill(store, toks(1000 + base, 1))
        seq = await store.open_sequence(tokens=toks(7, 1))
        await seq.acquire()
        await seq.extend(1)
        pid = seq.pages[0][0].id
        write_blocks(store, seq, [0], tag=1)            # not the final bytes yet (a kernel in flight)
        seq.commit(1)
        await store.drain()
        assert core.copy_of(pid) == -1                  # its writer holds it: no copy yet
        write_blocks(store, seq, [0], tag=0)
        await seq.release()
        await seq.close()
        await store.drain()
        assert core.copy_of(pid) >= 0                   # copied once released
        for base in range(24):                          # down to the disk: a demotion onto the copy
            await fill(store, toks(2000 + base, 1))
        check = await store.open_sequence(tokens=toks(7, 1))
        if check.matched_blocks:
            await check.acquire()
            assert torch.equal(read_block(store, check, 0, 0), expected_block(store, check, 0, 0))
        await check.close()
        store.check_consistency()


async def test_a_disk_no_larger_than_gpu_and_host_is_warned_about(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="kvtier"):
        async with Store.open(wt_config(tmp_path, gpu=16, host=32, disk=48)):
            pass
    assert any("cannot hold a copy" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvtier"):
        async with Store.open(wt_config(tmp_path, gpu=16, host=32, disk=512)):
            pass
    assert not any("cannot hold a copy" in r.getMessage() for r in caplog.records)

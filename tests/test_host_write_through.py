"""Host write-through (DESIGN.md, "Clean copies": every cold tier has a write policy): with
``[tiers.host] write = "through"`` committed GPU pages are copied to the host in the background,
so that demoting one later moves no bytes (the GPU page takes over its host copy), a page promoted
from the host keeps its host slot as a copy, and the host sheds copies (never spills them) when it
needs room. With the disk writing through too, a page can have a copy in both (a chain).

Every test checks bytes: the host rows of copies against the block's pattern, and every page
served after a demotion onto a copy (no bytes moved) against it too.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from runtime import ConfigError, DiskConfig, GpuConfig, HostConfig, LayerSpec, Store, StoreConfig
from runtime.migration import MigrationEngine
from runtime.pages import DISK, GPU, HOST

from helpers import DEVICE, check_seq, expected_block, fill, toks

NB = 4                          # blocks per sequence
INTERVAL = 0.02                 # write_interval of the write-through tiers


def hwt_config(gpu=8, host=32, disk=0, disk_dir=None, disk_write="back", persist_on_close=False) -> StoreConfig:
    return StoreConfig(
        layers=[LayerSpec(0, (("k", 256), ("v", 256)))], tokens_per_block=4,
        gpu=GpuConfig(slots=gpu, device=DEVICE),
        host=HostConfig(slots=host, codec="concat", write="through", write_interval=INTERVAL),
        disk=DiskConfig(path=str(disk_dir), slots=disk, fsync=False, write=disk_write, write_interval=INTERVAL)
        if disk else None,
        persist_on_close=persist_on_close)


def host_stats(store) -> dict:
    return store.stats()["host_write_through"]


def moved(store, direction: str) -> int:
    return store.stats()["moves"].get(direction, {}).get("pages", 0)


def copies_in(store, tier: int, keys) -> list[tuple[int, int, int]]:
    """(primary's tier, copy's group, copy's slot) of each block among ``keys`` whose chain has a
    copy in ``tier``."""
    out = []
    core = store.core
    for key in keys:
        found = core.find(key)
        if found is None:
            continue
        pid = found[2][0]
        c = core.copy_of(pid)
        while c >= 0:
            info = core.page_info(c)
            assert info["copy"] and not info["dead"]
            if info["tier"] == tier:
                out.append((core.page_info(pid)["tier"], info["group"], info["slot"]))
            c = core.copy_of(c)
    return out


async def keys_of(store, base, n=NB) -> list:
    seq = await store.open_sequence(tokens=toks(base, n))
    keys = list(seq.keys)
    await seq.close()
    return keys


def assert_host_rows(store, keys, seq_for_pattern) -> int:
    """The host row of every host copy among ``keys`` holds its block's bytes."""
    n = 0
    for b, key in enumerate(keys):
        for _tier, group, slot in copies_in(store, HOST, [key]):
            row = torch.from_numpy(store.engine.host[group].array[slot].copy())
            assert torch.equal(row, expected_block(store, seq_for_pattern, 0, b)), f"host copy of block {b} differs"
            n += 1
    return n


class _Keys:
    """What expected_block needs of a sequence: its keys."""

    def __init__(self, keys) -> None:
        self.keys = keys


@pytest.mark.timeout(60)
async def test_committed_gpu_pages_get_host_copies_with_their_bytes():
    async with Store.open(hwt_config(gpu=16, host=64)) as store:
        assert host_stats(store)["on"] is True and store.stats()["write_through"]["on"] is False
        for base in range(4):                               # 16 pages: all on the GPU
            await fill(store, toks(base, NB))
        await asyncio.wait_for(store.drain(), 10)
        s = host_stats(store)
        assert (s["copies"], s["pending"], s["failures"]) == (4 * NB, 0, 0), s
        assert s["copied_pages"] == 4 * NB and s["copied_bytes"] == 4 * NB * 512 and s["batches"] >= 1, s
        assert moved(store, "gpu->host") == 0               # copies are not moves
        checked = 0
        for base in range(4):
            keys = await keys_of(store, base)
            assert [t for t, _, _ in copies_in(store, HOST, keys)] == [GPU] * NB
            checked += assert_host_rows(store, keys, _Keys(keys))
        assert checked == 4 * NB
        store.check_consistency()


@pytest.mark.timeout(60)
async def test_demoting_onto_host_copies_moves_no_bytes_and_serves_exact_pages():
    """GPU 8, host 64: the first two sequences are copied, then pushed out by two more. Their
    demotions take over the copies (no gpu->host move); read back, each page is exact, and its
    promotion keeps the host slot as a copy, so pushing it out again is free too."""
    async with Store.open(hwt_config(gpu=8, host=64)) as store:
        for base in range(2):
            await fill(store, toks(base, NB))
        await store.drain()
        for base in range(2, 4):                            # evicts 0 and 1 onto their copies
            await fill(store, toks(base, NB))
        await store.drain()
        s = host_stats(store)
        assert s["free_demotions"] == 2 * NB, s
        assert moved(store, "gpu->host") == 0
        assert s["copies"] == 2 * NB, s                     # 2 and 3 copied; 0 and 1 are host primaries now
        for base in range(2):                               # promoted from the host: copies kept
            assert await check_seq(store, base) == NB
        await store.drain()
        s2 = host_stats(store)
        assert s2["kept_on_promotion"] == 2 * NB, s2
        assert moved(store, "host->gpu") == 2 * NB and moved(store, "gpu->host") == 0
        for base in range(4):                               # everything again, in turns: every demotion free
            assert await check_seq(store, base) == NB
        await store.drain()
        assert moved(store, "gpu->host") == 0
        assert host_stats(store)["free_demotions"] > s2["free_demotions"]
        store.check_consistency()


@pytest.mark.timeout(60)
async def test_a_full_host_sheds_copies_and_spills_only_primaries(tmp_path, caplog):
    """GPU 8, host 6, disk 256 (write-back): a host smaller than the GPU cannot hold a copy of
    every GPU page, so copies evict older copies, and demoted pages take the slots of copies.
    Copies are dropped (their primaries stay on the GPU), never spilled; the disk holds only
    primaries, and every page reads back exact."""
    async with Store.open(hwt_config(gpu=8, host=6, disk=256, disk_dir=tmp_path)) as store:
        for base in range(24):
            await fill(store, toks(base, NB))
            await store.drain()
        assert any("host cannot hold a copy" in r.getMessage() for r in caplog.records)   # warned at open
        s = host_stats(store)
        assert s["evicted_copies"] > 0 and s["free_demotions"] > 0, s
        disk_pages = [store.core.page_info(i) for i in store.core.tier_pages(DISK, 0).tolist()]
        assert disk_pages and not any(p["copy"] for p in disk_pages), "a host copy was spilled"
        stats = store.stats()
        disk_used = sum(g["used"] for g in stats["tiers"]["disk"]["groups"])
        # every page lives once: GPU primaries, host primaries, disk primaries; copies only in the host
        assert disk_used == moved(store, "host->disk") - moved(store, "disk->gpu") - moved(store, "disk->host")
        for base in range(24):
            assert await check_seq(store, base) == NB
        await store.drain()
        store.check_consistency()


@pytest.mark.timeout(90)
async def test_host_and_disk_write_through_keep_a_chain_and_survive_a_restart(tmp_path):
    """Both tiers write through: a GPU page gets a host copy and a disk copy. Demotions take over
    the host copy, then the disk copy; whatever is served is exact, and a store reopened on the
    directory (no persist at close: the disk copies are what survives) serves exact pages."""
    cfg = hwt_config(gpu=8, host=16, disk=256, disk_dir=tmp_path, disk_write="through")
    async with Store.open(cfg) as store:
        await fill(store, toks(0, NB))
        await store.drain()
        keys = await keys_of(store, 0)
        chains = [(copies_in(store, HOST, [k]), copies_in(store, DISK, [k])) for k in keys]
        assert all(len(h) == 1 and len(d) == 1 for h, d in chains), chains     # primary -> host -> disk
        assert assert_host_rows(store, keys, _Keys(keys)) == NB
        for base in range(1, 16):
            await fill(store, toks(base, NB))
            await store.drain()
        s, d = host_stats(store), store.stats()["write_through"]
        assert s["free_demotions"] > 0 and d["free_demotions"] > 0, (s, d)
        assert s["failures"] == d["failures"] == 0
        for base in range(16):
            assert await check_seq(store, base) == NB
        await store.drain()
        store.check_consistency()
    async with Store.open(hwt_config(gpu=8, host=16, disk=256, disk_dir=tmp_path)) as store:
        served = 0
        for base in range(16):
            served += await check_seq(store, base)          # exact, or a miss
        assert served >= 16 * NB - 8 - 16                   # at most what sat above the disk unpersisted
        store.check_consistency()


@pytest.mark.timeout(60)
async def test_a_failing_host_copy_is_retried_and_requests_go_on(monkeypatch):
    """Every copy batch to the host fails for a while (demotions still work): the pages stay
    queued, failures are counted, requests are served; then copies succeed."""
    run = MigrationEngine.run
    broken = [True]

    async def failing(self, batch, dst_tier, *args, record=True, **kw):
        if dst_tier == HOST and not record and broken[0]:
            raise RuntimeError("copy engine fault (injected)")
        return await run(self, batch, dst_tier, *args, record=record, **kw)

    monkeypatch.setattr(MigrationEngine, "run", failing)
    async with Store.open(hwt_config(gpu=16, host=64)) as store:
        for base in range(4):
            await fill(store, toks(base, NB))
        await asyncio.sleep(0.2)                            # about 10 intervals
        s = host_stats(store)
        assert s["failures"] >= 1 and s["copies"] == 0 and s["pending"] > 0, s
        for base in range(4):
            assert await check_seq(store, base) == NB
        broken[0] = False
        await asyncio.wait_for(store.drain(), 10)
        s = host_stats(store)
        assert s["pending"] == 0 and s["copies"] == 4 * NB, s
        store.check_consistency()


@pytest.mark.parametrize("bad", [{"write": "sideways"}, {"write_interval": 0}, {"max_inflight_bytes": 0}],
                         ids=["write", "interval-zero", "inflight-zero"])
def test_bad_host_write_settings_are_config_errors(bad):
    d = {"tokens_per_block": 4, "layers": [{"ids": "0", "buffers": {"k": 256, "v": 256}}],
         "tiers": {"gpu": {"slots": 8, "device": "cpu"}, "host": {"slots": 8, "write": "through", **bad}}}
    with pytest.raises(ConfigError) as ei:
        StoreConfig.from_dict(d)
    assert ei.value.field == "tiers.host." + next(iter(bad)), ei.value.field


def test_host_write_settings_from_toml():
    d = {"tokens_per_block": 4, "layers": [{"ids": "0", "buffers": {"k": 256, "v": 256}}],
         "tiers": {"gpu": {"slots": 8, "device": "cpu"}, "host": {"slots": 8}}}
    assert StoreConfig.from_dict(d).host.write == "back"              # the default
    d["tiers"]["host"].update(write="through", write_interval="10ms", max_inflight_bytes="1MiB")
    cfg = StoreConfig.from_dict(d)
    assert (cfg.host.write, cfg.host.write_interval, cfg.host.max_inflight_bytes) == ("through", 0.01, 1 << 20)

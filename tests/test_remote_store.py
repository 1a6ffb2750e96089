"""The remote tier through the Store (issue 13): pages one store writes through
are hits, bit-exact, for another store (another process too) with the same
layout and salt, and never for any other; a dead server is a miss."""
from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import textwrap

import pytest

from runtime import Store
from runtime.pages import DISK, GPU, HOST
from runtime.tools.redis_servers import REDIS_SERVER, RedisServer
from tiers.errors import ConfigError
from tiers.remote import RemoteSettings

from helpers import config, expected_block, fill, read_block

pytest.importorskip("redis")
pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="needs redis-server (apt-get install redis-server)")


@pytest.fixture
def server(tmp_path):
    with RedisServer(tmp_path / "redis") as s:
        yield s


def remote_cfg(url: str, **kw):
    return config(gpu=8, host=32, remote=RemoteSettings(url=url, namespace="t", model="m", op_timeout=2.0), **kw)


def prompt(i: int, blocks: int = 6) -> list[int]:
    return [i * 1000 + t for t in range(4 * blocks)]


async def write_some(store: Store, n: int = 6) -> None:
    for i in range(n):
        await fill(store, prompt(i))
    for i in range(n, n + 6):                   # push the first ones off the GPU: write-through on the way
        await fill(store, prompt(i))
    await store.drain()


async def check_hits(store: Store, n: int = 6) -> int:
    remote = 0
    for i in range(n):
        seq = await store.open_sequence(tokens=prompt(i))
        try:
            remote += seq.matched_by_tier["remote"]
            await seq.acquire()
            for b in range(seq.matched_blocks):
                assert (read_block(store, seq, 0, b) == expected_block(store, seq, 0, b)).all(), (i, b)
        finally:
            await seq.close()
    store.check_consistency()
    return remote


async def test_a_second_store_hits_what_the_first_wrote_through(server):
    async with Store.open(remote_cfg(server.url)) as a:
        await write_some(a)
        st = a.stats()["remote"]
        assert st["written_pages"] > 0 and st["circuit"] == "closed"
    async with Store.open(remote_cfg(server.url)) as b:
        remote = await check_hits(b)
        st = b.stats()
        assert remote > 0 and st["remote"]["imported_blocks"] == remote
        assert st["hits"]["remote"] == remote and st["lookup_blocks"] == 6 * 6
        assert sum(st["hits"].values()) == remote       # a fresh store: every hit came from the server


async def test_another_process_reads_them_bit_exact(server, tmp_path):
    async with Store.open(remote_cfg(server.url)) as a:
        await write_some(a)
    script = textwrap.dedent(f"""
        import asyncio, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from runtime import Store
        from test_remote_store import remote_cfg, check_hits
        async def main():
            async with Store.open(remote_cfg({server.url!r})) as b:
                print(await check_hits(b))
        asyncio.run(main())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.strip().splitlines()[-1]) > 0


async def test_another_salt_or_layout_never_shares(server):
    async with Store.open(remote_cfg(server.url)) as a:
        await write_some(a)
    async with Store.open(remote_cfg(server.url, hash_salt=b"other")) as b:
        assert await check_hits(b) == 0
    async with Store.open(remote_cfg(server.url, tpb=8)) as b:
        seq = await b.open_sequence(tokens=prompt(0))
        assert seq.matched_by_tier["remote"] == 0
        await seq.close()


async def test_a_dead_server_is_a_miss_and_corrupt_values_are_never_data(server, caplog):
    async with Store.open(remote_cfg(server.url)) as a:
        await write_some(a)
    import redis
    raw = redis.Redis.from_url(server.url)
    keys = raw.keys("t:*")
    assert keys
    for k in keys[::2]:                          # flip a payload byte in every other value
        v = bytearray(raw.get(k))
        v[-1] ^= 0xFF
        raw.set(k, bytes(v))
    raw.close()
    async with Store.open(remote_cfg(server.url)) as b:
        await check_hits(b)                      # every served byte checked against its pattern
        assert b.stats()["remote"]["misses"]["corrupt"] > 0
    server.kill()
    with caplog.at_level("WARNING", logger="kvtier"):
        c = await Store.open(remote_cfg(server.url))
    assert "unreachable at open" in caplog.text
    async with c:
        assert await check_hits(c) == 0
        await fill(c, prompt(50))                # requests go on
        st = c.stats()["remote"]
        assert st["circuit"] in ("open", "half_open") and sum(st["failures"].values()) > 0


def test_config_needs_a_host_tier():
    with pytest.raises(ConfigError, match="tiers.remote"):
        config(gpu=8, remote=RemoteSettings(url="redis://127.0.0.1:1/0", model="m"))
    with pytest.raises(ConfigError, match="tiers.remote.model"):
        config(gpu=8, host=8, remote=RemoteSettings(url="redis://127.0.0.1:1/0"))


async def test_concurrent_opens_of_one_prefix_all_match_it(server):
    """The first open imports; the others find the blocks held and are matched again."""
    import asyncio
    async with Store.open(remote_cfg(server.url)) as a:
        await write_some(a)
    async with Store.open(remote_cfg(server.url)) as b:
        seqs = await asyncio.gather(*(b.open_sequence(tokens=prompt(0)) for _ in range(4)))
        assert [s.matched_blocks for s in seqs] == [6] * 4
        assert sum(s.matched_by_tier["remote"] for s in seqs) == 6
        for s in seqs:
            await s.close()
        b.check_consistency()


async def test_cancelled_opens_leak_nothing(server, tmp_path, monkeypatch):
    """Opens cancelled while their import waits on the server: slots and sequences settle,
    later requests and the close (persisting to disk) work."""
    import asyncio
    from tiers.remote import RemoteTier
    async with Store.open(remote_cfg(server.url)) as a:
        await write_some(a, 8)
    real_get = RemoteTier.get

    async def slow_get(self, *args):
        await asyncio.sleep(0.02)
        return await real_get(self, *args)
    monkeypatch.setattr(RemoteTier, "get", slow_get)
    cfg = config(gpu=8, host=8, disk=64, disk_dir=tmp_path,
                 remote=RemoteSettings(url=server.url, namespace="t", model="m", op_timeout=2.0))
    async with Store.open(cfg) as b:
        cancelled = 0
        for i in range(8):
            try:
                seq = await asyncio.wait_for(b.open_sequence(tokens=prompt(i)), 0.01)
                await seq.close()
            except asyncio.TimeoutError:
                cancelled += 1
        assert cancelled >= 1
        await b.drain()
        b.check_consistency()
        for i in range(20, 26):
            await fill(b, prompt(i))
        await check_hits(b, 8)                       # what is served is exact
    async with Store.open(cfg) as b:            # what the close persisted came back
        assert b.stats()["recovered_pages"] > 0


async def test_pages_persisted_at_close_are_written_through(server, tmp_path):
    """GPU -> disk moves (persisting at close) write through too, not only GPU -> host."""
    cfg = config(gpu=64, host=32, disk=128, disk_dir=tmp_path,
                 remote=RemoteSettings(url=server.url, namespace="t", model="m", op_timeout=2.0))
    async with Store.open(cfg) as a:
        for i in range(4):
            await fill(a, prompt(i))            # all stay on the GPU until the close
        assert a.stats()["remote"]["written_pages"] == 0
    async with Store.open(remote_cfg(server.url)) as b:
        assert await check_hits(b, 4) == 4 * 6


async def test_remote_metrics_follow_the_stats(server):
    prom = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families
    from runtime.metrics import register
    async with Store.open(remote_cfg(server.url)) as a:
        await write_some(a)
    async with Store.open(remote_cfg(server.url)) as b:
        await check_hits(b)
        reg = prom.CollectorRegistry()
        register(b, reg)
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(prom.generate_latest(reg).decode()) for s in fam.samples}
        st = b.stats()["remote"]
        assert samples[("kvtier_remote_gets_total", (("outcome", "hit"),))] == st["hits"] > 0
        assert samples[("kvtier_remote_imported_blocks_total", ())] == st["imported_blocks"] > 0
        assert samples[("kvtier_remote_bytes_total", (("direction", "in"),))] == st["bytes_in"] > 0
        assert samples[("kvtier_remote_circuit", (("state", "closed"),))] == 1
        assert samples[("kvtier_prefix_cache_hits_total", (("tier", "remote"),))] == st["imported_blocks"]


async def test_the_server_killed_mid_replay_and_restarted(server):
    """Two stores replay the bundled trace slice, verifying every page served; the server
    dies half-way and comes back on the same port: no request fails, no wrong byte is
    served, and hits from the remote tier resume."""
    from runtime.tools.demo import bundled_trace
    from runtime.tools.replay import replay
    from runtime.tools.trace import read_trace
    requests, _ = read_trace(bundled_trace(), 240)
    cfg = lambda: config(gpu=512, host=512, remote=RemoteSettings(url=server.url, namespace="t", model="m",
                                                                  op_timeout=1.0, breaker_cooldown=0.2))
    async with Store.open(cfg()) as writer:
        res = await replay(writer, requests[:120], content=True, verify=True)
        assert not res.errors and res.corrupt_pages == 0
    async with Store.open(cfg()) as reader:
        before = await replay(reader, requests[:60], content=True, verify=True)
        hits_before = reader.stats()["hits"]["remote"]
        server.kill()
        during = await replay(reader, requests[60:90], content=True, verify=True)
        st = reader.stats()["remote"]
        assert sum(st["failures"].values()) > 0
        server.start()                                   # same port, empty (nothing persisted)
        async with Store.open(cfg()) as writer:          # a writer fills it again
            await replay(writer, requests[:120], content=True, verify=True)
        import asyncio
        await asyncio.sleep(0.3)                         # past the breaker's cooldown
        after = await replay(reader, requests[90:120], content=True, verify=True)
        for r in (before, during, after):
            assert not r.errors and r.corrupt_pages == 0
        assert hits_before > 0 and reader.stats()["hits"]["remote"] > hits_before
        assert reader.stats()["remote"]["circuit"] == "closed"
        reader.check_consistency()


async def test_a_failing_write_through_never_fails_a_move(server, monkeypatch):
    from runtime.remote import RemoteLink

    def broken(self, records, rows, nbytes):
        raise RuntimeError("write-through broke")
    monkeypatch.setattr(RemoteLink, "write_through", broken)
    async with Store.open(remote_cfg(server.url)) as a:
        await write_some(a)                          # GPU -> host moves all tee, all fail
        assert a.remote.inflight == 0 and a.stats()["remote"]["written_pages"] == 0
        await check_hits(a)                          # the moved pages are served (from the host tier), exact
        assert a.stats()["hits"]["host"] > 0


async def test_a_cluster_shares_pages_spread_over_its_masters(tmp_path):
    """Three masters on loopback: the pages land on every node, a second store hits them
    bit-exact, and an open's lookup takes one round trip per node."""
    from runtime.tools.redis_servers import REDIS_CLI, RedisClusterProcs
    if REDIS_CLI is None:
        pytest.skip("needs redis-cli")
    with RedisClusterProcs(tmp_path / "cluster") as cluster:
        settings = lambda: RemoteSettings(urls=cluster.urls, namespace="t", model="m", op_timeout=2.0)
        async with Store.open(config(gpu=8, host=32, remote=settings())) as a:
            await write_some(a)
        per_node = [int(n.info("keyspace").get("db0", "keys=0").split(",")[0].split("=")[1]) for n in cluster.nodes]
        assert all(k > 0 for k in per_node), per_node
        async with Store.open(config(gpu=8, host=32, remote=settings())) as b:
            trips = b.stats()["remote"]["round_trips"]
            seq = await b.open_sequence(tokens=prompt(0))
            assert seq.matched_by_tier["remote"] == 6
            await seq.close()
            trips = b.stats()["remote"]["round_trips"] - trips
            assert trips <= 2 * len(cluster.nodes)           # exists, then get: at most one per node each
            assert await check_hits(b) > 0


async def test_a_server_short_of_memory_evicts_and_serves_only_whole_pages(tmp_path):
    """maxmemory with allkeys-lru: far more written than fits; what is left is served
    bit-exact, what was evicted is a miss, and nothing fails."""
    from runtime import LayerSpec
    big = [LayerSpec(0, (("k", 16384), ("v", 16384)))]        # 32 KiB pages: 7.5 MiB written, 2 MiB kept
    with RedisServer(tmp_path / "small", "--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru") as small:
        async with Store.open(remote_cfg(small.url, layers=big)) as a:
            for i in range(40):
                await fill(a, prompt(i))
            await a.drain()
            assert a.stats()["remote"]["written_pages"] > 150
        async with Store.open(remote_cfg(small.url, layers=big)) as b:
            remote = await check_hits(b, 40)                   # every served byte checked
            st = b.stats()["remote"]
            assert 0 < remote < 40 * 6 and sum(st["failures"].values()) == 0


@pytest.mark.parametrize("with_disk", [False, True])
async def test_write_back_sends_what_the_last_tier_drops(server, tmp_path, with_disk):
    """write = "back": nothing goes out while pages stay local; what the last local tier
    (host, or disk) drops is written first, and another store hits it bit-exact."""
    settings = lambda: RemoteSettings(url=server.url, namespace="t", model="m", op_timeout=2.0, write="back")
    cfg = config(gpu=8, host=8, disk=16 if with_disk else None, disk_dir=tmp_path, remote=settings())
    async with Store.open(cfg) as a:
        await fill(a, prompt(0))
        await a.drain()
        assert a.stats()["remote"]["written_pages"] == 0          # GPU -> host is not a write here
        for i in range(1, 12):
            await fill(a, prompt(i))
        await a.drain()
        st = a.stats()
        assert st["drops"] > 0 and st["remote"]["written_pages"] > 0
    async with Store.open(remote_cfg(server.url)) as b:
        assert await check_hits(b, 12) > 0


async def test_write_back_never_sends_gpu_rows(server, tmp_path):
    """A victim dropped straight from the GPU (no colder tier could take it) is not written
    back: its slot numbers and width are the GPU's, not a cold tier's."""
    from runtime.pages import GPU
    settings = RemoteSettings(url=server.url, namespace="t", model="m", op_timeout=2.0, write="back")
    async with Store.open(config(gpu=8, host=8, disk=16, disk_dir=tmp_path, remote=settings)) as a:
        for i in range(6):
            await fill(a, prompt(i, blocks=1))
        victims = a.moves.pick_victims(GPU, 0, 2)
        before = a.stats()["remote"]["written_pages"]
        await a.remote.write_back(victims)
        await a.drain()
        assert a.stats()["remote"]["written_pages"] == before and a.remote.inflight == 0
        a.moves.unclaim(victims, None)
        a.check_consistency()


@pytest.mark.parametrize("host_write,disk_write,teed", [("back", "back", 40), ("back", "through", 40),
                                                        ("through", "back", 48), ("through", "through", 48)])
async def test_clean_copies_are_written_through_once(server, tmp_path, host_write, disk_write, teed):
    """Remote write-through writes pages as they leave the GPU. A copy to the host leaves it
    (a later demotion onto the copy moves no bytes), so it is written then; a disk copy below a
    host tier is not (the demotion to the host still is), or every page went out twice. GPU 8,
    48 committed pages: with host write-back the 40 demoted, with host write-through all 48."""
    cfg = config(gpu=8, host=64, disk=256, disk_dir=tmp_path,
                 remote=RemoteSettings(url=server.url, namespace="t", model="m", op_timeout=2.0))
    cfg.host.write, cfg.host.write_interval = host_write, 0.01
    cfg.disk.write, cfg.disk.write_interval = disk_write, 0.01
    async with Store.open(cfg) as a:
        for i in range(8):
            await fill(a, prompt(i))
            await a.drain()
        st = a.stats()
        assert st["remote"]["written_pages"] == teed and st["remote"]["skipped_pages"] == 0, st["remote"]
        assert st["moves"].get("gpu->host", {}).get("pages", 0) == (40 if host_write == "back" else 0)
    async with Store.open(remote_cfg(server.url)) as b:
        assert await check_hits(b, 8) > 0


async def test_write_back_sends_no_clean_copies(server, monkeypatch):
    """Host write-through, no disk, remote write = "back": the host sheds copies when it needs
    room; their primaries are still on the GPU, so they are not written back as lost pages."""
    from runtime.remote import RemoteLink
    sent = {"pages": 0, "copies": 0}
    real = RemoteLink.write_back

    async def spy(self, victims):
        infos = [self.store.core.page_info(v) for v in victims.tolist()]
        sent["pages"] += len(infos)
        sent["copies"] += sum(i["copy"] for i in infos)
        return await real(self, victims)

    monkeypatch.setattr(RemoteLink, "write_back", spy)
    cfg = config(gpu=8, host=6, remote=RemoteSettings(url=server.url, namespace="t", model="m", op_timeout=2.0,
                                                      write="back"))
    cfg.host.write, cfg.host.write_interval = "through", 0.01
    async with Store.open(cfg) as a:
        for i in range(12):
            await fill(a, prompt(i, blocks=2))
            await a.drain()
        st = a.stats()
        assert st["host_write_through"]["evicted_copies"] > 0
        assert sent["pages"] > 0 and sent["copies"] == 0, sent
        a.check_consistency()


@contextlib.asynccontextmanager
async def skipping_victims(server, tmp_path):
    """Host write-back, disk and remote write-through; 12 blocks (8 on the GPU, with disk
    copies; 4 in the host), then the host full of pages in flight: yields the store and 4 GPU
    victims, which must skip the host, and ``let_go()``, which frees the host (called at the
    end if the test did not)."""
    cfg = config(gpu=8, host=8, disk=64, disk_dir=tmp_path,
                 remote=RemoteSettings(url=server.url, namespace="t", model="m", op_timeout=2.0))
    cfg.disk.write, cfg.disk.write_interval = "through", 0.01
    async with Store.open(cfg) as a:
        for i in range(3):
            await fill(a, prompt(i, blocks=4))
            await a.drain()
        core = a.core
        held_victims = a.moves.pick_victims(HOST, 0, core.queue_len(HOST, 0))
        held_slots = core.allocate(HOST, 0, core.free(HOST, 0))
        victims = a.moves.pick_victims(GPU, 0, 4)
        assert all(core.page_info(core.copy_of(i))["tier"] == DISK for i in victims.tolist())
        held = [True]

        def let_go() -> None:
            if held[0]:
                held[0] = False
                a.moves.unclaim(held_victims, None)
                core.give_back(HOST, 0, held_slots)
            a.check_consistency()
        yield a, victims, let_go
        let_go()


async def check_prompt_1(store: Store, tier: str) -> None:
    """Prompt 1's 4 blocks are matched in ``tier`` and read back exact."""
    seq = await store.open_sequence(tokens=prompt(1, blocks=4))
    try:
        assert seq.matched_by_tier[tier] == 4
        await seq.acquire()
        for blk in range(4):
            assert (read_block(store, seq, 0, blk) == expected_block(store, seq, 0, blk)).all(), blk
    finally:
        await seq.close()


async def test_a_page_skipping_a_full_host_onto_its_disk_copy_is_written_through(server, tmp_path):
    """Host write-back, disk write-through: a GPU page's disk copy is not teed (the page's
    demotion to the host is). When the host is full of pages in flight, a demotion skips to
    the disk; swapping onto the copy would move no bytes and the remote would never see the
    page, so it moves (the landing frees the copy) and is written through on the way."""
    async with skipping_victims(server, tmp_path) as (a, victims, let_go):
        ids = victims.tolist()
        before = a.stats()["remote"]["written_pages"]
        a.core.give_back(GPU, 0, await a.moves.evict(GPU, victims))
        await a.drain()
        assert [a.core.page_info(i)["tier"] for i in ids] == [DISK] * 4
        assert a.stats()["remote"]["written_pages"] == before + 4
    async with Store.open(remote_cfg(server.url)) as b:
        await check_prompt_1(b, "remote")


async def test_a_skipping_page_the_full_disk_refuses_swaps_onto_its_copy(server, tmp_path):
    """Review find: the skipping page moves rather than swap onto its disk copy (above); when
    the full disk refused that move, the page was dropped with the copy that held it (or, held,
    the request failed). It now swaps onto the copy after all: kept, though the remote misses it."""
    import errno
    async with skipping_victims(server, tmp_path) as (a, victims, let_go):
        ids = victims.tolist()
        on_disk = len(a.core.tier_pages(DISK, 0))
        a.disk.inject_fault("write", errno.ENOSPC, count=1)
        a.core.give_back(GPU, 0, await a.moves.evict(GPU, victims))
        await a.drain()
        assert [a.core.page_info(i)["tier"] for i in ids] == [DISK] * 4
        assert len(a.core.tier_pages(DISK, 0)) == on_disk
        assert a.stats()["disk_full"] == {"refused_spills": 1, "dropped_pages": 0}     # swapped, none dropped
        let_go()
        await check_prompt_1(a, "disk")


async def test_a_tee_whose_records_fail_gives_its_reservation_back(server, monkeypatch):
    """A demotion's tee reserves write-through bytes, then reads its pages' records: if that
    raised, the reservation stayed, and write-through skipped every batch once enough had
    leaked. The move fails as a whole, its pages stay on the GPU, and the next one tees."""
    async with Store.open(remote_cfg(server.url)) as a:
        for i in range(2):
            await fill(a, prompt(i, blocks=4))              # the GPU's 8 blocks, full
        remote = a.moves.remote

        def broken(batch):
            raise RuntimeError("injected in the tee's records")
        monkeypatch.setattr(a.moves, "records", broken)
        with pytest.raises(RuntimeError, match="injected"):
            await fill(a, prompt(2, blocks=4))
        monkeypatch.undo()
        assert remote.inflight == 0
        a.check_consistency()
        before = a.stats()["remote"]["written_pages"]
        await fill(a, prompt(2, blocks=4))
        await a.drain()
        assert a.stats()["remote"]["written_pages"] == before + 4
        assert await check_hits(a, 3) == 0                  # all local, and all exact


async def test_a_batch_larger_than_the_inflight_bound_sends_its_shallowest_pages(server):
    """Review find: write-through reserved a whole demotion batch or nothing, so with pages of
    megabytes (a batch of 512 pages of 2 MiB is 1 GiB) no long prompt ever reached the server.
    Now the pages that fit go, the shallowest first (a match needs its prefix). Here the bound
    is three pages (of 512 bytes) and prompt 0's six pages leave the GPU in one batch."""
    def cfg():
        return config(gpu=8, host=32, remote=RemoteSettings(url=server.url, namespace="t", model="m",
                                                            op_timeout=2.0, max_inflight_bytes=3 * 512))
    async with Store.open(cfg()) as a:
        await fill(a, prompt(0))
        victims = a.moves.pick_victims(GPU, 0, 6)
        a.core.give_back(GPU, 0, await a.moves.evict(GPU, victims))
        await a.drain()
        st = a.stats()["remote"]
        assert st["written_pages"] == 3 and st["skipped_pages"] == 3 and st["inflight_bytes"] == 0, st
    async with Store.open(cfg()) as b:
        assert await check_hits(b, 1) == 3                  # blocks 0-2, exact: the prefix, not any three


async def written_without(server, layers, block: int, lc: int):
    """Prompt 0 written through to the server by a store of ``layers``, then life cycle ``lc``'s
    page of its block ``block`` deleted there (as the server's maxmemory or ttl would): the
    config of a store to read it back with."""
    from runtime.tools.redis_servers import command
    from tiers.remote import block_key_bytes

    def cfg():
        return config(gpu=16, host=64, layers=layers,
                      remote=RemoteSettings(url=server.url, namespace="t", model="m", op_timeout=2.0))
    async with Store.open(cfg()) as a:
        await fill(a, prompt(0))
        for i in range(100, 106):
            await fill(a, prompt(i))                        # prompt 0 off the GPU: written through
        await a.drain()
        seq = await a.open_sequence(tokens=prompt(0))
        keys = list(seq.keys)
        await seq.close()
    reply = command(server.port, "KEYS", b"t:*:" + block_key_bytes(keys[block]).hex().encode() + b":%d" % lc)
    assert command(server.port, "DEL", reply.split(b"\r\n")[2]).startswith(b":1"), reply
    return cfg


async def test_an_optional_page_the_server_lost_never_limits_the_match(server):
    """Review find: DESIGN.md has OPTIONAL pages never limit a match, but one missing on the
    server (its maxmemory evicted it, or its ttl ran out) ended the import at its block. Now the
    block comes without it (to recompute), as a local match without it does."""
    from runtime import LayerSpec, ReusePolicy
    layers = [LayerSpec(0, (("k", 128), ("v", 128))),
              LayerSpec(1, (("k", 128), ("v", 128)), reuse=ReusePolicy.OPTIONAL)]

    cfg = await written_without(server, layers, block=1, lc=1)
    async with Store.open(cfg()) as b:
        seq = await b.open_sequence(tokens=prompt(0))
        try:
            assert seq.matched_blocks == 6 and seq.matched_by_tier["remote"] == 6
            await seq.acquire()
            assert seq.recompute_blocks(1) == [1]           # the lost page, to recompute
            for blk in range(6):                            # the required pages, exact
                assert (read_block(b, seq, 0, blk) == expected_block(b, seq, 0, blk)).all(), blk
        finally:
            await seq.close()
        b.check_consistency()


async def test_a_window_page_the_server_lost_ends_the_match_and_counts_only_what_it_reached(server):
    """Review find: with a REQUIRED window, the import takes a block whose window page the server
    lost (no longer prefix-critical), but the match end needs that page: the match again stopped
    a block short, and hits and hit_pages took back every imported block (host went negative)."""
    from runtime import ReusePolicy
    from helpers import two_life_cycles

    cfg = await written_without(server, two_life_cycles(window_reuse=ReusePolicy.REQUIRED), block=5, lc=1)
    async with Store.open(cfg()) as b:
        seq = await b.open_sequence(tokens=prompt(0))
        assert seq.matched_blocks == 5
        assert seq.matched_by_tier == {"gpu": 0, "host": 0, "disk": 0, "remote": 5}
        await seq.close()
        st = b.stats()
        assert st["hits"] == {"gpu": 0, "host": 0, "disk": 0, "remote": 5}
        assert st["remote"]["imported_blocks"] == 5 and st["remote"]["imported_pages"] == 10
        assert [g["hit_pages"] for t in st["tiers"].values() for g in t["groups"]] == [0, 0]
        b.check_consistency()
        assert await check_hits(b, 1) == 0                  # all local now, and exact


async def test_an_open_importing_when_close_begins_is_refused(server, monkeypatch):
    """Review find: an open whose remote fetch was in flight when close() began returned a
    live sequence (its pages held while the close persisted) instead of StoreClosedError."""
    from runtime import StoreClosedError
    from tiers.remote import RemoteTier
    async with Store.open(remote_cfg(server.url)) as a:
        await write_some(a)
    real = RemoteTier.get

    async def slow_get(self, *args):
        await asyncio.sleep(0.1)
        return await real(self, *args)
    monkeypatch.setattr(RemoteTier, "get", slow_get)
    b = await Store.open(remote_cfg(server.url))
    opening = asyncio.ensure_future(b.open_sequence(tokens=prompt(1)))
    await asyncio.sleep(0.05)                               # fetching from the server
    closing = asyncio.ensure_future(b.close())
    with pytest.raises(StoreClosedError, match="closing"):
        await opening
    await closing


async def test_hit_pages_count_a_rematch_after_an_import_once(server):
    """Review find: an open that imports from the remote matches again, and the pages of its
    first match were counted in stats()'s per-group hit_pages twice."""
    async with Store.open(remote_cfg(server.url)) as a:
        await write_some(a)
    async with Store.open(remote_cfg(server.url)) as b:
        await fill(b, prompt(0, blocks=2))                  # 2 of prompt 0's 6 blocks, imported
        seq = await b.open_sequence(tokens=prompt(0))       # 2 local, 4 imported, matched again
        assert seq.matched_by_tier["remote"] == 4 and seq.matched_blocks == 6
        await seq.close()
        st = b.stats()
        pages = sum(g["hit_pages"] for t in st["tiers"].values() for g in t["groups"])
        assert st["hits"] == {"gpu": 2, "host": 0, "disk": 0, "remote": 6}
        assert pages == 2                                   # one page a block, each counted once ...
        assert st["remote"]["imported_pages"] == 6          # ... the imported ones as remote (review find)


async def test_hit_pages_of_concurrent_rematches(server):
    """Second review find: the pages an open counted were kept in one slot of the store, which a
    concurrent open overwrote during the import: re-matches took back another's pages (hit_pages
    went negative, and so did the Prometheus counter)."""
    async with Store.open(remote_cfg(server.url)) as a:
        await write_some(a)
    async with Store.open(remote_cfg(server.url)) as b:
        await fill(b, prompt(1, blocks=4))

        def pages() -> list[int]:
            return [g["hit_pages"] for t in b.stats()["tiers"].values() for g in t["groups"]]
        before, imported = sum(pages()), b.stats()["remote"]["imported_pages"]
        seqs = await asyncio.gather(*[b.open_sequence(tokens=prompt(i)) for i in (2, 3, 4, 5, 1)])
        assert [s.matched_blocks for s in seqs] == [6] * 5
        local = seqs[-1].matched_by_tier["gpu"] + seqs[-1].matched_by_tier["host"]
        for s in seqs:
            await s.close()
        # one page a block, once each: the imported ones as remote
        assert min(pages()) >= 0 and sum(pages()) - before == local
        assert b.stats()["remote"]["imported_pages"] - imported == 30 - local

"""The remote tier's backend (issue 13) against real ``redis-server`` processes on loopback:
content across processes, a three-master cluster, a server killed or hung mid-use, values
corrupted on the server, server-side eviction, the in-flight byte bound and bad settings."""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import textwrap
import time

import numpy as np
import pytest

from runtime.tools.redis_servers import REDIS_CLI, REDIS_SERVER, RedisClusterProcs, RedisServer, free_port

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
redis = pytest.importorskip("redis")

from tiers.errors import ConfigError, UsageError                                    # noqa: E402
from tiers.remote import (HEADER, HEADER_SIZE, MAGIC, RemoteSettings, RemoteTier,  # noqa: E402
                          block_key_bytes)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP = b"layout:tpb=16;group=0;codec=none;dtype=bf16;salt=abc"


def pages(n: int, size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size), dtype=np.uint8)


def idents_for(n: int, lc: int = 0, base: int = 0) -> list[tuple[bytes, int]]:
    return [(block_key_bytes(base + i), lc) for i in range(n)]


def raw(server: RedisServer) -> "redis.Redis":
    return redis.Redis(host="127.0.0.1", port=server.port)


@pytest.fixture
def server(tmp_path):
    s = RedisServer(tmp_path / "redis").start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if REDIS_CLI is None:
        pytest.skip("redis-cli is not installed")
    c = RedisClusterProcs(tmp_path_factory.mktemp("cluster")).start()
    yield c
    c.stop()


async def open_tier(url: str, fp: bytes = FP, **kw) -> RemoteTier:
    return await RemoteTier.open(RemoteSettings(url=url, **kw), fp)


# ---- round trip ---------------------------------------------------------------------------------

@pytest.mark.parametrize("size, n", [(64 << 10, 16), (1, 7), (4097, 5), (3 * 1000 + 7, 9)])
async def test_put_then_get_is_bit_exact(server, size, n):
    tier = await open_tier(server.url, ttl_ms=60_000)
    idents = idents_for(n, lc=1)
    keys = tier.page_keys(idents)
    rows = pages(n, size, seed=size)
    assert await tier.exists(keys) == [False] * n
    assert await tier.put(keys, idents, rows) == n
    assert await tier.exists(keys) == [True] * n
    out = np.full_like(rows, 0xAB)
    assert await tier.get(keys, idents, out) == [True] * n
    assert np.array_equal(out, rows)
    r = raw(server)
    ttls = [r.pttl(k) for k in keys]
    assert all(0 < t <= 60_000 for t in ttls), ttls
    st = tier.stats()
    assert st["hits"] == n and st["stored"] == n and st["lookups"] == 2 * n and st["lookup_hits"] == n
    assert st["lookup_misses"]["absent"] == n
    assert st["bytes_out"] == st["bytes_in"] == n * (HEADER_SIZE + size)
    assert st["round_trips"] == 4                         # one per call: exists, put, exists, get
    assert st["circuit"] == "closed" and sum(st["failures"].values()) == 0
    assert all(st["latency"][op]["count"] == c for op, c in (("exists", 2), ("get", 1), ("put", 1)))
    await tier.close()


async def test_torch_tensors_key_and_value_layout(server):
    torch = pytest.importorskip("torch")
    tier = await open_tier(server.url, namespace="ns1")
    idents = idents_for(3, lc=2, base=1000)
    keys = tier.page_keys(idents)
    rows = torch.from_numpy(pages(3, 4096, seed=3))
    assert await tier.put(keys, idents, rows) == 3
    out = torch.zeros_like(rows)
    assert await tier.get(keys, idents, out) == [True] * 3
    assert torch.equal(out, rows)
    fp_hex = hashlib.blake2b(FP, digest_size=16).hexdigest()
    assert keys[0] == f"ns1:{fp_hex}:{idents[0][0].hex()}:2".encode()
    assert idents[0][0] == (1000).to_bytes(16, "little") + b"\0"      # int key: 128-bit little endian, tag 0
    value = raw(server).get(keys[0])
    magic, version, lc, reserved, plen, kdig, csum = HEADER.unpack_from(value)
    import xxhash
    assert (magic, version, lc, reserved, plen) == (MAGIC, 1, 2, 0, 4096)
    assert kdig == hashlib.blake2b(idents[0][0], digest_size=16,
                                   key=hashlib.blake2b(FP, digest_size=16).digest()).digest()
    assert csum == xxhash.xxh3_64_intdigest(rows[0].numpy().tobytes())
    assert value[HEADER_SIZE:] == rows[0].numpy().tobytes()
    with pytest.raises(UsageError):
        await tier.get(keys, idents, torch.zeros(2, 4096, dtype=torch.uint8))
    with pytest.raises(UsageError):
        await tier.get(keys, idents, torch.zeros(3, 4096, dtype=torch.float32))
    with pytest.raises(UsageError):
        tier.page_key(b"short", 0)
    with pytest.raises(UsageError):
        tier.page_key(idents[0][0], 256)
    await tier.close()


async def test_skip_existing_and_no_ttl(server):
    tier = await open_tier(server.url, ttl_ms=None)
    idents = idents_for(4)
    keys = tier.page_keys(idents)
    first, second = pages(4, 1024, 1), pages(4, 1024, 2)
    assert await tier.put(keys[:2], idents[:2], first[:2]) == 2
    assert await tier.put(keys, idents, second, skip_existing=True) == 4     # 2 already there, 2 written
    st = tier.stats()
    assert st["stored"] == 4 and st["skipped"] == 2
    out = np.zeros_like(first)
    assert await tier.get(keys, idents, out) == [True] * 4
    assert np.array_equal(out[:2], first[:2]) and np.array_equal(out[2:], second[2:])
    assert raw(server).pttl(keys[0]) == -1                                 # no TTL
    await tier.close()


async def test_unix_socket_url(tmp_path):
    sock = tmp_path / "r.sock"
    with RedisServer(tmp_path / "unix", "--unixsocket", str(sock)):
        tier = await open_tier(f"unix://{sock}?db=2")
        idents = idents_for(3)
        keys = tier.page_keys(idents)
        rows = pages(3, 777)
        assert await tier.put(keys, idents, rows) == 3
        out = np.zeros_like(rows)
        assert await tier.get(keys, idents, out) == [True] * 3 and np.array_equal(out, rows)
        await tier.close()


async def test_error_replies_are_per_key_misses_and_the_pipeline_goes_on(server):
    tier = await open_tier(server.url)
    idents = idents_for(4)
    keys = tier.page_keys(idents)
    rows = pages(4, 2048)
    assert await tier.put(keys, idents, rows) == 4
    raw(server).delete(keys[1])
    raw(server).rpush(keys[1], b"not a string")              # GET of a list: -WRONGTYPE
    out = np.zeros_like(rows)
    assert await tier.get(keys, idents, out) == [True, False, True, True]
    assert np.array_equal(out[[0, 2, 3]], rows[[0, 2, 3]])
    st = tier.stats()
    assert st["misses"]["error"] == 1 and st["failures"]["other"] == 1 and st["circuit"] == "closed"
    await tier.close()


async def test_a_full_noeviction_server_refuses_writes_counted(tmp_path):
    with RedisServer(tmp_path / "full", "--maxmemory", "1500kb", "--maxmemory-policy", "noeviction") as server:
        tier = await open_tier(server.url)
        n = 64
        idents = idents_for(n)
        keys = tier.page_keys(idents)
        stored = 0
        for a in range(0, n, 4):
            stored += await tier.put(keys[a:a + 4], idents[a:a + 4], pages(4, 32768, seed=a))
        st = tier.stats()
        assert 0 < stored < n and st["put_failed"] == n - stored and st["failures"]["other"] == n - stored
        assert st["circuit"] == "closed"
        assert sum(await tier.exists(keys)) == stored
        await tier.close()


# ---- sharing: another process, another layout -------------------------------------------------------

CHILD = textwrap.dedent("""
    import asyncio, json, sys
    import numpy as np
    sys.path.insert(0, {root!r})
    from tiers.remote import RemoteSettings, RemoteTier, block_key_bytes

    async def main():
        url, fp = {url!r}, {fp!r}
        idents = [(block_key_bytes(i), 0) for i in range(12)]
        rows = np.random.default_rng(7).integers(0, 256, (12, 65536), dtype=np.uint8)
        res = {{}}
        tier = await RemoteTier.open(RemoteSettings(url=url), fp)
        keys = tier.page_keys(idents)
        out = np.zeros_like(rows)
        res["found"] = await tier.get(keys, idents, out)
        res["exact"] = bool(np.array_equal(out, rows))
        mine = [(block_key_bytes(100 + i), 1) for i in range(5)]
        res["written"] = await tier.put(tier.page_keys(mine), mine,
                                        np.random.default_rng(8).integers(0, 256, (5, 65536), dtype=np.uint8))
        other = await RemoteTier.open(RemoteSettings(url=url), fp + b"-other-layout")
        res["other_fp"] = await other.exists(other.page_keys(idents))
        ns = await RemoteTier.open(RemoteSettings(url=url, namespace="elsewhere"), fp)
        res["other_ns"] = await ns.exists(ns.page_keys(idents))
        for t in (tier, other, ns):
            await t.close()
        print(json.dumps(res))

    asyncio.run(main())
""")


async def test_another_process_reads_the_pages_bit_exact(server):
    tier = await open_tier(server.url)
    idents = idents_for(12)
    keys = tier.page_keys(idents)
    assert await tier.put(keys, idents, pages(12, 65536, seed=7)) == 12
    script = CHILD.format(root=ROOT, url=server.url, fp=FP)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, stderr.decode()[-3000:]
    res = json.loads(stdout.decode().strip().splitlines()[-1])
    assert res["found"] == [True] * 12 and res["exact"]
    assert res["other_fp"] == [False] * 12 and res["other_ns"] == [False] * 12
    assert res["written"] == 5
    # ...and what the other process wrote is a hit here
    mine = [(block_key_bytes(100 + i), 1) for i in range(5)]
    out = np.zeros((5, 65536), np.uint8)
    assert await tier.get(tier.page_keys(mine), mine, out) == [True] * 5
    assert np.array_equal(out, pages(5, 65536, seed=8))
    await tier.close()


async def test_a_value_copied_under_another_layouts_key_is_a_mismatch(server):
    a = await open_tier(server.url, fp=b"layout-a")
    b = await open_tier(server.url, fp=b"layout-b")
    idents = idents_for(2)
    ka, kb = a.page_keys(idents), b.page_keys(idents)
    assert not set(ka) & set(kb)
    assert await a.put(ka, idents, pages(2, 512)) == 2
    r = raw(server)
    for x, y in zip(ka, kb):
        r.set(y, r.get(x))
    out = np.zeros((2, 512), np.uint8)
    assert await b.get(kb, idents, out) == [False, False]
    assert b.stats()["misses"]["mismatch"] == 2 and not out.any()
    await a.close()
    await b.close()


# ---- cluster ---------------------------------------------------------------------------------------

async def test_cluster_spreads_keys_and_takes_one_round_trip_per_node(cluster, monkeypatch):
    from redis.asyncio.connection import AbstractConnection
    tier = await RemoteTier.open(RemoteSettings(urls=cluster.urls[:2], namespace="spread"), FP)
    assert tier.stats()["circuit"] == "closed"
    n = 96
    idents = idents_for(n)
    keys = tier.page_keys(idents)
    rows = pages(n, 8192, seed=11)

    sends: dict[int, int] = {}
    orig = AbstractConnection.send_packed_command

    async def counting(self, command, check_health=True):
        sends[self.port] = sends.get(self.port, 0) + 1
        return await orig(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counting)

    async def measured(call, cmd):
        before_calls = {node.port: node.calls(cmd) for node in cluster.nodes}
        before_rt = tier.stats()["round_trips"]
        sends.clear()
        result = await call
        after_calls = {node.port: node.calls(cmd) for node in cluster.nodes}
        return result, sends.copy(), tier.stats()["round_trips"] - before_rt, \
            {p: after_calls[p] - before_calls[p] for p in after_calls}

    assert await tier.exists(keys) == [False] * n              # warm up: every node's connection is open
    stored, s_put, rt_put, _ = await measured(tier.put(keys, idents, rows), "set")
    assert stored == n
    owned = {node.port: {k for k in raw(node).keys(b"spread:*")} for node in cluster.nodes}
    assert all(owned.values()), {p: len(v) for p, v in owned.items()}          # every master has some
    assert sum(len(v) for v in owned.values()) == n and set().union(*owned.values()) == set(keys)
    ports = {node.port for node in cluster.nodes}
    assert s_put == dict.fromkeys(ports, 1) and rt_put == 3

    found, s_ex, rt_ex, calls_ex = await measured(tier.exists(keys), "exists")
    assert found == [True] * n
    assert s_ex == dict.fromkeys(ports, 1) and rt_ex == 3
    assert calls_ex == {p: len(owned[p]) for p in ports}       # all of a node's keys went in its one pipeline

    out = np.zeros_like(rows)
    got, s_get, rt_get, calls_get = await measured(tier.get(keys, idents, out), "get")
    assert got == [True] * n and np.array_equal(out, rows)
    assert s_get == dict.fromkeys(ports, 1) and rt_get == 3
    assert calls_get == {p: len(owned[p]) for p in ports}

    # a request whose keys live on one node only talks to that node
    port0 = cluster.nodes[0].port
    on0 = [i for i, k in enumerate(keys) if k in owned[port0]][:5]
    res, s_one, rt_one, _ = await measured(tier.exists([keys[i] for i in on0]), "exists")
    assert res == [True] * 5 and s_one == {port0: 1} and rt_one == 1
    assert sum(tier.stats()["failures"].values()) == 0
    await tier.close()


async def test_cluster_resharding_is_a_counted_miss_then_hits_follow_the_slot(cluster):
    tier = await RemoteTier.open(RemoteSettings(urls=[cluster.urls[0]], namespace="reshard"), FP)
    n = 24
    idents = idents_for(n)
    keys = tier.page_keys(idents)
    rows = pages(n, 4096, seed=13)
    assert await tier.put(keys, idents, rows) == n
    # move the slot of keys[0] to another master, behind the client's back
    rs = {node.port: raw(node) for node in cluster.nodes}
    slot = rs[cluster.nodes[0].port].cluster("KEYSLOT", keys[0])
    src = next(node for node in cluster.nodes if rs[node.port].exists(keys[0]))
    dst = next(node for node in cluster.nodes if node is not src)
    ids = {node.port: rs[node.port].execute_command("CLUSTER MYID").decode() for node in cluster.nodes}
    rs[dst.port].execute_command("CLUSTER SETSLOT", slot, "IMPORTING", ids[src.port])
    rs[src.port].execute_command("CLUSTER SETSLOT", slot, "MIGRATING", ids[dst.port])
    moving = rs[src.port].execute_command("CLUSTER GETKEYSINSLOT", slot, 1000)
    rs[src.port].execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", *moving)
    for node in cluster.nodes:
        rs[node.port].execute_command("CLUSTER SETSLOT", slot, "NODE", ids[dst.port])
    in_slot = [i for i, k in enumerate(keys) if rs[dst.port].cluster("KEYSLOT", k) == slot]
    out = np.zeros_like(rows)
    got = await tier.get(keys, idents, out)                      # the client still routes the slot to src
    assert [i for i in range(n) if not got[i]] == in_slot
    assert all(np.array_equal(out[i], rows[i]) for i in range(n) if got[i])
    st = tier.stats()
    assert st["failures"]["cluster"] == len(in_slot) and st["misses"]["error"] == len(in_slot)
    assert st["circuit"] == "closed"
    out = np.zeros_like(rows)
    assert await tier.get(keys, idents, out) == [True] * n       # slot map refreshed: hits again
    assert np.array_equal(out, rows)
    await tier.close()


async def test_cluster_unreachable_at_open_is_an_open_circuit():
    urls = [f"redis://127.0.0.1:{free_port()}" for _ in range(2)]
    t0 = time.monotonic()
    tier = await RemoteTier.open(RemoteSettings(urls=urls, connect_timeout=0.2, op_timeout=0.2), FP)
    assert time.monotonic() - t0 < 1.0
    st = tier.stats()
    assert st["circuit"] == "open" and st["failures"]["connection"] + st["failures"]["cluster"] == 1
    keys = tier.page_keys(idents_for(3))
    assert await tier.exists(keys) == [False] * 3
    assert tier.stats()["lookup_misses"]["circuit_open"] == 3 and tier.stats()["round_trips"] == 0
    await tier.close()


# ---- failure: the server dies, hangs, or is not there yet ----------------------------------------------

SETTINGS = dict(connect_timeout=0.2, op_timeout=0.25, breaker_failures=2, breaker_cooldown=0.3)


async def test_server_killed_mid_use_then_restarted(server):
    tier = await open_tier(server.url, **SETTINGS)
    n = 32
    idents = idents_for(n)
    keys = tier.page_keys(idents)
    rows = pages(n, 65536, seed=5)
    assert await tier.put(keys, idents, rows) == n

    # killed while requests are in flight: nothing raises, nothing wrong is served
    loop = asyncio.get_running_loop()
    done = []
    elapsed = []

    async def worker():
        for _ in range(8):
            out = np.zeros_like(rows)
            t0 = time.monotonic()
            got = await tier.get(keys, idents, out)
            elapsed.append(time.monotonic() - t0)
            for i, ok in enumerate(got):
                assert np.array_equal(out[i], rows[i]) if ok else not out[i].any()
            done.append(sum(got))
            if len(done) == 4:
                loop.call_soon(server.kill)          # while the other workers' gets are on the wire

    await asyncio.gather(*(worker() for _ in range(3)))
    assert server.proc is None
    assert max(elapsed) < SETTINGS["op_timeout"] + 0.2
    assert done[:4] == [n] * 4 and done[-1] == 0             # hits before the kill, misses after
    assert tier.stats()["failures"]["connection"] >= 1

    # calls after the kill: misses within op_timeout, then the circuit opens
    for _ in range(3):
        t0 = time.monotonic()
        assert await tier.exists(keys) == [False] * n
        assert time.monotonic() - t0 < SETTINGS["op_timeout"] + 0.1
    st = tier.stats()
    assert st["circuit"] == "open" and st["failures"]["connection"] >= 2
    rt, refused = st["round_trips"], st["misses"]["circuit_open"]
    out = np.zeros_like(rows)
    t0 = time.monotonic()
    assert await tier.get(keys, idents, out) == [False] * n
    assert await tier.put(keys, idents, rows) == 0
    assert time.monotonic() - t0 < 0.1 and tier.stats()["round_trips"] == rt       # never touched the network
    st = tier.stats()
    assert st["misses"]["circuit_open"] == refused + n and st["put_refused"] == n
    assert st["lookup_misses"]["circuit_open"] > 0

    # restarted on the same port (empty: nothing was persisted); after the cooldown one trial goes through
    server.start()
    await asyncio.sleep(SETTINGS["breaker_cooldown"])
    assert tier.stats()["circuit"] == "half_open"
    burst = await asyncio.gather(*(tier.exists(keys[:1]) for _ in range(5)))
    assert tier.stats()["round_trips"] == rt + 1                 # only the trial reached the server
    assert burst == [[False]] * 5 and tier.stats()["circuit"] == "closed"
    assert await tier.put(keys, idents, rows) == n
    out = np.zeros_like(rows)
    assert await tier.get(keys, idents, out) == [True] * n and np.array_equal(out, rows)
    await tier.close()


async def test_server_hung_calls_time_out_and_hits_resume(server):
    tier = await open_tier(server.url, **SETTINGS)
    n = 8
    idents = idents_for(n)
    keys = tier.page_keys(idents)
    rows = pages(n, 65536, seed=6)
    assert await tier.put(keys, idents, rows) == n
    server.pause()
    try:
        for call in (lambda: tier.get(keys, idents, np.zeros_like(rows)), lambda: tier.exists(keys)):
            t0 = time.monotonic()
            assert await call() == [False] * n
            assert SETTINGS["op_timeout"] - 0.05 < time.monotonic() - t0 < SETTINGS["op_timeout"] + 0.25
        st = tier.stats()
        assert st["failures"]["timeout"] == 2 and st["circuit"] == "open"
        assert st["misses"]["error"] == n and st["lookup_misses"]["error"] == n
        # a caller that gives up mid-call is not a server failure and leaves no half-read connection
        task = asyncio.ensure_future(tier.put(keys, idents, rows))
        await asyncio.sleep(0)
        assert await task == 0                                  # refused by the open circuit
    finally:
        server.resume()
    await asyncio.sleep(SETTINGS["breaker_cooldown"])
    out = np.zeros_like(rows)
    assert await tier.get(keys, idents, out) == [True] * n and np.array_equal(out, rows)
    assert tier.stats()["circuit"] == "closed"
    # cancelled mid-round-trip: the next call still gets clean replies
    server.pause()
    task = asyncio.ensure_future(tier.get(keys, idents, np.zeros_like(rows)))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    server.resume()
    assert tier.stats()["circuit"] == "closed" and tier.stats()["failures"]["timeout"] == 2
    out = np.zeros_like(rows)
    assert await tier.get(keys, idents, out) == [True] * n and np.array_equal(out, rows)
    await tier.close()


async def test_unreachable_at_open_then_the_server_appears(tmp_path):
    server = RedisServer(tmp_path / "late")
    server.port = free_port()
    t0 = time.monotonic()
    tier = await open_tier(server.url, **SETTINGS)
    assert time.monotonic() - t0 < SETTINGS["connect_timeout"] + SETTINGS["op_timeout"]
    st = tier.stats()
    assert st["circuit"] == "open" and st["failures"]["connection"] == 1 and st["circuit_opens"] == 1
    idents = idents_for(2)
    keys = tier.page_keys(idents)
    assert await tier.exists(keys) == [False, False] and tier.stats()["round_trips"] == 0
    server.start()
    try:
        await asyncio.sleep(SETTINGS["breaker_cooldown"])
        assert await tier.put(keys, idents, pages(2, 100)) == 2
        assert await tier.exists(keys) == [True, True] and tier.stats()["circuit"] == "closed"
    finally:
        await tier.close()
        server.stop()


# ---- values damaged on the server -------------------------------------------------------------------

async def test_corrupted_truncated_and_swapped_values_are_counted_misses(server):
    tier = await open_tier(server.url)
    size = 4096
    n = 10
    idents = idents_for(n, lc=0)
    keys = tier.page_keys(idents)
    rows = pages(n, size, seed=9)
    assert await tier.put(keys, idents, rows) == n
    # a page of another life cycle and one of another size, written by the tier itself
    other_lc = [(idents[4][0], 1)]
    assert await tier.put(tier.page_keys(other_lc), other_lc, pages(1, size, seed=10)) == 1
    other_size = [(block_key_bytes(999), 0)]
    assert await tier.put(tier.page_keys(other_size), other_size, pages(1, size + 1, seed=10)) == 1

    r = raw(server)
    v = bytearray(r.get(keys[0]))
    v[HEADER_SIZE + 100] ^= 0x01                                 # one payload bit
    r.set(keys[0], bytes(v))
    r.set(keys[1], r.get(keys[1])[:-10])                         # cut short
    v2, v3 = r.get(keys[2]), r.get(keys[3])
    r.set(keys[2], v3)                                           # swapped
    r.set(keys[3], v2)
    r.set(keys[4], r.get(tier.page_key(*other_lc[0])))           # another life cycle's value
    r.set(keys[5], b"garbage")                                   # shorter than a header
    v = bytearray(r.get(keys[6]))
    v[:4] = b"XXXX"                                              # bad magic
    r.set(keys[6], bytes(v))
    r.set(keys[7], r.get(tier.page_key(*other_size[0])))        # a page of another size
    r.delete(keys[8])                                            # gone
    r.set(keys[9], r.get(keys[9]) + b"extra")                    # too long for its header
    extra = [(block_key_bytes(555), 0)]
    r.set(tier.page_key(*extra[0]), b"\0" * (HEADER_SIZE + size))   # zeros of the right length

    sentinel = np.full((n + 1, size), 0x5A, np.uint8)
    got = await tier.get(keys + tier.page_keys(extra), idents + extra, sentinel)
    assert got == [False] * (n + 1)
    assert (sentinel == 0x5A).all()                              # no byte of a bad value reached out
    m = tier.stats()["misses"]
    assert m == {"absent": 1, "corrupt": 6, "wrong_size": 1, "mismatch": 3, "circuit_open": 0, "error": 0}, m
    assert tier.stats()["hits"] == 0 and tier.stats()["circuit"] == "closed"
    await tier.close()


# ---- server-side eviction -------------------------------------------------------------------------

async def test_maxmemory_lru_evicts_and_evicted_keys_are_misses(tmp_path):
    with RedisServer(tmp_path / "small", "--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru") as server:
        tier = await open_tier(server.url)
        n, size = 160, 65536                                     # 10 MiB into a 2 MiB server
        idents = idents_for(n)
        keys = tier.page_keys(idents)
        rows = pages(n, size, seed=12)
        stored = 0
        for a in range(0, n, 8):
            stored += await tier.put(keys[a:a + 8], idents[a:a + 8], rows[a:a + 8])
        assert stored == n                                       # every SET succeeded...
        assert int(server.info("stats")["evicted_keys"]) > 0    # ...by evicting older keys
        present = await tier.exists(keys)
        assert 0 < sum(present) < n // 4
        out = np.zeros_like(rows)
        got = await tier.get(keys, idents, out)
        for i in range(n):
            if got[i]:
                assert np.array_equal(out[i], rows[i])
            else:
                assert not out[i].any()
            if not present[i]:
                assert not got[i]
        st = tier.stats()
        assert st["misses"]["absent"] == n - sum(got) and sum(got) > 0
        assert sum(st["failures"].values()) == 0 and st["put_failed"] == 0 and st["circuit"] == "closed"
        await tier.close()


# ---- the in-flight byte bound -----------------------------------------------------------------------

async def test_concurrent_puts_never_exceed_max_inflight_bytes(server):
    size = 16384
    value = HEADER_SIZE + size
    limit = 5 * value
    tier = await open_tier(server.url, max_inflight_bytes=limit)
    inflight = peak = 0
    orig = tier._roundtrip

    async def spy(node, chunks, n, on_reply, deadline):
        nonlocal inflight, peak
        sent = sum(len(c) for c in chunks if isinstance(c, memoryview)) + n * HEADER_SIZE
        inflight += sent
        peak = max(peak, inflight)
        try:
            await asyncio.sleep(0.002)                           # hold the bytes long enough to overlap
            return await orig(node, chunks, n, on_reply, deadline)
        finally:
            inflight -= sent

    tier._roundtrip = spy
    sizes = [1, 2, 12, 3, 1, 7, 2, 4, 1, 5, 2, 9]
    jobs = []
    base = 0
    for k in sizes:
        idents = idents_for(k, base=base)
        jobs.append(tier.put(tier.page_keys(idents), idents, pages(k, size, seed=base)))
        base += k
    assert await asyncio.gather(*jobs) == sizes
    st = tier.stats()
    assert peak <= limit and st["inflight_peak_bytes"] <= limit and st["inflight_bytes"] == 0
    assert peak > 2 * value                                      # puts did overlap
    assert st["round_trips"] == sum(-(-k // 5) for k in sizes)  # 12 pages -> 3 pipelines, 7 -> 2 ...
    assert st["stored"] == sum(sizes)

    # a page larger than the bound goes alone
    small = await open_tier(server.url, max_inflight_bytes=1000)
    idents = idents_for(3, base=500)
    assert await small.put(small.page_keys(idents), idents, pages(3, 4096)) == 3
    assert small.stats()["round_trips"] == 3 and small.stats()["inflight_peak_bytes"] == HEADER_SIZE + 4096
    await small.close()
    await tier.close()


# ---- settings --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, field", [
    ({}, "url"),
    ({"url": "http://127.0.0.1:6379"}, "url"),
    ({"url": "redis://"}, "url"),
    ({"url": "redis://127.0.0.1:99999/0"}, "url"),
    ({"url": 6379}, "url"),
    ({"url": "redis://127.0.0.1:6379/abc"}, "url"),
    ({"url": "redis://127.0.0.1:6379/0?socket_timeout=x"}, "url"),
    ({"url": "unix:///tmp/redis.sock", "cluster": True}, "url"),
    ({"url": "redis://127.0.0.1:7000/3", "cluster": True}, "url"),
    ({"urls": []}, "urls"),
    ({"urls": "redis://127.0.0.1:7000"}, "urls"),
    ({"urls": ["redis://127.0.0.1:7000", "ftp://127.0.0.1:7001"]}, "urls[1]"),
    ({"url": "redis://127.0.0.1:1", "urls": ["redis://127.0.0.1:7000"]}, "urls"),
    ({"cluster": "yes"}, "cluster"),
    ({"namespace": ""}, "namespace"),
    ({"namespace": "a b"}, "namespace"),
    ({"namespace": "tag{x}"}, "namespace"),
    ({"namespace": 5}, "namespace"),
    ({"ttl_ms": 0}, "ttl_ms"),
    ({"ttl_ms": 1.5}, "ttl_ms"),
    ({"ttl_ms": True}, "ttl_ms"),
    ({"max_inflight_bytes": 0}, "max_inflight_bytes"),
    ({"max_inflight_bytes": "1GiB"}, "max_inflight_bytes"),
    ({"connect_timeout": 0}, "connect_timeout"),
    ({"connect_timeout": "1"}, "connect_timeout"),
    ({"op_timeout": -1}, "op_timeout"),
    ({"op_timeout": float("nan")}, "op_timeout"),
    ({"breaker_failures": 0}, "breaker_failures"),
    ({"breaker_failures": 2.0}, "breaker_failures"),
    ({"breaker_cooldown": float("inf")}, "breaker_cooldown"),
    ({"url": "redis://127.0.0.1:1/0?foo=bar"}, "url"),      # redis-py reads the query at connect (review find)
])
async def test_bad_settings_are_config_errors_naming_the_field(kw, field):
    kw = dict(kw)
    if "url" not in kw and "urls" not in kw and field != "url":
        kw["url"] = "redis://127.0.0.1:1/0"
    with pytest.raises(ConfigError) as e:
        await RemoteTier.open(RemoteSettings(**kw), FP)
    assert e.value.field == f"tiers.remote.{field}"
    assert f"tiers.remote.{field}" in str(e.value)


async def test_bad_fingerprint_is_a_usage_error():
    with pytest.raises(UsageError):
        await RemoteTier.open(RemoteSettings(url="redis://127.0.0.1:1/0"), b"")

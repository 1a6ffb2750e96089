"""The remote tier's bandwidth against the raw limit of the same client.

A throwaway ``redis-server`` on loopback; pages written with ``RemoteTier.put``
and read with ``RemoteTier.get`` (headers, checksums, key digests, the copy
into the destination rows) against pipelined ``SET`` / ``GET`` of the same
bytes under the same keys' sizes with the same redis-py client, in the same
run. Best of a few rounds each, alternated, because the server shares the
machine's cores with the client.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import tempfile
import time

import numpy as np

from tiers.remote import SEND_PIECE_BYTES, RemoteSettings, RemoteTier, block_key_bytes

from ..store import Store

from .redis_servers import REDIS_SERVER, RedisServer

SIZES = ((64 << 10, 512), (2 << 20, 32))        # (page bytes, pages per round): 32 and 64 MiB
SHARED_TIERS = (2048, 8192)                     # each worker's GPU and host blocks in the shared replay row


async def _raw(url: str, pages: np.ndarray, rounds: int) -> tuple[float, float]:
    """Best put and get GB/s of pipelined SET / GET of ``pages`` (one pipeline each)."""
    import redis.asyncio as redis
    client = redis.Redis.from_url(url)
    values = [bytes(p) for p in pages]
    keys = [b"raw:%d" % i for i in range(len(values))]
    best_put = best_get = 0.0
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for k, v in zip(keys, values):
                pipe.set(k, v)
            await pipe.execute()
            best_put = max(best_put, pages.nbytes / 1e9 / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            got = await client.mget(keys)
            best_get = max(best_get, pages.nbytes / 1e9 / (time.perf_counter() - t0))
            assert all(g == v for g, v in zip(got, values))
        await client.delete(*keys)
    finally:
        await client.aclose()
    return best_put, best_get


async def _raw_pieces(url: str, pages: np.ndarray, rounds: int) -> float:
    """Best put GB/s of the same SETs (no header, no checksum) packed by the same client and
    sent on one connection in writes of about SEND_PIECE_BYTES, then every reply read: the
    transport kvtier's put uses, without kvtier (a plain pipeline joins its whole payload
    into one bytes object before sending, a slower limit)."""
    import redis.asyncio as redis
    client = redis.Redis.from_url(url)
    values = [bytes(p) for p in pages]
    keys = [b"raw:%d" % i for i in range(len(values))]
    best = 0.0
    try:
        for _ in range(rounds):
            conn = await client.connection_pool.get_connection("SET")
            try:
                t0 = time.perf_counter()
                chunks = conn.pack_commands([("SET", k, v) for k, v in zip(keys, values)])
                start, size = 0, 0
                for i, c in enumerate(chunks):
                    size += len(c)
                    if size >= SEND_PIECE_BYTES or i == len(chunks) - 1:
                        await conn.send_packed_command(chunks[start:i + 1], check_health=False)
                        start, size = i + 1, 0
                for _ in values:
                    await conn.read_response()
                best = max(best, pages.nbytes / 1e9 / (time.perf_counter() - t0))
            finally:
                await client.connection_pool.release(conn)
        await client.delete(*keys)
    finally:
        await client.aclose()
    return best


async def _ours(url: str, pages: np.ndarray, rounds: int) -> tuple[float, float]:
    tier = await RemoteTier.open(RemoteSettings(url=url, namespace="bench", ttl_ms=600_000,
                                                max_inflight_bytes=max(256 << 20, pages.nbytes),
                                                op_timeout=30.0), b"bench-layout")
    idents = [(block_key_bytes(i + 1), 0) for i in range(len(pages))]
    keys = tier.page_keys(idents)
    out = np.empty_like(pages)
    best_put = best_get = 0.0
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            stored = await tier.put(keys, idents, pages)
            best_put = max(best_put, pages.nbytes / 1e9 / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            ok = await tier.get(keys, idents, out)
            best_get = max(best_get, pages.nbytes / 1e9 / (time.perf_counter() - t0))
            assert stored == len(pages) and all(ok) and np.array_equal(out, pages)
    finally:
        await tier.close()
    return best_put, best_get


async def remote_rows(rounds: int = 3) -> list[dict]:
    """Put and get rows at 64 KiB and 2 MiB pages; none when redis-server is not installed."""
    if REDIS_SERVER is None:
        return []
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-redis-") as d:
        with RedisServer(d) as server:
            for page, n in SIZES:
                pages = np.random.default_rng(page).integers(0, 256, (n, page), dtype=np.uint8)
                raw_put, raw_get = await _raw(server.url, pages, rounds)
                raw_put = max(raw_put, await _raw_pieces(server.url, pages, rounds))
                put, get = await _ours(server.url, pages, rounds)
                size = f"{page >> 20} MiB" if page >= 1 << 20 else f"{page >> 10} KiB"
                for what, ours, raw, limit in (
                        ("put (write-through)", put, raw_put, "pipelined SETs (best of one write and pieces), same client"),
                        ("get (promotion)", get, raw_get, "one MGET, same client")):
                    rows.append({"bench": f"remote {what}, {size} pages", "value": round(ours, 3), "unit": "GB/s",
                                 "baseline": round(raw, 3), "baseline_is": limit, "ratio": round(ours / raw, 4)})
    return rows


async def _worker(url: str | None, trace: str, limit: int, part: int, parts: int, scale: int) -> dict:
    """One store's share of the trace (every ``parts``-th request from ``part``), metadata
    first, with the remote tier at ``url`` (None: none); its hit rate by tier."""
    from .bench_core import _config
    from .replay import replay
    from .trace import read_trace
    requests, _ = read_trace(trace, limit)
    cfg = _config(tuple(t * scale for t in SHARED_TIERS), None)
    if url is not None:
        cfg = dataclasses.replace(cfg, remote=RemoteSettings(url=url, namespace="bench", model="bench",
                                                             op_timeout=5.0))
    async with Store.open(cfg) as store:
        res = await replay(store, requests[part::parts], content=False, verify=False)
    return {"blocks": res.blocks, "hit_blocks": res.hit_blocks, "by_tier": dict(res.hit_by_tier),
            "errors": dict(res.errors)}


def shared_replay_row(trace: str, limit: int | None = 3000) -> dict | None:
    """The trace split between two store processes sharing one server, against one store
    of the same total capacity (no server) replaying it all: hit rates."""
    if REDIS_SERVER is None:
        return None
    here = [sys.executable, "-m", "runtime.tools.bench_remote", "worker"]
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-redis-") as d, RedisServer(d) as server:
        procs = [subprocess.Popen(here + [server.url, trace, str(limit or 0), str(i), "2", "1"],
                                  stdout=subprocess.PIPE, text=True) for i in range(2)]
        shared = [json.loads(p.communicate(timeout=1800)[0].strip().splitlines()[-1]) for p in procs]
    single = asyncio.run(_worker(None, trace, limit or 0, 0, 1, 2))
    alone = [asyncio.run(_worker(None, trace, limit or 0, i, 2, 1)) for i in range(2)]
    rate = lambda r: round(r["hit_blocks"] / max(1, r["blocks"]), 4)
    return {"bench": "remote: trace split over two stores sharing one server", "value": [rate(r) for r in shared],
            "unit": "hit rate", "baseline": rate(single), "baseline_is": "one store of both stores' capacity",
            "ratio": round(sum(r["hit_blocks"] for r in shared) / max(1, single["hit_blocks"]), 4),
            "remote_hits": [r["by_tier"].get("remote", 0) for r in shared],
            "without_server": [rate(r) for r in alone]}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        url, trace, limit, part, parts, scale = sys.argv[2:8]
        print(json.dumps(asyncio.run(_worker(url, trace, int(limit) or None, int(part), int(parts), int(scale)))))
    else:
        from .bench import default_trace
        print(json.dumps(asyncio.run(remote_rows()) + [shared_replay_row(default_trace())], indent=1))

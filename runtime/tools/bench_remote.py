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
import tempfile
import time

import numpy as np

from tiers.remote import RemoteSettings, RemoteTier, block_key_bytes

from .redis_servers import REDIS_SERVER, RedisServer

SIZES = ((64 << 10, 512), (2 << 20, 32))        # (page bytes, pages per round): 32 and 64 MiB


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
                put, get = await _ours(server.url, pages, rounds)
                size = f"{page >> 20} MiB" if page >= 1 << 20 else f"{page >> 10} KiB"
                for what, ours, raw in (("put (write-through)", put, raw_put), ("get (promotion)", get, raw_get)):
                    rows.append({"bench": f"remote {what}, {size} pages", "value": round(ours, 3), "unit": "GB/s",
                                 "baseline": round(raw, 3), "baseline_is": "pipelined SET/GET, same client",
                                 "ratio": round(ours / raw, 4)})
    return rows


if __name__ == "__main__":
    import json
    print(json.dumps(asyncio.run(remote_rows()), indent=1))

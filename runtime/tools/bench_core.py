"""Control-plane benchmarks of the native core, each a ratio against a
reference measured in the same run (never a timed test):

- replays of a trace metadata-first through GPU-only stores (nothing
  evicted; 4096 blocks, evicting) and through three tiers with fsync on, in
  blocks/s against the bare LRU prefix cache of the same total capacity,
  and the three-tier replay's movement floor (``bench.movement_seconds``);
- metadata bytes per indexed page: process RSS growth over a million
  committed pages (page bytes excluded: the slab is allocated at open);
- how long one 4096-block request holds the event loop, fresh and cached;
- replay throughput at concurrency 32 against concurrency 1, with loop lag;
- reopening a disk tier of many pages: seconds, and the longest loop stall;
- KV events on (published on a loopback ZMQ socket) against the same replay
  with events off;
- the disk tier's spills beside a thread running Python (what a busy event
  loop is to the disk threads) against the same spills alone.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import sys
import tempfile
import threading
import time
from typing import AsyncIterator, Sequence

import numpy as np

from tiers.config import DiskConfig, EventsConfig, GpuConfig, HostConfig, StoreConfig
from tiers.layers import LayerSpec

from ..lag import LoopLagMonitor
from ..store import Store
from .bench import _best_replay, floor_fields, floor_row
from .oracle import LruPrefixCache
from .replay import replay
from .trace import TraceRequest

PAGE = (("k", 2048), ("v", 2048))       # 4 KiB pages, as the three-tier row


def _config(tiers: Sequence[int], directory: str | None, fsync: bool = False, page=PAGE,
            tpb: int = 512, events: EventsConfig | None = None, write: str = "back",
            host_write: str = "back") -> StoreConfig:
    g = tiers[0]
    h = tiers[1] if len(tiers) > 1 else None
    d = tiers[2] if len(tiers) > 2 else None
    return StoreConfig(layers=[LayerSpec(0, page)], tokens_per_block=tpb,
                       gpu=GpuConfig(slots=g, device="auto"),
                       host=HostConfig(slots=h, write=host_write) if h else None,
                       disk=DiskConfig(path=directory, slots=d, fsync=fsync, write=write) if d else None,
                       persist_on_close=False, events=events)


@contextlib.asynccontextmanager
async def _fresh_store(tiers: Sequence[int], directory: str, **cfg) -> AsyncIterator[Store]:
    """A store of ``tiers`` (``_config``'s other settings in ``cfg``) on a directory of its own,
    removed when the store closes (a full run kept about 8 GB of segments), collected first."""
    with tempfile.TemporaryDirectory(dir=directory) as sub:
        async with Store.open(_config(tiers, sub, **cfg)) as store:
            gc.collect()
            yield store


def _bare(requests: Sequence[TraceRequest], capacity: int) -> float:
    """Best blocks/s of three fresh bare-LRU replays of ``requests``."""
    return _best_replay(lambda: LruPrefixCache(capacity), requests)[1]


async def replay_row(name: str, requests: Sequence[TraceRequest], tiers: Sequence[int], directory: str,
                     fsync: bool = False, concurrency: int = 1, rounds: int = 3) -> dict:
    """The store against the bare LRU of the same total capacity, each the best of
    ``rounds`` replays on a fresh cache (the same rule for both: this machine drifts)."""
    bare = _bare(requests, sum(tiers))
    ours, res = -1.0, None
    for _ in range(rounds):
        async with _fresh_store(tiers, directory, fsync=fsync) as store:
            r = await replay(store, requests, content=False, verify=False, concurrency=concurrency)
            device = store.device
        if r.blocks / r.seconds > ours:
            ours, res = r.blocks / r.seconds, r
    row = {"bench": name, "value": round(ours), "unit": "blocks/s", "baseline": round(bare),
           "baseline_is": "bare LRU prefix cache", "ratio": round(ours / bare, 4),
           "hit_rate": round(res.hit_blocks / max(1, res.blocks), 4), "loop_lag_ms": res.loop_lag_ms,
           "errors": dict(res.errors)}
    if len(tiers) > 1:
        row.update(floor_fields(res, device, directory, bare, durable=fsync))
    return row


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def metadata_row(n_pages: int = 1 << 20) -> dict:
    """``metadata_in_process`` in a fresh interpreter: the heap of the rows
    run before it would absorb (and hide) the growth it measures."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "runtime.tools.bench_core", "metadata", str(n_pages),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"metadata benchmark failed: {err.decode(errors='replace')[-2000:]}")
    return json.loads(out)


async def metadata_in_process(n_pages: int, per_request: int = 512) -> dict:
    """RSS growth per committed, indexed page (one life cycle, GPU tier
    large enough that nothing is evicted; 16-byte pages so the slab is small
    and allocated before the first reading). The core's tables grow as they
    fill here: a store writes them for up to a million pages when it opens
    (``store.CORE_PREFAULT_PAGES``), which would hide the growth."""
    from .. import store as store_module
    cfg = _config((n_pages,), None, page=(("k", 8), ("v", 8)))
    saved, store_module.CORE_PREFAULT_PAGES = store_module.CORE_PREFAULT_PAGES, 0
    try:
        store = await Store.open(cfg)
    finally:
        store_module.CORE_PREFAULT_PAGES = saved
    try:
        await _requests(store, 0, per_request, per_request)        # warm up allocators and code paths
        before = _rss()
        done = per_request
        while done < n_pages:
            n = min(per_request, n_pages - done)
            await _requests(store, done, n, per_request)
            done += n
        after = _rss()
        pages = store.stats()["core"]["live_pages"]
    finally:
        await store.close()
    per = (after - before) / max(1, pages - per_request)
    return {"bench": f"core: metadata per indexed page ({pages:,} pages)", "value": round(per, 1), "unit": "B",
            "baseline": None, "baseline_is": "", "ratio": None}


async def _requests(store: Store, first_key: int, n_blocks: int, per_request: int) -> None:
    keys = list(range(first_key + 1, first_key + n_blocks + 1))
    seq = await store.open_sequence(block_keys=keys)
    await seq.extend(len(keys))
    seq.commit(len(keys))
    await seq.close()


class _HoldWatcher:
    """The longest time the loop went without running this watcher, which yields at every
    turn (``sleep(0)``): the longest run of other callbacks between two of its turns, plus any
    wait of the loop's thread for the GIL meanwhile. A timer ticker measures that only to its
    timer's grain: on this VM a 1 ms ticker on an idle loop read up to 0.7-1.4 ms late
    (uvloop's timers count whole milliseconds). The watcher keeps the loop busy, so a worker
    thread that needs the GIL (the request's token hashing) gets it less often and runs longer
    than it would: a measure of the loop's hold, not of the request's duration."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._task: asyncio.Task | None = None

    async def _watch(self) -> None:
        clock = time.perf_counter
        last = clock()
        while True:
            await asyncio.sleep(0)
            now = clock()
            if now - last > self.longest:
                self.longest = now - last
            last = now

    def start(self) -> "_HoldWatcher":
        self._task = asyncio.ensure_future(self._watch())
        return self

    async def stop(self) -> float:
        """The longest gap seen, in ms."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        return self.longest * 1e3


async def loop_hold_rows(n_blocks: int = 4096, tpb: int = 32, rounds: int = 5) -> list[dict]:
    """The longest the loop was held while one request of ``n_blocks`` blocks (tokens, so
    hashing counts) runs: fresh (every block extended) and cached (every block a GPU hit),
    each the worst of ``rounds``, measured by a watcher that yields at every loop turn
    (``_HoldWatcher``), after one unmeasured request of each kind (first calls: the hashing
    worker thread starts, code paths warm up). The baseline is the same watcher on the idle
    loop for as long: what this machine's scheduling alone shows."""
    cfg = _config((2 * n_blocks,), None, page=(("k", 64), ("v", 64)), tpb=tpb)
    out = []
    async with Store.open(cfg) as store:
        warm = list(range(-n_blocks * tpb, 0))
        await _token_request(store, warm)           # fresh ...
        await _token_request(store, warm)           # ... and cached
        await _evict_all(store)
        for label, cached in (("fresh", False), ("gpu-cached", True)):
            worst = idle = 0.0
            for r in range(rounds):
                tokens = list(range(r * n_blocks * tpb, (r + 1) * n_blocks * tpb))
                if cached:
                    await _token_request(store, tokens)
                gc.collect()            # earlier rows' garbage is not collected on this clock
                await asyncio.sleep(0.01)
                watch = _HoldWatcher().start()
                t0 = time.perf_counter()
                await _token_request(store, tokens)
                took = time.perf_counter() - t0
                worst = max(worst, await watch.stop())
                watch = _HoldWatcher().start()
                await asyncio.sleep(took)
                idle = max(idle, await watch.stop())
                if not cached:      # make room for the next round
                    await _evict_all(store)
            out.append({"bench": f"core: loop held by one {n_blocks}-block request ({label}, max of {rounds})",
                        "value": round(worst, 2), "unit": "ms", "baseline": round(idle, 2),
                        "baseline_is": f"idle loop {idle:.2f} ms (this machine's scheduling alone)", "ratio": None})
            await _evict_all(store)
    return out


async def _token_request(store: Store, tokens: list[int]) -> None:
    seq = await store.open_sequence(tokens=tokens)
    await seq.acquire()
    await seq.extend(len(seq.keys) - seq.num_blocks)
    seq.commit(len(seq.keys))
    await seq.release()
    await seq.close()


async def _evict_all(store: Store) -> None:
    """Drop every page of a GPU-only store (its queue's victims, dropped)."""
    core = store.core
    n = core.queue_len(0, 0)
    if n:
        victims = store.moves.pick_victims(0, 0, n)
        core.give_back(0, 0, await store.moves.evict(0, victims))


async def concurrency_rows(requests: Sequence[TraceRequest], tiers: Sequence[int], directory: str,
                           rounds: int = 3) -> list[dict]:
    """Replay throughput at concurrency 32 against concurrency 1 (three tiers): ``rounds``
    pairs of fresh replays, each pair back to back, its order alternating (this VM's speed
    drifts by tens of percent over a minute, in phases longer than a replay). The ratio is the
    median of the pairs' ratios: the best of each side, the rule before, took each from whichever
    phase was fastest for it and swung from 0.65 to 1.18 on the same code. Beside it, the
    median pair's throughputs, and the loop lag p99 of its replay at 32."""
    pairs: list[tuple[float, float, object]] = []
    for i in range(rounds):
        got = {}
        for c in ((1, 32) if i % 2 == 0 else (32, 1)):
            async with _fresh_store(tiers, directory) as store:
                got[c] = await replay(store, requests, content=False, verify=False, concurrency=c)
        pairs.append((got[1].blocks / got[1].seconds, got[32].blocks / got[32].seconds, got[32]))
    pairs.sort(key=lambda p: p[1] / p[0])
    one, many, r32 = pairs[len(pairs) // 2]
    ratios = [round(m / o, 3) for o, m, _ in pairs]
    rows = [{"bench": "core: three-tier replay at concurrency 32", "value": round(many), "unit": "blocks/s",
             "baseline": round(one), "baseline_is": "the same replay at concurrency 1; "
             + (f"the median of {len(pairs)} pairs: {', '.join(map(str, ratios))}" if len(pairs) > 1 else "one pair"),
             "ratio": round(many / one, 3)}]
    lag = r32.loop_lag_ms
    rows.append({"bench": "core: loop lag p99 at concurrency 32", "value": lag.get("p99"), "unit": "ms",
                 "baseline": None, "baseline_is": f"max {lag.get('max')} ms", "ratio": None})
    return rows


async def reopen_row(directory: str, n_pages: int) -> dict:
    """Fill a disk tier with ``n_pages`` committed pages, close, and time
    reopening it (index rebuilt from the journal) with a ticker watching
    the loop."""
    page = (("k", 8), ("v", 8))
    gpu = 8192
    cfg = StoreConfig(layers=[LayerSpec(0, page)], tokens_per_block=16, gpu=GpuConfig(slots=gpu, device="auto"),
                      disk=DiskConfig(path=directory, slots=n_pages + gpu, fsync=False), persist_on_close=True)
    async with Store.open(cfg) as store:
        per = gpu // 2
        for first in range(0, n_pages, per):
            await _requests(store, first, min(per, n_pages - first), per)
    lag = LoopLagMonitor(0.001).start()
    t0 = time.perf_counter()
    async with Store.open(cfg) as store:
        secs = time.perf_counter() - t0
        await lag.stop()
        recovered = store.stats()["recovered_pages"]
    return {"bench": f"core: reopen a disk tier of {recovered:,} pages", "value": round(secs, 3), "unit": "s",
            "baseline": None, "baseline_is": f"loop stalled at most {lag.percentiles_ms()['max']} ms",
            "ratio": None, "loop_max_ms": lag.percentiles_ms()["max"], "recovered": recovered}


def _spills(directory: str, batches: int, busy: bool, page: int = 4096, per: int = 600) -> float:
    """MB/s of ``batches`` spills of ``per`` scattered host rows each, written (fsync on, group
    commit) over a disk a few batches larger than what they keep live, each batch freeing
    the one written a lap before, as a full disk's spills do. ``busy``: beside a thread
    spinning in Python, the whole time."""
    from tiers.disk import DiskTier
    from tiers.journal import RECORD, TAG_NONE
    rng = np.random.default_rng(7)
    slab = rng.integers(0, 256, (16 * per, page), dtype=np.uint8)
    lap = 24
    stop = threading.Event()

    def spin() -> None:                 # Python bytecode, never blocking: the GIL's worst neighbour
        while not stop.is_set():
            pass
    spinner = threading.Thread(target=spin, name="kvtier-bench-spin")
    with tempfile.TemporaryDirectory(dir=directory) as sub:
        tier = DiskTier.open(sub, {"bench": "spills"}, [(page, (lap + 2) * per)], fsync=True)
        try:
            if busy:
                spinner.start()
            t0 = time.perf_counter()
            for b in range(batches):
                at = (b % (lap + 2)) * per
                if b >= lap:
                    done = ((b - lap) % (lap + 2)) * per
                    tier.free(0, list(range(done, done + per)))
                recs = np.zeros(per, RECORD)
                recs["key_lo"], recs["ptag"] = np.arange(b * per, (b + 1) * per), TAG_NONE
                tier.write(0, list(range(at, at + per)), slab, recs, index=rng.integers(0, len(slab), per),
                           durable=False)
            tier.flush()
            seconds = time.perf_counter() - t0
        finally:
            stop.set()
            if busy:
                spinner.join()
            tier.close()
    return batches * per * page / 1e6 / seconds


async def disk_contention_row(directory: str, batches: int = 160, rounds: int = 2) -> dict:
    """The disk tier's spills beside a thread running Python against the same spills alone,
    alternated, best of ``rounds`` each. A disk thread's bookkeeping that gives the GIL up
    (numpy does past 500 elements) waits up to the switch interval (5 ms) to get it back
    while the loop runs Python: each spill then pays that for every such step, not once for
    its I/O."""
    best = {False: 0.0, True: 0.0}
    for _ in range(rounds):
        for busy in (False, True):
            best[busy] = max(best[busy], await asyncio.to_thread(_spills, directory, batches, busy))
    return {"bench": "core: disk spills beside a thread running Python (4 KiB pages, fsync on)",
            "value": round(best[True]), "unit": "MB/s", "baseline": round(best[False]),
            "baseline_is": "the same spills alone", "ratio": round(best[True] / best[False], 4)}


async def events_rows(requests: Sequence[TraceRequest], rounds: int = 2) -> list[dict]:
    """Replays with KV events on (batches published on a loopback PUB socket) against
    the same replays with events off, alternated, best of ``rounds`` each: the
    events' whole cost on the loop and in the publisher's thread."""
    rows = []
    for tiers, what in (((4096,), "GPU-only 4096 blocks (evicting)"), ((4096, 16384), "GPU 4096 + host 16384")):
        best = {False: 0.0, True: 0.0}
        published = 0
        for _ in range(rounds):
            for on in (False, True):
                ev = EventsConfig(endpoint="tcp://127.0.0.1:*") if on else None
                async with Store.open(_config(tiers, None, events=ev)) as store:
                    res = await replay(store, requests, content=False, verify=False)
                    if on:
                        store.kv_events.flush()
                        published = store.stats()["events"]["events"]
                best[on] = max(best[on], res.blocks / res.seconds)
        rows.append({"bench": f"core: replay with KV events on, {what}", "value": round(best[True]),
                     "unit": "blocks/s", "baseline": round(best[False]), "baseline_is": "same replay, events off",
                     "ratio": round(best[True] / best[False], 4), "events": published})
    return rows


async def write_through_row(requests: Sequence[TraceRequest], directory: str, rounds: int = 2,
                            tier: str = "disk") -> dict:
    """The three-tier replay (fsync on) with the ``tier``'s write = "through" against write =
    "back", alternated, best of ``rounds`` each: what keeping clean copies there costs (every
    committed page also copied once) and saves (demotions onto a copy move no bytes)."""
    tiers = (4096, 16384, 65536)
    key, down = ("write_through", "host->disk") if tier == "disk" else ("host_write_through", "gpu->host")
    best = {"back": 0.0, "through": 0.0}
    moved = {"back": 0, "through": 0}
    wt: dict = {}
    for _ in range(rounds):
        for write in ("back", "through"):
            kw = {"write": write} if tier == "disk" else {"host_write": write}
            async with _fresh_store(tiers, directory, fsync=True, **kw) as store:
                res = await replay(store, requests, content=False, verify=False)
                st = store.stats()
                moved[write] = st["moves"].get(down, {}).get("pages", 0)
                if write == "through":
                    wt = st[key]
            best[write] = max(best[write], res.blocks / res.seconds)
    return {"bench": f"core: three-tier replay, {tier} write = through (fsync on)", "value": round(best["through"]),
            "unit": "blocks/s", "baseline": round(best["back"]), "baseline_is": "same replay, write = back",
            "ratio": round(best["through"] / best["back"], 4), "copied_pages": wt.get("copied_pages", 0),
            "free_demotions": wt.get("free_demotions", 0), "kept_on_promotion": wt.get("kept_on_promotion", 0),
            f"{down.replace('->', '_to_')}_pages": moved}


async def control_plane_rows(requests: Sequence[TraceRequest], directory: str, quick: bool = False) -> list[dict]:
    rows = [
        await replay_row("core: GPU-only replay, nothing evicted", requests, (400_000,), directory),
        await replay_row("core: GPU-only replay, 4096 blocks (evicting)", requests, (4096,), directory),
        await replay_row("core: three-tier replay 4096/16384/65536, fsync on", requests, (4096, 16384, 65536),
                         tempfile.mkdtemp(dir=directory), fsync=True),
    ]
    rows += floor_row(rows[-1], "core: three-tier replay 4096/16384/65536, fsync on: movement floor "
                                "(store at {share:.3f} of it)")
    rows.append(await metadata_row(1 << 17 if quick else 1 << 20))
    rows += await loop_hold_rows(rounds=2 if quick else 5)
    rows += await concurrency_rows(requests, (4096, 16384, 65536), directory, rounds=1 if quick else 3)
    rows.append(await reopen_row(tempfile.mkdtemp(dir=directory), 100_000 if quick else 1_000_000))
    rows += await events_rows(requests, rounds=1 if quick else 2)
    for tier in ("disk", "host"):
        rows.append(await write_through_row(requests, directory, rounds=1 if quick else 2, tier=tier))
    rows.append(await disk_contention_row(directory, batches=60 if quick else 160, rounds=1 if quick else 2))
    return rows


if __name__ == "__main__":        # python -m runtime.tools.bench_core metadata N (metadata_row runs it)
    from .cli import tune_gc
    tune_gc()
    if len(sys.argv) != 3 or sys.argv[1] != "metadata":
        sys.exit("usage: python -m runtime.tools.bench_core metadata N_PAGES")
    print(json.dumps(asyncio.run(metadata_in_process(int(sys.argv[2])))))

"""``kvtier bench``: the store's data and control paths as ratios against
raw limits measured in the same run, on the same machine.

- ``gpu->host`` / ``host->gpu``: pages moved by the migration engine (batches
  of 64, as concurrent requests produce them) against one plain tensor copy of
  the same bytes between the same two memories; ``scattered``: each batch's
  pages lie all over the GPU slab, as demoted pages do.
- ``host->disk`` / ``disk->host``: spill and recall through the engine and the
  disk tier (checksums, journal, fdatasync per batch) against a plain
  sequential file write (+fdatasync) and read of the same bytes.
- ``replay``: the control plane (metadata-first replay, pages of a few KiB)
  against the bare LRU prefix cache, in blocks per second; beside it two
  bounds that are not kvtier: the same tiered LRU with only its bookkeeping
  (``TieredLruBound``), and the replay's page moves at raw speed.
- ``loop lag``: event-loop lag p99 and max (the longest stall) while the moves run.
"""
from __future__ import annotations

import asyncio
import gc
import os
import random
import tempfile
import time

import torch
import xxhash

from tiers.config import DiskConfig, GpuConfig, HostConfig, StoreConfig
from tiers.errors import CorruptPageError, UsageError
from tiers.layers import LayerSpec

from ..core import Pages
from ..lag import LoopLagMonitor
from ..pages import DISK, GPU, HOST
from ..store import Store
from .demo import bundled_trace
from .oracle import LruPrefixCache, TieredLruBound
from .replay import replay
from .trace import read_trace, report_skipped

BATCH = 64


def _gbps(nbytes: int, secs: float) -> float:
    return nbytes / secs / 1e9 if secs > 0 else 0.0


async def _move_all(store: Store, pages, dst: int) -> float:
    """Move ``pages`` (one pool group's ``Pages``) to tier ``dst`` in
    concurrent batches; seconds taken."""
    t0 = time.perf_counter()
    jobs = []
    core = store.core
    for i in range(0, len(pages), BATCH):
        chunk = pages.slice(i, i + BATCH)
        (g, n), = core.group_counts(chunk, dst)
        slots = core.allocate(dst, g, n)
        store.moves.claim(chunk, dst)
        jobs.append(store.moves.move(chunk, dst, {g: slots}, handoff=False))
    await asyncio.gather(*jobs)
    return time.perf_counter() - t0


async def _fill(store: Store, n_blocks: int) -> list:
    seq = await store.open_sequence(block_keys=list(range(1, n_blocks + 1)))
    await seq.extend(n_blocks)
    gpu = store.slabs[GPU][0].tensor
    gpu.copy_(torch.randint(0, 256, gpu.shape, dtype=torch.uint8, device=gpu.device))
    seq.commit(n_blocks)
    await seq.close()
    return store.core.tier_pages(GPU, 0)


def _raw_copy(nbytes: int, device: torch.device, pinned: bool) -> tuple[float, float]:
    """GB/s of one large copy device->host and host->device."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = []
    for a, b in ((dst, src), (src, dst)):
        a.copy_(b, non_blocking=True)
        sync()
        t0 = time.perf_counter()
        for _ in range(3):
            a.copy_(b, non_blocking=True)
        sync()
        out.append(_gbps(3 * nbytes, time.perf_counter() - t0))
    return out[0], out[1]


def _raw_file(path: str, nbytes: int, chunk: int = 8 << 20, durable: bool = True,
              cached_reads: bool | None = None) -> tuple[float, float]:
    """GB/s of the best plain sequential write (+fdatasync) and read of
    ``nbytes``: buffered and O_DIRECT (where the filesystem takes it).
    Not ``durable``: buffered only, no fdatasync, reads from the page cache
    (what a tier with ``fsync=False`` gets at best). ``cached_reads`` (by
    default: not ``durable``): buffered reads of what was just written, from
    the page cache, as a tier reads back pages it spilled lately."""
    cached_reads = not durable if cached_reads is None else cached_reads
    import mmap
    buf = mmap.mmap(-1, chunk)            # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(chunk))
    best_w = best_r = 0.0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:                # allocated up front, as the disk tier's segments are: the rounds time writes, not allocation
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        pass
    finally:
        os.close(fd)
    for direct in (False, True, False, True) if durable else (False, False):     # best of two rounds
        flags = os.O_DIRECT if direct and hasattr(os, "O_DIRECT") else 0
        if direct and not flags:
            continue
        try:
            fd = os.open(path, os.O_WRONLY | flags)
        except OSError:
            continue
        try:
            t0 = time.perf_counter()
            for off in range(0, nbytes, chunk):
                os.pwritev(fd, [memoryview(buf)[:min(chunk, nbytes - off)]], off)
            if durable:
                os.fdatasync(fd)
            best_w = max(best_w, _gbps(nbytes, time.perf_counter() - t0))
        except OSError:
            continue
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY | (0 if cached_reads else flags))
        try:
            if not cached_reads:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            for off in range(0, nbytes, chunk):
                os.preadv(fd, [buf], off)
            best_r = max(best_r, _gbps(nbytes, time.perf_counter() - t0))
        finally:
            os.close(fd)
    os.unlink(path)
    return best_w, best_r


async def bench_moves(page_bytes: int, n_pages: int, directory: str, scattered: bool = False) -> list[dict]:
    """The four directions' rows for ``n_pages`` pages of ``page_bytes``.
    ``scattered``: each batch takes pages from all over the GPU slab (a
    seeded shuffle), as demotions of least recently used pages do, while its
    host slots stay runs; else batches are runs of slots on both sides."""
    half = page_bytes // 2
    # no reserves: background demotion would claim pages of the full GPU that the moves below claim
    cfg = StoreConfig(layers=[LayerSpec(0, (("k", half), ("v", half)))], tokens_per_block=16,
                      gpu=GpuConfig(slots=n_pages, device="auto", reserve=0), host=HostConfig(slots=n_pages, reserve=0),
                      disk=DiskConfig(path=directory, slots=n_pages, fsync=True, reserve=0), persist_on_close=False)
    nbytes = page_bytes * n_pages
    label, how = _size(page_bytes), ", scattered" if scattered else ""
    rows = []
    async with Store.open(cfg) as store:
        dev = store.device
        # the raw limits are measured before and after the store's moves, the best of both kept:
        # one measurement on a busy machine can come out below what the store then reaches
        before = _raw_copy(nbytes, dev.torch_device, dev.pin_host) + \
            _raw_file(os.path.join(directory, "raw.bin"), nbytes, chunk=BATCH * page_bytes)
        pages = await _fill(store, n_pages)
        written = _page_digests(store)
        if scattered:
            ids = pages.tolist()
            random.Random(0).shuffle(ids)
            pages = Pages(ids)
        await _move_all(store, pages, HOST)           # warm-up: fault the host slab in
        await _move_all(store, pages, GPU)
        lag = LoopLagMonitor(0.002).start()
        down = await _move_all(store, pages, HOST)
        store.slabs[GPU][0].tensor.fill_(0xA5)        # what comes back up must be copied there
        if dev.is_cuda:                                 # (on the current stream, not the copy streams')
            torch.cuda.synchronize(dev.torch_device)
        to_disk = await _move_all(store, pages, DISK)
        if store.disk is not None:
            await asyncio.to_thread(_drop_disk_cache, store)
        from_disk = await _move_all(store, pages, HOST)
        up = await _move_all(store, pages, GPU)
        await lag.stop()
        if _page_digests(store) != written:
            raise CorruptPageError(f"bench: {label}{how} pages moved through every tier came back changed")
        after = _raw_copy(nbytes, dev.torch_device, dev.pin_host) + \
            _raw_file(os.path.join(directory, "raw.bin"), nbytes, chunk=BATCH * page_bytes)
        raw_down, raw_up, raw_w, raw_r = map(max, before, after)
        where = "cuda" if dev.is_cuda else "cpu"
        for name, secs, raw, base in (("gpu->host", down, raw_down, f"one {where} tensor copy"),
                                      ("host->gpu", up, raw_up, f"one {where} tensor copy"),
                                      ("host->disk", to_disk, raw_w, "best sequential write+fdatasync"),
                                      ("disk->host", from_disk, raw_r, "best sequential read")):
            got = _gbps(nbytes, secs)
            rows.append({"bench": f"{name} {label} pages{how}", "value": round(got, 3), "unit": "GB/s",
                         "baseline": round(raw, 3), "baseline_is": base, "ratio": round(got / raw, 3) if raw else None})
        lag_ms = lag.percentiles_ms()
        for q in ("p99", "max"):
            rows.append({"bench": f"loop lag {q} during moves ({label}{how})", "value": lag_ms[q],
                         "unit": "ms", "baseline": None, "baseline_is": "", "ratio": None})
    return rows


def _page_digests(store: Store) -> dict[int, int]:
    """Page id -> digest of its bytes, for a full GPU tier (its pages listed in slot order)."""
    rows = store.slabs[GPU][0].tensor.cpu().numpy()
    ids = store.core.tier_pages(GPU, 0).tolist()
    if len(ids) != len(rows):
        raise CorruptPageError(f"bench: {len(ids)} pages in a GPU tier of {len(rows)} slots after the moves")
    return {page: xxhash.xxh3_64_intdigest(row) for page, row in zip(ids, rows)}


def _drop_disk_cache(store: Store) -> None:
    for name in os.listdir(store.cfg.disk.path):
        if name.endswith(".seg"):
            fd = os.open(os.path.join(store.cfg.disk.path, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


async def bench_replay(trace: str, limit: int | None, directory: str) -> dict:
    requests, problems = read_trace(trace, limit)
    report_skipped(trace, problems)
    if not requests:
        raise UsageError(f"no requests in trace {trace!r}")
    g, h, d = 4096, 16384, 65536
    oracle, bare = _best_replay(lambda: LruPrefixCache(g + h + d), requests)
    _, lean = _best_replay(lambda: TieredLruBound((g, h, d)), requests)
    cfg = StoreConfig(layers=[LayerSpec(0, (("k", 2048), ("v", 2048)))], tokens_per_block=512,
                      gpu=GpuConfig(slots=g, device="auto"), host=HostConfig(slots=h),
                      disk=DiskConfig(path=directory, slots=d, fsync=False), persist_on_close=False)
    async with Store.open(cfg) as store:
        res = await replay(store, requests, content=False, verify=False)
        device = store.device
    ours = res.blocks / res.seconds
    return {"bench": f"replay {os.path.basename(trace)} ({len(requests)} requests)", "value": round(ours),
            "unit": "blocks/s", "baseline": round(bare), "baseline_is": "bare LRU prefix cache",
            "ratio": round(ours / bare, 4), "hit_rate": round(res.hit_blocks / max(1, res.blocks), 4),
            "oracle_hit_rate": round(oracle.hits / max(1, oracle.lookups), 4),
            "lean_bound": round(lean), "lean_ratio": round(lean / bare, 4), "ratio_to_lean": round(ours / lean, 4),
            **floor_fields(res, device, directory, bare)}


def _best_replay(make, requests, rounds: int = 3) -> tuple:
    """(the reference after its last round, its best blocks/s of ``rounds``
    fresh replays): the references take a fraction of the store's time, and
    the best of a few is steadier against this machine's drift. A request
    a reference refuses (longer than its first tier; the store refuses it
    too) is skipped."""
    blocks = sum(len(r.hash_ids) for r in requests)
    best = 0.0
    for _ in range(rounds):
        ref = make()
        gc.collect()            # the garbage of what ran before is not collected on this clock
        t0 = time.perf_counter()
        for r in requests:
            try:
                ref.request(r.hash_ids)
            except ValueError:
                pass
        best = max(best, blocks / (time.perf_counter() - t0))
    return ref, best


def movement_seconds(moved: dict, device, directory: str, sample: int = 64 << 20, durable: bool = False) -> float:
    """Seconds the replay's page moves (``Store.stats()["moves"]``) take at
    the raw limits measured now, the copies and the disk each at full speed
    and overlapped: the longer of the copies' time (one large tensor copy
    for every byte that crosses between GPU and host memory) and the disk's
    (a plain sequential write for every byte spilled, with fdatasync if
    ``durable``, and a page-cache read for every byte recalled). No store
    can replay the trace faster than ``blocks / this``, bookkeeping aside."""
    if not moved:
        return 0.0
    down, up = _raw_copy(sample, device.torch_device, device.pin_host)
    write, read = _raw_file(os.path.join(directory, "floor.bin"), sample, durable=durable, cached_reads=True)
    if min(down, up, write, read) <= 0:
        return 0.0                      # a raw limit could not be measured here: no floor
    copies = disk = 0.0
    for d, m in moved.items():
        src, dst = d.split("->")
        b = m["bytes"]
        if "disk" in (src, dst):
            disk += b / 1e9 / (write if dst == "disk" else read)
        if "gpu" in (src, dst):
            copies += b / 1e9 / (up if dst == "gpu" else down)
    return max(copies, disk)


def floor_fields(res, device, directory: str, bare: float, durable: bool = False) -> dict:
    """A tiered replay row's movement floor (``movement_seconds``): blocks/s, its ratio to the
    bare LRU and the store's share of it; None each where nothing moved or no raw limit could be
    measured."""
    moving = movement_seconds(res.moved, device, directory, durable=durable)
    if moving <= 0:
        return {"movement_floor": None, "floor_ratio": None, "ratio_to_floor": None}
    floor = res.blocks / moving
    return {"movement_floor": round(floor), "floor_ratio": round(floor / bare, 4),
            "ratio_to_floor": round(res.blocks / res.seconds / floor, 4)}


def floor_row(replayed: dict, name: str) -> list[dict]:
    """The movement floor of a tiered replay row, as a row of its own (none without a floor);
    ``{share}`` in ``name`` becomes the store's share of it."""
    if replayed.get("movement_floor") is None:
        return []
    return [{"bench": name.format(share=replayed["ratio_to_floor"]), "value": replayed["movement_floor"],
             "unit": "blocks/s", "baseline": replayed["baseline"], "baseline_is": "bare LRU prefix cache",
             "ratio": replayed["floor_ratio"], "store_to_floor": replayed["ratio_to_floor"]}]


def default_trace() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    shared = os.path.join(here, "..", "..", "..", "shared", "traces", "conversation_trace.jsonl")
    return shared if os.path.exists(shared) else bundled_trace()


def run_bench(quick: bool = False, quiet: bool = True, trace: str | None = None,
              directory: str | None = None, core: bool = True) -> dict:
    """Every row; ``core``: also the control-plane rows of ``bench_core``."""
    from ..loop import run
    sizes = [(256 << 10, 256)] if quick else [(64 << 10, 2048), (256 << 10, 1024), (2 << 20, 256)]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-", dir=directory) as tmp:
        for page, n in sizes:
            sub = tempfile.mkdtemp(dir=tmp)
            rows += run(bench_moves(page, n, sub))
        if not quick:
            rows += run(bench_moves(64 << 10, 2048, tempfile.mkdtemp(dir=tmp), scattered=True))
        replayed = run(bench_replay(trace or default_trace(), 300 if quick else None, tempfile.mkdtemp(dir=tmp)))
        rows.append(replayed)
        rows.append({"bench": "replay lean bound (its tiered LRU, bookkeeping only)",
                     "value": replayed["lean_bound"], "unit": "blocks/s", "baseline": replayed["baseline"],
                     "baseline_is": "bare LRU prefix cache", "ratio": replayed["lean_ratio"]})
        rows += floor_row(replayed, "replay movement floor (its page moves at raw copy and page-cache speed)")
        from .bench_remote import remote_rows, shared_replay_row
        rows += run(remote_rows(rounds=2 if quick else 3))      # none without redis-server
        shared = shared_replay_row(trace or default_trace(), 1000 if quick else 3000)
        if shared is not None:
            rows.append(shared)
        if core:
            from .bench_core import control_plane_rows
            requests, _ = read_trace(trace or default_trace(), 2000 if quick else None)
            rows += run(control_plane_rows(requests, tempfile.mkdtemp(dir=tmp), quick=quick))
    return {"device": "cuda" if torch.cuda.is_available() else "cpu (emulated gpu)", "rows": rows}


def print_bench(out: dict) -> None:
    from .cli import _table
    rows = [[r["bench"], r["value"], r["unit"], "" if r["baseline"] is None else r["baseline"], r["baseline_is"],
             "" if r["ratio"] is None else f"{r['ratio']:.3g}x"] for r in out["rows"]]
    _table(f"kvtier bench on {out['device']}", ["bench", "value", "unit", "raw limit", "limit is", "ratio"], rows)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"

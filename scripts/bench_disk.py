#!/usr/bin/env python3
"""Disk tier throughput against the raw limits of the same filesystem.

For each cold page size, spills ``--gib`` GiB of pages through
``DiskTier.write`` in batches (the way the runtime moves them: ``--batch``
pages a call, ascending slots, durable when the call returns) and recalls them
through ``DiskTier.read`` (checksums verified). In the same run it writes the
same bytes as one plain sequential file (``pwrite`` of batch-sized chunks, one
fdatasync at the end) and reads it back, buffered and with O_DIRECT. Before
every read phase the page cache is dropped for the file being read
(``posix_fadvise(POSIX_FADV_DONTNEED)`` after its data is clean), the same
for both sides. Each measurement is repeated ``--repeat`` times, interleaved,
and the best run is kept (the disks of shared machines are noisy); files are
deleted only between rounds, followed by a sync and a pause (``--settle``).

Host buffers are page-aligned by default, as pinned host slabs are (an O_DIRECT
tier then reads and writes them in place); ``--torch-buffers`` uses torch's
allocator (64-byte aligned: the tier goes through bounce buffers).

Ratios compare with the *better* of the two baselines (buffered, O_DIRECT).

    python scripts/bench_disk.py --gib 1
    python scripts/bench_disk.py --gib 4 --sizes 256KiB,1MiB --json

``run_bench(gib, sizes, directory)`` is importable (``kvtier bench`` loads
this file by path); the module does nothing on import.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _disk_module():
    """``tiers.disk``, importable from a source checkout that is not installed."""
    try:
        import tiers.disk as disk
    except ImportError:
        sys.path.insert(0, _ROOT)
        import tiers.disk as disk
    return disk

DEFAULT_SIZES = (64 << 10, 256 << 10, 1 << 20, 2 << 20)
_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def _parse_size(text: str) -> int:
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    return int(float(num) * _UNITS[t[len(num):]])


def _fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10} KiB"


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _settle(work: str, pause: float) -> None:
    """Remove the previous round's files, then let the filesystem finish with them."""
    for name in os.listdir(work):
        p = os.path.join(work, name)
        shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)
    os.sync()
    time.sleep(pause)
    os.sync()


def _aligned(nbytes: int):
    import numpy as np
    mm = mmap.mmap(-1, -(-nbytes // 4096) * 4096)
    return mm, np.frombuffer(mm, dtype=np.uint8)[:nbytes]


def _source(total: int, seed: int = 1234):
    """``total`` bytes of page-aligned data: 64 MiB of random bytes tiled, each 4 KiB stamped with its index,
    so that every page is distinct (and incompressible enough for a checksum to mean something)."""
    import numpy as np
    mm, buf = _aligned(total)
    rng = np.random.default_rng(seed)
    block = rng.integers(0, 256, size=min(total, 64 << 20), dtype=np.uint8)
    for off in range(0, total, block.nbytes):
        n = min(block.nbytes, total - off)
        buf[off:off + n] = block[:n]
    words = buf[: total - total % 4096].view(np.uint64).reshape(-1, 512)
    words[:, 0] = np.arange(words.shape[0], dtype=np.uint64)
    return mm, buf


def _baseline(path: str, src, chunk: int, direct: bool) -> tuple[float, float]:
    """Sequential write (+fdatasync) and read of ``src``; returns (write s, read s)."""
    flags = os.O_CREAT | os.O_TRUNC | os.O_RDWR | (os.O_DIRECT if direct else 0)
    mv = memoryview(src)
    total = src.nbytes
    fd = os.open(path, flags, 0o644)
    try:
        try:            # allocated before the clock starts: the limit is the write, not block allocation
            os.posix_fallocate(fd, 0, total)
        except OSError:
            pass
        t0 = time.perf_counter()
        for off in range(0, total, chunk):
            n = os.pwrite(fd, mv[off:off + chunk], off)
            assert n == min(chunk, total - off)
        os.fdatasync(fd)
        tw = time.perf_counter() - t0
    finally:
        os.close(fd)
    _drop_cache(path)
    mm, dst = _aligned(total)          # a destination as big as the source, like the tier's recall
    dst[:] = 0
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        t0 = time.perf_counter()
        for off in range(0, total, chunk):
            n = os.preadv(fd, [memoryview(dst)[off:off + chunk]], off)
            assert n == min(chunk, total - off)
        tr = time.perf_counter() - t0
    finally:
        os.close(fd)
        del dst
        mm.close()
    return tw, tr


def _tier(path: str, src, size: int, batch: int, o_direct: str, verify: bool,
          aligned: bool) -> tuple[float, float, dict]:
    """Spill ``src`` as pages of ``size`` bytes through DiskTier and recall them; returns (spill s, recall s, stats).

    ``aligned``: the host buffers are page-aligned, as pinned host slabs are; otherwise they come from
    torch's CPU allocator (64-byte aligned), which makes an O_DIRECT tier go through bounce buffers."""
    import torch
    disk = _disk_module()
    DiskTier, PageRecord = disk.DiskTier, disk.PageRecord

    n = src.nbytes // size
    pages = torch.from_numpy(src[: n * size]).view(n, size)
    # Recall lands in a buffer as big as the source: the timed loop has no gaps (an untimed check
    # between reads would let readahead run for free), and the check comes after it.
    if aligned:
        out_mm, out_np = _aligned(n * size)
        out = torch.from_numpy(out_np).view(n, size)
    else:
        pages = pages.clone()
        out = torch.empty((n, size), dtype=torch.uint8)
    out.fill_(0)
    shutil.rmtree(path, ignore_errors=True)
    tier = DiskTier.open(path, {"bench": size}, [(size, n)], o_direct=o_direct)
    try:
        records = [PageRecord(key=i + 1, parent=i if i else None, depth=i, life_cycle=0) for i in range(n)]
        t0 = time.perf_counter()
        for a in range(0, n, batch):
            b = min(n, a + batch)
            tier.write(0, list(range(a, b)), pages[a:b], records[a:b])
        t_spill = time.perf_counter() - t0
        _drop_cache(tier.segment_path(0))
        t0 = time.perf_counter()
        for a in range(0, n, batch):
            b = min(n, a + batch)
            tier.read(0, list(range(a, b)), out[a:b])
        t_recall = time.perf_counter() - t0
        if verify and not torch.equal(out, pages):
            raise AssertionError("recalled pages differ from what was spilled")
        stats = tier.stats
    finally:
        tier.close()
    return t_spill, t_recall, stats


def run_bench(gib: float = 1.0, sizes=DEFAULT_SIZES, directory: str | None = None, *, batch: int = 64,
              o_direct: str = "auto", repeat: int = 2, verify: bool = True, aligned: bool = True,
              settle: float = 2.0, progress=None) -> list[dict]:
    """Measure spill/recall of ``gib`` GiB per page size against plain sequential I/O.

    ``settle``: seconds to pause (after a sync) between rounds, for the filesystem to finish
    discarding the previous round's files. ``aligned`` (default): host buffers are page-aligned like pinned host slabs; False uses torch's
    allocator. Returns one dict per size with GB/s figures (1 GB = 1e9 bytes) and ratios against the
    better baseline. ``progress(done, total, label)`` is called between steps if given.
    """
    base = directory or (os.getcwd() if os.access(os.getcwd(), os.W_OK) else tempfile.gettempdir())
    work = tempfile.mkdtemp(prefix="kvtier-bench-", dir=base)
    sizes = [int(s) for s in sizes]
    total_bytes = int(gib * (1 << 30))
    results = []
    try:
        probe_dir = os.path.join(work, "probe")
        with _disk_module().DiskTier.open(probe_dir, {}, [], o_direct="auto") as probe:
            direct_ok = probe.o_direct_supported
        shutil.rmtree(probe_dir, ignore_errors=True)
        mm, src_all = _source(total_bytes)
        steps, done = len(sizes) * repeat, 0
        for size in sizes:
            n = total_bytes // size
            if n == 0:
                continue
            src = src_all[: n * size]
            chunk = batch * size
            best = dict(spill=0.0, recall=0.0, bw=0.0, br=0.0, dw=0.0, dr=0.0)
            stats: dict = {}
            for _ in range(repeat):
                nbytes = n * size
                # Files are removed only between rounds, followed by a sync and a pause: deleting 1 GiB
                # makes a filesystem mounted with online discard trim it at the next journal commit,
                # which would stall whichever measurement runs next.
                _settle(work, settle)
                tw, tr = _baseline(os.path.join(work, "baseline.bin"), src, chunk, direct=False)
                ts, tc, stats = _tier(os.path.join(work, "tier"), src, size, batch, o_direct, verify, aligned)
                best["spill"] = max(best["spill"], nbytes / ts / 1e9)
                best["recall"] = max(best["recall"], nbytes / tc / 1e9)
                best["bw"] = max(best["bw"], nbytes / tw / 1e9)
                best["br"] = max(best["br"], nbytes / tr / 1e9)
                if direct_ok:
                    dw, dr = _baseline(os.path.join(work, "baseline-direct.bin"), src, chunk, direct=True)
                    best["dw"] = max(best["dw"], nbytes / dw / 1e9)
                    best["dr"] = max(best["dr"], nbytes / dr / 1e9)
                done += 1
                if progress is not None:
                    progress(done, steps, _fmt_size(size))
            base_w = max(best["bw"], best["dw"])
            base_r = max(best["br"], best["dr"])
            results.append({
                "page_bytes": size, "pages": n, "bytes": n * size, "batch_pages": batch,
                "host_buffers": "page-aligned" if aligned else "torch",
                "tier_o_direct": bool(stats.get("o_direct")),
                "tier_o_direct_reads": bool(stats.get("o_direct_reads")),
                "spill_gbps": round(best["spill"], 3),
                "baseline_write_gbps": round(base_w, 3),
                "baseline_write_buffered_gbps": round(best["bw"], 3),
                "baseline_write_direct_gbps": round(best["dw"], 3) if direct_ok else None,
                "spill_ratio": round(best["spill"] / base_w, 3) if base_w else None,
                "recall_gbps": round(best["recall"], 3),
                "baseline_read_gbps": round(base_r, 3),
                "baseline_read_buffered_gbps": round(best["br"], 3),
                "baseline_read_direct_gbps": round(best["dr"], 3) if direct_ok else None,
                "recall_ratio": round(best["recall"] / base_r, 3) if base_r else None,
            })
        del src_all, src
        mm.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


def format_table(results: list[dict]) -> str:
    head = ("page", "spill GB/s", "base write GB/s", "ratio", "recall GB/s", "base read GB/s", "ratio")
    rows = [head]
    for r in results:
        bw = f"{r['baseline_write_gbps']:.2f} ({r['baseline_write_buffered_gbps']:.2f}b/" \
             f"{(r['baseline_write_direct_gbps'] or 0):.2f}d)"
        br = f"{r['baseline_read_gbps']:.2f} ({r['baseline_read_buffered_gbps']:.2f}b/" \
             f"{(r['baseline_read_direct_gbps'] or 0):.2f}d)"
        rows.append((_fmt_size(r["page_bytes"]), f"{r['spill_gbps']:.2f}", bw, f"{r['spill_ratio']:.2f}",
                     f"{r['recall_gbps']:.2f}", br, f"{r['recall_ratio']:.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("(baselines: the better of buffered (b) and O_DIRECT (d) sequential I/O; ratio = tier / baseline)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="GiB spilled and recalled per page size (default 1)")
    ap.add_argument("--dir", default=None, help="directory to test in (default: the current one, else /tmp); a scratch "
                                                 "directory inside it is removed after")
    ap.add_argument("--sizes", default="64KiB,256KiB,1MiB,2MiB", help="comma-separated page sizes: bytes, or with K/KiB, M/MiB or G/GiB (default 64KiB,256KiB,1MiB,2MiB)")
    ap.add_argument("--batch", type=int, default=64, help="pages per write/read call (default 64)")
    ap.add_argument("--o-direct", default="auto", choices=("auto", "on", "off"),
                    help="DiskTier o_direct mode (default auto: O_DIRECT writes from 64 KiB pages up)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per measurement, best kept (default 2)")
    ap.add_argument("--torch-buffers", action="store_true",
                    help="host buffers from torch's allocator instead of page-aligned ones (pinned-like)")
    ap.add_argument("--settle", type=float, default=2.0,
                    help="seconds to let the filesystem settle between rounds (default 2)")
    ap.add_argument("--no-verify", action="store_true", help="skip comparing recalled bytes with the source")
    ap.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    args = ap.parse_args(argv)
    sizes = [_parse_size(s) for s in args.sizes.split(",") if s.strip()]

    def progress(done: int, total: int, label: str) -> None:
        if not args.json:
            print(f"\r[{done}/{total}] {label} ", end="", file=sys.stderr, flush=True)

    results = run_bench(args.gib, sizes, args.dir, batch=args.batch, o_direct=args.o_direct,
                        repeat=args.repeat, verify=not args.no_verify,
                        aligned=not args.torch_buffers, settle=args.settle, progress=progress)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(file=sys.stderr)
        print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

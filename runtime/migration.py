"""The data path of page migration: one batch per (source tier, source group,
destination group), run as stages on copy and I/O streams.

GPU <-> host runs on the device's copy streams (one each way, so both
directions overlap); the codec runs on the GPU side, so only cold bytes cross
the bus. Disk stages run on host I/O streams (one for writes, one for reads).
Each stage is one job whose event the engine awaits through the readiness
bridge; the last stage's event is the batch's event, stamped by the caller on
both the destination page and the freed source slot.

Bookkeeping (which page owns which slot, claims, eviction) stays in the Store;
this module only moves bytes and counts them.
"""
from __future__ import annotations

import asyncio
import bisect
import dataclasses
import logging
import time
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from tiers.native import copy_rows as _copy_rows
from tiers.codecs import Codec, get_codec
from tiers.device import Device, aligned_empty
from tiers.layers import LifeCycle
from tiers.staging import StagingPool
from tiers.streams import Event, HostStream

from .pages import DISK, GPU, HOST, TIER_NAMES
from .copy_thread import CopyThread
from .readiness import ended, outlast, wait_event, wait_events
from .stats import MoveStats


log = logging.getLogger("kvtier")
# An emulated GPU<->host copy this small runs on the loop (a disk read from the page cache too,
# up to the disk tier's CACHED_READ_MAX) rather than on its stream's thread: a refill step of small
# pages (reclaim.REFILL_BYTES), about
# 0.2-0.5 ms of memcpy. A hop to the thread cost a wait for it to start (the GIL behind a busy
# loop) and a loop turn to hear back; a request short of GPU slots waited 0.65 ms on average for
# a demotion's copy there. From 256 KiB to 2 MiB: +19 % at concurrency 1, +21 % at 32 (docs/BENCH.md).
INLINE_BYTES = 2 << 20
# A spill this small is written behind (MigrationEngine._spill_behind): its rows are gathered into a
# staging buffer on the loop (about 0.4 ms for 4 MiB here) and its pages land before the write.
# Against none: +7 % at concurrency 1, +13 % at 32 (4 of 5 pairs each); 8 MiB measured no better.
BEHIND_BYTES = 4 << 20
BEHIND_LIMIT_BYTES = 64 << 20   # staged rows of writes behind in flight at most: past it a spill waits (backpressure)
SPILL_CHUNK_BYTES = 32 << 20   # the most one disk write (one batch of the disk tier's queue) of a spill takes
STAGING_IDLE_BYTES = 256 << 20  # reusable staging buffers kept between moves
# A copy between the GPU and host slabs whose slots break into many runs goes through a staging
# buffer on the GPU (copy_rows, _staging_plan): one cudaMemcpyAsync moved a 64 KiB page at a
# fraction of the bus's speed (0.3 of one large copy on an H200, issue 11). The staging takes at
# most this much GPU memory, from torch's caching allocator on the copy stream (which keeps it
# cached for that stream); larger pages copy near the bus's speed one by one anyway.
GATHER_MAX_BYTES = 32 << 20
STAGING_OOM_PAUSE = 1.0         # seconds without staging after the GPU had no memory for it
# upper bounds (seconds) of the batch latency histogram; one more bucket counts what lies above the last
MOVE_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                        1.0, 2.5, 5.0, 10.0)
_DIRECTION = tuple(tuple(f"{a}->{b}" for b in TIER_NAMES) for a in TIER_NAMES)   # [src][dst] -> "gpu->host"


class MoveLatency:
    """Wall time of each batch that landed, per direction (``"gpu->host"``),
    from the engine taking it to its last stage's event (waits on earlier
    copies included), in the fixed buckets ``bounds``: ``counts[d][i]`` is
    the number of batches with ``bounds[i-1] < seconds <= bounds[i]``, the
    last entry those above every bound; ``sums[d]`` their total seconds.

    Plain ints and floats, updated once per batch on the loop. A metrics
    scrape may read them from another thread: ``snapshot()`` copies each
    list in one step (atomic under the GIL)."""

    __slots__ = ("bounds", "counts", "sums")

    def __init__(self, bounds: Sequence[float] = MOVE_LATENCY_BUCKETS) -> None:
        self.bounds = tuple(bounds)
        self.counts: dict[str, list[int]] = {}
        self.sums: dict[str, float] = {}

    def record(self, direction: str, seconds: float) -> None:
        c = self.counts.get(direction)
        if c is None:
            c = self.counts[direction] = [0] * (len(self.bounds) + 1)
        c[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sums[direction] = self.sums.get(direction, 0.0) + seconds

    def snapshot(self) -> dict[str, tuple[list[int], float]]:
        """direction -> (per-bucket counts, not cumulative; total seconds)."""
        return {d: (list(c), self.sums.get(d, 0.0)) for d, c in list(self.counts.items())}


@dataclasses.dataclass(slots=True)
class Batch:
    """The pages of one move, as the core describes them: one source tier
    and group, sorted by source slot (runs copy as one), except host rows
    into the disk: in eviction order, least recently used first (``split_batches``)."""

    src_tier: int
    src_group: int
    src_slots: list[int]
    lcs: list[int]                      # life cycle per page
    deps: set                           # the pages' ready events (few distinct: one per batch that placed them)
    records: Callable[[], np.ndarray]   # their disk journal records (called on the loop, for writes to disk)
    tee: Callable[[torch.Tensor], None] | None = None   # GPU->host: gets a copy of the landed cold rows ...
    tee_rows: np.ndarray | None = None  # ... of these pages of the batch (ascending positions)
    behind: bool = False                # host->disk: the pages may land before their write (see _spill_behind)
    released: bool = False              # set by the engine: the source rows were copied out, no slot fence
    pages: object = None                # the store's handle of the pages, and the id of the ready event
    ready_id: int = 0                   # they landed with: given back if a write behind fails

    def __len__(self) -> int:
        return len(self.src_slots)


def _runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(row offset, first slot, length) of each run of consecutive slots."""
    out, start = [], 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            out.append((start, slots[start], i - start))
            start = i
    return out


def index_tensor(slots: Sequence[int], device: torch.device) -> torch.Tensor:
    """``slots`` as a long tensor on ``device``. To CUDA through pinned memory
    and non-blocking: a pageable host-to-device copy would synchronize the
    current (copy) stream and stall the event loop that issues it."""
    idx = torch.as_tensor(slots, dtype=torch.long)
    if device.type == "cuda":
        idx = idx.pin_memory().to(device, non_blocking=True)
    return idx


Rows = "torch.Tensor | np.ndarray"     # a slab or a buffer: numpy for host memory skips the torch calls


def _host(t: Rows) -> np.ndarray | None:
    """Host rows as numpy (None for CUDA memory). A numpy array passes as it is: torch calls give
    up the GIL, and on the loop or a disk thread each costs a wait to get it back."""
    if isinstance(t, np.ndarray):
        return t
    return None if t.is_cuda else t.numpy()


_HOST = torch.device("cpu")


def _index(slots: Sequence[int]) -> np.ndarray:
    return np.asarray(slots, dtype=np.int64)


def gather(src: Rows, slots: Sequence[int], device: torch.device, out: Rows | None = None) -> Rows:
    """Rows ``slots`` of ``src`` as a tensor on ``device``: ``out`` when given
    (a host staging buffer, a tensor or a numpy array), else a new tensor
    (page-aligned on the host, so the disk tier can write it without a bounce copy).
    From the GPU into host memory: one gather on the GPU and one copy where
    the slots break into four runs or more, else a copy per run."""
    if device.type == "cpu":
        host_src = _host(src)
        if out is None:
            out = aligned_empty(len(slots), src.shape[1]) if host_src is not None else \
                torch.empty((len(slots), src.shape[1]), dtype=src.dtype, pin_memory=True)
        if host_src is not None:       # one native memcpy per row (torch's CPU index_select runs far slower)
            _copy_rows(host_src, _index(slots), _host(out), None)
            return out
    elif src.device == device:
        return src.index_select(0, index_tensor(slots, device))
    else:
        out = torch.empty((len(slots), src.shape[1]), dtype=src.dtype, device=device)
    runs = _runs(slots)
    if _host(src) is None and len(runs) >= 4 and out.nbytes <= GATHER_MAX_BYTES and _staging_allowed():
        try:                            # one gather kernel on the GPU, then one copy
            out.copy_(_gather_on_device(src, slots), non_blocking=True)
            return out
        except torch.cuda.OutOfMemoryError:
            _staging_failed()
    for off, first, n in runs:
        out[off:off + n].copy_(src[first:first + n], non_blocking=True)
    return out


def scatter(dst: Rows, slots: Sequence[int], rows: Rows) -> None:
    """``dst[slots] = rows``. On the GPU one index_copy_ kernel; between
    host rows one native call (a memcpy per row); across devices one copy
    per run of consecutive slots."""
    host_dst, host_rows = _host(dst), _host(rows)
    if host_dst is not None and host_rows is not None:
        _copy_rows(host_rows, None, host_dst, _index(slots))
        return
    if host_dst is None and host_rows is None:
        dst.index_copy_(0, index_tensor(slots, dst.device), rows)
        return
    for off, first, n in _runs(slots):
        dst[first:first + n].copy_(rows[off:off + n], non_blocking=True)


def _joint_runs(src_slots: Sequence[int], dst_slots: Sequence[int]) -> list[tuple[int, int]]:
    """(row offset, length) of each run consecutive in both slot lists."""
    out, start, n = [], 0, len(src_slots)
    for i in range(1, n + 1):
        if i == n or src_slots[i] != src_slots[i - 1] + 1 or dst_slots[i] != dst_slots[i - 1] + 1:
            out.append((start, i - start))
            start = i
    return out


def copy_rows(src: Rows, src_slots: Sequence[int], dst: Rows, dst_slots: Sequence[int]) -> None:
    """``dst[dst_slots] = src[src_slots]``: between host rows one native call
    (a memcpy per row); across devices one copy (one cudaMemcpyAsync) per run
    consecutive on both sides, or, where the device's slots break those runs
    up (demoted pages lie all over the GPU slab), through a staging buffer
    on the device (``_copy_via_device``)."""
    host_src, host_dst = _host(src), _host(dst)
    if host_src is not None and host_dst is not None:
        _copy_rows(host_src, _index(src_slots), host_dst, _index(dst_slots))
        return
    runs = _joint_runs(src_slots, dst_slots)
    if (host_src is None) != (host_dst is None) and len(src_slots) * src[0].nbytes <= GATHER_MAX_BYTES:
        host_runs = _staging_plan(runs, dst_slots if host_src is None else src_slots)
        if host_runs is not None and _staging_allowed():
            try:
                _copy_via_device(src, src_slots, dst, dst_slots, host_runs, to_host=host_src is None)
                return
            except torch.cuda.OutOfMemoryError:      # a GPU full of other work: the copies need no memory
                _staging_failed()
    for off, n in runs:
        dst[dst_slots[off]:dst_slots[off] + n].copy_(src[src_slots[off]:src_slots[off] + n], non_blocking=True)


def _staging_plan(joint_runs: list[tuple[int, int]], host_slots: Sequence[int]) -> list[tuple[int, int, int]] | None:
    """The runs of the host side's slots when a copy in ``joint_runs`` should
    go through a staging buffer on the device, else None: when a copy per
    host run plus the index's upload and the kernel come to at most half
    the copies of one per joint run."""
    if len(joint_runs) < 4:
        return None
    host_runs = _runs(host_slots)
    return host_runs if len(host_runs) * 2 + 2 <= len(joint_runs) else None


_staging_off_until = 0.0      # after an out-of-memory: each try frees torch's cache and syncs the device


def _staging_allowed() -> bool:
    return _staging_off_until == 0.0 or time.monotonic() >= _staging_off_until


def _staging_failed() -> None:
    global _staging_off_until
    _staging_off_until = time.monotonic() + STAGING_OOM_PAUSE
    log.info("no GPU memory for a copy's staging: copying run by run for %.1f s", STAGING_OOM_PAUSE)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """A slab's rows as int64 where they allow it: the gather and scatter kernels then move
    eight bytes an element, not one."""
    if t.dtype == torch.uint8 and t.dim() == 2 and t.shape[1] % 8 == 0 and t.is_contiguous() \
            and t.data_ptr() % 8 == 0:
        return t.view(torch.int64)
    return t


def _gather_on_device(src: torch.Tensor, slots: Sequence[int]) -> torch.Tensor:
    """Rows ``slots`` of ``src`` in a new tensor on ``src``'s device (one kernel), as ``src``'s dtype."""
    return _wide(src).index_select(0, index_tensor(slots, src.device)).view(src.dtype)


def _copy_via_device(src: torch.Tensor, src_slots: Sequence[int], dst: torch.Tensor, dst_slots: Sequence[int],
                     host_runs: list[tuple[int, int, int]], to_host: bool) -> None:
    """A copy between a device slab and a host slab with one gather (or,
    ``to_host`` False, scatter) kernel on the device's side and one copy per
    run of the host side's slots (``host_runs``, as ``_runs`` gives them),
    through a staging buffer on the device. The staging comes from torch's
    caching allocator on the current (copy) stream, so it is not reused
    before the copies issued here ran. Every allocation comes before the
    first write into ``dst``: out of memory leaves it untouched."""
    if to_host:
        rows = _gather_on_device(src, src_slots)
        for off, first, n in host_runs:
            dst[first:first + n].copy_(rows[off:off + n], non_blocking=True)
    else:
        rows = torch.empty((len(src_slots), src.shape[1]), dtype=src.dtype, device=dst.device)
        idx = index_tensor(dst_slots, dst.device)
        for off, first, n in host_runs:
            rows[off:off + n].copy_(src[first:first + n], non_blocking=True)
        wide = _wide(dst)
        wide.index_copy_(0, idx, rows.view(wide.dtype))


def _rows_of(*pools) -> tuple:
    """The pools' slabs as numpy when all are host memory (an emulated GPU's too), else as tensors."""
    if all(p.array is not None for p in pools):
        return tuple(p.array for p in pools)
    return tuple(p.tensor for p in pools)


class MigrationEngine:
    __slots__ = ("device", "lcs", "codecs", "gpu", "host", "disk", "cold_bytes", "down", "up", "io_write", "staging",
                 "io_read", "tee", "stats", "latency", "fault", "loop", "behind", "behind_bytes", "staged", "on_behind_failure",
                 "copier", "copier_up")

    def __init__(self, device: Device, lcs: Sequence[LifeCycle], gpu: list, host: list, disk,
                 cold_bytes: Sequence[int]) -> None:
        self.device = device
        self.cold_bytes = list(cold_bytes)   # slot bytes of each cold (host/disk) group
        self.lcs = lcs
        self.codecs: list[Codec] = [get_codec(lc.codec) for lc in lcs]
        self.gpu = gpu                   # [SlabPool] per GPU group
        self.host = host                 # [SlabPool] per host group
        self.disk = disk                 # DiskTier or None
        self.down = device.new_stream("kvtier-d2h")
        self.up = device.new_stream("kvtier-h2d")
        self.io_write = HostStream("kvtier-disk-write")
        self.io_read = HostStream("kvtier-disk-read")
        self.tee = HostStream("kvtier-remote-tee")     # write-through copies: off the loop, beside the copies
        self.stats = MoveStats()
        self.latency = MoveLatency()         # per-batch wall time by direction, for metrics
        self.loop: asyncio.AbstractEventLoop | None = None   # the store's (set at its start): no lookup per stage
        self.staging = StagingPool(lambda n: device.host_empty(1, n, zero=False).view(-1), STAGING_IDLE_BYTES)
        self.behind: set[Event] = set()      # writes behind not ended yet (Store.drain waits for them)
        self.behind_bytes = 0                # and the bytes they hold staged
        # write event -> (disk group, its slots ascending, its staged rows, give the rows back): reads
        # of pages whose write is queued copy from here (_read_staged). None: off (write-through keeps
        # a promoted page's disk slot as its copy, whose bytes must be on the disk when it lands)
        self.staged: dict[Event, tuple] | None = {}
        self.on_behind_failure: Callable[[BaseException, Batch], None] | None = None   # the store's
        # emulated copies past INLINE_BYTES (attach): demotions, and promotions apart (on a request's
        # path, never queued behind a demotion)
        self.copier: CopyThread | None = None
        self.copier_up: CopyThread | None = None
        self.fault: Callable[[int, int], None] | None = None   # test hook: (src tier, dst tier) -> may raise

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """At the store's start, on its loop: where completions go, and on the emulated GPU
        (host memory slabs) a native thread for the copies too large for the loop."""
        self.loop = loop
        if self.copier is None and self.gpu and all(p.array is not None for p in (*self.gpu, *self.host)):
            self.copier, self.copier_up = CopyThread(loop), CopyThread(loop)

    def stop_copier(self) -> None:
        """Copies past INLINE_BYTES go to the copy streams' worker threads again (where tests can
        hold them)."""
        for c in (self.copier, self.copier_up):
            if c is not None:
                c.close()
        self.copier = self.copier_up = None

    def close(self) -> None:
        self.stop_copier()
        for s in (self.down, self.up, self.io_write, self.io_read, self.tee):
            s.close()
        self.staging.clear()

    async def _copy_off_loop(self, copier: CopyThread, busy: list[float], src: np.ndarray, src_slots: Sequence[int],
                             dst: np.ndarray, dst_slots: Sequence[int], deps: Iterable[Event | None]) -> Event:
        """An emulated copy too large for the loop, on the native copy thread (runtime/copy_thread.py):
        it starts once what it depends on ended (however it ended, as a stream's wait does)."""
        for e in set(deps):
            if e is not None:
                await ended(e, self.loop)
        t0 = time.perf_counter()                # busy: from issue to completion, as on CUDA
        ev = copier.submit(src, _index(src_slots), dst, _index(dst_slots))
        try:
            await wait_event(ev, self.loop)
        except asyncio.CancelledError:
            await outlast(ev, self.loop)    # the rows may still be copied: the caller's cleanup must wait
            raise
        busy[0] += time.perf_counter() - t0
        return ev

    # -- codec helpers ----------------------------------------------------------
    def _identity(self, lcs: list[int]) -> bool:
        return all(self.codecs[lc].name == "concat" for lc in set(lcs))

    def _convert(self, rows: torch.Tensor, lcs: list[int], encode: bool, width: int) -> torch.Tensor:
        first = lcs[0]
        if all(l == first for l in lcs):
            c = self.codecs[first]
            return c.encode(rows, self.lcs[first]) if encode else c.decode(rows, self.lcs[first])
        out = torch.empty((rows.shape[0], width), dtype=torch.uint8, device=rows.device)
        for lc in set(lcs):
            idx = index_tensor([i for i, l in enumerate(lcs) if l == lc], rows.device)
            c = self.codecs[lc]
            part = rows.index_select(0, idx)
            out.index_copy_(0, idx, c.encode(part, self.lcs[lc]) if encode else c.decode(part, self.lcs[lc]))
        return out

    # -- one batch --------------------------------------------------------------
    async def run(self, batch: Batch, dst_tier: int, dst_group: int, dst_slots: Sequence[int],
                  fences: Sequence[Event | None], record: bool = True) -> Event:
        """Move ``batch`` into ``dst_slots`` (ascending). ``fences`` are the
        events a writer of the destination slots must wait for. Returns the
        batch's event. ``record=False``: not counted as a move (write-through
        copies keep their own counts)."""
        t_start = time.perf_counter()
        src_tier, src_group, src_slots, lcs = batch.src_tier, batch.src_group, batch.src_slots, batch.lcs
        n_pages = len(src_slots)
        deps = set(batch.deps)
        deps.update(fences)
        busy = [0.0]        # seconds the stages' jobs ran (not queued), for bandwidth
        if self.fault is not None:
            self.fault(src_tier, dst_tier)
        dev = self.device.torch_device
        host_dev = _HOST
        nbytes = n_pages * self._dst_width(dst_tier, dst_group)
        small = nbytes <= INLINE_BYTES   # cheaper on the loop than a hop to a copy thread
        off_loop = not small and self.copier is not None and self._identity(lcs)    # on a native copy thread

        if src_tier == GPU:
            hot = self.gpu[src_group]
            cold_bytes = self.cold_bytes[dst_group]
            if dst_tier == HOST:
                dst = self.host[dst_group].tensor

                def job() -> None:
                    if self._identity(lcs):
                        src_rows, dst_rows = _rows_of(hot, self.host[dst_group])
                        copy_rows(src_rows, src_slots, dst_rows, dst_slots)
                    else:
                        rows = gather(hot.tensor, src_slots, dev)
                        scatter(dst, dst_slots, self._convert(rows, lcs, True, cold_bytes))
                if off_loop:
                    ev = await self._copy_off_loop(self.copier, busy, hot.array, src_slots,
                                                   self.host[dst_group].array, dst_slots, deps)
                else:
                    ev = await self._stage(busy, self.down, job, deps, inline=small)
                if batch.tee is not None:       # the landed rows, copied while the claim still holds the slots
                    teed = [dst_slots[i] for i in batch.tee_rows.tolist()]
                    await self._tee(batch, busy, lambda out: gather(dst, teed, host_dev, out=out),
                                    len(teed), cold_bytes, [ev])
            else:
                records = batch.records()
                with self.staging.borrow(n_pages, cold_bytes) as buf:
                    def job() -> None:
                        if self._identity(lcs):
                            gather(hot.tensor, src_slots, host_dev, out=buf)
                        else:
                            buf.copy_(self._convert(gather(hot.tensor, src_slots, dev), lcs, True, cold_bytes),
                                      non_blocking=True)
                    await self._stage(busy, self.down, job, deps, inline=small)
                    if batch.tee is not None:   # the cold rows, copied before the staging goes back
                        idx = torch.from_numpy(batch.tee_rows)
                        await self._tee(batch, busy, lambda out: torch.index_select(buf, 0, idx, out=out),
                                        len(idx), cold_bytes, [])
                    ev = await self._stage(busy, self.io_write,
                                           lambda: self.disk.write(dst_group, list(dst_slots), buf, records,
                                                                   durable=False), [])
        elif src_tier == HOST:
            src = self.host[src_group].tensor
            if dst_tier == GPU:
                dst, hot_bytes = self.gpu[dst_group].tensor, self.gpu[dst_group].spec.slot_bytes

                def job() -> None:
                    if self._identity(lcs):
                        src_rows, dst_rows = _rows_of(self.host[src_group], self.gpu[dst_group])
                        copy_rows(src_rows, src_slots, dst_rows, dst_slots)
                    else:
                        rows = gather(src, src_slots, dev)
                        scatter(dst, dst_slots, self._convert(rows, lcs, False, hot_bytes))
                if off_loop:
                    ev = await self._copy_off_loop(self.copier_up, busy, self.host[src_group].array, src_slots,
                                                   self.gpu[dst_group].array, dst_slots, deps)
                else:
                    ev = await self._stage(busy, self.up, job, deps, inline=small)
            else:
                records = batch.records()
                src_rows = self.host[src_group].array       # host memory: numpy all the way to the disk
                if batch.behind and nbytes <= BEHIND_BYTES and self.behind_bytes + nbytes <= BEHIND_LIMIT_BYTES:
                    ev = await self._spill_behind(busy, batch, src_rows, dst_group, dst_slots, records, fences,
                                                  t_start)
                else:
                    ev = await self._stage(busy, self.io_write,
                                           lambda: self._spill(src_rows, src_slots, dst_group, dst_slots, records),
                                           deps)
        else:   # DISK source
            width = self.cold_bytes[src_group]
            read_deps = set(batch.deps)
            if dst_tier == HOST:
                dst = self.host[dst_group].array

                def job() -> None:          # straight into the host slab, one read per run of slots
                    for off, first, n in _runs(dst_slots):
                        self.disk.read(src_group, src_slots[off:off + n], dst[first:first + n])
                ev = await self._stage(busy, self.io_read, job, read_deps.union(fences))
            else:
                hot = self.gpu[dst_group]
                plain = hot.array is not None and self._identity(lcs)     # emulated: host memory end to end
                borrow = self.staging.borrow_array if plain else self.staging.borrow
                with borrow(n_pages, width) as staging:
                    if not (self._read_staged(src_group, src_slots, staging, read_deps) or
                            small and self._read_cached(busy, src_group, src_slots, staging, read_deps)):
                        await self._stage(busy, self.io_read, lambda: self.disk.read(src_group, src_slots, staging),
                                          read_deps)

                    def job() -> None:
                        if plain:
                            scatter(hot.array, dst_slots, staging)
                        else:
                            rows = staging.to(dev, non_blocking=True)      # the staging itself when emulated
                            scatter(hot.tensor, dst_slots, self._convert(rows, lcs, False, hot.spec.slot_bytes))
                    ev = await self._stage(busy, self.up, job, fences, inline=small)
        if record:
            self.stats.record(TIER_NAMES[src_tier], src_group, TIER_NAMES[dst_tier], dst_group, n_pages, nbytes,
                              busy[0])
            if not batch.released:      # a write behind: when it ends (_behind_done)
                self.latency.record(_DIRECTION[src_tier][dst_tier], time.perf_counter() - t_start)
        return ev

    def _read_staged(self, group: int, slots: Sequence[int], out, deps: Iterable[Event | None]) -> bool:
        """Disk pages whose writes behind are all still queued, copied from those writes' staging
        rows here on the loop (True); False (``out`` maybe part written) where any page's ready
        event is not such a write. The rows are the page's bytes until its write ends (``_behind_done``
        gives the buffer back, on the loop, after forgetting the write). A recently spilled page
        asked for again no longer waits on the read thread for its write (session 15: 0.36 s of
        a 2 s replay)."""
        if not self.staged:
            return False
        recs = []
        for e in deps:
            rec = self.staged.get(e) if e is not None else None
            if rec is None or rec[0] != group or e.query():     # done: written (or failed), read the disk
                return False
            recs.append(rec)
        if not recs:
            return False
        want = _index(slots)
        dst = _host(out)
        done = np.zeros(len(want), dtype=bool)
        for _, written, rows, _ in recs:    # written: the write's disk slots, ascending; rows in that order
            pos = np.searchsorted(written, want)
            hit = pos < len(written)
            hit[hit] = written[pos[hit]] == want[hit]
            if (hit & done).any():
                # a slot two queued writes fill (a page promoted from one, its slot reused by the
                # other): which is this page's is not known here; the disk has the newest once both
                # ran, in order (found in review)
                return False
            if hit.any():
                _copy_rows(rows, pos[hit], dst, np.flatnonzero(hit))
                done |= hit
        return bool(done.all())

    def _read_cached(self, busy: list[float], group: int, slots: Sequence[int], out,
                     deps: Iterable[Event | None]) -> bool:
        """A small disk read done here on the loop, when every page is in the page cache and
        nothing the read depends on is pending (``DiskTier.read_cached``: it never waits for the
        device or a lock), whatever the read thread has queued (reads of other pages: a page is
        claimed while it moves). A promotion from disk then costs a memcpy, not two hops to the
        read thread and back, each a wait for the GIL behind a busy loop."""
        if any(e is not None and not e.query() for e in deps):
            return False                # the read waits for those in the read thread's queue
        t0 = time.perf_counter()
        try:
            return self.disk.read_cached(group, slots, out)
        finally:
            busy[0] += time.perf_counter() - t0

    async def _tee(self, batch: Batch, busy: list[float], copy: Callable[[torch.Tensor], object], n_pages: int,
                   width: int, deps: list) -> None:
        """A copy of a batch's cold rows for ``batch.tee`` (write-through). Best effort: a
        failure here is logged and the move goes on (the tee is just not called)."""
        try:
            out = torch.empty((n_pages, width), dtype=torch.uint8)
            await self._stage(busy, self.tee, lambda: copy(out), deps)
            batch.tee(out)
        except Exception as exc:        # noqa: BLE001 - write-through must never fail a move
            log.warning("write-through copy of %d page(s) failed: %r", n_pages, exc)

    async def _stage(self, busy: list[float], stream, job: Callable[[], None],
                     deps: Iterable[Event | None], inline: bool = False) -> Event:
        """Submit ``job`` after ``deps``; await it. ``busy[0]`` accumulates its
        run time (on CUDA, from issue to completion). ``inline``: the job is
        small enough to run on the loop if its (host) stream is idle."""
        pending = [e for e in set(deps) if e is not None and not e.query()]    # events hash by identity
        await wait_events(e for e in pending if not stream.can_wait(e))
        for e in pending:
            if stream.can_wait(e):
                stream.wait_event(e)

        def timed() -> None:
            t0 = time.perf_counter()
            try:
                job()
            finally:
                busy[0] += time.perf_counter() - t0
        t_issue = time.perf_counter()
        if stream.kind == "cuda":                               # timed from issue to completion
            ev = stream.submit(job, inline=inline)
        else:
            # inline even past jobs queued on the stream, if nothing it depends on was pending: a
            # move's ``deps`` name every copy that touched its pages and slots (a slot goes back
            # to the allocator only after the move that read it landed, with its event as fence).
            # At concurrency 32 the copy streams were seldom idle, and small promotions went
            # through the thread: 3x the jobs, each waiting for the GIL behind a busy loop.
            ev = stream.submit(timed, inline=inline, ordered=bool(pending))
        try:
            await wait_event(ev, self.loop)
        except asyncio.CancelledError:
            # the job may still run: the move's cleanup hands its slots back, and another copy
            # (inline, past this one) may take them, so let it end first (found in review)
            await outlast(ev, self.loop)
            raise
        if stream.kind == "cuda":
            busy[0] += time.perf_counter() - t_issue
        return ev

    async def _spill_behind(self, busy: list[float], batch: Batch, src: np.ndarray, group: int,
                            dst_slots: Sequence[int], records: np.ndarray, fences: Sequence[Event | None],
                            t_start: float) -> Event:
        """A small spill written behind: the rows are copied to a staging buffer here on the loop
        and the write is queued on the write stream; the returned event is the write's, not
        awaited. The caller lands the pages at once, their ready event the write's (a read waits
        for it) and their host slots unfenced (``batch.released``): a demotion waiting for host
        slots no longer waits for a disk write (a start behind the GIL, a checksum and a pwrite).

        For pages the store may lose (``Batch.behind``: all published and unheld). If the write
        fails, the disk tier forgets the slots (``DiskTier.forget``) and the store drops the pages
        (``on_behind_failure``; a full filesystem counts as a refused spill). A page claimed then
        (a read waiting for the write) fails its read with ``CorruptPageError`` and is dropped
        there, as a page found bad is."""
        pending = [e for e in batch.deps if e is not None and not e.query()]
        if pending:
            await wait_events(pending)      # rows still arriving in the host slots
        n = len(batch.src_slots)
        t0 = time.perf_counter()
        rows, give_back = self.staging.lend_array(n, src.shape[1])
        try:
            _copy_rows(src, _index(batch.src_slots), rows, None)
        except BaseException:
            give_back()
            raise
        busy[0] += time.perf_counter() - t0
        for e in set(fences):           # the disk slots' last readers: the write queues behind them
            if e is not None and not e.query():
                self.io_write.wait_event(e)
        disk, slots, ran = self.disk, list(dst_slots), [False, 0.0, rows.nbytes]    # ran, seconds, bytes staged

        def job() -> None:
            ran[0] = True
            t = time.perf_counter()
            try:
                disk.write(group, slots, rows, records, durable=False)
            except BaseException as exc:
                self._forget(group, slots, exc)
                raise
            finally:
                ran[1] = time.perf_counter() - t
        ev = self.io_write.submit(job)
        self.behind.add(ev)
        if self.staged is not None:
            self.staged[ev] = (group, np.asarray(slots, dtype=np.int64), rows, give_back)
        self.behind_bytes += ran[2]
        loop = self.loop or asyncio.get_running_loop()

        def done(error: BaseException | None) -> None:
            try:
                loop.call_soon_threadsafe(self._behind_done, ev, batch, group, slots, error, ran, t_start,
                                          give_back)
            except RuntimeError:        # the loop is gone: nobody counts any more
                pass
        ev.add_done_callback(done)
        batch.released = True
        return ev

    def _forget(self, group: int, slots: list[int], exc: BaseException) -> None:
        try:
            self.disk.forget(group, slots, f"its write failed: {exc!r}")
        except Exception as e:          # noqa: BLE001 - the write's own error is what gets reported
            log.warning("disk write of %d page(s) failed (%r), and forgetting its slots too: %r", len(slots), exc, e)

    def _behind_done(self, ev: Event, batch: Batch, group: int, slots: list[int], error: BaseException | None,
                     ran: list, t_start: float, give_back: Callable[[], None]) -> None:
        """On the loop, when a write behind ended: its time goes to the stats and the batch's
        latency; a failure is counted."""
        self.behind.discard(ev)
        self.behind_bytes -= ran[2]
        rec = self.staged.pop(ev, None) if self.staged is not None else None
        (rec[3] if rec is not None else give_back)()     # the rows are no page's any more
        self.stats.seconds["host->disk"] += ran[1]
        if error is None:
            self.latency.record(_DIRECTION[HOST][DISK], time.perf_counter() - t_start)
            return
        self.stats.failures["host->disk"] += 1
        if not ran[0]:                  # failed before it ran (a wait before it failed): forget on the thread
            self.io_write.submit(lambda: self._forget(group, slots, error), event=False)
        if self.on_behind_failure is not None:
            self.on_behind_failure(error, batch)

    def _spill(self, src: np.ndarray, src_slots: list[int], group: int, dst_slots: Sequence[int],
               records: np.ndarray) -> None:
        """Host rows to disk, one disk write (journaled by the tier's next commit)
        per chunk of up to SPILL_CHUNK_BYTES, straight from the slab: the
        disk tier writes scattered rows where they are (``index``). If a chunk
        fails, the chunks already written are freed again, so the batch fails
        as a whole and the disk tier holds none of it."""
        per = max(1, SPILL_CHUNK_BYTES // max(1, src.shape[1]))
        done: list[int] = []
        try:
            for a in range(0, len(src_slots), per):
                dst = list(dst_slots[a:a + per])
                self.disk.write(group, dst, src, records[a:a + per], index=_index(src_slots[a:a + per]),
                                durable=False)
                done.extend(dst)
        except BaseException:
            if done:
                self.disk.free(group, done)
            raise

    def _dst_width(self, tier: int, group: int) -> int:
        return self.gpu[group].spec.slot_bytes if tier == GPU else self.cold_bytes[group]

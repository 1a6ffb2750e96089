"""Replaying request traces through a Store, with real page bytes.

Each request opens a sequence on its block keys, acquires the matched pages,
extends the rest, writes their content, commits and closes — what an engine
does per prefill. With ``verify`` every matched page that comes back to the
GPU is checked against the content written when it was first computed.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Sequence

import torch

from tiers.codecs import get_codec
from tiers.errors import KvtierError, OutOfPagesError, RequestTooLargeError

from ..lag import LoopLagMonitor
from ..store import Store
from .content import key_seed, matches, pattern
from .trace import TraceRequest


class PageWriter:
    """Writes and checks deterministic content through the public pool API."""

    __slots__ = ("store", "views", "lossless")

    def __init__(self, store: Store) -> None:
        self.store = store
        self.views = []        # per life cycle: [(layer, offset, size, pool tensor)]
        self.lossless = []
        for lc in store.lcs:
            off, views = 0, []
            for layer, role, size in lc.buffers:
                views.append((layer, off, size, store.pool_tensor(layer, role)))
                off += size
            self.views.append(views)
            self.lossless.append(get_codec(lc.codec).lossless)

    def write(self, seq, blocks: Sequence[int]) -> None:
        for lc, views in enumerate(self.views):
            layer0 = views[0][0]
            slots = seq.page_indices(layer0)
            sel = [b for b in blocks if slots[b] >= 0]
            if not sel:
                continue
            data = pattern([key_seed(seq.keys[b], lc) for b in sel], self.store.lcs[lc].page_bytes)
            idx = torch.as_tensor([slots[b] for b in sel], dtype=torch.long)
            for _, off, size, view in views:
                view.index_copy_(0, idx.to(view.device), data[:, off:off + size].to(view.device))

    def plan(self, seq, blocks: Sequence[int]) -> list[tuple[int, list[int], list[int]]]:
        """On the loop: per life cycle, (seeds, slots) of the pages among
        ``blocks`` that this sequence has locked on the GPU. Only locked
        pages hold still while a worker thread reads them."""
        out = []
        for lc, views in enumerate(self.views):
            layer0 = views[0][0]
            skip = set(seq.recompute_blocks(layer0))
            locked = seq.locked_indices(layer0)
            seeds, slots = [], []
            for b in blocks:
                if locked[b] >= 0 and b not in skip:
                    seeds.append(key_seed(seq.keys[b], lc))
                    slots.append(locked[b])
            if slots:
                out.append((lc, seeds, slots))
        return out

    def check(self, plan: list[tuple[int, list[int], list[int]]]) -> tuple[int, int]:
        """(pages verified, pages wrong); runs on a worker thread."""
        ok = bad = 0
        for lc, seeds, slots in plan:
            views = self.views[lc]
            expected = pattern(seeds, self.store.lcs[lc].page_bytes)
            idx = torch.as_tensor(slots, dtype=torch.long)
            actual = torch.cat([view.index_select(0, idx.to(view.device)).cpu() for _, _, _, view in views], dim=1)
            n_good = int(matches(actual, expected, self.lossless[lc]).sum())
            ok += n_good
            bad += len(slots) - n_good
        return ok, bad


YIELD_EVERY = 256      # a replay of a list yields to the loop at least this often (requests)


@dataclasses.dataclass(slots=True)
class ReplayResult:
    requests: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    hit_by_tier: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    verified_pages: int = 0
    corrupt_pages: int = 0
    errors: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    error_examples: dict = dataclasses.field(default_factory=dict)     # type name -> its first message
    seconds: float = 0.0
    loop_lag_ms: dict = dataclasses.field(default_factory=dict)
    moved: dict = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        b = max(self.blocks, 1)
        return {
            "requests": self.requests, "blocks": self.blocks, "hit_blocks": self.hit_blocks,
            "hit_rate": self.hit_blocks / b,
            "hit_rate_by_tier": {t: self.hit_by_tier[t] / b for t in ("gpu", "host", "disk")},
            "moved": self.moved, "blocks_per_s": self.blocks / self.seconds if self.seconds else 0.0,
            "loop_lag_ms": self.loop_lag_ms, "verified_pages": self.verified_pages,
            "corrupt_pages": self.corrupt_pages, "errors": dict(self.errors),
            "error_examples": dict(self.error_examples), "seconds": round(self.seconds, 3),
        }


async def _each(requests: Iterable[TraceRequest] | AsyncIterable[TraceRequest]) -> AsyncIterator[TraceRequest]:
    """One async loop over a list (the benchmarks') or a stream (the CLI's
    TraceStream); a stream left early is closed, so its file is too."""
    if not isinstance(requests, AsyncIterable):
        for req in requests:
            yield req
        return
    source = aiter(requests)
    try:
        async for req in source:
            yield req
    finally:
        if hasattr(source, "aclose"):
            await source.aclose()


async def _workers(n: int, requests: Iterable[TraceRequest] | AsyncIterable[TraceRequest],
                   each: AsyncIterator[TraceRequest], one: Callable[[TraceRequest], Awaitable[None]],
                   room_wanted: Callable[[], bool]) -> None:
    """Serve ``requests`` in order with ``n`` worker tasks. The first error
    that is not a request's own (those ``one`` counts) stops every worker from
    taking more; the others finish what they hold, then it is raised. Cancelling
    the replay cancels the requests in flight (the store undoes each)."""
    failures: list[BaseException] = []
    lock = asyncio.Lock()
    it = None if isinstance(requests, AsyncIterable) else iter(requests)

    async def take() -> TraceRequest | None:
        async with lock:
            return await anext(each, None)

    async def worker() -> None:
        served, every = 0, max(1, YIELD_EVERY // max(1, n))   # all workers together: YIELD_EVERY requests
        try:
            while not failures:
                # a list's next request without a coroutine of its own (one per request at 32 workers)
                req = next(it, None) if it is not None else await take()
                if req is None or failures:
                    return
                await one(req)
                served += 1
                # a turn of the loop before the next request when requests wait for room (woken by
                # this one's end, they go first), and at least every YIELD_EVERY requests of all the
                # workers (one served from the GPU never waits: back to back they would hold the
                # loop). Not after each: that turn cost concurrency 32 a sixth of its throughput
                if room_wanted() or not served % every:
                    await asyncio.sleep(0)
        except BaseException as exc:        # noqa: BLE001 - kept, raised once every worker is done
            failures.append(exc)
    loop = asyncio.get_running_loop()
    await asyncio.gather(*(loop.create_task(worker()) for _ in range(max(1, n))))
    if failures:
        raise failures[0]


async def replay(store: Store, requests: Iterable[TraceRequest] | AsyncIterable[TraceRequest], *,
                 concurrency: int = 1, honor_timestamps: bool = False, speed: float = 1.0, content: bool = True,
                 verify: bool = True, progress: Callable[[int], None] | None = None) -> ReplayResult:
    """Serve ``requests`` (a list, or an async iterable such as a TraceStream,
    consumed as the replay goes) in order, at most ``concurrency`` at a time."""
    res = ReplayResult()
    writer = PageWriter(store) if content else None
    lag = LoopLagMonitor().start()
    t0 = time.perf_counter()

    finished = asyncio.Condition()
    in_flight = waiting = 0

    def count_error(exc: BaseException) -> None:
        res.errors[type(exc).__name__] += 1
        res.error_examples.setdefault(type(exc).__name__, str(exc))

    async def one(req: TraceRequest) -> None:
        nonlocal in_flight, waiting
        in_flight += 1
        try:
            for attempt in range(8):
                try:
                    await serve(req, first=attempt == 0)
                    break
                except asyncio.CancelledError as exc:
                    task = asyncio.current_task()
                    cancelling = getattr(task, "cancelling", None)      # Python 3.11+
                    if cancelling is None or cancelling():
                        raise                   # the replay (or this request's task) is being cancelled
                    count_error(exc)            # a request that cancelled itself: its own failure
                    break
                except OutOfPagesError as exc:
                    # the pool is locked by requests in flight: wait for one to finish, as a server queues;
                    # not when every other request in flight waits too (nobody would finish to wake them)
                    if in_flight - waiting <= 1 or attempt == 7 or isinstance(exc, RequestTooLargeError):
                        count_error(exc)
                        break
                    waiting += 1
                    try:
                        async with finished:
                            await finished.wait()
                    finally:
                        waiting -= 1
        finally:
            in_flight -= 1
            if waiting:                     # wake the requests that wait for room, only when there are some
                async with finished:
                    finished.notify_all()
        if progress is not None:
            progress(1)

    async def serve(req: TraceRequest, first: bool) -> None:
        keys = req.hash_ids
        seq = await store.open_sequence(block_keys=keys)
        if first:
            res.requests += 1
            res.blocks += len(keys)
            if seq.matched_blocks:
                res.hit_blocks += seq.matched_blocks
                by_tier = res.hit_by_tier
                for tier, n in seq.matched_by_tier.items():     # Counter.update costs more than the store's open
                    by_tier[tier] += n
        try:
            await seq.acquire()
            if writer is not None and verify and seq.matched_blocks:
                ok, bad = await asyncio.to_thread(writer.check, writer.plan(seq, range(seq.matched_blocks)))
                res.verified_pages += ok
                res.corrupt_pages += bad
            start = seq.num_blocks
            await seq.extend(len(keys) - start)
            if writer is not None:
                redo = sorted({b for lc in store.lcs for b in seq.recompute_blocks(lc.layers[0].id)})
                await asyncio.to_thread(writer.write, seq, list(range(start, len(keys))) + redo)
            seq.commit(len(keys))
            await seq.release()
        except OutOfPagesError:
            raise
        except KvtierError as exc:
            count_error(exc)
        finally:
            if not seq.closed:
                await seq.close()

    each = _each(requests)
    try:
        if concurrency <= 1 and not honor_timestamps:
            # one at a time: nothing to wait for on OutOfPagesError (a list skips the async iterator)
            async def alone(req: TraceRequest) -> None:
                try:
                    await serve(req, first=True)
                except OutOfPagesError as exc:
                    count_error(exc)
                if progress is not None:
                    progress(1)
            if isinstance(requests, AsyncIterable):
                async for req in each:
                    await alone(req)
            else:
                for i, req in enumerate(requests, 1):
                    await alone(req)
                    if not i % YIELD_EVERY:     # requests served from the GPU never suspend: let others run
                        await asyncio.sleep(0)
        elif not honor_timestamps:
            # `concurrency` workers, each taking the next request when its last one ends: no task
            # and no semaphore per request (a stream is read under a lock: one reader at a time)
            await _workers(concurrency, requests, each, one, lambda: waiting > 0)
        else:
            # at most `concurrency` requests in flight, each started at its time: the next starts
            # when one ends (no task waits in a queue of its own, so a finishing request costs
            # O(1), not a pass over all of them)
            room = asyncio.Semaphore(max(1, concurrency))
            loop = asyncio.get_running_loop()
            running: set[asyncio.Task] = set()
            failures: list[BaseException] = []

            def ended(t: asyncio.Task) -> None:
                running.discard(t)
                room.release()
                if not t.cancelled() and t.exception() is not None:
                    failures.append(t.exception())
            base: float | None = None
            try:
                async for req in each:
                    if failures:
                        break
                    base = req.timestamp if base is None else base
                    delay = (req.timestamp - base) / 1000.0 / speed - (time.perf_counter() - t0)
                    if delay > 0:
                        await asyncio.sleep(delay)
                    await room.acquire()
                    t = loop.create_task(one(req))
                    running.add(t)
                    t.add_done_callback(ended)
            finally:                            # a stream can fail mid-trace: let the requests in flight end first
                if running:
                    await asyncio.gather(*running, return_exceptions=True)
            if failures:
                raise failures[0]
    finally:
        await each.aclose()
        res.seconds = time.perf_counter() - t0
        await lag.stop()
    res.loop_lag_ms = lag.percentiles_ms()
    res.moved = store.stats()["moves"]
    return res

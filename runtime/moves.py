"""The store's page moves: claims, slots obtained with eviction, the demotion cascade, batch
moves through the migration engine, and the disk work the core asks for.

``Store`` (``runtime/store.py``) keeps the request API; what runs moves (a sequence's
acquires, prefetches and extends in ``sequence.py``, background demotion in ``reclaim.py``,
recovery and persisting in ``recovery.py``, write-through, the remote tier's imports) calls
this module's public methods through ``store.moves``. It also counts the store's tasks: close and drain wait for them.

Rules the code keeps:
- after every core call that can free disk slots or publish disk pages, ``sync`` submits them
  before anything awaits;
- a claimed page (in flight) is awaited through its claim's future; the operation that claimed
  it settles that future when it lands or fails.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
from operator import attrgetter
from typing import TYPE_CHECKING, Coroutine

import numpy as np
import torch

from tiers.errors import CorruptPageError, DiskFullError, OutOfPagesError
from tiers.journal import RECORD

from .core import Pages
from .migration import Batch
from .pages import DISK, GPU, HOST, TIER_NAMES
from .readiness import ended
from .reclaim import Reclaimer

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("kvtier")
REFILL_WAITS = 2                 # landings the first in line waits for before it evicts for itself


class _Tee:
    """A batch's write-through to the remote tier: the bytes of its reservation, held until the
    engine hands over the landed rows (``write``; from then on the remote's), released if the
    batch fails or lands without the tee running (its copy failed: nothing to write)."""

    __slots__ = ("remote", "reserved", "pages", "records")

    def __init__(self, remote, nbytes: int, pages: int, records: np.ndarray) -> None:
        self.remote, self.reserved, self.pages, self.records = remote, nbytes, pages, records

    def write(self, rows: torch.Tensor) -> None:
        nbytes, self.reserved = self.reserved, 0    # write_through owns the reservation from here, and releases it
        try:
            self.remote.write_through(self.records, rows, nbytes)
        except Exception:           # noqa: BLE001 - it never got to its own release
            self.remote.release(nbytes)
            raise

    def release(self) -> None:
        if self.reserved:
            self.remote.release(self.reserved)
            self.reserved = 0

    def landed(self) -> None:
        if self.reserved:
            self.release()
            self.remote.skipped_pages += self.pages


class _FreeBatch:
    """The disk frees of one job on the write stream. The loop joins frees to it until the
    job starts; the lock makes "not started yet, so joined" and "started, so taken" exclusive."""

    __slots__ = ("frees", "lock", "started", "mark")

    def __init__(self, group: int, slots: list[int]) -> None:
        self.frees = [(group, slots)]
        self.lock = threading.Lock()
        self.started = False
        self.mark = -1                  # the stream's submission count just after this job was queued

    def join(self, group: int, slots: list[int]) -> bool:
        with self.lock:
            if self.started:
                return False
            self.frees.append((group, slots))
            return True

    def take(self) -> list[tuple[int, list[int]]]:
        with self.lock:
            self.started = True
            return self.frees


class _InLine:
    """A request waiting in a (tier, group)'s line for slots: ``turn`` is set when it comes first."""
    __slots__ = ("need", "turn")

    def __init__(self, need: int) -> None:
        self.need = need
        self.turn: asyncio.Future | None = None


class Moves:
    """The moves of one store (see the module docstring). The parts it moves pages between
    (core, engine, disk, remote tier) are the store's."""

    def __init__(self, store: "Store") -> None:
        self.store = store
        self.tasks: set[asyncio.Task] = set()
        self._free_batch: _FreeBatch | None = None      # the last free job's batch (see _disk_free)
        # (tier, group) -> slots that demotions in flight will give back to the free pool (the
        # reclaimer's batches and on-demand evictions' extra): what refills the reserve already
        self.refilling: dict[tuple[int, int], int] = {}
        self._refill_waiters: dict[tuple[int, int], asyncio.Future] = {}
        # (tier, group) -> the requests short of slots there, first come first served (see obtain)
        self.lines: dict[tuple[int, int], collections.deque[_InLine]] = {}
        self.line_batch: dict[int, int] = {}       # tier -> most slots a demotion batch takes beyond its own need
        self.corrupt_pages = 0             # pages a read found damaged: dropped, their blocks recomputed
        self.disk_full_events = 0          # spills the full filesystem refused ...
        self.disk_full_dropped = 0         # ... and the evicted pages dropped instead
        self.behind_failures = 0           # spills written behind whose write failed (not a full disk)
        self._said: dict[str, float] = {}  # warning kind -> when it was last logged (_once_a_minute)

    # -- the store's parts (read through it: they exist once it has started) ---------------------
    core = property(attrgetter("store.core"))
    engine = property(attrgetter("store.engine"))
    disk = property(attrgetter("store.disk"))
    remote = property(attrgetter("store.remote"))
    write_throughs = property(attrgetter("store.write_throughs"))
    claims = property(attrgetter("store.claims"))
    events = property(attrgetter("store.events"))
    reclaimers = property(attrgetter("store.reclaimers"))
    next_tier = property(attrgetter("store.next_tier"))
    closed = property(attrgetter("store.closed"))
    loop = property(attrgetter("store.loop"))

    # -- tasks -----------------------------------------------------------------------------------
    def spawn(self, coro: Coroutine) -> asyncio.Task:
        """A task on the store's loop, counted (close and drain wait for it)."""
        return self.track(self.loop.create_task(coro))

    def track(self, task: asyncio.Task) -> asyncio.Task:
        """Count ``task`` among the store's (close and drain wait for them)."""
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def behind_written(self) -> None:
        """Wait until no spill written behind is in flight (each written or failed)."""
        while self.engine.behind:
            await ended(next(iter(self.engine.behind)), self.loop)
            await asyncio.sleep(0)      # its _behind_done (scheduled before the waiter woke) ran

    async def wait_tasks(self) -> None:
        """Wait for the store's tasks to end. ``asyncio.wait``, not ``gather``:
        a waiter that is cancelled must not cancel the moves it waits for."""
        if self.tasks:
            await asyncio.wait(list(self.tasks))

    # -- what the core asks of the disk ---------------------------------------------------------
    def sync(self) -> None:
        """Submit the disk frees and relabels the core decided on, in order
        with the writes that may reuse those slots (before anything awaits)."""
        if self.disk is None:
            return
        core = self.core
        for g, slots in core.take_disk_frees():
            self._disk_free(g, slots)
        for g, slots, pages in core.take_relabels():
            records = self.records(pages)
            self.engine.io_write.submit(lambda g=g, slots=slots, records=records:
                                        self.disk.relabel(g, slots, records, durable=False), event=False)

    def _disk_free(self, group: int, slots: list[int]) -> None:
        """Forget disk slots, in order with the other work of the write stream. Frees gather
        into one job: a free joins the last free job while that job has not started and
        nothing else was submitted to the stream after it (a relabel or a write queued since
        must keep running before the frees made after it). So the disk thread takes the GIL
        once for many frees, each time a wait behind a busy loop."""
        stream = self.engine.io_write
        batch = self._free_batch
        if batch is not None and stream.queued == batch.mark and batch.join(group, slots):
            return
        batch = _FreeBatch(group, slots)
        stream.submit(lambda: self._apply_disk_frees(batch), event=False)
        batch.mark = stream.queued
        self._free_batch = batch

    def _apply_disk_frees(self, batch: "_FreeBatch") -> None:
        """On the disk write thread: one batch of frees (see _disk_free), one ``DiskTier.free``
        per group (each call's checks cost more than its slots: 1,100 calls of 100 us a replay).
        A call that fails has changed nothing; its frees then go one by one, as before."""
        per_group: dict[int, list[list[int]]] = {}
        for group, slots in batch.take():
            per_group.setdefault(group, []).append(slots)
        for group, parts in per_group.items():
            if len(parts) > 1:
                try:
                    self.disk.free(group, [s for part in parts for s in part])
                    continue
                except Exception as exc:    # noqa: BLE001 - the parts alone say which one is wrong
                    log.debug("merged disk free of group %d failed (%r): freeing its %d parts one by one",
                              group, exc, len(parts))
            for slots in parts:
                try:
                    self.disk.free(group, slots)
                except Exception as exc:    # noqa: BLE001 - as a job of its own would: logged, the rest go on
                    log.warning("%s: background job failed: %r", self.engine.io_write.name, exc)

    def records(self, pages: Pages) -> np.ndarray:
        """The disk journal records of ``pages`` (anonymous for uncommitted ones), one array."""
        return np.frombuffer(self.core.disk_records(pages), dtype=RECORD)

    # -- claims, eviction and moves ------------------------------------------------------------
    def drop_for(self, n: int) -> bool:
        """A GPU-only store makes room for ``n`` more blocks by dropping its
        least recent pages, synchronously (a drop waits for nothing): the
        common eviction of such a store without a task. False, with nothing
        dropped, where some group lacks the victims (the slow path reports it)."""
        core = self.core
        short = {g: n * k - core.free(GPU, g) for g, k in self.store.lcs_per_gpu_group.items()}
        short = {g: k for g, k in short.items() if k > 0}
        if any(core.queue_len(GPU, g) < k for g, k in short.items()):
            return False
        for g, k in short.items():
            victims, _ = core.pick_victims(GPU, g, k, 0)     # no futures: nothing can wait on them
            claims, freed = core.drop_victims(GPU, victims)
            self.claims.settle(claims)
            core.give_back(GPU, g, freed)                    # each with the fence of its last reader
        return True

    def claim(self, pages: Pages, to_tier: int, propagate: bool = True) -> None:
        """Mark pages as moving: one claim per batch the move will run
        (source tier and group, destination group); waiters on a promotion
        get its error when ``propagate``."""
        self.claims.open(self.core.claim(pages, to_tier, False), to_tier == GPU and propagate)

    def unclaim(self, pages: Pages, exc: BaseException | None) -> None:
        self.claims.settle(self.core.unclaim(pages), exc)
        self.sync()

    async def obtain_many(self, tier: int, counts) -> dict[int, list[int]]:
        """Slots in several groups of one tier, all or none; ``counts`` is a
        {group: n} dict or (group, n) pairs."""
        got: dict[int, list[int]] = {}
        items = counts.items() if isinstance(counts, dict) else counts
        try:
            for g, n in sorted(items):      # one order for every caller: no two wait on each other's line
                got[g] = await self.obtain(tier, g, n)
        except BaseException:
            for g, slots in got.items():
                self.core.give_back(tier, g, slots)
            raise
        return got

    async def obtain(self, tier: int, group: int, n: int) -> list[int]:
        """``n`` free slots, evicting (and cascading) as needed.

        A request that finds enough slots free takes them at once (as the Sequence's fast
        paths do). Requests short of slots wait in line, first come first served: only the
        head evicts, for itself and, in the same batch, for some of the demand behind it.
        Without the line, concurrent requests each took what was free (none got enough), each
        ran a small eviction of its own and all woke on every landing: at concurrency 32 that
        was 64 k wake-ups and 2.4x the batches of concurrency 1 for the same moves."""
        core = self.core
        reclaimer = self.reclaimers.get((tier, group))
        if reclaimer is not None:
            reclaimer.kick_after(n)
        if n <= core.free(tier, group):
            return core.allocate(tier, group, n)
        key = (tier, group)
        line = self.lines.get(key)
        if line is None:
            line = self.lines[key] = collections.deque()
        me = _InLine(n)
        line.append(me)
        try:
            if len(line) > 1:
                me.turn = self.loop.create_future()
                await me.turn
            return await self._obtain_first(tier, group, n, reclaimer, line)
        finally:
            head = line[0] is me
            line.remove(me)
            if head and line and line[0].turn is not None and not line[0].turn.done():
                line[0].turn.set_result(None)

    async def _obtain_first(self, tier: int, group: int, n: int, reclaimer: Reclaimer | None,
                            line: collections.deque[_InLine]) -> list[int]:
        """``obtain`` for the head of the line."""
        core = self.core
        key = (tier, group)
        got = core.allocate(tier, group, min(n, core.free(tier, group)))
        landings = 0
        try:
            while len(got) < n:
                short = n - len(got)
                if self.refilling.get(key, 0) >= short and landings < REFILL_WAITS:
                    # demotions in flight will give back enough: wait for them rather than run a
                    # small batch of our own (a few times: requests that find slots free take
                    # them too, so landed slots may go elsewhere; then it evicts its own)
                    await self._refill_landed(key)
                    landings += 1
                else:
                    # evicting on demand: for the requests behind in line too, and to refill the
                    # background reserve, less what demotions in flight will give back. The
                    # extra is capped (line_batch): a batch larger than the next tier can make
                    # room for would skip that tier whole, dropping newer pages where a smaller
                    # batch would have pushed out the next tier's oldest
                    behind = sum(w.need for w in line) - n
                    extra = min(max(0, behind + (reclaimer.high if reclaimer is not None and reclaimer.running else 0)
                                    - self.refilling.get(key, 0)), self.line_batch[tier])
                    # pages the background demotion or a write-through copy has claimed are not
                    # evictable, but they are again when it finishes: wait for that rather than fail
                    wt = next((w for t, w in self.write_throughs.items() if t > tier and not w.idle.is_set()),
                              None)
                    busy = reclaimer.idle if reclaimer is not None and reclaimer.busy else \
                        wt.idle if wt is not None else None
                    victims = self.pick_victims(tier, group, short, extra, raise_=busy is None)
                    if victims is None:
                        await busy.wait()
                    else:
                        spare = len(victims) - short
                        self.refilling_add(key, spare)
                        try:
                            freed = await self.evict(tier, victims)
                            if len(freed) > short:      # back to the pool, each with the fence of its last reader
                                core.give_back(tier, group, freed[short:])
                        finally:
                            self.refilling_add(key, -spare)
                        return got + freed[:short]
                got += core.allocate(tier, group, min(core.free(tier, group), n - len(got)))
            return got
        except BaseException:
            core.give_back(tier, group, got)
            raise

    def refilling_add(self, key: tuple[int, int], n: int) -> None:
        """Count ``n`` more (or, negative, fewer) slots that demotions in flight will give back
        to (tier, group)'s pool; when it falls, wake the requests waiting for them."""
        if not n:
            return
        self.refilling[key] = self.refilling.get(key, 0) + n
        if n < 0:
            fut = self._refill_waiters.pop(key, None)
            if fut is not None and not fut.done():
                fut.set_result(None)

    async def _refill_landed(self, key: tuple[int, int]) -> None:
        """Wait until a demotion in flight for (tier, group) lands (or fails)."""
        fut = self._refill_waiters.get(key)
        if fut is None or fut.done():
            fut = self._refill_waiters[key] = self.loop.create_future()
        await asyncio.shield(fut)       # a cancelled waiter leaves the others' future alone

    def pick_victims(self, tier: int, group: int, need: int, extra: int = 0, raise_: bool = True) -> Pages | None:
        """Claim ``need`` victims plus up to ``extra`` more if the queue has
        them; if fewer than ``need`` are evictable, nothing is claimed and
        OutOfPagesError is raised (None without ``raise_``).

        A demotion in a group with a background reserve takes at least one refill step
        (within the line batch) where the queue has it: each batch costs the loop fixed
        work and thread hand-offs, and at concurrency 32 demand evictions of a few pages
        each had made 1.5x the batches of concurrency 1. The pages demoted early live on
        in the next tier; their slots wait free, as the reserve's do."""
        core = self.core
        reclaimer = self.reclaimers.get((tier, group))
        if reclaimer is not None and reclaimer.running and self.next_tier[tier] is not None:
            extra = max(extra, min(reclaimer.step, self.line_batch[tier]) - need)
        picked = core.pick_victims(tier, group, need, extra)
        if picked is None:
            if not raise_:
                return None
            raise OutOfPagesError(f"{TIER_NAMES[tier]} pool group {group}: need {need} more slots, "
                                  f"{core.free(tier, group)} free of {core.capacity(tier, group)} "
                                  f"and only {core.queue_len(tier, group)} evictable")
        victims, claims = picked
        self.claims.open(claims, False)
        return victims

    async def evict(self, tier: int, victims: Pages) -> list[int]:
        """Demote (or, in the last tier, drop) claimed victims; their slots go to the caller.
        Under write-through, the clean copies among the victims leave first (their primaries
        stay), and victims that have a copy in the tier they go to take over their copy's slot:
        no bytes move (a full next tier sending them on to the disk included)."""
        if not victims:
            return []
        group = self.core.group_counts(victims, tier)[0][0]     # the victims' (one) group
        handed: list[int] = []
        try:
            return await self._evict_claimed(tier, victims, handed)
        except BaseException:
            # slots of victims that needed no move or landed before the failure: nobody takes them now
            self.core.give_back(tier, group, handed)
            raise

    def _swap_to_copies(self, victims: Pages, to: int, handed: list[int]) -> Pages:
        """``core.swap_to_copies``: the slots it frees join ``handed``; the victims left to move."""
        claims, slots, rest = self.core.swap_to_copies(victims, to)
        self.claims.settle(claims)
        self.sync()
        handed += slots
        return rest

    def _may_swap(self, tier: int, to: int) -> bool:
        """Whether victims leaving ``tier`` may swap onto their copies in ``to`` before trying to
        move. Not GPU pages onto copies the remote's write-through never saw: it tees copies only
        in the tier the GPU demotes to (write_through), and sees a page leave the GPU by its
        move's bytes, so a GPU page skipping a full host onto its disk copy moves (the landing
        frees the copy); only if the disk refuses the move does it swap (``_evict_claimed``)."""
        remote = self.remote
        return (tier != GPU or to == self.next_tier[GPU] or remote is None
                or remote.settings.write != "through")

    async def _evict_claimed(self, tier: int, victims: Pages, done: list[int]) -> list[int]:
        """``evict``; ``done`` collects the slots of victims that need no move (and of those that
        landed, if others fail), and the result starts with them."""
        nxt = self.next_tier[tier]
        swaps = bool(self.write_throughs)
        declined: int | None = None         # a tier whose copies the victims did not swap onto (_may_swap)

        def swap_declined() -> Pages:
            """The victims' last chance before a drop or an error: the copies they passed over."""
            return self._swap_to_copies(victims, declined, done) if declined is not None else victims

        if swaps:
            victims = self._swap_to_copies(victims, tier if nxt is None else nxt, done)
            if not victims:
                return done
        while nxt is not None:
            try:
                slots = await self.obtain_many(nxt, self.core.group_counts(victims, nxt))
            except OutOfPagesError:
                # the next tier is full of locked, held or in-flight pages: skip to a colder one
                # (cold groups are the same in host and disk); drop only when none can take them
                victims = swap_declined()
                declined = None
                if not victims:
                    return done
                nxt = self.next_tier[nxt]
                if nxt is not None and swaps:
                    if self._may_swap(tier, nxt):
                        victims = self._swap_to_copies(victims, nxt, done)
                        if not victims:
                            return done
                    else:
                        declined = nxt
                if nxt is None and not self.core.droppable(victims):
                    self.unclaim(victims, None)
                    raise
            except BaseException:
                self.unclaim(victims, None)
                raise
            else:
                # a batch the full disk refuses keeps its claims (hold_full): nothing else may take
                # its pages while the other batches finish, as they may be dropped below
                freed, failed, _src = await self._move_batches(victims, nxt, slots, handoff=True, hold_full=True)
                done += freed
                if not failed:
                    return done
                held = [(b, e) for b, e in failed if isinstance(e, DiskFullError)]     # still claimed
                victims = Pages([i for b, _ in held for i in b.tolist()])
                if len(held) < len(failed):         # another error: the refused pages stay where they are
                    if victims:
                        self.unclaim(victims, held[0][1])
                    raise next(e for _, e in failed if not isinstance(e, DiskFullError))
                # the filesystem takes no more: the disk keeps what it has (the batches that landed
                # included); refused victims swap onto the copies they passed over, and those that
                # are only cached pages are dropped instead of spilled (a later spill retries)
                exc = held[0][1]
                victims = swap_declined()
                if victims and not self.core.droppable(victims):
                    self._disk_full(exc, 0)
                    self.unclaim(victims, exc)
                    raise exc
                self._disk_full(exc, len(victims))      # (counted as dropped: those not swapped)
                if not victims:
                    return done
                break
        if self.remote is not None and self.remote.settings.write == "back" and tier != GPU:
            try:
                await self.remote.write_back(victims)   # to the server before the drop (still claimed)
            except BaseException:
                self.unclaim(victims, None)
                raise
        claims, freed = self.core.drop_victims(tier, victims)
        self.claims.settle(claims)
        self.sync()
        return done + freed

    def behind_failed(self, exc: BaseException, batch: Batch) -> None:
        """A spill written behind failed after its pages landed (migration._spill_behind): the
        disk tier forgot their slots; the pages are dropped (a miss from now on, as after a
        refused spill), but for any a read has claimed meanwhile, which that read drops."""
        if self.closed:
            return                      # closing waited for the writes: nothing is served any more
        self.core.discard_unwritten(batch.pages, batch.ready_id)
        self.sync()
        if isinstance(exc, DiskFullError):
            self._disk_full(exc, len(batch))
            return
        self.behind_failures += 1
        if self._once_a_minute("write behind failed"):
            log.warning("a disk write of %d spilled page(s) failed after they landed: %r; they are dropped "
                        "(%d such write(s) so far)", len(batch), exc, self.behind_failures)

    def _once_a_minute(self, kind: str) -> bool:
        """Whether a warning of ``kind`` may be logged now (at most once a minute each)."""
        now = self.loop.time()
        if now - self._said.get(kind, float("-inf")) < 60.0:
            return False
        self._said[kind] = now
        return True

    def _disk_full(self, exc: DiskFullError, dropped: int) -> None:
        """Count a spill the full filesystem refused, and say so (once a minute at most)."""
        self.disk_full_events += 1
        self.disk_full_dropped += dropped
        if self._once_a_minute("disk full"):
            log.warning("disk tier is full (%s): evicted pages are dropped instead of spilled until it has "
                        "room again; %d spill(s) refused so far", exc, self.disk_full_events)

    async def move(self, pages: Pages, dst_tier: int, slots: dict[int, list[int]],
                   handoff: bool) -> list[int]:
        """Move claimed pages into ``slots`` (per destination group). Batches
        run concurrently, one per (source tier, source group, destination
        group). With ``handoff`` the source slots are returned to the caller
        instead of freed. On failure every batch's claims are settled and the
        first error is raised (after the others finish)."""
        freed, failed, src = await self._move_batches(pages, dst_tier, slots, handoff)
        if failed:
            if handoff and freed:     # source slots of the batches that did move: nobody takes them now
                self.core.give_back(*src, freed)
            raise failed[0][1]
        return freed

    async def _move_batches(self, pages: Pages, dst_tier: int, slots: dict[int, list[int]], handoff: bool,
                            hold_full: bool = False) -> tuple[list[int], list[tuple[Pages, BaseException]],
                                                              tuple[int, int]]:
        """``move``'s batches: the source slots the landed ones freed (``handoff``), each batch
        that failed with its error (its pages unclaimed, still in their source tier; with
        ``hold_full``, those the full disk refused still claimed: the caller settles them), and
        the source (tier, group), one for all. Cancelled, it cancels the batches; the source
        slots of those that had landed go back, and held claims end."""
        batches = self.core.split_batches(pages, dst_tier)
        src = batches[0][0], batches[0][1]
        if len(batches) == 1:           # the common case, one batch: no task, no gather
            _, _, g, batch = batches[0]
            try:
                return (await self._move_batch(batch, dst_tier, g, sorted(slots[g][:len(batch)]), handoff,
                                               hold_full), [], src)
            except Exception as exc:
                return [], [(batch, exc)], src
        jobs = []
        for _, _, g, batch in batches:
            mine = sorted(slots[g][:len(batch)])
            del slots[g][:len(batch)]
            jobs.append((batch, self.spawn(self._move_batch(batch, dst_tier, g, mine, handoff, hold_full))))
        try:
            await asyncio.wait([j for _, j in jobs])
        except BaseException:
            for batch, j in jobs:
                j.cancel()
                j.add_done_callback(lambda j, batch=batch: self._abandoned(j, batch, src, handoff, hold_full))
            raise
        freed: list[int] = []
        failed: list[tuple[Pages, BaseException]] = []
        for batch, j in jobs:
            exc = j.exception() if not j.cancelled() else asyncio.CancelledError()
            if exc is None:
                freed.extend(j.result())
            elif isinstance(exc, Exception):
                failed.append((batch, exc))
            else:                       # a batch cancelled on its own (the store closing): as the first error
                failed.insert(0, (batch, exc))
        return freed, failed, src

    def _abandoned(self, job: asyncio.Task, batch: Pages, src: tuple[int, int], handoff: bool,
                   hold_full: bool) -> None:
        """A batch of a move cancelled while it ran, once it ends: the source slots it freed go
        back (``handoff``); the claims it held (a refusal under ``hold_full``) end."""
        if job.cancelled():
            return
        exc = job.exception()           # retrieved, either way
        if exc is None:
            if handoff:
                self.core.give_back(*src, job.result())
        elif hold_full and isinstance(exc, DiskFullError):
            self.unclaim(batch, exc)

    def tee_to_remote(self, job: Batch, batch: Pages, group: int) -> "_Tee | None":
        """Remote write-through: the bytes of a batch leaving the GPU (a demotion, or a clean
        copy to a cold tier's ``group``) also go to the server, from the rows the engine landed
        (``job.tee``). None when there is nothing to tee; the caller calls ``release`` if the
        batch fails, ``landed`` once it landed."""
        remote = self.remote
        if remote is None or remote.settings.write != "through" or job.src_tier != GPU:
            return None
        page = self.engine.cold_bytes[group]
        records = self.records(batch)               # now: the claim keeps these pages as they are
        rows = remote.send(records, page)
        if rows is None:
            return None
        tee = _Tee(remote, len(rows) * page, len(rows), records[rows])
        job.tee, job.tee_rows = tee.write, rows
        return tee

    async def _move_batch(self, batch: Pages, dst_tier: int, g: int, dst_slots: list[int],
                          handoff: bool, hold_full: bool = False) -> list[int]:
        """One batch; on failure its destination slots go back and its claims end, but with
        ``hold_full`` a batch the full disk refused keeps them (``_move_batches``)."""
        core = self.core
        tee = src_tier = None
        try:        # the setup too: whatever raises, the batch's slots go back and its claims end
            src_tier, src_group, src_slots, lcs, ready = core.batch_view(batch)
            fences = self.events.all(core.slot_fences(dst_tier, g, dst_slots))
            self.sync()
            job = Batch(src_tier, src_group, src_slots, lcs, set(self.events.all(ready)),
                        lambda: self.records(batch))
            # a spill of pages the store may lose is written behind (migration._spill_behind); not
            # with a remote tier, whose write-back reads disk victims before their drop
            job.behind = src_tier == HOST and dst_tier == DISK and self.remote is None and core.droppable(batch)
            tee = self.tee_to_remote(job, batch, g)
            ev = await self.engine.run(job, dst_tier, g, dst_slots, fences)
        except BaseException as exc:
            if tee is not None:
                tee.release()
            src_name = "?" if src_tier is None else TIER_NAMES[src_tier]
            self.engine.stats.failures[f"{src_name}->{TIER_NAMES[dst_tier]}"] += 1
            core.give_back(dst_tier, g, dst_slots)
            if not (hold_full and isinstance(exc, DiskFullError)):
                self.unclaim(batch, exc)
            if isinstance(exc, CorruptPageError):
                depths = core.discard_corrupt(batch, list(getattr(exc, "slots", ())))
                self.corrupt_pages += len(depths)
                log.warning("dropped %d corrupt disk page(s) at depths %s: their blocks will be recomputed",
                            len(depths), sorted(depths)[:16])
                self.sync()
            raise
        if tee is not None:
            tee.landed()
        ready = self.events.id(ev, keep=job.released)     # a write behind may have failed already
        if job.released:
            job.pages, job.ready_id = batch, ready
        claims, freed = core.land(batch, dst_tier, g, dst_slots, ready, handoff, 0 if job.released else None)
        self.claims.settle(claims)
        self.sync()
        return freed

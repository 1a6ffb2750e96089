"""A sequence: one request's view of the store (its blocks and their pages), and its
operations: extend, acquire, prefetch, commit, release and close, each one call into the
native core, with the moves it needs through ``store.moves`` and cancellation that leaks
nothing (``_run_exclusive``)."""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Sequence as Seq

import numpy as np
import torch

from tiers.errors import (CorruptPageError, KvtierError, OutOfPagesError, RequestTooLargeError, StoreClosedError,
                          UsageError)
from tiers.streams import CudaEvent

from .core import COMMIT_PAST_BLOCKS, CoreError, Pages
from .keys import BlockKey, check_block_keys, hash_blocks, token_array
from .loop import start_eagerly
from .pages import GPU
from .readiness import wait_events
from .views import PageView, page_rows

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("kvtier")


# A call on a sequence this long yields to the event loop once before its core call (which
# runs a few hundred microseconds per thousand blocks): one long request's operations do not
# run back to back without a yield. Before, so a caller cancelled there has changed nothing;
# close() yields after instead, so that a cancelled close still closes (nothing leaks).
LONG_BLOCKS = 1024


class Sequence:
    """Returned by ``Store.open_sequence``. Methods mirror DESIGN.md §3 and do
    their work through the native core and ``store.moves``. The sequence's blocks
    and pages live in the core under ``sid``; this object holds its keys and
    asyncio state."""

    __slots__ = ("store", "sid", "keys", "tail", "num_tokens", "priority", "matched_blocks", "_by_tier", "_remote",
                 "closed", "busy", "task", "final_committed")

    def __init__(self, store: "Store", sid: int, keys: list[BlockKey], tokens: np.ndarray | None,
                 priority: int, matched: int = 0, by_tier: tuple = (0, 0, 0, 0), remote: int | None = None) -> None:
        self.store = store
        self.sid = sid
        self.keys = keys
        if tokens is None:
            self.tail = None
            self.num_tokens = 0
        else:   # opened with tokens: those after the last full block, kept to hash the next one (append)
            self.tail = tokens[len(keys) * store.tpb:].copy()
            self.num_tokens = len(tokens)
        self.priority = priority
        self.matched_blocks = matched
        self._by_tier = by_tier                 # the core's count per tier of the coldest matched page
        self._remote = remote                   # blocks imported from the remote tier (None: no remote tier)
        self.closed = False
        self.busy = False
        self.task = None                        # the running acquire/extend (it outlives a cancelled caller)
        self.final_committed = 0                # committed blocks when it closed

    @property
    def matched_by_tier(self) -> dict[str, int]:
        """Matched blocks by the tier their coldest page was in at open: "gpu", "host", "disk"
        and "remote" (always all four keys; "remote" is 0 without a remote tier). "remote"
        counts the blocks imported from the remote tier (they are on the host now, and not
        counted there)."""
        gpu, host, disk = self._by_tier[0], self._by_tier[1], self._by_tier[2]
        remote = self._remote or 0
        return {"gpu": gpu, "host": host - min(remote, host), "disk": disk, "remote": remote}

    @property
    def committed(self) -> int:
        """Blocks published (or matched) so far."""
        return self.final_committed if self.closed else self.store.core.committed(self.sid)

    @property
    def acquired(self) -> bool:
        return not self.closed and self.store.core.acquired(self.sid)

    @property
    def pages(self) -> list[list[PageView | None]]:
        """A snapshot of the sequence's pages, per block and life cycle
        (for tests and tools; not for hot paths)."""
        return [] if self.closed else page_rows(self.store.core, self.sid, len(self.store.lcs))

    # -- state checks -------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise StoreClosedError("sequence is closed")
        if self.store.closed:
            raise StoreClosedError("store is closed")

    def _open_with(self, stream) -> "Store":
        """The store, once the sequence and the store are open and ``stream`` is usable."""
        store = self.store
        if self.closed or store.closed:
            self._check_open()
        if stream is not None:
            _check_stream(store, stream)
        return store

    @property
    def num_blocks(self) -> int:
        """Blocks with pages (matched + extended)."""
        return 0 if self.closed else self.store.core.num_blocks(self.sid)

    # -- public API -----------------------------------------------------------------
    def append(self, tokens: Seq[int] | None = None, block_keys: Seq[BlockKey] | None = None) -> None:
        """Make more blocks committable: generated tokens, or their block keys."""
        self._check_open()
        if (tokens is None) == (block_keys is None):
            raise UsageError("pass exactly one of tokens= or block_keys=")
        if block_keys is not None:
            keys = check_block_keys(block_keys)
            if keys and self.keys and type(keys[0]) is not type(self.keys[0]):
                raise UsageError("appended block keys must have the same type as the sequence's")
            if self.tail is not None:
                raise UsageError("this sequence was opened with tokens; append tokens")
            self._append_keys(keys)
            return
        if self.tail is None:
            raise UsageError("this sequence was opened with block_keys; append block_keys")
        new = token_array(tokens)                  # raises before anything changes
        tpb = self.store.cfg.tokens_per_block
        pending = np.concatenate([self.tail, new])
        parent = self.keys[-1] if self.keys else b""
        keys = hash_blocks(pending, tpb, self.store.cfg.hash_salt, parent)
        first = len(self.keys)
        self._append_keys(keys)
        if self.store.kv_events is not None:
            self.store.kv_events.tokens(self.sid, first, pending[:len(keys) * tpb])
        self.tail = pending[len(keys) * tpb:].copy()
        self.num_tokens += len(new)

    def _append_keys(self, keys: list[BlockKey]) -> None:
        try:
            self.store.core.append_keys(self.sid, keys)
        except (ValueError, TypeError) as exc:      # a key the core cannot hold: nothing changed
            raise UsageError(str(exc)) from None
        self.keys.extend(keys)

    async def extend(self, num_blocks: int) -> None:
        """New GPU pages for ``num_blocks`` blocks after the current ones."""
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
            raise UsageError(f"num_blocks must be a non-negative integer, got {num_blocks!r}")
        if len(self.keys) >= LONG_BLOCKS or num_blocks >= LONG_BLOCKS:
            await asyncio.sleep(0)
        self._check_open()
        if self.busy:
            raise UsageError("another acquire or extend of this sequence is running")
        fences = self._extend_now(num_blocks)
        if fences is not None:
            if fences:
                # its new slots' fences (copies still reading them, on CUDA) are waited for as the
                # slow path's work is: busy meanwhile, and a cancelled caller's extend undone once
                # they ended (undone at once, the slots went back unfenced: found in review)
                async def read(n: int = num_blocks) -> int:
                    await wait_events(fences)
                    return n
                await self._run_exclusive(read(), self._undo_extend)
            return
        await self._run_exclusive(self._extend(num_blocks), self._undo_extend)

    async def acquire(self, stream=None) -> None:
        """Bring every page the next step needs to the GPU, locked and ready.
        On CUDA, ``stream`` (default: the current stream) is also made to wait
        on the pages' ready events: those of other sequences' kernels too."""
        if len(self.keys) >= LONG_BLOCKS:
            await asyncio.sleep(0)
        store = self._open_with(stream)
        if self.busy:
            raise UsageError("another acquire or extend of this sequence is running")
        done = store.core.acquire_now(self.sid)     # the common case: every page on the GPU, still
        if done < 0:
            raise UsageError("sequence is already acquired")
        if not done:
            await self._run_exclusive(self._acquire(), self._undo_acquire)
        if stream is not None or store.cuda:
            self._stream_wait(stream)           # on CUDA, the current stream when none is given

    def prefetch(self) -> None:
        """Start bringing the pages the next ``acquire`` needs to the GPU in
        the background, without locking them: call it when a request is
        queued, and its ``acquire`` later finds the pages there (or waits for
        the move already under way instead of starting one)."""
        self._check_open()
        self._prefetch()

    def page_indices(self, layer_id: int) -> list[int]:
        """GPU slot per block for ``layer_id``'s pools (-1: no GPU page)."""
        self._check_open()
        return self.store.core.page_indices(self.sid, self.store.lc_of_layer(layer_id))

    def locked_indices(self, layer_id: int) -> list[int]:
        """GPU slot per block of the pages this sequence's acquire locked for
        ``layer_id`` (-1 elsewhere): the pages that hold still until release."""
        self._check_open()
        return self.store.core.locked_slots(self.sid, self.store.lc_of_layer(layer_id))

    def recompute_blocks(self, layer_id: int) -> list[int]:
        """Blocks whose pages for ``layer_id`` hold no cached data (an
        ``OPTIONAL`` page that was not present): the caller recomputes them."""
        self._check_open()
        return self.store.core.recompute_blocks(self.sid, self.store.lc_of_layer(layer_id))

    def commit(self, num_blocks: int) -> None:
        """Publish the first ``num_blocks`` full blocks for reuse."""
        store = self._open_with(None)
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
            raise UsageError(f"num_blocks must be a non-negative integer, got {num_blocks!r}")
        if self.busy:
            raise UsageError("commit while an acquire or extend of this sequence is still running")
        bad = store.core.commit(self.sid, min(num_blocks, 1 << 40))    # (any count that large is past the end)
        if bad != -1:
            self._commit_refused(num_blocks, bad)
        if store.disk is not None:
            store.moves.sync()

    async def _settle(self) -> None:
        """Wait out an acquire/extend whose caller was cancelled."""
        while self.busy and self.task is not None:
            await asyncio.wait([self.task])
            await asyncio.sleep(0)          # let its done-callbacks (the undo) run

    async def release(self, stream=None) -> None:
        """Unlock: pages become HELD (demotable, never dropped). On CUDA the
        work queued so far on ``stream`` (default: the current stream) fences
        the pages: no move copies them before it is done."""
        if len(self.keys) >= LONG_BLOCKS:
            await asyncio.sleep(0)
        store = self._open_with(stream)
        if self.busy:
            await self._settle()
            if self.closed or store.closed:     # closed meanwhile: its id may be another sequence's now
                return
        if stream is None and not store.cuda:
            store.core.release(self.sid, 0)         # nothing to fence the pages with
        else:
            self._release_fenced(stream)

    async def close(self) -> None:
        """Committed pages become DROPPABLE; the others are freed. Waits for a
        cancelled acquire or extend to finish first, so nothing leaks. A long
        sequence yields to the loop after closing (never before: a caller
        cancelled there has still closed it)."""
        if self.closed:
            raise StoreClosedError("sequence is already closed")
        if self.store.closed:                # the store let go of every page when it closed
            self.closed = True
            return
        if self.busy:
            await self._settle()
        if not self.closed:
            self._close_now()
        if len(self.keys) >= LONG_BLOCKS:
            await asyncio.sleep(0)

    async def __aenter__(self) -> "Sequence":
        return self

    async def __aexit__(self, *exc) -> None:
        if not self.closed and not self.store.closed:
            await self.close()

    # -- the operations' work ------------------------------------------------------------------
    async def _run_exclusive(self, coro: Coroutine, undo: Callable[[Any], None]) -> None:
        """Run an acquire's or extend's slow path so that a cancelled caller leaks nothing: it
        runs to its end in a task of the store's, and ``undo`` (with its result) takes back what
        it did if its caller is gone."""
        if self.busy:
            coro.close()
            raise UsageError("another acquire or extend of this sequence is running")
        self.busy = True
        try:
            # most finish without waiting (pages promoted from host memory by an inline copy, free
            # slots): run them here; a task (which a cancelled caller leaves running) only from the
            # first wait on, where a cancellation could come
            done, task = start_eagerly(coro, self.store.loop)
        except BaseException:
            self.busy = False
            raise
        if done:
            self.busy = False
            return
        self.task = task
        self.store.moves.track(task)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():         # it finished just as its caller was cancelled: the caller sees no effect
                self.busy = False
                if not task.cancelled() and task.exception() is None and not self.closed:
                    undo(task.result())
                raise

            def _after(t: asyncio.Task) -> None:
                self.busy = False
                if not t.cancelled() and t.exception() is None and not self.closed:
                    undo(t.result())
            task.add_done_callback(_after)
            raise
        except BaseException:
            self.busy = False
            raise
        self.busy = False

    def _extend_now(self, n: int) -> list | None:
        """The common case, without a task: every GPU group has the free
        slots. Returns the fences to wait for, or None to take the slow path.
        (The caller checked that the sequence and the store are open.)"""
        store = self.store
        if n > store.max_extend:
            _extend_counts(store, n)            # raises, naming the group
        core = store.core
        fences = core.extend_now(self.sid, n)
        if fences is None and store.last_tier == GPU and store.moves.drop_for(n):
            fences = core.extend_now(self.sid, n)
        for per_block, reclaimer in store.gpu_reclaimers:   # wake below the reserve (counting what is still needed)
            reclaimer.kick_after(0 if fences is not None else n * per_block)
        return fences and store.events.all(fences)

    async def _extend(self, n: int) -> int:
        store = self.store
        store.check_open()
        if n == 0:
            return 0
        counts = _extend_counts(store, n)
        try:
            slots = await store.moves.obtain_many(GPU, counts)
        except OutOfPagesError:
            if big := _too_large(store, counts.items(), "extending", "new pages", self._held_per_group()):
                raise big from None         # never fits: not the back-pressure a retry waits out
            raise
        await wait_events(store.events.all(store.core.place_extension(self.sid, n, slots)))
        return n

    def _held_per_group(self) -> dict[int, int]:
        """The pages this sequence holds locked, per GPU group (a pass over its pages: for a
        refusal only)."""
        store = self.store
        held: dict[int, int] = {}
        for lc in range(len(store.lcs)):
            g = store.group_of[GPU][lc]
            held[g] = held.get(g, 0) + int((np.asarray(store.core.locked_slots(self.sid, lc)) >= 0).sum())
        return held

    def _undo_extend(self, n: int) -> None:
        self.store.core.undo_extend(self.sid, n)
        self.store.moves.sync()

    async def _acquire(self) -> Pages:
        store = self.store
        store.check_open()
        if self.acquired:
            raise UsageError("sequence is already acquired")
        core, moves = store.core, store.moves
        while True:       # every await may change pages: re-check until a pass needs none
            holes, claims = core.acquire_scan(self.sid)
            if holes:
                await self._fill_holes(holes)
                continue
            if claims:
                waits = store.claims.pending(claims)
                if not waits:
                    raise CoreError(f"pages claimed by settled operations {claims}")
                await asyncio.wait(waits)
                for f in waits:
                    exc = None if f.cancelled() else f.exception()
                    if exc is not None and f.to_gpu and not isinstance(exc, CorruptPageError):
                        raise exc
                continue
            pages = core.lock_needed(self.sid)
            try:
                cold = core.cold_pages(pages)
                if cold:
                    moves.claim(cold, GPU)
                    try:
                        slots = await moves.obtain_many(GPU, core.group_counts(cold, GPU))
                    except BaseException as exc:
                        moves.unclaim(cold, exc)
                        if isinstance(exc, OutOfPagesError) and \
                                (big := _too_large(store, core.group_counts(pages, GPU), "acquiring")):
                            raise big from None     # never fits: not the back-pressure a retry waits out
                        raise
                    await moves.move(cold, GPU, slots, handoff=False)
            except CorruptPageError:
                # The bad pages were dropped (with the rest of their prefix where it is critical): the
                # next pass finds their blocks empty and gives them fresh pages to recompute.
                core.unlock(pages)
                moves.sync()
                continue
            except BaseException:
                core.unlock(pages)
                moves.sync()
                raise
            break
        core.finish_acquire(self.sid, pages)
        return pages

    def _prefetch(self) -> asyncio.Task | None:
        """Start promoting the cold pages the next acquire needs, unlocked.
        A failure only logs: the acquire that follows does the work itself."""
        store = self.store
        store.check_open()
        core, moves = store.core, store.moves
        pages = core.prefetch_pages(self.sid)
        if not pages:
            return None
        moves.claim(pages, GPU, propagate=False)

        async def promote() -> None:
            try:
                slots = await moves.obtain_many(GPU, core.group_counts(pages, GPU))
            except BaseException as exc:
                moves.unclaim(pages, None)
                if not isinstance(exc, (OutOfPagesError, asyncio.CancelledError)):
                    log.warning("prefetch failed: %r", exc)
                return
            try:
                await moves.move(pages, GPU, slots, handoff=False)
            except (OSError, KvtierError) as exc:
                log.warning("prefetch failed: %r", exc)
        return moves.spawn(promote())

    async def _fill_holes(self, holes: list[int]) -> None:
        """New (empty) GPU pages for needed pages that no tier holds; the
        caller recomputes them (``recompute_blocks``)."""
        store = self.store
        counts: dict[int, int] = {}
        gpu_group = store.group_of[GPU]
        for lc in holes[1::2]:
            g = gpu_group[lc]
            counts[g] = counts.get(g, 0) + 1
        if big := _too_large(store, counts.items(), "acquiring", "new pages"):  # the fresh pages alone
            raise big
        slots = await store.moves.obtain_many(GPU, counts)
        await wait_events(store.events.all(store.core.fill_holes(self.sid, holes, slots)))

    def _undo_acquire(self, pages: Pages) -> None:
        self.store.core.undo_acquire(self.sid, pages)
        self.store.moves.sync()

    def _release_fenced(self, stream=None) -> None:
        """Unlock exactly the pages this sequence locked (others may share them), fenced by
        the caller's stream (``release`` unlocks unfenced itself when there is none)."""
        if self.closed:                             # its id may be another sequence's now
            return
        if not self.acquired:
            return
        store = self.store
        ev = _stream_event(_caller_stream(store, stream))
        store.core.release(self.sid, store.events.id(ev))

    def _stream_wait(self, stream) -> None:
        store = self.store
        stream = _caller_stream(store, stream)
        if stream is None:
            return
        for ev in store.events.all(store.core.ready_events(self.sid)):
            if isinstance(ev, CudaEvent):
                stream.wait_event(ev._event)

    def _commit_refused(self, n: int, code: int) -> None:
        """The UsageError for a commit the core refused (``code``: its answer; nothing changed)."""
        if code >= 0:
            raise UsageError(f"block key {self.keys[code]!r} at position {code} is already indexed at "
                             "another position")
        if code == COMMIT_PAST_BLOCKS:
            raise UsageError(f"cannot commit {n} blocks: only {self.store.core.num_blocks(self.sid)} have pages")
        raise UsageError(f"cannot commit {n} blocks: only {len(self.keys)} have keys (append the tokens first)")

    def _close_now(self) -> None:
        store = self.store
        if store.cuda:
            self._release_fenced()      # the caller's current stream fences what it locked
        self.final_committed = store.core.close(self.sid)   # (it releases what is still locked, unfenced)
        self.closed = True
        if store.disk is not None:
            store.moves.sync()


def _extend_counts(store: "Store", n: int) -> dict[int, int]:
    """Pages per GPU group that ``n`` more blocks take (RequestTooLargeError where a group is
    too small)."""
    counts = {g: n * k for g, k in store.lcs_per_gpu_group.items()}
    if big := _too_large(store, counts.items(), f"extending by {n} blocks"):
        raise big
    return counts


def _too_large(store: "Store", counts, doing: str, what: str = "pages",
               held: dict[int, int] | None = None) -> RequestTooLargeError | None:
    """The error for a request (``doing``) whose pages, (GPU group, count) pairs ``counts``, and
    the ones the sequence ``held`` there outnumber a GPU pool group's slots; None where each fits."""
    for g, n in counts:
        have = held.get(g, 0) if held else 0
        if n + have > (cap := store.core.capacity(GPU, g)):
            tail = f" beside the {have} this sequence holds, and the group holds" if have else ", which holds"
            return RequestTooLargeError(f"{doing} needs {n} {what} of GPU pool group {g}{tail} {cap}")
    return None


def _check_stream(store: "Store", stream) -> None:
    """A caller's stream must be a CUDA stream on a CUDA store (checked before anything changes)."""
    if not store.device.is_cuda:
        raise UsageError("stream= needs a CUDA device; this store's GPU tier is emulated in host memory")
    if not isinstance(stream, torch.cuda.Stream):
        raise UsageError(f"stream must be a torch.cuda.Stream, got {type(stream).__name__}")


def _caller_stream(store: "Store", stream):
    """The stream a caller's kernels use: the one given, else (on CUDA)
    the current one, so pages are fenced by the caller's work either way."""
    if stream is None and store.device.is_cuda:
        return torch.cuda.current_stream(store.device.torch_device)
    return stream


def _stream_event(stream) -> CudaEvent | None:
    """An event recorded on a caller's CUDA stream (None for no stream)."""
    return None if stream is None else CudaEvent.on(stream)

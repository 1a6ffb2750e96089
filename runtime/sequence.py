"""A sequence: one request's view of the store (its blocks and their pages)."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Sequence as Seq

from tiers.errors import StoreClosedError, UsageError

from .views import PageView, page_rows
import numpy as np

from .keys import BlockKey, check_block_keys, hash_blocks, token_array
from .readiness import wait_events

if TYPE_CHECKING:
    from .store import Store


# A call on a sequence this long yields to the event loop once before its core call (which
# runs a few hundred microseconds per thousand blocks): one long request's operations do not
# run back to back without a yield. Before, so a caller cancelled there has changed nothing;
# close() yields after instead, so that a cancelled close still closes (nothing leaks).
LONG_BLOCKS = 1024


class Sequence:
    """Returned by ``Store.open_sequence``. Methods mirror DESIGN.md §3; the
    store does the work. The sequence's blocks and pages live in the native
    core under ``sid``; this object holds its keys and asyncio state."""

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
        """Matched blocks by the tier their coldest page was in at open; with a
        remote tier, "remote" counts the blocks imported from it (they are on
        the host now, and not counted there)."""
        gpu, host, disk = self._by_tier[0], self._by_tier[1], self._by_tier[2]
        remote = self._remote
        if remote is None:
            return {"gpu": gpu, "host": host, "disk": disk}
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
            store._check_stream(stream)
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
        fences = self.store._extend_now(self, num_blocks)
        if fences is not None:
            if fences:
                await wait_events(fences)   # a cancelled wait leaves the pages placed and owned: no leak
            return
        await self.store._run_exclusive(self, self.store._extend(self, num_blocks), self.store._undo_extend)

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
            await store._run_exclusive(self, store._acquire(self), store._undo_acquire)
        if stream is not None or store.cuda:
            store._stream_wait(self, stream)    # on CUDA, the current stream when none is given

    def prefetch(self) -> None:
        """Start bringing the pages the next ``acquire`` needs to the GPU in
        the background, without locking them: call it when a request is
        queued, and its ``acquire`` later finds the pages there (or waits for
        the move already under way instead of starting one)."""
        self._check_open()
        self.store._prefetch(self)

    def page_indices(self, layer_id: int) -> list[int]:
        """GPU slot per block for ``layer_id``'s pools (-1: no GPU page)."""
        self._check_open()
        return self.store.core.page_indices(self.sid, self.store._lc_of_layer(layer_id))

    def locked_indices(self, layer_id: int) -> list[int]:
        """GPU slot per block of the pages this sequence's acquire locked for
        ``layer_id`` (-1 elsewhere): the pages that hold still until release."""
        self._check_open()
        return self.store.core.locked_slots(self.sid, self.store._lc_of_layer(layer_id))

    def recompute_blocks(self, layer_id: int) -> list[int]:
        """Blocks whose pages for ``layer_id`` hold no cached data (an
        ``OPTIONAL`` page that was not present): the caller recomputes them."""
        self._check_open()
        return self.store.core.recompute_blocks(self.sid, self.store._lc_of_layer(layer_id))

    def commit(self, num_blocks: int) -> None:
        """Publish the first ``num_blocks`` full blocks for reuse."""
        store = self._open_with(None)
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
            raise UsageError(f"num_blocks must be a non-negative integer, got {num_blocks!r}")
        if self.busy:
            raise UsageError("commit while an acquire or extend of this sequence is still running")
        bad = store.core.commit(self.sid, min(num_blocks, 1 << 40))    # (any count that large is past the end)
        if bad != -1:
            store._commit_refused(self, num_blocks, bad)
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
            store._release(self, stream)

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
            self.store._close_sequence(self)
        if len(self.keys) >= LONG_BLOCKS:
            await asyncio.sleep(0)

    async def __aenter__(self) -> "Sequence":
        return self

    async def __aexit__(self, *exc) -> None:
        if not self.closed and not self.store.closed:
            await self.close()

"""Reusable host staging buffers, for moves that cannot go slab to slab.

A disk batch on its way to or from the GPU, or scattered host rows gathered
for one disk write, needs a contiguous host buffer: page-aligned for
O_DIRECT, pinned when CUDA copies use it. A fresh one costs a page fault per
4 KiB on first touch (measured here: 13 ms to gather 32 MiB into a new
buffer, 2 ms into a reused one), and on CUDA a pinned allocation besides.
So buffers come back here when their move is done and the next batch of the
same size or smaller reuses them.

A buffer goes back only when the ``borrow`` block ends normally: after an
error an asynchronous copy might still be using it, so it is left to the
garbage collector instead.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

import numpy as np
import torch

MIN_BYTES = 64 << 10         # buffers are sized in powers of two from here, so nearby sizes share them


class StagingPool:
    __slots__ = ("_alloc", "_free", "_lock", "limit", "idle_bytes", "allocated")

    def __init__(self, alloc: Callable[[int], torch.Tensor], limit: int) -> None:
        self._alloc = alloc               # nbytes -> flat uint8 host tensor (aligned, pinned as needed)
        # idle buffers, each with its numpy view made once (a torch view per borrow gives up the GIL)
        # and its size in bytes (len() of a tensor costs a torch dispatch, ~2 us on the loop)
        self._free: list[tuple[torch.Tensor, np.ndarray, int]] = []
        self._lock = threading.Lock()     # moves borrow from the loop and from stream threads
        self.limit = limit                # idle bytes kept at most
        self.idle_bytes = 0
        self.allocated = 0                # buffers made (a test and stats figure)

    def _take(self, nbytes: int) -> tuple[torch.Tensor, np.ndarray, int]:
        with self._lock:
            best = None
            for i, buf in enumerate(self._free):      # the smallest idle buffer that fits
                if buf[2] >= nbytes and (best is None or buf[2] < self._free[best][2]):
                    best = i
            if best is not None:
                buf = self._free.pop(best)
                self.idle_bytes -= buf[2]
                return buf
        self.allocated += 1
        size = max(MIN_BYTES, 1 << (nbytes - 1).bit_length())
        t = self._alloc(size)
        return t, t.numpy(), size

    def _give(self, buf: tuple[torch.Tensor, np.ndarray, int]) -> None:
        with self._lock:
            if self.idle_bytes + buf[2] <= self.limit:
                self._free.append(buf)
                self.idle_bytes += buf[2]

    @contextmanager
    def borrow(self, rows: int, cols: int) -> Iterator[torch.Tensor]:
        """A ``[rows, cols]`` uint8 tensor for the duration of the block."""
        buf = self._take(rows * cols)
        yield buf[0][:rows * cols].view(rows, cols)
        self._give(buf)

    @contextmanager
    def borrow_array(self, rows: int, cols: int) -> Iterator[np.ndarray]:
        """The same as a numpy array, for host-only work (gathers, disk I/O): numpy views keep
        the GIL, where each torch view gives it up and a busy loop makes it wait to get it back."""
        buf = self._take(rows * cols)
        yield buf[1][:rows * cols].reshape(rows, cols)
        self._give(buf)

    def lend_array(self, rows: int, cols: int) -> tuple[np.ndarray, Callable[[], None]]:
        """``borrow_array`` for a buffer that outlives the caller's block (a write queued on
        a thread): the array and the call that gives it back (once; from any thread)."""
        buf = self._take(rows * cols)
        given = [False]

        def give_back() -> None:
            if not given[0]:
                given[0] = True
                self._give(buf)
        return buf[1][:rows * cols].reshape(rows, cols), give_back

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.idle_bytes = 0

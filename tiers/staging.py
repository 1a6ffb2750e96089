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

import torch

MIN_BYTES = 64 << 10         # buffers are sized in powers of two from here, so nearby sizes share them


class StagingPool:
    __slots__ = ("_alloc", "_free", "_lock", "limit", "idle_bytes", "allocated")

    def __init__(self, alloc: Callable[[int], torch.Tensor], limit: int) -> None:
        self._alloc = alloc               # nbytes -> flat uint8 host tensor (aligned, pinned as needed)
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()     # moves borrow from the loop and from stream threads
        self.limit = limit                # idle bytes kept at most
        self.idle_bytes = 0
        self.allocated = 0                # buffers made (a test and stats figure)

    def _take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                self.idle_bytes -= buf.numel()
                return buf
        self.allocated += 1
        return self._alloc(max(MIN_BYTES, 1 << (nbytes - 1).bit_length()))

    def _give(self, buf: torch.Tensor) -> None:
        with self._lock:
            if self.idle_bytes + buf.numel() <= self.limit:
                self._free.append(buf)
                self.idle_bytes += buf.numel()

    @contextmanager
    def borrow(self, rows: int, cols: int) -> Iterator[torch.Tensor]:
        """A ``[rows, cols]`` uint8 buffer for the duration of the block."""
        buf = self._take(rows * cols)
        yield buf[:rows * cols].view(rows, cols)
        self._give(buf)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.idle_bytes = 0

"""Emulated copies too large for the loop, on a native thread that needs no GIL.

On the emulated GPU a copy stream is a Python worker thread: a job there waits for the
GIL to start and again to end, up to the interpreter's switch interval (5 ms) each time
behind a busy loop. Copies of up to ``migration.INLINE_BYTES`` run on the loop itself;
larger ones (GPU demotions on demand at concurrency 32: 222 of 595 were 2-8 MiB) went to
that thread, and the loop idled 0.44 s a replay waiting for them. Run on the loop, they
broke its lag target: a copy of 1 MiB or more gives the GIL up, and getting it back costs
up to a switch interval. ``tiers.native.CopyWorker`` copies on a C++ thread instead, and a
byte on a pipe wakes the loop, which completes the jobs' events (``add_reader``).
"""
from __future__ import annotations

import asyncio
import threading

import numpy as np

from tiers.native import CopyWorker
from tiers.streams import HostEvent


class CopyThread:
    """One native copy thread, its completions delivered on ``loop``. ``submit`` and the
    completions run on the loop's thread; ``close`` may run on any."""

    __slots__ = ("_loop", "_worker", "_fd", "_pending", "_closed", "_lock")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._worker = CopyWorker()
        self._fd = self._worker.fd
        # job id -> (its event, the arrays it reads and writes: alive until it is done)
        self._pending: dict[int, tuple[HostEvent, tuple]] = {}
        self._closed = False
        # submit's "queued, then registered" and close's "run the rest, then complete them" are
        # each one step to the other: else a job close ran before submit registered it would
        # never have its event set (found in review)
        self._lock = threading.Lock()
        loop.add_reader(self._fd, self._on_done)

    def submit(self, src: np.ndarray, src_index: np.ndarray | None, dst: np.ndarray,
               dst_index: np.ndarray | None) -> HostEvent:
        """``dst[dst_index[i]] = src[src_index[i]]`` on the thread (arguments as
        ``tiers.native.copy_rows``, checked here: a bad one raises and nothing is queued);
        the returned event is set on the loop when the rows are copied."""
        ev = HostEvent()
        with self._lock:
            job = self._worker.submit(src, src_index, dst, dst_index)
            self._pending[job] = (ev, (src, src_index, dst, dst_index))
        return ev

    def _on_done(self) -> None:
        for job in self._worker.take_done():
            done = self._pending.pop(job, None)
            if done is not None:
                done[0].set()

    def close(self) -> None:
        """Run the queued copies, complete their events and stop the thread. Idempotent."""
        if not self._finish():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        try:
            if running is self._loop:
                self._drop_reader()
            elif not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._drop_reader)     # (keeps the pipe open until then)
        except RuntimeError:            # the loop closed meanwhile: its readers went with it
            pass

    def _finish(self) -> bool:
        """Stop the thread after the queued copies and complete their events; False if done before."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            self._worker.close()
            self._on_done()
            return True

    def _drop_reader(self) -> None:
        self._loop.remove_reader(self._fd)

    def __del__(self) -> None:
        # dropped unclosed: the thread must stop writing before the arrays in _pending go
        # (slots and cycles are cleared after this runs; found in review: a segfault)
        if getattr(self, "_lock", None) is not None:
            self._finish()

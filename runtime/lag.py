"""Event-loop lag: how late a ticker on a fixed schedule runs, sampled in the background.

The ticker's schedule is anchored at its first tick: tick k is due at
``start + k * interval``, and each tick records how late it
ran against when it was *due*, not against when the previous tick happened to
run. So a stall that begins right after ``start()`` (before the ticker ever
ran) is seen in full, and a stall of S seconds shows as one sample of about S.
Slots a stall swallowed are skipped, not replayed: the next tick is the first
slot of the schedule after the late one, so one stall is one sample and not a
burst of shrinking catch-up samples that would flood the percentiles.

Time is read from ``time.monotonic()``, not from ``loop.time()``: uvloop's
clock (which kvtier's CLI runs on) counts whole milliseconds, too coarse for
sub-millisecond lag. The same clock is what asyncio's own loop uses.

Samples go to a ``LagRecorder``: bounded memory (a fixed-size uniform
reservoir for p50/p99, plus an exact running count and max) and O(1) work per
tick, so a server can sample forever.
"""
from __future__ import annotations

import asyncio
import random
import time
from array import array
from typing import Callable

DEFAULT_CAPACITY = 8192     # samples kept for the percentiles (64 KiB)


class LagRecorder:
    """Lag samples in seconds: exact count and max, percentiles from a reservoir.

    Up to ``capacity`` samples every sample is kept, so the percentiles are
    exact; after that the reservoir is a uniform random sample of all samples
    seen (Vitter's algorithm R, seeded, so runs are reproducible).
    """
    __slots__ = ("capacity", "count", "max", "_kept", "_rng")

    def __init__(self, capacity: int = DEFAULT_CAPACITY, *, seed: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.count = 0
        self.max = 0.0
        self._kept = array("d")
        self._rng = random.Random(seed)

    def record(self, lag: float) -> None:
        self.count += 1
        if lag > self.max:
            self.max = lag
        kept = self._kept
        if len(kept) < self.capacity:
            kept.append(lag)
        else:
            j = int(self._rng.random() * self.count)
            if j < self.capacity:
                kept[j] = lag

    def __len__(self) -> int:
        """Samples held in memory (at most ``capacity``), not samples seen (``count``)."""
        return len(self._kept)

    def samples(self) -> list[float]:
        return list(self._kept)

    def percentiles_ms(self) -> dict[str, float]:
        if not self._kept:
            return {"p50": 0.0, "p99": 0.0, "max": 0.0, "count": 0}
        s = sorted(self._kept)

        def pct(q: float) -> float:
            return round(s[min(len(s) - 1, int(q * len(s)))] * 1e3, 3)
        return {"p50": pct(0.50), "p99": pct(0.99), "max": round(self.max * 1e3, 3), "count": self.count}


class LoopLagMonitor:
    """Ticks every ``interval`` seconds on the running loop and records each tick's lateness."""
    __slots__ = ("interval", "recorder", "observe", "_clock", "_loop", "_handle", "_due")

    def __init__(self, interval: float = 0.005, *, capacity: int = DEFAULT_CAPACITY,
                 clock: Callable[[], float] = time.monotonic,
                 observe: Callable[[float], None] | None = None) -> None:
        """``observe``: also called with each sample in seconds (a metrics histogram's observe)."""
        if not interval > 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        self.interval = interval
        self._clock = clock
        self.recorder = LagRecorder(capacity)
        self.observe = observe
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    @property
    def running(self) -> bool:
        return self._handle is not None

    @property
    def samples(self) -> list[float]:
        """The samples held for the percentiles, in seconds (all of them up to ``capacity``)."""
        return self.recorder.samples()

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> "LoopLagMonitor":
        """Schedule the first tick now, synchronously, so a stall right after this call counts."""
        if self._handle is not None:
            return self
        self._loop = loop = loop or asyncio.get_running_loop()
        self._due = self._clock() + self.interval
        self._handle = loop.call_later(self.interval, self._tick)
        return self

    def _tick(self) -> None:
        now = self._clock()
        late = now - self._due
        self._record(late if late > 0.0 else 0.0)
        iv = self.interval
        due = self._due + iv
        if due <= now:      # a stall swallowed slots: resume at the first one still ahead
            due += iv * (int((now - due) / iv) + 1)
        self._due = due
        self._handle = self._loop.call_later(due - now, self._tick)

    def close(self) -> None:
        """Stop ticking. A tick that is already overdue is recorded as late as it is now,
        so a stall just before stopping is not lost. Idempotent; never awaits."""
        handle, self._handle = self._handle, None
        if handle is None:
            return
        handle.cancel()
        late = self._clock() - self._due
        if late > 0.0:
            self._record(late)

    def _record(self, lag: float) -> None:
        self.recorder.record(lag)
        if self.observe is not None:
            self.observe(lag)

    async def stop(self) -> None:
        # No await inside: a cancellation pending on the caller cannot interrupt it.
        self.close()

    def percentiles_ms(self) -> dict[str, float]:
        """p50, p99 and max (the longest stall) in ms, and the number of samples."""
        return self.recorder.percentiles_ms()

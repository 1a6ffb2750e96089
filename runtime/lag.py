"""Event-loop lag: how late a short sleep wakes up, sampled in the background."""
from __future__ import annotations

import asyncio
import time


class LoopLagMonitor:
    __slots__ = ("interval", "samples", "_task")

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.samples: list[float] = []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.interval)
            self.samples.append(max(0.0, time.perf_counter() - t0 - self.interval))

    def start(self) -> "LoopLagMonitor":
        self._task = asyncio.ensure_future(self._run())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def percentiles_ms(self) -> dict[str, float]:
        if not self.samples:
            return {"p50": 0.0, "p99": 0.0, "max": 0.0}
        s = sorted(self.samples)

        def pct(q: float) -> float:
            return round(s[min(len(s) - 1, int(q * len(s)))] * 1e3, 3)
        return {"p50": pct(0.50), "p99": pct(0.99), "max": round(s[-1] * 1e3, 3)}

"""LoopLagMonitor sees stalls: lateness counts from each tick's due time, anchored at the first tick."""
from __future__ import annotations

import asyncio
import time

import pytest

from runtime.lag import LoopLagMonitor

STALL = 0.3


async def test_stall_right_after_start_is_seen():
    # the ticker has not run once when the loop blocks; the first tick is due 5 ms after start()
    mon = LoopLagMonitor().start()
    time.sleep(STALL)
    await asyncio.sleep(0.03)
    await mon.stop()
    p = mon.percentiles_ms()
    assert p["max"] >= 250, p
    assert p["count"] >= 1


async def test_stall_in_the_middle_is_one_full_sample():
    mon = LoopLagMonitor().start()
    await asyncio.sleep(0.05)
    time.sleep(STALL)
    await asyncio.sleep(0.05)
    await mon.stop()
    p = mon.percentiles_ms()
    assert p["max"] >= 250, p
    # one stall is one sample, not a burst of catch-up ticks (a schedule that replayed the
    # ~60 swallowed 5 ms slots would leave ~40 samples above 100 ms)
    assert sum(s >= 0.1 for s in mon.samples) <= 3, sorted(mon.samples)[-10:]
    assert p["count"] == len(mon.samples)


async def test_stall_just_before_stop_is_seen():
    mon = LoopLagMonitor().start()
    await asyncio.sleep(0.03)
    time.sleep(STALL)
    await mon.stop()      # the overdue tick never ran; stop() records how late it is
    assert mon.percentiles_ms()["max"] >= 250


def test_stalls_are_seen_on_uvloop_too():
    # kvtier's CLI runs its coroutines on uvloop (runtime.loop.run)
    uvloop = pytest.importorskip("uvloop")

    async def scenario():
        running = LoopLagMonitor().start()
        stopping = LoopLagMonitor().start()
        await asyncio.sleep(0.05)
        fresh = LoopLagMonitor().start()
        time.sleep(STALL)       # mid-run for `running`, right after start for `fresh`
        await stopping.stop()   # and just before stop for `stopping`
        await asyncio.sleep(0.05)
        await running.stop()
        await fresh.stop()
        return running, fresh, stopping

    for mon in uvloop.run(scenario()):
        p = mon.percentiles_ms()
        assert p["max"] >= 250, p
        assert sum(s >= 0.1 for s in mon.samples) <= 3, sorted(mon.samples)[-5:]


async def test_idle_loop_reports_small_lag():
    mon = LoopLagMonitor().start()
    await asyncio.sleep(0.25)
    await mon.stop()
    p = mon.percentiles_ms()
    assert set(p) >= {"p50", "p99", "max", "count"}
    assert p["count"] >= 5          # ~50 expected; a loaded machine may tick less often
    assert p["p50"] < 50, p
    assert p["p50"] <= p["p99"] <= p["max"]


async def test_no_samples_reports_zeros():
    mon = LoopLagMonitor()
    assert mon.percentiles_ms() == {"p50": 0.0, "p99": 0.0, "max": 0.0, "count": 0}
    await mon.stop()                # never started: a no-op


async def test_stop_is_idempotent_and_safe_when_cancelled():
    mon = LoopLagMonitor(0.002)

    async def worker():
        mon.start()
        try:
            await asyncio.sleep(10)
        finally:
            await mon.stop()        # runs while the task is being cancelled

    task = asyncio.create_task(worker())
    await asyncio.sleep(0.03)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not mon.running
    await mon.stop()
    n = mon.percentiles_ms()["count"]
    await asyncio.sleep(0.02)
    assert mon.percentiles_ms()["count"] == n       # nothing ticks after stop()


class FakeLoop:
    """A clock the test moves by hand; call_later keeps the one pending callback."""

    def __init__(self) -> None:
        self.now = 0.0
        self.pending: list[tuple[float, object]] = []

    def time(self) -> float:
        return self.now

    def call_later(self, delay, cb):
        loop, when = self, self.now + delay

        class Handle:
            def cancel(self):
                loop.pending = [p for p in loop.pending if p[1] is not cb or p[0] != when]
        self.pending.append((when, cb))
        return Handle()

    def fire(self, at: float) -> float:
        ((when, cb),) = self.pending
        self.pending.clear()
        self.now = max(at, when)
        cb()
        return when


def test_schedule_is_anchored_at_the_first_tick():
    loop = FakeLoop()
    mon = LoopLagMonitor(0.005, clock=loop.time).start(loop)
    assert loop.pending[0][0] == pytest.approx(0.005)
    loop.fire(0.400)                # a 395 ms stall before the first tick
    assert mon.samples == [pytest.approx(0.395)]
    assert loop.pending[0][0] == pytest.approx(0.405)   # next free slot of the grid, no catch-up
    loop.fire(0.405)
    loop.fire(0.4112)               # 1.2 ms late
    p = mon.percentiles_ms()
    assert p["count"] == 3 and p["max"] == pytest.approx(395, abs=1e-6)
    assert sorted(mon.samples) == [0.0, pytest.approx(0.0012), pytest.approx(0.395)]
    mon.close()
    mon.close()
    assert loop.pending == []


def test_memory_stays_bounded_over_many_ticks():
    loop = FakeLoop()
    mon = LoopLagMonitor(0.001, capacity=512, clock=loop.time).start(loop)
    n = 20_000
    for i in range(n):
        due = loop.pending[0][0]
        loop.fire(due + (0.25 if i == 13_337 else (i % 10) * 1e-5))
    p = mon.percentiles_ms()
    assert p["count"] == n
    assert len(mon.recorder) == len(mon.samples) == 512     # bounded, whatever the count
    assert p["max"] == pytest.approx(250, abs=1e-6)         # the max is exact, even if the reservoir lost it
    assert 0.0 <= p["p50"] <= p["p99"] <= 0.1


def test_recorder_percentiles_from_a_uniform_reservoir():
    from runtime.lag import LagRecorder
    rec = LagRecorder(capacity=4096)
    n = 100_000
    for i in range(n):
        rec.record((i * 7919 % n) / n * 0.1)    # 0..100 ms, in scrambled order
    p = rec.percentiles_ms()
    assert len(rec) == 4096 and p["count"] == n
    assert p["p50"] == pytest.approx(50, abs=5) and p["p99"] == pytest.approx(99, abs=2)
    assert p["max"] == pytest.approx(100 * (n - 1) / n, abs=1e-6)
    with pytest.raises(ValueError):
        LagRecorder(capacity=0)


async def test_observe_gets_every_sample_a_stall_included():
    """serve.py feeds its Prometheus histogram through ``observe``: the
    stall must reach it too, not only the monitor's own percentiles."""
    seen: list[float] = []
    mon = LoopLagMonitor(0.005, observe=seen.append).start()
    time.sleep(0.3)                         # a stall right after start, before any tick ran
    await asyncio.sleep(0.03)
    await mon.stop()
    assert len(seen) == mon.percentiles_ms()["count"] and max(seen) >= 0.25


async def test_the_bench_hold_watcher_sees_a_stall_whole():
    """bench_core's loop-hold rows: a watcher that yields every turn sees a callback that
    holds the loop for its whole length (a timer ticker sees it only to its grain)."""
    from runtime.tools.bench_core import _HoldWatcher
    watch = _HoldWatcher().start()
    await asyncio.sleep(0.005)
    asyncio.get_running_loop().call_soon(time.sleep, 0.02)      # holds the loop 20 ms
    await asyncio.sleep(0.005)
    assert await watch.stop() >= 20.0

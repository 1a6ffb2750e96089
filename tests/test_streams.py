"""Streams and ready events: the emulated (host) kind always, CUDA when present."""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from tiers.device import Device
from runtime.core import Core
from runtime.handles import EventTable
from tiers.streams import DONE, HostEvent, HostStream

T = 5.0          # generous timeout for anything that should happen promptly
SETTLE = 0.05    # how long we give work that must NOT run a chance to run anyway


@pytest.fixture
def streams():
    made: list[HostStream] = []

    def make(name="s"):
        s = HostStream(f"test-{name}-{len(made)}")
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def worker_ident(stream) -> int:
    box = []
    stream.submit(lambda: box.append(threading.get_ident())).synchronize(T)
    return box[0]


def test_work_runs_in_order_on_one_worker_thread(streams):
    s = streams()
    seen, threads = [], set()

    def job(i):
        def fn():
            seen.append(i)
            threads.add(threading.get_ident())
        return fn

    events = [s.submit(job(i)) for i in range(100)]
    events[-1].synchronize(T)
    assert seen == list(range(100))
    assert all(ev.query() for ev in events)
    assert len(threads) == 1
    assert threading.get_ident() not in threads
    assert threads == {worker_ident(s)}


def test_submit_returns_before_slow_work_finishes(streams):
    s = streams()
    gate, started, finished = threading.Event(), threading.Event(), threading.Event()

    def slow():
        started.set()
        assert gate.wait(T)
        finished.set()

    ev = s.submit(slow)                # returns while the work is blocked
    assert started.wait(T)
    assert not finished.is_set() and not ev.query()
    after = s.record()                 # a point after the slow work
    time.sleep(SETTLE)
    assert not after.query()
    with pytest.raises(TimeoutError):
        ev.synchronize(timeout=0.01)
    gate.set()
    after.synchronize(T)
    assert finished.is_set() and ev.query() and after.query()
    assert ev.error is None and after.error is None


def test_every_thread_waiting_on_one_event_wakes_when_it_is_set():
    ev = HostEvent()
    woke = []
    waiters = [threading.Thread(target=lambda: (ev.synchronize(T), woke.append(1))) for _ in range(6)]
    for t in waiters:
        t.start()
    time.sleep(SETTLE)
    assert not woke                         # all blocked until the set
    ev.set(RuntimeError("copy failed"))
    for t in waiters:
        t.join(T)
    assert len(woke) == 6 and isinstance(ev.error, RuntimeError)
    ev.synchronize(0)                       # a done event answers at once, timeout or not
    with pytest.raises(TimeoutError):
        HostEvent().synchronize(timeout=0)


def test_a_timed_wait_set_in_time_never_times_out_however_late_its_thread_runs():
    """Set 10 ms into a 100 ms wait, then the setter keeps the GIL in one C
    call past the deadline: every waiter still sees the event done."""
    rng = random.Random(0)
    big = [rng.random() for _ in range(1_000_000)]
    ev, out = HostEvent(), []

    def wait() -> None:
        try:
            ev.synchronize(0.1)
            out.append("done")
        except TimeoutError:
            out.append("timed out")
    waiters = [threading.Thread(target=wait) for _ in range(3)]
    for t in waiters:
        t.start()
    time.sleep(0.01)
    ev.set()
    sorted(big)                             # one C call: no other thread runs Python until it returns
    for t in waiters:
        t.join(T)
    assert out == ["done"] * 3


def test_wait_event_makes_later_work_wait(streams):
    a, b = streams("a"), streams("b")
    gate = threading.Event()
    log: list[str] = []
    lock = threading.Lock()

    def note(x):
        with lock:
            log.append(x)

    def producer():
        assert gate.wait(T)
        note("a:produce")

    ev_a = a.submit(producer)
    before = b.submit(lambda: note("b:before"))      # b is free until it waits
    before.synchronize(T)
    b.wait_event(ev_a)
    started = threading.Event()

    def consumer():
        started.set()
        note("b:consume")

    ev_b = b.submit(consumer)
    time.sleep(SETTLE)
    assert not started.is_set() and not ev_b.query() and not ev_a.query()
    assert log == ["b:before"]
    gate.set()                                       # the test opens the gate only now
    ev_b.synchronize(T)
    assert log == ["b:before", "a:produce", "b:consume"]


def test_wait_event_on_a_done_event_does_not_block(streams):
    s = streams()
    s.wait_event(DONE)
    s.wait_event(HostEvent(done=True))
    ev = s.submit(lambda: None)
    ev.synchronize(T)


def test_exceptions_surface_as_event_error_and_later_work_runs(streams):
    s = streams()
    ran = []

    def boom():
        raise ValueError("bad copy")

    ev_bad = s.submit(boom)
    ev_ok = s.submit(lambda: ran.append(1))
    ev_ok.synchronize(T)
    assert ev_bad.query()
    assert isinstance(ev_bad.error, ValueError) and str(ev_bad.error) == "bad copy"
    assert ev_ok.error is None and ran == [1]
    ev_bad.synchronize(T)            # a failed event still completes; the error is read, not raised


def test_waiting_on_a_failed_event_still_releases_the_waiter(streams):
    a, b = streams("a"), streams("b")
    gate = threading.Event()

    def fail():
        assert gate.wait(T)
        raise RuntimeError("x")

    ev_a = a.submit(fail)
    b.wait_event(ev_a)
    ev_b = b.submit(lambda: None)
    gate.set()
    ev_b.synchronize(T)
    assert isinstance(ev_a.error, RuntimeError) and ev_b.error is None


def test_add_done_callback_fires_once_from_the_worker(streams):
    s = streams()
    gate = threading.Event()
    ev = s.submit(lambda: gate.wait(T))
    calls = []
    ev.add_done_callback(lambda err: calls.append(("first", err, threading.get_ident())))
    ev.add_done_callback(lambda err: calls.append(("second", err, threading.get_ident())))
    assert calls == []
    gate.set()
    ev.synchronize(T)
    s.synchronize()
    w = worker_ident(s)
    assert calls == [("first", None, w), ("second", None, w)]
    ev.set()                                             # completing again changes nothing
    assert len(calls) == 2
    # added after completion: called exactly once, right away (like concurrent.futures)
    late = []
    ev.add_done_callback(lambda err: late.append(err))
    assert late == [None]
    s.synchronize()
    assert late == [None] and len(calls) == 2


def test_add_done_callback_gets_the_error(streams):
    s = streams()
    gate = threading.Event()

    def fail():
        assert gate.wait(T)
        raise KeyError("k")

    ev = s.submit(fail)
    got = []
    ev.add_done_callback(lambda err: got.append((err, threading.get_ident())))
    gate.set()
    s.synchronize()
    assert len(got) == 1 and isinstance(got[0][0], KeyError) and got[0][1] == worker_ident(s)
    late = []
    ev.add_done_callback(late.append)
    assert len(late) == 1 and late[0] is got[0][0]


def test_a_raising_callback_does_not_kill_the_stream(streams, caplog):
    s = streams()
    gate = threading.Event()
    ev = s.submit(lambda: gate.wait(T))
    order = []

    def bad(err):
        order.append("bad")
        raise RuntimeError("callback bug")

    ev.add_done_callback(bad)
    ev.add_done_callback(lambda err: order.append("good"))
    gate.set()
    later = s.submit(lambda: order.append("later"))
    later.synchronize(T)
    assert order == ["bad", "good", "later"]
    assert "callback bug" in caplog.text


def test_host_event_basics():
    ev = HostEvent()
    assert not ev.query() and ev.error is None
    with pytest.raises(TimeoutError):
        ev.synchronize(timeout=0.01)
    err = OSError("io")
    ev.set(err)
    assert ev.query() and ev.error is err
    ev.set()                       # first completion wins
    assert ev.error is err
    assert DONE.query() and DONE.error is None
    DONE.synchronize()
    flag = HostEvent(done=True)
    assert flag.query()


def test_close_drains_queued_work_and_rejects_new_work():
    s = HostStream("test-close")
    seen = []
    for i in range(20):
        s.submit(lambda i=i: (time.sleep(0.001), seen.append(i)))
    s.close()
    assert seen == list(range(20))
    with pytest.raises(RuntimeError):
        s.submit(lambda: None)
    s.close()                      # idempotent


def test_next_owner_does_not_write_before_previous_owners_copy_finished(streams):
    """A slot is released with the event of the copy that reads it as its fence;
    the next owner's write waits on the slot's fence (the core keeps its event id)."""
    a, b = streams("copy"), streams("write")
    slab = torch.zeros((2, 64), dtype=torch.uint8)
    core, events = Core(4, [(False, 0, 0, 0)], [[0], [-1], [-1]], [[2], [], []]), EventTable()
    (other,) = core.allocate(0, 0, 1)           # keep slot 0 busy so the next owner gets the fenced one
    (slot,) = core.allocate(0, 0, 1)
    assert (other, slot) == (0, 1)
    old = torch.arange(64, dtype=torch.uint8) * 3
    slab[slot] = old                            # the previous owner's page
    out = torch.zeros(64, dtype=torch.uint8)
    gate = threading.Event()
    copy_started = threading.Event()

    def copy_out():                             # e.g. a demotion reading the slot
        copy_started.set()
        assert gate.wait(T)
        out.copy_(slab[slot])

    copy_ev = a.submit(copy_out)
    core.release_slots(0, 0, [slot], events.id(copy_ev))     # the owner lets go before the copy finished
    assert core.is_free(0, 0, slot) and events.all(core.slot_fences(0, 0, [slot])) == [copy_ev]

    (new_slot,) = core.allocate(0, 0, 1)        # the next owner
    assert new_slot == slot
    (fence,) = events.all(core.slot_fences(0, 0, [slot]))   # it must wait on this before writing
    assert fence is copy_ev
    b.wait_event(fence)
    wrote = threading.Event()

    def write_new():
        slab[new_slot] = 0xEE
        wrote.set()

    write_ev = b.submit(write_new)
    assert copy_started.wait(T)
    time.sleep(SETTLE)
    assert not wrote.is_set() and not write_ev.query()
    assert torch.equal(slab[slot], old)         # nothing overwritten yet
    gate.set()
    write_ev.synchronize(T)
    assert copy_ev.error is None and write_ev.error is None
    assert torch.equal(out, old)                # the copy saw the OLD content
    assert bool((slab[slot] == 0xEE).all())
    assert torch.equal(slab[other], torch.zeros(64, dtype=torch.uint8))


def test_device_streams_are_host_streams_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: Device('cpu') still gives host streams, covered below")
    s = Device("auto").new_stream("dev")
    try:
        assert isinstance(s, HostStream) and s.kind == "host" and s.name == "dev"
        assert s.can_wait(HostEvent())
    finally:
        s.close()


# -- CUDA (only where present) ------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_cuda_stream_order_events_and_callbacks():
    from tiers.streams import CudaStream
    dev = torch.device("cuda")
    a, b = CudaStream(dev, "a"), CudaStream(dev, "b")
    try:
        x = torch.zeros(1 << 20, device=dev)
        ev_a = a.submit(lambda: x.add_(1))
        b.wait_event(ev_a)
        y = torch.empty_like(x)
        ev_b = b.submit(lambda: y.copy_(x * 2))
        got = []
        done = threading.Event()
        ev_b.add_done_callback(lambda err: (got.append((err, threading.get_ident())), done.set()))
        assert done.wait(T)
        assert got[0][0] is None and got[0][1] != threading.get_ident()
        ev_b.synchronize()
        assert ev_b.query() and bool((y == 2).all())
        bad = a.submit(lambda: (_ for _ in ()).throw(ValueError("x")))
        assert bad.query() and isinstance(bad.error, ValueError)
        assert b.can_wait(ev_a) and b.can_wait(DONE) and not b.can_wait(HostEvent())
    finally:
        a.close()
        b.close()


@cuda
def test_cuda_host_slab_is_pinned_in_place_at_its_exact_size():
    from tiers.device import Device
    dev = Device("cuda", pin_host=True)
    rows, cols = 3000, 4096 + 512             # 13.5 MiB: torch's pinned allocator would take 16 MiB
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) \
        if hasattr(torch.cuda, "host_memory_stats") else None
    slab = dev.host_slab(rows, cols)
    assert slab.shape == (rows, cols) and slab.is_pinned() and slab.data_ptr() % 4096 == 0
    assert int(slab[::97].sum()) == 0
    if before is not None:                     # not from torch's caching host allocator
        assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before
    src = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, device=dev.torch_device)
    slab.copy_(src, non_blocking=True)
    back = torch.empty_like(src)
    back.copy_(slab, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)


def test_host_slab_without_cuda_is_aligned_zeroed_and_pageable():
    from tiers.device import Device
    slab = Device("cpu", pin_host=True).host_slab(5, 1000)    # pinning asked for, but no CUDA copies use it
    assert slab.shape == (5, 1000) and slab.data_ptr() % 4096 == 0 and int(slab.sum()) == 0
    if not torch.cuda.is_available():
        assert not slab.is_pinned()


def test_a_failed_wait_fails_the_job_behind_it_instead_of_running_it():
    from tiers.streams import HostEvent, HostStream

    class Broken(HostEvent):
        def synchronize(self, timeout=None):
            raise RuntimeError("the device reported an error")
    s = HostStream("t")
    try:
        ran = []
        s.wait_event(Broken())
        ev = s.submit(lambda: ran.append(1))
        ev.synchronize(5)
        assert isinstance(ev.error, RuntimeError) and not ran
        ok = s.submit(lambda: ran.append(2))           # the stream carries on
        ok.synchronize(5)
        assert ok.error is None and ran == [2]
    finally:
        s.close()


def test_an_unordered_inline_job_runs_on_the_caller_past_queued_work():
    """``ordered=False``: for a caller whose job depends on nothing queued. It runs here at once,
    its errors go to its event, and a failed wait queued before stays for the queued job after."""
    from tiers.streams import HostEvent, HostStream
    s = HostStream("t")
    try:
        gate = threading.Event()
        first = s.submit(gate.wait)                                       # busy now
        where = []
        ev = s.submit(lambda: where.append(threading.get_ident()), inline=True, ordered=False)
        assert ev.query() and ev.error is None and where == [threading.get_ident()] and not first.query()
        bad = s.submit(lambda: 1 / 0, inline=True, ordered=False)
        assert bad.query() and isinstance(bad.error, ZeroDivisionError)

        class Broken(HostEvent):
            def synchronize(self, timeout=None):
                raise RuntimeError("the device reported an error")
        s.wait_event(Broken())                                            # queued behind the busy job
        queued = s.submit(lambda: where.append("queued"))
        passing = s.submit(lambda: where.append("past"), inline=True, ordered=False)
        assert passing.query() and passing.error is None and where[-1] == "past"
        gate.set()
        queued.synchronize(5)
        assert isinstance(queued.error, RuntimeError) and "queued" not in where    # the failed wait's
    finally:
        s.close()


def test_an_inline_job_runs_on_the_caller_only_when_the_stream_is_idle():
    from tiers.streams import HostEvent, HostStream
    s = HostStream("t")
    try:
        where = []
        ev = s.submit(lambda: where.append(threading.get_ident()), inline=True)
        assert ev.query() and where == [threading.get_ident()]          # idle: ran here, done on return
        gate = threading.Event()
        s.submit(gate.wait)                                               # busy now
        order = []
        behind = s.submit(lambda: order.append(("inline", threading.get_ident())), inline=True)
        assert not behind.query() and order == []                        # queued behind the busy job
        gate.set()
        behind.synchronize(5)
        assert order[0][1] != threading.get_ident()                     # ran on the worker, in order
        s.synchronize()

        class Broken(HostEvent):
            def synchronize(self, timeout=None):
                raise RuntimeError("the device reported an error")
        s.wait_event(Broken())
        for _ in range(500):                                              # the worker takes the failed wait
            if s._finished == s._queued:
                break
            threading.Event().wait(0.01)
        ran = []
        s.submit(lambda: ran.append("fire-and-forget"), event=False, inline=True)   # does not consume it
        failed = s.submit(lambda: ran.append("after the failed wait"), inline=True)
        assert failed.query() and isinstance(failed.error, RuntimeError)
        assert ran == ["fire-and-forget"]
        ok = s.submit(lambda: ran.append("next"), inline=True)
        assert ok.query() and ok.error is None and ran[-1] == "next"
    finally:
        s.close()

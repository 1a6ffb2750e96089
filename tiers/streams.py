"""Streams and ready events, on CUDA and emulated.

The contract both kinds keep: work submitted to a stream runs in order and
asynchronously to the caller; ``submit`` returns an event that completes when
that work is done (carrying its exception, if any); ``wait_event`` makes the
stream's later work wait for an event; events can be queried, synchronized,
and told to call back (from another thread) when done, which is what the
asyncio bridge in ``runtime.readiness`` builds on.

The emulated kind runs each stream's work on one worker thread, so torch ops
release the GIL and never run on the event loop. CUDA streams run the issuing
function on the caller's thread inside ``torch.cuda.stream``; completion
callbacks come from one waiter thread per stream, which synchronizes that
stream's events in the order they were recorded.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Callable, Optional

import torch

Callback = Callable[[Optional[BaseException]], None]

_log = logging.getLogger(__name__)


def _invoke(cb: Callback, error: BaseException | None) -> None:
    """Run a done-callback; one that raises is logged, never allowed to kill
    the stream's worker (or waiter) thread or skip the callbacks after it."""
    try:
        cb(error)
    except Exception:   # noqa: BLE001
        _log.exception("kvtier: event done-callback %r raised", cb)



WORKER_NICE = 5     # how much less CPU priority worker threads take than the event loop's thread


def _lower_priority() -> None:
    """Run this (worker) thread at a lower CPU priority than the event loop.
    Copies and checksums of 64 KiB or more and I/O calls on workers run
    without the GIL (``tiers.native.keep_gil_below``), so on a
    machine with few cores they compete with the loop for the CPU itself:
    at equal priority the scheduler hands the loop's core to a worker for a
    whole time slice (several ms of loop lag). A nicer worker still gets
    every idle cycle. Linux sets niceness per thread; elsewhere a no-op."""
    if not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + WORKER_NICE)
    except OSError:
        pass

class Event:
    __slots__ = ()

    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def add_done_callback(self, cb: Callback) -> None: ...

    @property
    def error(self) -> BaseException | None:
        return None


class HostEvent(Event):
    """A point on a host stream (or a plain completion flag). A thread that
    must block in ``synchronize`` parks on a lock of its own, which ``set``
    releases: nothing to wait on is made unless someone waits, where a
    ``threading.Event`` (a condition and two locks) cost 7x more to create,
    and every batch of moves creates some events."""

    __slots__ = ("_done", "_error", "_callbacks", "_lock", "_waiters")

    def __init__(self, done: bool = False) -> None:
        self._done = done
        self._error: BaseException | None = None
        self._callbacks: list[Callback] = []
        self._lock = threading.Lock()       # guards all the fields
        self._waiters: list[threading.Lock] | None = None   # held locks of the threads in synchronize

    def set(self, error: BaseException | None = None) -> None:
        with self._lock:
            if self._done:
                return
            self._error = error
            self._done = True
            callbacks, self._callbacks = self._callbacks, []
            waiters, self._waiters = self._waiters, None
        for w in waiters or ():
            w.release()
        for cb in callbacks:
            _invoke(cb, error)

    def query(self) -> bool:
        return self._done

    def synchronize(self, timeout: float | None = None) -> None:
        with self._lock:
            if self._done:
                return
            parked = threading.Lock()
            parked.acquire()
            if self._waiters is None:
                self._waiters = [parked]
            else:
                self._waiters.append(parked)
        if parked.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return
        with self._lock:
            if self._done:                  # set as the wait ran out: done in time after all
                return
            self._waiters.remove(parked)
        raise TimeoutError("event not done in time")

    @property
    def error(self) -> BaseException | None:
        return self._error

    def add_done_callback(self, cb: Callback) -> None:
        with self._lock:
            if not self._done:
                self._callbacks.append(cb)
                return
        _invoke(cb, self._error)


DONE = HostEvent(done=True)


_WAIT = object()      # marks a queued wait on another stream's event


class HostStream:
    """An ordered queue of work on one worker thread.

    ``submit(fn, inline=True)`` runs ``fn`` on the caller's thread instead
    when the stream is idle (nothing queued or running), which keeps the
    order. For a job of a few microseconds (a small copy between host
    tensors) the hop to the worker and back costs far more than the job,
    and under a busy event loop the worker also waits for the GIL. That
    makes an idle emulated copy stream behave like a CUDA one: the work is
    issued on the caller's thread, and the event is already done.
    ``ordered=False`` runs it inline even past queued work: for a caller
    whose job depends on nothing queued (the migration engine's copies
    name what they depend on as events, and go inline only when those
    have passed).

    One thread submits (the event loop's): ``submit`` and ``wait_event``
    count what they queue without a lock."""

    kind = "host"
    __slots__ = ("name", "_queue", "_thread", "_closed", "_queued", "_finished", "_failed_wait")

    def __init__(self, name: str = "kvtier-stream") -> None:
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._queued = 0            # items put, by the submitting thread
        self._finished = 0          # items done, by the worker: equal means idle
        self._failed_wait: BaseException | None = None   # a wait that failed: the next job must not run
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        _lower_priority()
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, ev = item
            try:
                if ev is _WAIT:
                    try:
                        fn()
                    except BaseException as exc:   # noqa: BLE001 - fails the job queued after the wait
                        self._failed_wait = exc
                else:
                    self._execute(fn, ev)
            finally:
                self._finished += 1

    def _execute(self, fn: Callable[[], None], ev: HostEvent | None) -> None:
        """Run one job (unless a wait before it failed) and complete its event."""
        if ev is not None and self._failed_wait is not None:
            failed, self._failed_wait = self._failed_wait, None
            ev.set(failed)
            return
        self._run_job(fn, ev)

    def _run_job(self, fn: Callable[[], None], ev: HostEvent | None) -> None:
        """Run ``fn`` and complete ``ev`` with how it ended (a fire-and-forget job's error logs)."""
        try:
            fn()
        except BaseException as exc:   # noqa: BLE001 - delivered to the event's waiters
            if ev is None:
                _log.warning("%s: background job failed: %r", self.name, exc)
                return
            ev.set(exc)
        else:
            if ev is not None:
                ev.set()

    def submit(self, fn: Callable[[], None], event: bool = True, inline: bool = False,
               ordered: bool = True) -> HostEvent | None:
        """Queue ``fn`` (or with ``inline``, run it now if the stream is
        idle, or with ``ordered=False`` too, whatever is queued); its
        completion event, or None with ``event=False`` for fire-and-forget
        work (an error then only logs)."""
        if self._closed:
            raise RuntimeError(f"stream {self.name} is closed")
        ev = HostEvent() if event else None
        if inline and self.idle:
            self._execute(fn, ev)
            return ev
        if inline and not ordered:      # past queued work: a failed wait there is not this job's
            self._run_job(fn, ev)
            return ev
        self._queued += 1
        self._queue.put((fn, ev))
        return ev

    @property
    def idle(self) -> bool:
        """Nothing queued or running: work done on the caller's thread now keeps the order."""
        return self._finished == self._queued

    @property
    def queued(self) -> int:
        """How many items were ever submitted (jobs and waits): a submitter can tell whether
        anything went in after its own item."""
        return self._queued

    def record(self) -> HostEvent:
        return self.submit(lambda: None)

    def can_wait(self, ev: Event) -> bool:
        return True

    def wait_event(self, ev: Event) -> None:
        if not ev.query():
            self._queued += 1
            self._queue.put((ev.synchronize, _WAIT))

    def synchronize(self) -> None:
        self.record().synchronize()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()


class CudaEvent(Event):
    """A ``torch.cuda.Event``. Done-callbacks come from the recording
    stream's waiter thread, or from a shared one for events recorded on a
    caller's stream (``CudaEvent.on(stream)``)."""

    __slots__ = ("_event", "_waiter", "_error")

    def __init__(self, event: "torch.cuda.Event", waiter: "_EventWaiter") -> None:
        self._event = event
        self._waiter = waiter
        self._error = None

    @classmethod
    def on(cls, stream: "torch.cuda.Stream") -> "CudaEvent":
        ev = torch.cuda.Event(blocking=True)
        ev.record(stream)
        return cls(ev, _foreign_waiter(stream.device))

    def query(self) -> bool:
        return self._event.query()

    def synchronize(self) -> None:
        self._event.synchronize()

    def add_done_callback(self, cb: Callback) -> None:
        self._waiter.put(self._event, cb)


class _EventWaiter:
    """One thread that synchronizes CUDA events in submission order (events of
    one stream complete in order) and then calls their callbacks."""

    __slots__ = ("_queue", "_thread", "device")

    def __init__(self, device: torch.device, name: str) -> None:
        self.device = device
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, event: "torch.cuda.Event", cb: Callback) -> None:
        self._queue.put((event, cb))

    def _run(self) -> None:
        broken: BaseException | None = None
        try:
            torch.cuda.set_device(self.device)
        except BaseException as exc:   # noqa: BLE001 - every waiter gets it, none hangs
            broken = exc
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, cb = item
            error = broken
            if error is None:
                try:
                    event.synchronize()
                except BaseException as exc:   # noqa: BLE001
                    error = exc
            _invoke(cb, error)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


_FOREIGN: dict = {}
_FOREIGN_LOCK = threading.Lock()


def _foreign_waiter(device: torch.device) -> _EventWaiter:
    with _FOREIGN_LOCK:
        w = _FOREIGN.get(device)
        if w is None:
            w = _FOREIGN[device] = _EventWaiter(device, "kvtier-cuda-foreign-waiter")
        return w


class CudaStream:
    """A ``torch.cuda.Stream`` with the HostStream contract."""

    kind = "cuda"
    __slots__ = ("name", "stream", "device", "_waiter")

    def __init__(self, device: torch.device, name: str = "kvtier-cuda") -> None:
        self.name = name
        if device.index is None:        # the waiter thread's set_device needs an index
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._waiter = _EventWaiter(device, name + "-waiter")

    def submit(self, fn: Callable[[], None], inline: bool = True) -> Event:
        """Issue ``fn``'s kernels and copies on this stream from the caller's
        thread (always: a launch is asynchronous); the event after them."""
        with torch.cuda.stream(self.stream):
            try:
                fn()
            except BaseException as exc:   # noqa: BLE001 - surfaced like a failed host-stream job
                # copies the job queued before it failed may still write the destination slots,
                # which go back to the allocator: let them finish first (a rare, short wait)
                self.stream.synchronize()
                return _failed(exc)
        return self.record()

    def record(self) -> CudaEvent:
        ev = torch.cuda.Event(blocking=True)    # waiters sleep in synchronize() instead of spinning
        ev.record(self.stream)
        return CudaEvent(ev, self._waiter)

    def can_wait(self, ev: Event) -> bool:
        """Host events would block the issuing thread; the engine awaits them first."""
        return isinstance(ev, CudaEvent) or ev.query()

    def wait_event(self, ev: Event) -> None:
        if isinstance(ev, CudaEvent):
            self.stream.wait_event(ev._event)
        else:
            ev.synchronize()

    def synchronize(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        self._waiter.close()


def _failed(exc: BaseException) -> HostEvent:
    ev = HostEvent()
    ev.set(exc)
    return ev


Stream = HostStream | CudaStream

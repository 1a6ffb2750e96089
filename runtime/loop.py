"""Running kvtier's coroutines: uvloop when installed, asyncio otherwise."""
from __future__ import annotations

import asyncio
import collections.abc
import contextlib
import logging
import sys
import threading
from typing import Any, Awaitable, Callable, Coroutine, Generator, Iterator

try:
    import uvloop
except ImportError:   # pragma: no cover - platforms without uvloop
    uvloop = None


def run(main: Coroutine[Any, Any, Any], *, use_uvloop: bool = True) -> Any:
    if use_uvloop and uvloop is not None:
        return uvloop.run(main)
    return asyncio.run(main)


_switch_lock = threading.Lock()
_switch_users = 0
_switch_saved = 0.0


@contextlib.contextmanager
def short_switch_interval(seconds: float = 0.0005) -> Iterator[None]:
    """While bulk work runs on a worker thread (a journal replay, an index
    rebuild), shorten the interpreter's switch interval: between its native
    calls the worker runs Python holding the GIL, and the event loop waits
    up to the interval (5 ms by default) for it each time. Nested and
    concurrent users share one change; the last one out restores it."""
    global _switch_users, _switch_saved
    with _switch_lock:
        if _switch_users == 0:
            _switch_saved = sys.getswitchinterval()
            sys.setswitchinterval(min(seconds, _switch_saved))
        _switch_users += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_users -= 1
            if _switch_users == 0:
                sys.setswitchinterval(_switch_saved)


class _Continuation(collections.abc.Coroutine):
    """A coroutine that already ran up to its first suspension, where it yielded ``first``
    (what it waits on: a future, or None for a bare yield), as a coroutine a task can run:
    the task's first step gets ``first`` to wait on, and everything after goes to the
    coroutine, a cancellation before that first step included (it then cancels ``first``
    too, as a task cancelled while waiting on a future does)."""

    __slots__ = ("coro", "first", "blocking", "started")

    def __init__(self, coro: Coroutine, first: Any) -> None:
        self.coro = coro
        self.first = first
        # Future.__await__ marks the future it yields as awaited; the task that receives it
        # clears the mark at once. Until our task takes it, others may await that future too.
        self.blocking = getattr(first, "_asyncio_future_blocking", False)
        if self.blocking:
            first._asyncio_future_blocking = False
        self.started = False

    def send(self, value: Any) -> Any:
        if not self.started:
            self.started = True
            first, self.first = self.first, None
            if self.blocking:
                first._asyncio_future_blocking = True
            return first
        return self.coro.send(value)

    def __next__(self) -> Any:
        return self.send(None)

    def throw(self, typ, val=None, tb=None) -> Any:     # noqa: ANN001 - the generator protocol's signature
        if not self.started:
            self.started = True
            first, self.first = self.first, None
            exc = typ if val is None else val
            if (exc is asyncio.CancelledError or isinstance(exc, asyncio.CancelledError)) and \
                    isinstance(first, asyncio.Future):
                first.cancel()
        if val is None and tb is None:
            return self.coro.throw(typ)
        return self.coro.throw(typ, val, tb)

    def close(self) -> None:
        self.coro.close()

    def __await__(self) -> Generator[Any, Any, Any]:
        return self

    # what a task's get_stack() and "destroyed but pending" warnings read of its coroutine
    @property
    def cr_frame(self) -> Any:
        return getattr(self.coro, "cr_frame", None)

    @property
    def cr_await(self) -> Any:
        return getattr(self.coro, "cr_await", None)


def start_eagerly(coro: Coroutine, loop: asyncio.AbstractEventLoop) -> tuple[bool, Any]:
    """Run ``coro`` on the caller's stack until it first suspends (a form of Python 3.12's
    eager tasks, for 3.11). Returns (True, its result) when it finished without suspending:
    no task, no loop turn. Else (False, a task of ``loop`` that continues it). Its exception,
    if it raised before suspending, propagates. Nothing can cancel it before it suspends.

    Unlike 3.12's, the part before the first wait runs as the caller: in its context
    (contextvars) and as its ``asyncio.current_task()``. So ``coro`` must not enter
    ``asyncio.timeout``, ``wait_for`` or a TaskGroup before its first wait: those would
    cancel the caller. The store's acquire and extend do not."""
    try:
        first = coro.send(None)
    except StopIteration as stop:
        return True, stop.value
    return False, loop.create_task(_Continuation(coro, first),
                                   name=getattr(coro, "__qualname__", None))


async def every(seconds: float, job: Callable[[], Awaitable[Any]], what: str) -> None:
    """Await ``job()`` every ``seconds`` until cancelled; a failure is logged (``what``
    failed), never fatal: background duties must outlive any one bad turn."""
    while True:
        await asyncio.sleep(seconds)
        try:
            await job()
        except Exception:       # noqa: BLE001 - see above
            logging.getLogger("kvtier").exception("%s failed", what)

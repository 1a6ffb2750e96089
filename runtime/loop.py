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
    coroutine, a cancellation before that first step included."""

    __slots__ = ("coro", "first", "started")

    def __init__(self, coro: Coroutine, first: Any) -> None:
        self.coro = coro
        self.first = first
        self.started = False

    def send(self, value: Any) -> Any:
        if not self.started:
            self.started = True
            return self.first
        return self.coro.send(value)

    def throw(self, typ, val=None, tb=None) -> Any:     # noqa: ANN001 - the generator protocol's signature
        self.started = True
        if val is None and tb is None:
            return self.coro.throw(typ)
        return self.coro.throw(typ, val, tb)

    def close(self) -> None:
        self.coro.close()

    def __await__(self) -> Generator[Any, Any, Any]:
        return self


def start_eagerly(coro: Coroutine, loop: asyncio.AbstractEventLoop) -> tuple[bool, Any]:
    """Run ``coro`` on the caller's stack until it first suspends (asyncio's eager tasks,
    Python 3.12, for 3.11). Returns (True, its result) when it finished without suspending:
    no task, no loop turn. Else (False, a task of ``loop`` that continues it). Its exception,
    if it raised before suspending, propagates. Nothing can cancel it before it suspends."""
    try:
        first = coro.send(None)
    except StopIteration as stop:
        return True, stop.value
    return False, loop.create_task(_Continuation(coro, first))


async def every(seconds: float, job: Callable[[], Awaitable[Any]], what: str) -> None:
    """Await ``job()`` every ``seconds`` until cancelled; a failure is logged (``what``
    failed), never fatal: background duties must outlive any one bad turn."""
    while True:
        await asyncio.sleep(seconds)
        try:
            await job()
        except Exception:       # noqa: BLE001 - see above
            logging.getLogger("kvtier").exception("%s failed", what)

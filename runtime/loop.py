"""Running kvtier's coroutines: uvloop when installed, asyncio otherwise."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
from typing import Any, Awaitable, Callable, Coroutine, Iterator

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


async def every(seconds: float, job: Callable[[], Awaitable[Any]], what: str) -> None:
    """Await ``job()`` every ``seconds`` until cancelled; a failure is logged (``what``
    failed), never fatal: background duties must outlive any one bad turn."""
    while True:
        await asyncio.sleep(seconds)
        try:
            await job()
        except Exception:       # noqa: BLE001 - see above
            logging.getLogger("kvtier").exception("%s failed", what)

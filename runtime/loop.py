"""Running kvtier's coroutines: uvloop when installed, asyncio otherwise."""
from __future__ import annotations

import asyncio
import contextlib
import gc
from typing import Any, Coroutine, Iterator

try:
    import uvloop
except ImportError:   # pragma: no cover - platforms without uvloop
    uvloop = None


def run(main: Coroutine[Any, Any, Any], *, use_uvloop: bool = True) -> Any:
    if use_uvloop and uvloop is not None:
        return uvloop.run(main)
    return asyncio.run(main)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """For bulk work off the loop that allocates many long-lived objects
    (replaying a disk journal, rebuilding the index): a cyclic-GC pass it
    triggers would scan them all with the GIL held and stall the event loop
    for hundreds of milliseconds. Collection resumes afterwards."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()

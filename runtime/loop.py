"""Running kvtier's coroutines: uvloop when installed, asyncio otherwise."""
from __future__ import annotations

import asyncio
from typing import Any, Coroutine

try:
    import uvloop
except ImportError:   # pragma: no cover - platforms without uvloop
    uvloop = None


def run(main: Coroutine[Any, Any, Any], *, use_uvloop: bool = True) -> Any:
    if use_uvloop and uvloop is not None:
        return uvloop.run(main)
    return asyncio.run(main)

"""Python objects the native core names by int ids: copy events and claims.

The core keeps an event id per page (its ready event) and per freed slot (its
fence), and a claim id per page in flight. The objects live here, on the
Python side: a done event needs no id at all (0), so the table only holds
events still running and sweeps the rest away as it grows.
"""
from __future__ import annotations

import asyncio
from typing import Iterable

from tiers.streams import Event

_MAX_ID = (1 << 31) - 1


class EventTable:
    """Event <-> id. Id 0 means none (or already passed); an id whose event
    was swept away (it passed) reads back as None, which waits on nothing."""

    __slots__ = ("_events", "_next", "_sweep_at", "_last", "_last_id")

    def __init__(self) -> None:
        self._events: dict[int, Event] = {}
        self._next = 0
        self._sweep_at = 1024
        self._last: Event | None = None      # a batch's event is registered for its pages and slots at once
        self._last_id = 0

    def id(self, ev: Event | None, keep: bool = False) -> int:
        """``ev``'s id (0 for none, or one already done unless ``keep``: a caller that must
        find its pages by this id later, whatever the event ended with)."""
        if ev is None:
            return 0
        if ev is self._last:
            return self._last_id
        if ev.query() and not keep:
            return 0
        self._next = self._next + 1 if self._next < _MAX_ID else 1
        self._events[self._next] = ev
        self._last, self._last_id = ev, self._next
        if len(self._events) >= self._sweep_at:
            self._events = {k: e for k, e in self._events.items() if not e.query()}
            self._sweep_at = max(1024, 2 * len(self._events))
        return self._next

    def get(self, i: int) -> Event | None:
        return self._events.get(i) if i else None

    def all(self, ids: Iterable[int]) -> list[Event]:
        get = self._events.get
        return [e for e in map(get, ids) if e is not None]


class ClaimTable:
    """Claim id -> the future its waiters await (one per batch a move runs)."""

    __slots__ = ("futures", "loop")

    def __init__(self) -> None:
        self.futures: dict[int, asyncio.Future] = {}
        self.loop: asyncio.AbstractEventLoop | None = None      # the store's, set when it starts

    def open(self, ids: Iterable[int], to_gpu: bool) -> None:
        loop = self.loop or asyncio.get_running_loop()
        for i in ids:
            fut = loop.create_future()
            fut.to_gpu = to_gpu        # waiters on a promotion get its error
            self.futures[i] = fut

    def settle(self, ids: Iterable[int], exc: BaseException | None = None) -> None:
        """Resolve each claim once. An error is marked retrieved here: the
        failed operation raises it itself, and waiters still see it."""
        pop = self.futures.pop
        for i in ids:
            fut = pop(i, None)
            if fut is None or fut.done():
                continue
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)
                fut.exception()

    def pending(self, ids: Iterable[int]) -> list[asyncio.Future]:
        get = self.futures.get
        return [f for f in map(get, ids) if f is not None]

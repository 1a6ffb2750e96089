"""The bridge from stream events to asyncio.

An event's done-callback fires on a worker (or CUDA waiter) thread and hands
the result to the loop with ``call_soon_threadsafe``: no polling, no thread
per page, one callback per batch event.
"""
from __future__ import annotations

import asyncio
from typing import Iterable

from tiers.streams import Event


def event_future(ev: Event, loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Future:
    loop = loop or asyncio.get_running_loop()
    fut = loop.create_future()

    def _settle(error: BaseException | None) -> None:
        if fut.done():
            return
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)

    def _done(error: BaseException | None) -> None:
        try:
            loop.call_soon_threadsafe(_settle, error)
        except RuntimeError:    # loop closed: nobody is waiting any more
            pass

    ev.add_done_callback(_done)
    return fut


async def wait_event(ev: Event | None, loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Await one event (a done event returns at once, raising its error). Callers that
    know their loop pass it: on Python 3.11 looking it up is a getpid() system call."""
    if ev is None:
        return
    if ev.query():
        if ev.error is not None:
            raise ev.error
        return
    await event_future(ev, loop)


async def outlast(ev: Event, loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Wait until ``ev`` is done, whatever it ended with, through cancellations: for a caller
    cancelled while a job it queued may still write memory that its cleanup hands on."""
    if ev.query():
        return
    fut = event_future(ev, loop)
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            continue
        except Exception:       # noqa: BLE001 - the job failed: it is done all the same
            return
    if not fut.cancelled():
        fut.exception()         # retrieved: a failed job is the caller's to report, not the loop's


async def ended(ev: Event, loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Wait until ``ev`` is done, whatever it ended with; cancelling the waiter cancels only the
    wait (for a caller that watches work it does not own, as ``Store.drain``)."""
    if ev.query():
        return
    fut = event_future(ev, loop)
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())    # retrieved: the job reports it
    await asyncio.wait([fut])


async def wait_events(events: Iterable[Event | None]) -> None:
    pending = {id(e): e for e in events if e is not None}
    for ev in pending.values():
        await wait_event(ev)

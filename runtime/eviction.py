"""Prioritised LRU: lowest priority first, then least recently used (lowest
``page.stamp``).

Each priority has an ``OrderedDict`` in stamp order: stamps come from one
rising clock, so a touched page moves to the end and a page pushed with the
newest stamp appends, both O(1) in C. A page pushed with an older stamp (a
demoted page keeps its recency in the colder tier; a page released late by a
slow sequence) goes to a small side heap instead, and ``pop`` takes whichever
of the two heads is older. That keeps the order exact without a heap
operation on the common path.

``page.qentry`` says where a queued page is: ``IN_ORDER`` for the ordered
dict, its heap entry for the side heap, None when not queued.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
from collections import OrderedDict
from typing import Any

IN_ORDER = True


class _Class:
    """The pages of one priority."""

    __slots__ = ("order", "late", "dead")

    def __init__(self) -> None:
        self.order: OrderedDict = OrderedDict()     # page -> None, ascending stamp
        self.late: list[list] = []                  # heap of [stamp, tiebreak, page or None]
        self.dead = 0                               # blanked entries in ``late``

    def head_of_late(self) -> list | None:
        late = self.late
        while late and late[0][2] is None:
            heapq.heappop(late)
            self.dead -= 1
        return late[0] if late else None


class EvictionQueue:
    __slots__ = ("_classes", "_priorities", "_live", "_tiebreak")

    def __init__(self) -> None:
        self._classes: dict[int, _Class] = {}
        self._priorities: list[int] = []            # ascending: the eviction order of classes
        self._live = 0
        self._tiebreak = itertools.count()

    def __len__(self) -> int:
        return self._live

    def _class(self, priority: int) -> _Class:
        c = self._classes.get(priority)
        if c is None:
            c = self._classes[priority] = _Class()
            bisect.insort(self._priorities, priority)
        return c

    def push(self, page: Any) -> None:
        c = self._classes.get(page.priority) or self._class(page.priority)
        order = c.order
        if not order or next(reversed(order)).stamp <= page.stamp:
            order[page] = None
            page.qentry = IN_ORDER
        else:
            entry = [page.stamp, next(self._tiebreak), page]
            heapq.heappush(c.late, entry)
            page.qentry = entry
        self._live += 1

    def push_many(self, pages) -> None:
        """``push`` each page; in ascending stamp order (as moves and releases
        give them) every page appends, with one tail check per priority run."""
        classes, prio, n = self._classes, None, 0
        for page in pages:
            if page.priority != prio:
                prio = page.priority
                c = classes.get(prio) or self._class(prio)
                order = c.order
                tail = next(reversed(order)).stamp if order else -1
            stamp = page.stamp
            if tail <= stamp:
                order[page] = None
                page.qentry = IN_ORDER
                tail = stamp
            else:
                entry = [stamp, next(self._tiebreak), page]
                heapq.heappush(c.late, entry)
                page.qentry = entry
            n += 1
        self._live += n

    def touch(self, page: Any) -> None:
        """``page`` (queued) just got the newest stamp."""
        c = self._classes[page.priority]
        entry = page.qentry
        if entry is IN_ORDER:
            c.order.move_to_end(page)
            return
        self._blank(c, entry)
        c.order[page] = None
        page.qentry = IN_ORDER

    def remove(self, page: Any) -> None:
        entry = page.qentry
        if entry is None:
            return
        c = self._classes[page.priority]
        if entry is IN_ORDER:
            del c.order[page]
        else:
            self._blank(c, entry)
        page.qentry = None
        self._live -= 1

    @staticmethod
    def _blank(c: _Class, entry: list) -> None:
        entry[2] = None
        c.dead += 1
        if c.dead > 64 and 2 * c.dead > len(c.late):
            c.late = [e for e in c.late if e[2] is not None]
            heapq.heapify(c.late)
            c.dead = 0

    def pop(self) -> Any | None:
        """The best victim, or None."""
        got = self.pop_many(1)
        return got[0] if got else None

    def pop_many(self, n: int) -> list:
        """Up to ``n`` victims, best first."""
        out: list = []
        for prio in self._priorities:
            c = self._classes[prio]
            order = c.order
            while len(out) < n:
                top = c.head_of_late()
                if top is None:
                    for _ in range(min(n - len(out), len(order))):
                        page = order.popitem(last=False)[0]
                        page.qentry = None
                        out.append(page)
                    break
                limit = top[0]          # take in-order pages up to the late head's stamp in one run
                while order and len(out) < n:
                    first = next(iter(order))
                    if first.stamp > limit:
                        break
                    del order[first]
                    first.qentry = None
                    out.append(first)
                if len(out) < n:
                    page = heapq.heappop(c.late)[2]
                    page.qentry = None
                    out.append(page)
            if len(out) >= n:
                break
        self._live -= len(out)
        return out

"""Prioritised LRU: lowest priority first, then least recently used.

A heap of ``[priority, stamp, tiebreak, page]`` entries with lazy deletion:
removing a page blanks its entry; the heap is rebuilt when blanks dominate.
Insertion by the page's own stamp is what lets a demoted page keep its
recency in the colder tier. Touching a queued page only updates its stamp:
``pop`` finds the entry stale and re-inserts it where it now belongs, so a
hit costs O(1) instead of a heap update.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable


class EvictionQueue:
    __slots__ = ("_heap", "_live", "_tiebreak")

    def __init__(self) -> None:
        self._heap: list[list] = []
        self._live = 0
        self._tiebreak = itertools.count()

    def __len__(self) -> int:
        return self._live

    def push(self, page: Any) -> None:
        entry = [page.priority, page.stamp, next(self._tiebreak), page]
        page.qentry = entry
        heapq.heappush(self._heap, entry)
        self._live += 1

    def remove(self, page: Any) -> None:
        entry = page.qentry
        if entry is not None:
            entry[3] = None
            page.qentry = None
            self._live -= 1
            if len(self._heap) > 64 and len(self._heap) > 4 * self._live:
                self._heap = [e for e in self._heap if e[3] is not None]
                heapq.heapify(self._heap)

    def pop(self, accept: Callable[[Any], bool] = lambda p: True) -> Any | None:
        """The best victim that ``accept`` takes; rejected pages stay queued."""
        skipped = []
        try:
            while self._heap:
                entry = heapq.heappop(self._heap)
                page = entry[3]
                if page is None:
                    continue
                if entry[1] != page.stamp or entry[0] != page.priority:
                    entry[0], entry[1] = page.priority, page.stamp
                    heapq.heappush(self._heap, entry)
                    continue
                if accept(page):
                    page.qentry = None
                    self._live -= 1
                    return page
                skipped.append(entry)
            return None
        finally:
            for e in skipped:
                heapq.heappush(self._heap, e)

"""The bare reference: a plain LRU prefix cache of N blocks, no tiers, no
bytes. Benchmarks replay the same trace through it to get the control-plane
speed limit; requests touch their blocks deepest-first, like the Store."""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


class LruPrefixCache:
    __slots__ = ("capacity", "_lru", "hits", "lookups")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lru: OrderedDict = OrderedDict()    # key -> None, least recent first
        self.hits = 0
        self.lookups = 0

    def request(self, keys: Sequence) -> int:
        """Match the longest cached prefix, then cache every block; returns the match."""
        lru = self._lru
        matched = 0
        for k in keys:
            if k not in lru:
                break
            matched += 1
        self.hits += matched
        self.lookups += len(keys)
        for k in reversed(keys):
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = None
        while len(lru) > self.capacity:
            lru.popitem(last=False)
        return matched

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


class _Rec:
    __slots__ = ("key", "parent", "tier", "slot")

    def __init__(self, key, parent: "_Rec | None", slot: int) -> None:
        self.key = key
        self.parent = parent
        self.tier = 0
        self.slot = slot


class TieredLruBound:
    """The store's eviction policy over tiers of ``capacities`` blocks with
    nothing but its bookkeeping: one record per block, one ``OrderedDict``
    LRU and one free-slot list per tier; a full tier demotes its least
    recent blocks one tier down, the last tier drops them, a hit on a colder
    block promotes it to the first tier. No bytes, no awaits, no claims, no
    priorities, one life cycle. It makes the same moves as the store, so its
    speed bounds any control plane that keeps a Python record per page:
    benchmarks print it beside the bare LRU."""

    __slots__ = ("nodes", "lru", "free", "owner", "hits", "lookups", "moves", "drops")

    def __init__(self, capacities: Sequence[int]) -> None:
        if not capacities or min(capacities) < 1:
            raise ValueError(f"every tier needs at least one block, got {list(capacities)}")
        self.nodes: dict = {}                                    # key -> record
        self.lru = [OrderedDict() for _ in capacities]           # per tier: record -> None, least recent first
        self.free = [list(range(c)) for c in capacities]
        self.owner: list[list[_Rec | None]] = [[None] * c for c in capacities]
        self.hits = self.lookups = self.moves = self.drops = 0

    def request(self, keys: Sequence) -> int:
        """Match, promote the matched blocks and add the rest in the first
        tier, touch them deepest-first; returns the match."""
        nodes, lru = self.nodes, self.lru
        path: list[_Rec] = []
        parent = None
        for k in keys:
            rec = nodes.get(k)
            if rec is None or rec.parent is not parent:
                break
            path.append(rec)
            parent = rec
        matched = len(path)
        for rec in path:                 # in use: no victim of the room made below
            del lru[rec.tier][rec]
        cold = [rec for rec in path if rec.tier]
        need = len(cold) + len(keys) - matched
        if need > len(self.owner[0]):
            raise ValueError(f"a request of {need} new or promoted blocks exceeds the first tier")
        self._make_room(0, need)
        free0, own0 = self.free[0], self.owner[0]
        for rec in cold:
            self.free[rec.tier].append(rec.slot)
            self.owner[rec.tier][rec.slot] = None
            rec.tier, rec.slot = 0, free0.pop()
            own0[rec.slot] = rec
        self.moves += len(cold)
        for i in range(matched, len(keys)):
            rec = _Rec(keys[i], parent, free0.pop())
            own0[rec.slot] = nodes[keys[i]] = parent = rec
            path.append(rec)
        lru0 = lru[0]
        for rec in reversed(path):
            lru0[rec] = None
        self.hits += matched
        self.lookups += len(keys)
        return matched

    def _make_room(self, tier: int, n: int) -> None:
        free = self.free[tier]
        if len(free) >= n:
            return
        lru = self.lru[tier]
        victims = [lru.popitem(last=False)[0] for _ in range(min(n - len(free), len(lru)))]
        own = self.owner[tier]
        for v in victims:
            own[v.slot] = None
            free.append(v.slot)
        nxt = tier + 1
        placed = 0
        if nxt < len(self.lru):
            self._make_room(nxt, len(victims))
            nfree, nlru, nown = self.free[nxt], self.lru[nxt], self.owner[nxt]
            placed = min(len(victims), len(nfree))
            for v in victims[:placed]:
                v.tier, v.slot = nxt, nfree.pop()
                nown[v.slot] = v
                nlru[v] = None
            self.moves += placed
        nodes = self.nodes
        for v in victims[placed:]:       # the last tier (or a colder one with no room) drops
            if nodes.get(v.key) is v:
                del nodes[v.key]
        self.drops += len(victims) - placed

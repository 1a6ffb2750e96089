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
    __slots__ = ("key", "parent", "children", "tier", "slot")

    def __init__(self, key, parent: _Rec | None, slot: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[_Rec, None] | None = None    # made on the first child: most blocks are leaves
        self.tier = 0
        self.slot = slot


class TieredLruBound:
    """The store's eviction policy over tiers of ``capacities`` blocks with
    nothing but its bookkeeping: one record per block, one ``OrderedDict``
    LRU and one free-slot list per tier. As in the store, a request first
    promotes its matched colder blocks to the first tier, then adds its new
    ones; a full tier demotes its least recent blocks to the next tier that
    can take the whole batch, and drops them (with their descendants) when
    none can, as the last tier does. No bytes, no awaits, no claims, no
    priorities, one life cycle. It makes the store's moves and drops, so
    its speed bounds any control plane that keeps a Python record per page:
    benchmarks print it beside the bare LRU."""

    __slots__ = ("nodes", "lru", "free", "capacity", "hits", "lookups", "moves", "drops")

    def __init__(self, capacities: Sequence[int]) -> None:
        if not capacities or min(capacities) < 1:
            raise ValueError(f"every tier needs at least one block, got {list(capacities)}")
        self.capacity = list(capacities)
        self.nodes: dict = {}                                    # key -> record
        self.lru = [OrderedDict() for _ in capacities]           # per tier: record -> None, least recent first
        self.free = [list(range(c)) for c in capacities]
        self.hits = self.lookups = self.moves = self.drops = 0

    def request(self, keys: Sequence) -> int:
        """Match, promote, add the rest (unless a key is repeated or already
        indexed elsewhere: the store refuses to commit those), touch them
        deepest-first; returns the match."""
        if len(keys) > self.capacity[0]:          # checked before anything changes
            raise ValueError(f"a request of {len(keys)} blocks exceeds the first tier's {self.capacity[0]}")
        nodes, lru, free = self.nodes, self.lru, self.free
        path: list[_Rec] = []
        parent = None
        for k in keys:
            rec = nodes.get(k)
            if rec is None or rec.parent is not parent:
                break
            path.append(rec)
            parent = rec
        matched = len(path)
        cold = []
        for rec in path:                 # in use: no victim of the room made below
            del lru[rec.tier][rec]
            if rec.tier:
                cold.append(rec)
        if cold:
            self._make_room(0, len(cold))
            free0 = free[0]
            for rec in cold:
                free[rec.tier].append(rec.slot)
                rec.tier, rec.slot = 0, free0.pop()
            self.moves += len(cold)
        new = keys[matched:]
        if new and nodes.keys().isdisjoint(new) and len(set(new)) == len(new):
            self._make_room(0, len(new))
            free0 = free[0]
            for k in new:
                rec = nodes[k] = _Rec(k, parent, free0.pop())
                if parent is not None:
                    if parent.children is None:
                        parent.children = {rec: None}
                    else:
                        parent.children[rec] = None
                path.append(rec)
                parent = rec
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
        for v in victims:
            free.append(v.slot)
        k, lrus, frees = len(victims), self.lru, self.free
        for nxt in range(tier + 1, len(lrus)):
            if len(frees[nxt]) + len(lrus[nxt]) >= k:     # takes the whole batch
                self._make_room(nxt, k)
                nfree, nlru = frees[nxt], lrus[nxt]
                for v in victims:
                    v.tier, v.slot = nxt, nfree.pop()
                    nlru[v] = None
                self.moves += k
                return
        for v in victims:                 # no colder tier can take them: drop (slots already freed)
            v.tier = -1
        self.drops += k                   # as the store counts: evicted pages, not their descendants
        for v in victims:
            self._drop(v)

    def _drop(self, root: _Rec) -> None:
        """Forget ``root`` and its descendants (a colder tier may still hold some)."""
        nodes = self.nodes
        parent = root.parent
        if parent is not None and parent.children is not None:
            parent.children.pop(root, None)
        stack = [root]
        while stack:
            rec = stack.pop()
            if nodes.get(rec.key) is not rec:
                continue                 # gone already, with an ancestor dropped before it
            del nodes[rec.key]
            if rec.tier >= 0:            # still in a tier: free its slot
                del self.lru[rec.tier][rec]
                self.free[rec.tier].append(rec.slot)
                rec.tier = -1
            if rec.children is not None:
                stack.extend(rec.children)

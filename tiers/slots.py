"""Slot allocation for one pool group: all-or-nothing, ready slots first.

A freed slot keeps the fence event of the last copy that touched it; the next
owner must wait on that event before writing. Allocation prefers slots whose
fence has already passed, so new owners rarely wait at all.
"""
from __future__ import annotations

from collections import deque

from .errors import UsageError
from .streams import Event


class SlotAllocator:
    __slots__ = ("capacity", "_ready", "_fenced", "_is_free", "fences")

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise UsageError(f"capacity must not be negative, got {capacity}")
        self.capacity = capacity
        self._ready: list[int] = list(range(capacity - 1, -1, -1))   # a stack: slot 0 goes first
        self._fenced: deque[int] = deque()
        self._is_free = bytearray(b"\x01" * capacity)
        self.fences: list[Event | None] = [None] * capacity

    @property
    def free(self) -> int:
        return len(self._ready) + len(self._fenced)

    @property
    def used(self) -> int:
        return self.capacity - self.free

    def _refresh(self) -> None:
        for _ in range(len(self._fenced)):
            s = self._fenced.popleft()
            ev = self.fences[s]
            if ev is None or ev.query():
                self.fences[s] = None
                self._ready.append(s)
            else:
                self._fenced.append(s)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` slots, or None (and nothing taken) if fewer are free."""
        if n < 0:
            raise UsageError(f"cannot allocate {n} slots")
        if n > self.free:
            return None
        ready = self._ready
        if n > len(ready) and self._fenced:
            self._refresh()
        k = min(n, len(ready))
        out = ready[len(ready) - k:]
        del ready[len(ready) - k:]
        out.reverse()                       # the order of repeated pops: lowest slot first when fresh
        for _ in range(n - k):
            out.append(self._fenced.popleft())
        is_free = self._is_free
        for s in out:
            is_free[s] = 0
        return out

    def release(self, slots: list[int], fence: Event | None = None) -> None:
        """Give slots back; ``fence`` marks the last copy that touched them."""
        is_free, cap = self._is_free, self.capacity
        for s in slots:
            if not 0 <= s < cap or is_free[s]:
                raise UsageError(f"slot {s} released twice or never allocated")
        if len(slots) > 1 and len(set(slots)) != len(slots):
            dup = next(s for i, s in enumerate(slots) if s in slots[:i])
            raise UsageError(f"slot {dup} released twice or never allocated")
        fences = self.fences
        if fence is None or fence.query():
            for s in slots:
                is_free[s] = 1
                fences[s] = None
            self._ready.extend(slots)
        else:
            for s in slots:
                is_free[s] = 1
                fences[s] = fence
            self._fenced.extend(slots)

    def is_free(self, slot: int) -> bool:
        return bool(self._is_free[slot])

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
        self._ready: deque[int] = deque(range(capacity - 1, -1, -1))   # pop() hands out slot 0 first
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
        if n > len(self._ready) and self._fenced:
            self._refresh()
        out = []
        for _ in range(n):
            s = self._ready.pop() if self._ready else self._fenced.popleft()
            self._is_free[s] = 0
            out.append(s)
        return out

    def release(self, slots: list[int], fence: Event | None = None) -> None:
        """Give slots back; ``fence`` marks the last copy that touched them."""
        seen: set[int] = set()
        for s in slots:
            if not 0 <= s < self.capacity or self._is_free[s] or s in seen:
                raise UsageError(f"slot {s} released twice or never allocated")
            seen.add(s)
        for s in slots:
            self._is_free[s] = 1
            if fence is None or fence.query():
                self.fences[s] = None
                self._ready.append(s)
            else:
                self.fences[s] = fence
                self._fenced.append(s)

    def is_free(self, slot: int) -> bool:
        return bool(self._is_free[slot])

"""The runtime's records: one Page per (block, life cycle), one Block per
indexed (or sequence-local) block."""
from __future__ import annotations

import asyncio

from tiers.streams import Event

GPU, HOST, DISK = 0, 1, 2
TIER_NAMES = ("gpu", "host", "disk")


class Block:
    __slots__ = ("key", "parent", "children", "depth", "pages", "indexed")

    def __init__(self, key, parent: "Block | None", depth: int, n_lcs: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict = {}
        self.depth = depth
        self.pages: list[Page | None] = [None] * n_lcs
        self.indexed = False


class Page:
    """State: LOCKED when ``locks``; HELD when ``holders``; else DROPPABLE
    (if published) — see DESIGN.md."""

    __slots__ = ("block", "lc", "tier", "group", "slot", "locks", "holders", "published",
                 "priority", "stamp", "qentry", "moving", "moving_to", "ready", "dead")

    def __init__(self, block: Block | None, lc: int, tier: int, group: int, slot: int, priority: int,
                 holders: int = 0, locks: int = 0, stamp: int = 0) -> None:
        self.block = block
        self.lc = lc
        self.tier = tier
        self.group = group
        self.slot = slot
        self.locks = locks
        self.holders = holders
        self.published = False
        self.priority = priority
        self.stamp = stamp
        self.qentry: list | None = None
        self.moving: asyncio.Future | None = None
        self.moving_to = -1
        self.ready: Event | None = None
        self.dead = False

    @property
    def state(self) -> str:
        if self.locks:
            return "LOCKED"
        if self.holders or not self.published:
            return "HELD"
        return "DROPPABLE"

    def __repr__(self) -> str:
        return (f"Page(lc={self.lc}, depth={self.block.depth if self.block else None}, "
                f"{TIER_NAMES[self.tier]}[{self.group}:{self.slot}], {self.state})")

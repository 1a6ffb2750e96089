"""Counters the store keeps and reports through ``Store.stats()``."""
from __future__ import annotations

import collections


class MoveStats:
    """Pages, bytes and busy seconds per direction (e.g. ``"gpu->host"``), and per pool group
    each way (``group``: (tier, group, "in" | "out") -> [pages, bytes, seconds])."""

    __slots__ = ("pages", "bytes", "seconds", "batches", "failures", "group")

    def __init__(self) -> None:
        self.pages: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()
        self.seconds: collections.Counter = collections.Counter()
        self.group: dict[tuple[str, int, str], list] = {}
        self.batches: collections.Counter = collections.Counter()
        self.failures: collections.Counter = collections.Counter()

    def record(self, src: str, src_group: int, dst: str, dst_group: int, pages: int, nbytes: int,
               seconds: float) -> None:
        d = f"{src}->{dst}"
        self.pages[d] += pages
        self.bytes[d] += nbytes
        self.seconds[d] += seconds
        self.batches[d] += 1
        for key in ((src, src_group, "out"), (dst, dst_group, "in")):
            row = self.group.get(key)
            if row is None:
                row = self.group[key] = [0, 0, 0.0]
            row[0] += pages
            row[1] += nbytes
            row[2] += seconds

    def of_group(self, tier: str, group: int) -> dict:
        """One pool group's moves each way: pages, bytes and bandwidth (GB/s of busy time)."""
        out = {}
        for way in ("in", "out"):
            pages, nbytes, secs = self.group.get((tier, group, way), (0, 0, 0.0))
            out[f"moved_{way}"] = {"pages": pages, "bytes": nbytes,
                                   "bandwidth_gbps": (nbytes / secs / 1e9) if secs > 0 else 0.0}
        return out

    def as_dict(self) -> dict:
        out = {}
        for d in sorted(self.pages.keys() | self.failures.keys()):
            secs = self.seconds[d]
            out[d] = {"pages": self.pages[d], "bytes": self.bytes[d], "batches": self.batches[d],
                      "failures": self.failures[d],
                      "bandwidth_gbps": (self.bytes[d] / secs / 1e9) if secs > 0 else 0.0}
        return out

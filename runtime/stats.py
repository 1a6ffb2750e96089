"""Counters the store keeps and reports through ``Store.stats()``."""
from __future__ import annotations

import collections


class MoveStats:
    """Pages, bytes and busy seconds per direction (e.g. ``"gpu->host"``)."""

    __slots__ = ("pages", "bytes", "seconds", "batches", "failures")

    def __init__(self) -> None:
        self.pages: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()
        self.seconds: collections.Counter = collections.Counter()
        self.batches: collections.Counter = collections.Counter()
        self.failures: collections.Counter = collections.Counter()

    def record(self, src: str, dst: str, pages: int, nbytes: int, seconds: float) -> None:
        d = f"{src}->{dst}"
        self.pages[d] += pages
        self.bytes[d] += nbytes
        self.seconds[d] += seconds
        self.batches[d] += 1

    def as_dict(self) -> dict:
        out = {}
        for d in sorted(self.pages.keys() | self.failures.keys()):
            secs = self.seconds[d]
            out[d] = {"pages": self.pages[d], "bytes": self.bytes[d], "batches": self.batches[d],
                      "failures": self.failures[d],
                      "bandwidth_gbps": (self.bytes[d] / secs / 1e9) if secs > 0 else 0.0}
        return out

"""A disk group's journal replayed at open (``tiers/disk.py``, format in ``tiers/journal.py``).

The records are applied as arrays, a chunk of frames at a time: reopening a million pages
is array work. A damaged frame is skipped (the next one found by its magic), a torn tail
is found (the tier truncates it), and records no writer produces are skipped; each is reported."""
from __future__ import annotations

import logging
import os
import zlib

import msgpack
import numpy as np

from . import journal
from .disk_group import DiskGroup
from .disk_io import unpackb
from .journal import FORMAT_VERSION, FRAME, RECORD, WRITE

log = logging.getLogger("kvtier.disk")
REPLAY_CHUNK = 1 << 16           # records replayed per array step at open


def valid_next_gen(v: object) -> bool:
    return type(v) is int and 1 <= v <= journal.MAX_GEN + 1


class JournalReader:
    """Reads a journal by absolute offset through a window of ``chunk`` bytes. ``os.pread``
    releases the GIL while the disk works (an mmap's page faults would hold it: a cold journal
    stalled the event loop for 200 ms at a time) and memory stays bounded by the window."""

    def __init__(self, fd: int, size: int, chunk: int = 1 << 20) -> None:
        self.fd, self.size, self.chunk = fd, size, chunk
        self.base, self.buf = 0, b""

    def read(self, off: int, n: int) -> bytes:
        """Bytes [off, off + n) (fewer at the end of the file)."""
        n = max(0, min(n, self.size - off))
        if not (self.base <= off and off + n <= self.base + len(self.buf)):
            if n > self.chunk:
                return os.pread(self.fd, n, off)
            self.base, self.buf = off, os.pread(self.fd, min(self.chunk, self.size - off), off)
        return self.buf[off - self.base:off - self.base + n]

    def find(self, needle: bytes, start: int) -> int:
        """Offset of the first ``needle`` at or after ``start``, or -1. Searches the
        window it holds before reading on, so a run of near-miss candidates costs
        one read per window, not one per candidate."""
        pos = start
        while pos < self.size:
            if not (self.base <= pos and pos + len(needle) <= self.base + len(self.buf)):
                self.base, self.buf = pos, os.pread(self.fd, min(self.chunk, self.size - pos), pos)
            i = self.buf.find(needle, pos - self.base)
            if i >= 0:
                return self.base + i
            end = self.base + len(self.buf)
            if end >= self.size:
                return -1
            pos = end - len(needle) + 1
        return -1


class Replay:
    """One group's journal replayed into its arrays (see the module docstring).

    Frames are read in order; their records are applied a chunk at a time
    (``REPLAY_CHUNK``): within a chunk the last record of each slot is found
    by sorting, and it wins over what the arrays hold if its generation is
    higher. Damage is skipped frame by frame and reported.
    """

    def __init__(self, g: DiskGroup, errors: list[tuple[int, int, str]],
                 discarded: list[tuple[int, int, str]]) -> None:
        self.g = g
        self.errors = errors            # the tier's journal_errors and discarded: what open reports
        self.discarded = discarded
        self.max_gen = 0
        self.dirty = False
        self.parts: list[np.ndarray] = []
        self.n_parts = 0
        self.outside: dict[int, tuple[int, int]] = {}     # slot beyond the quota -> (gen, kind) of its last record
        self.malformed = 0
        self.crc_budget = 0

    def release(self) -> None:
        self.parts = []

    def error(self, off: int, msg: str) -> None:
        msg = f"journal {self.g.journal_path}: {msg} at offset {off}"
        log.warning("disk tier: %s", msg)
        self.errors.append((self.g.index, off, msg))
        self.dirty = True

    def frame_at(self, src: JournalReader, off: int, size: int) -> tuple[bytes, bytes] | str:
        """(magic, payload) of the frame at ``off``, or why there is none."""
        if size - off < FRAME.size:
            return "torn frame header"
        magic, ln, crc = FRAME.unpack(src.read(off, FRAME.size))
        if magic not in (journal.HEADER_MAGIC, journal.RECORDS_MAGIC):
            return "bad frame magic"
        if ln > size - off - FRAME.size:
            return f"torn frame (needs {ln} bytes, {size - off - FRAME.size} left)"
        if magic == journal.RECORDS_MAGIC and ln % RECORD.itemsize:
            return f"frame length {ln} is not whole records"
        self.crc_budget -= ln
        payload = src.read(off + FRAME.size, ln)
        if zlib.crc32(payload) != crc:
            return "frame checksum mismatch"
        return magic, payload

    def resync(self, src: JournalReader, start: int, size: int) -> int | None:
        """Offset of the next intact records frame after ``start`` (None: none, or the
        search spent its budget: a hostile file cannot make it quadratic)."""
        pos = start
        while self.crc_budget > 0:
            pos = src.find(journal.RECORDS_MAGIC, pos)
            if pos < 0:
                return None
            self.crc_budget -= FRAME.size      # every candidate costs, even one rejected unread
            if not isinstance(self.frame_at(src, pos, size), str):
                return pos
            pos += 1
        return None

    def run(self, src: JournalReader, size: int) -> int:
        """Replay every frame; returns the offset the journal is good up to (the rest is a torn tail)."""
        g = self.g
        self.crc_budget = 2 * size + (1 << 20)
        off = 0
        while off < size:
            got = self.frame_at(src, off, size)
            if isinstance(got, str):
                nxt = self.resync(src, off + 1, size)
                if nxt is None:
                    self.error(off, f"{got}; the last {size - off} bytes dropped")
                    self.apply()
                    self.finish()
                    return off
                self.error(off, f"{got}; {nxt - off} bytes skipped")
                off = nxt
                continue
            magic, payload = got
            if off == 0 and magic == journal.HEADER_MAGIC:
                try:
                    head = unpackb(payload)
                    if not isinstance(head, dict) or head.get("group") != g.index or \
                            head.get("format") != FORMAT_VERSION or not valid_next_gen(head.get("next_gen", 1)):
                        raise ValueError(f"header {head!r} is not this group's")
                except (ValueError, TypeError, msgpack.UnpackException) as e:
                    self.error(0, f"bad journal header ({e}); the journal is dropped")
                    return 0
                self.max_gen = max(self.max_gen, head.get("next_gen", 1) - 1)
            elif magic == journal.HEADER_MAGIC:
                self.error(off, "a header frame after the first; skipped")
            else:
                if off == 0:
                    self.error(0, "journal header missing")
                self.parts.append(np.frombuffer(payload, dtype=RECORD))
                self.n_parts += len(self.parts[-1])
                if self.n_parts >= REPLAY_CHUNK:
                    self.apply()
            off += FRAME.size + len(payload)
        self.apply()
        self.finish()
        return off

    def apply(self) -> None:
        """Apply the records read so far (the last record of a slot wins)."""
        if not self.parts:
            return
        g = self.g
        recs = journal.concat(self.parts) if len(self.parts) > 1 else self.parts[0]
        self.parts, self.n_parts = [], 0
        bad = journal.malformed(recs)
        if bad.any():
            self.malformed += int(bad.sum())
            recs = journal.take(recs, ~bad)
        if not len(recs):
            return
        self.max_gen = max(self.max_gen, int(recs["gen"].max()))
        far = recs["slot"] >= g.slots
        if far.any():
            for r in recs[far]:
                s, gen = int(r["slot"]), int(r["gen"])
                if s not in self.outside or self.outside[s][0] < gen:
                    self.outside[s] = (gen, int(r["kind"]))
            recs = journal.take(recs, ~far)
            if not len(recs):
                return
        order = np.lexsort((recs["gen"], recs["slot"]))
        slots = recs["slot"][order]
        last = np.ones(len(order), dtype=bool)
        last[:-1] = slots[1:] != slots[:-1]
        win = journal.take(recs, order[last])
        g.reserve(int(win["slot"].max()) + 1)
        win = journal.take(win, win["gen"] > g.meta["gen"][win["slot"]])
        slots = win["slot"].astype(np.int64)
        journal.put(g.meta, slots, win)
        g.live[slots] = win["kind"] == WRITE

    def finish(self) -> None:
        g = self.g
        if self.malformed:
            self.error(0, f"{self.malformed} malformed record(s) skipped")
        lost = sorted(s for s, (_, kind) in self.outside.items() if kind == WRITE)
        if lost:
            reason = f"outside the group's {g.slots} slots"
            self.discarded.extend((g.index, s, f"slot {s} is {reason}") for s in lost)
            log.warning("disk tier: group %d: %d page(s) discarded at open: %s", g.index, len(lost), reason)
        if self.outside:
            self.dirty = True

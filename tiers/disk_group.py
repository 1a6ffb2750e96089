"""One pool group of the disk tier (``tiers/disk.py``): its segment and journal files, and its
slot table as arrays (one row per slot, no Python object per page), with the bookkeeping a
write, a free and a commit do on them. Locking and I/O are the tier's; the lock order is
below."""
from __future__ import annotations

import os
import threading

import numpy as np

from . import disk_io, journal
from .disk_io import ALIGN, IOV_MAX, round_up
from .journal import RECORD
from .native import concat, flags_select, flags_set, iota_u64, records_current


class DiskGroup:
    """One cold pool group's segment, journal and per-slot metadata.

    Per slot (arrays indexed by slot, grown on demand up to ``slots``):
    ``meta[s]`` is the last record applied for s (a write or a free);
    ``live[s]`` says s holds a page, whose record is ``meta[s]``;
    ``journaled[s]``: the journal holds (or an append under way is writing)
    a write record for s that no free record follows, so freeing s needs a
    free record; ``pending[s]``: s was freed and that free record is not
    journaled yet (it is in ``pending_slots``/``pending_gens``), so s must
    not be written before it is; ``forgotten[s]``: s was discarded as bad, so
    a later free of it is a no-op. Invariants: live and pending are disjoint,
    live and forgotten are disjoint, pending implies journaled,
    ``n_live == live.sum()``.

    ``queued`` holds the records of writes and relabels whose bytes are written
    but not yet journaled (each with whether its bytes are already synced), in
    order; a commit journals those still current (the slot live, the generation
    its ``meta``'s). ``commit_failed``: the last background commit failed (it
    is retried; the next write commits first, and reports a failure). Lock order:
    ``write_lock`` (one write at a time), ``commit_lock`` (one commit at a
    time, from its snapshot of ``queued`` to its frame durable),
    ``journal_lock`` (one append or compaction at a time), ``lock`` (the slot
    table and the segment's size; held only around bookkeeping, and by a
    compaction).
    """
    __slots__ = ("index", "slot_bytes", "slots", "stride", "max_size", "seg_path", "journal_path",
                 "seg_fd", "read_fd", "journal_fd", "size", "journal_size", "meta", "live", "pending", "forgotten",
                 "pending_slots", "pending_gens", "n_pending", "n_live", "lock", "write_lock", "broken", "pad", "direct",
                 "dir_unsynced", "journaled", "queued", "commit_failed", "journal_lock", "commit_lock")

    def __init__(self, index: int, slot_bytes: int, slots: int, path: str) -> None:
        self.index = index
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.stride = round_up(slot_bytes, ALIGN)
        self.max_size = slots * self.stride
        self.direct = False                 # this group's writes bypass the page cache
        self.seg_path = os.path.join(path, f"group-{index}.seg")
        self.journal_path = os.path.join(path, f"group-{index}.journal")
        self.seg_fd = -1
        self.read_fd = -1              # the fd reads use: seg_fd, or a page-cache fd next to an O_DIRECT seg_fd
        self.journal_fd = -1
        self.size = 0                  # segment file size (allocated)
        self.journal_size = 0
        self.meta = np.zeros(0, dtype=RECORD)
        self.live = np.zeros(0, dtype=bool)
        self.pending = np.zeros(0, dtype=bool)
        self.forgotten = np.zeros(0, dtype=bool)
        self.journaled = np.zeros(0, dtype=bool)
        self.queued: list[tuple[np.ndarray, bool]] = []
        self.commit_failed = False
        self.pending_slots: list[np.ndarray] = []
        self.pending_gens: list[np.ndarray] = []
        self.n_pending = 0
        self.n_live = 0
        self.lock = threading.Lock()          # the slot table and the segment's size (see the docstring)
        self.write_lock = threading.Lock()    # one write() at a time; taken before `lock`, never after
        self.commit_lock = threading.Lock()   # one commit at a time; see the class docstring for the order
        self.journal_lock = threading.Lock()  # one journal append (or compaction) at a time
        self.broken: str | None = None
        self.dir_unsynced = False      # a journal rename awaits its directory fsync
        self.pad = bytes(self.stride - slot_bytes)            # written after each row to fill its stride

    def reserve(self, n: int) -> None:
        """Make the per-slot arrays cover slots < n (n <= slots)."""
        cap = len(self.live)
        if n <= cap:
            return
        new = min(self.slots, max(n, 2 * cap, 1024))
        for name in ("meta", "live", "pending", "forgotten", "journaled"):
            old = getattr(self, name)
            arr = np.zeros(new, dtype=old.dtype)
            if name == "meta":
                journal.put(arr, slice(0, cap), old)     # whole rows: a structured copy goes field by field
            else:
                arr[:cap] = old
            setattr(self, name, arr)

    def live_bytes(self) -> int:
        """Journal bytes a snapshot of the live records takes."""
        return self.n_live * RECORD.itemsize

    def free_records(self) -> np.ndarray:
        """The pending frees as journal records."""
        return journal.frees(concat(self.pending_slots, np.int64), concat(self.pending_gens, np.uint64))

    def clear_pending(self) -> None:
        self.settle_pending(self.pending_slots)
        self.pending_slots, self.pending_gens, self.n_pending = [], [], 0

    def take_pending(self) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
        """The pending frees as records, handed to an append: their flags stay set (the slots stay
        unwritable) until ``settle_pending`` or ``restore_pending``."""
        taken = self.free_records(), self.pending_slots, self.pending_gens
        self.pending_slots, self.pending_gens, self.n_pending = [], [], 0
        return taken

    def settle_pending(self, slots: list[np.ndarray]) -> None:
        """The frees taken are durable."""
        for part in slots:
            flags_set(self.pending, part, False)
            flags_set(self.journaled, part, False)

    def restore_pending(self, slots: list[np.ndarray], gens: list[np.ndarray]) -> None:
        """The append of the frees taken failed: they are pending again, first in line."""
        self.pending_slots[:0] = slots
        self.pending_gens[:0] = gens
        self.n_pending += sum(len(p) for p in slots)

    def unlive(self, slots: np.ndarray) -> np.ndarray:
        """Slots stop holding pages; returns those the journal names, which need a free record
        (``add_pending``). The records of the others, still queued, are not current any more,
        so no commit journals them."""
        flags_set(self.live, slots, False)
        self.n_live -= len(slots)
        return flags_select(self.journaled, slots, True)

    def queue(self, records: np.ndarray, synced: bool) -> None:
        """Queue a batch's records for the next commit."""
        self.queued.append((records, synced))

    def take_queued(self) -> list[tuple[np.ndarray, bool]]:
        taken, self.queued = self.queued, []
        return taken

    def current(self, recs: np.ndarray) -> np.ndarray:
        """The records of ``recs`` still their slot's live page (a later free, write or relabel
        of a slot supersedes a queued record)."""
        return journal.take(recs, records_current(journal.rows(recs), self.live, journal.rows(self.meta)))

    def add_pending(self, slots: np.ndarray, first_gen: int) -> None:
        flags_set(self.pending, slots, True)
        self.pending_slots.append(slots)
        self.pending_gens.append(iota_u64(first_gen, len(slots)))
        self.n_pending += len(slots)

    def pieces(self, sorted_slots: np.ndarray, split: bool = True) -> list[tuple[int, int]]:
        """[a, b) index ranges of ``sorted_slots`` that are adjacent on disk, each one I/O call.

        ``split``: a batch is also cut into about IO_THREADS pieces (none under MIN_PIECE_BYTES,
        none over PIECE_BYTES) that run in parallel. Without it a run of adjacent slots stays one
        call (up to MAX_RUN_BYTES), which suits page-cache reads: the kernel's readahead pipelines
        one sequential read better than parallel readers, which look random to it. Either way a
        piece has one stride at least and at most IOV_MAX vectors.
        """
        n = len(sorted_slots)
        if split:
            share = -(-n * self.stride // disk_io.IO_THREADS)
            target = min(disk_io.PIECE_BYTES, max(disk_io.MIN_PIECE_BYTES, share))
        else:
            target = disk_io.MAX_RUN_BYTES
        cap = max(1, min(target // self.stride, IOV_MAX // (2 if self.pad else 1)))
        bounds = [0, *(np.flatnonzero(np.diff(sorted_slots) != 1) + 1).tolist(), n]
        return [(a, min(b, a + cap)) for lo, b in zip(bounds, bounds[1:]) for a in range(lo, b, cap)]

"""The disk tier: durable, slot-addressed spill files for cold pages.

This module holds ``DiskTier``; a group's slot table is ``tiers/disk_group.py``, the
journal's format ``tiers/journal.py`` and its replay at open ``tiers/journal_replay.py``,
and the system-call helpers (vectored I/O, typed errors, the sizes that cut a batch into I/O calls)
``tiers/disk_io.py``.

Data plane only: every call blocks, no asyncio here. The runtime calls it from
worker threads; the tier's own committer thread journals deferred writes. A
pool group's lock serialises what reads or changes its slot table; a write
holds it only around those steps and queues behind other writes on the
group's write lock, so reads of live pages run beside a write's data transfer
and a commit's syncs. Different groups run concurrently (the I/O and the
checksums release the GIL).

Directory layout (``path``)::

    LOCK              fcntl.flock'ed while a DiskTier has the directory open; holds the pid
    HEADER            msgpack: format version, fingerprint, [[slot_bytes, slots], ...]
    group-N.seg       segment file of cold pool group N: slot k at offset k * stride
    group-N.journal   journal of group N: CRC'd frames of fixed-width records (tiers/journal.py)

``stride`` is ``slot_bytes`` rounded up to 4096, always (also when O_DIRECT is
off), so that one directory can be reopened with either I/O mode. The quota of
a group is ``slots * slot_bytes`` as configured; on disk it takes at most
``slots * stride`` (the rounding costs nothing for the usual page sizes, which
are multiples of 4 KiB). The segment file grows in preallocated steps
(``posix_fallocate``; min(64 MiB, an eighth of the group's size), never past
``slots * stride``) so that the filesystem hands out large extents and a full
disk is found at allocation time (``DiskFullError``), not half-way into a
batch.

Journal (format in ``tiers/journal.py``). Each append is one frame of 64-byte
records: a page was written (slot, generation, checksum, block key, parent
key, depth, life cycle, priority) or a slot was freed. The first frame is a
header (group, format, ``next_gen``). Generation numbers are monotonic per
directory (all groups draw from one counter, persisted through the journal
headers), and on replay a slot's last record wins. Replay reads the records
as arrays, a chunk of frames at a time: reopening a million pages is array
work, and what the tier keeps per slot is one row of an array, not a Python
object. A damaged frame (bad checksum, bad length) is skipped: the reader
finds the next frame by its magic and goes on, so damage loses only the
records of the frames it hits; a torn tail is truncated. Records no writer
produces (unknown kinds or key forms, slots outside the group) are skipped
and reported. All of it lands in ``journal_errors`` / ``discarded`` and a
warning on ``kvtier.disk``; open compacts a journal it had to repair. Because
a frame holds whole ``write()`` batches (less pages freed since), a crash
never leaves half a batch in the index. Compaction writes frames of at most ``FRAME_RECORDS`` records.

Durability order (with ``fsync=True``). A ``write()``:

1. if some target slot was freed but its free record is not yet durable, the
   pending frees are appended and fdatasync'ed first, so that no durable
   record still names the old page when its bytes get overwritten;
2. writes the data to the segment (one ``pwritev`` per run of adjacent
   slots); the pages are live (readable, freeable) from here;
3. queues the batch's records for a commit.

A commit (group commit) syncs the segment once for every batch queued before
it, then appends one frame with their records (those still current: a page
freed, rewritten or relabelled meanwhile is left out) and the group's pending
frees, and fdatasyncs the journal. ``write(durable=True)`` (the default)
commits before it returns; ``write(durable=False)``, what the store uses,
returns after step 3 and the tier's committer thread commits soon after: a
spill does not wait for the syncs of its own bytes and records, and a commit
covers every batch queued while the one before it ran. A spill still waits
for step 1 when it overwrites slots freed since the last commit, which is
most spills once the disk is full (freed slots are reused first).
``flush()`` and ``close()`` commit what is queued.

So the journal never points at unwritten data; a crash loses at most the
batches not yet committed, never serves wrong bytes. A failure at steps 1-2
(``ENOSPC`` -> ``DiskFullError``; any other ``OSError`` -> ``TierIOError``)
leaves every slot's previous state as it was; a failed journal append is
rolled back by truncating the journal to its previous length and its records
stay queued: the committer retries (after 50 ms, doubling up to 1 s), and
the group's next write commits first, so it reports the failure
(``DiskFullError`` for a full filesystem) rather than pile more on. A failed
sync of the segment makes the group unusable until it is reopened (after a
failed fdatasync Linux may have dropped the dirty pages: nothing written
since the previous sync can be trusted) and its records are never
journaled. ``write()`` only takes free
slots (writing over a live page is a ``UsageError``: free it first), which is
what makes "nothing previously stored is lost" hold even when the data write
fails half-way. Frees are journaled lazily (with the group's next commit or
append, ``flush()`` or ``close()``); a crash can therefore bring back a page
that was freed shortly before it, with its bytes intact (its checksum still
matches), never a page with wrong bytes.

Checksums. A page's record holds the XXH64 of its ``slot_bytes`` XOR the
page's identity (block key, life cycle, layout fingerprint; see
``journal.identity``), so a record pointing a key at another page's bytes
fails like damaged bytes do. They are computed in batches by the native
``tiers._native.xxh64_rows`` (the GIL released for 64 KiB or more on a worker
thread), and verified lazily, by
``read()``: verifying eagerly at open would read the whole quota (up to
terabytes) before the first request. Open checks what is cheap - journal
integrity, that the segment exists and covers every recorded slot - and
``verify_all()`` checks every live page when the caller wants it. A page that
fails is reported in ``discarded`` (with a warning), forgotten as if freed,
and ``read()`` raises ``CorruptPageError`` naming the bad slots.

O_DIRECT. ``o_direct="auto"`` probes at open (an aligned O_DIRECT write to a
scratch file; the probe also finds whether memory must be 512- or 4096-byte
aligned) and, when the filesystem takes it, writes with O_DIRECT and reads
through the page cache; ``"on"`` uses O_DIRECT for both (``ConfigError`` if
the filesystem refuses it), ``"off"`` uses the page cache for both. Measured
with ``scripts/bench_disk.py`` (ext4 on a virtio disk, 1 GiB, 64 KiB..2 MiB
pages): buffered writes + fdatasync ran at 0.3-0.9 GB/s against 2-3 GB/s for
O_DIRECT - the page-cache copy, dirty throttling and writeback of data nobody
will read soon (it is cold by definition) cost more than they save, and cached
cold pages would duplicate the host tier's memory. For reads it is the other
way round: one buffered ``preadv`` per run of adjacent slots (1.3-1.9 GB/s)
beat O_DIRECT reads (0.9-1.5 GB/s), because the kernel's readahead pipelines
the device reads with the copy into the caller's rows, which a synchronous
O_DIRECT read cannot do. So "auto" reads through the page cache and drops the
pages it read right after (``POSIX_FADV_DONTNEED``), keeping no second copy.
Offsets and lengths are always aligned (the slot stride is a multiple of 4096);
rows whose memory is aligned (pinned or page-aligned host slabs) go to the
device as they are, others through page-aligned bounce buffers. An O_DIRECT
batch is cut into pieces of adjacent slots (1-8 MiB) that run on a small
thread pool, so bounce copies overlap the I/O and the device sees a few
requests at once; page-cache reads keep a run of adjacent slots in one call
(parallel readers would look random to readahead) and spread separate runs
over the pool.
In "auto" mode only groups whose slot stride is at least ``DIRECT_MIN_STRIDE``
(64 KiB) write with O_DIRECT: scattered small pages cost a device round trip
each under O_DIRECT, while the page cache coalesces them (a metadata-first
replay of 4 KiB pages ran 1.4x faster buffered).
``stats["o_direct"]`` / ``stats["o_direct_reads"]`` say which mode is in use.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import mmap
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator

import msgpack
import numpy as np
import torch

from . import disk_io, journal
from .disk_group import DiskGroup
from .disk_io import (ALIGN, FULL_ERRNOS, aligned_buffer, first_difference, flatnonzero,
                      fsync_dir, packb, preadv_all, pwritev_all, remove, round_up, typed_error, unpackb)
from .errors import ConfigError, CorruptPageError, DiskFullError, StoreClosedError, TierIOError, UsageError
from .journal import FORMAT_VERSION, RECORD, WRITE, PageRecord
from .journal_replay import JournalReader, Replay
from .native import (argsort_i64, bounds_i64, drop_arrays, flags_any, flags_first_neither, flags_select, flags_set,
                     iota_u64, pread_rows, pwrite_all, pwrite_rows, records_slots, take, xxh64_rows)
from .units import human_bytes

log = logging.getLogger("kvtier.disk")

GROW_STEP = 64 << 20             # segment growth step (or 1/8 of the group's size, whichever smaller)
CHECKPOINT_FLOOR = 1 << 20       # never compact a journal smaller than this
CHECKPOINT_RATIO = 4             # compact when the journal exceeds this many times its snapshot
PENDING_FREE_FLUSH = 8192        # journal pending frees once this many have piled up in a group
DIRECT_MIN_STRIDE = 64 << 10    # "auto": smaller pages go through the page cache (see O_DIRECT above)
PARALLEL_MIN_BYTES = 8 << 20     # page-cache batches smaller than this do their I/O on one thread
CACHED_READ_MAX = 1 << 20        # read_cached takes at most this many bytes (a memcpy on the caller's thread)
# preadv2(RWF_NOWAIT) refused by this kernel (< 4.14), filesystem or sandbox: read_cached stops trying
_NOWAIT_UNSUPPORTED = {errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS, errno.EPERM}

_HEADER = "HEADER"
_LOCK = "LOCK"


@dataclasses.dataclass(frozen=True, slots=True)
class RecoveredPage:
    group: int
    slot: int
    record: PageRecord
    generation: int = 0               # write order: higher was written later


# -- errors ---------------------------------------------------------------------------------------

def _corrupt(g: DiskGroup, slots: list[int], what: str) -> CorruptPageError:
    """The error naming pages of group ``g`` that cannot be served (``.slots``, ``.group``)."""
    slots = sorted(slots)
    err = CorruptPageError(f"disk group {g.index}: {len(slots)} {what} page(s): {slots[:16]}")
    err.slots = slots
    err.group = g.index
    return err


class _Committer:
    """The committer thread's state, apart from the tier: the thread holds the tier only weakly
    (between turns), so a tier nobody closed can still be collected, and its thread then ends."""
    __slots__ = ("cv", "due", "closed", "thread")

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.due: dict[int, float] = {}      # group -> when to commit it (0: now)
        self.closed = False
        self.thread: threading.Thread | None = None

    def run(self, tier_ref: "weakref.ref[DiskTier]") -> None:
        retry: dict[int, float] = {}         # group -> its last retry delay
        while True:
            with self.cv:
                while True:
                    now = time.monotonic()
                    ready = sorted(i for i, t in self.due.items() if t <= now)
                    if ready or (self.closed and not self.due):
                        break
                    if self.closed:          # close() journals the rest itself
                        return
                    self.cv.wait(min([t - now for t in self.due.values()] + [1.0]))
                    if tier_ref() is None:
                        return
                if not ready:
                    return
                for i in ready:
                    del self.due[i]
            tier = tier_ref()
            if tier is None:
                return
            tier._commit_due(ready, retry)
            del tier


# -- the tier ------------------------------------------------------------------------------------

class DiskTier:
    """Durable disk spill for the cold pool groups; see the module docstring."""

    discarded: list[tuple[int, int, str]]

    def __init__(self) -> None:  # use DiskTier.open
        self.path = ""
        self.fsync = True
        self.min_free: int | None = None
        self.o_direct = False              # writes bypass the page cache
        self.o_direct_reads = False        # reads too (o_direct="on"); "auto" reads through the page cache
        self.o_direct_supported = False
        self.fingerprint: dict = {}
        self.groups: list[DiskGroup] = []
        self.discarded = []
        self._fp = 0                       # the layout fingerprint folded to 64 bits (journal.identity)
        self.journal_errors: list[tuple[int, int, str]] = []   # (group, offset, reason)
        self.checkpoint_floor = CHECKPOINT_FLOOR
        self._lock_fd = -1
        self._closed = True
        self._gen = 1
        self._gen_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._faults: dict[str, list[int]] = {}
        self._dio_mem_align = ALIGN
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._bounces: list[tuple[mmap.mmap, np.ndarray]] = []
        self._stats = dict(bytes_written=0, bytes_read=0, pages_written=0, pages_read=0, discarded=0,
                           checksum_seconds=0.0, io_seconds=0.0, fsync_seconds=0.0, checkpoints=0,
                           commits=0, commit_failures=0, cached_reads=0, unlocked_reads=0, verified_pages=0)
        self._committer = _Committer()
        self._nowait = True                # preadv2(RWF_NOWAIT) works here (read_cached)

    # ---- open / close ----

    @classmethod
    def open(cls, path: str, fingerprint: dict, groups: list[tuple[int, int]], *,
             on_mismatch: str = "error", o_direct: str = "auto", min_free: int | None = None,
             fsync: bool = True) -> "DiskTier":
        if on_mismatch not in ("error", "wipe"):
            raise ConfigError("tiers.disk.on_mismatch", f"expected 'error' or 'wipe', got {on_mismatch!r}")
        if o_direct not in ("auto", "on", "off"):
            raise ConfigError("tiers.disk.o_direct", f"expected auto, on or off, got {o_direct!r}")
        if min_free is not None and (not isinstance(min_free, int) or min_free < 0):
            raise ConfigError("tiers.disk.min_free", f"must be a byte count >= 0, got {min_free!r}")
        if not isinstance(fingerprint, dict):
            raise ConfigError("tiers.disk.layout", f"fingerprint must be a dict, got {type(fingerprint).__name__}")
        norm_groups: list[tuple[int, int]] = []
        for i, g in enumerate(groups):
            try:
                sb, n = g
            except (TypeError, ValueError):
                raise ConfigError("tiers.disk.layout", f"group {i} must be (slot_bytes, slots), got {g!r}") from None
            if not isinstance(sb, int) or isinstance(sb, bool) or sb <= 0 or \
                    not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ConfigError("tiers.disk.layout", f"group {i} must be (slot_bytes > 0, slots >= 0), got {g!r}")
            norm_groups.append((sb, n))
        try:
            fingerprint = unpackb(packb(fingerprint))          # compare as stored (tuples -> lists)
        except (TypeError, ValueError) as e:
            raise ConfigError("tiers.disk.layout", f"fingerprint is not msgpack-serialisable: {e}") from None

        tier = cls()
        tier.path = os.path.abspath(path)
        tier.fsync = bool(fsync)
        tier.min_free = min_free
        tier.fingerprint = fingerprint
        tier._fp = journal.fingerprint_hash(packb(fingerprint))
        try:
            os.makedirs(tier.path, exist_ok=True)
        except OSError as e:
            raise ConfigError("tiers.disk.path", f"cannot create {tier.path!r}: {e.strerror}") from None
        tier._take_lock()
        try:
            tier._open_locked(norm_groups, on_mismatch, o_direct)
        except BaseException:
            tier._release_fds()
            raise
        tier._closed = False
        return tier

    def _take_lock(self) -> None:
        lock_path = os.path.join(self.path, _LOCK)
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError("tiers.disk.path", f"cannot create lock file {lock_path!r}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            except OSError:
                holder = "unknown"
            os.close(fd)
            raise ConfigError("tiers.disk.path",
                              f"{self.path!r} is in use by another disk tier (lock held by pid {holder})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _open_locked(self, groups: list[tuple[int, int]], on_mismatch: str, o_direct: str) -> None:
        header_path = os.path.join(self.path, _HEADER)
        want = {"format": FORMAT_VERSION, "fingerprint": self.fingerprint, "groups": [list(g) for g in groups]}
        problem = None
        fresh = not os.path.exists(header_path)
        if not fresh:
            try:
                with open(header_path, "rb") as f:
                    have = unpackb(f.read())
                if not isinstance(have, dict):
                    raise ValueError("not a map")
            except (OSError, ValueError, msgpack.UnpackException) as e:
                problem = f"header {header_path!r} is unreadable ({e})"
            else:
                if have.get("format") != FORMAT_VERSION:
                    problem = f"format version {have.get('format')!r} on disk, this build writes {FORMAT_VERSION}"
                else:
                    problem = self._layout_difference(have.get("groups"), want["groups"]) or \
                        first_difference(have.get("fingerprint"), self.fingerprint, "")
                    if problem and not problem.startswith("pool group") and not problem.startswith("directory has"):
                        problem = f"fingerprint {problem}"
        if problem is not None:
            if on_mismatch != "wipe":
                raise ConfigError("tiers.disk.layout",
                                  f"{self.path!r} holds another layout: {problem} (on_mismatch='wipe' discards it)")
            log.warning("disk tier %s: %s; wiping the old pages", self.path, problem)
        resized = not fresh and problem is None and [list(g) for g in have.get("groups")] != want["groups"]
        if resized:
            log.warning("disk tier %s: quota changed; pages in slots beyond a smaller quota are dropped", self.path)
        if fresh or problem is not None or resized:
            if not resized:
                self._remove_data_files()
            if os.path.lexists(header_path) and not os.path.isfile(header_path):
                remove(header_path)              # a directory (or dangling link) where HEADER belongs
            tmp = header_path + ".tmp"
            with open(tmp, "wb") as f:
                f.write(packb(want))
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, header_path)
            if self.fsync:
                fsync_dir(self.path)

        self.o_direct_supported = self._probe_o_direct()
        if o_direct == "on" and not self.o_direct_supported:
            raise ConfigError("tiers.disk.o_direct", f"the filesystem of {self.path!r} does not support O_DIRECT")
        self.o_direct = o_direct == "on" or (o_direct == "auto" and self.o_direct_supported)
        self.o_direct_reads = o_direct == "on"
        self._stats["o_direct"] = self.o_direct
        self._stats["o_direct_reads"] = self.o_direct_reads

        self.groups = [DiskGroup(i, sb, n, self.path) for i, (sb, n) in enumerate(groups)]
        for g in self.groups:
            g.direct = self.o_direct and (o_direct == "on" or g.stride >= DIRECT_MIN_STRIDE)
        self._stats["o_direct_groups"] = [g.index for g in self.groups if g.direct]
        self._check_data_files(on_mismatch)
        needs_checkpoint: list[DiskGroup] = []
        max_gen = 0
        for g in self.groups:
            gen, dirty = self._recover_group(g)
            max_gen = max(max_gen, gen)
            if dirty:
                needs_checkpoint.append(g)
        self._gen = max_gen + 1
        for g in self.groups:               # a smaller quota: the file shrinks to it
            if g.size > g.max_size:
                os.ftruncate(g.seg_fd, g.max_size)
                g.size = g.max_size
                needs_checkpoint.append(g)
        if self.fsync:
            fsync_dir(self.path)
        self._warn_if_quota_exceeds_free_space()
        for g in needs_checkpoint:
            try:
                self._checkpoint_locked(g)
            except OSError as e:       # the repaired journal serves as it is; the next compaction retries
                if g.broken is not None:   # ... unless the group lost its journal fd: refuse to open
                    raise
                log.warning("disk tier: compacting group %d's journal at open failed: %s", g.index, e)
        self._stats["discarded"] = len(self.discarded)

    def _warn_if_quota_exceeds_free_space(self) -> None:
        """The quota is a ceiling, not a reservation: say so at open when the filesystem cannot hold it."""
        st = os.statvfs(self.path)
        free = st.f_bavail * st.f_frsize - (self.min_free or 0)
        growth = sum(max(0, g.max_size - g.size) for g in self.groups)
        if growth > free:
            log.warning("disk tier %s: the quota needs %d more bytes (%s) but the filesystem has %d (%s) free%s; "
                        "the tier will stop growing when it fills (a store then drops the pages it would spill, "
                        "counted in stats()['disk_full'], and requests go on)", self.path,
                        growth, human_bytes(growth), max(0, free), human_bytes(max(0, free)),
                        f" above min_free={self.min_free}" if self.min_free else "")
        self._stats["quota_beyond_free_bytes"] = max(0, growth - max(0, free))

    @staticmethod
    def _layout_difference(have: Any, want: list) -> str | None:
        if not isinstance(have, list):
            return "directory has no pool group list"
        if len(have) != len(want):
            return f"directory has {len(have)} cold pool groups, this store has {len(want)}"
        for i, (a, b) in enumerate(zip(have, want)):
            if not isinstance(a, list) or len(a) != 2 or not all(type(v) is int and v >= 0 for v in a):
                return f"directory has a malformed pool group {i}: {a!r}"
            if a[0] != b[0]:        # a new slot count (quota) is fine: see _open_locked
                return (f"pool group {i} differs: directory has (slot_bytes={a[0]}, slots={a[1]}), "
                        f"this store has (slot_bytes={b[0]}, slots={b[1]})")
        return None

    def _remove_data_files(self) -> None:
        for name in os.listdir(self.path):
            if name.startswith("group-") and (name.endswith((".seg", ".journal", ".tmp"))):
                remove(os.path.join(self.path, name))

    def _check_data_files(self, on_mismatch: str) -> None:
        """Each group's segment and journal is a regular file or absent; anything else in their
        place is refused, or removed under ``wipe``."""
        for g in self.groups:
            for path in (g.seg_path, g.journal_path):
                if not os.path.lexists(path) or os.path.isfile(path):      # a link to a file is fine
                    continue
                if on_mismatch != "wipe":
                    raise ConfigError("tiers.disk.path",
                                      f"{path!r} is not a regular file (kvtier keeps a segment or journal there); "
                                      "remove it, or set on_mismatch='wipe' to have it removed")
                log.warning("disk tier: %s is not a regular file; removing it (on_mismatch='wipe')", path)
                remove(path)

    def _probe_o_direct(self) -> bool:
        """Can files here be opened O_DIRECT? Also finds how aligned memory must be (512 or 4096)."""
        if not hasattr(os, "O_DIRECT"):
            return False
        probe = os.path.join(self.path, ".o_direct_probe")
        mm, buf = aligned_buffer(2 * ALIGN)
        mv = memoryview(buf)
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
            try:
                if os.pwrite(fd, mv[:ALIGN], 0) != ALIGN:
                    return False
                try:
                    if os.pwrite(fd, mv[512:512 + ALIGN], 0) == ALIGN:
                        self._dio_mem_align = 512
                except OSError:
                    pass
                return True
            finally:
                os.close(fd)
        except OSError:
            return False
        finally:
            mv.release()
            del buf
            mm.close()
            try:
                os.unlink(probe)
            except OSError:
                pass

    def _open_seg(self, g: DiskGroup) -> None:
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if g.direct else 0)
        g.seg_fd = os.open(g.seg_path, flags, 0o644)
        g.size = os.fstat(g.seg_fd).st_size
        g.read_fd = g.seg_fd if g.direct == self.o_direct_reads else os.open(g.seg_path, os.O_RDONLY)

    def _recover_group(self, g: DiskGroup) -> tuple[int, bool]:
        """Replay group g's journal; returns (highest generation seen, needs a checkpoint)."""
        seg_exists = os.path.exists(g.seg_path)
        journal_exists = os.path.exists(g.journal_path)
        self._open_seg(g)
        if seg_exists and not journal_exists and g.size:
            log.warning("disk tier: group %d: journal %s is missing; the %d-byte segment's pages are lost",
                        g.index, g.journal_path, g.size)
            self.journal_errors.append((g.index, 0, f"journal {g.journal_path} missing"))
        g.journal_fd = os.open(g.journal_path, os.O_RDWR | os.O_CREAT, 0o644)
        size = os.fstat(g.journal_fd).st_size
        replay = Replay(g, self.journal_errors, self.discarded)
        try:
            good = replay.run(JournalReader(g.journal_fd, size), size) if size else 0
        finally:
            replay.release()
        dirty = size == 0 or replay.dirty
        if good < size:
            os.ftruncate(g.journal_fd, good)
            dirty = True
        g.journal_size = good
        # Check what is cheap: the segment exists and covers every recorded slot.
        live = flatnonzero(g.live)
        g.n_live = len(live)
        if len(live):
            if not seg_exists:
                lost, reason = live, "segment file missing"
            else:
                lost = live[live * g.stride + g.slot_bytes > g.size]
                reason = f"segment truncated (size {g.size})"
            if len(lost):
                g.live[lost] = False
                g.n_live -= len(lost)
                self.discarded.extend((g.index, int(s), reason) for s in lost)
                log.warning("disk tier: group %d: %d page(s) discarded at open: %s", g.index, len(lost), reason)
                dirty = True
        g.journaled = g.live.copy()
        return replay.max_gen, dirty

    def close(self) -> None:
        """Flush, compact every journal, release the lock. Idempotent."""
        if self._closed:
            return
        self._closed = True          # new calls fail from here; calls under way finish first (group and write locks)
        try:
            self._stop_committer()
            for g in self.groups:
                with g.write_lock, g.commit_lock, g.journal_lock, g.lock:      # a write under way finishes first
                    if g.broken is None:
                        try:
                            self._checkpoint_locked(g)
                        except OSError as e:
                            log.warning("disk tier: checkpoint of group %d at close failed: %s", g.index, e)
                if g.broken is None and (g.queued or g.n_pending):
                    try:
                        self._commit(g)
                    except OSError as e2:
                        log.error("disk tier: group %d: records not journaled at close: %s", g.index, e2)
        finally:
            self._release_fds()

    def _release_fds(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._bounces = []
        for g in self.groups:
            if g.read_fd == g.seg_fd:
                g.read_fd = -1
            for attr in ("read_fd", "seg_fd", "journal_fd"):
                fd = getattr(g, attr)
                if fd >= 0:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                    setattr(g, attr, -1)
        if self._lock_fd >= 0:
            try:
                os.ftruncate(self._lock_fd, 0)
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            except OSError:
                pass
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self) -> "DiskTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- helpers ----

    def _group(self, group: int) -> DiskGroup:
        if self._closed:
            raise StoreClosedError("disk tier is closed")
        if not isinstance(group, int) or not 0 <= group < len(self.groups):
            raise UsageError(f"no disk pool group {group!r} (have {len(self.groups)})")
        return self.groups[group]

    @staticmethod
    def _usable(g: DiskGroup) -> None:
        if g.broken is not None:
            raise TierIOError(errno.EIO, f"disk tier group {g.index} is unusable: {g.broken}; reopen the tier")

    def _check_live_locked(self, g: DiskGroup, slots: np.ndarray, forgotten_ok: bool = False) -> np.ndarray:
        """Under g.lock: the tier is open, the group usable, and every slot holds a page. A slot
        whose page was discarded (found bad, or its write failed: ``forget``) is a
        ``CorruptPageError`` naming it, as the read that found it bad was, or with
        ``forgotten_ok`` returned among such slots; any other empty slot a ``UsageError``."""
        if self._closed:
            raise StoreClosedError("disk tier is closed")
        self._usable(g)
        g.reserve(int(slots.max()) + 1 if len(slots) else 0)
        missing = slots[~g.live[slots]]
        if len(missing):
            gone = missing[g.forgotten[missing]]
            if len(gone) < len(missing):
                raise UsageError(f"disk group {g.index} has no page in slot(s) {missing[:16].tolist()}")
            if not forgotten_ok:
                raise _corrupt(g, gone.tolist(), "discarded")
        return missing

    @staticmethod
    def _check_slots(g: DiskGroup, slots: Iterable[int]) -> tuple[np.ndarray, np.ndarray]:
        """A caller's slots as an int64 array (each an int in [0, slots), no duplicates) and their
        ascending order (a stable argsort)."""
        if isinstance(slots, np.ndarray) and slots.dtype.kind in "iu" and slots.ndim == 1:
            arr = np.ascontiguousarray(slots.astype(np.int64, copy=False))    # the kernels take it as rows
        else:
            slots = list(slots)
            if not set(map(type, slots)) <= {int}:    # the common list of ints in one C-speed pass
                for s in slots:
                    if type(s) is not int and (not isinstance(s, (int, np.integer)) or isinstance(s, bool)):
                        raise UsageError(f"slot {s!r} of disk group {g.index} is not an int")
            try:
                arr = np.asarray(slots, dtype=np.int64).reshape(-1)
            except OverflowError:           # beyond int64: outside the group whatever it is
                bad = next(s for s in slots if not 0 <= s < g.slots)
                raise UsageError(f"slot {bad!r} is outside disk group {g.index}'s {g.slots} slots") from None
        order, dup = argsort_i64(arr)        # (numpy's min and max would give the GIL up)
        if len(arr) and (arr[order[0]] < 0 or arr[order[-1]] >= g.slots):
            bad = int(arr[(arr < 0) | (arr >= g.slots)][0])
            raise UsageError(f"slot {bad!r} is outside disk group {g.index}'s {g.slots} slots")
        if dup:
            raise UsageError(f"duplicate slots in one call on disk group {g.index}")
        return arr, order

    def _take_gens(self, n: int) -> int:
        with self._gen_lock:
            first = self._gen
            if first + n > journal.MAX_GEN:      # 2**62 writes: not reachable by use, only by a forged journal
                raise TierIOError(errno.EOVERFLOW, f"disk tier {self.path}: journal generations exhausted; "
                                  "reopen with on_mismatch='wipe'")
            self._gen += n
            return first

    def _fault(self, op: str) -> None:
        with self._stats_lock:
            q = self._faults.get(op)
            if not q:
                return
            err = q.pop(0)
        raise OSError(err, f"injected fault: {os.strerror(err)}")

    def _add_stats(self, **kw: float) -> None:
        with self._stats_lock:
            for k, v in kw.items():
                self._stats[k] += v

    def _discard(self, g: DiskGroup, slots: Iterable[int], reason: str, live: bool = True) -> None:
        """Forget pages found bad (caller holds g.lock); their frees are journaled lazily.
        ``live=False``: slots that hold no page (``forget``)."""
        slots = np.asarray(list(slots), dtype=np.int64)
        if not len(slots):
            return
        if live:
            self._unlive(g, slots)
        g.forgotten[slots] = True
        listed = slots.tolist()
        with self._stats_lock:
            self.discarded.extend((g.index, s, reason) for s in listed)
            self._stats["discarded"] += len(listed)
        # a failed write's caller reports the failure (a full disk once a minute): no line per write here
        log.log(logging.WARNING if live else logging.DEBUG, "disk tier: group %d: discarded %d page(s) in slot(s) %s: %s",
                g.index, len(listed), listed if len(listed) <= 16 else f"{listed[:16]}...", reason)

    def _unlive(self, g: DiskGroup, slots: np.ndarray) -> None:
        """Under g.lock: ``slots`` hold no page from now on (see ``DiskGroup.unlive``)."""
        named = g.unlive(slots)
        if len(named):
            g.add_pending(named, self._take_gens(len(named)))

    def _append(self, g: DiskGroup, *records: np.ndarray) -> None:
        """Append one frame of ``records`` to g's journal and make it durable (on failure roll it back).
        The caller holds g.journal_lock."""
        frame = journal.frame(journal.RECORDS_MAGIC, b"".join(r.tobytes() for r in records if len(r)))
        start = g.journal_size
        t0 = time.perf_counter()
        try:
            self._fault("journal")
            self._sync_dir(g)
            pwrite_all(g.journal_fd, frame, start, self.fsync)     # the frame and its barrier: one GIL release
        except OSError as e:
            try:
                os.ftruncate(g.journal_fd, start)
                if self.fsync:
                    os.fdatasync(g.journal_fd)
            except OSError as e2:
                g.broken = f"journal append failed ({e.strerror}) and could not be rolled back ({e2.strerror})"
            raise typed_error(e, f"journal append to {g.journal_path}") from e
        g.journal_size = start + len(frame)
        self._add_stats(fsync_seconds=time.perf_counter() - t0)

    def _append_frees(self, g: DiskGroup, slots: np.ndarray) -> None:
        """Before ``slots`` are written over: if one has a pending free, append the pending frees
        (alone: a queued write never names a slot with a pending free, so the order between them
        does not matter) and make them durable."""
        with g.journal_lock:
            with g.lock:
                if not g.pending[slots].any():        # a commit under way journaled them
                    return
                self._usable(g)
            self._append_with_frees(g, np.zeros(0, RECORD))

    def _append_with_frees(self, g: DiskGroup, records: np.ndarray, undo: Callable[[], None] | None = None) -> None:
        """Append ``records`` and g's pending frees as one frame (the caller holds g.journal_lock).
        The freed slots stay pending, so unwritable, until the frame is durable; if the append
        fails their frees are pending again, and ``undo`` (under g.lock) takes ``records`` back."""
        with g.lock:
            frees, slots, gens = g.take_pending()
        try:
            self._append(g, records, frees)
        except BaseException:
            with g.lock:
                if undo is not None:
                    undo()
                g.restore_pending(slots, gens)
            raise
        with g.lock:
            g.settle_pending(slots)

    def _sync_dir(self, g: DiskGroup) -> None:
        """A compaction's rename is not durable until the directory is synced: nothing after it
        would be. Retried by every append (and idle commit) until it succeeds."""
        if g.dir_unsynced:
            fsync_dir(self.path)
            g.dir_unsynced = False

    def _sync_segment(self, g: DiskGroup) -> None:
        """fdatasync g's segment. On failure the group is unusable: after a failed fdatasync Linux
        may drop the dirty pages, so nothing written since the previous sync can be trusted."""
        t0 = time.perf_counter()
        try:
            self._fault("sync")
            os.fdatasync(g.seg_fd)
        except OSError as e:
            g.broken = f"syncing the segment failed ({e.strerror}): what was written since the previous " \
                       "sync may be lost"
            raise typed_error(e, f"syncing {g.seg_path}") from e
        self._add_stats(fsync_seconds=time.perf_counter() - t0)

    def _commit(self, g: DiskGroup) -> None:
        """Journal what g has queued (group commit): sync the queued bytes, then append and sync
        one frame with the queued records still current and the pending frees. Writes queued
        meanwhile wait for the next commit. ``OSError`` (typed) on failure: a failed append is
        rolled back and its records stay queued; a failed sync of the segment breaks the group
        (``_sync_segment``) and its records are never journaled."""
        try:
            with g.commit_lock:
                with g.lock:
                    if g.broken is not None:
                        return
                    snap = g.take_queued()
                    idle = not snap and not g.n_pending
                if idle:
                    with g.journal_lock:
                        try:
                            self._sync_dir(g)
                        except OSError as e:
                            raise typed_error(e, f"syncing {self.path}") from e
                    g.commit_failed = False
                    return
                if self.fsync and not all(synced for _, synced in snap):
                    self._sync_segment(g)
                with g.journal_lock:
                    with g.lock:
                        recs = g.current(journal.concat([r for r, _ in snap])) if snap else np.zeros(0, RECORD)
                        slots = records_slots(journal.rows(recs))
                        before = take(g.journaled, slots)
                        flags_set(g.journaled, slots, True)     # before a free can look

                    def undo() -> None:
                        # never journaled after all, unless freed meanwhile (pending implies journaled)
                        g.journaled[slots[~before & ~g.pending[slots]]] = False
                        # the whole snapshot, synced: a record left out as not current may be
                        # current again if what superseded it is rolled back (a durable relabel)
                        g.queued[:0] = [(r, True) for r, _ in snap]
                    self._append_with_frees(g, recs, undo)
                    with g.lock:
                        g.commit_failed = False
                        self._add_stats(commits=1)
                        self._maybe_checkpoint(g)
        except OSError:
            with self._stats_lock:
                self._stats["commit_failures"] += 1
            raise

    def _commit_soon(self, g: DiskGroup) -> None:
        """Have the committer thread journal g's queued writes (started on first use)."""
        c = self._committer
        with c.cv:
            if c.closed:            # close() journals what is queued once writes under way finish
                return
            c.due.setdefault(g.index, 0.0)     # a failing group keeps its retry time
            if c.thread is None:
                c.thread = threading.Thread(target=_Committer.run, args=(c, weakref.ref(self)),
                                            name="kvtier-disk-commit", daemon=True)
                c.thread.start()
            c.cv.notify()

    def _commit_due(self, due: list[int], retry: dict[int, float]) -> None:
        """The committer's turn: commit each due group; one that fails (and is not broken) is
        retried later, with a growing delay, and the group's next write commits first."""
        for i in due:
            g = self.groups[i]
            try:
                self._commit(g)
                if retry.pop(i, None) is not None:
                    log.warning("disk tier: group %d: journaling works again", g.index)
            except Exception as e:      # noqa: BLE001 - the committer must outlive any one failure
                (log.debug if i in retry else log.error)(
                    "disk tier: group %d: journaling written pages failed (retrying): %r", g.index, e)
                g.commit_failed = isinstance(e, OSError) and g.broken is None
                delay = retry[i] = min(1.0, 2 * retry.get(i, 0.025))
                with self._committer.cv:
                    self._committer.due[i] = time.monotonic() + delay

    def _stop_committer(self) -> None:
        c = self._committer
        with c.cv:
            c.closed = True
            t, c.thread = c.thread, None
            c.cv.notify()
        if t is not None:
            t.join()

    def _maybe_checkpoint(self, g: DiskGroup) -> None:
        snapshot = g.live_bytes() + 4096
        if g.journal_size > max(CHECKPOINT_RATIO * snapshot, self.checkpoint_floor):
            try:
                self._checkpoint_locked(g)
            except OSError as e:   # the old journal, or the new one, is in use and valid (see _checkpoint_locked)
                log.warning("disk tier: journal compaction of group %d failed: %s", g.index, e)

    def _checkpoint_locked(self, g: DiskGroup) -> None:
        """Rewrite g's journal as a snapshot of its live records (the caller holds g's commit, journal
        and slot-table locks). Queued writes are in the snapshot, so their bytes are synced first."""
        if self.fsync and not all(synced for _, synced in g.queued):
            self._sync_segment(g)
            g.queued = [(r, True) for r, _ in g.queued]
        tmp = g.journal_path + ".tmp"
        with self._gen_lock:
            next_gen = self._gen
        header = {"format": FORMAT_VERSION, "group": g.index, "next_gen": next_gen}
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:
            raise typed_error(e, f"creating {tmp}") from e
        written = 0
        try:
            chunks = [journal.frame(journal.HEADER_MAGIC, packb(header))]
            pending = len(chunks[0])
            live = journal.take(g.meta, np.flatnonzero(g.live))
            live = journal.take(live, np.argsort(live["gen"], kind="stable"))
            for i in range(0, len(live), journal.FRAME_RECORDS):     # bounded frames: damage costs only its own
                f = journal.frame(journal.RECORDS_MAGIC, live[i:i + journal.FRAME_RECORDS].tobytes())
                chunks.append(f)
                pending += len(f)
                if pending >= 8 << 20:
                    pwritev_all(fd, chunks, written)
                    written += pending
                    chunks, pending = [], 0
            pwritev_all(fd, chunks, written)
            written += pending
            if self.fsync:
                os.fsync(fd)
        except BaseException as e:
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if isinstance(e, OSError):
                raise typed_error(e, f"compacting group {g.index}'s journal") from e
            raise
        os.close(fd)
        try:
            os.replace(tmp, g.journal_path)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise typed_error(e, f"replacing {g.journal_path}") from e
        # The new journal is in place: switch to it before anything else can fail, or later records
        # would go to the old file, which the rename just unlinked.
        try:
            new_fd = os.open(g.journal_path, os.O_RDWR)
        except OSError as e:
            g.broken = f"the compacted journal could not be reopened ({e.strerror})"
            raise typed_error(e, f"reopening {g.journal_path}") from e
        old, g.journal_fd = g.journal_fd, new_fd
        os.close(old)
        g.dir_unsynced = self.fsync       # the rename is durable once the directory is synced
        g.journal_size = written
        g.clear_pending()          # the snapshot already leaves freed slots out ...
        g.queued = []              # ... and holds every live record
        g.journaled = g.live.copy()
        self._add_stats(checkpoints=1)
        if g.dir_unsynced:
            try:
                fsync_dir(self.path)
            except OSError as e:      # every append syncs the directory first until one succeeds
                raise typed_error(e, f"syncing {self.path} after compacting group {g.index}'s journal") from e
            g.dir_unsynced = False

    def _ensure_size(self, g: DiskGroup, needed: int) -> None:
        """Grow g's segment (preallocated) so that it covers ``needed`` bytes."""
        if needed <= g.size:
            return
        step = max(g.stride, min(GROW_STEP, round_up(g.max_size // 8, g.stride)))
        target = min(g.max_size, max(round_up(needed, g.stride), round_up(g.size + step, g.stride)))
        for size in dict.fromkeys((target, round_up(needed, g.stride))):
            if self.min_free is not None:
                st = os.statvfs(self.path)
                if st.f_bavail * st.f_frsize - (size - g.size) < self.min_free:
                    continue
            try:
                os.posix_fallocate(g.seg_fd, g.size, size - g.size)
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
                    try:
                        os.ftruncate(g.seg_fd, size)
                    except OSError as e2:
                        raise typed_error(e2, f"growing {g.seg_path}") from e2
                elif e.errno in FULL_ERRNOS and size > round_up(needed, g.stride):
                    continue       # try again with just what this batch needs
                else:
                    raise typed_error(e, f"growing {g.seg_path}") from e
            g.size = size
            return
        if self.min_free is not None:
            raise DiskFullError(errno.ENOSPC, f"disk tier: writing group {g.index} would leave less than "
                                              f"min_free={self.min_free} bytes free on {self.path}")
        raise DiskFullError(errno.ENOSPC, f"disk tier: no space to grow {g.seg_path}")

    @staticmethod
    def _as_rows(t: Any, n: int, width: int, what: str, writable: bool) -> np.ndarray:
        if isinstance(t, torch.Tensor):
            if t.device.type != "cpu":
                raise UsageError(f"{what} must be a CPU tensor, got device {t.device}")
            if t.dtype != torch.uint8:
                raise UsageError(f"{what} must be uint8, got {t.dtype}")
            if tuple(t.shape) != (n, width):
                raise UsageError(f"{what} must have shape ({n}, {width}), got {tuple(t.shape)}")
            if writable:
                if not t.is_contiguous():
                    raise UsageError(f"{what} must be contiguous")
            elif n and t.stride(1) != 1:
                t = t.contiguous()
            return t.detach().numpy()
        if isinstance(t, np.ndarray) and t.dtype == np.uint8 and t.shape == (n, width):
            if (writable and not t.flags.c_contiguous) or (n and t.strides[1] != 1):
                raise UsageError(f"{what} rows must be contiguous")
            return t
        raise UsageError(f"{what} must be a uint8 CPU tensor of shape ({n}, {width})")

    @staticmethod
    def _row_index(index: Any, n: int, n_rows: int) -> np.ndarray:
        """``index`` as an int64 array of ``n`` rows of an array of ``n_rows`` (UsageError otherwise)."""
        idx = np.asarray(index)
        if idx.size == 0 and n == 0:
            return np.zeros(0, dtype=np.int64)
        if idx.dtype.kind not in "iu" or idx.shape != (n,):
            raise UsageError(f"index must be {n} integer row numbers, got shape {idx.shape} of {idx.dtype}")
        idx = np.ascontiguousarray(idx.astype(np.int64, copy=False))
        lo, hi = bounds_i64(idx) if n else (0, -1)
        if lo < 0 or hi >= n_rows:
            raise UsageError(f"index holds a row outside 0..{n_rows - 1}")
        return idx

    def _direct_ok(self, arr: np.ndarray, rows: list[int], g: DiskGroup) -> bool:
        """Can these rows go to/from an O_DIRECT fd as they are (no bounce copy)?"""
        if g.pad:
            return False
        base, rs = arr.ctypes.data, arr.strides[0]
        al = self._dio_mem_align
        return all((base + i * rs) % al == 0 for i in rows)

    def _bounce_get(self, nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
        with self._pool_lock:
            for k, (mm, buf) in enumerate(self._bounces):
                if buf.nbytes >= nbytes:
                    return self._bounces.pop(k)
        return aligned_buffer(max(nbytes, disk_io.PIECE_BYTES))

    def _bounce_put(self, b: tuple[mmap.mmap, np.ndarray]) -> None:
        with self._pool_lock:
            if len(self._bounces) < 2 * disk_io.IO_THREADS:
                self._bounces.append(b)

    def _run_pieces(self, fn: Callable[[int, int], Any], pieces: list[tuple[int, int]], parallel: bool) -> list:
        """fn(a, b) for every piece, spread over at most IO_THREADS jobs of about equal size: the first
        job on this thread, the rest on the I/O pool. All finish before this returns; the first OSError
        is raised. Returns the results in piece order. Without ``parallel`` (small page-cache batches:
        their I/O is a memcpy, and handing it to other threads costs more than it overlaps) all run here."""
        if len(pieces) == 1 or not parallel:
            return [fn(a, b) for a, b in pieces]
        jobs: list[list[tuple[int, int]]] = [[]]
        total = sum(b - a for a, b in pieces)
        share, acc = -(-total // disk_io.IO_THREADS), 0
        for a, b in pieces:
            if acc >= share * len(jobs) and len(jobs) < disk_io.IO_THREADS:
                jobs.append([])
            jobs[-1].append((a, b))
            acc += b - a
        if jobs[0] == []:
            jobs.pop(0)

        def job(part: list[tuple[int, int]]) -> list:
            return [fn(a, b) for a, b in part]

        if len(jobs) == 1:
            return job(jobs[0])
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(disk_io.IO_THREADS - 1, thread_name_prefix="kvtier-disk")
            pool = self._pool
        futs = [pool.submit(job, part) for part in jobs[1:]]
        results, err = [], None
        try:
            results += job(jobs[0])
        except OSError as e:
            err = e
        for f in futs:
            try:
                results += f.result()
            except OSError as e:
                err = err or e
        if err is not None:
            raise err
        return results

    # ---- data path ----

    def write(self, group: int, slots: Iterable[int], rows: torch.Tensor, records: Any,
              index: np.ndarray | None = None, durable: bool = True) -> None:
        """Store ``rows[i]`` (a CPU uint8 row of ``slot_bytes``; any row stride) in ``slots[i]`` with
        ``records[i]`` (a ``journal.RECORD`` array, as the core builds it, or PageRecords). With ``index``
        (int64, one per slot), ``rows`` is any number of rows (a host slab) and ``slots[i]`` gets
        ``rows[index[i]]``: scattered rows are written where they are, with no gathering copy.

        ``durable``: the pages are journaled (and, with ``fsync``, synced) when it returns. Without it
        the call returns once the bytes are written, the pages readable and freeable at once, and the
        tier's committer thread journals them soon after, many writes per sync (group commit); a crash
        before that loses them, never anything else. See the module docstring for the order.

        The slots must be free (``UsageError`` for a live one, a duplicate, or one outside the group).
        ``DiskFullError`` when the segment cannot grow (filesystem full, a file size limit, or
        ``min_free``, which is checked whenever the segment grows), ``TierIOError`` for other I/O errors;
        after either, every slot is as it was before the call.
        """
        g = self._group(group)
        if type(durable) is not bool:
            raise UsageError(f"durable must be True or False, got {durable!r}")
        sl, order = self._check_slots(g, slots)
        n = len(sl)
        recs = journal.as_records(records, n)
        if n and journal.malformed(recs, stored=False).any():
            raise UsageError("records with an unknown key form or a priority above 100")
        if index is None:
            arr = self._as_rows(rows, n, g.slot_bytes, "rows", writable=False)
        else:
            shape = tuple(getattr(rows, "shape", ()))
            if len(shape) != 2:
                raise UsageError(f"rows must be a 2-D array of rows of {g.slot_bytes} bytes, got shape {shape}")
            arr = self._as_rows(rows, shape[0], g.slot_bytes, "rows", writable=False)
            index = self._row_index(index, n, len(arr))
        if n == 0:
            return
        # One writer per group at a time (write_lock); the group lock only around what reads
        # the slot table, so that reads of live pages go on while this batch's data is written
        # and synced: its slots are free, so no read or free touches them meanwhile.
        with g.write_lock:
            # 0. a background commit failed: it goes through first (or this write reports why)
            if g.commit_failed:
                self._commit(g)
            with g.lock:
                if self._closed:
                    raise StoreClosedError("disk tier is closed")
                self._usable(g)
                sorted_slots = take(sl, order)
                end = int(sorted_slots[-1]) + 1
                g.reserve(end)
                if flags_any(g.live, sl):
                    raise UsageError(f"slot {int(sl[g.live[sl]][0])} of disk group {g.index} holds a live page; "
                                     "free it first")
                t1 = time.perf_counter()
                hashes = np.zeros(n, dtype=np.uint64)
                self._ensure_size(g, end * g.stride)
                frees_first = flags_any(g.pending, sl)
            # 1. frees of the target slots must be durable before their old bytes are overwritten
            if frees_first:
                self._append_frees(g, sl)
            # 2. the data (and its barrier, when durable)
            sync = self.fsync and durable
            try:
                self._fault("write")
                parallel = g.direct or n * g.stride >= PARALLEL_MIN_BYTES
                src = order if index is None else take(index, order)     # the row of each slot, in slot order
                if parallel:
                    tck = sum(self._run_pieces(lambda a, b: self._write_piece(g, arr, src, order, sorted_slots,
                                                                              hashes, a, b),
                                               g.pieces(sorted_slots), True))
                    if sync:
                        os.fdatasync(g.seg_fd)
                else:   # a page-cache batch: one piece, its barrier in the same native call
                    tck = self._write_piece(g, arr, src, order, sorted_slots, hashes, 0, n, sync=sync)
            except OSError as e:
                raise typed_error(e, f"writing {n} page(s) to {g.seg_path}") from e
            # 3. the records go live and join the queue of the next commit
            t2 = time.perf_counter()
            with g.lock:
                t1 += time.perf_counter() - t2      # time waiting for the lock behind reads is not I/O
                self._usable(g)             # a failed sync may have broken the group meanwhile
                out = journal.stamp_writes(recs, sl, self._take_gens(n), hashes, self._fp)
                journal.put(g.meta, sl, out)
                flags_set(g.live, sl, True)
                flags_set(g.forgotten, sl, False)
                g.n_live += n
                g.queue(out, sync)
                self._add_stats(bytes_written=n * g.slot_bytes, pages_written=n, checksum_seconds=tck,
                                io_seconds=time.perf_counter() - t1)
            # 4. durable: commit now (with whatever else is queued); else the committer does
            self._settle(g, durable, lambda: self._unlive(g, sl))

    def _settle(self, g: DiskGroup, durable: bool, undo: Callable[[], None]) -> None:
        """After a batch is queued: with ``durable``, commit now and, if that fails, ``undo`` the
        batch (under g.lock) and raise; without, leave it to the committer thread."""
        if not durable:
            self._commit_soon(g)
            return
        try:
            self._commit(g)
            self._usable(g)
        except BaseException:
            with g.lock:
                undo()
            raise

    def _write_piece(self, g: DiskGroup, arr: np.ndarray, src: np.ndarray, order: np.ndarray,
                     sorted_slots: np.ndarray, hashes: np.ndarray, a: int, b: int, sync: bool = False) -> float:
        """Checksum and write rows ``src[a:b]`` of ``arr`` to slots ``sorted_slots[a:b]`` (adjacent when it
        bounces through an aligned buffer; else one native call, a pwritev per run of adjacent slots, which
        gives the GIL up once for the checksums, the writes and, with ``sync``, the segment's fdatasync:
        each time costs a wait to get it back behind a busy loop); their checksums go to
        ``hashes[order[a:b]]`` (the batch's order). Returns the seconds spent hashing. Runs on the I/O
        pool (hashing overlaps other I/O)."""
        off = int(sorted_slots[a]) * g.stride
        rows = src[a:b]
        at = order[a:b]
        k = b - a
        if g.direct and not self._direct_ok(arr, rows, g):
            bounce = self._bounce_get(k * g.stride)
            try:
                staged = bounce[1][:k * g.stride].reshape(k, g.stride)[:, :g.slot_bytes]
                for j, i in enumerate(rows.tolist()):
                    staged[j] = arr[i]
                t = time.perf_counter()
                hashes[at] = xxh64_rows(staged)
                tck = time.perf_counter() - t
                pwritev_all(g.seg_fd, [memoryview(bounce[1])[:k * g.stride]], off)
                if sync:
                    os.fdatasync(g.seg_fd)
            finally:
                self._bounce_put(bounce)
            return tck
        got = np.empty(k, dtype=np.uint64)
        tck = pwrite_rows(g.seg_fd, arr, rows, sorted_slots[a:b] * g.stride, g.stride, got, sync)
        hashes[at] = got
        return tck

    def _expected(self, g: DiskGroup, slots: np.ndarray) -> np.ndarray:
        """The XXH64 the bytes of ``slots`` must have: their records' checksums less their identities."""
        recs = journal.take(g.meta, slots)
        return recs["csum"] ^ journal.identity(recs, self._fp)

    def _read_piece(self, g: DiskGroup, out: np.ndarray, order: np.ndarray, sorted_slots: np.ndarray,
                    a: int, b: int, nowait: bool = False) -> tuple[np.ndarray, np.ndarray, float]:
        """Read slots ``sorted_slots[a:b]`` (adjacent when it bounces; else any, a preadv per run in one
        native call) into rows ``order[a:b]`` and verify them; returns (rows read short, rows failing
        their checksum, seconds spent hashing)."""
        off = int(sorted_slots[a]) * g.stride
        rows = order[a:b]
        k = b - a
        expected = self._expected(g, sorted_slots[a:b])
        if self.o_direct_reads and not self._direct_ok(out, rows, g):
            bounce = self._bounce_get(k * g.stride)
            try:
                got = preadv_all(g.read_fd, [memoryview(bounce[1])[:k * g.stride]], off)
                short = np.arange(k) * g.stride + g.slot_bytes > got
                staged = bounce[1][:k * g.stride].reshape(k, g.stride)[:, :g.slot_bytes]
                t = time.perf_counter()
                hashes = xxh64_rows(staged)
                tck = time.perf_counter() - t
                for j, i in enumerate(rows.tolist()):
                    out[i] = staged[j]
            finally:
                self._bounce_put(bounce)
        else:
            part = sorted_slots[a:b]
            short = pread_rows(g.read_fd, out, rows, part * g.stride, g.stride, nowait) < g.slot_bytes
            if g.direct and not self.o_direct_reads:
                # cold pages just promoted: do not keep a second copy in the page cache
                for lo, hi in g.pieces(part, split=False):
                    os.posix_fadvise(g.read_fd, int(part[lo]) * g.stride, (hi - lo) * g.stride,
                                     os.POSIX_FADV_DONTNEED)
            t = time.perf_counter()
            hashes = xxh64_rows(out, rows)
            tck = time.perf_counter() - t
        bad = (hashes != expected) & ~short
        return rows[short], rows[bad], tck

    def _read_locked(self, g: DiskGroup, slots: np.ndarray, order: np.ndarray, out: np.ndarray, nowait: bool = False,
                     faults: bool = True) -> tuple[list[int], list[int], float, float]:
        """Read and verify (``order``: the slots' ascending order); returns (short slots,
        checksum-mismatch slots, io seconds, checksum seconds). ``nowait``: one piece, from the
        page cache only (``TierIOError`` with errno EAGAIN where it would wait; see ``read_cached``).
        ``faults=False``: an injected read fault is left for the next read (``inject_fault``)."""
        n = len(slots)
        sorted_slots = slots[order]
        short: list[np.ndarray] = []
        bad: list[np.ndarray] = []
        tck = 0.0
        t0 = time.perf_counter()
        try:
            if faults:
                self._fault("read")
            parallel = not nowait and (self.o_direct_reads or n * g.stride >= PARALLEL_MIN_BYTES)
            pcs = g.pieces(sorted_slots, split=self.o_direct_reads) if parallel else [(0, n)]
            for sh, bd, t in self._run_pieces(lambda a, b: self._read_piece(g, out, order, sorted_slots, a, b,
                                                                            nowait), pcs, parallel):
                short.append(slots[sh])
                bad.append(slots[bd])
                tck += t
        except OSError as e:
            raise typed_error(e, f"reading {n} page(s) from {g.seg_path}") from e
        return (sorted(np.concatenate(short).tolist()), sorted(np.concatenate(bad).tolist()),
                time.perf_counter() - t0, tck)

    def read(self, group: int, slots: Iterable[int], out: torch.Tensor) -> None:
        """Fill ``out[i]`` (contiguous CPU uint8 ``[len(slots), slot_bytes]``) with the page in ``slots[i]``.

        Every page is checked against its checksum. Bad or short pages are reported in ``discarded``,
        forgotten as if freed, and ``CorruptPageError`` is raised with ``.slots`` (and ``.group``); the
        other rows of ``out`` are valid. An I/O error raises ``TierIOError`` and changes nothing.
        A slot without a live page is a ``UsageError``, and one whose page was discarded (found bad
        before, or ``forget``) a ``CorruptPageError`` naming it.
        """
        g = self._group(group)
        sl, order = self._check_slots(g, slots)
        n = len(sl)
        arr = self._as_rows(out, n, g.slot_bytes, "out", writable=True)
        if n == 0:
            return
        with g.lock:
            self._check_live_locked(g, sl)
            self._finish_read(g, sl, *self._read_locked(g, sl, order, arr))

    def read_cached(self, group: int, slots: Iterable[int], out: torch.Tensor) -> bool:
        """``read``, for a caller that must not block (the event loop): done only if every page is
        in the page cache (True); otherwise False, with ``out`` undefined and nothing else changed,
        and the caller reads on a thread. It never waits for the group's lock: while another thread
        holds it, the read goes on unlocked and validated (``_read_unlocked``). Errors as ``read``,
        raised only by a read under the lock (one without it declines instead). Groups whose writes
        bypass the page cache (O_DIRECT) always answer False."""
        g = self._group(group)
        if g.direct or self.o_direct_reads or not self._nowait:
            return False
        sl, order = self._check_slots(g, slots)
        arr = self._as_rows(out, len(sl), g.slot_bytes, "out", writable=True)
        if not len(sl) or len(sl) * g.stride > CACHED_READ_MAX:
            return not len(sl)
        if not g.lock.acquire(blocking=False):
            return self._read_unlocked(g, sl, order, arr)
        try:
            self._check_live_locked(g, sl)
            got = self._read_nowait(g, sl, order, arr)
            if got is None:
                return False
            self._finish_read(g, sl, *got)
            self._add_stats(cached_reads=1)
            return True
        finally:
            g.lock.release()

    def _read_nowait(self, g: DiskGroup, sl: np.ndarray, order: np.ndarray, arr: np.ndarray,
                     faults: bool = True) -> tuple[list[int], list[int], float, float] | None:
        """``_read_locked`` from the page cache only; None where that would wait (or cannot be
        done here at all)."""
        try:
            return self._read_locked(g, sl, order, arr, nowait=True, faults=faults)
        except OSError as e:
            if e.errno == errno.EAGAIN:
                return None
            if e.errno in _NOWAIT_UNSUPPORTED:      # this kernel or filesystem: never again
                self._nowait = False
                log.info("disk tier %s: reads without waiting are not supported here (%s); reads go "
                         "to a thread", self.path, e.strerror)
                return None
            raise

    def _read_unlocked(self, g: DiskGroup, sl: np.ndarray, order: np.ndarray, arr: np.ndarray) -> bool:
        """``read_cached`` while another thread holds g.lock. The holder is mostly doing bookkeeping
        of other slots (a write's records, a free, a commit's snapshot), held longer than its few
        microseconds whenever it waits for the GIL behind the loop; going to the read thread instead
        cost a request about 2 ms (one cached read in ten found the lock held at concurrency 1).

        So the read goes on without the lock, validated the way a seqlock is: every change to a
        slot's record (write, relabel) gives it a new generation, and a slot stops being live before
        its bytes can change (a write needs it free). The slots' generations and liveness are read
        before the bytes and checked after; any change, any page short or failing its checksum, or a
        closed or broken group answers False (the read thread redoes the read under the lock, and
        only it discards pages or raises for bad ones), never a row the tier did not hold. So does
        an I/O error (a close may have closed the fd under the read), and an injected fault is left
        for the locked read."""
        if self._closed or g.broken is not None:
            return False
        top = int(sl.max())
        live, meta = g.live, g.meta         # reserve() may replace them: each is whole when read
        if top >= len(live) or top >= len(meta) or not live[sl].all():
            return False
        gens = meta["gen"][sl]              # a copy (fancy index)
        try:
            got = self._read_nowait(g, sl, order, arr, faults=False)
        except OSError:
            return False
        if got is None or self._closed or g.broken is not None:
            return False
        short, bad, tio, tck = got
        if short or bad or not g.live[sl].all() or not np.array_equal(g.meta["gen"][sl], gens):
            return False
        n = len(sl)
        self._add_stats(bytes_read=n * g.slot_bytes, pages_read=n, io_seconds=tio, checksum_seconds=tck,
                        cached_reads=1, unlocked_reads=1)
        return True

    def _finish_read(self, g: DiskGroup, sl: np.ndarray, short: list[int], bad: list[int], tio: float,
                     tck: float) -> None:
        """Under g.lock: count a read, and forget (and raise for) its bad pages."""
        n = len(sl)
        self._add_stats(bytes_read=n * g.slot_bytes, pages_read=n, io_seconds=tio, checksum_seconds=tck)
        if short:
            self._discard(g, short, "short read (segment ends before the page)")
        if bad:
            self._discard(g, bad, "checksum mismatch")
        if short or bad:
            raise _corrupt(g, short + bad, "bad")

    def verify_all(self, batch: int = 64) -> list[tuple[int, int, str]]:
        """Read and checksum every live page; discard the bad ones. Returns what it discarded.
        Holds each group's lock throughout: for a tier nothing else uses (a store scrubs with
        ``verify``, a piece at a time)."""
        found: list[tuple[int, int, str]] = []
        for g in self.groups:
            scratch = np.empty((batch, g.slot_bytes), dtype=np.uint8)
            with g.lock:
                self._group(g.index)
                self._usable(g)
                live = np.flatnonzero(g.live)
                for i in range(0, len(live), batch):      # (flatnonzero's slots are ascending)
                    found += self._verify_locked(g, live[i:i + batch], scratch)
        return found

    def verify(self, group: int, slots: Iterable[int]) -> list[tuple[int, int, str]]:
        """Read and checksum the pages of ``slots``, discarding the bad ones as a read that found
        them would; returns the bad ones as (group, slot, reason), slots whose page was discarded
        already (found bad, or its write failed: ``forget``) among them. For a store's scrub
        (``runtime.scrub``), whose claims keep the pages still; any other empty slot is a
        ``UsageError``."""
        g = self._group(group)
        sl, _ = self._check_slots(g, slots)
        if not len(sl):
            return []
        sl = np.sort(sl)
        with g.lock:
            gone = self._check_live_locked(g, sl, forgotten_ok=True)
            found = [(g.index, int(s), "discarded") for s in gone.tolist()]
            part = sl[g.live[sl]]
            if len(part):
                found += self._verify_locked(g, part, np.empty((len(part), g.slot_bytes), dtype=np.uint8))
            return found

    def _verify_locked(self, g: DiskGroup, part: np.ndarray, scratch: np.ndarray) -> list[tuple[int, int, str]]:
        """Under g.lock: ``verify`` of ascending live slots ``part`` (scratch: rows to read into),
        counted in ``verified_pages``."""
        short, bad, tio, tck = self._read_locked(g, part, np.arange(len(part)), scratch[:len(part)])
        self._add_stats(bytes_read=len(part) * g.slot_bytes, io_seconds=tio, checksum_seconds=tck,
                        verified_pages=len(part))
        found = []
        if short:
            self._discard(g, short, "short read (segment ends before the page)")
            found += [(g.index, s, "short read") for s in short]
        if bad:
            self._discard(g, bad, "checksum mismatch")
            found += [(g.index, s, "checksum mismatch") for s in bad]
        return found

    def relabel(self, group: int, slots: Iterable[int], records: Any, durable: bool = True) -> None:
        """Give live pages new records, keeping their bytes: journal records with the next commit,
        no data read or written (the checksum trades the old identity for the new one). For a page
        whose block was committed after the page reached the disk (it was written with an anonymous
        record, which recovery never serves). ``durable`` as for ``write`` (a durable relabel that
        fails leaves the old records). ``UsageError`` for a slot with no page."""
        g = self._group(group)
        if type(durable) is not bool:
            raise UsageError(f"durable must be True or False, got {durable!r}")
        sl, _ = self._check_slots(g, slots)
        recs = journal.as_records(records, len(sl))
        if len(sl) and journal.malformed(recs, stored=False).any():
            raise UsageError("records with an unknown key form or a priority above 100")
        if not len(sl):
            return
        with g.lock:
            self._check_live_locked(g, sl)
            old = journal.take(g.meta, sl)
            out = journal.copy(recs)
            out["kind"] = WRITE
            out["slot"] = sl
            gen = self._take_gens(len(sl))
            out["gen"] = iota_u64(gen, len(sl))
            out["csum"] = old["csum"] ^ journal.identity(old, self._fp) ^ journal.identity(out, self._fp)
            journal.put(g.meta, sl, out)
            g.queue(out, bool(g.journaled[sl].all()))    # bytes journaled before are synced

        def undo() -> None:
            # the old records again, where nothing superseded ours: with new generations, queued,
            # since another commit may have journaled ours before this one failed
            ours = g.live[sl] & (g.meta["gen"][sl] == out["gen"])
            back = journal.copy(journal.take(old, ours))
            back["gen"] = iota_u64(self._take_gens(len(back)), len(back))
            journal.put(g.meta, sl[ours], back)
            g.queue(back, bool(g.journaled[sl[ours]].all()))
            self._commit_soon(g)
        self._settle(g, durable, undo)

    def forget(self, group: int, slots: Iterable[int], reason: str) -> None:
        """Count the pages of ``slots`` discarded, for a caller that had placed them before their
        ``write`` ran and the write failed (a spill written behind: ``runtime.migration``). The
        slots hold no page (a failed write changes nothing); from now on a read of one raises
        ``CorruptPageError``, as for a page a read found bad, and a free of one is accepted. A slot
        that holds a page is left alone: a later write filled it (a forget can come late, queued
        behind that write)."""
        g = self._group(group)
        sl, _ = self._check_slots(g, slots)
        if not len(sl):
            return
        with g.lock:
            g.reserve(int(sl.max()) + 1)
            self._discard(g, sl[~g.live[sl]], reason, live=False)

    def free(self, group: int, slots: Iterable[int]) -> None:
        """Forget the pages in ``slots``. Free records are needed only for pages the journal names;
        they are journaled with the group's next commit (``flush``, ``close``, the committer) and
        always before a freed slot is written again. Freeing a slot that ``read``/``verify_all``
        already discarded is accepted (a no-op)."""
        g = self._group(group)
        sl, order = self._check_slots(g, slots)
        if not len(sl):
            return
        with g.lock:
            if self._closed:
                raise StoreClosedError("disk tier is closed")
            g.reserve(int(sl[order[-1]]) + 1)
            unknown = flags_first_neither(g.live, g.forgotten, sl)
            if unknown >= 0:
                raise UsageError(f"slot {int(sl[unknown])} of disk group {g.index} holds no page (freed twice?)")
            freed = flags_select(g.live, sl, True)
            if len(freed):
                self._unlive(g, freed)
            flags_set(g.forgotten, sl, False)
            flush = g.n_pending >= PENDING_FREE_FLUSH and g.broken is None
        if flush:
            try:
                self._commit(g)
            except OSError as e:   # stays pending; a later append retries
                log.warning("disk tier: journaling frees of group %d failed: %s", g.index, e)

    def flush(self) -> None:
        """Make everything written or freed so far durable (journaled and synced)."""
        if self._closed:
            raise StoreClosedError("disk tier is closed")
        for g in self.groups:
            self._usable(g)
            self._commit(g)
            with g.journal_lock:                # frees an append under way took: durable, or pending again
                pass
            with g.lock:
                again = bool(g.queued or g.n_pending)
            if again:
                self._commit(g)
            self._usable(g)

    def checkpoint(self, group: int | None = None) -> None:
        """Rewrite the journal(s) as a snapshot of the live records."""
        targets = [self._group(group)] if group is not None else list(self.groups)
        if self._closed:
            raise StoreClosedError("disk tier is closed")
        for g in targets:
            with g.commit_lock, g.journal_lock, g.lock:
                self._usable(g)
                try:
                    self._checkpoint_locked(g)
                except OSError as e:
                    raise typed_error(e, f"compacting {g.journal_path}") from e

    # ---- introspection / testing ----

    def inject_fault(self, op: str, err: int, count: int = 1) -> None:
        """Make the next ``count`` ``op`` calls fail with OSError(err) at the I/O point: "write" (a
        write's data), "read", "sync" (a commit's sync of written data) or "journal" (an append)."""
        if op not in ("write", "read", "sync", "journal"):
            raise UsageError(f"inject_fault: op must be 'write', 'read', 'sync' or 'journal', got {op!r}")
        with self._stats_lock:
            self._faults.setdefault(op, []).extend([err] * count)

    def record(self, group: int, slot: int) -> PageRecord | None:
        g = self._group(group)
        with g.lock:
            if not isinstance(slot, int) or not 0 <= slot < len(g.live) or not g.live[slot]:
                return None
            return journal.decode(g.meta[slot])

    def live_slots(self, group: int) -> list[int]:
        g = self._group(group)
        with g.lock:
            return np.flatnonzero(g.live).tolist()

    def recovered_records(self, chunk: int = 1 << 16) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(group per record, ``RECORD`` array) chunks of every live page, in write order: what
        the store rebuilds its index from after open. Chunks keep each temporary a few MiB:
        freeing a large array holds the GIL for milliseconds."""
        slots, gens = [], []
        for g in self.groups:
            with g.lock:
                idx = flatnonzero(g.live)
                slots.append(idx)
                gens.append(g.meta["gen"][idx])
                del idx
        if not self.groups:
            return
        ends = np.cumsum([len(s) for s in slots])          # group k's entries end at ends[k]
        # the large arrays' pages go back without the GIL before they are freed (drop_arrays): a
        # free of millions of entries under the GIL stalled the event loop for milliseconds
        slot = np.concatenate(slots)
        gen = [np.concatenate(gens)]            # held by the list alone: dropped after the sort
        order = np.argsort(gen[0], kind="stable")
        for arrays in (gen, slots, gens):
            drop_arrays(arrays)
        part = None
        for a in range(0, len(order), chunk):
            part = order[a:a + chunk]
            gs = np.searchsorted(ends, part, side="right").astype(np.int32)     # groups[k].index == k
            ss = slot[part]
            out = np.empty(len(part), dtype=RECORD)
            for g in self.groups:
                mine = gs == g.index
                if mine.any():
                    with g.lock:
                        journal.put(out, mine, journal.take(g.meta, ss[mine]))
            yield gs, out
        del part                # a view of order
        big = [order, slot]
        del order, slot
        drop_arrays(big)

    @property
    def recovered(self) -> list[RecoveredPage]:
        """The live pages as Python records, in write order (tests and tools; the store uses
        ``recovered_records``)."""
        return [RecoveredPage(int(g), int(r["slot"]), journal.decode(r), int(r["gen"]))
                for groups, recs in self.recovered_records() for g, r in zip(groups, recs)]

    def stride(self, group: int) -> int:
        return self._group(group).stride

    def segment_path(self, group: int) -> str:
        return self.groups[group].seg_path

    def journal_path(self, group: int) -> str:
        return self.groups[group].journal_path

    def journal_size(self, group: int) -> int:
        return self.groups[group].journal_size

    @property
    def stats(self) -> dict:
        with self._stats_lock:
            return dict(self._stats)

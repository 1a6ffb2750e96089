"""Group commit in the disk tier: ``write(durable=False)`` returns once the bytes are written, and the
tier's committer thread journals them, many writes per sync.

What must hold, whatever the timing:
- a deferred page reads back bit-exact at once, and frees, rewrites and relabels of it work before it is
  journaled;
- what ``flush()`` (or ``close()``) returned from is in the journal;
- a crash at any moment (a "crash image": the tier's files copied while it runs, no flush) reopens with
  nothing discarded, and every page it serves has the bytes its record names;
- a failed sync or journal append is typed, and loses only what was not journaled yet.

Page bytes are a function of a "content key" kept in each record's ``parent``, so that a relabel (a new
key for the same bytes) can be checked too.
"""
from __future__ import annotations

import errno
import os
import shutil
import threading
import time

import numpy as np
import pytest
import torch

from tiers.disk import DiskTier, PageRecord
from tiers.errors import TierIOError, UsageError

FP = {"test": "group-commit"}
GROUPS = [(4096, 512), (1000, 256)]


def page_bytes(key: int, width: int) -> np.ndarray:
    return np.random.default_rng(key).integers(0, 256, width, dtype=np.uint8)


def rec(key: int, content: int, group: int) -> PageRecord:
    return PageRecord(key=key, parent=content, depth=key % 100, life_cycle=group)


def write(tier: DiskTier, g: int, slots: list[int], keys: list[int], durable: bool = False) -> None:
    width = GROUPS[g][0]
    rows = torch.from_numpy(np.stack([page_bytes(k, width) for k in keys]))
    tier.write(g, slots, rows, [rec(k, k, g) for k in keys], durable=durable)


def read(tier: DiskTier, g: int, slots: list[int]) -> torch.Tensor:
    out = torch.empty((len(slots), GROUPS[g][0]), dtype=torch.uint8)
    tier.read(g, slots, out)
    return out


def check_exact(tier: DiskTier) -> dict[tuple[int, int], tuple[int, int]]:
    """Every page the tier holds reads back the bytes of its content key; returns
    (group, slot) -> (key, content)."""
    got = {(p.group, p.slot): (p.record.key, p.record.parent) for p in tier.recovered}
    for g in range(len(GROUPS)):
        slots = sorted(s for gg, s in got if gg == g)
        if slots:
            out = read(tier, g, slots)
            for i, s in enumerate(slots):
                assert np.array_equal(out[i].numpy(), page_bytes(got[g, s][1], GROUPS[g][0])), (g, s)
    return got


def reopen_image(src: str, dest) -> dict[tuple[int, int], tuple[int, int]]:
    """What a crash now leaves: the files copied as they are (no flush), reopened and checked."""
    shutil.copytree(src, dest)
    tier = DiskTier.open(str(dest), FP, GROUPS)
    try:
        assert tier.discarded == [], tier.discarded
        assert all(r.endswith("bytes dropped") for _, _, r in tier.journal_errors), tier.journal_errors  # a torn tail
        return check_exact(tier)
    finally:
        tier.close()


def wait_for(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.002)


def test_deferred_pages_read_back_at_once_and_flush_journals_them(tmp_path):
    tier = DiskTier.open(str(tmp_path / "d"), FP, GROUPS)
    try:
        write(tier, 0, list(range(64)), list(range(1000, 1064)))
        write(tier, 1, [5, 7], [7, 9])
        out = read(tier, 0, list(range(64)))          # before any commit could have run
        assert all(np.array_equal(out[i].numpy(), page_bytes(1000 + i, 4096)) for i in range(64))
        tier.flush()
        assert tier.stats["commits"] >= 1
        got = reopen_image(tier.path, tmp_path / "img")
        assert got == {**{(0, s): (1000 + s, 1000 + s) for s in range(64)}, (1, 5): (7, 7), (1, 7): (9, 9)}
    finally:
        tier.close()


def test_free_rewrite_and_relabel_before_the_commit(tmp_path):
    tier = DiskTier.open(str(tmp_path / "d"), FP, GROUPS)
    try:
        write(tier, 0, [0, 1, 2, 3], [10, 11, 12, 13], durable=True)     # journaled
        tier.free(0, [0, 1])                        # frees of journaled pages: pending free records
        write(tier, 0, [0, 4], [20, 24])            # slot 0 again: its free goes to the journal first
        tier.free(0, [4])                           # a queued page freed: never journaled at all
        write(tier, 0, [4], [34])
        tier.relabel(0, [2, 0], [rec(42, 12, 0), rec(40, 20, 0)], durable=False)   # one journaled, one queued
        got = reopen_image(tier.path, tmp_path / "img1")        # whatever was journaled so far is right
        assert got.get((0, 1)) in (None, (11, 11))              # a free may come back, with its bytes
        tier.flush()
        want = {(0, 0): (40, 20), (0, 2): (42, 12), (0, 3): (13, 13), (0, 4): (34, 34)}
        assert check_exact(tier) == want
        assert reopen_image(tier.path, tmp_path / "img2") == want
    finally:
        tier.close()
    tier = DiskTier.open(str(tmp_path / "d"), FP, GROUPS)
    try:
        assert check_exact(tier) == want and tier.discarded == []
    finally:
        tier.close()


def test_crash_images_taken_while_the_committer_runs(tmp_path):
    """A seeded workload of deferred writes (often into slots just freed), frees and relabels, with
    crash images taken at random moments: each reopens clean, serves only right bytes, and holds
    everything flushed before it (less what was freed since)."""
    rng = np.random.default_rng(7)
    tier = DiskTier.open(str(tmp_path / "d"), FP, GROUPS)
    tier.checkpoint_floor = 1 << 40     # a copy of the directory is not atomic across a compaction's rename
    live: list[dict[int, tuple[int, int]]] = [{}, {}]
    flushed: dict[tuple[int, int], tuple[int, int]] = {}
    key = 1
    images = 0
    try:
        for step in range(900):
            g = int(rng.integers(0, 2))
            n_slots = GROUPS[g][1]
            r = rng.random()
            if live[g] and (r < 0.3 or len(live[g]) > n_slots - 40):
                victims = [int(s) for s in rng.choice(sorted(live[g]), size=min(len(live[g]), int(rng.integers(1, 30))),
                                                    replace=False)]
                tier.free(g, victims)
                for s in victims:
                    del live[g][s]
                    flushed.pop((g, s), None)
            elif live[g] and r < 0.38:
                slots = [int(s) for s in rng.choice(sorted(live[g]), size=min(len(live[g]), 5), replace=False)]
                recs = [rec(key + i, live[g][s][1], g) for i, s in enumerate(slots)]
                tier.relabel(g, slots, recs, durable=False)
                for i, s in enumerate(slots):
                    live[g][s] = (key + i, live[g][s][1])
                key += len(slots)
            else:
                free = [s for s in range(n_slots) if s not in live[g]]
                slots = [int(s) for s in rng.choice(free, size=int(rng.integers(1, 40)), replace=False)]
                keys = list(range(key, key + len(slots)))
                key += len(slots)
                write(tier, g, slots, keys)
                live[g].update({s: (k, k) for s, k in zip(slots, keys)})
            if step % 97 == 50:
                tier.flush()
                flushed = {(gg, s): v for gg in range(2) for s, v in live[gg].items()}
            if step % 61 == 30:
                got = reopen_image(tier.path, tmp_path / f"img{images}")
                images += 1
                for where, v in flushed.items():        # relabels since the flush may or may not be in
                    assert where in got and got[where][1] == v[1], (where, v, got.get(where))
        tier.flush()
        want = {(gg, s): v for gg in range(2) for s, v in live[gg].items()}
        assert reopen_image(tier.path, tmp_path / "final") == want
        assert tier.stats["commits"] < 700       # several writes per commit some of the time
    finally:
        tier.close()
    assert images >= 14


def test_a_failed_sync_breaks_the_group_and_loses_only_what_it_had_not_journaled(tmp_path):
    tier = DiskTier.open(str(tmp_path / "d"), FP, GROUPS)
    try:
        write(tier, 0, [0, 1], [1, 2], durable=True)
        tier.inject_fault("sync", errno.EIO)
        write(tier, 0, [2, 3], [3, 4])                  # the committer's sync fails
        wait_for(lambda: tier.stats["commit_failures"] == 1)
        with pytest.raises(TierIOError, match="syncing the segment failed"):
            write(tier, 0, [4], [5])
        with pytest.raises(TierIOError):
            tier.flush()
        write(tier, 1, [0], [6], durable=True)          # other groups go on
    finally:
        tier.close()
    tier = DiskTier.open(str(tmp_path / "d"), FP, GROUPS)
    try:
        assert check_exact(tier) == {(0, 0): (1, 1), (0, 1): (2, 2), (1, 0): (6, 6)}
        assert tier.discarded == []
    finally:
        tier.close()


def test_a_failed_journal_append_keeps_the_records_for_the_next_commit(tmp_path):
    tier = DiskTier.open(str(tmp_path / "d"), FP, GROUPS)
    try:
        tier.inject_fault("journal", errno.EIO)
        write(tier, 0, [0, 1], [1, 2])
        wait_for(lambda: tier.stats["commit_failures"] == 1)
        assert np.array_equal(read(tier, 0, [1])[0].numpy(), page_bytes(2, 4096))
        tier.flush()                                    # the next commit journals them
        assert reopen_image(tier.path, tmp_path / "img") == {(0, 0): (1, 1), (0, 1): (2, 2)}
    finally:
        tier.close()


def test_a_durable_write_failing_at_its_commit_leaves_its_slots_free(tmp_path):
    tier = DiskTier.open(str(tmp_path / "d"), FP, GROUPS)
    try:
        write(tier, 1, [0], [1], durable=True)
        tier.inject_fault("journal", errno.EIO)
        with pytest.raises(TierIOError):
            write(tier, 1, [3, 4], [3, 4], durable=True)
        with pytest.raises(UsageError):                  # as before the call: no page there ...
            read(tier, 1, [3])
        g = tier.groups[1]                               # ... and no free record owed for it
        assert not g.journaled[[3, 4]].any() and not g.pending[[3, 4]].any() and g.n_pending == 0
        write(tier, 1, [3], [30], durable=True)          # and the slot takes a page again
    finally:
        tier.close()
    tier = DiskTier.open(str(tmp_path / "d"), FP, GROUPS)
    try:
        assert check_exact(tier) == {(1, 0): (1, 1), (1, 3): (30, 30)} and tier.discarded == []
    finally:
        tier.close()


def test_threads_writing_freeing_and_reading_then_close_keeps_exactly_the_last_state(tmp_path):
    tier = DiskTier.open(str(tmp_path / "d"), FP, GROUPS)
    n_threads = 4
    states: list[dict[int, int]] = [{} for _ in range(n_threads)]
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        rng = np.random.default_rng(100 + t)
        mine = list(range(t, GROUPS[0][1], n_threads))         # disjoint slots per thread
        live = states[t]
        key = 1_000_000 * (t + 1)
        try:
            for _ in range(150):
                free = [s for s in mine if s not in live]
                if live and (rng.random() < 0.35 or len(free) < 10):
                    victims = [int(s) for s in rng.choice(sorted(live), size=min(len(live), 8), replace=False)]
                    tier.free(0, victims)
                    for s in victims:
                        del live[s]
                else:
                    slots = [int(s) for s in rng.choice(free, size=int(rng.integers(1, 10)), replace=False)]
                    keys = list(range(key, key + len(slots)))
                    key += len(slots)
                    write(tier, 0, slots, keys, durable=bool(rng.random() < 0.1))
                    live.update(zip(slots, keys))
                if live and rng.random() < 0.3:
                    s = int(rng.choice(sorted(live)))
                    assert np.array_equal(read(tier, 0, [s])[0].numpy(), page_bytes(live[s], 4096))
        except BaseException as e:      # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    tier.close()
    assert errors == []
    want = {(0, s): (k, k) for st in states for s, k in st.items()}
    tier = DiskTier.open(str(tmp_path / "d"), FP, GROUPS)
    try:
        assert check_exact(tier) == want and tier.discarded == []
    finally:
        tier.close()


def test_close_journals_what_is_queued(tmp_path):
    tier = DiskTier.open(str(tmp_path / "d"), FP, GROUPS)
    write(tier, 0, list(range(100)), list(range(100)))
    tier.free(0, [3])
    tier.close()
    tier = DiskTier.open(str(tmp_path / "d"), FP, GROUPS)
    try:
        assert check_exact(tier) == {(0, s): (s, s) for s in range(100) if s != 3}
    finally:
        tier.close()
    assert not [t for t in threading.enumerate() if t.name == "kvtier-disk-commit"]


def test_bad_fault_name_is_a_usage_error(tmp_path):
    with DiskTier.open(str(tmp_path / "d"), FP, GROUPS) as tier:
        with pytest.raises(UsageError, match="'sync'"):
            tier.inject_fault("fsync", errno.EIO)
    assert not os.path.exists(os.path.join(str(tmp_path / "d"), "group-0.journal.tmp"))


# ---- the order of syncs: what crash images and SIGKILL cannot see (the page cache survives them) ----

class SyncLog:
    """Every data write, sync and journal append the tier makes, in the order they happen (a data
    write logged when it is done, a sync when it starts), so that a test can check the order a
    power cut would need: a journal record only after a sync of the segment that began after its
    page's bytes were written."""

    def __init__(self, monkeypatch, tier: DiskTier) -> None:
        from tiers import disk as disk_mod
        self.events: list[tuple] = []
        self.lock = threading.Lock()
        self.seg = {g.seg_fd for g in tier.groups}
        self.seg_of = {g.journal_path: g.seg_fd for g in tier.groups}
        real_rows, real_all, real_sync, real_replace = (disk_mod.pwrite_rows, disk_mod.pwrite_all, os.fdatasync,
                                                        os.replace)

        def pwrite_rows(fd, rows, index, offsets, stride, hashes=None, sync=False):
            out = real_rows(fd, rows, index, offsets, stride, hashes, False)
            self.log("data", fd, (np.asarray(offsets) // stride).tolist())
            if sync:
                self.log("sync", fd)
                real_sync(fd)
            return out

        def pwrite_all(fd, data, offset, sync):
            self.log("append", fd, bytes(data))
            real_all(fd, data, offset, False)
            if sync:
                real_sync(fd)

        def fdatasync(fd):
            self.log("sync", fd)
            real_sync(fd)

        def replace(src, dst):
            self.log("replace", dst, _snapshot_slots(src) if dst in self.seg_of else [])
            real_replace(src, dst)
        monkeypatch.setattr(disk_mod, "pwrite_rows", pwrite_rows)
        monkeypatch.setattr(disk_mod, "pwrite_all", pwrite_all)
        monkeypatch.setattr(os, "fdatasync", fdatasync)
        monkeypatch.setattr(os, "replace", replace)

    def log(self, *event) -> None:
        with self.lock:
            self.events.append(event)

    def check(self) -> tuple[int, int]:
        """Assert the order; returns (records checked, compactions checked)."""
        from tiers.journal import FRAME, RECORD, WRITE
        written: dict[tuple[int, int], int] = {}     # (seg fd, slot) -> index of its last data write
        synced: dict[int, int] = {}                  # seg fd -> index of its last sync's start
        n_records = n_replaced = 0
        for i, ev in enumerate(self.events):
            if ev[0] == "data":
                for s in ev[2]:
                    written[ev[1], s] = i
            elif ev[0] == "sync" and ev[1] in self.seg:
                synced[ev[1]] = i
            elif ev[0] == "append":
                recs = np.frombuffer(ev[2][FRAME.size:], dtype=RECORD)
                for r in recs[recs["kind"] == WRITE]:
                    fds = [fd for fd in self.seg if (fd, int(r["slot"])) in written]
                    assert fds, f"a record for slot {int(r['slot'])}, never written"
                    assert any(synced.get(fd, -1) > written[fd, int(r["slot"])] for fd in fds), \
                        f"slot {int(r['slot'])}'s record appended before a sync of its bytes (event {i})"
                    n_records += 1
            elif ev[0] == "replace" and ev[1] in self.seg_of:
                fd = self.seg_of[ev[1]]             # a compaction: every page its snapshot names
                for s in ev[2]:
                    assert synced.get(fd, -1) > written[fd, s], \
                        f"a compaction names slot {s} before a sync of its bytes (event {i})"
                n_replaced += 1
        return n_records, n_replaced


def _snapshot_slots(path: str) -> list[int]:
    """The slots a compacted journal (not yet renamed into place) names."""
    from tiers.journal import FRAME, RECORD, RECORDS_MAGIC
    with open(path, "rb") as f:
        data = f.read()
    slots, off = [], 0
    while off + FRAME.size <= len(data):
        magic, length, _ = FRAME.unpack_from(data, off)
        if magic == RECORDS_MAGIC:
            slots += np.frombuffer(data, RECORD, length // RECORD.itemsize, off + FRAME.size)["slot"].tolist()
        off += FRAME.size + length
    return slots


def test_every_record_reaches_the_journal_after_a_sync_of_its_bytes(tmp_path, monkeypatch):
    tier = DiskTier.open(str(tmp_path / "d"), FP, GROUPS, o_direct="off")
    tier.checkpoint_floor = 16 << 10            # compactions happen too
    synclog = SyncLog(monkeypatch, tier)
    rng = np.random.default_rng(3)
    live: dict[int, int] = {}
    key = 1
    try:
        for step in range(300):
            free = [s for s in range(GROUPS[0][1]) if s not in live]
            if live and (rng.random() < 0.3 or len(free) < 40):
                victims = [int(s) for s in rng.choice(sorted(live), size=min(len(live), 20), replace=False)]
                tier.free(0, victims)
                for s in victims:
                    del live[s]
            elif live and rng.random() < 0.1:
                s = int(rng.choice(sorted(live)))
                tier.relabel(0, [s], [rec(key, live[s], 0)], durable=False)
                key += 1
            else:
                slots = [int(s) for s in rng.choice(free, size=int(rng.integers(1, 30)), replace=False)]
                write(tier, 0, slots, list(range(key, key + len(slots))), durable=bool(rng.random() < 0.1))
                live.update({s: key + i for i, s in enumerate(slots)})
                key += len(slots)
            if step % 50 == 49:
                tier.flush()
            if step == 150:
                tier.checkpoint(0)
    finally:
        tier.close()
    n_records, n_replaced = synclog.check()
    assert n_records > 500 and n_replaced >= 2


# ---- failures of the committer: reported, retried, survived ----

def test_a_failed_background_commit_is_retried_without_more_writes(tmp_path):
    tier = DiskTier.open(str(tmp_path / "d"), FP, GROUPS)
    try:
        tier.inject_fault("journal", errno.EIO)
        write(tier, 0, [0, 1, 2, 3], [1, 2, 3, 4])
        wait_for(lambda: tier.stats["commits"] >= 1)         # the retry, with nothing else happening
        assert tier.stats["commit_failures"] == 1
        assert reopen_image(tier.path, tmp_path / "img") == {(0, s): (s + 1, s + 1) for s in range(4)}
    finally:
        tier.close()


def test_a_journal_that_stays_full_stops_the_next_write_with_disk_full(tmp_path):
    from tiers.errors import DiskFullError
    tier = DiskTier.open(str(tmp_path / "d"), FP, GROUPS)
    try:
        tier.inject_fault("journal", errno.ENOSPC, count=10**6)
        write(tier, 0, [0, 1], [1, 2])                      # written; its commit fails in the background
        wait_for(lambda: tier.groups[0].commit_failed)
        with pytest.raises(DiskFullError):                  # reported to the next write, which adds nothing
            write(tier, 0, [5], [6])
        with pytest.raises(UsageError):
            read(tier, 0, [5])
        with tier._stats_lock:
            tier._faults.pop("journal")                     # room again: a retry succeeds
        wait_for(lambda: tier.stats["commits"] >= 1, timeout=15)
        write(tier, 0, [5], [6])
        tier.flush()
        assert reopen_image(tier.path, tmp_path / "img") == {(0, 0): (1, 1), (0, 1): (2, 2), (0, 5): (6, 6)}
    finally:
        tier.close()


def test_the_committer_outlives_an_unexpected_error(tmp_path, monkeypatch):
    tier = DiskTier.open(str(tmp_path / "d"), FP, GROUPS)
    real = DiskTier._maybe_checkpoint
    calls = []

    def once(self, g):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("simulated")
        return real(self, g)
    monkeypatch.setattr(DiskTier, "_maybe_checkpoint", once)
    try:
        write(tier, 0, [0], [1])
        wait_for(lambda: len(calls) >= 1)
        write(tier, 0, [1], [2])
        wait_for(lambda: len(calls) >= 2)
        assert tier._committer.thread.is_alive()
        tier.flush()
        assert reopen_image(tier.path, tmp_path / "img") == {(0, 0): (1, 1), (0, 1): (2, 2)}
    finally:
        tier.close()


def test_a_failed_durable_relabel_keeps_the_old_records(tmp_path):
    tier = DiskTier.open(str(tmp_path / "d"), FP, GROUPS)
    try:
        write(tier, 0, [0], [1], durable=True)
        tier.inject_fault("journal", errno.EIO)
        with pytest.raises(TierIOError):
            tier.relabel(0, [0], [rec(99, 1, 0)])
        assert tier.record(0, 0).key == 1
        assert np.array_equal(read(tier, 0, [0])[0].numpy(), page_bytes(1, 4096))   # its checksum still fits
    finally:
        tier.close()
    tier = DiskTier.open(str(tmp_path / "d"), FP, GROUPS)
    try:
        assert check_exact(tier) == {(0, 0): (1, 1)}
    finally:
        tier.close()


def test_durable_must_be_a_bool(tmp_path):
    with DiskTier.open(str(tmp_path / "d"), FP, GROUPS) as tier:
        with pytest.raises(UsageError, match="durable"):
            write(tier, 0, [0], [1], durable=None)
        with pytest.raises(UsageError, match="durable"):
            tier.relabel(0, [0], [rec(2, 1, 0)], durable="no")
        assert tier.live_slots(0) == []


def test_a_tier_nobody_closed_lets_its_committer_go(tmp_path):
    import gc
    tier = DiskTier.open(str(tmp_path / "d"), FP, GROUPS)
    write(tier, 0, [0], [1])
    tier.flush()
    thread = tier._committer.thread
    assert thread.is_alive()
    tier._release_fds()                 # what close() would release; the tier itself is just dropped
    del tier
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


def test_a_failed_durable_relabel_of_a_page_not_yet_journaled_loses_nothing(tmp_path):
    """The relabel's commit takes the page's queued write too (left out as superseded); when the
    append fails and the relabel rolls back, that write must still reach the journal."""
    tier = DiskTier.open(str(tmp_path / "d"), FP, GROUPS)
    try:
        write(tier, 0, [0], [1])                                # deferred
        tier.inject_fault("journal", errno.EIO, count=3)
        with pytest.raises(TierIOError):
            tier.relabel(0, [0], [rec(99, 1, 0)])
        assert tier.record(0, 0).key == 1
        with tier._stats_lock:
            tier._faults.pop("journal", None)
        tier.flush()
        assert reopen_image(tier.path, tmp_path / "img") == {(0, 0): (1, 1)}
    finally:
        tier.close()


def test_a_failed_append_keeps_pending_frees_named_by_the_journal(tmp_path, monkeypatch):
    """A page freed while its commit's append is under way needs a free record if that append
    succeeds; if it fails the flag that says so must stay (pending implies journaled)."""
    tier = DiskTier.open(str(tmp_path / "d"), FP, GROUPS)
    g = tier.groups[0]
    real = DiskTier._append
    state = {"armed": True}

    def freeing_then_failing(self, group, *records):
        if state["armed"] and any(len(r) and (r["slot"] == 0).any() for r in records):
            state["armed"] = False
            tier.free(0, [0])                                   # from another thread in real life
            raise OSError(errno.EIO, "simulated append failure")
        return real(self, group, *records)
    monkeypatch.setattr(DiskTier, "_append", freeing_then_failing)
    monkeypatch.setattr(DiskTier, "_commit_soon", lambda self, g: None)    # flush alone commits
    try:
        write(tier, 0, [0, 1], [1, 2])
        with pytest.raises(OSError, match="simulated"):
            tier.flush()
        assert g.pending[0] and g.journaled[0]
        assert not (g.pending & ~g.journaled).any() and not (g.live & g.pending).any()
        tier.flush()
        write(tier, 0, [0], [3])
        tier.flush()
        assert reopen_image(tier.path, tmp_path / "img") == {(0, 0): (3, 3), (0, 1): (2, 2)}
    finally:
        tier.close()


def test_flush_waits_for_an_append_of_frees_under_way(tmp_path, monkeypatch):
    """A write's step 1 holds the journal lock while it appends the frees it took; a flush that
    ran meanwhile must not return before they are durable (or raise if they could not be)."""
    tier = DiskTier.open(str(tmp_path / "d"), FP, GROUPS)
    g = tier.groups[0]
    try:
        write(tier, 0, [5], [1], durable=True)
        tier.free(0, [5])                                       # a pending free record
        inside = threading.Event()
        real = DiskTier._append
        calls = []

        def slow_failing(self, group, *records):
            calls.append(1)
            if len(calls) == 1:
                inside.set()
                time.sleep(0.3)
                raise OSError(errno.EIO, "simulated append failure")
            return real(self, group, *records)
        monkeypatch.setattr(DiskTier, "_append", slow_failing)
        errors = []

        def writer() -> None:
            try:
                write(tier, 0, [5], [2])
            except OSError as e:
                errors.append(e)
        th = threading.Thread(target=writer)
        th.start()
        inside.wait(5)
        tier.flush()                                            # its own commit journals the free
        th.join()
        assert len(errors) == 1 and g.n_pending == 0 and not g.pending[5]
    finally:
        tier.close()


def test_an_idle_commit_reports_a_directory_sync_failure_typed(tmp_path, monkeypatch):
    from tiers import disk as disk_mod
    tier = DiskTier.open(str(tmp_path / "d"), FP, GROUPS)
    try:
        tier.groups[0].dir_unsynced = True                      # as a compaction whose dir sync failed leaves it

        def failing(path):
            raise OSError(errno.EIO, "simulated")
        monkeypatch.setattr(disk_mod, "fsync_dir", failing)
        with pytest.raises(TierIOError):
            tier.flush()
        monkeypatch.undo()
        tier.flush()
        assert not tier.groups[0].dir_unsynced
    finally:
        tier.close()

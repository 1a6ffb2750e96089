"""The disk tier against real files: round trips, reuse, corruption, faults, quota, lock, layout, compaction.

A "crash image" is taken by copying the files of a tier that is still open after ``flush()``: that is
exactly what a crash at that point leaves on disk (everything is already written). The SIGKILL test in
test_disk_crash.py covers a real process death.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import threading

import numpy as np
import pytest
import torch

from tiers.disk import DiskTier, PageRecord, RecoveredPage
from tiers.errors import ConfigError, CorruptPageError, DiskFullError, StoreClosedError, TierIOError, UsageError

FP = {"model": "test-model", "tokens_per_block": 32, "life_cycles": [["attention", None, None, "required"]]}
GROUPS = [(4096, 2048), (1000, 1536)]      # an aligned page size and an odd one (padded stride)
# page cache; O_DIRECT writes + page-cache reads where the filesystem takes O_DIRECT; O_DIRECT for both
MODES = ["off", "auto", "on"]


def page_bytes(key: int, width: int) -> np.ndarray:
    return np.random.default_rng(key).integers(0, 256, width, dtype=np.uint8)


def rows_for(keys: list[int], width: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([page_bytes(k, width) for k in keys])) if keys else \
        torch.empty((0, width), dtype=torch.uint8)


def rec(key, depth: int = 0, lc: int = 0, parent=None, priority: int = 35) -> PageRecord:
    return PageRecord(key=key, parent=parent, depth=depth, life_cycle=lc, priority=priority)


def open_tier(path, groups=GROUPS, fp=FP, **kw) -> DiskTier:
    try:
        return DiskTier.open(str(path), fp, groups, **kw)
    except ConfigError as e:
        if kw.get("o_direct") == "on" and e.field == "tiers.disk.o_direct":
            pytest.skip("this filesystem does not take O_DIRECT")
        raise


def read_back(tier: DiskTier, group: int, slots: list[int]) -> torch.Tensor:
    out = torch.empty((len(slots), tier.groups[group].slot_bytes), dtype=torch.uint8)
    tier.read(group, slots, out)
    return out


def crash_image(tier: DiskTier, dest) -> str:
    """What a crash right now leaves on disk: the tier's files, copied while it is still open."""
    tier.flush()
    shutil.copytree(tier.path, dest)
    return str(dest)


def write_keys(tier: DiskTier, group: int, slots: list[int], keys: list[int]) -> None:
    width = tier.groups[group].slot_bytes
    tier.write(group, slots, rows_for(keys, width), [rec(k, depth=k % 7, lc=group) for k in keys])


# ---- round trip ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_roundtrip_thousands_of_pages_two_groups(tmp_path, mode):
    rng = np.random.default_rng(7)
    expected: dict[tuple[int, int], tuple[PageRecord, np.ndarray]] = {}
    tier = open_tier(tmp_path / "d", o_direct=mode)
    assert tier.recovered == [] and tier.discarded == []
    key = 0
    for g, (width, slots) in enumerate(GROUPS):
        order = rng.permutation(slots)[: slots * 3 // 4].tolist()      # scattered, partly adjacent slots
        for a in range(0, len(order), 48):
            batch = order[a:a + 48]
            # a non-contiguous row selection: every other row of a bigger buffer
            big = torch.from_numpy(rng.integers(0, 256, (2 * len(batch), width), dtype=np.uint8))
            rows = big[::2]
            assert not rows.is_contiguous()
            recs = []
            for s in batch:
                key += 1
                k = key if key % 3 else key.to_bytes(16, "little") if key % 2 else key << 80   # ints, bytes, bigints
                parent = None if key % 5 == 0 else (k if isinstance(k, bytes) else k - 1)
                recs.append(rec(k, depth=key % 50, lc=g, parent=parent, priority=key % 101))
            tier.write(g, batch, rows, recs)
            for i, (s, r) in enumerate(zip(batch, recs)):
                expected[(g, s)] = (r, rows[i].numpy().copy())
    st = tier.stats
    assert st["pages_written"] == len(expected)
    assert st["o_direct"] == (mode == "on" or (mode == "auto" and tier.o_direct_supported))
    assert st["o_direct_reads"] == (mode == "on")
    assert st["bytes_written"] == sum(GROUPS[g][0] for g, _ in expected)
    tier.close()
    tier.close()                                                         # idempotent

    tier = open_tier(tmp_path / "d", o_direct=mode)
    try:
        assert tier.discarded == [] and tier.journal_errors == []
        assert len(tier.recovered) == len(expected) > 2500
        assert all(isinstance(p, RecoveredPage) for p in tier.recovered)
        got = {(p.group, p.slot): p.record for p in tier.recovered}
        assert got == {k: v[0] for k, v in expected.items()}
        gens = [p.generation for p in tier.recovered]
        assert gens == sorted(gens) and len(set(gens)) == len(gens)
        for g in range(len(GROUPS)):
            slots = [s for (gg, s) in expected if gg == g]
            rng.shuffle(slots)
            for a in range(0, len(slots), 64):
                part = slots[a:a + 64]
                out = read_back(tier, g, part)
                want = np.stack([expected[(g, s)][1] for s in part])
                assert np.array_equal(out.numpy(), want)
        assert tier.stats["pages_read"] == len(expected)
        assert tier.verify_all() == []
    finally:
        tier.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("aligned", [True, False])
def test_write_takes_scattered_rows_of_a_slab_by_index(tmp_path, mode, aligned):
    """write(..., index=) stores slab[index[i]] in slots[i] with no gathering copy: scattered,
    descending and unsorted rows into unsorted slots, from page-aligned memory (O_DIRECT writes it in
    place) or not (through bounce buffers); every page reads back bit-exact and checks out."""
    import mmap
    n_rows, width = 64, 8192
    keep = mmap.mmap(-1, (n_rows + 1) * width)
    flat = np.frombuffer(keep, dtype=np.uint8)
    start = 0 if aligned else 64                  # a slab whose rows are off the page boundary
    slab = torch.from_numpy(flat[start:start + n_rows * width].reshape(n_rows, width))
    slab.copy_(rows_for(list(range(1000, 1000 + n_rows)), width))
    rng = np.random.default_rng(7)
    index = rng.permutation(n_rows)[:40]          # 40 rows, in no order (one of them twice)
    index[7] = index[30]
    slots = rng.permutation(256)[:40].tolist()    # to 40 distinct slots, in no order
    tier = open_tier(tmp_path / "d", groups=[(width, 256)], o_direct=mode)
    try:
        tier.write(0, slots, slab, [rec(1000 + int(r)) for r in index], index=index)
        out = torch.zeros((40, width), dtype=torch.uint8)
        tier.read(0, slots, out)
        assert torch.equal(out, slab[torch.from_numpy(index)])
        assert tier.verify_all() == []
        free = [s for s in range(256) if s not in slots][:2]
        for bad, what in (([0, n_rows], "outside"), ([-1, 0], "outside"), ([0.5, 1.0], "integer"),
                          ([True, False], "integer"), ([0, 1, 2], "integer row numbers")):
            with pytest.raises(UsageError, match=what):
                tier.write(0, free, slab, [rec(1), rec(2)], index=np.asarray(bad))
        with pytest.raises(UsageError, match="2-D"):
            tier.write(0, free, slab[0], [rec(1), rec(2)], index=[0, 1])
        tier.write(0, [], slab, [], index=[])     # an empty batch is a no-op, with or without rows
        assert sorted(tier.live_slots(0)) == sorted(slots)     # the refused writes took no slot
    finally:
        tier.close()
    del slab, flat


@pytest.mark.parametrize("mode", MODES)
def test_page_aligned_host_buffers(tmp_path, mode):
    """Pinned host slabs are page-aligned: O_DIRECT then reads and writes them in place (no bounce)."""
    import mmap
    n, width = 96, 8192
    src_mm = mmap.mmap(-1, n * width)
    src = torch.from_numpy(np.frombuffer(src_mm, dtype=np.uint8).reshape(n, width))
    src.copy_(rows_for(list(range(n)), width))
    dst_mm = mmap.mmap(-1, n * width)
    dst = torch.from_numpy(np.frombuffer(dst_mm, dtype=np.uint8).reshape(n, width))
    tier = open_tier(tmp_path / "d", groups=[(width, 256)], o_direct=mode)
    try:
        slots = list(range(100, 196))
        tier.write(0, slots, src, [rec(k) for k in range(n)])
        tier.read(0, slots[::-1], dst)
        assert torch.equal(dst, src.flip(0))
        tier.read(0, slots[10:20], dst[:10])
        assert torch.equal(dst[:10], src[10:20])
    finally:
        tier.close()
    del src, dst


def test_segment_layout_and_quota(tmp_path):
    tier = open_tier(tmp_path / "d")
    try:
        for g, (width, slots) in enumerate(GROUPS):
            stride = tier.stride(g)
            assert stride % 4096 == 0 and stride >= width
            with pytest.raises(UsageError):
                write_keys(tier, g, [slots], [1])
            with pytest.raises(UsageError):
                write_keys(tier, g, [-1], [1])
            with pytest.raises(UsageError):
                read_back(tier, g, [slots])
            with pytest.raises(UsageError):
                tier.free(g, [slots + 5])
            write_keys(tier, g, [0], [10 + g])
            size0 = os.path.getsize(tier.segment_path(g))
            # grown in preallocated steps: more than the one page, never past the quota
            assert stride < size0 <= slots * stride
            write_keys(tier, g, [slots - 1], [20 + g])
            assert os.path.getsize(tier.segment_path(g)) == slots * stride
            write_keys(tier, g, list(range(1, 200)), list(range(1000, 1199)))
            assert os.path.getsize(tier.segment_path(g)) == slots * stride
            assert np.array_equal(read_back(tier, g, [slots - 1, 0])[0].numpy(), page_bytes(20 + g, width))
        with pytest.raises(UsageError):
            tier.write(0, [5], torch.zeros((1, 100), dtype=torch.uint8), [rec(1)])       # wrong width
        with pytest.raises(UsageError):
            tier.write(0, [300, 300], rows_for([1, 2], 4096), [rec(1), rec(2)])       # duplicate slot
        with pytest.raises(UsageError):
            tier.write(0, [300], rows_for([1], 4096), [rec(1.5)])                      # bad key type
        with pytest.raises(UsageError):
            tier.write(5, [0], rows_for([1], 4096), [rec(1)])                          # no such group
        with pytest.raises(UsageError):
            tier.read(0, [0], torch.empty((2, 4096), dtype=torch.uint8))               # wrong shape
    finally:
        tier.close()


# ---- free and reuse -----------------------------------------------------------------------------

def test_free_and_reuse_last_write_wins(tmp_path):
    tier = open_tier(tmp_path / "d")
    write_keys(tier, 0, list(range(10)), list(range(100, 110)))
    with pytest.raises(UsageError, match="free it first"):
        write_keys(tier, 0, [4], [999])
    tier.free(0, [3, 4, 7])
    with pytest.raises(UsageError):
        tier.free(0, [3])                                        # freed twice
    with pytest.raises(UsageError):
        read_back(tier, 0, [3])                                  # no live record
    write_keys(tier, 0, [4], [204])                              # reuse
    tier.free(0, [4])
    write_keys(tier, 0, [4], [304])                              # and again: the last write wins
    write_keys(tier, 1, [3], [403])                              # same slot number in another group is unrelated
    tier.close()

    tier = open_tier(tmp_path / "d")
    try:
        got = {(p.group, p.slot): p.record.key for p in tier.recovered}
        assert got == {**{(0, s): 100 + s for s in (0, 1, 2, 5, 6, 8, 9)}, (0, 4): 304, (1, 3): 403}
        assert np.array_equal(read_back(tier, 0, [4])[0].numpy(), page_bytes(304, 4096))
        # generations keep growing across reopen: a new write beats everything recovered
        top = max(p.generation for p in tier.recovered)
        write_keys(tier, 0, [3], [503])
        img = crash_image(tier, tmp_path / "img")
    finally:
        tier.close()
    tier = open_tier(img)
    try:
        gens = {(p.group, p.slot): p.generation for p in tier.recovered}
        assert gens[(0, 3)] > top
        assert tier.record(0, 3) == rec(503, depth=503 % 7, lc=0)
    finally:
        tier.close()


def test_unflushed_frees_may_come_back_but_never_with_wrong_bytes(tmp_path):
    tier = open_tier(tmp_path / "d")
    try:
        write_keys(tier, 0, list(range(8)), list(range(8)))
        tier.free(0, [1, 2])                                     # pending, not yet journaled
        shutil.copytree(tier.path, tmp_path / "img")            # crash before anything else
        tier.free(0, [3])
        write_keys(tier, 0, [1], [77])                          # reuse: the free of slot 1 goes first
        shutil.copytree(tier.path, tmp_path / "img2")
    finally:
        tier.close()
    for img, want in ((tmp_path / "img", {s: s for s in range(8)}),
                      (tmp_path / "img2", {0: 0, 1: 77, 4: 4, 5: 5, 6: 6, 7: 7})):
        t = open_tier(img)
        try:
            got = {p.slot: p.record.key for p in t.recovered}
            assert got == want
            slots = sorted(got)
            out = read_back(t, 0, slots)
            assert all(np.array_equal(out[i].numpy(), page_bytes(got[s], 4096)) for i, s in enumerate(slots))
        finally:
            t.close()


# ---- corruption ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_flipped_bytes_discarded_at_read(tmp_path, mode, caplog):
    tier = open_tier(tmp_path / "d", o_direct=mode)
    for g, (width, _) in enumerate(GROUPS):
        write_keys(tier, g, list(range(32)), list(range(g * 100, g * 100 + 32)))
    tier.close()
    with open(tmp_path / "d" / "group-0.seg", "r+b") as f:
        f.seek(5 * 4096 + 100)
        b = f.read(1)
        f.seek(5 * 4096 + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    with open(tmp_path / "d" / "group-1.seg", "r+b") as f:       # group 1: stride 4096, page 1000 bytes
        f.seek(9 * 4096 + 999)
        b = f.read(1)
        f.seek(9 * 4096 + 999)
        f.write(bytes([b[0] ^ 0x01]))
        f.seek(10 * 4096 + 1000)                                 # padding after the page: harmless
        f.write(b"\xAA" * 16)

    tier = open_tier(tmp_path / "d", o_direct=mode)
    try:
        assert len(tier.recovered) == 64 and tier.discarded == []    # lazy: found at read
        out = torch.zeros((6, 4096), dtype=torch.uint8)
        slots = [4, 5, 6, 0, 31, 17]
        with caplog.at_level(logging.WARNING, logger="kvtier.disk"):
            with pytest.raises(CorruptPageError) as ei:
                tier.read(0, slots, out)
        assert ei.value.slots == [5]
        assert "checksum" in caplog.text
        for i, s in enumerate(slots):
            if s != 5:
                assert np.array_equal(out[i].numpy(), page_bytes(s, 4096))
        assert tier.discarded == [(0, 5, "checksum mismatch")]
        assert tier.stats["discarded"] == 1
        with pytest.raises(CorruptPageError) as ei:
            read_back(tier, 0, [5])                              # forgotten: named as discarded
        assert ei.value.slots == [5]
        tier.free(0, [5])                                        # the runtime releasing it is fine
        # verify_all finds the other one
        found = tier.verify_all()
        assert found == [(1, 9, "checksum mismatch")]
        assert np.array_equal(read_back(tier, 1, [10])[0].numpy(), page_bytes(110, 1000))
        write_keys(tier, 0, [5], [555])                          # the slot is usable again
    finally:
        tier.close()
    tier = open_tier(tmp_path / "d", o_direct=mode)
    try:
        got = {(p.group, p.slot): p.record.key for p in tier.recovered}
        assert got[(0, 5)] == 555 and (1, 9) not in got and len(got) == 63
        assert tier.verify_all() == []
    finally:
        tier.close()


def test_truncated_segment_discards_pages_past_the_end(tmp_path, caplog):
    tier = open_tier(tmp_path / "d")
    write_keys(tier, 0, list(range(40)), list(range(40)))
    write_keys(tier, 1, list(range(10)), list(range(10)))
    tier.close()
    os.truncate(tmp_path / "d" / "group-0.seg", 25 * 4096 + 10)      # slot 25 is cut short
    with caplog.at_level(logging.WARNING, logger="kvtier.disk"):
        tier = open_tier(tmp_path / "d")
    try:
        assert sorted(p.slot for p in tier.recovered if p.group == 0) == list(range(25))
        assert len([p for p in tier.recovered if p.group == 1]) == 10
        assert sorted(s for g, s, _ in tier.discarded) == list(range(25, 40))
        assert all(g == 0 and "truncated" in why for g, _, why in tier.discarded)
        assert "truncated" in caplog.text
        assert np.array_equal(read_back(tier, 0, [24])[0].numpy(), page_bytes(24, 4096))
        write_keys(tier, 0, [30], [3030])                        # grows the segment again
        assert np.array_equal(read_back(tier, 0, [30])[0].numpy(), page_bytes(3030, 4096))
    finally:
        tier.close()
    tier = open_tier(tmp_path / "d")
    try:
        assert tier.discarded == [] and len(tier.recovered) == 36
    finally:
        tier.close()


def test_deleted_segment_discards_its_pages(tmp_path):
    tier = open_tier(tmp_path / "d")
    write_keys(tier, 0, list(range(12)), list(range(12)))
    write_keys(tier, 1, list(range(5)), list(range(5)))
    tier.close()
    os.unlink(tmp_path / "d" / "group-0.seg")
    tier = open_tier(tmp_path / "d")
    try:
        assert [(p.group, p.slot) for p in tier.recovered] == [(1, s) for s in range(5)]
        assert sorted(tier.discarded) == [(0, s, "segment file missing") for s in range(12)]
        write_keys(tier, 0, [3], [33])
        assert np.array_equal(read_back(tier, 0, [3])[0].numpy(), page_bytes(33, 4096))
    finally:
        tier.close()


def _journal_image(tmp_path) -> tuple[str, list[int]]:
    """A crash image whose group-0 journal is a header and one frame per batch; returns (dir, frame offsets)."""
    tier = open_tier(tmp_path / "src")
    offsets = [tier.journal_size(0)]
    try:
        for b in range(6):
            write_keys(tier, 0, list(range(b * 8, b * 8 + 8)), list(range(b * 8, b * 8 + 8)))
            offsets.append(tier.journal_size(0))
        write_keys(tier, 1, [0, 1], [500, 501])
        img = crash_image(tier, tmp_path / "img")
    finally:
        tier.close()
    return img, offsets


def test_torn_journal_tail_recovers_good_prefix(tmp_path, caplog):
    img, offsets = _journal_image(tmp_path)
    jpath = os.path.join(img, "group-0.journal")
    assert os.path.getsize(jpath) == offsets[-1]
    os.truncate(jpath, offsets[-1] - 7)                         # the last frame is torn mid-record
    with caplog.at_level(logging.WARNING, logger="kvtier.disk"):
        tier = open_tier(img)
    try:
        assert sorted(p.slot for p in tier.recovered if p.group == 0) == list(range(40))
        assert [p.record.key for p in tier.recovered if p.group == 1] == [500, 501]
        assert len(tier.journal_errors) == 1
        g, off, why = tier.journal_errors[0]
        assert (g, off) == (0, offsets[-2]) and "torn" in why
        assert "journal" in caplog.text
        out = read_back(tier, 0, list(range(40)))
        assert all(np.array_equal(out[s].numpy(), page_bytes(s, 4096)) for s in range(40))
        write_keys(tier, 0, [40], [4040])                        # appends after the good prefix
    finally:
        tier.close()
    tier = open_tier(img)
    try:
        assert tier.journal_errors == [] and len(tier.recovered) == 43
    finally:
        tier.close()


def test_corrupted_journal_frame_loses_only_its_records(tmp_path):
    """A damaged frame in the middle costs its own records; the frames after it are found by their
    magic and replayed (issue 12: the blast radius of journal damage is one frame)."""
    img, offsets = _journal_image(tmp_path)
    jpath = os.path.join(img, "group-0.journal")
    with open(jpath, "r+b") as f:                               # a flipped byte inside the 4th batch's frame
        f.seek(offsets[3] + 20)
        b = f.read(1)
        f.seek(offsets[3] + 20)
        f.write(bytes([b[0] ^ 0x40]))
    tier = open_tier(img)
    try:
        kept = [s for s in range(48) if not 24 <= s < 32]
        assert sorted(p.slot for p in tier.recovered if p.group == 0) == kept
        assert len(tier.journal_errors) == 1 and tier.journal_errors[0][:2] == (0, offsets[3])
        assert "checksum" in tier.journal_errors[0][2]
        out = read_back(tier, 0, kept)
        assert all(np.array_equal(out[i].numpy(), page_bytes(s, 4096)) for i, s in enumerate(kept))
    finally:
        tier.close()
    tier = open_tier(img)                                       # open compacted the repaired journal
    try:
        assert tier.journal_errors == [] and len([p for p in tier.recovered if p.group == 0]) == 40
    finally:
        tier.close()


def test_damaged_length_field_resyncs_on_the_next_frame(tmp_path):
    img, offsets = _journal_image(tmp_path)
    jpath = os.path.join(img, "group-0.journal")
    with open(jpath, "r+b") as f:                               # the 2nd batch's frame claims to be huge
        f.seek(offsets[1] + 4)
        f.write((1 << 30).to_bytes(4, "little"))
    tier = open_tier(img)
    try:
        kept = [s for s in range(48) if not 8 <= s < 16]
        assert sorted(p.slot for p in tier.recovered if p.group == 0) == kept
        assert tier.journal_errors[0][:2] == (0, offsets[1])
    finally:
        tier.close()


def test_compacted_journal_damage_is_bounded(tmp_path):
    """After compaction a journal is frames of at most FRAME_RECORDS records: one damaged byte loses
    one frame's pages, not the group's."""
    from tiers.journal import FRAME_RECORDS
    n = 3 * FRAME_RECORDS
    tier = open_tier(tmp_path / "d", groups=[(64, n)])
    try:
        slots = list(range(n))
        tier.write(0, slots, torch.zeros((n, 64), dtype=torch.uint8), [PageRecord(s + 1, None, 0, 0) for s in slots])
        tier.checkpoint(0)
        size = tier.journal_size(0)
    finally:
        tier.close()
    jpath = os.path.join(tmp_path / "d", "group-0.journal")
    assert os.path.getsize(jpath) == size
    with open(jpath, "r+b") as f:                               # a byte in the middle of the second records frame
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 1]))
    tier = open_tier(tmp_path / "d", groups=[(64, n)])
    try:
        assert len(tier.recovered) == n - FRAME_RECORDS
    finally:
        tier.close()


def test_garbage_journal_header_keeps_the_records(tmp_path):
    img, _ = _journal_image(tmp_path)
    with open(os.path.join(img, "group-0.journal"), "r+b") as f:
        f.write(b"\x00\x01\x02\x03garbage!")
    tier = open_tier(img)
    try:
        assert sorted(p.slot for p in tier.recovered if p.group == 0) == list(range(48))
        assert tier.journal_errors and tier.journal_errors[0][:2] == (0, 0)
        out = read_back(tier, 0, [0, 47])
        assert np.array_equal(out[1].numpy(), page_bytes(47, 4096))
        write_keys(tier, 0, [48], [1])
    finally:
        tier.close()


# ---- faults -------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_injected_faults_are_typed_and_lose_nothing(tmp_path, mode):
    tier = open_tier(tmp_path / "d", o_direct=mode)
    try:
        write_keys(tier, 0, list(range(16)), list(range(16)))
        tier.free(0, [2])
        tier.inject_fault("write", errno.EIO)
        with pytest.raises(TierIOError) as ei:
            write_keys(tier, 0, [2, 16, 17], [102, 116, 117])
        assert ei.value.errno == errno.EIO and isinstance(ei.value, OSError)
        tier.inject_fault("write", errno.ENOSPC, count=2)
        for _ in range(2):
            with pytest.raises(DiskFullError) as ei:
                write_keys(tier, 0, [16, 17], [116, 117])
            assert ei.value.errno == errno.ENOSPC and isinstance(ei.value, OSError)
        for s in (2, 16, 17):                                    # previous state kept: still free
            with pytest.raises(UsageError):
                read_back(tier, 0, [s])
        tier.inject_fault("read", errno.EIO)
        with pytest.raises(TierIOError):
            read_back(tier, 0, [0, 1])
        assert tier.discarded == []                              # an I/O error is not corruption
        live = [s for s in range(16) if s != 2]
        out = read_back(tier, 0, live)
        assert all(np.array_equal(out[i].numpy(), page_bytes(s, 4096)) for i, s in enumerate(live))
        write_keys(tier, 0, [2, 16, 17], [102, 116, 117])       # and it keeps working
        assert np.array_equal(read_back(tier, 0, [17])[0].numpy(), page_bytes(117, 4096))
        with pytest.raises(UsageError):
            tier.inject_fault("open", errno.EIO)
    finally:
        tier.close()
    tier = open_tier(tmp_path / "d", o_direct=mode)
    try:
        assert {p.slot: p.record.key for p in tier.recovered} == {**{s: s for s in range(16)}, 2: 102,
                                                                  16: 116, 17: 117}
    finally:
        tier.close()


def test_min_free_refuses_growth(tmp_path):
    tier = open_tier(tmp_path / "d", min_free=1 << 62)          # more than any disk has
    try:
        with pytest.raises(DiskFullError, match="min_free"):
            write_keys(tier, 0, [0], [1])
        assert os.path.getsize(tier.segment_path(0)) == 0
        tier.min_free = 0
        write_keys(tier, 0, [0], [1])
        tier.min_free = 1 << 62
        write_keys(tier, 0, [1], [2])                            # inside the preallocated step: no new space
        assert np.array_equal(read_back(tier, 0, [1])[0].numpy(), page_bytes(2, 4096))
    finally:
        tier.close()


def test_real_file_size_limit_is_disk_full(tmp_path):
    """Not injected: RLIMIT_FSIZE makes the kernel refuse to grow the segment (EFBIG)."""
    import resource
    import signal
    tier = open_tier(tmp_path / "d", groups=[(4096, 4096)])    # 16 MiB quota: 2 MiB growth steps
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, old_limit[1]))
        write_keys(tier, 0, list(range(8)), list(range(8)))   # the 2 MiB step is refused, 32 KiB is not
        assert os.path.getsize(tier.segment_path(0)) == 8 * 4096
        with pytest.raises(DiskFullError) as ei:
            write_keys(tier, 0, [300, 301], [300, 301])
        assert ei.value.errno == errno.EFBIG
        with pytest.raises(UsageError):
            read_back(tier, 0, [300])
        write_keys(tier, 0, [8, 9], [8, 9])                   # small growth still fits
        out = read_back(tier, 0, list(range(10)))
        assert all(np.array_equal(out[s].numpy(), page_bytes(s, 4096)) for s in range(10))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
        tier.close()
    tier = open_tier(tmp_path / "d", groups=[(4096, 4096)])
    try:
        assert sorted(p.slot for p in tier.recovered) == list(range(10))
        write_keys(tier, 0, [300], [300])
    finally:
        tier.close()


# ---- lock, layout -------------------------------------------------------------------------------

def test_lock_excludes_a_second_open(tmp_path):
    tier = open_tier(tmp_path / "d")
    with open(tmp_path / "d" / "LOCK") as f:
        assert f.read().strip() == str(os.getpid())
    with pytest.raises(ConfigError) as ei:
        open_tier(tmp_path / "d")
    assert ei.value.field == "tiers.disk.path" and "in use" in str(ei.value) and str(os.getpid()) in str(ei.value)
    write_keys(tier, 0, [0], [1])                                # the failed open disturbed nothing
    tier.close()
    with pytest.raises(StoreClosedError):
        write_keys(tier, 0, [1], [2])
    with pytest.raises(StoreClosedError):
        tier.flush()
    tier = open_tier(tmp_path / "d")
    try:
        assert [p.record.key for p in tier.recovered] == [1]
    finally:
        tier.close()


def test_layout_mismatch_names_the_difference_or_wipes(tmp_path):
    tier = open_tier(tmp_path / "d")
    write_keys(tier, 0, [0, 1], [1, 2])
    tier.close()
    other = {**FP, "model": "another-model"}
    with pytest.raises(ConfigError) as ei:
        open_tier(tmp_path / "d", fp=other)
    assert ei.value.field == "tiers.disk.layout" and "'model'" in str(ei.value) and "another-model" in str(ei.value)
    nested = {**FP, "life_cycles": [["attention", 4096, None, "required"]]}
    with pytest.raises(ConfigError, match=r"life_cycles\[0\]\[1\]"):
        open_tier(tmp_path / "d", fp=nested)
    with pytest.raises(ConfigError, match="pool group 1"):
        open_tier(tmp_path / "d", groups=[GROUPS[0], (2000, 1536)])
    with pytest.raises(ConfigError, match="directory has 2 cold pool groups, this store has 1"):
        open_tier(tmp_path / "d", groups=GROUPS[:1])
    with pytest.raises(ConfigError) as ei:
        open_tier(tmp_path / "d", on_mismatch="maybe")
    assert ei.value.field == "tiers.disk.on_mismatch"
    with pytest.raises(ConfigError) as ei:
        open_tier(tmp_path / "d", o_direct="sometimes")
    assert ei.value.field == "tiers.disk.o_direct"
    # tuples and lists are the same fingerprint (msgpack stores both as arrays)
    same = {**FP, "life_cycles": [("attention", None, None, "required")]}
    open_tier(tmp_path / "d", fp=same).close()

    tier = open_tier(tmp_path / "d", fp=other, on_mismatch="wipe")
    try:
        assert tier.recovered == [] and tier.discarded == []
        assert os.path.getsize(tier.segment_path(0)) == 0
        write_keys(tier, 0, [5], [55])
    finally:
        tier.close()
    with pytest.raises(ConfigError):
        open_tier(tmp_path / "d")                                # the directory now holds the other layout
    tier = open_tier(tmp_path / "d", fp=other)
    try:
        assert [(p.slot, p.record.key) for p in tier.recovered] == [(5, 55)]
    finally:
        tier.close()


def test_o_direct_on_and_off_share_one_directory(tmp_path):
    tier = open_tier(tmp_path / "d", o_direct="off")
    write_keys(tier, 1, [0, 1, 2, 7], [1, 2, 3, 8])
    supported = tier.o_direct_supported
    tier.close()
    if not supported:
        with pytest.raises(ConfigError, match="O_DIRECT"):
            open_tier(tmp_path / "d", o_direct="on")
        return
    tier = open_tier(tmp_path / "d", o_direct="on")
    try:
        assert tier.stats["o_direct"] is True
        assert np.array_equal(read_back(tier, 1, [7, 0])[0].numpy(), page_bytes(8, 1000))
        write_keys(tier, 1, [3], [4])
    finally:
        tier.close()
    tier = open_tier(tmp_path / "d", o_direct="off")
    try:
        assert np.array_equal(read_back(tier, 1, [3])[0].numpy(), page_bytes(4, 1000))
    finally:
        tier.close()


# ---- journal compaction, concurrency ------------------------------------------------------------

def test_journal_compaction_bounded_and_exact(tmp_path):
    rng = np.random.default_rng(3)
    tier = open_tier(tmp_path / "d", groups=[(512, 96), (512, 8)], fsync=False)
    tier.checkpoint_floor = 32 << 10
    live: dict[int, int] = {}
    key, biggest = 0, 0
    try:
        for it in range(900):
            free_slots = [s for s in range(96) if s not in live]
            batch = rng.choice(free_slots, size=min(len(free_slots), int(rng.integers(1, 9))), replace=False).tolist()
            keys = list(range(key + 1, key + 1 + len(batch)))
            key += len(batch)
            write_keys(tier, 0, batch, keys)
            live.update(zip(batch, keys))
            if len(live) > 40:
                gone = rng.choice(sorted(live), size=int(rng.integers(1, 9)), replace=False).tolist()
                tier.free(0, gone)
                for s in gone:
                    del live[s]
            biggest = max(biggest, tier.journal_size(0))
        assert key > 3000
        assert biggest < 64 << 10                                # bounded: floor + one frame, not ~key * 60 bytes
        assert tier.stats["checkpoints"] >= 5
        img = crash_image(tier, tmp_path / "img")                # recovery of a compacted + appended journal
        write_keys(tier, 1, [0], [1])
    finally:
        tier.close()
    for path in (img, tmp_path / "d"):
        t = open_tier(path, groups=[(512, 96), (512, 8)])
        try:
            assert {p.slot: p.record.key for p in t.recovered if p.group == 0} == live
            slots = sorted(live)
            out = read_back(t, 0, slots)
            assert all(np.array_equal(out[i].numpy(), page_bytes(live[s], 512)) for i, s in enumerate(slots))
        finally:
            t.close()


def test_groups_written_concurrently(tmp_path):
    tier = open_tier(tmp_path / "d")
    errors = []

    def worker(g: int) -> None:
        try:
            for b in range(20):
                slots = list(range(b * 16, b * 16 + 16))
                write_keys(tier, g, slots, [g * 10_000 + s for s in slots])
                out = read_back(tier, g, slots)
                assert all(np.array_equal(out[i].numpy(), page_bytes(g * 10_000 + s, GROUPS[g][0]))
                           for i, s in enumerate(slots))
        except BaseException as e:   # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(g,)) for g in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tier.close()
    assert errors == []
    tier = open_tier(tmp_path / "d")
    try:
        assert len(tier.recovered) == 640
        gens = [p.generation for p in tier.recovered]
        assert len(set(gens)) == 640
    finally:
        tier.close()


# ---- journal compaction under faults (found in review) ------------------------------------------

def test_a_compaction_whose_directory_sync_fails_loses_no_later_write(tmp_path, monkeypatch):
    """The rename is done but not durable: later appends go to the new
    journal and sync the directory first, so what they acknowledge survives
    a crash (they used to go to the unlinked old journal)."""
    import tiers.disk as disk
    tier = open_tier(tmp_path / "d", groups=[(4096, 256)], o_direct="off")
    write_keys(tier, 0, [0], [1])
    real = disk.fsync_dir

    def failing(path):
        raise OSError(errno.EIO, "injected EIO on the directory fsync")
    monkeypatch.setattr(disk, "fsync_dir", failing)
    with pytest.raises(TierIOError):
        tier.checkpoint(0)
    with pytest.raises(TierIOError):               # nothing is acknowledged while the rename is not durable
        write_keys(tier, 0, [5], [6])
    monkeypatch.setattr(disk, "fsync_dir", real)
    write_keys(tier, 0, [1, 2, 3], [2, 3, 4])
    crash = crash_image(tier, tmp_path / "crash")
    tier.close()
    again = open_tier(crash, groups=[(4096, 256)], o_direct="off")
    try:
        assert sorted(again.live_slots(0)) == [0, 1, 2, 3]
        out = read_back(again, 0, [0, 1, 2, 3])
        assert all(np.array_equal(out[i].numpy(), page_bytes(k, 4096)) for i, k in enumerate([1, 2, 3, 4]))
    finally:
        again.close()


def test_reopening_a_crashed_tier_on_a_full_disk_serves_what_it_holds(tmp_path):
    """Open compacts dirty journals; when the disk is full that fails, and the
    repaired journal serves as it is instead of failing the open."""
    import resource
    import signal
    tier = open_tier(tmp_path / "d", groups=[(4096, 4096)], o_direct="off", fsync=False)
    for a in range(0, 2000, 100):
        write_keys(tier, 0, list(range(a, a + 100)), list(range(a + 1, a + 101)))
    crash = crash_image(tier, tmp_path / "crash")
    tier.close()
    with open(os.path.join(crash, "group-0.journal"), "ab") as f:
        f.write(b"\x50\x00\x00\x00torn")                        # a torn last frame
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, old_limit[1]))   # no file may grow past 16 KiB
        again = open_tier(crash, groups=[(4096, 4096)], o_direct="off", fsync=False)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    try:
        assert len(again.live_slots(0)) == 2000
        out = read_back(again, 0, [0, 999, 1999])
        assert all(np.array_equal(out[i].numpy(), page_bytes(s + 1, 4096)) for i, s in enumerate([0, 999, 1999]))
    finally:
        again.close()


def test_relabel_gives_live_pages_new_records_that_survive_reopen(tmp_path):
    tier = open_tier(tmp_path / "d", groups=[(4096, 64)], o_direct="off")
    tier.write(0, [3, 4], rows_for([7, 8], 4096), [rec(b"", depth=0), rec(b"", depth=0)])
    with pytest.raises(UsageError):
        tier.relabel(0, [5], [rec(9)])                          # no page there
    tier.relabel(0, [3, 4], [rec(70, depth=2, parent=69), rec(80, depth=3, parent=70)])
    tier.close()
    again = open_tier(tmp_path / "d", groups=[(4096, 64)], o_direct="off")
    try:
        got = {p.slot: p.record for p in again.recovered}
        assert got == {3: rec(70, depth=2, parent=69), 4: rec(80, depth=3, parent=70)}
        out = read_back(again, 0, [3, 4])                        # the bytes and checksums are the old ones
        assert np.array_equal(out[0].numpy(), page_bytes(7, 4096)) and np.array_equal(out[1].numpy(), page_bytes(8, 4096))
    finally:
        again.close()


# ---- reads beside a write ----------------------------------------------------------------------

def test_reads_go_on_while_a_write_is_in_its_data_phase(tmp_path, monkeypatch):
    """A write holds the group's lock only around the slot table: a promotion's read of
    live pages does not wait for another batch's data write and sync. close() waits for
    the write under way, and both batches are there after a reopen."""
    import tiers.disk as disk_mod
    real = disk_mod.pwrite_rows
    entered, go = threading.Event(), threading.Event()

    def paused(*args):
        entered.set()
        assert go.wait(10), "the test never let the write go on"
        return real(*args)

    tier = open_tier(tmp_path / "d", o_direct="off")
    write_keys(tier, 0, list(range(10)), list(range(100, 110)))
    monkeypatch.setattr(disk_mod, "pwrite_rows", paused)
    writer = threading.Thread(target=write_keys, args=(tier, 0, list(range(20, 30)), list(range(200, 210))))
    writer.start()
    assert entered.wait(10)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(read_back(tier, 0, list(range(10)))))
    reader.start()
    reader.join(5)
    assert not reader.is_alive(), "a read waited for a write to other slots"
    assert np.array_equal(got[0].numpy(), rows_for(list(range(100, 110)), 4096).numpy())
    with pytest.raises(UsageError):                      # the slots being written are not pages yet
        read_back(tier, 0, [20])
    closer = threading.Thread(target=tier.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close() did not wait for the write under way"
    go.set()
    writer.join(10)
    closer.join(10)
    assert not writer.is_alive() and not closer.is_alive()
    monkeypatch.setattr(disk_mod, "pwrite_rows", real)
    again = open_tier(tmp_path / "d", o_direct="off")
    try:
        assert np.array_equal(read_back(again, 0, list(range(20, 30))).numpy(),
                              rows_for(list(range(200, 210)), 4096).numpy())
        assert np.array_equal(read_back(again, 0, list(range(10))).numpy(),
                              rows_for(list(range(100, 110)), 4096).numpy())
    finally:
        again.close()


# ---- the store's frees on the write stream --------------------------------------------------------

async def test_store_frees_made_before_the_job_runs_join_it_and_stay_ordered_with_writes(tmp_path):
    """Disk frees the store makes while its free job waits in the write stream join that job
    (one GIL hand-off for many), but only while nothing else went into the stream after it:
    a write or relabel queued in between runs before any free made after it, and a write into
    a freed slot submitted after the free runs after it."""
    import threading

    from helpers import config
    from runtime import Store

    async with Store.open(config(gpu=8, host=8, disk=32, disk_dir=tmp_path)) as store:
        tier, stream = store.disk, store.engine.io_write
        width = tier.groups[0].slot_bytes
        write_keys(tier, 0, [0, 1, 2, 3, 4], [10, 11, 12, 13, 14])
        gate, started = threading.Event(), threading.Event()
        blocker = stream.submit(lambda: (started.set(), gate.wait(10)))
        assert started.wait(10)
        queued = stream.queued
        store.moves._disk_free(0, [0])
        store.moves._disk_free(0, [1, 2])
        assert stream.queued == queued + 1              # one job for both frees
        written = stream.submit(lambda: tier.write(0, [2], rows_for([99], width), [rec(99)]))
        relabeled = stream.submit(lambda: tier.relabel(0, [3], [rec(77)]))
        store.moves._disk_free(0, [3])                        # after the relabel queued since: a job of its own
        assert stream.queued == queued + 4
        gate.set()
        for ev in (blocker, written, relabeled):
            ev.synchronize()
            assert ev.error is None                     # the relabel found slot 3 still live
        stream.synchronize()
        assert (read_back(tier, 0, [2])[0].numpy() == page_bytes(99, width)).all()   # the free came first
        assert (read_back(tier, 0, [4])[0].numpy() == page_bytes(14, width)).all()
        assert tier.groups[0].n_live == 2 and not tier.groups[0].live[[0, 1, 3]].any()
        done = threading.Event()
        stream.submit(lambda: done.wait(10), event=False)
        queued = stream.queued
        store.moves._disk_free(0, [4])                        # the last free job has run: a job of its own
        assert stream.queued == queued + 1
        done.set()
        stream.synchronize()
        assert not tier.groups[0].live[4]


def test_recovered_records_hand_back_their_large_temporaries_and_stay_exact(tmp_path, monkeypatch):
    """Recovery's temporaries (every live slot and generation, their sort order) give their pages
    back before they are freed (``drop_arrays``; at a small threshold here, a million pages'
    worth in production), and the records it yields are the same as without."""
    from tiers import native
    tier = open_tier(tmp_path / "d")
    keys = {}
    key = 0
    for g, (width, slots) in enumerate(GROUPS):
        order = np.random.default_rng(g).permutation(slots)[: slots * 3 // 4].tolist()
        for a in range(0, len(order), 64):
            batch = order[a:a + 64]
            ks = list(range(key + 1, key + 1 + len(batch)))
            key += len(batch)
            write_keys(tier, g, batch, ks)
            keys.update({(g, s): k for s, k in zip(batch, ks)})
    tier.close()

    def records(tier) -> list:
        return [(int(g), r.tobytes()) for gs, recs in tier.recovered_records(chunk=500) for g, r in zip(gs, recs)]
    tier = open_tier(tmp_path / "d")
    try:
        want = records(tier)
        released = []
        real = native.release_pages
        monkeypatch.setattr(native, "DROP_MIN_BYTES", 4096)
        monkeypatch.setattr(native, "release_pages", lambda a: (released.append(a.nbytes), real(a)))
        assert records(tier) == want and len(want) == len(keys)
        assert {(p.group, p.slot) for p in tier.recovered} == set(keys)
        n = len(keys)
        assert n * 8 in released                       # the slots, the generations and their order
        assert released.count(n * 8) >= 3
    finally:
        tier.close()

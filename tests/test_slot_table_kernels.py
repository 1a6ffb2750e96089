"""The disk tier's slot-table kernels (tiers/native/slot_table.hpp) against the numpy
expressions they replace: per-slot flags, journal record checks and stamps, and the
gathers, scatters and concatenation that keep the GIL. Property-based: random tables,
batches and records, each result compared with numpy's."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tiers import journal, native
from tiers.journal import FREE, MAX_GEN, MAX_KEY_BYTES, MAX_PRIORITY, RECORD, TAG_ANONYMOUS, TAG_NONE, WRITE

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)


def table(seed: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random(n) < 0.5, rng.random(n) < 0.3, rng.integers(0, n, rng.integers(0, 2 * n + 1)).astype(np.int64)


def random_records(seed: int, n: int) -> np.ndarray:
    """Records with every field drawn, malformed ones included (tags, kinds, priorities, generations
    at and past their limits)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, RECORD.itemsize), dtype=np.uint8)
    recs = raw.view(RECORD).reshape(-1).copy()
    recs["kind"] = rng.choice([WRITE, FREE, 2, 255], n)
    recs["ktag"] = rng.choice([0, 1, 16, 17, TAG_NONE, TAG_ANONYMOUS], n)
    recs["ptag"] = rng.choice([0, 5, 16, 17, TAG_NONE, TAG_ANONYMOUS], n)
    recs["priority"] = rng.choice([0, 35, 100, 101, 255], n)
    recs["gen"] = rng.choice(np.array([0, 1, 7, MAX_GEN, MAX_GEN + 1, 2 ** 64 - 1], dtype=np.uint64), n)
    return recs


def numpy_malformed(recs: np.ndarray, stored: bool) -> np.ndarray:
    """journal.malformed as numpy expressed it before the native kernel."""
    ktag, ptag = recs["ktag"], recs["ptag"]
    bad = (ktag > MAX_KEY_BYTES) & (ktag != TAG_ANONYMOUS)
    bad |= (ptag > MAX_KEY_BYTES) & (ptag != TAG_NONE)
    bad |= recs["priority"] > MAX_PRIORITY
    if not stored:
        return bad
    kind, gen = recs["kind"], recs["gen"]
    return ((kind == WRITE) & bad) | (kind > FREE) | (gen == 0) | (gen > MAX_GEN)


@SETTINGS
@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 700))
def test_flag_kernels_are_numpys(seed, n):
    a, b, slots = table(seed, n)
    assert native.flags_any(a, slots) == bool(a[slots].any())
    assert np.array_equal(native.flags_select(a, slots, True), slots[a[slots]])
    assert np.array_equal(native.flags_select(a, slots, False), slots[~a[slots]])
    neither = np.flatnonzero(~(a[slots] | b[slots]))
    assert native.flags_first_neither(a, b, slots) == (int(neither[0]) if len(neither) else -1)
    for value in (True, False):
        got, want = a.copy(), a.copy()
        native.flags_set(got, slots, value)
        want[slots] = value
        assert np.array_equal(got, want)


@SETTINGS
@given(st.integers(0, 2 ** 32 - 1), st.integers(0, 700))
def test_record_checks_and_stamps_are_numpys(seed, n):
    recs = random_records(seed, n)
    for stored in (True, False):
        assert np.array_equal(journal.malformed(recs, stored), numpy_malformed(recs, stored))
    rng = np.random.default_rng(seed + 1)
    slots = rng.permutation(max(n, 1) * 3)[:n].astype(np.int64)
    hashes = rng.integers(0, 2 ** 63, n, dtype=np.int64).astype(np.uint64)
    fp, first = int(rng.integers(0, 2 ** 63)), int(rng.integers(1, 2 ** 40))
    got = journal.stamp_writes(recs, slots, first, hashes, fp)
    want = recs.copy()
    want["kind"] = WRITE
    want["slot"] = slots
    want["gen"] = np.arange(first, first + n, dtype=np.uint64)
    want["csum"] = hashes ^ journal.identity(want, fp)
    assert got.dtype == RECORD and got.tobytes() == want.tobytes()
    assert recs.tobytes() == random_records(seed, n).tobytes()          # the caller's records untouched
    assert np.array_equal(native.records_slots(journal.rows(got)), slots)
    gens = np.arange(first, first + n, dtype=np.uint64)
    frees = journal.frees(slots, gens)
    want = np.zeros(n, RECORD)
    want["kind"], want["slot"], want["gen"] = FREE, slots, gens
    assert frees.tobytes() == want.tobytes()


@SETTINGS
@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 600))
def test_current_records_are_numpys(seed, n):
    rng = np.random.default_rng(seed)
    meta = random_records(seed, n)
    live = rng.random(n) < 0.6
    queued = random_records(seed + 7, int(rng.integers(0, 2 * n)))
    queued["slot"] = rng.integers(0, n, len(queued))
    same = rng.random(len(queued)) < 0.5                # half name their slot's current generation
    queued["gen"][same] = meta["gen"][queued["slot"][same]]
    slots = queued["slot"].astype(np.int64)
    want = queued[live[slots] & (meta["gen"][slots] == queued["gen"])]
    got = journal.take(queued, native.records_current(journal.rows(queued), live, journal.rows(meta)))
    assert got.tobytes() == want.tobytes()


@SETTINGS
@given(st.integers(0, 2 ** 32 - 1), st.integers(0, 900), st.sampled_from(["int64", "uint64", "bool", "record"]))
def test_take_put_concat_are_numpys(seed, n, kind):
    rng = np.random.default_rng(seed)
    a = random_records(seed, n + 1) if kind == "record" else \
        rng.integers(0, 2, n + 1).astype(kind) if kind == "bool" else rng.integers(-2 ** 40, 2 ** 40, n + 1).astype(kind)
    idx = rng.integers(0, n + 1, rng.integers(0, 2 * n + 2)).astype(np.int64)
    assert native.take(a, idx).tobytes() == a[idx].tobytes()
    dst = a.copy()
    uniq = np.unique(idx)                               # numpy's put of repeats keeps the last
    vals = native.take(a[::-1].copy(), uniq)
    native.put(dst, uniq, vals)
    want = a.copy()
    want[uniq] = vals
    assert dst.tobytes() == want.tobytes()
    parts = [a[:k] for k in rng.integers(0, n + 2, 4)]
    assert native.concat(parts, a.dtype).tobytes() == np.concatenate(parts).tobytes()
    assert journal.copy(a).tobytes() == a.tobytes() if kind == "record" else True
    if n:
        assert native.bounds_i64(idx if len(idx) else np.array([3], np.int64)) == \
            ((int(idx.min()), int(idx.max())) if len(idx) else (3, 3))
    first = int(rng.integers(0, 2 ** 62))
    assert np.array_equal(native.iota_u64(first, n), np.arange(first, first + n, dtype=np.uint64))


@SETTINGS
@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 400), st.sampled_from([2, -1, -3]))
def test_strided_inputs_are_read_as_numpy_reads_them(seed, n, step):
    """Slot lists and record rows with any stride (a view every other element, reversed)."""
    a, b, slots = table(seed, n)
    view = np.concatenate([slots, slots])[::step]
    assert native.flags_any(a, view) == bool(a[view].any())
    assert np.array_equal(native.flags_select(a, view, True), view[a[view]])
    got, want = a.copy(), a.copy()
    native.flags_set(got, view, True)
    want[view] = True
    assert np.array_equal(got, want)
    recs = random_records(seed, 2 * n)
    rows = journal.rows(recs)[::step]
    assert np.array_equal(native.records_malformed(rows, True, MAX_GEN), numpy_malformed(recs[::step], True))
    assert np.array_equal(native.records_slots(rows), recs[::step]["slot"].astype(np.int64))
    assert native.take(recs[::step], np.arange(len(rows), dtype=np.int64)).tobytes() == recs[::step].tobytes()


def test_repeated_indices_and_large_batches():
    """A put's repeated index keeps its last value (a loop's order); batches past the size where
    the kernels give the GIL up (16,384 elements) compute the same."""
    a = np.zeros(10, np.int64)
    native.put(a, np.array([3, 5, 3, 3], np.int64), np.array([1, 2, 3, 4], np.int64))
    assert a.tolist() == [0, 0, 0, 4, 0, 2, 0, 0, 0, 0]
    n = 40_000
    flags, other, slots = table(11, n)
    assert native.flags_any(flags, slots) == bool(flags[slots].any())
    assert np.array_equal(native.flags_select(flags, slots, False), slots[~flags[slots]])
    got = flags.copy()
    native.flags_set(got, slots, False)
    want = flags.copy()
    want[slots] = False
    assert np.array_equal(got, want)
    recs = random_records(12, n)
    assert np.array_equal(journal.malformed(recs, True), numpy_malformed(recs, True))
    assert native.bounds_i64(slots) == (int(slots.min()), int(slots.max()))
    assert native.take(recs, slots % n).tobytes() == recs[slots % n].tobytes()


def test_a_disk_write_takes_strided_slots_and_rows(tmp_path):
    """DiskTier.write with slot and row-index arrays that are views (every other element,
    reversed), as a caller may pass them: the pages read back bit-exact."""
    from tiers.disk import DiskTier
    tier = DiskTier.open(str(tmp_path), {"t": 1}, [(4096, 64)], fsync=False, o_direct="off")
    try:
        rows = np.random.default_rng(5).integers(0, 256, (32, 4096), dtype=np.uint8)
        recs = np.zeros(8, RECORD)
        recs["key_lo"], recs["ptag"] = np.arange(1, 9), TAG_NONE
        slots = np.arange(40, 8, -2, dtype=np.int64)[:8]          # 40, 38, ..., 26: a reversed strided view
        index = np.arange(0, 32, 4, dtype=np.int64)[::-1]         # rows 28, 24, ..., 0
        tier.write(0, slots, rows, recs, index=index)
        out = np.zeros((8, 4096), dtype=np.uint8)
        tier.read(0, slots.tolist(), out)
        assert np.array_equal(out, rows[index])
        tier.write(0, np.arange(0, 16, 2, dtype=np.int64), rows[::4], recs)
        tier.read(0, list(range(0, 16, 2)), out)
        assert np.array_equal(out, rows[::4])
    finally:
        tier.close()


def test_bad_arguments_are_typed_errors_and_change_nothing():
    flags = np.zeros(8, dtype=bool)
    for bad in ([8], [-1], [0, 9]):
        with pytest.raises(IndexError, match="slot out of range"):
            native.flags_set(flags, np.array(bad, dtype=np.int64), True)
    assert not flags.any()                  # every slot is checked before the first is set
    with pytest.raises(TypeError):          # another index dtype is refused, not converted
        native.flags_any(flags, np.array([1], dtype=np.int32))
    with pytest.raises(TypeError):          # a converted table would take the writes and vanish
        native.flags_set(np.zeros(8, dtype=np.uint8), np.array([1], dtype=np.int64), True)
    with pytest.raises(ValueError, match="differ in length"):
        native.flags_first_neither(flags, np.zeros(9, dtype=bool), np.array([1], dtype=np.int64))
    with pytest.raises(ValueError, match="64 contiguous bytes"):
        native.records_malformed(np.zeros((2, 32), dtype=np.uint8), True, MAX_GEN)
    with pytest.raises(ValueError, match="one slot and one hash"):
        native.records_stamp_writes(np.zeros((2, 64), dtype=np.uint8), np.array([1], dtype=np.int64), 1,
                                    np.zeros(2, dtype=np.uint64), 0)
    with pytest.raises(IndexError, match="slot out of range"):       # slots are 32 bits on disk
        native.records_frees(np.array([1 << 32], dtype=np.int64), np.zeros(1, dtype=np.uint64))
    with pytest.raises(ValueError, match="empty"):
        native.bounds_i64(np.zeros(0, dtype=np.int64))
    with pytest.raises(ValueError, match="1-D C-contiguous"):
        native.as_rows(np.zeros((4, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="3 values for 2 indices"):
        native.put(np.zeros(4, np.int64), np.array([0, 1], np.int64), np.array([1, 2, 3], np.int64))
    with pytest.raises(IndexError):         # numpy would count from the end
        native.take(np.zeros(4, np.int64), np.array([-1], np.int64))
    meta = np.zeros(4, RECORD)
    queued = np.zeros(1, RECORD)
    queued["slot"] = 4                      # beyond the table: an invariant broken, said, not skipped
    with pytest.raises(IndexError, match="beyond the table"):
        native.records_current(journal.rows(queued), np.ones(4, bool), journal.rows(meta))


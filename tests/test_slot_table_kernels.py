"""The disk tier's slot-table kernels (tiers/native/slot_table.hpp) against the numpy
expressions they replace: per-slot flags, journal record checks and stamps, and the
gathers, scatters and concatenation that keep the GIL. Property-based: random tables,
batches and records, each result compared with numpy's."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tiers import journal, native
from tiers.journal import FREE, MAX_GEN, RECORD, TAG_ANONYMOUS, TAG_NONE, WRITE

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
    bad = (ktag > 16) & (ktag != TAG_ANONYMOUS)
    bad |= (ptag > 16) & (ptag != TAG_NONE)
    bad |= recs["priority"] > 100
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


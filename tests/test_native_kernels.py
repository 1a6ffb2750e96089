"""tiers._native: copy_rows (the host side of every page move) and pread_rows /
pwrite_rows (the disk tier's page I/O). Errors are typed and nothing is written
through a silent temporary."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from tiers.native import copy_rows


def rows(n: int, width: int = 48, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, width), dtype=np.uint8)


def test_gather_and_scatter_match_numpy():
    src, dst = rows(32), np.zeros((16, 48), dtype=np.uint8)
    si, di = np.array([5, 0, 31, 7], dtype=np.int64), np.array([3, 15, 0, 9], dtype=np.int64)
    copy_rows(src, si, dst, di)
    want = np.zeros_like(dst)
    want[di] = src[si]
    assert np.array_equal(dst, want)
    copy_rows(src[:16], None, dst, None)
    assert np.array_equal(dst, src[:16])


def test_within_one_buffer():
    buf = rows(8)
    want = buf.copy()
    want[[1, 6]] = buf[[4, 4]]
    copy_rows(buf, np.array([4, 4], dtype=np.int64), buf, np.array([1, 6], dtype=np.int64))
    assert np.array_equal(buf, want)
    copy_rows(buf, np.array([2], dtype=np.int64), buf, np.array([2], dtype=np.int64))  # a row onto itself
    assert np.array_equal(buf, want)


def test_bad_arguments_are_typed_errors_and_write_nothing():
    src, dst = rows(4), np.zeros((4, 48), dtype=np.uint8)
    with pytest.raises(IndexError):
        copy_rows(src, np.array([4], dtype=np.int64), dst, np.array([0], dtype=np.int64))
    with pytest.raises(IndexError):
        copy_rows(src, np.array([0], dtype=np.int64), dst, np.array([-1], dtype=np.int64))
    with pytest.raises(ValueError, match="widths"):
        copy_rows(src, None, np.zeros((4, 40), dtype=np.uint8), None)
    with pytest.raises(ValueError, match="counts"):
        copy_rows(src, np.array([0, 1], dtype=np.int64), dst, np.array([0], dtype=np.int64))
    with pytest.raises(TypeError):              # another index dtype is refused, not converted
        copy_rows(src, np.array([0], dtype=np.int32), dst, None)
    with pytest.raises(TypeError):              # a converted dst would take the writes and vanish
        copy_rows(src, None, np.zeros((4, 48), dtype=np.int16), None)
    overlapping = np.lib.stride_tricks.as_strided(np.zeros(96, dtype=np.uint8), (4, 48), (16, 1))
    with pytest.raises(ValueError, match="overlap"):
        copy_rows(src, None, overlapping, None)
    assert not dst.any()


# -- pread_rows / pwrite_rows: a batch of scattered page rows to and from a real file ----------------

def test_row_io_round_trip_with_pad_and_runs(tmp_path):
    """Rows land at their offsets (runs of adjacent slots and lone ones, each row then
    zero pad to the stride) and read back bit-exact into another order."""
    from tiers.native import pread_rows, pwrite_rows
    stride, src = 64, rows(40)
    slots = np.array([0, 1, 2, 7, 9, 10, 30], dtype=np.int64)        # runs 0-2, 7, 9-10, 30
    order = np.array([5, 0, 39, 12, 3, 3, 20], dtype=np.int64)        # a row may go to two slots
    with open(tmp_path / "seg", "w+b") as f:
        pwrite_rows(f.fileno(), src, order, slots * stride, stride)
        raw = np.frombuffer((tmp_path / "seg").read_bytes(), dtype=np.uint8)
        assert len(raw) == (30 + 1) * stride
        for s, r in zip(slots, order):
            assert np.array_equal(raw[s * stride:s * stride + 48], src[r])
            assert not raw[s * stride + 48:(s + 1) * stride].any()     # the pad is zeros
        out = np.zeros((7, 48), dtype=np.uint8)
        back = np.array([6, 5, 4, 3, 2, 1, 0], dtype=np.int64)
        moved = pread_rows(f.fileno(), out, back, slots * stride, stride)
        assert moved.tolist() == [48] * 7
        assert np.array_equal(out[back], src[order])


def test_row_io_write_hashes_and_syncs_in_the_same_call(tmp_path):
    """pwrite_rows with hashes= and sync=: the checksums are xxh64_rows' of the same rows, in the
    batch's order, the file holds the rows, and a bad hashes length writes nothing."""
    from tiers.native import pwrite_rows, xxh64_rows
    stride, src = 64, rows(40)
    slots = np.array([3, 4, 5, 11, 20], dtype=np.int64)
    order = np.array([9, 2, 2, 30, 0], dtype=np.int64)
    with open(tmp_path / "seg", "w+b") as f:
        got = np.zeros(5, dtype=np.uint64)
        seconds = pwrite_rows(f.fileno(), src, order, slots * stride, stride, got, True)
        assert seconds >= 0.0 and got.tolist() == xxh64_rows(src, order).tolist()
        raw = np.frombuffer((tmp_path / "seg").read_bytes(), dtype=np.uint8)
        for s, r in zip(slots, order):
            assert np.array_equal(raw[s * stride:s * stride + 48], src[r])
        assert pwrite_rows(f.fileno(), src, order, slots * stride, stride) == 0.0      # no hashes asked
        with pytest.raises(ValueError, match="one entry per row"):
            pwrite_rows(f.fileno(), src, order, slots * stride + 4096, stride, np.zeros(4, dtype=np.uint64))
        assert len((tmp_path / "seg").read_bytes()) == len(raw)                     # nothing written
        with pytest.raises(TypeError):                    # hashes of another dtype: no silent temporary
            pwrite_rows(f.fileno(), src, order, slots * stride, stride, np.zeros(5, dtype=np.int64))


def test_pwrite_all_writes_at_its_offset_and_names_its_errno(tmp_path):
    from tiers.native import pwrite_all
    with open(tmp_path / "j", "w+b") as f:
        pwrite_all(f.fileno(), b"hello", 0, True)
        pwrite_all(f.fileno(), b"world" * 1000, 3, False)
        assert (tmp_path / "j").read_bytes() == b"hel" + b"world" * 1000
    (tmp_path / "ro").write_bytes(b"")
    fd = os.open(tmp_path / "ro", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as e:
            pwrite_all(fd, b"x", 0, True)
        assert e.value.errno == errno.EBADF
    finally:
        os.close(fd)


def test_row_io_short_read_at_end_of_file_and_errors(tmp_path):
    from tiers.native import pread_rows, pwrite_rows
    stride, src = 64, rows(4)
    with open(tmp_path / "seg", "w+b") as f:
        fd = f.fileno()
        pwrite_rows(fd, src, np.arange(2, dtype=np.int64), np.array([0, 64], dtype=np.int64), stride)
        f.truncate(64 + 20)                               # the second page is cut after 20 bytes
        out = np.zeros((3, 48), dtype=np.uint8)
        moved = pread_rows(fd, out, np.arange(3, dtype=np.int64), np.array([0, 64, 128], dtype=np.int64), stride)
        assert moved.tolist() == [48, 20, 0]
        assert np.array_equal(out[0], src[0]) and np.array_equal(out[1, :20], src[1, :20])
        with pytest.raises(IndexError):
            pwrite_rows(fd, src, np.array([4], dtype=np.int64), np.array([0], dtype=np.int64), stride)
        with pytest.raises(ValueError, match="differ in length"):
            pwrite_rows(fd, src, np.array([0, 1], dtype=np.int64), np.array([0], dtype=np.int64), stride)
        with pytest.raises(ValueError, match="negative"):
            pread_rows(fd, out, np.array([0], dtype=np.int64), np.array([-64], dtype=np.int64), stride)
        with pytest.raises(ValueError, match="stride"):
            pwrite_rows(fd, src, np.array([0], dtype=np.int64), np.array([0], dtype=np.int64), 16)
        read_only = np.frombuffer(bytes(48), dtype=np.uint8).reshape(1, 48)
        with pytest.raises(TypeError):                    # a read-only array cannot take a read
            pread_rows(fd, read_only, np.array([0], dtype=np.int64), np.array([0], dtype=np.int64), stride)
    (tmp_path / "ro").write_bytes(b"")
    fd = os.open(tmp_path / "ro", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as e:                 # the fd is not open for writing
            pwrite_rows(fd, src, np.array([0], dtype=np.int64), np.array([0], dtype=np.int64), stride)
        assert e.value.errno == errno.EBADF
    finally:
        os.close(fd)


@pytest.mark.parametrize("n", [0, 1, 2, 137, (1 << 14) + 5])       # below and above the GIL threshold
def test_argsort_i64_is_numpys_stable_argsort_and_finds_duplicates(n):
    from tiers.native import argsort_i64
    rng = np.random.default_rng(n)
    distinct = rng.permutation(10 * n + 1)[:n].astype(np.int64)
    order, dup = argsort_i64(distinct)
    assert order.dtype == np.int64 and np.array_equal(order, np.argsort(distinct, kind="stable")) and not dup
    if n >= 2:
        repeated = distinct.copy()
        repeated[-1] = repeated[0]
        order, dup = argsort_i64(repeated)
        assert np.array_equal(order, np.argsort(repeated, kind="stable")) and dup
        strided = rng.integers(-50, 50, 2 * n).astype(np.int64)[::2]     # a view: stride 16 bytes
        order, dup = argsort_i64(strided)
        assert np.array_equal(order, np.argsort(strided, kind="stable"))
        assert dup == (len(np.unique(strided)) < n)
    with pytest.raises(TypeError):
        argsort_i64(distinct.astype(np.int32))          # no silent conversion


@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 9000, 100_000])
def test_the_journal_crc_in_steps_is_zlibs(n):
    import zlib
    from tiers.journal import crc32
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    assert crc32(data) == zlib.crc32(data) and crc32(memoryview(data)) == zlib.crc32(data)


def _resident_pages(a: np.ndarray) -> int:
    """Resident pages under ``a``'s whole pages (mincore)."""
    import ctypes
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    lo = -(-a.ctypes.data // page) * page
    hi = (a.ctypes.data + a.nbytes) // page * page
    n = (hi - lo) // page
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


def test_drop_arrays_hands_back_only_arrays_nothing_else_refers_to(monkeypatch):
    """``drop_arrays`` empties its list and gives a large array's pages back (without the GIL)
    only when the list held its last reference and the array owns its memory: a name, a view,
    another container, a weak reference, a read-only or a small array keeps it as it is."""
    import weakref
    from tiers import native
    size = 4 * native.DROP_MIN_BYTES
    mine = np.ones(size, dtype=np.uint8)
    assert _resident_pages(mine) > 0
    native.release_pages(mine)                         # the kernel call itself: the pages go
    assert _resident_pages(mine) == 0 and mine[size // 2] == 0

    released = []
    real = native.release_pages
    monkeypatch.setattr(native, "release_pages", lambda a: (released.append(a.nbytes), real(a)))
    box = [np.ones(size, dtype=np.uint8), np.ones(size + 1, dtype=np.uint8)]
    native.drop_arrays(box)
    assert box == [] and sorted(released) == [size, size + 1]

    released.clear()
    named = np.ones(size, dtype=np.uint8)
    viewed = np.ones(size, dtype=np.uint8)
    view = viewed[8:]
    held = np.ones(size, dtype=np.uint8)
    other = [held]
    watched = np.ones(size, dtype=np.uint8)
    ref = weakref.ref(watched)
    base = np.ones(size + 64, dtype=np.uint8)
    frozen = np.ones(size, dtype=np.uint8)
    frozen.flags.writeable = False
    box = [named, viewed, held, watched, base[64:], frozen, np.ones(native.DROP_MIN_BYTES // 2, dtype=np.uint8),
           b"not an array"]
    del viewed, held, watched, frozen                  # each still referred to (a view, a list, a weak ref)
    native.drop_arrays(box)
    assert box == [] and released == []
    for a in (named, view, other[0], base):
        assert a.all()
    assert ref() is None                               # it went with the list, as it was


def test_drop_arrays_fails_closed_where_an_interpreter_counts_differently(monkeypatch):
    from tiers import native
    monkeypatch.setattr(native, "_SOLE_REFS", native._SOLE_REFS - 1)     # as if references counted fewer
    released = []
    monkeypatch.setattr(native, "release_pages", released.append)
    native.drop_arrays([np.ones(4 * native.DROP_MIN_BYTES, dtype=np.uint8)])
    assert released == []

"""The data plane's native kernels (``tiers._native``, built from this
folder's C++ by the package's own build): batched page checksums, row
copies, row I/O and journal record identities, each one call per batch (the GIL given up for large batches and
for file I/O); the disk tier's slot-table bookkeeping (``slot_table.hpp``: per-slot flags, record checks and
stamps, and the gathers, scatters and concatenation below), which its threads do without giving up the GIL
as numpy does; and ``CopyWorker``, a thread that runs row copies without the GIL at all
(``runtime/copy_thread.py``).

``KVTIER_NATIVE_LIB`` names another build of the extension to load instead
(scripts/sanitize.sh points it at an AddressSanitizer build).
"""
from __future__ import annotations

import os
import sys
import weakref

import numpy as np

if os.environ.get("KVTIER_NATIVE_LIB") and "tiers._native" not in sys.modules:
    import importlib.util

    _spec = importlib.util.spec_from_file_location("tiers._native", os.environ["KVTIER_NATIVE_LIB"])
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _mod
    _spec.loader.exec_module(_mod)

from tiers._native import (CopyWorker, argsort_i64, bounds_i64, copy_rows, flags_any, flags_first_neither,  # noqa: E402
                           flags_select, flags_set, iota_u64, keep_gil_below, pread_rows, pwrite_all, pwrite_rows,
                           record_identities, records_current, records_frees, records_malformed, records_slots,
                           records_stamp_writes, release_pages, xxh64, xxh64_rows, RECORD_RULES)

__all__ = ["CopyWorker", "RECORD_RULES", "argsort_i64", "as_rows", "bounds_i64", "concat", "copy_rows",
           "drop_arrays", "flags_any", "flags_first_neither", "flags_select", "flags_set", "iota_u64", "keep_gil_below", "pread_rows",
           "pwrite_all", "pwrite_rows", "put", "record_identities", "records_current", "records_frees",
           "records_malformed", "records_slots", "records_stamp_writes", "take", "xxh64", "xxh64_rows"]

# -- numpy's gathers, scatters and concatenation, keeping the GIL ----------------------------------
# numpy gives the GIL up for an indexed copy of more than 500 elements; a disk thread then waits
# to get it back behind a busy event loop (slot_table.hpp). These move 1-D arrays' elements as
# byte rows through copy_rows, keeping the GIL below MOVE_KEEP_GIL_BELOW bytes (16,384 journal
# records: a group commit's; about 50 us of copying) on any thread. Indices are int64 and
# non-negative (IndexError otherwise: numpy would count a negative one from the end).
MOVE_KEEP_GIL_BELOW = 1 << 20


def as_rows(a: np.ndarray) -> np.ndarray:
    """A 1-D C-contiguous array's elements as rows of bytes (a view)."""
    if a.ndim != 1 or not a.flags.c_contiguous:
        raise ValueError("as_rows takes a 1-D C-contiguous array")
    return a.view(np.uint8).reshape(len(a), a.dtype.itemsize)


def take(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``a[idx]`` for a 1-D array and an int64 index array (IndexError for one out of range)."""
    out = np.empty(len(idx), dtype=a.dtype)
    if len(idx):
        copy_rows(as_rows(np.ascontiguousarray(a)), idx, as_rows(out), None, MOVE_KEEP_GIL_BELOW)
    return out


def put(a: np.ndarray, idx: np.ndarray, values: np.ndarray) -> None:
    """``a[idx] = values`` for a 1-D C-contiguous array, an int64 index array and as many values
    (of ``a``'s dtype, or cast to it); a repeated index gets its last value, as in numpy."""
    if len(values) != len(idx):
        raise ValueError(f"put: {len(values)} values for {len(idx)} indices")
    if len(idx):
        copy_rows(as_rows(np.ascontiguousarray(values, dtype=a.dtype)), None, as_rows(a), idx, MOVE_KEEP_GIL_BELOW)


def concat(parts: list, dtype) -> np.ndarray:
    """``np.concatenate(parts)`` for 1-D arrays of ``dtype``."""
    out = np.empty(sum(len(p) for p in parts), dtype=dtype)
    rows, at = as_rows(out), 0
    for p in parts:
        if len(p):
            copy_rows(as_rows(np.ascontiguousarray(p, dtype=dtype)), None, rows[at:at + len(p)], None,
                      MOVE_KEEP_GIL_BELOW)
            at += len(p)
    return out


DROP_MIN_BYTES = 1 << 20        # smaller arrays free fast enough (and may not hold a whole page)


def _refs(a: object) -> int:
    return sys.getrefcount(a)


def _sole_refs() -> int:
    """What ``_refs`` counts for an array popped from a list and held by one local name, on this
    interpreter: measured with the very code shape ``drop_arrays`` uses, so that a change in
    how an interpreter counts makes the check fail closed (nothing dropped), never open."""
    box = [bytearray(1)]
    a = box.pop()
    return _refs(a)


_SOLE_REFS = _sole_refs()


def drop_arrays(box: list) -> None:
    """Empty ``box``, a list of numpy arrays its caller gives up, and hand the
    pages of each large one back to the kernel without the GIL first: the free
    that follows (under the GIL, on whatever thread) is then cheap, and does
    not hold the event loop for milliseconds. An array is left as it is unless
    the list held its last reference (no name, view, container or weak
    reference besides), it owns its memory and is writable and C-contiguous."""
    while box:
        a = box.pop()
        if _refs(a) != _SOLE_REFS or weakref.getweakrefcount(a):
            continue
        flags = getattr(a, "flags", None)
        sole = flags is not None and a.nbytes >= DROP_MIN_BYTES and flags.owndata and flags.writeable \
            and flags.c_contiguous
        del flags                       # (it refers to ``a``)
        if sole:
            release_pages(a)

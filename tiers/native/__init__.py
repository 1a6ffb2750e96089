"""The data plane's native kernels (``tiers._native``, built from this
folder's C++ by the package's own build): batched page checksums, row
copies, row I/O and journal record identities, each one call per batch (the GIL given up for large batches and
for file I/O), the small array sort the disk tier needs without giving up the GIL, and ``CopyWorker``, a
thread that runs row copies without the GIL at all (``runtime/copy_thread.py``).

``KVTIER_NATIVE_LIB`` names another build of the extension to load instead
(scripts/sanitize.sh points it at an AddressSanitizer build).
"""
from __future__ import annotations

import os
import sys
import weakref

if os.environ.get("KVTIER_NATIVE_LIB") and "tiers._native" not in sys.modules:
    import importlib.util

    _spec = importlib.util.spec_from_file_location("tiers._native", os.environ["KVTIER_NATIVE_LIB"])
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _mod
    _spec.loader.exec_module(_mod)

from tiers._native import (CopyWorker, argsort_i64, copy_rows, keep_gil_below, pread_rows, pwrite_all, pwrite_rows,  # noqa: E402
                           record_identities, release_pages, xxh64, xxh64_rows)

__all__ = ["CopyWorker", "argsort_i64", "copy_rows", "drop_arrays", "keep_gil_below", "pread_rows", "pwrite_all",
           "pwrite_rows", "record_identities", "xxh64", "xxh64_rows"]

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

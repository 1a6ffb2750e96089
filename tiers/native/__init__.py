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

if os.environ.get("KVTIER_NATIVE_LIB") and "tiers._native" not in sys.modules:
    import importlib.util

    _spec = importlib.util.spec_from_file_location("tiers._native", os.environ["KVTIER_NATIVE_LIB"])
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _mod
    _spec.loader.exec_module(_mod)

from tiers._native import (CopyWorker, argsort_i64, copy_rows, keep_gil_below, pread_rows, pwrite_all, pwrite_rows,  # noqa: E402
                           record_identities, release_pages, xxh64, xxh64_rows)

__all__ = ["CopyWorker", "argsort_i64", "copy_rows", "drop_array", "keep_gil_below", "pread_rows", "pwrite_all",
           "pwrite_rows", "record_identities", "xxh64", "xxh64_rows"]

DROP_MIN_BYTES = 1 << 20        # smaller arrays free fast enough (and may not hold a whole page)


def drop_array(a) -> None:
    """Before the last reference to a large numpy array goes: hand its pages
    back to the kernel without the GIL, so that the free which follows (with
    the GIL, on whatever thread drops it) is cheap and the event loop is not
    held by it. Does nothing unless ``a`` owns its memory, is writable and
    C-contiguous, and only the caller refers to it (no view of it, no
    container holding it): its bytes are zeros after."""
    if sys.getrefcount(a) > 3:          # the caller's name, ``a`` and this call's: nothing else
        return
    flags = getattr(a, "flags", None)   # (it refers to ``a`` too)
    if flags is not None and a.nbytes >= DROP_MIN_BYTES and flags.owndata and flags.writeable \
            and flags.c_contiguous:
        del flags
        release_pages(a)

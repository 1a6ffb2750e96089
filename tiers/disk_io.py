"""System-call helpers of the disk tier (``tiers/disk.py``): vectored I/O carried to the end,
``OSError`` turned into the tier's typed errors, page-aligned buffers, directory syncs, the
msgpack of HEADER and the journals' headers, and the sizes that cut a batch's I/O into calls
(read as ``disk_io.NAME`` where they are used, so that one assignment here changes them all).
Nothing here knows slots or records."""
from __future__ import annotations

import errno
import mmap
import os
import shutil
from typing import Any, Callable

import msgpack
import numpy as np

from .errors import DiskFullError, TierIOError

ALIGN = 4096
PIECE_BYTES = 8 << 20            # one parallel pwritev/preadv covers at most this much (or one stride)
MAX_RUN_BYTES = 64 << 20         # one page-cache preadv covers at most this much (or one stride)
MIN_PIECE_BYTES = 1 << 20        # ... and a batch is not split finer than this across I/O threads
IO_THREADS = 4                   # parallel pieces of one batch (queue depth, and bounce copies overlap I/O)
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)     # the filesystem (or a limit) takes no more data
_EXT_BIGINT = 1


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, int):           # msgpack hands us ints outside 64 bits
        return msgpack.ExtType(_EXT_BIGINT, obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True))
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_BIGINT:
        return int.from_bytes(data, "little", signed=True)
    return msgpack.ExtType(code, data)


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_pack_default, use_bin_type=True)


def unpackb(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


def round_up(n: int, a: int) -> int:
    return -(-n // a) * a


def remove(path: str) -> None:
    """Remove a file, link or directory tree at ``path``."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def fsync_dir(path: str) -> None:
    """Make a directory's entries (a created, renamed or removed file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def typed_error(exc: OSError, what: str) -> OSError:
    msg = f"disk tier: {what}: {exc.strerror or exc}"
    if exc.errno in FULL_ERRNOS:
        return DiskFullError(exc.errno, msg)
    return TierIOError(exc.errno if exc.errno is not None else errno.EIO, msg)


def flatnonzero(mask: np.ndarray, step: int = 1 << 18) -> np.ndarray:
    """``np.flatnonzero`` a quarter million entries per call: a worker holds the GIL through
    each numpy call, and one over millions of slots stalls the event loop for milliseconds.
    (The result may be a view of a larger array.)"""
    if len(mask) <= step:
        return np.flatnonzero(mask)
    return np.concatenate([np.flatnonzero(mask[a:a + step]) + a for a in range(0, len(mask), step)])


def _vectored(op: Callable, fd: int, bufs: list, offset: int, short_ok: bool) -> int:
    """Run ``op`` (os.pwritev or os.preadv) until every buffer is done, at most
    IOV_MAX vectors a call; returns the bytes moved. ``short_ok``: stop at the
    end of the file instead of failing."""
    bufs = [memoryview(b).cast("B") for b in bufs]
    total, i = 0, 0
    while i < len(bufs):
        n = op(fd, bufs[i:i + IOV_MAX], offset)
        if n <= 0:
            if short_ok:
                break
            raise OSError(errno.EIO, f"{op.__name__} moved nothing")
        total += n
        offset += n
        while i < len(bufs) and n >= len(bufs[i]):
            n -= len(bufs[i])
            i += 1
        if n:
            bufs[i] = bufs[i][n:]
    return total


def pwritev_all(fd: int, bufs: list, offset: int) -> None:
    _vectored(os.pwritev, fd, bufs, offset, short_ok=False)


def preadv_all(fd: int, bufs: list, offset: int) -> int:
    """Fill ``bufs`` from ``offset``; returns the bytes read (short only at end of file)."""
    return _vectored(os.preadv, fd, bufs, offset, short_ok=True)


def aligned_buffer(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    mm = mmap.mmap(-1, round_up(max(nbytes, ALIGN), ALIGN))
    return mm, np.frombuffer(mm, dtype=np.uint8)


def first_difference(old: Any, new: Any, path: str) -> str | None:
    """The first difference between a directory's fingerprint and this store's, in words
    (``path``: where in the fingerprint); None if they are the same."""
    if isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(set(old) | set(new), key=repr):
            sub = f"{path}.{k}" if path else str(k)
            if k not in old:
                return f"key {sub!r} is new (the directory's fingerprint has no such key)"
            if k not in new:
                return f"key {sub!r} is missing (the directory's fingerprint has {old[k]!r})"
            d = first_difference(old[k], new[k], sub)
            if d:
                return d
        return None
    if isinstance(old, list) and isinstance(new, list):
        for i, (a, b) in enumerate(zip(old, new)):
            d = first_difference(a, b, f"{path}[{i}]")
            if d:
                return d
        if len(old) != len(new):
            return f"key {path!r} has {len(new)} items, the directory's has {len(old)}"
        return None
    if old != new or type(old) is not type(new):
        return f"key {path!r} differs: directory has {old!r}, this store has {new!r}"
    return None

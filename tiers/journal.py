"""The disk tier's journal format: fixed-width binary records in CRC'd frames.

A record is 64 bytes (``RECORD``, little-endian), so a frame's records are a
numpy array read straight from the file: replaying a million-page journal is
a few array operations, not a Python object per page. The same layout is
written by the native core (``runtime/core/disk_record.hpp``), which hands the
records of a migration batch over as one buffer; a test pins the two layouts
to each other.

Record fields::

    kind      0 = a page was written to ``slot``, 1 = ``slot`` was freed
    ktag      key form: 0 = int (128-bit two's complement in key_lo/key_hi),
              1..16 = bytes of that length (zero-padded), 255 = anonymous
              (an uncommitted page: never recovered)
    ptag      the parent key's form, 254 = no parent (the first block)
    priority  eviction priority (0..100)
    lc        life cycle index
    slot      slot in the group's segment
    depth     block index in its chain
    gen       generation: monotonic per directory, the last record of a slot wins;
              1..MAX_GEN (a larger one is malformed: it would leave no room to count on)
    csum      XXH64 of the page's bytes XOR its identity (see ``identity``)

Frames: ``<4s magic><u32 length><u32 crc32(payload)>`` then the payload. The
first frame of a journal is the header (magic ``KVJH``, a msgpack map); every
later frame (``KVJR``) holds whole records, applied all or nothing. The magic
lets a reader find the next frame after a damaged one, so damage costs only
the records of the frames it hits.
"""
from __future__ import annotations

import hashlib
import struct
import zlib
from typing import Iterable, NamedTuple

import numpy as np

from .errors import UsageError
from . import native
from .native import record_identities

RECORD = np.dtype([
    ("kind", "u1"), ("ktag", "u1"), ("ptag", "u1"), ("priority", "u1"), ("lc", "<u2"), ("_pad", "<u2"),
    ("slot", "<u4"), ("depth", "<u4"), ("gen", "<u8"), ("csum", "<u8"),
    ("key_lo", "<u8"), ("key_hi", "<u8"), ("parent_lo", "<u8"), ("parent_hi", "<u8"),
])
assert RECORD.itemsize == 64
# the fields the native kernels read and write, as they do (tiers/native/record_identity.hpp, slot_table.hpp)
if [RECORD.fields[f][:2] for f in ("kind", "ktag", "ptag", "priority", "lc", "slot", "gen", "csum", "key_lo", "key_hi")] != \
        [(np.dtype("u1"), 0), (np.dtype("u1"), 1), (np.dtype("u1"), 2), (np.dtype("u1"), 3), (np.dtype("<u2"), 4),
         (np.dtype("<u4"), 8), (np.dtype("<u8"), 16), (np.dtype("<u8"), 24), (np.dtype("<u8"), 32), (np.dtype("<u8"), 40)]:
    raise ImportError("journal.RECORD no longer matches tiers/native/record_identity.hpp and slot_table.hpp")
MAX_GEN = (1 << 62) - 1     # generations stay far below u8's end: a hostile 2**64-1 cannot stop writes
_ROW = np.dtype((np.void, RECORD.itemsize))    # a record as opaque bytes: numpy moves these at memcpy speed


def _indexed(idx) -> bool:
    return isinstance(idx, np.ndarray) and idx.dtype == np.int64 and idx.ndim == 1


def take(recs: np.ndarray, idx) -> np.ndarray:
    """``recs[idx]``, moved as whole rows (a structured gather copies field by field, 10x slower);
    for an int64 index array without giving up the GIL (``native.take``)."""
    if _indexed(idx) and recs.flags.c_contiguous:
        return native.take(recs, idx)
    return recs.view(_ROW)[idx].view(RECORD)


def put(dst: np.ndarray, idx, src: np.ndarray) -> None:
    """``dst[idx] = src``, moved as whole rows (for an int64 index array without giving up the GIL)."""
    if _indexed(idx) and dst.flags.c_contiguous:
        native.put(dst, idx, src)
    else:
        dst.view(_ROW)[idx] = src.view(_ROW)


def copy(recs: np.ndarray) -> np.ndarray:
    """A contiguous copy of ``recs``, moved as whole rows, without giving up the GIL below the
    thread's ``keep_gil_below``."""
    return native.concat([recs], RECORD)


def concat(parts: list[np.ndarray]) -> np.ndarray:
    return native.concat(parts, RECORD)


def rows(recs: np.ndarray) -> np.ndarray:
    """Records as (n, 64) uint8 rows, the form the native record kernels take (a view when
    contiguous)."""
    return native.as_rows(np.ascontiguousarray(recs))


def stamp_writes(recs: np.ndarray, slots: np.ndarray, first_gen: int, hashes: np.ndarray, fp: int) -> np.ndarray:
    """A copy of a caller's write records made the journal's: kind WRITE, ``slots`` (int64), the
    generations ``first_gen, first_gen + 1, ...`` and the checksums ``hashes ^ identity``."""
    return native.records_stamp_writes(rows(recs), slots, first_gen, hashes, fp).view(RECORD).reshape(-1)


def frees(slots: np.ndarray, gens: np.ndarray) -> np.ndarray:
    """FREE records of ``slots`` (int64) with generations ``gens`` (uint64)."""
    return native.records_frees(slots, gens).view(RECORD).reshape(-1)


WRITE, FREE = 0, 1
TAG_ANONYMOUS = 255          # ktag of an uncommitted page's record
TAG_NONE = 254               # ptag of a first block (no parent)
MAX_PRIORITY = 100
MAX_KEY_BYTES = 16           # a bytes key of up to this many bytes is kept as it is (tag = its length)
# the rules the native record kernels apply (tiers/native/slot_table.hpp: malformed, the stamps)
if native.RECORD_RULES != (WRITE, FREE, MAX_KEY_BYTES, TAG_ANONYMOUS, TAG_NONE, MAX_PRIORITY):
    raise ImportError("journal's record constants no longer match tiers/native/slot_table.hpp")

# a disk directory's format: 2: binary records, identity-bound XXH64 checksums (1: msgpack records, xxh3)
FORMAT_VERSION = 2
FRAME = struct.Struct("<4sII")
HEADER_MAGIC = b"KVJH"
RECORDS_MAGIC = b"KVJR"
FRAME_RECORDS = 4096         # records per frame when a journal is compacted: damage loses at most this many


class PageRecord(NamedTuple):
    """What the journal keeps about a page, as Python values (tests and tools;
    the store hands records over as ``RECORD`` arrays)."""
    key: int | bytes                  # block key; b"" marks an anonymous (uncommitted) page
    parent: int | bytes | None        # parent block key, None for the first block
    depth: int                        # block index in the chain (0 = first block)
    life_cycle: int                   # life cycle index
    priority: int = 35


# -- keys --------------------------------------------------------------------------------------------

_MASK64 = (1 << 64) - 1


def encode_key(key: int | bytes) -> tuple[int, int, int]:
    """(lo, hi, tag) of a block key in the core's form: ints in 128 bits,
    bytes up to 16 as they are, longer bytes as their BLAKE2b-128 digest."""
    if isinstance(key, bool) or not isinstance(key, (int, bytes)):
        raise UsageError(f"block keys must be int or bytes, got {key!r}")
    if isinstance(key, int):
        if not -(1 << 127) <= key < (1 << 127):
            raise UsageError(f"an int block key must fit in 128 bits, got {key!r}")
        v = key & ((1 << 128) - 1)
        return v & _MASK64, v >> 64, 0
    if not key:
        raise UsageError("block key b'' is reserved (the mark of an anonymous page)")
    if len(key) > MAX_KEY_BYTES:
        key = hashlib.blake2b(key, digest_size=MAX_KEY_BYTES).digest()
    raw = key.ljust(MAX_KEY_BYTES, b"\0")
    lo, hi = struct.unpack("<QQ", raw)
    return lo, hi, len(key)


def decode_key(lo: int, hi: int, tag: int) -> int | bytes:
    if tag == 0:
        v = (int(hi) << 64) | int(lo)
        return v - (1 << 128) if v >> 127 else v
    return struct.pack("<QQ", int(lo), int(hi))[:tag]


def encode(records: Iterable[PageRecord]) -> np.ndarray:
    """``RECORD`` rows (kind, slot, gen and csum left zero) for PageRecords."""
    records = list(records)
    out = np.zeros(len(records), dtype=RECORD)
    for i, r in enumerate(records):
        if not isinstance(r, PageRecord):
            raise UsageError(f"records must be PageRecord, got {type(r).__name__}")
        if isinstance(r.key, bytes) and not r.key:
            out[i]["ktag"] = TAG_ANONYMOUS
        else:
            lo, hi, tag = encode_key(r.key)
            out[i]["key_lo"], out[i]["key_hi"], out[i]["ktag"] = lo, hi, tag
        if r.parent is None:
            out[i]["ptag"] = TAG_NONE
        else:
            lo, hi, tag = encode_key(r.parent)
            out[i]["parent_lo"], out[i]["parent_hi"], out[i]["ptag"] = lo, hi, tag
        for name, v, top in (("depth", r.depth, 0xFFFFFFFF), ("lc", r.life_cycle, 0xFFFF),
                             ("priority", r.priority, MAX_PRIORITY)):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= top:
                raise UsageError(f"record {name} must be an int in [0, {top}], got {v!r}")
            out[i][name] = v
    return out


def decode(rec: np.void) -> PageRecord:
    key = b"" if rec["ktag"] == TAG_ANONYMOUS else decode_key(rec["key_lo"], rec["key_hi"], rec["ktag"])
    parent = None if rec["ptag"] == TAG_NONE else decode_key(rec["parent_lo"], rec["parent_hi"], rec["ptag"])
    return PageRecord(key, parent, int(rec["depth"]), int(rec["lc"]), int(rec["priority"]))


def as_records(records, n: int) -> np.ndarray:
    """A caller's records (a ``RECORD`` array or PageRecords) as a ``RECORD`` array of ``n`` rows."""
    if isinstance(records, np.ndarray) and records.dtype == RECORD:
        out = records
    elif isinstance(records, (bytes, bytearray, memoryview)):
        out = np.frombuffer(records, dtype=RECORD)
    else:
        out = encode(records)
    if len(out) != n:
        raise UsageError(f"{n} slots but {len(out)} records")
    return out


# -- identity ----------------------------------------------------------------------------------------

def fingerprint_hash(packed_fingerprint: bytes) -> int:
    """The layout fingerprint (as stored in HEADER) folded to 64 bits."""
    return int.from_bytes(hashlib.blake2b(packed_fingerprint, digest_size=8).digest(), "little")


def identity(recs: np.ndarray, fp: int) -> np.ndarray:
    """Per record, a 64-bit mix of what the page is: block key and its form,
    life cycle, and the directory's layout fingerprint. A record's ``csum`` is
    the page bytes' XXH64 XOR this, so a record that names another page's
    slot (keys swapped between slots, a stale or forged record) fails the
    check when the page is read, even though the bytes are intact. A relabel
    swaps one identity for another without reading the bytes.

    The mix is splitmix64's finalizer over (key form | life cycle << 8) ^ fp,
    then key_hi, then key_lo (``tiers/native/record_identity.hpp``): one native
    call per batch, where numpy took 27 array operations."""
    if not isinstance(recs, np.ndarray) or recs.dtype != RECORD or recs.ndim != 1:
        raise UsageError("identity takes a 1-D array of journal records (journal.RECORD)")
    return record_identities(rows(recs), fp)


# -- frames ------------------------------------------------------------------------------------------

_CRC_STEP = 4096       # zlib.crc32 gives up the GIL above 5 KiB; a disk thread then waits to get it back


def crc32(data: bytes | memoryview) -> int:
    """zlib's CRC-32 of ``data``, in steps small enough that the GIL is kept (a frame of a few
    hundred records takes microseconds; giving up the GIL cost a wait under a busy event loop)."""
    view = memoryview(data).cast("B")
    if len(view) <= _CRC_STEP:
        return zlib.crc32(view)
    crc = 0
    for a in range(0, len(view), _CRC_STEP):
        crc = zlib.crc32(view[a:a + _CRC_STEP], crc)
    return crc


def frame(magic: bytes, payload: bytes | memoryview) -> bytes:
    return FRAME.pack(magic, len(payload), crc32(payload)) + bytes(payload)


def malformed(recs: np.ndarray, stored: bool = True) -> np.ndarray:
    """Mask of records no writer produces: unknown kinds or key forms, a
    generation of 0 or beyond ``MAX_GEN``, a priority out of range. ``stored=False`` checks a
    caller's write records before the tier stamps kind and generation: their
    content only. One native pass (``tiers/native/slot_table.hpp``), the GIL kept."""
    return native.records_malformed(rows(recs), stored, MAX_GEN)
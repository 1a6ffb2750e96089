"""The disk journal's binary format: records, identity-bound checksums, and
what damaged or hostile metadata does to an open (issue 12, items 1-3)."""
from __future__ import annotations

import os
import struct
import zlib

import msgpack
import numpy as np
import pytest
import torch
import xxhash

from runtime import DiskConfig, GpuConfig, LayerSpec, Store, StoreConfig
from tiers import journal
from tiers.native import xxh64, xxh64_rows
from tiers.disk import DiskTier
from tiers.errors import ConfigError, CorruptPageError, UsageError
from tiers.journal import RECORD, PageRecord

GROUPS = [(4096, 64)]
FP = {"layout": "test"}


def page(key: int, width: int = 4096) -> np.ndarray:
    return np.random.default_rng(key).integers(0, 256, width, dtype=np.uint8)


def fill(path, keys=range(1, 17)) -> None:
    keys = list(keys)
    with DiskTier.open(str(path), FP, GROUPS) as tier:
        rows = torch.from_numpy(np.stack([page(k) for k in keys]))
        tier.write(0, list(range(len(keys))), rows, [PageRecord(k, None, 0, 0) for k in keys])


def records_frames(path) -> list[tuple[int, int]]:
    """(offset, length) of each records frame of group 0's journal."""
    data = open(os.path.join(path, "group-0.journal"), "rb").read()
    out, off = [], 0
    while off < len(data):
        magic, ln, _ = journal.FRAME.unpack_from(data, off)
        if magic == journal.RECORDS_MAGIC:
            out.append((off, ln))
        off += journal.FRAME.size + ln
    return out


def rewrite_frame(path, off: int, recs: np.ndarray) -> None:
    """Replace the frame at ``off`` by one holding ``recs`` with a valid CRC (same size)."""
    payload = recs.tobytes()
    with open(os.path.join(path, "group-0.journal"), "r+b") as f:
        f.seek(off)
        f.write(journal.frame(journal.RECORDS_MAGIC, payload))


def frame_records(path, off: int, ln: int) -> np.ndarray:
    data = open(os.path.join(path, "group-0.journal"), "rb").read()
    return np.frombuffer(data[off + journal.FRAME.size:off + journal.FRAME.size + ln], dtype=RECORD).copy()


# ---- the format ------------------------------------------------------------------------------------

def test_xxh64_matches_the_reference():
    rng = np.random.default_rng(0)
    for n in [*range(0, 70), 4095, 4096, 65537]:
        b = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        for seed in (0, 7, (1 << 64) - 1):
            assert xxh64(b, seed) == xxhash.xxh64_intdigest(b, seed=seed)
    rows = rng.integers(0, 256, (9, 100), dtype=np.uint8)
    assert xxh64_rows(rows).tolist() == [xxhash.xxh64_intdigest(r.tobytes()) for r in rows]
    idx = np.array([8, 0, 3])
    assert xxh64_rows(rows[:, 10:], idx).tolist() == [xxhash.xxh64_intdigest(rows[i, 10:].tobytes()) for i in idx]
    with pytest.raises(IndexError):
        xxh64_rows(rows, np.array([9]))


@pytest.mark.parametrize("key", [0, 1, -1, (1 << 127) - 1, -(1 << 127), 1 << 70, b"a", b"x" * 16, b"long" * 10])
def test_record_keys_round_trip(key):
    rec = journal.encode([PageRecord(key, 5, 3, 2, 60)])[0]
    back = journal.decode(rec)
    want = key if not (isinstance(key, bytes) and len(key) > 16) else \
        __import__("hashlib").blake2b(key, digest_size=16).digest()
    assert back == PageRecord(want, 5, 3, 2, 60)


@pytest.mark.parametrize("bad", [1 << 127, 1.5, "k", True, b""])
def test_unencodable_keys_are_refused(bad):
    with pytest.raises(UsageError):
        journal.encode_key(bad)


async def test_core_records_match_the_journal_layout(tmp_path):
    """The native core writes journal records itself (disk_record.hpp): what it wrote must decode to
    the block keys, parents and depths the store committed."""
    cfg = StoreConfig(layers=[LayerSpec(0, (("k", 64), ("v", 64)))], tokens_per_block=4,
                      gpu=GpuConfig(slots=8, device="cpu"), disk=DiskConfig(path=str(tmp_path), slots=64),
                      persist_on_close=True)
    keys = [b"k" * 20, -5, 1 << 100]
    async with Store.open(cfg) as store:
        for chain in ([keys[0], b"second"], [keys[1], keys[2], 7]):
            seq = await store.open_sequence(block_keys=chain, priority=70)
            await seq.extend(len(chain))
            seq.commit(len(chain))
            await seq.close()
    with DiskTier.open(str(tmp_path), store.layout.fingerprint(4, cfg.hash_salt), [(128, 64)]) as tier:
        got = {p.record.key: p.record for p in tier.recovered}
    digest = __import__("hashlib").blake2b(keys[0], digest_size=16).digest()
    assert got[digest] == PageRecord(digest, None, 0, 0, 70)
    assert got[b"second"] == PageRecord(b"second", digest, 1, 0, 70)
    assert got[-5] == PageRecord(-5, None, 0, 0, 70)
    assert got[1 << 100] == PageRecord(1 << 100, -5, 1, 0, 70)
    assert got[7] == PageRecord(7, 1 << 100, 2, 0, 70)


# ---- identity-bound checksums (12.1) ---------------------------------------------------------------

def _identity_reference(rec: np.void, fp: int) -> int:
    """The record identity as the format defines it, one record in plain Python ints."""
    m = (1 << 64) - 1

    def mix(x: int) -> int:
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & m
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & m
        return x ^ (x >> 31)
    x = mix((int(rec["ktag"]) | int(rec["lc"]) << 8) ^ fp)
    x = mix(x ^ int(rec["key_hi"]))
    return mix(x ^ int(rec["key_lo"]))


def test_record_identity_matches_the_format_and_stays_pinned():
    """Checksums on disk hold the identity: a change of its function would fail every page of an
    existing directory. Native against a plain-Python reference on random records (views and
    empty batches too), and five values pinned from the numpy implementation it replaced."""
    rng = np.random.default_rng(20261201)
    recs = np.zeros(300, dtype=journal.RECORD)
    recs.view(np.uint8)[:] = rng.integers(0, 256, recs.nbytes, dtype=np.uint8)
    for fp in (0, 1, 0xFEDCBA9876543210, (1 << 64) - 1):
        got = journal.identity(recs, fp)
        assert got.dtype == np.uint64 and [int(x) for x in got] == [_identity_reference(r, fp) for r in recs]
        assert [int(x) for x in journal.identity(recs[::7], fp)] == [int(x) for x in got[::7]]
    assert len(journal.identity(recs[:0], 5)) == 0
    assert [hex(int(x)) for x in journal.identity(recs[:5], 0xFEDCBA9876543210)] == [
        "0x1d8df7d2221dcfca", "0xeae5d4835d993e98", "0xd9353b3a2c880fa2", "0x61e8f8c576455900", "0xb223603fe2515d66"]


def test_swapped_keys_with_a_valid_crc_are_detected(tmp_path):
    """A frame with a valid CRC that swaps the block keys of two slots (each keeping its own
    checksum) used to make the store serve the wrong bytes for both blocks."""
    fill(tmp_path)
    (off, ln), = records_frames(tmp_path)
    recs = frame_records(tmp_path, off, ln)
    for f in ("key_lo", "key_hi"):
        recs[2][f], recs[5][f] = recs[5][f].copy(), recs[2][f].copy()
    rewrite_frame(tmp_path, off, recs)
    with DiskTier.open(str(tmp_path), FP, GROUPS) as tier:
        assert tier.record(0, 2).key == 6 and tier.record(0, 5).key == 3      # the records now lie
        out = torch.empty((16, 4096), dtype=torch.uint8)
        with pytest.raises(CorruptPageError) as e:
            tier.read(0, list(range(16)), out)
        assert e.value.slots == [2, 5]
        for s in range(16):
            if s not in (2, 5):
                assert np.array_equal(out[s].numpy(), page(s + 1))
        assert tier.live_slots(0) == [s for s in range(16) if s not in (2, 5)]


def test_a_record_from_another_layout_fails_its_check(tmp_path):
    fill(tmp_path)
    os.rename(os.path.join(tmp_path, "HEADER"), os.path.join(tmp_path, "HEADER.old"))
    with open(os.path.join(tmp_path, "HEADER"), "wb") as f:        # the same directory claimed by another layout
        head = msgpack.unpackb(open(os.path.join(tmp_path, "HEADER.old"), "rb").read())
        head["fingerprint"] = {"layout": "other"}
        f.write(msgpack.packb(head))
    with DiskTier.open(str(tmp_path), {"layout": "other"}, GROUPS) as tier:
        with pytest.raises(CorruptPageError):
            tier.read(0, [0], torch.empty((1, 4096), dtype=torch.uint8))


def test_relabel_keeps_the_check_valid(tmp_path):
    with DiskTier.open(str(tmp_path), FP, GROUPS) as tier:
        tier.write(0, [3], torch.from_numpy(page(9)[None]), [PageRecord(b"", None, 0, 0)])
        tier.relabel(0, [3], [PageRecord(99, None, 0, 0)])
    with DiskTier.open(str(tmp_path), FP, GROUPS) as tier:
        out = torch.empty((1, 4096), dtype=torch.uint8)
        tier.read(0, [3], out)
        assert np.array_equal(out[0].numpy(), page(9)) and tier.record(0, 3).key == 99


# ---- hostile metadata never stops a start (12.2) -----------------------------------------------------

def test_hostile_records_are_skipped_and_reported(tmp_path):
    fill(tmp_path)
    (off, ln), = records_frames(tmp_path)
    recs = frame_records(tmp_path, off, ln)
    recs[0]["slot"] = 0xFFFFFFFF            # slot -1
    recs[1]["kind"] = 7                     # no such record kind
    recs[2]["ktag"] = 99                    # no such key form
    recs[3]["gen"] = 0                      # no writer uses generation 0
    rewrite_frame(tmp_path, off, recs)
    with DiskTier.open(str(tmp_path), FP, GROUPS) as tier:
        assert sorted(p.slot for p in tier.recovered) == list(range(4, 16))
        reasons = " | ".join(e[2] for e in tier.journal_errors)
        assert "3 malformed record(s) skipped" in reasons
        assert [d[:2] for d in tier.discarded] == [(0, 0xFFFFFFFF)]
        out = torch.empty((12, 4096), dtype=torch.uint8)
        tier.read(0, list(range(4, 16)), out)
        assert all(np.array_equal(out[i].numpy(), page(s + 1)) for i, s in enumerate(range(4, 16)))


@pytest.mark.parametrize("forged", ["record", "header"])
def test_a_forged_huge_generation_does_not_stop_writes(tmp_path, forged):
    """A generation near u8's end (in a record or as the header's next_gen) would leave the tier
    unable to number its next write: the record is malformed, the header a bad one."""
    fill(tmp_path)
    jpath = os.path.join(tmp_path, "group-0.journal")
    if forged == "record":
        (off, ln), = records_frames(tmp_path)
        recs = frame_records(tmp_path, off, ln)
        recs[0]["gen"] = (1 << 64) - 1
        rewrite_frame(tmp_path, off, recs)
    else:
        data = open(jpath, "rb").read()
        magic, ln, _ = journal.FRAME.unpack_from(data, 0)
        head = msgpack.unpackb(data[journal.FRAME.size:journal.FRAME.size + ln])
        head["next_gen"] = 1 << 63
        with open(jpath, "wb") as f:
            f.write(journal.frame(journal.HEADER_MAGIC, msgpack.packb(head)) + data[journal.FRAME.size + ln:])
    with DiskTier.open(str(tmp_path), FP, GROUPS) as tier:
        assert tier.journal_errors
        tier.write(0, [20], torch.from_numpy(page(77)[None]), [PageRecord(77, None, 0, 0)])
    with DiskTier.open(str(tmp_path), FP, GROUPS) as tier:
        assert tier.record(0, 20).key == 77


def test_a_journal_of_near_miss_frames_opens_with_linear_reads(tmp_path, monkeypatch):
    """Megabytes of records magics with impossible lengths: each candidate is charged to the
    resync budget and searched in the window already read, so the bytes read stay linear in
    the file's size (re-reading a 4 MiB window per candidate read terabytes)."""
    import tiers.disk as disk
    fill(tmp_path)
    jpath = os.path.join(tmp_path, "group-0.journal")
    with open(jpath, "ab") as f:
        f.write(struct.pack("<4sII", journal.RECORDS_MAGIC, 0xFFFFFFF0, 0) * (3 << 18))  # 9 MiB
    read = [0]
    real = os.pread

    def counting(fd, n, off):
        data = real(fd, n, off)
        read[0] += len(data)
        return data
    monkeypatch.setattr(disk.os, "pread", counting)
    with DiskTier.open(str(tmp_path), FP, GROUPS) as tier:
        assert len(tier.recovered) == 16 and tier.journal_errors
    assert read[0] < 4 * os.path.getsize(jpath) + (64 << 20)


def test_a_frame_of_msgpack_maps_is_skipped(tmp_path):
    """A frame whose payload is not records (the old format's maps, say) ends in KeyError no more."""
    fill(tmp_path)
    jpath = os.path.join(tmp_path, "group-0.journal")
    with open(jpath, "ab") as f:
        payload = msgpack.packb([{"slot": 1}] * 4)
        f.write(struct.pack("<4sII", journal.RECORDS_MAGIC, len(payload), zlib.crc32(payload)) + payload)
    with DiskTier.open(str(tmp_path), FP, GROUPS) as tier:
        assert len(tier.recovered) == 16 and tier.journal_errors


@pytest.mark.parametrize("groups", [[[]], [5], [[4096]], [["x", 1]], "nope"])
def test_a_malformed_header_is_a_mismatch(tmp_path, groups):
    fill(tmp_path)
    with open(os.path.join(tmp_path, "HEADER"), "wb") as f:
        f.write(msgpack.packb({"format": 2, "fingerprint": FP, "groups": groups}))
    with pytest.raises(ConfigError, match="on_mismatch='wipe'"):
        DiskTier.open(str(tmp_path), FP, GROUPS)
    with DiskTier.open(str(tmp_path), FP, GROUPS, on_mismatch="wipe") as tier:
        assert tier.recovered == []
        tier.write(0, [0], torch.from_numpy(page(1)[None]), [PageRecord(1, None, 0, 0)])


@pytest.mark.parametrize("name", ["group-0.journal", "group-0.seg", "HEADER"])
def test_a_directory_in_place_of_a_file(tmp_path, name):
    fill(tmp_path)
    path = os.path.join(tmp_path, name)
    os.unlink(path)
    os.makedirs(os.path.join(path, "inner"))
    with pytest.raises(ConfigError) as e:
        DiskTier.open(str(tmp_path), FP, GROUPS)
    assert name in str(e.value)
    with DiskTier.open(str(tmp_path), FP, GROUPS, on_mismatch="wipe") as tier:
        tier.write(0, [0], torch.from_numpy(page(1)[None]), [PageRecord(1, None, 0, 0)])
        if name == "group-0.journal":
            assert tier.recovered[0].slot == 0
    with DiskTier.open(str(tmp_path), FP, GROUPS) as tier:
        assert 0 in tier.live_slots(0)


def test_records_a_caller_cannot_hand_over(tmp_path):
    with DiskTier.open(str(tmp_path), FP, GROUPS) as tier:
        row = torch.from_numpy(page(1)[None])
        with pytest.raises(UsageError):
            tier.write(0, [0], row, [PageRecord(1, None, 0, 0, priority=101)])
        bad = journal.encode([PageRecord(1, None, 0, 0)])
        bad["ktag"] = 77
        with pytest.raises(UsageError):
            tier.write(0, [0], row, bad)
        with pytest.raises(UsageError):
            tier.write(0, [0], row, journal.encode([PageRecord(1, None, 0, 0)] * 2))
        assert tier.live_slots(0) == []


# ---- accounting (12.4) -----------------------------------------------------------------------------

async def test_unreachable_pages_count_as_orphaned_and_recovery_logs_a_summary(tmp_path, caplog):
    """Pages whose prefix root never reached the disk (a SIGKILL while the root was on the GPU) are
    orphaned, not 'discarded', and the restart says so in one INFO line."""
    cfg = StoreConfig(layers=[LayerSpec(0, (("k", 64), ("v", 64)))], tokens_per_block=4,
                      gpu=GpuConfig(slots=8, device="cpu"), disk=DiskConfig(path=str(tmp_path), slots=64),
                      persist_on_close=False)
    async with Store.open(cfg) as store:
        fp = store.layout.fingerprint(4, cfg.hash_salt)
    with DiskTier.open(str(tmp_path), fp, [(128, 64)]) as tier:     # blocks 2..4 of chain 1 -> 2 -> 3 -> 4
        rows = torch.from_numpy(np.stack([page(k, 128) for k in (2, 3, 4)]))
        tier.write(0, [0, 1, 2], rows, [PageRecord(2, 1, 1, 0), PageRecord(3, 2, 2, 0), PageRecord(4, 3, 3, 0)])
        tier.write(0, [3], torch.from_numpy(page(7, 128)[None]), [PageRecord(7, None, 0, 0)])
    with caplog.at_level("INFO", logger="kvtier"):
        async with Store.open(cfg) as store:
            st = store.stats()
            assert (st["recovered_pages"], st["orphaned_pages"], st["discarded_pages"]) == (1, 3, 0)
            seq = await store.open_sequence(block_keys=[7])
            assert seq.matched_blocks == 1
            await seq.close()
    line = [r.getMessage() for r in caplog.records if "recovered" in r.getMessage() and r.levelname == "INFO"]
    assert len(line) == 1 and "recovered 1 pages" in line[0] and "3 orphaned" in line[0]


def test_a_quota_beyond_the_free_space_warns_at_open(tmp_path, caplog):
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    with caplog.at_level("WARNING", logger="kvtier.disk"):
        with DiskTier.open(str(tmp_path), FP, [(4096, free // 4096 + (1 << 20))]) as tier:
            assert tier.stats["quota_beyond_free_bytes"] > 0
    assert "the quota needs" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvtier.disk"):
        with DiskTier.open(str(tmp_path), FP, [(4096, 16)]) as tier:
            assert tier.stats["quota_beyond_free_bytes"] == 0
    assert "the quota needs" not in caplog.text

"""Copies between the GPU and host slabs through a staging buffer on the GPU
(runtime/migration.py: ``copy_rows``, ``_staging_plan``, ``_copy_via_device``,
``gather``): one gather or scatter kernel on the device's side and a copy per
run of the host's slots, instead of a copy per run consecutive on both sides.

The staging path is device-agnostic torch: here it runs with the slab of the
"device" on the test device (the CPU unless ``KVTIER_TEST_DEVICE=cuda``), so
the slicing is checked byte for byte on every machine; on a GPU the same tests
run the CUDA kernels and copies. ``copy_rows``'s choice (staging, run copies,
the byte cap, the fallback when the GPU is out of memory) runs on any machine
with a CPU tensor counted as device memory."""
from __future__ import annotations

import random
import time

import pytest
import torch

from runtime import migration
from runtime.migration import _copy_via_device, _joint_runs, _runs, _staging_plan, copy_rows, gather

from helpers import DEVICE

DEV = torch.device(DEVICE)
ROWS, WIDTH = 256, 96


def _sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def _host_slab(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (ROWS, WIDTH), dtype=torch.uint8, generator=g)


def _slots(rng: random.Random, n: int, contiguous: bool) -> list[int]:
    if contiguous:
        first = rng.randrange(ROWS - n)
        return list(range(first, first + n))
    return sorted(rng.sample(range(ROWS), n))


def test_joint_runs_break_where_either_side_breaks():
    assert _joint_runs([1, 2, 3, 7, 8], [10, 11, 13, 14, 15]) == [(0, 2), (2, 1), (3, 2)]
    assert _joint_runs([], []) == []
    assert _runs([4, 5, 9]) == [(0, 4, 2), (2, 9, 1)]


def test_staging_on_the_device_only_where_it_at_least_halves_the_copies():
    scattered = list(range(0, 64, 2))                  # 32 runs on the device's side
    host_run = list(range(100, 132))                   # one run on the host's
    assert _staging_plan(_joint_runs(scattered, host_run), host_run) == [(0, 100, 32)]
    host_scattered = list(range(100, 164, 2))
    assert _staging_plan(_joint_runs(scattered, host_scattered), host_scattered) is None
    few = [0, 2, 4]                                    # three copies: as they are
    assert _staging_plan(_joint_runs(few, [0, 1, 2]), [0, 1, 2]) is None
    # 8 joint runs: 3 host runs (+ the index's upload and the kernel) stage, 4 do not
    dev8 = [0, 2, 4, 6, 8, 10, 12, 14]
    host3 = [0, 1, 2, 4, 5, 6, 8, 9]
    host4 = [0, 1, 3, 4, 6, 7, 9, 10]
    assert len(_joint_runs(dev8, host3)) == len(_joint_runs(dev8, host4)) == 8
    assert _staging_plan(_joint_runs(dev8, host3), host3) == [(0, 0, 3), (3, 4, 3), (6, 8, 2)]
    assert _staging_plan(_joint_runs(dev8, host4), host4) is None


@pytest.mark.parametrize("seed", range(6))
def test_device_to_host_through_a_gather_lands_every_byte(seed):
    rng = random.Random(seed)
    n = rng.randrange(8, 120)
    src_host = _host_slab(seed)
    src = src_host.to(DEV)
    dst = torch.zeros((ROWS, WIDTH), dtype=torch.uint8)
    src_slots = _slots(rng, n, contiguous=False)
    dst_slots = _slots(rng, n, contiguous=seed % 2 == 0)
    _copy_via_device(src, src_slots, dst, dst_slots, _runs(dst_slots), to_host=True)
    _sync()
    assert torch.equal(dst[dst_slots], src_host[src_slots])
    untouched = sorted(set(range(ROWS)) - set(dst_slots))
    assert not dst[untouched].any()                    # nothing written past the batch's slots


@pytest.mark.parametrize("seed", range(6))
def test_host_to_device_through_a_scatter_lands_every_byte(seed):
    rng = random.Random(100 + seed)
    n = rng.randrange(8, 120)
    src = _host_slab(seed)
    dst = torch.zeros((ROWS, WIDTH), dtype=torch.uint8, device=DEV)
    src_slots = _slots(rng, n, contiguous=seed % 2 == 0)
    dst_slots = _slots(rng, n, contiguous=False)
    _copy_via_device(src, src_slots, dst, dst_slots, _runs(src_slots), to_host=False)
    _sync()
    got = dst.cpu()
    assert torch.equal(got[dst_slots], src[src_slots])
    untouched = sorted(set(range(ROWS)) - set(dst_slots))
    assert not got[untouched].any()


@pytest.mark.skipif(DEVICE != "cuda", reason="copy_rows and gather take the staging path across devices only")
@pytest.mark.parametrize("contiguous_host", [True, False])
def test_copy_rows_and_gather_across_devices_land_every_byte(contiguous_host):
    rng = random.Random(7)
    host = _host_slab(7).pin_memory()
    gpu = _host_slab(8).to(DEV)
    expect_gpu = gpu.cpu()
    for _ in range(20):
        n = rng.randrange(4, 100)
        gpu_slots = _slots(rng, n, contiguous=False)
        host_slots = _slots(rng, n, contiguous=contiguous_host)
        copy_rows(gpu, gpu_slots, host, host_slots)                  # down
        _sync()
        assert torch.equal(host[host_slots], expect_gpu[gpu_slots])
        back = _slots(rng, n, contiguous=False)
        copy_rows(host, host_slots, gpu, back)                       # up
        _sync()
        expect_gpu[back] = host[host_slots]
        assert torch.equal(gpu.cpu(), expect_gpu)
        out = torch.empty((n, WIDTH), dtype=torch.uint8).pin_memory()
        gather(gpu, gpu_slots, torch.device("cpu"), out=out)        # GPU rows into a disk write's staging
        _sync()
        assert torch.equal(out, expect_gpu[gpu_slots])


async def test_the_move_benchmark_fills_every_slot_and_checks_every_page_it_moved(tmp_path, monkeypatch):
    """``bench_moves`` on a full store (its GPU as large as its pages, where a background reserve
    once claimed pages under the benchmark's own moves) in scattered batches; its check of the
    pages that come back catches one flipped byte, and one copy up that never happened."""
    from tiers.errors import CorruptPageError
    from runtime.tools.bench import bench_moves
    for sub in "abc":
        (tmp_path / sub).mkdir()
    rows = await bench_moves(4 << 10, 2048, str(tmp_path / "a"), scattered=True)
    by_name = {r["bench"]: r for r in rows}
    for direction in ("gpu->host", "host->gpu", "host->disk", "disk->host"):
        row = by_name[f"{direction} 4 KiB pages, scattered"]
        assert row["value"] > 0 and row["baseline"] > 0
    real, flipped = migration.copy_rows, []

    def corrupting(src, src_slots, dst, dst_slots):
        real(src, src_slots, dst, dst_slots)
        if not flipped:
            if torch.cuda.is_available():
                torch.cuda.synchronize()                # the copy has landed: the flip is not overwritten
            dst[dst_slots[0], 0] ^= 1
            flipped.append(dst_slots[0])
    monkeypatch.setattr(migration, "copy_rows", corrupting)
    with pytest.raises(CorruptPageError, match="came back changed"):
        await bench_moves(4 << 10, 2048, str(tmp_path / "b"))
    assert flipped
    gpu, into_gpu = [], []

    def dropping(src, src_slots, dst, dst_slots):
        gpu[:] = gpu or [src]                     # the first copy is the warm-up's, from the GPU
        if dst is gpu[0]:
            into_gpu.append(len(dst_slots))
            if len(into_gpu) == 2048 // 64 + 1:   # the first copy up of the timed pass: lost
                return
        real(src, src_slots, dst, dst_slots)
    monkeypatch.setattr(migration, "copy_rows", dropping)
    with pytest.raises(CorruptPageError, match="came back changed"):
        await bench_moves(4 << 10, 2048, str(tmp_path / "c"))
    assert len(into_gpu) == 2 * 2048 // 64


@pytest.fixture
def as_device(monkeypatch):
    """Makes ``copy_rows`` treat the tensors passed in as device memory (``migration._host``
    gives None for them), so that its cross-device branch runs on any machine."""
    devices: list[torch.Tensor] = []
    real = migration._host
    monkeypatch.setattr(migration, "_staging_off_until", 0.0)     # no pause left by an earlier test
    monkeypatch.setattr(migration, "_host", lambda t: None if any(t is d for d in devices) else real(t))
    return devices.append


@pytest.fixture
def staged(monkeypatch) -> list:
    """The calls that went through the device's staging buffer."""
    calls, real = [], migration._copy_via_device

    def spy(*args, **kw):
        calls.append(kw["to_host"])
        real(*args, **kw)
    monkeypatch.setattr(migration, "_copy_via_device", spy)
    return calls


def _cross_copy(rng: random.Random, as_device, n: int, host_contiguous: bool):
    """A down copy then an up copy between a "device" slab and a host slab; both checked."""
    dev, host = _host_slab(1), torch.zeros((ROWS, WIDTH), dtype=torch.uint8)
    as_device(dev)
    expect = dev.clone()
    dev_slots, host_slots = _slots(rng, n, contiguous=False), _slots(rng, n, contiguous=host_contiguous)
    copy_rows(dev, dev_slots, host, host_slots)
    assert torch.equal(host[host_slots], expect[dev_slots])
    back = _slots(rng, n, contiguous=False)
    copy_rows(host, host_slots, dev, back)
    expect[back] = host[host_slots]
    assert torch.equal(dev, expect)


def test_copy_rows_stages_on_the_device_when_the_host_side_is_in_runs(as_device, staged):
    _cross_copy(random.Random(3), as_device, 64, host_contiguous=True)
    assert staged == [True, False]                     # down through a gather, up through a scatter


def test_copy_rows_copies_run_by_run_when_staging_would_not_halve_the_copies(as_device, staged):
    _cross_copy(random.Random(4), as_device, 64, host_contiguous=False)
    assert staged == []


def test_copy_rows_stages_no_more_than_its_byte_cap(as_device, staged, monkeypatch):
    monkeypatch.setattr(migration, "GATHER_MAX_BYTES", 63 * WIDTH)
    _cross_copy(random.Random(5), as_device, 64, host_contiguous=True)
    assert staged == []


def test_copy_rows_falls_back_to_run_copies_when_the_device_is_out_of_memory(as_device, monkeypatch):
    """Out of memory: this copy goes run by run, and so do the next ones for a while (each try
    would free torch's cache and wait for the device); then staging is tried again."""
    tried = []

    def full(*args, **kw):
        tried.append(kw["to_host"])
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
    monkeypatch.setattr(migration, "_copy_via_device", full)
    monkeypatch.setattr(migration, "STAGING_OOM_PAUSE", 3600.0)
    _cross_copy(random.Random(6), as_device, 64, host_contiguous=True)
    assert tried == [True]                             # the copy up, in the pause, did not try
    monkeypatch.setattr(migration, "_staging_off_until", time.monotonic() - 1)
    _cross_copy(random.Random(7), as_device, 64, host_contiguous=True)
    assert tried == [True, True]


def test_the_device_gather_moves_eight_bytes_an_element_where_rows_allow():
    rows = _host_slab(9)
    assert migration._wide(rows).dtype == torch.int64
    assert migration._wide(rows[:, 1:]).dtype == torch.uint8          # not contiguous
    assert migration._wide(torch.zeros((4, 12), dtype=torch.uint8)).dtype == torch.uint8
    slots = [5, 1, 200, 7]
    got = migration._gather_on_device(rows, slots)
    assert got.dtype == torch.uint8 and torch.equal(got, rows[slots])


def test_gather_of_scattered_device_rows_into_a_host_buffer_is_one_kernel_and_one_copy(as_device, monkeypatch):
    """The disk's path from the GPU: rows of a device slab into a spill's host staging."""
    dev = _host_slab(10)
    as_device(dev)
    used, real = [], migration._gather_on_device
    monkeypatch.setattr(migration, "_gather_on_device", lambda *a: used.append(1) or real(*a))
    rng = random.Random(11)
    for n, expect_kernel in ((64, True), (3, False)):   # three runs or fewer: copied as they are
        slots = _slots(rng, n, contiguous=False)
        out = torch.zeros((n, WIDTH), dtype=torch.uint8)
        assert gather(dev, slots, torch.device("cpu"), out=out) is out
        assert torch.equal(out, dev[slots])
        assert bool(used) == expect_kernel
        used.clear()

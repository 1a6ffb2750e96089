"""Small builders shared by the runtime tests."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import asyncio
import threading
import time
from typing import Callable

import torch

from runtime import DiskConfig, GpuConfig, HostConfig, LayerSpec, ReusePolicy, StoreConfig
from runtime.tools.content import key_seed, pattern


DEVICE = os.environ.get("KVTIER_TEST_DEVICE", "cpu")    # scripts/gpu_check.py sets "cuda"


def half_inline_layers() -> list[LayerSpec]:
    """One layer of pages half the emulated copies' inline limit (migration.INLINE_BYTES): a move
    of one or two pages runs on the loop, a move of three or more on the native copy thread or,
    after ``engine.stop_copier()``, on its stream's thread (where a test can hold it)."""
    from runtime import migration
    half = migration.INLINE_BYTES // 4
    return [LayerSpec(0, (("k", half), ("v", half)))]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_until_killed(code: str, args: list[str], stop: Callable[[list[str]], bool], delay: float = 0.0,
                     deadline: float = 60.0) -> tuple[list[str], float]:
    """Run ``code`` in a child Python (the repository on its path) until ``stop(lines)`` holds for
    the lines read so far, sleep ``delay``, SIGKILL it: a real crash. Returns every complete line it
    printed (those after the last one read too) and the parent's monotonic time of the kill."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryFile() as errf:
        child = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=errf,
                                 cwd=ROOT, env=env)
        watchdog = threading.Timer(deadline, child.kill)    # a hung child fails the test, never stalls it
        watchdog.start()
        lines: list[str] = []
        killed_at = 0.0
        try:
            while not stop(lines):
                line = child.stdout.readline()
                if not line:
                    child.wait()
                    errf.seek(0)
                    raise AssertionError(f"child ended early (rc {child.returncode}): "
                                         f"{errf.read().decode()[-3000:]}")
                lines.append(line.decode())
            time.sleep(delay)
            os.kill(child.pid, signal.SIGKILL)
            killed_at = time.monotonic()
        finally:
            watchdog.cancel()
            if child.poll() is None:
                child.kill()
            # what it printed before dying: read through the same buffered reader (it may hold some already)
            rest = child.stdout.read()
            child.stdout.close()
            child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    lines += [ln + "\n" for ln in rest.decode().split("\n")[:-1]]   # complete lines printed before the kill
    return lines, killed_at


def config(gpu=8, host=None, disk=None, disk_dir=None, tpb=4, layers=None, codec="concat", **kw) -> StoreConfig:
    layers = layers or [LayerSpec(0, (("k", 256), ("v", 256)))]
    return StoreConfig(
        layers=layers, tokens_per_block=tpb, gpu=GpuConfig(slots=gpu, device=DEVICE),
        host=HostConfig(slots=host, codec=codec) if host else None,
        disk=DiskConfig(path=str(disk_dir), slots=disk, fsync=False) if disk else None, **kw)


def two_life_cycles(window_reuse=ReusePolicy.SINK_REQUIRED_ONLY, window=8, sinks=4):
    kv = (("k", 128), ("v", 128))
    return [LayerSpec(0, kv), LayerSpec(1, kv, window_tokens=window, sink_tokens=sinks, reuse=window_reuse)]


def write_blocks(store, seq, blocks, tag=0) -> None:
    """Write deterministic bytes into every layer's pools for ``blocks``."""
    for lc in store.lcs:
        off = 0
        for layer, role, size in lc.buffers:
            view = store.pool_tensor(layer, role)
            idx = seq.page_indices(layer)
            for b in blocks:
                if idx[b] >= 0:
                    data = pattern([key_seed(seq.keys[b], lc.index) + tag], lc.page_bytes)[0]
                    view[idx[b]] = data[off:off + size]
            off += size


def read_block(store, seq, layer_lc, b) -> torch.Tensor:
    lc = store.lcs[layer_lc]
    parts = []
    for layer, role, size in lc.buffers:
        parts.append(store.pool_tensor(layer, role)[seq.page_indices(layer)[b]].cpu())
    return torch.cat(parts)


def expected_block(store, seq, lc, b, tag=0) -> torch.Tensor:
    return pattern([key_seed(seq.keys[b], lc) + tag], store.lcs[lc].page_bytes)[0]


async def fill(store, tokens, n_blocks=None, priority=None):
    """One request: open, acquire, extend the rest, write, commit, close."""
    seq = await store.open_sequence(tokens=tokens, priority=priority)
    try:
        await seq.acquire()
        start = seq.num_blocks
        n = len(seq.keys) if n_blocks is None else n_blocks
        await seq.extend(n - start)
        write_blocks(store, seq, range(start, n))
        seq.commit(n)
        await seq.release()
    finally:
        await seq.close()
    return seq


async def fill_and_hold_writer(store, bases, n_blocks=4) -> threading.Event:
    """Fill ``bases`` (``n_blocks`` each), then hold the disk write thread with a job that
    waits for the returned gate (the caller sets it, in a ``finally``)."""
    for base in bases:
        await fill(store, toks(base, n_blocks))
    gate = threading.Event()
    store.engine.io_write.submit(gate.wait)
    return gate


async def prefill_keys(store, keys) -> int:
    """One metadata-only request on block keys (no page content), as the
    benchmark replays a trace; returns its matched blocks."""
    seq = await store.open_sequence(block_keys=keys)
    await seq.acquire()
    await seq.extend(len(keys) - seq.num_blocks)
    seq.commit(len(keys))
    await seq.release()
    await seq.close()
    return seq.matched_blocks


def toks(base, n_blocks, tpb=4):
    return [base * 100000 + i for i in range(n_blocks * tpb)]


async def acquire_while_held(store, stream, tokens) -> dict:
    """Open and acquire ``tokens`` while another job holds ``stream``'s worker thread: the
    acquire must finish without that thread (on the loop). Checks every matched page's bytes,
    releases, closes, lets the thread go and checks the store; returns what the sequence
    matched by tier."""
    gate = threading.Event()
    busy = stream.submit(gate.wait)
    try:
        seq = await store.open_sequence(tokens=tokens)
        await asyncio.wait_for(seq.acquire(), 5)
        assert not busy.query()
        for b in range(seq.matched_blocks):
            assert torch.equal(read_block(store, seq, 0, b), expected_block(store, seq, 0, b))
        await seq.release()
        await seq.close()
    finally:
        gate.set()
    busy.synchronize(5)
    store.check_consistency()
    return seq.matched_by_tier


async def read_all(store, base, n=4):
    """Acquire base's prefix; returns (matched, recomputed) after checking every page kept."""
    seq = await store.open_sequence(tokens=toks(base, n))
    try:
        matched = seq.matched_blocks
        await seq.acquire()
        redo = seq.recompute_blocks(0)
        for b in range(matched):
            if b not in redo:
                assert torch.equal(read_block(store, seq, 0, b), expected_block(store, seq, 0, b))
        await seq.release()
    finally:
        await seq.close()
    return matched, redo


async def check_seq(store, base, n=4) -> int:
    """Open ``toks(base, n)``, acquire, assert every matched block reads back its key's bytes;
    returns the matched blocks."""
    seq = await store.open_sequence(tokens=toks(base, n))
    matched = seq.matched_blocks
    try:
        await seq.acquire()
        for b in range(matched):
            got, want = read_block(store, seq, 0, b), expected_block(store, seq, 0, b)
            assert torch.equal(got, want), f"sequence {base} block {b}: wrong bytes served"
    finally:
        await seq.close()
    return matched

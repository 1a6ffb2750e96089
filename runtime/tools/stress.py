"""``kvtier stress``: random concurrent sequences with shared prefixes under
memory pressure in every tier, random priorities, suspends and resumes,
store restarts on the same disk directory, disk scrubs running beside the
requests and, with ``faults``, injected I/O errors and cancellations. Every
page that comes back is checked against the bytes written when it was
computed.

Reported: ``corrupt`` (a page served with wrong bytes), ``lost`` (a page the
disk tier held durably at a restart that the new store does not serve, other
than ones it reports discarded), ``leaked_slots`` (slots in use that no page
owns, or pages still held once every sequence closed).
"""
from __future__ import annotations

import asyncio
import collections
import errno
import random
import tempfile

from tiers.config import DiskConfig, GpuConfig, HostConfig, StoreConfig
from tiers.errors import KvtierError, TierIOError
from tiers.layers import LayerSpec
from tiers.policy import ReusePolicy

from ..pages import DISK
from ..store import Store
from ..views import page_view
from .replay import PageWriter

TPB = 4


def stress_config(disk_dir: str, write: str = "back", host_write: str = "back") -> StoreConfig:
    kv = (("k", 512), ("v", 512))
    layers = [LayerSpec(0, kv), LayerSpec(1, kv),
              LayerSpec(2, kv, window_tokens=12, sink_tokens=4, reuse=ReusePolicy.SINK_REQUIRED_ONLY)]
    # write-through keeps a copy of what is above in the tier: three times the tiers above, so copies do
    # not only evict each other (the store warns at 1x or less); write-back's tiers are smaller
    gpu = 160
    host = 3 * gpu if host_write == "through" else 96
    disk = 3 * (gpu + host) if write == "through" else gpu + host
    return StoreConfig(layers=layers, tokens_per_block=TPB, gpu=GpuConfig(slots=gpu, device="auto"),
                       host=HostConfig(slots=host, write=host_write),
                       disk=DiskConfig(path=disk_dir, slots=disk, fsync=False, write=write))


class _Run:
    def __init__(self, seed: int, faults: bool) -> None:
        self.rng = random.Random(seed)
        self.faults = faults
        self.counts = collections.Counter()
        self.errors = collections.Counter()
        self.prefixes = [[self.rng.randrange(50_000) for _ in range(TPB * self.rng.randrange(1, 5))]
                         for _ in range(12)]

    def tokens(self) -> list[int]:
        r = self.rng
        suffix = [r.randrange(8) for _ in range(TPB * r.randrange(0, 4) + r.randrange(TPB))]
        return list(r.choice(self.prefixes)) + suffix

    async def op(self, store: Store, writer: PageWriter) -> None:
        r = self.rng
        seq = await store.open_sequence(tokens=self.tokens(), priority=r.randrange(0, 101))
        self.counts["ops"] += 1
        try:
            if self.faults and r.random() < 0.05:
                task = asyncio.ensure_future(seq.acquire())
                await asyncio.sleep(r.random() * 0.002)
                self.counts["injected"] += not task.done()
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    self.errors["CancelledError"] += 1
                    return
            else:
                await seq.acquire()
            await self.check(writer, seq)
            start = seq.num_blocks
            await seq.extend(len(seq.keys) - start)
            redo = sorted({b for lc in store.lcs for b in seq.recompute_blocks(lc.layers[0].id)})
            await asyncio.to_thread(writer.write, seq, list(range(start, len(seq.keys))) + redo)
            seq.commit(len(seq.keys))
            await seq.release()
            if r.random() < 0.25:                 # suspend, let others run, resume
                await asyncio.sleep(0)
                await seq.acquire()
                await self.check(writer, seq)
                await seq.release()
        except KvtierError as exc:
            self.errors[type(exc).__name__] += 1
        finally:
            if not seq.closed:
                await seq.close()

    async def check(self, writer: PageWriter, seq) -> None:
        ok, bad = await asyncio.to_thread(writer.check, writer.plan(seq, range(seq.committed)))
        self.counts["verified_pages"] += ok
        self.counts["corrupt"] += bad


def _owned(store: Store, tier: int, group: int) -> list:
    core = store.core
    return [page_view(core, i) for i in core.tier_pages(tier, group).tolist()]


def _leaks(store: Store) -> int:
    leaked = 0
    for t in store.tier_ids:
        for g in range(store.core.n_groups(t)):
            owned = _owned(store, t, g)
            leaked += abs(store.core.used(t, g) - len(owned)) + sum(1 for p in owned if p.holders or p.locks)
    return leaked


def _disk_keys(store: Store) -> set:
    """(key, life cycle) of every page the disk holds: published pages, and clean copies (a
    restart recovers them as pages, and losing them is what write-through must not do)."""
    return {(p.key, p.lc) for g in range(store.core.n_groups(DISK)) for p in _owned(store, DISK, g)
            if (p.published or p.copy) and not p.dead}


async def run_stress(ops: int = 2000, seed: int = 0, concurrency: int = 8, faults: bool = False,
                     restarts: int = 2, quiet: bool = True, write: str = "back", host_write: str = "back") -> dict:
    from .cli import progress_bar
    run = _Run(seed, faults)
    lost = leaked = discarded = recovered = orphaned = 0
    scrub = collections.Counter()
    copies = {"host": collections.Counter(), "disk": collections.Counter()}    # clean copies, all phases
    phases = restarts + 1
    with tempfile.TemporaryDirectory(prefix="kvtier-stress-") as tmp, \
            progress_bar(ops, "stress", not quiet) as advance:
        expected: set = set()
        for phase in range(phases):
            cfg = stress_config(tmp, write, host_write)
            async with Store.open(cfg) as store:
                if expected:
                    served = _disk_keys(store)
                    discarded += store.stats()["discarded_pages"]
                    recovered += store.stats()["recovered_pages"]
                    st = store.stats()
                    lost += max(0, len(expected - served) - st["discarded_pages"] - st["orphaned_pages"])
                    orphaned += st["orphaned_pages"]
                writer = PageWriter(store)
                if faults:
                    _inject(store, run.rng, run.counts)
                budget = ops // phases + (ops % phases if phase == phases - 1 else 0)
                queue = iter(range(budget))

                async def worker() -> None:
                    for _ in queue:
                        await run.op(store, writer)
                        advance(1)

                async def scrubs() -> None:         # passes over the disk while the requests run
                    while not done.is_set():
                        got = await store.scrub()
                        scrub["passes"] += 1
                        scrub["checked_pages"] += got["checked_pages"]
                        scrub["discarded_pages"] += got["discarded_pages"]
                        scrub["errors"] += got["error"] is not None
                        await asyncio.sleep(0.01)
                done = asyncio.Event()
                scrubbing = asyncio.ensure_future(scrubs())
                try:
                    await asyncio.gather(*(worker() for _ in range(concurrency)))
                finally:
                    done.set()
                    await scrubbing
                store.engine.fault = None
                await store.drain()
                st = store.stats()
                for tier, key in (("host", "host_write_through"), ("disk", "write_through")):
                    for k in ("copied_pages", "free_demotions", "kept_on_promotion", "evicted_copies"):
                        copies[tier][k] += st[key][k]
                leaked += _leaks(store)
                store.check_consistency()
                store_ref = store
            expected = _disk_keys(store_ref) if phase < phases - 1 else set()
    return {"ops": run.counts["ops"], "verified_pages": run.counts["verified_pages"],
            "corrupt": run.counts["corrupt"], "lost": lost, "faults_injected": run.counts["injected"], "leaked_slots": leaked,
            "discarded": discarded, "recovered": recovered, "orphaned": orphaned, "restarts": restarts, "errors_by_type": dict(run.errors),
            "clean_copies": {t: dict(c) for t, c in copies.items() if c["copied_pages"] or c["kept_on_promotion"]},
            "scrub": dict(scrub)}


def _inject(store: Store, rng: random.Random, counts: collections.Counter) -> None:
    """Random move failures, and EIO on the disk tier now and then; one
    early move of every phase fails for sure, so no run goes untested
    however few batches its timing makes."""
    calls = [0]
    sure = rng.randrange(2, 8)

    def fault(src: int, dst: int) -> None:
        calls[0] += 1
        x = rng.random()
        if x < 0.04 or calls[0] == sure:
            counts["injected"] += 1
            raise TierIOError(f"injected move failure {src}->{dst}")
        if store.disk is not None and x < 0.06:
            counts["injected"] += 1
            store.disk.inject_fault(rng.choice(("read", "write")), errno.EIO)
    store.engine.fault = fault

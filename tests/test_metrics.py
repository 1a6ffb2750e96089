"""runtime.metrics: the Prometheus collector's figures against Store.stats() and what the store did."""
from __future__ import annotations

import asyncio
import sys
import threading

import pytest

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from runtime import Store  # noqa: E402
from runtime.lag import LoopLagMonitor  # noqa: E402
from runtime.metrics import StoreCollector, register  # noqa: E402
from runtime.migration import MOVE_LATENCY_BUCKETS, MigrationEngine  # noqa: E402
from runtime.pages import TIER_NAMES  # noqa: E402

from helpers import config, fill, toks  # noqa: E402


def scrape(registry) -> tuple[dict, dict]:
    """(samples by (name, sorted labels), family types by family name) of one scrape."""
    samples, types = {}, {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, types


def by_label(samples: dict, name: str, label: str) -> dict:
    """{label value: sample value} of the samples of ``name`` that carry ``label``."""
    return {dict(k)[label]: v for (n, k), v in samples.items() if n == name and label in dict(k)}


def counting_runs(monkeypatch) -> dict:
    """Count the batches MigrationEngine.run lands, per direction, independently of its own stats."""
    landed: dict[str, int] = {}
    real = MigrationEngine.run

    async def run(self, batch, dst_tier, *args, **kw):
        ev = await real(self, batch, dst_tier, *args, **kw)
        d = f"{TIER_NAMES[batch.src_tier]}->{TIER_NAMES[dst_tier]}"
        landed[d] = landed.get(d, 0) + 1
        return ev
    monkeypatch.setattr(MigrationEngine, "run", run)
    return landed


async def drive_every_direction(store) -> None:
    """Requests that move pages gpu->host, host->disk, host->gpu and disk->gpu."""
    await fill(store, toks(1, 4))
    await fill(store, toks(2, 4))                 # A: gpu -> host
    seq = await store.open_sequence(tokens=toks(1, 4))
    assert seq.matched_by_tier["host"] == 4
    await seq.acquire()                           # A: host -> gpu (B: gpu -> host)
    await seq.release()
    await seq.close()
    await fill(store, toks(3, 4))
    await fill(store, toks(4, 4))                 # A and B: host -> disk
    seq = await store.open_sequence(tokens=toks(1, 4))
    assert seq.matched_by_tier["disk"] == 4
    await seq.acquire()                           # A: disk -> gpu
    await seq.release()
    await seq.close()
    seq = await store.open_sequence(tokens=toks(9, 4))   # a miss: a lookup without hits
    await seq.close()
    await store.drain()


async def test_figures_match_store_stats(tmp_path, monkeypatch):
    landed = counting_runs(monkeypatch)
    async with Store.open(config(gpu=4, host=4, disk=32, disk_dir=tmp_path)) as store:
        lag = LoopLagMonitor(0.001).start()
        await drive_every_direction(store)
        await asyncio.sleep(0.01)                 # a few lag ticks
        registry = CollectorRegistry()
        collector = register(store, registry, lag=lag)
        assert isinstance(collector, StoreCollector)
        samples, types = scrape(registry)
        stats = store.stats()
        await lag.stop()

        # prefix cache: lookups and hits per tier, in blocks
        queries = samples[("kvtier_prefix_cache_queries_total", ())]
        hits = by_label(samples, "kvtier_prefix_cache_hits_total", "tier")
        assert types["kvtier_prefix_cache_queries"] == types["kvtier_prefix_cache_hits"] == "counter"
        assert queries == stats["lookup_blocks"] == 4 * 6 + 4     # six requests on 4 blocks, one miss
        assert hits == {t: float(n) for t, n in stats["hits"].items()}
        assert hits["host"] == 4 and hits["disk"] == 4 and hits["gpu"] == 0
        assert sum(hits.values()) <= queries
        assert samples[("kvtier_indexed_blocks", ())] == stats["indexed_blocks"]

        # moves: every direction the store took, pages * page bytes = bytes
        moves = stats["moves"]
        assert {"gpu->host", "host->disk", "host->gpu", "disk->gpu"} <= set(moves)
        assert set(landed) == set(moves)
        slot_bytes = {t: v["groups"][0]["slot_bytes"] for t, v in stats["tiers"].items()}
        assert set(slot_bytes.values()) == {512}
        pages = by_label(samples, "kvtier_kv_offload_pages_total", "direction")
        nbytes = by_label(samples, "kvtier_kv_offload_bytes_total", "direction")
        batches = by_label(samples, "kvtier_kv_offload_batches_total", "direction")
        failed = by_label(samples, "kvtier_kv_offload_failed_batches_total", "direction")
        seconds = by_label(samples, "kvtier_kv_offload_time_seconds_total", "direction")
        assert set(pages) == set(nbytes) == set(batches) == set(failed) == set(seconds) == set(moves)
        for d, m in moves.items():
            assert pages[d] == m["pages"] > 0
            assert nbytes[d] == m["bytes"] == m["pages"] * slot_bytes[d.split("->")[1]]
            assert batches[d] == m["batches"] == landed[d]
            assert failed[d] == m["failures"] == 0
            assert seconds[d] == pytest.approx(store.engine.stats.seconds[d]) and seconds[d] > 0
        assert pages["disk->gpu"] == 4

        # latency histograms: one observation per landed batch, cumulative buckets
        assert types["kvtier_kv_offload_batch_latency_seconds"] == "histogram"
        name = "kvtier_kv_offload_batch_latency_seconds"
        for d in moves:
            count = samples[(f"{name}_count", (("direction", d),))]
            assert count == landed[d] == batches[d]
            buckets = by_label({k: v for k, v in samples.items() if dict(k[1]).get("direction") == d},
                               f"{name}_bucket", "le")
            assert len(buckets) == len(MOVE_LATENCY_BUCKETS) + 1
            ordered = [buckets[k] for k in sorted(buckets, key=float)]
            assert ordered == sorted(ordered) and ordered[-1] == buckets["+Inf"] == count
            total = samples[(f"{name}_sum", (("direction", d),))]
            assert 0 < total < 60
            assert total >= seconds[d] * 0.5      # wall time covers (nearly all of) the jobs' run time

        # slots: capacity, in use and states against the store's own counts
        used = {}
        for (n, k), v in samples.items():
            if n == "kvtier_kv_cache_slots_used":
                used[(dict(k)["tier"], int(dict(k)["group"]))] = v
        assert set(used) == {(t, 0) for t in ("gpu", "host", "disk")}
        core = store.core
        for tier, g in used:
            t = TIER_NAMES.index(tier)
            labels = (("group", str(g)), ("tier", tier))
            group = stats["tiers"][tier]["groups"][g]
            assert used[(tier, g)] == core.used(t, g) == group["used"]
            assert samples[("kvtier_kv_cache_slots", labels)] == core.capacity(t, g) == group["slots"]
            assert samples[("kvtier_kv_cache_usage_perc", labels)] == pytest.approx(
                core.used(t, g) / core.capacity(t, g))
            assert samples[("kvtier_kv_cache_slots_evictable", labels)] == core.queue_len(t, g)
            states = {s: samples[("kvtier_kv_cache_pages", (("group", str(g)), ("state", s), ("tier", tier)))]
                      for s in ("locked", "held", "droppable")}
            assert sum(states.values()) == used[(tier, g)]          # drained: every used slot has its page
            assert states["locked"] == 0
            assert samples[("kvtier_kv_cache_hit_pages_total", labels)] == group["hit_pages"]
            for way in ("in", "out"):
                key = (("group", str(g)), ("tier", tier), ("way", way))
                assert samples[("kvtier_kv_cache_moved_pages_total", key)] == group[f"moved_{way}"]["pages"]
                assert samples[("kvtier_kv_cache_moved_bytes_total", key)] == group[f"moved_{way}"]["bytes"]
        assert used[("gpu", 0)] == 4 and used[("host", 0)] == 4 and used[("disk", 0)] > 0

        # drops and recovery
        assert samples[("kvtier_dropped_pages_total", ())] == stats["drops"]
        assert samples[("kvtier_disk_full_dropped_pages_total", ())] == stats["disk_full"]["dropped_pages"] == 0
        assert samples[("kvtier_disk_full_refused_spills_total", ())] == 0
        assert samples[("kvtier_corrupt_pages_total", ())] == stats["corrupt_pages"] == 0
        assert samples[("kvtier_recovered_pages", ())] == stats["recovered_pages"]
        assert samples[("kvtier_orphaned_pages_total", ())] == stats["orphaned_pages"]
        assert samples[("kvtier_discarded_pages_total", ())] == stats["discarded_pages"]

        # KV events: only when the store reports them
        if "events" in stats:
            for k in ("published", "dropped"):
                assert samples[(f"kvtier_events_{k}_total", ())] == stats["events"][k]
        else:
            assert not [n for n, _ in samples if n.startswith("kvtier_events_")]

        # event-loop lag from the monitor
        p = lag.percentiles_ms()
        assert p["count"] > 0
        assert 0 < samples[("kvtier_event_loop_lag_samples_total", ())] <= p["count"]
        q = by_label(samples, "kvtier_event_loop_lag_seconds", "quantile")
        assert set(q) == {"0.5", "0.99", "1"}
        assert 0 <= q["0.5"] <= q["0.99"] <= q["1"] < 5


async def test_bytes_follow_the_destination_slot_size(tmp_path):
    """With a codec the cold slot is smaller: bytes moved count the destination's slot size."""
    from runtime import LayerSpec
    layers = [LayerSpec(0, (("k", 256), ("v", 256)), dtype="float16")]
    async with Store.open(config(gpu=4, host=4, disk=16, disk_dir=tmp_path, layers=layers,
                                 codec="int8")) as store:
        await fill(store, toks(1, 4))
        await fill(store, toks(2, 4))
        await fill(store, toks(3, 4))
        await store.drain()
        registry = CollectorRegistry()
        register(store, registry)
        samples, _ = scrape(registry)
        stats = store.stats()
        cold = stats["tiers"]["host"]["groups"][0]["slot_bytes"]
        assert cold < 512
        for d in ("gpu->host", "host->disk"):
            m = stats["moves"][d]
            assert samples[("kvtier_kv_offload_bytes_total", (("direction", d),))] == m["pages"] * cold


async def test_drops_from_the_last_tier():
    async with Store.open(config(gpu=4)) as store:
        for i in range(4):
            await fill(store, toks(i + 1, 4))     # a GPU-only store drops the oldest request's pages
        registry = CollectorRegistry()
        register(store, registry, prefix="gpuonly")
        samples, _ = scrape(registry)
        stats = store.stats()
        assert stats["drops"] == 12
        assert samples[("gpuonly_dropped_pages_total", ())] == 12
        assert not [n for n, _ in samples if n.startswith("gpuonly_kv_offload_") and n.endswith("_total")]
        assert set(by_label(samples, "gpuonly_kv_cache_slots", "tier")) == {"gpu"}


async def test_kv_event_counters(tmp_path):
    async with Store.open(config(gpu=4)) as store:
        await fill(store, toks(1, 2))
        real = store.stats
        store.stats = lambda: {**real(), "events": {"published": 7, "dropped": 2, "buffered": 3}}
        registry = CollectorRegistry()
        register(store, registry)
        samples, types = scrape(registry)
        assert samples[("kvtier_events_published_total", ())] == 7
        assert samples[("kvtier_events_dropped_total", ())] == 2
        assert samples[("kvtier_events_buffered", ())] == 3
        assert types["kvtier_events_published"] == types["kvtier_events_dropped"] == "counter"


async def test_store_not_started_or_closed_yields_nothing(tmp_path):
    store = Store.open(config(gpu=4, host=4, disk=8, disk_dir=tmp_path))
    registry = CollectorRegistry()
    lag = LoopLagMonitor()
    collector = register(store, registry, lag=lag)
    samples, _ = scrape(registry)
    # nothing from the store; the lag monitor, not started, has no samples yet
    assert set(n for n, _ in samples) == {"kvtier_event_loop_lag_samples_total"}
    assert list(StoreCollector(store).collect()) == []

    async with store:
        await fill(store, toks(1, 4))
        samples, _ = scrape(registry)
        assert samples[("kvtier_prefix_cache_queries_total", ())] == 4
    assert store.closed
    samples, _ = scrape(registry)
    assert not [n for n, _ in samples if not n.startswith("kvtier_event_loop_lag")]
    assert list(collector.collect()) == [f for f in collector.collect() if f.name.startswith("kvtier_event")]

    # a store whose start failed (its disk directory is locked by another store)
    async with Store.open(config(gpu=4, host=4, disk=8, disk_dir=tmp_path)):
        bad = Store.open(config(gpu=4, host=4, disk=8, disk_dir=tmp_path))
        with pytest.raises(Exception):
            await bad
        assert bad.closed and not bad.started
        assert list(StoreCollector(bad).collect()) == []
    assert list(StoreCollector(None).collect()) == []


async def test_stats_failing_mid_scrape_is_skipped():
    async with Store.open(config(gpu=4)) as store:
        def boom():
            raise RuntimeError("closing")
        store.stats = boom
        assert list(StoreCollector(store).collect()) == []


async def test_scrapes_from_another_thread_while_requests_run(tmp_path):
    async with Store.open(config(gpu=4, host=8, disk=64, disk_dir=tmp_path)) as store:
        registry = CollectorRegistry()
        register(store, registry, lag=LoopLagMonitor(0.001).start())
        stop, errors, scrapes = threading.Event(), [], [0]

        def scraper():
            while not stop.is_set():
                try:
                    scrape(registry)
                    scrapes[0] += 1
                except BaseException as exc:   # noqa: BLE001 - reported below
                    errors.append(exc)
                    return
        t = threading.Thread(target=scraper)
        t.start()
        try:
            for round_ in range(3):
                for i in range(8):
                    await fill(store, toks(i + 1, 4))
        finally:
            stop.set()
            await asyncio.get_running_loop().run_in_executor(None, t.join)
        assert not errors, errors
        assert scrapes[0] > 0
        await store.drain()
        store.check_consistency()


def test_registry_refuses_a_second_collector_with_the_same_prefix():
    store = Store.open(config(gpu=4))
    registry = CollectorRegistry()
    register(store, registry)
    with pytest.raises(ValueError):
        register(store, registry)
    register(store, registry, prefix="other")        # another prefix, other names


def test_default_registry():
    store = Store.open(config(gpu=4))
    collector = register(store, prefix="kvtier_default_registry_test")
    try:
        assert prometheus_client.REGISTRY._collector_to_names[collector]
    finally:
        prometheus_client.REGISTRY.unregister(collector)


def test_missing_prometheus_client_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match=r"kvtier\[serve\]"):
        StoreCollector(object())
    with pytest.raises(ImportError, match=r"kvtier\[serve\]"):
        register(object())


async def test_write_through_figures_match_store_stats(tmp_path):
    cfg = config(gpu=8, host=8, disk=64, disk_dir=tmp_path, persist_on_close=False)
    cfg.disk.write = "through"
    async with Store.open(cfg) as store:
        for i in range(6):
            await fill(store, toks(i, 3))
        await store.drain()
        for i in range(6):                      # back up: the disk pages keep their slots as copies
            await fill(store, toks(i, 3))
        await store.drain()
        registry = CollectorRegistry()
        register(store, registry)
        samples, _ = scrape(registry)
        wt = store.stats()["write_through"]
        assert wt["copied_pages"] > 0 and wt["free_demotions"] > 0
        assert samples[("kvtier_write_through_pages_total", (("tier", "disk"),))] == wt["copied_pages"]
        assert samples[("kvtier_write_through_bytes_total", (("tier", "disk"),))] == wt["copied_bytes"]
        assert samples[("kvtier_write_through_copies", (("tier", "disk"),))] == wt["copies"]
        assert samples[("kvtier_write_through_pending", (("tier", "disk"),))] == wt["pending"] == 0
        assert samples[("kvtier_write_through_free_demotions_total", (("tier", "disk"),))] == wt["free_demotions"]
    async with Store.open(config(gpu=4)) as store:     # write-back: no such family
        await fill(store, toks(1, 2))
        registry = CollectorRegistry()
        register(store, registry)
        samples, _ = scrape(registry)
        assert ("kvtier_write_through_pages_total", ()) not in samples

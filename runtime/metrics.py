"""Prometheus metrics of a Store, for any server that embeds one.

``register(store)`` adds a custom collector to a ``prometheus_client``
registry; every scrape reads ``Store.stats()`` and the migration engine's
counters right then (no state kept here, nothing to update on the hot path)::

    from runtime.metrics import register
    register(store, registry, lag=monitor)     # monitor: a runtime.lag.LoopLagMonitor

Collecting is cheap and never touches the event loop: it calls no coroutine
and schedules nothing, only ``Store.stats()`` (synchronous; its core calls
hold the GIL, so they are atomic against the loop thread's) and plain
attributes of the engine and the lag monitor, so a scrape may run on another
thread (an HTTP exporter's). A store that was never started, is closed or
closing yields no store metrics (the lag monitor's still come out).

``prometheus_client`` is an optional dependency (``pip install 'kvtier[serve]'``):
importing this module works without it, building a collector does not.

Metrics, with the ``kvtier`` prefix (``prefix=`` changes it), and the closest
vLLM metric. Units differ: kvtier counts blocks where vLLM counts tokens
(``tokens_per_block`` tokens a block), and reports per (tier, pool group)
what vLLM reports for its one GPU pool.

========================================================  ====================================================
kvtier metric (labels)                                    closest vLLM metric
========================================================  ====================================================
kvtier_prefix_cache_queries_total                         vllm:prefix_cache_queries (tokens; blocks here)
kvtier_prefix_cache_hits_total{tier}                      tier=gpu: vllm:prefix_cache_hits; tier=host|disk:
                                                          vllm:external_prefix_cache_hits (KV connector hits)
kvtier_indexed_blocks                                     none
kvtier_kv_cache_slots{tier,group}                         none (vllm:cache_config_info num_gpu_blocks)
kvtier_kv_cache_slots_used{tier,group}                    none (numerator of vllm:kv_cache_usage_perc)
kvtier_kv_cache_usage_perc{tier,group}                    vllm:kv_cache_usage_perc (a 0..1 fraction as well)
kvtier_kv_cache_slots_evictable{tier,group}               none
kvtier_kv_cache_pages{tier,group,state}                   none
kvtier_kv_cache_hit_pages_total{tier,group}               none (pages open_sequence matched in the group)
kvtier_kv_cache_moved_pages_total{tier,group,way}         none (way: in, out; the offload metrics per group)
kvtier_kv_cache_moved_bytes_total{tier,group,way}         none
kvtier_kv_offload_pages_total{direction}                  none
kvtier_kv_offload_bytes_total{direction}                  vllm:kv_offload_total_bytes{transfer_type}
                                                          (newer: vllm:kv_offload_store_bytes / _load_bytes)
kvtier_kv_offload_time_seconds_total{direction}           vllm:kv_offload_total_time{transfer_type}
                                                          (newer: vllm:kv_offload_store_time / _load_time)
kvtier_kv_offload_batches_total{direction}                vllm:kv_offload_size_count (one sample a transfer)
kvtier_kv_offload_failed_batches_total{direction}         vllm:nixl_num_failed_transfers (NIXL connector)
kvtier_kv_offload_batch_latency_seconds{direction}        vllm:nixl_xfer_time_seconds (a per-transfer time
  (histogram)                                             histogram; the offloading connector has none)
kvtier_dropped_pages_total                                none
kvtier_disk_full_dropped_pages_total                      none
kvtier_disk_full_refused_spills_total                     none (vllm:kv_offload_stores_skipped skips by policy)
kvtier_corrupt_pages_total                                none
kvtier_recovered_pages                                    none
kvtier_orphaned_pages_total                               none
kvtier_discarded_pages_total                              none
kvtier_write_through_pages_total{tier}                    none (clean copies written to the host or disk)
kvtier_write_through_bytes_total{tier}                    none
kvtier_write_through_pending{tier}                        none (published pages waiting for their copy)
kvtier_write_through_copies{tier}                         none (slots holding a clean copy now)
kvtier_write_through_free_demotions_total{tier}           none (demotions onto a copy: no bytes moved)
kvtier_write_through_kept_on_promotion_total{tier}       none (promotions that kept the cold slot as a copy)
kvtier_write_through_evicted_copies_total{tier}           none
kvtier_write_through_failures_total{tier}                 none
kvtier_events_total                                       none (vLLM's KV event publisher exports no metric)
kvtier_events_published_total                             none
kvtier_events_dropped_total                               none
kvtier_events_buffered                                    none
kvtier_remote_lookups_total                               none (LMCache: lmcache:num_lookup_requests)
kvtier_remote_gets_total{outcome}                         none (hit, absent, corrupt, wrong_size, mismatch, ...)
kvtier_remote_puts_total{outcome}                         none (stored, already_there, failed, refused)
kvtier_remote_bytes_total{direction}                      none (in, out)
kvtier_remote_round_trips_total                           none
kvtier_remote_failures_total{kind}                        none (timeout, connection, cluster, other)
kvtier_remote_seconds_total{op}, _calls_total{op}         none (exists, get, put: mean latency = ratio)
kvtier_remote_circuit{state}                              none (1 for the breaker's current state)
kvtier_remote_imported_blocks_total                       vllm:external_prefix_cache_hits (blocks, one store)
kvtier_remote_imported_pages_total                        none (their pages: not in kv_cache_hit_pages)
kvtier_remote_write_skipped_pages_total                   none
kvtier_event_loop_lag_seconds{quantile}                   none
kvtier_event_loop_lag_samples_total                       none
========================================================  ====================================================

What the figures are:

- ``prefix_cache_*``: blocks looked up by ``open_sequence`` and the blocks it
  matched, each matched block under the tier of its coldest page (the hits
  of all tiers sum to the matched blocks, at most the queries).
- ``kv_cache_*``: per tier and pool group, slots (capacity), slots used,
  their fraction, slots on the eviction queue, and the owned pages by state
  (``locked`` by a sequence, ``held`` or not yet published, ``droppable``;
  the three sum to the pages owning slots).
- ``kv_offload_*``: batches that landed per direction (``gpu->host``,
  ``host->disk``, ``disk->gpu``, ``host->gpu``, ...): pages, bytes (each
  page at its destination's slot size), seconds the copy and I/O jobs ran
  (``bytes / time`` is the bandwidth), batches, and failed batches. The
  latency histogram observes each landed batch's wall time, from the engine
  taking it to its last stage's completion (waits on earlier copies
  included), so its ``_count`` equals ``kv_offload_batches_total``.
- Pages lost, kept apart rather than as one ``cause`` label because the
  store's figures overlap (a label's values should sum): ``dropped_pages``
  is every page the index dropped (eviction from the last tier and the
  pages under a dropped prefix-critical page, and also the two next ones
  where they were indexed); ``disk_full_dropped_pages`` the evicted pages
  a full disk refused, dropped instead of spilled (``disk_full_refused_spills``
  the spills refused); ``corrupt_pages`` the disk pages a read found damaged.
  At start: ``recovered_pages`` re-indexed from disk, ``orphaned_pages``
  unreachable (freed), ``discarded_pages`` damaged or not fitting this
  layout (``discarded_pages`` also counts the corrupt pages found later).
- ``events_*``: KV events made, and the batches they travel in: published
  (handed to ZMQ), dropped (a full queue or reader buffer) and buffered for
  Python readers; present only when the store makes KV events.
- ``event_loop_lag_seconds``: from the lag monitor given as ``lag=``, p50
  and p99 of its recent samples and (``quantile="1"``) the longest stall,
  present once it has a sample; ``event_loop_lag_samples_total`` its ticks.
"""
from __future__ import annotations

import logging
from typing import Any, Iterator

log = logging.getLogger("kvtier")

INSTALL_HINT = "prometheus_client is not installed: pip install 'kvtier[serve]'"


def _prometheus():
    try:
        import prometheus_client
        import prometheus_client.core
    except ImportError as exc:
        raise ImportError(f"runtime.metrics needs {INSTALL_HINT}") from exc
    return prometheus_client


class StoreCollector:
    """A ``prometheus_client`` custom collector for one Store (and, optionally,
    an event-loop lag monitor): register it on a registry, or use ``register``."""

    def __init__(self, store: Any, *, prefix: str = "kvtier", lag: Any = None) -> None:
        """``lag``: a ``runtime.lag.LoopLagMonitor`` (or its ``LagRecorder``)."""
        prom = _prometheus()
        self._core = prom.core
        self._go_float = prom.utils.floatToGoString     # bucket bounds written as prometheus_client's own
        self.store = store
        self.prefix = prefix.rstrip("_")
        self.lag = lag

    # -- the families ----------------------------------------------------------------
    def _families(self) -> dict[str, Any]:
        """Every family this collector can yield, empty, by short name."""
        c, p = self._core, self.prefix
        counter, gauge = c.CounterMetricFamily, c.GaugeMetricFamily
        slot = ["tier", "group"]
        d = ["direction"]
        wt = ["tier"]
        return {
            "queries": counter(f"{p}_prefix_cache_queries", "Blocks looked up by open_sequence"),
            "hits": counter(f"{p}_prefix_cache_hits",
                            "Blocks open_sequence matched, by the tier of their coldest page", labels=["tier"]),
            "indexed": gauge(f"{p}_indexed_blocks", "Blocks in the prefix index"),
            "slots": gauge(f"{p}_kv_cache_slots", "Slots per tier and pool group", labels=slot),
            "used": gauge(f"{p}_kv_cache_slots_used", "Slots in use per tier and pool group", labels=slot),
            "usage": gauge(f"{p}_kv_cache_usage_perc",
                           "Fraction of the slots in use per tier and pool group (0..1)", labels=slot),
            "evictable": gauge(f"{p}_kv_cache_slots_evictable",
                               "Slots on the eviction queue per tier and pool group", labels=slot),
            "states": gauge(f"{p}_kv_cache_pages", "Pages owning slots per tier, pool group and state "
                            "(locked, held or unpublished, droppable)", labels=slot + ["state"]),
            "hit_pages": counter(f"{p}_kv_cache_hit_pages", "Pages open_sequence matched per tier and pool group",
                                 labels=slot),
            "moved_pages": counter(f"{p}_kv_cache_moved_pages", "Pages moved in and out per tier and pool group",
                                   labels=slot + ["way"]),
            "moved_bytes": counter(f"{p}_kv_cache_moved_bytes", "Bytes moved in and out per tier and pool group "
                                   "(pages at their destination's slot size)", labels=slot + ["way"]),
            "pages": counter(f"{p}_kv_offload_pages", "Pages moved per direction", labels=d),
            "bytes": counter(f"{p}_kv_offload_bytes",
                             "Bytes moved per direction (pages at their destination's slot size)", labels=d),
            "time": counter(f"{p}_kv_offload_time_seconds",
                            "Seconds the copy and I/O jobs of moves ran per direction", labels=d),
            "batches": counter(f"{p}_kv_offload_batches", "Move batches that landed per direction", labels=d),
            "failed": counter(f"{p}_kv_offload_failed_batches", "Move batches that failed per direction",
                              labels=d),
            "latency": c.HistogramMetricFamily(
                f"{p}_kv_offload_batch_latency_seconds",
                "Wall time of each move batch that landed, from start to its last stage's completion",
                labels=d),
            "dropped": counter(f"{p}_dropped_pages", "Pages the index dropped (evicted from the last tier, "
                               "under a dropped prefix-critical page, refused by a full disk, corrupt)"),
            "disk_full_dropped": counter(f"{p}_disk_full_dropped_pages",
                                         "Evicted pages a full disk refused, dropped instead of spilled"),
            "disk_full_spills": counter(f"{p}_disk_full_refused_spills", "Spills a full disk refused"),
            "corrupt": counter(f"{p}_corrupt_pages", "Disk pages a read found damaged (dropped, recomputed)"),
            "recovered": gauge(f"{p}_recovered_pages", "Disk pages re-indexed at start"),
            "orphaned": counter(f"{p}_orphaned_pages", "Disk pages unreachable at start (freed)"),
            "discarded": counter(f"{p}_discarded_pages",
                                 "Disk pages discarded (damaged, or not fitting the layout or tree)"),
            "wt_pages": counter(f"{p}_write_through_pages", "Clean copies written per cold tier (write-through)",
                                labels=wt),
            "wt_bytes": counter(f"{p}_write_through_bytes", "Bytes of clean copies written per cold tier", labels=wt),
            "wt_pending": gauge(f"{p}_write_through_pending", "Published pages waiting for their copy per cold tier",
                                labels=wt),
            "wt_copies": gauge(f"{p}_write_through_copies", "Slots holding a clean copy now per cold tier",
                               labels=wt),
            "wt_free": counter(f"{p}_write_through_free_demotions", "Demotions onto a clean copy (no bytes moved)",
                               labels=wt),
            "wt_kept": counter(f"{p}_write_through_kept_on_promotion",
                               "Cold pages promoted that kept their slot as a clean copy", labels=wt),
            "wt_evicted": counter(f"{p}_write_through_evicted_copies", "Clean copies their tier evicted", labels=wt),
            "wt_failures": counter(f"{p}_write_through_failures", "Write-through batches that failed", labels=wt),
            "ev_made": counter(f"{p}_events", "KV events made (BlockStored, BlockRemoved, AllBlocksCleared)"),
            "ev_published": counter(f"{p}_events_published", "KV event batches published (handed to ZMQ)"),
            "ev_dropped": counter(f"{p}_events_dropped", "KV event batches dropped (a full queue or reader buffer)"),
            "ev_buffered": gauge(f"{p}_events_buffered", "KV event batches buffered for Python readers"),
            "r_lookups": counter(f"{p}_remote_lookups", "Pages the remote tier was asked about (exists)"),
            "r_gets": counter(f"{p}_remote_gets", "Pages fetched from the remote tier, by outcome",
                              labels=["outcome"]),
            "r_puts": counter(f"{p}_remote_puts", "Pages written to the remote tier, by outcome", labels=["outcome"]),
            "r_bytes": counter(f"{p}_remote_bytes", "Bytes to and from the remote tier", labels=["direction"]),
            "r_round_trips": counter(f"{p}_remote_round_trips", "Round trips to the remote tier's nodes"),
            "r_failures": counter(f"{p}_remote_failures", "Failed remote calls, by kind", labels=["kind"]),
            "r_seconds": counter(f"{p}_remote_seconds", "Seconds spent in remote calls, by operation",
                                 labels=["op"]),
            "r_calls": counter(f"{p}_remote_calls", "Remote calls, by operation", labels=["op"]),
            "r_circuit": gauge(f"{p}_remote_circuit", "The remote tier's circuit breaker (1 in the current state)",
                               labels=["state"]),
            "r_imported": counter(f"{p}_remote_imported_blocks", "Blocks imported from the remote tier at open"),
            "r_imported_pages": counter(f"{p}_remote_imported_pages", "Pages imported from the remote tier at open"),
            "r_skipped": counter(f"{p}_remote_write_skipped_pages",
                                 "Pages not written through: past max_inflight_bytes"),
            "lag": gauge(f"{p}_event_loop_lag_seconds", "Event-loop lag: p50 and p99 of the recent samples, "
                         "and the longest stall (quantile 1)", labels=["quantile"]),
            "lag_samples": counter(f"{p}_event_loop_lag_samples", "Event-loop lag samples taken"),
        }

    def describe(self) -> Iterator[Any]:
        """The names, so a registry refuses a second collector with the same prefix."""
        fams = self._families()
        if self.lag is None:
            del fams["lag"], fams["lag_samples"]
        return iter(fams.values())

    def collect(self) -> Iterator[Any]:
        f = self._families()
        stats = self._stats()
        if stats is not None:
            yield from self._store_metrics(f, stats)
        if self.lag is not None:
            yield from self._lag_metrics(f)

    # -- reading ---------------------------------------------------------------------
    def _stats(self) -> dict | None:
        store = self.store
        if store is None or not getattr(store, "started", False) or getattr(store, "closed", True):
            return None
        try:
            return store.stats()
        except Exception as exc:   # noqa: BLE001 - a store closing under the scrape: skip it this time
            log.debug("metrics: store stats unavailable: %r", exc)
            return None

    def _store_metrics(self, f: dict, stats: dict) -> Iterator[Any]:
        f["queries"].add_metric([], stats["lookup_blocks"])
        for tier, n in stats["hits"].items():
            f["hits"].add_metric([tier], n)
        f["indexed"].add_metric([], stats["indexed_blocks"])
        yield from (f["queries"], f["hits"], f["indexed"])

        for tier, t in stats["tiers"].items():
            for g in t["groups"]:
                labels = [tier, str(g["index"])]
                f["slots"].add_metric(labels, g["slots"])
                f["used"].add_metric(labels, g["used"])
                f["usage"].add_metric(labels, g["used"] / g["slots"] if g["slots"] else 0.0)
                f["evictable"].add_metric(labels, g["evictable"])
                for s in ("locked", "held", "droppable"):
                    f["states"].add_metric(labels + [s], g[s])
                f["hit_pages"].add_metric(labels, g["hit_pages"])
                for way in ("in", "out"):
                    f["moved_pages"].add_metric(labels + [way], g[f"moved_{way}"]["pages"])
                    f["moved_bytes"].add_metric(labels + [way], g[f"moved_{way}"]["bytes"])
        yield from (f["slots"], f["used"], f["usage"], f["evictable"], f["states"], f["hit_pages"],
                    f["moved_pages"], f["moved_bytes"])

        engine = getattr(self.store, "engine", None)
        seconds = getattr(getattr(engine, "stats", None), "seconds", {})
        for d, m in stats["moves"].items():
            f["pages"].add_metric([d], m["pages"])
            f["bytes"].add_metric([d], m["bytes"])
            f["time"].add_metric([d], seconds.get(d, 0.0))
            f["batches"].add_metric([d], m["batches"])
            f["failed"].add_metric([d], m["failures"])
        latency = getattr(engine, "latency", None)
        if latency is not None:
            bounds = [self._go_float(b) for b in latency.bounds] + ["+Inf"]
            for d, (counts, total) in sorted(latency.snapshot().items()):
                cum, buckets = 0, []
                for le, n in zip(bounds, counts):
                    cum += n
                    buckets.append((le, cum))
                f["latency"].add_metric([d], buckets, sum_value=total)
        yield from (f["pages"], f["bytes"], f["time"], f["batches"], f["failed"], f["latency"])

        full = stats.get("disk_full", {})
        f["dropped"].add_metric([], stats["drops"])
        f["disk_full_dropped"].add_metric([], full.get("dropped_pages", 0))
        f["disk_full_spills"].add_metric([], full.get("refused_spills", 0))
        f["corrupt"].add_metric([], stats.get("corrupt_pages", 0))
        f["recovered"].add_metric([], stats.get("recovered_pages", 0))
        f["orphaned"].add_metric([], stats.get("orphaned_pages", 0))
        f["discarded"].add_metric([], stats.get("discarded_pages", 0))
        yield from (f[k] for k in ("dropped", "disk_full_dropped", "disk_full_spills", "corrupt", "recovered",
                                   "orphaned", "discarded"))

        on = [(tier, wt) for tier, wt in (("host", stats.get("host_write_through")), ("disk", stats.get("write_through")))
              if wt and wt.get("on")]
        for tier, wt in on:
            f["wt_pages"].add_metric([tier], wt["copied_pages"])
            f["wt_bytes"].add_metric([tier], wt["copied_bytes"])
            f["wt_pending"].add_metric([tier], wt["pending"])
            f["wt_copies"].add_metric([tier], wt["copies"])
            f["wt_free"].add_metric([tier], wt["free_demotions"])
            f["wt_evicted"].add_metric([tier], wt["evicted_copies"])
            f["wt_kept"].add_metric([tier], wt["kept_on_promotion"])
            f["wt_failures"].add_metric([tier], wt["failures"])
        if on:
            yield from (f[k] for k in f if k.startswith("wt_"))

        events = stats.get("events")
        if events:
            f["ev_made"].add_metric([], events.get("events", 0))
            f["ev_published"].add_metric([], events.get("published", 0))
            f["ev_dropped"].add_metric([], events.get("dropped", 0))
            f["ev_buffered"].add_metric([], events.get("buffered", 0))
            yield from (f["ev_made"], f["ev_published"], f["ev_dropped"], f["ev_buffered"])

        remote = stats.get("remote")
        if remote:
            f["r_lookups"].add_metric([], remote.get("lookups", 0))
            f["r_gets"].add_metric(["hit"], remote.get("hits", 0))
            for kind, v in remote.get("misses", {}).items():
                f["r_gets"].add_metric([kind], v)
            f["r_puts"].add_metric(["stored"], remote.get("stored", 0))
            f["r_puts"].add_metric(["already_there"], remote.get("skipped", 0))
            f["r_puts"].add_metric(["failed"], remote.get("put_failed", 0))
            f["r_puts"].add_metric(["refused"], remote.get("put_refused", 0))
            f["r_bytes"].add_metric(["in"], remote.get("bytes_in", 0))
            f["r_bytes"].add_metric(["out"], remote.get("bytes_out", 0))
            f["r_round_trips"].add_metric([], remote.get("round_trips", 0))
            for kind, v in remote.get("failures", {}).items():
                f["r_failures"].add_metric([kind], v)
            for op, lat in remote.get("latency", {}).items():
                f["r_seconds"].add_metric([op], lat["sum"])
                f["r_calls"].add_metric([op], lat["count"])
            for state in ("closed", "open", "half_open"):
                f["r_circuit"].add_metric([state], 1 if remote.get("circuit") == state else 0)
            f["r_imported"].add_metric([], remote.get("imported_blocks", 0))
            f["r_imported_pages"].add_metric([], remote.get("imported_pages", 0))
            f["r_skipped"].add_metric([], remote.get("skipped_pages", 0))
            yield from (f[k] for k in f if k.startswith("r_"))

    def _lag_metrics(self, f: dict) -> Iterator[Any]:
        recorder = getattr(self.lag, "recorder", self.lag)      # a LoopLagMonitor, or its LagRecorder
        p = recorder.percentiles_ms()
        if p["count"]:
            for q, key in (("0.5", "p50"), ("0.99", "p99"), ("1", "max")):
                f["lag"].add_metric([q], p[key] / 1e3)
        f["lag_samples"].add_metric([], p["count"])
        yield from (f["lag"], f["lag_samples"])


def register(store: Any, registry: Any = None, **kw: Any) -> StoreCollector:
    """A ``StoreCollector`` for ``store`` (``prefix=``, ``lag=`` as there),
    registered on ``registry`` (default: ``prometheus_client.REGISTRY``)."""
    prom = _prometheus()
    collector = StoreCollector(store, **kw)
    (prom.REGISTRY if registry is None else registry).register(collector)
    return collector

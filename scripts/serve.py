#!/usr/bin/env python3
"""A small HTTP JSON server around one ``runtime.Store``.

The server embeds ONE store for its whole life (opened when the app starts,
closed when it stops) and exposes sequence operations over HTTP. It plays the
part of an inference engine: after ``extend`` it writes deterministic page
content into the GPU pools (a pure function of block key, layer and role), so
``verify`` can check, after any number of spills to host and disk and a
restart, that every cached page came back byte for byte.

Endpoints (JSON in, JSON out):

    POST   /sequences                {"tokens": [...]} | {"block_keys": [...]}, "priority"?
                                     -> {"id", "matched_blocks", "matched_by_tier", "num_keys"}
                                     (the sequence is acquired on open)
    POST   /sequences/{id}/extend    {"num_blocks": n} -> {"num_blocks", "page_indices": {layer: [...]}}
    POST   /sequences/{id}/commit    {"num_blocks": n} -> {"committed"}
    POST   /sequences/{id}/append    {"tokens": [...]} | {"block_keys": [...]} -> {"num_keys", "num_blocks"}
    POST   /sequences/{id}/acquire   {} -> {"acquired": true}
    POST   /sequences/{id}/release   {} -> {"released": true}
    GET    /sequences/{id}/verify    -> {"verified_pages", "corrupt", "skipped", "corrupt_pages"}
    GET    /sequences/{id}           -> the sequence's state
    DELETE /sequences/{id}           -> {"closed": true}
    GET    /stats                    -> Store.stats()
    GET    /healthz                  -> {"ok": true, ...}
    GET    /metrics                  -> Prometheus text (see Metrics below)

Block keys in JSON are integers (Mooncake ``hash_ids``) or hex strings
(bytes keys). Errors: ``{"error": <type name>, "message": ...}`` with
UsageError/ConfigError/bad input -> 400, unknown sequence -> 404,
StoreClosedError -> 410, OutOfPagesError -> 503 (RequestTooLargeError, more
pages than the GPU pool group holds at all, -> 413), CorruptPageError,
DiskFullError, TierIOError and anything unexpected -> 500. A refusal by one
of the limits below also names it (``"limit": "max_tokens"``...): too many
tokens or body bytes -> 413, a compressed body -> 415, too many open
sequences -> 429, request bodies in flight at their cap -> 503.

Limits. Sequence ids are random (``secrets``): holding one is the right to
use it. Every sequence has a lease (``--lease-seconds``), renewed by each
request that names it; a sweeper releases and closes the sequences of
clients that vanished, so their pages come back. A client (its peer IP
address: behind a proxy all clients share one, so raise the per-client cap
there) holds at most ``--max-sequences-per-client`` open sequences, the
server ``--max-sequences``. A request carries at most ``--max-tokens``
tokens (or that many tokens' worth of block keys; a sequence grows to at
most as many by appends) in a body of at most ``--max-body-bytes``, and the
bodies of all requests in flight together take at most
``--max-inflight-bytes``. Bodies over 64 KiB are decoded and checked on a
worker thread (one at a time), token lists as numpy arrays.

Page content. Block ``i``'s page for ``(layer, role)`` holds
``tile(blake2b(key || layer || role, 64 bytes)) + (byte offset // 64)``
(mod 256): cheap to make, different for every key/layer/role and for every
64-byte chunk of a page, so swapped, shifted or stale pages are all caught.
The server writes it into the pages it creates (extended blocks and the
recompute holes an acquire fills) as soon as the block's key is known.
Extend, commit and verify acquire a released sequence for the time they need
its pages on the GPU and release it again: each call leaves the sequence in
the acquired/released state it found it in.

Metrics. The store's come from ``runtime.metrics`` (its module docstring
lists them with the closest vLLM metric): prefix-cache queries and hits by
tier, slots and pages per tier and pool group, pages, bytes, time, batches
and batch latency moved per direction, pages dropped, corrupt, recovered
and discarded, KV events (with ``[events]`` in the config), and the
event-loop lag quantiles and sample count of the server's 10 ms ticker
(runtime.lag). The server adds its own:
``kvtier_http_requests_total{method,route,status}``,
``kvtier_open_sequences``, ``kvtier_expired_sequences_total``,
``kvtier_verified_pages_total{result}`` and the histogram of every lag
sample, ``kvtier_event_loop_lag_overshoot_seconds``.

Config. Without ``--config`` the embedded model below; a TOML config is
loaded as ``runtime.load_config`` reads it (the tier flags override its
tiers), so its ``[events]`` table, if any, makes the store publish KV events
over ZMQ in vLLM's format (``runtime/events.py``).

    python scripts/serve.py --port 8080                   # embedded model, temp disk dir
    python scripts/serve.py --disk-dir /var/tmp/kv         # disk tier survives restarts
    python scripts/serve.py --config kv.toml --host 0.0.0.0 --port 8080

SIGTERM / SIGINT: stop accepting, let in-flight requests finish (bounded),
close the open sequences, close the store (which persists committed pages to
disk when ``persist_on_close``), exit 0.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter as Tally      # prometheus_client's Counter has the name
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from aiohttp import hdrs, web  # noqa: E402
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest  # noqa: E402
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # noqa: E402

import runtime  # noqa: E402
from runtime.loop import every  # noqa: E402
from runtime.lag import LoopLagMonitor  # noqa: E402
from runtime.metrics import StoreCollector, register as register_store_metrics  # noqa: E402
from runtime.tools.cli import at_least, tune_gc  # noqa: E402
from runtime.migration import index_tensor  # noqa: E402

log = logging.getLogger("kvtier.serve")

LAG_INTERVAL = 0.010          # the lag monitor's tick: each records how late it ran against its schedule
SHUTDOWN_TIMEOUT = 5.0        # seconds in-flight requests get at shutdown
OFFLOAD_BYTES = 64 << 10      # bodies above this are decoded and checked on the parser thread
EXTRA_VALUES = 64             # JSON values a body may hold besides its tokens (the comma pre-check's slack)

STATE_KEY = web.AppKey("state", object)


# -- configuration ------------------------------------------------------------------------------
def default_config(disk_dir: str, gpu_slots: int, host_slots: int, disk_slots: int, device: str = "cpu",
                   fsync: bool = True, on_mismatch: str = "error") -> runtime.StoreConfig:
    """The embedded model: two life cycles of two layers each, k/v 4 KiB per block.
    Layers 0-1: full attention, REQUIRED. Layers 2-3: sliding window of 64
    tokens with 16 sink tokens, SINK_REQUIRED_ONLY (same page shape, so both
    life cycles share every tier's pool group)."""
    kv = (("k", 4096), ("v", 4096))
    full = runtime.ReusePolicy.REQUIRED
    sink = runtime.ReusePolicy.SINK_REQUIRED_ONLY
    layers = [runtime.LayerSpec(i, kv, kind="attention", reuse=full) for i in (0, 1)]
    layers += [runtime.LayerSpec(i, kv, kind="attention", window_tokens=64, sink_tokens=16, reuse=sink)
               for i in (2, 3)]
    return runtime.StoreConfig(
        layers=layers,
        gpu=runtime.GpuConfig(slots=gpu_slots, device=device),
        host=runtime.HostConfig(slots=host_slots),
        disk=runtime.DiskConfig(path=disk_dir, slots=disk_slots, fsync=fsync, on_mismatch=on_mismatch),
        tokens_per_block=16,
    )


def override_config(cfg: runtime.StoreConfig, args: argparse.Namespace) -> runtime.StoreConfig:
    """Apply the command line's tier flags to a config loaded from a file."""
    gpu, host, disk = cfg.gpu, cfg.host, cfg.disk
    if args.gpu_slots is not None:
        gpu = dataclasses.replace(gpu, slots=args.gpu_slots, quota=None)
    if args.device is not None:
        gpu = dataclasses.replace(gpu, device=args.device)
    if args.host_slots is not None:
        host = dataclasses.replace(host or runtime.HostConfig(), slots=args.host_slots, quota=None)
    if args.disk_dir is not None or args.disk_slots is not None or not args.fsync or args.on_mismatch:
        if disk is None and (args.disk_dir is None or args.disk_slots is None):
            raise runtime.ConfigError("tiers.disk", "the config has no disk tier: pass both --disk-dir and "
                                                    "--disk-slots to add one")
        disk = disk or runtime.DiskConfig()
        changes: dict[str, Any] = {}
        if args.disk_dir is not None:
            changes["path"] = args.disk_dir
        if args.disk_slots is not None:
            changes.update(slots=args.disk_slots, quota=None)
        if not args.fsync:
            changes["fsync"] = False
        if args.on_mismatch:
            changes["on_mismatch"] = args.on_mismatch
        disk = dataclasses.replace(disk, **changes)
    if (gpu, host, disk) == (cfg.gpu, cfg.host, cfg.disk):
        return cfg
    return dataclasses.replace(cfg, gpu=gpu, host=host, disk=disk)


# -- deterministic page content -------------------------------------------------------------------
def _key_bytes(key) -> bytes:
    return b"b" + key if isinstance(key, bytes) else b"i" + str(int(key)).encode()


@functools.lru_cache(maxsize=4096)
def page_content(key, layer: int, role: str, nbytes: int) -> torch.Tensor:
    """The bytes block ``key``'s page holds for ``(layer, role)``: a pure function
    of its arguments (stable across processes)."""
    digest = hashlib.blake2b(_key_bytes(key) + b"|%d|" % layer + role.encode(), digest_size=64).digest()
    base = np.frombuffer(digest, dtype=np.uint8)
    reps = -(-nbytes // 64)
    pattern = np.tile(base, reps)[:nbytes] + (np.arange(nbytes, dtype=np.int64) // 64).astype(np.uint8)
    return torch.from_numpy(np.ascontiguousarray(pattern, dtype=np.uint8))


# -- limits and errors ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Limits:
    """What clients and requests may take, so that none can hold the store's
    pages or the event loop for long (see the module docstring)."""

    lease_seconds: float = 60.0
    max_sequences: int = 1024
    max_sequences_per_client: int = 64
    max_tokens: int = 1 << 17
    max_body_bytes: int = 4 << 20
    max_inflight_bytes: int = 32 << 20

    @property
    def sweep_interval(self) -> float:
        """How often expired leases are looked for: a quarter lease, within 10 ms..5 s."""
        return min(max(self.lease_seconds / 4, 0.01), 5.0)


class BadRequest(Exception):
    """Malformed input (400)."""


class UnknownSequence(Exception):
    """No open sequence with that id (404)."""


class UnsupportedEncoding(Exception):
    """A compressed request body (415): its decoded size is unknown until decoded."""


class LimitExceeded(Exception):
    """A configured limit refused the request; the JSON error names it."""

    status = 429

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


class TooManySequences(LimitExceeded):
    """Open sequences at the client's or the server's cap (429)."""


class PayloadTooLarge(LimitExceeded):
    """More tokens or body bytes than a request may carry (413)."""

    status = 413


class ServerBusy(LimitExceeded):
    """Request bodies in flight at their cap (503: try again soon)."""

    status = 503


# -- request parsing ----------------------------------------------------------------------------------
def decode_json(raw: bytes, max_tokens: int) -> dict:
    """``raw`` as a JSON object. A body with more values than a request may
    carry is refused before parsing (counting commas is a C scan), so the
    parse, which holds the GIL even on a worker thread, stays short."""
    if raw.count(b",") > max_tokens + EXTRA_VALUES:
        raise PayloadTooLarge("max_tokens", f"the body holds more than {max_tokens + EXTRA_VALUES} values; "
                                            f"a request carries at most {max_tokens} tokens (--max-tokens)")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:       # bad JSON or UTF-8, or nesting past the parser
        raise BadRequest(f"malformed JSON: {exc}"[:300]) from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    return body


async def read_raw(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:             # a chunked body past client_max_size
        limit = _state(request).limits.max_body_bytes
        raise PayloadTooLarge("max_body_bytes", f"the body is over {limit} bytes (--max-body-bytes)") from None


async def read_body(request: web.Request, required: bool = True) -> dict:
    if not request.can_read_body:
        if required:
            raise BadRequest("a JSON object body is required")
        return {}
    raw = await read_raw(request)
    if not raw.strip() and not required:
        return {}
    st = _state(request)
    return await st.offload(len(raw), decode_json, raw, st.limits.max_tokens)


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A body's tokens (an int64 array) or block keys: exactly one is set."""

    tokens: np.ndarray | None = None
    keys: list | None = None

    def token_count(self, tokens_per_block: int) -> int:
        """Its length in tokens (block keys count a block's worth each)."""
        return len(self.tokens) if self.tokens is not None else len(self.keys) * tokens_per_block


async def read_prompt(request: web.Request) -> tuple[dict, Prompt]:
    """The body and its prompt, decoded and checked off the loop when large."""
    if not request.can_read_body:
        raise BadRequest("a JSON object body is required")
    raw = await read_raw(request)
    st = _state(request)
    return await st.offload(len(raw), decode_prompt, raw, st.limits.max_tokens, st.cfg.tokens_per_block)


def decode_prompt(raw: bytes, max_tokens: int, tokens_per_block: int) -> tuple[dict, Prompt]:
    body = decode_json(raw, max_tokens)
    return body, parse_prompt(body, max_tokens, tokens_per_block)


def _int(value, field: str, lo: int | None = None, hi: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"{field} must be an integer, got {value!r}"[:200])
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise BadRequest(f"{field} must be in {lo}..{hi if hi is not None else ''}, got {value}")
    return value


def parse_prompt(body: dict, max_tokens: int, tokens_per_block: int) -> Prompt:
    tokens, keys = body.get("tokens"), body.get("block_keys")
    if (tokens is None) == (keys is None):
        raise BadRequest('pass exactly one of "tokens" or "block_keys"')
    if tokens is not None:
        return Prompt(tokens=token_ids(tokens, max_tokens))
    return Prompt(keys=block_keys(keys, max(1, max_tokens // tokens_per_block), max_tokens))


def token_ids(tokens: object, max_tokens: int) -> np.ndarray:
    """JSON token ids as an int64 array, checked in C (numpy); only a bad
    list is walked in Python, to name its first bad token."""
    if not isinstance(tokens, list):
        raise BadRequest('"tokens" must be a list of integers')
    if len(tokens) > max_tokens:
        raise PayloadTooLarge("max_tokens", f"{len(tokens)} tokens: a request carries at most {max_tokens} "
                                            "(--max-tokens)")
    if not set(map(type, tokens)) <= {int}:                 # floats, strings, bools (a bool is no int here)
        bad = next(t for t in tokens if type(t) is not int)
        raise BadRequest(f'"tokens" must hold 64-bit integers, got {bad!r}'[:200])
    try:
        return np.array(tokens, dtype=np.int64)
    except OverflowError:
        bad = next(t for t in tokens if not -2**63 <= t < 2**63)
        raise BadRequest(f'"tokens" must hold 64-bit integers, got {bad!r}'[:200]) from None


def block_keys(keys: object, max_keys: int, max_tokens: int) -> list:
    """JSON block keys (integers or hex strings) as the store's int or bytes keys."""
    if not isinstance(keys, list):
        raise BadRequest('"block_keys" must be a list of integers or hex strings')
    if len(keys) > max_keys:
        raise PayloadTooLarge("max_tokens", f"{len(keys)} block keys: a request carries at most {max_keys}, "
                                            f"{max_tokens} tokens' worth (--max-tokens)")
    out: list = []
    for k in keys:
        if isinstance(k, int) and not isinstance(k, bool):
            out.append(k)
        elif isinstance(k, str):
            try:
                out.append(bytes.fromhex(k))
            except ValueError:
                raise BadRequest(f"block key {k!r} is not a hex string"[:200]) from None
        else:
            raise BadRequest(f"block key {k!r} must be an integer or a hex string"[:200])
    return out


def _num_blocks(body: dict) -> int:
    if "num_blocks" not in body:
        raise BadRequest('"num_blocks" is required')
    return _int(body["num_blocks"], "num_blocks", 0)


# -- server state -------------------------------------------------------------------------------------
class Session:
    """One open sequence and what the server knows about its pages."""

    __slots__ = ("id", "seq", "lock", "acquired", "written", "closed", "created", "client", "expires")

    def __init__(self, sid: str, seq: runtime.Sequence, client: str = "",
                 lease: float = Limits.lease_seconds) -> None:
        self.id = sid
        self.seq = seq
        self.lock = asyncio.Lock()       # one HTTP operation on a sequence at a time
        self.acquired = False
        self.written: set[tuple[int, int]] = set()   # (block, layer) pages this server filled
        self.closed = False
        self.created = time.monotonic()
        self.client = client             # who it counts against (max_sequences_per_client)
        self.expires = self.created + lease

    def renew(self, lease: float) -> None:
        """Push the lease out: its client is still there."""
        self.expires = time.monotonic() + lease


class ServerCollector:
    """The server's own Prometheus metrics, read from its state at scrape
    time: open and expired sequences, pages checked by /verify. The store's
    metrics come from ``runtime.metrics.StoreCollector``, registered when the
    store opens; HTTP requests and the lag histogram are plain metric objects."""

    def __init__(self, state: "ServerState") -> None:
        self.state = state

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, CounterMetricFamily, CounterMetricFamily]:
        return (GaugeMetricFamily("kvtier_open_sequences", "Sequences open through this server"),
                CounterMetricFamily("kvtier_expired_sequences", "Sequences closed because their lease ran out"),
                CounterMetricFamily("kvtier_verified_pages", "Pages checked by /verify", labels=["result"]))

    def describe(self):
        """The names, so the registry refuses a store metric of the same name."""
        return iter(self._families())

    def collect(self):
        st = self.state
        open_seqs, expired, pages = self._families()
        open_seqs.add_metric([], len(st.sessions))
        expired.add_metric([], st.expired)
        pages.add_metric(["ok"], st.verified_ok)
        pages.add_metric(["corrupt"], st.verified_bad)
        yield from (open_seqs, expired, pages)


class ServerState:
    def __init__(self, cfg: runtime.StoreConfig, limits: Limits | None = None) -> None:
        self.cfg = cfg
        self.limits = limits or Limits()
        self.store: runtime.Store | None = None
        self.sessions: dict[str, Session] = {}
        self.held: Tally[str] = Tally()     # open (or opening) sequences per client
        self.expired = 0
        self.sweeper: asyncio.Task | None = None
        self.inflight_bytes = 0             # request body bytes admitted and not yet answered
        # large bodies decode here, one at a time: json.loads holds the GIL, so a queue of them
        # would hold the loop for their sum; one at a time lets the loop in between
        self.parser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-serve-parse")
        self.verified_ok = 0
        self.verified_bad = 0
        # /metrics: the server's own metrics here, the store's (and the lag quantiles) from
        # runtime.metrics once the store is open (open_store)
        self.registry = CollectorRegistry(auto_describe=False)
        overshoot = Histogram(
            "kvtier_event_loop_lag_overshoot_seconds",
            f"Event-loop lag samples (lateness of a {LAG_INTERVAL * 1000:g} ms ticker)",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=self.registry)
        self.lag = LoopLagMonitor(LAG_INTERVAL, observe=overshoot.observe)
        self.requests = Counter("kvtier_http_requests", "HTTP requests by route and status",
                                ["method", "route", "status"], registry=self.registry)
        self.registry.register(ServerCollector(self))
        self.store_metrics: StoreCollector | None = None
        self.roles: dict[int, list[tuple[str, int]]] = {}   # layer id -> [(role, bytes)] of its GPU pools
        self.cuda = False
        self.shutting_down = False

    # -- the store's life -------------------------------------------------------------
    async def open_store(self) -> None:
        self.store = await runtime.Store.open(self.cfg)
        self.store_metrics = register_store_metrics(self.store, self.registry, lag=self.lag)
        self.cuda = bool(getattr(self.store.device, "is_cuda", False))
        lcs = self.cfg.layout.life_cycles
        for lc in lcs:
            for layer, role, nbytes in lc.buffers:
                self.roles.setdefault(layer, []).append((role, nbytes))
        self.lag.start()
        self.sweeper = asyncio.create_task(self.sweep_forever(), name="kvtier-serve-lease-sweeper")

    async def close_store(self) -> None:
        self.shutting_down = True
        if self.sweeper is not None:
            self.sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.sweeper
        for sess in list(self.sessions.values()):
            await self._close_session(sess)
        await self.lag.stop()
        self.parser.shutdown(wait=False, cancel_futures=True)
        if self.store is not None:
            await self.store.close()

    async def _close_session(self, sess: Session) -> None:
        if self.sessions.pop(sess.id, None) is sess:
            self.unreserve(sess.client)
        if sess.closed:
            return
        sess.closed = True
        try:
            await sess.seq.close()
        except runtime.KvtierError as exc:
            log.warning("closing sequence %s: %s", sess.id, exc)

    # -- leases and caps ----------------------------------------------------------------
    def reserve(self, client: str) -> None:
        """Count a sequence about to open against the caps (429 past them);
        the count is taken before the open so that concurrent opens cannot overshoot."""
        lim = self.limits
        total = sum(self.held.values())
        if total >= lim.max_sequences:
            raise TooManySequences("max_sequences", f"the server holds {total} open sequences, its limit "
                                                    f"(--max-sequences {lim.max_sequences}): try again later")
        if self.held[client] >= lim.max_sequences_per_client:
            raise TooManySequences("max_sequences_per_client",
                                   f"client {client} holds {self.held[client]} open sequences, the limit per "
                                   f"client (--max-sequences-per-client {lim.max_sequences_per_client}): "
                                   "close some first")
        self.held[client] += 1

    def unreserve(self, client: str) -> None:
        self.held[client] -= 1
        if self.held[client] <= 0:
            del self.held[client]

    def register(self, sess: Session) -> None:
        """Make an opened (and reserved) session reachable; its lease starts now."""
        sess.renew(self.limits.lease_seconds)
        self.sessions[sess.id] = sess

    async def sweep_forever(self) -> None:
        """Reclaim expired sequences until cancelled; a failed sweep is logged, never fatal."""
        await every(self.limits.sweep_interval, self.sweep, "lease sweep")

    async def sweep(self) -> int:
        """Release and close the sequences whose lease ran out (their client
        vanished), so their pages come back. One in use by a request is skipped:
        the request renews it. Returns how many were closed."""
        now = time.monotonic()
        closed = 0
        for sess in [s for s in self.sessions.values() if s.expires <= now]:
            if sess.closed or sess.lock.locked() or sess.expires > time.monotonic():
                continue                    # a request has it (or renewed it meanwhile)
            async with sess.lock:
                try:
                    await self.expire(sess)
                except Exception:   # noqa: BLE001 - one bad sequence must not stop the others' reclaim
                    log.exception("closing expired sequence %s", sess.id)
                closed += 1
        return closed

    async def expire(self, sess: Session) -> None:
        log.info("sequence %s of client %s: lease expired, closing it", sess.id, sess.client)
        self.expired += 1
        if sess.acquired:
            try:
                await self.release(sess)
            except Exception:   # noqa: BLE001 - closing frees its pages anyway
                log.exception("releasing expired sequence %s", sess.id)
        await self._close_session(sess)

    @contextlib.contextmanager
    def body_budget(self, nbytes: int) -> Iterator[None]:
        """Admit a request body of ``nbytes`` against the in-flight cap (503 past it)."""
        cap = self.limits.max_inflight_bytes
        if self.inflight_bytes + nbytes > cap:
            raise ServerBusy("max_inflight_bytes", f"request bodies in flight are at the server's cap "
                                                   f"({cap} bytes, --max-inflight-bytes): try again soon")
        self.inflight_bytes += nbytes
        try:
            yield
        finally:
            self.inflight_bytes -= nbytes

    async def offload(self, nbytes: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``: on the loop for a small body, on the parser thread for a large one."""
        if nbytes <= OFFLOAD_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.parser, fn, *args)

    def check_length(self, sess: Session, prompt: Prompt) -> None:
        """A sequence grows to at most --max-tokens tokens (block keys count a block each)."""
        tpb, limit = self.cfg.tokens_per_block, self.limits.max_tokens
        total = len(sess.seq.keys) * tpb + prompt.token_count(tpb)
        if total > limit:
            raise PayloadTooLarge("max_tokens", f"the sequence would hold {total} tokens, over the limit of "
                                                f"{limit} (--max-tokens)")

    # -- helpers -------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def locked(self, request: web.Request):
        """The request's session, held for this request alone (and still open once the lock is ours)."""
        sess = self.session(request)
        async with sess.lock:
            try:
                yield self.session(request)
            finally:
                sess.renew(self.limits.lease_seconds)     # the lease counts from the request's end

    def session(self, request: web.Request) -> Session:
        """The named open session, its lease renewed."""
        sess = self.sessions.get(request.match_info["id"])
        if sess is None or sess.closed:
            raise UnknownSequence(f"no open sequence {request.match_info['id']!r}")
        sess.renew(self.limits.lease_seconds)
        return sess

    def stream(self):
        return torch.cuda.current_stream() if self.cuda else None

    async def acquire(self, sess: Session) -> None:
        await sess.seq.acquire(self.stream())
        sess.acquired = True
        self.fill(sess)

    @contextlib.asynccontextmanager
    async def pages_on_gpu(self, sess: Session):
        """Acquire a released sequence for one request's work, then release it again."""
        was = sess.acquired
        if not was:
            await self.acquire(sess)
        try:
            yield
        finally:
            if not was:
                await self.release(sess)

    async def release(self, sess: Session) -> None:
        await sess.seq.release(self.stream())
        sess.acquired = False

    def pending(self, sess: Session, upto: int) -> bool:
        """Whether some own page of the first ``upto`` blocks (with keys) is not filled yet."""
        seq = sess.seq
        n = min(len(seq.keys), seq.num_blocks, upto)
        for layer in self.roles:
            if any((i, layer) not in sess.written for i in range(seq.matched_blocks, n)):
                return True
            if any(b < n and (b, layer) not in sess.written for b in seq.recompute_blocks(layer)):
                return True
        return False

    def _expected(self, keys: list, layer: int, role: str, nbytes: int, device) -> torch.Tensor:
        rows = torch.stack([page_content(k, layer, role, nbytes) for k in keys])
        return rows if rows.device == device else rows.to(device)

    def fill(self, sess: Session) -> int:
        """Write the deterministic content into the sequence's own GPU pages
        (extended blocks and recompute holes) whose block key is known. Needs
        the sequence acquired (its pages locked on the GPU)."""
        seq, store = sess.seq, self.store
        nkeys = min(len(seq.keys), seq.num_blocks)
        written = 0
        for layer, roles in self.roles.items():
            idx = seq.page_indices(layer)
            own = set(range(seq.matched_blocks, nkeys)) | {b for b in seq.recompute_blocks(layer) if b < nkeys}
            todo = sorted(i for i in own if (i, layer) not in sess.written and idx[i] >= 0)
            if not todo:
                continue
            keys = [seq.keys[i] for i in todo]
            for role, nbytes in roles:
                pool = store.pool_tensor(layer, role)
                slots = index_tensor([idx[i] for i in todo], pool.device)
                pool.index_copy_(0, slots, self._expected(keys, layer, role, nbytes, pool.device))
                written += len(todo)
            sess.written.update((i, layer) for i in todo)
        return written

    def check(self, sess: Session) -> dict:
        """Compare every committed (or server-filled) page on the GPU with its content."""
        seq, store = sess.seq, self.store
        ok = bad = skipped = 0
        corrupt = []
        nkeys = min(len(seq.keys), seq.num_blocks)
        for layer, roles in self.roles.items():
            idx = seq.page_indices(layer)
            blocks = [i for i in range(nkeys) if i < seq.committed or (i, layer) in sess.written]
            present = [i for i in blocks if idx[i] >= 0]
            skipped += (len(blocks) - len(present)) * len(roles)   # stale window pages not on the GPU
            if not present:
                continue
            keys = [seq.keys[i] for i in present]
            for role, nbytes in roles:
                pool = store.pool_tensor(layer, role)
                slots = index_tensor([idx[i] for i in present], pool.device)
                same = (pool.index_select(0, slots) == self._expected(keys, layer, role, nbytes, pool.device)).all(1)
                n_ok = int(same.sum())
                ok += n_ok
                bad += len(present) - n_ok
                if n_ok < len(present):
                    for i, good in zip(present, same.tolist()):
                        if not good and len(corrupt) < 32:
                            corrupt.append({"block": i, "layer": layer, "role": role, "slot": idx[i]})
        self.verified_ok += ok
        self.verified_bad += bad
        return {"verified_pages": ok, "corrupt": bad, "skipped": skipped, "corrupt_pages": corrupt}

    def describe(self, sess: Session) -> dict:
        seq = sess.seq
        return {"id": sess.id, "matched_blocks": seq.matched_blocks, "matched_by_tier": dict(seq.matched_by_tier),
                "num_blocks": seq.num_blocks, "num_keys": len(seq.keys), "committed": seq.committed,
                "acquired": sess.acquired, "priority": seq.priority}

    def page_indices(self, sess: Session) -> dict[str, list[int]]:
        return {str(layer): sess.seq.page_indices(layer) for layer in sorted(self.roles)}


# -- handlers -------------------------------------------------------------------------------------------
def _state(request: web.Request) -> ServerState:
    return request.app[STATE_KEY]


def client_id(request: web.Request) -> str:
    """Who a request counts against for --max-sequences-per-client: its peer IP
    address (not a header, which any client could vary to dodge the cap)."""
    return request.remote or "unknown"


async def open_sequence(request: web.Request) -> web.Response:
    st = _state(request)
    client = client_id(request)
    st.reserve(client)                  # before the body is read: a client at its cap costs nothing
    try:
        sess = await _open_session(st, request, client)
    except BaseException:
        st.unreserve(client)
        raise
    st.register(sess)
    return web.json_response(st.describe(sess))


async def _open_session(st: ServerState, request: web.Request, client: str) -> Session:
    """Open and acquire the body's sequence (closed again if the acquire fails)."""
    body, prompt = await read_prompt(request)
    priority = body.get("priority")
    if priority is not None:
        priority = _int(priority, "priority", 0, 100)
    # tokens as an int64 array: the store converts it in C and hashes a long prompt off the loop
    seq = await st.store.open_sequence(tokens=prompt.tokens, block_keys=prompt.keys, priority=priority)
    sess = Session(secrets.token_urlsafe(16), seq, client, st.limits.lease_seconds)
    try:
        await st.acquire(sess)          # nobody else can reach sess (nor its lock) before register
    except BaseException:
        with contextlib.suppress(runtime.KvtierError):
            await seq.close()
        raise
    return sess


async def get_sequence(request: web.Request) -> web.Response:
    st = _state(request)
    sess = st.session(request)
    return web.json_response(st.describe(sess))


async def extend(request: web.Request) -> web.Response:
    st = _state(request)
    body = await read_body(request)
    n = _num_blocks(body)
    async with st.locked(request) as sess:
        async with st.pages_on_gpu(sess):
            await sess.seq.extend(n)
            st.fill(sess)
            out = {"num_blocks": sess.seq.num_blocks, "page_indices": st.page_indices(sess)}
        return web.json_response(out)


async def commit(request: web.Request) -> web.Response:
    st = _state(request)
    body = await read_body(request)
    n = _num_blocks(body)
    async with st.locked(request) as sess:
        if st.pending(sess, n) and n <= sess.seq.num_blocks and n <= len(sess.seq.keys):
            if sess.acquired:
                st.fill(sess)
            else:
                await st.acquire(sess)
                await st.release(sess)
        sess.seq.commit(n)
        return web.json_response({"committed": sess.seq.committed, "num_blocks": sess.seq.num_blocks})


async def append(request: web.Request) -> web.Response:
    st = _state(request)
    _, prompt = await read_prompt(request)
    async with st.locked(request) as sess:
        st.check_length(sess, prompt)
        sess.seq.append(tokens=prompt.tokens, block_keys=prompt.keys)
        if sess.acquired:
            st.fill(sess)
        return web.json_response({"num_keys": len(sess.seq.keys), "num_blocks": sess.seq.num_blocks})


async def acquire(request: web.Request) -> web.Response:
    st = _state(request)
    await read_body(request, required=False)
    async with st.locked(request) as sess:
        if sess.acquired:
            raise runtime.UsageError("sequence is already acquired")
        await st.acquire(sess)
        return web.json_response({"acquired": True, "page_indices": st.page_indices(sess)})


async def release(request: web.Request) -> web.Response:
    st = _state(request)
    await read_body(request, required=False)
    async with st.locked(request) as sess:
        await st.release(sess)
        return web.json_response({"released": True})


async def verify(request: web.Request) -> web.Response:
    st = _state(request)
    async with st.locked(request) as sess:
        async with st.pages_on_gpu(sess):
            out = st.check(sess)
        return web.json_response(out)


async def close_sequence(request: web.Request) -> web.Response:
    st = _state(request)
    async with st.locked(request) as sess:
        await st._close_session(sess)
        return web.json_response({"closed": True})


async def stats(request: web.Request) -> web.Response:
    return web.json_response(_state(request).store.stats())


async def healthz(request: web.Request) -> web.Response:
    st = _state(request)
    if st.store is None or st.store.closed or st.shutting_down:
        return web.json_response({"ok": False}, status=503)
    return web.json_response({"ok": True, "device": st.store.device.name, "open_sequences": len(st.sessions)})


async def metrics(request: web.Request) -> web.Response:
    data = generate_latest(_state(request).registry)
    return web.Response(body=data, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


# -- errors ---------------------------------------------------------------------------------------------
ERROR_STATUS: list[tuple[type, int]] = [
    (BadRequest, 400),
    (UnknownSequence, 404),
    (UnsupportedEncoding, 415),
    (runtime.RequestTooLargeError, 413),      # never fits this store: not "try later" (an OutOfPagesError too)
    (runtime.OutOfPagesError, 503),
    (runtime.StoreClosedError, 410),
    (runtime.CorruptPageError, 500),
    (runtime.DiskFullError, 500),
    (runtime.TierIOError, 500),
    (runtime.UsageError, 400),
    (runtime.ConfigError, 400),
]


def error_response(exc: BaseException) -> web.Response:
    payload = {"error": type(exc).__name__, "message": str(exc)[:2000]}
    headers = {}
    if isinstance(exc, LimitExceeded):
        status = exc.status
        payload["limit"] = exc.limit
        if status in (429, 503):
            headers["Retry-After"] = "1"
    else:
        status = next((code for cls, code in ERROR_STATUS if isinstance(exc, cls)), 500)
    return web.json_response(payload, status=status, headers=headers)


@web.middleware
async def errors_middleware(request: web.Request, handler) -> web.StreamResponse:
    st = _state(request)
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
    try:
        if st.shutting_down and request.path.startswith("/sequences"):
            raise runtime.StoreClosedError("the server is shutting down")
        resp = await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        resp = web.json_response({"error": type(exc).__name__, "message": exc.reason}, status=exc.status)
    except asyncio.CancelledError:
        raise
    except Exception as exc:   # noqa: BLE001 - every error becomes a response; the server keeps running
        resp = error_response(exc)
        if resp.status >= 500 and not isinstance(exc, runtime.OutOfPagesError):
            log.error("%s %s failed", request.method, request.path, exc_info=exc)
    st.requests.labels(request.method, route, str(resp.status)).inc()
    return resp


@web.middleware
async def body_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Refuse a body before reading it when it is compressed (415: its size is
    unknown until inflated), over --max-body-bytes (413), or would take the
    bodies in flight past --max-inflight-bytes (503); the admitted bytes count
    until the response. A chunked body counts as the largest allowed."""
    if not request.body_exists:
        return await handler(request)
    st = _state(request)
    encoding = request.headers.get(hdrs.CONTENT_ENCODING, "").strip().lower()
    if encoding not in ("", "identity"):
        raise UnsupportedEncoding(f"Content-Encoding {encoding[:40]!r} is not accepted: send the JSON uncompressed")
    limit = st.limits.max_body_bytes
    nbytes = limit if request.content_length is None else request.content_length
    if nbytes > limit:
        raise PayloadTooLarge("max_body_bytes", f"a {nbytes}-byte body is over the limit of {limit} bytes "
                                                "(--max-body-bytes)")
    with st.body_budget(nbytes):
        return await handler(request)


# -- the app --------------------------------------------------------------------------------------------
def make_app(cfg: runtime.StoreConfig, limits: Limits | None = None) -> web.Application:
    limits = limits or Limits()
    app = web.Application(middlewares=[errors_middleware, body_middleware], client_max_size=limits.max_body_bytes)
    state = ServerState(cfg, limits)
    app[STATE_KEY] = state

    async def store_ctx(app: web.Application):
        await state.open_store()
        yield
        await state.close_store()

    async def on_shutdown(app: web.Application) -> None:
        state.shutting_down = True      # requests that still arrive on open connections get 410

    app.cleanup_ctx.append(store_ctx)
    app.on_shutdown.append(on_shutdown)
    app.router.add_post("/sequences", open_sequence)
    app.router.add_get("/sequences/{id}", get_sequence)
    app.router.add_delete("/sequences/{id}", close_sequence)
    app.router.add_post("/sequences/{id}/extend", extend)
    app.router.add_post("/sequences/{id}/commit", commit)
    app.router.add_post("/sequences/{id}/append", append)
    app.router.add_post("/sequences/{id}/acquire", acquire)
    app.router.add_post("/sequences/{id}/release", release)
    app.router.add_get("/sequences/{id}/verify", verify)
    app.router.add_get("/stats", stats)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    return app


async def serve(cfg: runtime.StoreConfig, host: str, port: int, limits: Limits | None = None) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    app = make_app(cfg, limits)
    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT)
    try:
        await runner.setup()     # opens the store
    except runtime.KvtierError as exc:
        print(f"kvtier serve: cannot open the store: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        site = web.TCPSite(runner, host, port, reuse_address=True)
        await site.start()
    except OSError as exc:
        print(f"kvtier serve: cannot listen on {host}:{port}: {exc}", file=sys.stderr, flush=True)
        await runner.cleanup()
        return 2
    bound = runner.addresses[0]
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    print(f"listening on http://{shown}:{bound[1]}", flush=True)
    await stop.wait()
    print("stopping: finishing the requests in flight, then closing the store"
          + (" (committed pages persisted to disk)" if cfg.disk is not None and cfg.persist_on_close else ""),
          file=sys.stderr, flush=True)
    # stop accepting, finish in-flight requests, then close sequences and the store (cleanup_ctx)
    await runner.cleanup()
    print("stopped", file=sys.stderr, flush=True)
    return 0


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0..65535 (0 picks a free one)."""
    n = at_least(0)(text)
    if n > 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is at most 65535, got {n}")
    return n


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above 0."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return x


def limits_from(args: argparse.Namespace) -> Limits:
    return Limits(lease_seconds=args.lease_seconds, max_sequences=args.max_sequences,
                  max_sequences_per_client=args.max_sequences_per_client, max_tokens=args.max_tokens,
                  max_body_bytes=args.max_body_bytes, max_inflight_bytes=args.max_inflight_bytes)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="a kvtier TOML config (default: the embedded small model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8080, help="0..65535; 0 picks a free port")
    p.add_argument("--disk-dir", help="disk tier directory (kept across restarts; default: a temp dir, removed)")
    p.add_argument("--gpu-slots", type=at_least(1), help="GPU slots per pool group (default 64)")
    p.add_argument("--host-slots", type=at_least(1), help="host slots per pool group (default 128)")
    p.add_argument("--disk-slots", type=at_least(1), help="disk slots per pool group (default 1024)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"),
                   help="GPU tier device (default: cpu, i.e. emulated, for the embedded model)")
    p.add_argument("--no-fsync", dest="fsync", action="store_false",
                   help="skip the disk tier's durability barriers (throwaway experiments)")
    p.add_argument("--on-mismatch", choices=("error", "wipe"),
                   help="when --disk-dir holds another layout: refuse (error) or wipe it")
    d = Limits()
    p.add_argument("--lease-seconds", type=positive_seconds, default=d.lease_seconds,
                   help="a sequence no request names for this long is released and closed "
                        f"(default {d.lease_seconds:g})")
    p.add_argument("--max-sequences", type=at_least(1), default=d.max_sequences,
                   help=f"open sequences on the server (default {d.max_sequences})")
    p.add_argument("--max-sequences-per-client", type=at_least(1), default=d.max_sequences_per_client,
                   help="open sequences per client, i.e. peer IP address "
                        f"(default {d.max_sequences_per_client})")
    p.add_argument("--max-tokens", type=at_least(1), default=d.max_tokens,
                   help=f"tokens per request and per sequence (default {d.max_tokens})")
    p.add_argument("--max-body-bytes", type=at_least(1024), default=d.max_body_bytes,
                   help=f"bytes of one request body (default {d.max_body_bytes})")
    p.add_argument("--max-inflight-bytes", type=at_least(1024), default=d.max_inflight_bytes,
                   help=f"bytes of the bodies of all requests in flight (default {d.max_inflight_bytes})")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    if args.max_inflight_bytes < args.max_body_bytes:
        p.error("--max-inflight-bytes must be at least --max-body-bytes")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tune_gc()                      # a long-lived store: see README, "Garbage collection"
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tmp_dir = made_dir = None
    try:
        if args.config:
            if args.disk_dir is not None and not os.path.exists(args.disk_dir):
                os.makedirs(args.disk_dir)      # as without --config (gone again if the config is bad)
                made_dir = args.disk_dir
            cfg = override_config(runtime.load_config(args.config, disk_path=args.disk_dir), args)
        else:
            disk_dir = args.disk_dir
            if disk_dir is None:
                disk_dir = tmp_dir = tempfile.mkdtemp(prefix="kvtier-serve-")
            else:
                os.makedirs(disk_dir, exist_ok=True)
            cfg = default_config(disk_dir, _or(args.gpu_slots, 64), _or(args.host_slots, 128),
                                 _or(args.disk_slots, 1024),
                                 device=args.device or "cpu", fsync=args.fsync,
                                 on_mismatch=args.on_mismatch or "error")
    except (runtime.ConfigError, OSError) as exc:
        if made_dir is not None:
            shutil.rmtree(made_dir, ignore_errors=True)
        what = f"--disk-dir {args.disk_dir}: " if isinstance(exc, OSError) and args.disk_dir is not None else ""
        print(f"kvtier serve: {what}{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        return runtime.run(serve(cfg, args.host, args.port, limits_from(args)))
    finally:
        if tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

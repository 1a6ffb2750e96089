"""The remote tier's backend: cold pages in a shared Redis / Valkey (standalone or cluster).

Data plane only: no asyncio policy beyond the client's own awaits, nothing
here imports ``runtime``. The Store decides what to look up, fetch and
publish; this module moves the bytes, checks them, and turns every remote
failure into a miss (never an exception, never a wrong byte).

Keys
----
One key per cold page::

    <namespace> ":" <hex BLAKE2b-128 of the layout fingerprint> ":" <hex of the block key form> ":" <life cycle>

The block key form is the 17 bytes the data plane already uses for a block
key: its 16-byte key (``<QQ`` of lo, hi) plus its 1-byte tag, as
:func:`block_key_bytes` builds it from an ``int``/``bytes`` block key. Two
stores with the same namespace and fingerprint share keys; any other pair
never does. Namespaces may not contain ``{`` or ``}`` (a cluster hash tag
would put every page on one node).

Values
------
One value per key: a fixed 36-byte little-endian header, then the raw page::

    struct "<4s B B H I 16s Q"
      magic        4s   b"KVRM"
      version      u8   1
      life cycle   u8   the page's life cycle (0..255)
      reserved     u16  0
      payload len  u32  bytes of page that follow (== the caller's page_bytes)
      key digest   16s  BLAKE2b-128 of the 17-byte block key form, keyed with the
                        layout fingerprint's digest (so a value copied under
                        another layout's key is a mismatch, not data)
      checksum     u64  xxh3_64 of the payload
    payload        payload len bytes

A value is served only when every field matches what the caller asked for;
otherwise the page is a miss counted by kind: ``absent`` (no such key),
``corrupt`` (bad magic/version/reserved, a value whose length disagrees with
its header, a checksum mismatch), ``wrong_size`` (payload length != the
caller's page size), ``mismatch`` (key digest or life cycle of another page),
``circuit_open`` (the breaker kept the call off the network) or ``error`` (the
round trip, or that key's reply, failed).

Round trips
-----------
``exists``, ``get`` and ``put`` send one pipeline per node that owns any of the
call's keys (cluster: keys grouped by slot owner, nodes served concurrently)
and read the replies in order; ``get`` checks and copies each value as it
arrives. ``exists`` and ``get`` run under one deadline of ``op_timeout`` (a
cluster's slot-map refresh, connecting, sending, every reply, every node), so
no lookup or fetch waits longer. ``put`` splits a batch into pipelines of at
most ``max_inflight_bytes`` of values (a single larger value goes alone), each
under its own ``op_timeout``, and every pipeline first takes its bytes from
one budget shared by all concurrent puts (FIFO), so the client never holds
more than that in flight. A timeout or dropped connection makes the keys that
had no reply yet misses; an error reply (``-MOVED``, ``-OOM``, ``-WRONGTYPE``)
makes that one key a miss and the pipeline goes on. Both are counted as
failures by kind (``timeout``, ``connection``, ``cluster``, ``other``): one per
failed round trip and one per error reply. After a failure that hints at a
topology change the cluster's slot map is refreshed before the next call.

Circuit breaker
---------------
``breaker_failures`` consecutive failed calls (a call fails when any of its
round trips does) open the circuit; while open every call returns misses at
once (``circuit_open``) without touching the network; after
``breaker_cooldown`` seconds one call goes through (half open) while the
others still get ``circuit_open``: success closes the circuit, failure opens
it again for another cooldown. A caller cancelling a call counts as neither.
``open`` never fails on an unreachable server: the tier starts with its
circuit open (the failure counted).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
import struct
import time
import urllib.parse
from collections import deque
from typing import Any, Callable, Sequence

import numpy as np
import xxhash

from .errors import ConfigError, UsageError

try:                                                   # Python >= 3.11
    from asyncio import timeout_at as _timeout_at
except ImportError:                                    # pragma: no cover - 3.10: redis-py depends on async-timeout
    from async_timeout import timeout_at as _timeout_at

__all__ = ["RemoteSettings", "RemoteTier", "block_key_bytes", "HEADER", "HEADER_SIZE", "MAGIC", "VERSION"]

HEADER = struct.Struct("<4sBBHI16sQ")
HEADER_SIZE = HEADER.size                              # 36
MAGIC = b"KVRM"
VERSION = 1
BLOCK_KEY_BYTES = 17
_FIELD = "tiers.remote"
_SCHEMES = ("redis", "rediss", "unix")

MISS_KINDS = ("absent", "corrupt", "wrong_size", "mismatch", "circuit_open", "error")
FAILURE_KINDS = ("timeout", "connection", "cluster", "other")
SEND_PIECE_BYTES = 4 << 20                          # a pipeline goes out in writes of about this much
_ops = ("exists", "get", "put")

_xxh3 = xxhash.xxh3_64_intdigest
_unpack = HEADER.unpack_from
_pack = HEADER.pack


def block_key_bytes(key: int | bytes) -> bytes:
    """The 17-byte form of a block key that :meth:`RemoteTier.page_key` and the idents take:
    ``struct.pack("<QQB", lo, hi, tag)`` of the data plane's (lo, hi, tag) encoding."""
    if type(key) is bytes and len(key) == 16:          # a token digest, the common case: no detour
        return key + b"\x10"
    if type(key) is int and -(1 << 127) <= key < (1 << 127):
        return key.to_bytes(16, "little", signed=True) + b"\x00"
    from .journal import encode_key
    lo, hi, tag = encode_key(key)
    return struct.pack("<QQB", lo, hi, tag)


_KEY17 = np.dtype([("lo", "<u8"), ("hi", "<u8"), ("tag", "u1")])    # block_key_bytes' layout, packed


def record_key_bytes(records: np.ndarray) -> list[bytes]:
    """``block_key_bytes`` of each disk journal record's key (``tiers.journal.RECORD``),
    built for the whole array at once."""
    packed = np.empty(len(records), dtype=_KEY17)
    packed["lo"], packed["hi"], packed["tag"] = records["key_lo"], records["key_hi"], records["ktag"]
    raw = packed.tobytes()
    return [raw[i:i + BLOCK_KEY_BYTES] for i in range(0, len(raw), BLOCK_KEY_BYTES)]


# ---- settings ----------------------------------------------------------------------------------

def _number(field: str, value: Any, *, integer: bool = False) -> None:
    """A positive int (``integer``) or a positive finite number; bools are neither."""
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or (not integer and not math.isfinite(value)):
        what = "an integer" if integer else "a finite number"
        raise ConfigError(f"{_FIELD}.{field}", f"must be {what}, got {value!r}")
    if value <= 0:
        raise ConfigError(f"{_FIELD}.{field}", f"must be > 0, got {value!r}")


def _check_url(field: str, url: Any, cluster: bool) -> None:
    if not isinstance(url, str) or not url:
        raise ConfigError(field, f"must be a URL string such as \"redis://127.0.0.1:6379/0\", got {url!r}")
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port                                      # raises on a port that is not a number in 0..65535
    except ValueError as e:
        raise ConfigError(field, f"invalid URL {url!r}: {e}") from None
    if parts.scheme not in _SCHEMES:
        raise ConfigError(field, f"scheme must be redis://, rediss:// or unix://, got {url!r}")
    if parts.scheme == "unix":
        if cluster:
            raise ConfigError(field, "a cluster is reached over TCP (redis:// or rediss://), not unix://")
        if not parts.path:
            raise ConfigError(field, f"unix:// needs a socket path, got {url!r}")
    else:
        if not parts.hostname:
            raise ConfigError(field, f"needs a host, got {url!r}")
        db = parts.path.lstrip("/")
        if db and not db.isdigit():
            raise ConfigError(field, f"the path must be a database number, got {url!r}")
    if cluster and parts.path not in ("", "/", "/0"):
        raise ConfigError(field, f"a cluster has only database 0, got {url!r}")


@dataclasses.dataclass
class RemoteSettings:
    url: str | None = None            # "redis://127.0.0.1:6379/0" (also rediss://, unix://)
    urls: list[str] | None = None     # cluster startup nodes (implies cluster)
    cluster: bool = False
    namespace: str = "kvtier"
    ttl_ms: int | None = 24 * 3600 * 1000
    max_inflight_bytes: int = 256 << 20
    connect_timeout: float = 1.0
    op_timeout: float = 0.5           # no exists/get call (and no put pipeline) waits longer than this
    breaker_failures: int = 3         # consecutive failed calls that open the circuit
    breaker_cooldown: float = 2.0     # seconds the circuit stays open before one trial (half-open)
    model: str = ""                   # the model the pages belong to: part of the Store's fingerprint
    write: str = "through"            # the Store's policy: "through" (pages leaving the GPU) or "back" (dropped)

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad field (``tiers.remote.<field>``)."""
        if not isinstance(self.model, str):
            raise ConfigError(f"{_FIELD}.model", f"must be a string, got {self.model!r}")
        if self.write not in ("through", "back"):
            raise ConfigError(f"{_FIELD}.write", f"expected 'through' or 'back', got {self.write!r}")
        if not isinstance(self.cluster, bool):
            raise ConfigError(f"{_FIELD}.cluster", f"must be true or false, got {self.cluster!r}")
        if self.url is not None and self.urls is not None:
            raise ConfigError(f"{_FIELD}.urls", "set url or urls, not both")
        if self.url is None and self.urls is None:
            raise ConfigError(f"{_FIELD}.url", "set url (or urls for a cluster)")
        if self.urls is not None:
            if isinstance(self.urls, (str, bytes)) or not isinstance(self.urls, (list, tuple)) or not self.urls:
                raise ConfigError(f"{_FIELD}.urls", f"must be a non-empty list of URLs, got {self.urls!r}")
            for i, u in enumerate(self.urls):
                _check_url(f"{_FIELD}.urls[{i}]", u, True)
        else:
            _check_url(f"{_FIELD}.url", self.url, self.cluster)
        ns = self.namespace
        if not isinstance(ns, str) or not ns or len(ns) > 128 or not ns.isprintable() or any(
                c in ns for c in " {}"):
            raise ConfigError(f"{_FIELD}.namespace",
                              f"must be 1..128 printable characters without spaces, '{{' or '}}', got {ns!r}")
        if self.ttl_ms is not None:
            _number("ttl_ms", self.ttl_ms, integer=True)
        _number("max_inflight_bytes", self.max_inflight_bytes, integer=True)
        _number("connect_timeout", self.connect_timeout)
        _number("op_timeout", self.op_timeout)
        _number("breaker_failures", self.breaker_failures, integer=True)
        _number("breaker_cooldown", self.breaker_cooldown)

    @property
    def is_cluster(self) -> bool:
        return bool(self.cluster or self.urls is not None)


# ---- failure kinds ------------------------------------------------------------------------------

def _failure_kind(exc: BaseException) -> str:
    from redis import exceptions as rx
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError, rx.TimeoutError)):
        return "timeout"
    if isinstance(exc, (rx.AskError, rx.TryAgainError, rx.ClusterDownError, rx.ClusterCrossSlotError,
                        rx.ClusterError, rx.RedisClusterException)):
        return "cluster"
    if isinstance(exc, (rx.ConnectionError, OSError, EOFError)):
        return "connection"
    return "other"


def _topology_suspect(exc: BaseException) -> bool:
    """After this error a cluster's slot map may be out of date."""
    return _failure_kind(exc) in ("cluster", "connection", "timeout")


# ---- a byte budget shared by all puts --------------------------------------------------------------

class _ByteBudget:
    """FIFO byte semaphore: ``acquire(n)`` waits until ``n`` more bytes fit under the limit
    (a request larger than the limit waits for an empty budget and then runs alone)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()

    def _fits(self, n: int) -> bool:
        return self.used == 0 or self.used + n <= self.limit

    async def acquire(self, n: int) -> None:
        if not self._waiters and self._fits(n):
            self._take(n)
            return
        fut = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():      # granted, then cancelled: give the bytes back
                self.release(n)
            else:
                self._waiters.remove(entry)
                self._wake()
            raise

    def _take(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)

    def release(self, n: int) -> None:
        self.used -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if not self._fits(n):
                return
            self._waiters.popleft()
            self._take(n)
            fut.set_result(None)


# ---- nodes: where a pipeline goes ----------------------------------------------------------------

class _Node:
    """A server a pipeline can be sent to: one connection out, one back."""
    __slots__ = ("name", "acquire", "release")

    def __init__(self, name: str, acquire: Callable, release: Callable) -> None:
        self.name = name
        self.acquire = acquire          # async () -> connection
        self.release = release          # async (connection) -> None


def _reply_reader(conn) -> Callable:
    """The fastest way to read one reply on ``conn`` that redis-py offers: the connection's
    parser (no per-reply timeout context; our own op_timeout bounds the whole round trip),
    else the connection's public ``read_response``."""
    parser = getattr(conn, "_parser", None)
    fn = getattr(parser, "read_response", None)
    return fn if fn is not None else conn.read_response


class _Standalone:
    def __init__(self, settings: RemoteSettings, kwargs: dict) -> None:
        import redis.asyncio as aredis
        self.client = aredis.Redis.from_url(settings.url, **kwargs)
        pool = self.client.connection_pool
        pool.make_connection()          # not connected: checks the URL's query options now, not at the first connect
        self.pool = pool
        import inspect
        param = inspect.signature(pool.get_connection).parameters.get("command_name")
        args = ("GET",) if param is not None and param.default is inspect.Parameter.empty else ()   # redis-py < 5.3

        async def acquire():
            return await pool.get_connection(*args)

        async def release(conn):
            await pool.release(conn)

        self.node = _Node(settings.url, acquire, release)

    async def ensure_ready(self) -> None:
        return None

    async def ping(self) -> None:
        await self.client.ping()

    def route(self, keys: Sequence[bytes]) -> list[tuple[_Node, list[int] | None]]:
        return [(self.node, None)]      # None: every key, in order

    def mark_stale(self) -> None:
        return None

    async def close(self) -> None:
        await self.client.aclose()


class _Cluster:
    def __init__(self, settings: RemoteSettings, kwargs: dict) -> None:
        from redis.asyncio.cluster import ClusterNode, RedisCluster
        from redis.crc import key_slot
        self._key_slot = key_slot
        urls = settings.urls if settings.urls is not None else [settings.url]
        first = urllib.parse.urlsplit(urls[0])
        kw = dict(kwargs)
        if first.username:
            kw["username"] = urllib.parse.unquote(first.username)
        if first.password:
            kw["password"] = urllib.parse.unquote(first.password)
        if first.scheme == "rediss":
            kw["ssl"] = True
        nodes = []
        for u in urls:
            p = urllib.parse.urlsplit(u)
            nodes.append(ClusterNode(p.hostname, p.port or 6379))
        self.client = RedisCluster(startup_nodes=nodes, require_full_coverage=False, reinitialize_steps=1,
                                   **kw)
        self._need_init = True
        self._stale = False
        self._wrapped: dict[int, _Node] = {}

    async def ensure_ready(self) -> None:
        if self._need_init:
            await self.client.initialize()
            self._need_init = False
            self._stale = False
            self._wrapped.clear()
        elif self._stale:
            await self.client.nodes_manager.initialize()
            self._stale = False
            self._wrapped.clear()

    async def ping(self) -> None:
        await self.ensure_ready()

    def mark_stale(self) -> None:
        self._stale = True

    def _node(self, cnode) -> _Node:
        node = self._wrapped.get(id(cnode))
        if node is None:
            async def acquire():
                return cnode.acquire_connection()

            give_back = getattr(cnode, "release", None) or cnode._free.append     # redis-py < 5.1: no release()

            async def release(conn):
                give_back(conn)

            node = _Node(cnode.name, acquire, release)
            self._wrapped[id(cnode)] = node
        return node

    def route(self, keys: Sequence[bytes]) -> list[tuple[_Node, list[int]]]:
        from redis.exceptions import SlotNotCoveredError
        manager = self.client.nodes_manager
        slot_of = self._key_slot
        groups: dict[int, tuple[Any, list[int]]] = {}
        unrouted: list[int] = []
        for i, k in enumerate(keys):
            try:
                cnode = manager.get_node_from_slot(slot_of(k))
            except (SlotNotCoveredError, KeyError, IndexError):
                unrouted.append(i)
                continue
            g = groups.get(id(cnode))
            if g is None:
                groups[id(cnode)] = (cnode, [i])
            else:
                g[1].append(i)
        out: list[tuple[_Node | None, list[int]]] = [(self._node(c), idx) for c, idx in groups.values()]
        if unrouted:
            self._stale = True
            out.append((None, unrouted))
        return out

    async def close(self) -> None:
        await self.client.aclose()


# ---- the tier --------------------------------------------------------------------------------------

def _as_rows(array, name: str, n: int, *, writable: bool) -> np.ndarray:
    """A 2-D uint8 numpy view of a torch tensor or numpy array with ``n`` rows (no copy)."""
    if hasattr(array, "detach") and hasattr(array, "device"):          # torch.Tensor, without importing torch
        if array.device.type != "cpu":
            raise UsageError(f"{name} must be in host memory, got a tensor on {array.device}")
        array = array.detach().numpy()
    if not isinstance(array, np.ndarray):
        raise UsageError(f"{name} must be a torch tensor or numpy array, got {type(array).__name__}")
    if array.dtype != np.uint8 or array.ndim != 2 or array.shape[0] != n:
        raise UsageError(f"{name} must be uint8 of shape [{n}, page_bytes], got {array.dtype} {list(array.shape)}")
    if array.shape[1] == 0 or array.shape[1] >= 1 << 32:
        raise UsageError(f"{name}: page_bytes must be in 1..2**32-1, got {array.shape[1]}")
    if writable and not array.flags.writeable:
        raise UsageError(f"{name} must be writable")
    return array


def _check_keys(keys) -> None:
    if keys and not isinstance(keys[0], bytes):        # the first only: keys come from page_key()
        raise UsageError(f"keys must be bytes from page_key(), got {type(keys[0]).__name__}")


class RemoteTier:
    """Cold pages in Redis / Valkey: see the module docstring for keys, values and failures."""

    def __init__(self, settings: RemoteSettings, fingerprint: bytes, backend) -> None:
        self.settings = settings
        self.fingerprint = bytes(fingerprint)
        self._fp_digest = hashlib.blake2b(self.fingerprint, digest_size=16).digest()
        self._prefix = f"{settings.namespace}:{self._fp_digest.hex()}:".encode()
        self._backend = backend
        self._budget = _ByteBudget(settings.max_inflight_bytes)
        self._closed = False
        # breaker
        self._state = "closed"                  # "closed" | "open"
        self._opened_at = 0.0
        self._consecutive = 0
        self._trial = False
        # stats
        self._n = dict(lookups=0, lookup_hits=0, gets=0, hits=0, puts=0, stored=0, skipped=0, put_failed=0,
                       put_refused=0, bytes_in=0, bytes_out=0, round_trips=0, circuit_opens=0)
        self._lookup_misses = dict.fromkeys(("absent", "circuit_open", "error"), 0)
        self._misses = dict.fromkeys(MISS_KINDS, 0)
        self._failures = dict.fromkeys(FAILURE_KINDS, 0)
        self._latency = {op: [0.0, 0] for op in _ops}

    # -- opening --------------------------------------------------------------------------------

    @classmethod
    async def open(cls, settings: RemoteSettings, fingerprint: bytes) -> "RemoteTier":
        """Validate ``settings`` (ConfigError naming the field), connect and PING within
        ``connect_timeout + op_timeout``. An unreachable server does not fail: the tier opens
        with its circuit open (the failure counted) and tries again after the cooldown."""
        if not isinstance(settings, RemoteSettings):
            raise ConfigError(_FIELD, f"expected RemoteSettings, got {type(settings).__name__}")
        settings.validate()
        if not isinstance(fingerprint, (bytes, bytearray, memoryview)) or not bytes(fingerprint):
            raise UsageError(f"fingerprint must be non-empty bytes, got {fingerprint!r}")
        try:
            from redis.backoff import NoBackoff
            from redis.exceptions import RedisClusterException, RedisError
            from redis.retry import Retry
        except ImportError:
            raise ConfigError(_FIELD, "the remote tier needs redis-py: pip install 'kvtier[remote]'") from None
        kwargs = dict(socket_connect_timeout=settings.connect_timeout, socket_timeout=settings.op_timeout,
                      retry=Retry(NoBackoff(), 0), health_check_interval=0)
        if settings.is_cluster or not settings.url.startswith("unix:"):
            kwargs["socket_keepalive"] = True
        try:
            backend = _Cluster(settings, kwargs) if settings.is_cluster else _Standalone(settings, kwargs)
        except (ValueError, TypeError, RedisClusterException) as e:       # e.g. a bad option in the URL's query
            raise ConfigError(f"{_FIELD}.{'urls' if settings.urls is not None else 'url'}", str(e)) from None
        tier = cls(settings, fingerprint, backend)
        loop = asyncio.get_running_loop()
        try:
            async with _timeout_at(loop.time() + settings.connect_timeout + settings.op_timeout):
                await backend.ping()
        except (RedisError, RedisClusterException, OSError, asyncio.TimeoutError) as e:   # unreachable, refused, ...
            tier._failures[_failure_kind(e)] += 1
            tier._open_circuit()
        return tier

    # -- keys -------------------------------------------------------------------------------------

    def page_key(self, block_key: bytes, lc: int) -> bytes:
        """``namespace:fingerprint digest:block key hex:life cycle`` (bytes)."""
        if not isinstance(block_key, (bytes, bytearray)) or len(block_key) != BLOCK_KEY_BYTES:
            raise UsageError(f"block_key must be the {BLOCK_KEY_BYTES}-byte form (block_key_bytes()), "
                             f"got {block_key!r}")
        if isinstance(lc, bool) or not isinstance(lc, int) or not 0 <= lc <= 255:
            raise UsageError(f"life cycle must be an int in 0..255, got {lc!r}")
        return b"%s%s:%d" % (self._prefix, block_key.hex().encode(), lc)

    def page_keys(self, idents: Sequence[tuple[bytes, int]]) -> list[bytes]:
        return [self.page_key(bk, lc) for bk, lc in idents]

    def _digest(self, block_key: bytes) -> bytes:
        return hashlib.blake2b(block_key, digest_size=16, key=self._fp_digest).digest()

    # -- the breaker ------------------------------------------------------------------------------

    def _open_circuit(self) -> None:
        self._state = "open"
        self._opened_at = time.monotonic()
        self._n["circuit_opens"] += 1

    def _admit(self) -> int:
        """0: refused (circuit open or closed tier), 1: admitted, 2: admitted as the half-open trial."""
        if self._closed:
            return 0
        if self._state == "closed":
            return 1
        if not self._trial and time.monotonic() - self._opened_at >= self.settings.breaker_cooldown:
            self._trial = True
            return 2
        return 0

    def _settle(self, admitted: int, ok: bool) -> None:
        if admitted == 2:
            self._trial = False
        if ok:
            self._consecutive = 0
            self._state = "closed"
        else:
            self._consecutive += 1
            if admitted == 2 or (self._state == "closed" and self._consecutive >= self.settings.breaker_failures):
                self._open_circuit()

    def circuit_state(self) -> str:
        if self._state == "closed":
            return "closed"
        if self._trial or time.monotonic() - self._opened_at >= self.settings.breaker_cooldown:
            return "half_open"
        return "open"

    # -- one round trip ---------------------------------------------------------------------------

    async def _roundtrip(self, node: _Node, chunks: list, n: int, on_reply: Callable[[int, Any], None],
                         deadline: float) -> bool:
        """Send ``chunks`` (a pipeline of ``n`` commands) to ``node`` and hand each reply, in order,
        to ``on_reply(j, reply)`` (an error reply arrives as the exception object). True when every
        reply came back; a failure is counted and returns False. Never raises, except the caller's
        own CancelledError."""
        from redis.exceptions import ConnectionError as RedisConnectionError, ResponseError
        self._n["round_trips"] += 1
        try:
            async with _timeout_at(deadline):
                conn = await node.acquire()
                clean = False
                try:
                    # in pieces of about SEND_PIECE_BYTES: asyncio joins what one writelines gets into a
                    # new bytes object, so a 64 MiB pipeline would be copied whole before its first byte
                    # left; pieces overlap that copy with the server's reading
                    start, size = 0, 0
                    for i, c in enumerate(chunks):
                        size += len(c)
                        if size >= SEND_PIECE_BYTES or i == len(chunks) - 1:
                            if start and not conn.is_connected:   # redis-py would reconnect and send a tail
                                raise RedisConnectionError("the connection closed mid-pipeline")
                            await conn.send_packed_command(chunks[start:i + 1], check_health=False)
                            start, size = i + 1, 0
                    read = _reply_reader(conn)
                    for j in range(n):
                        try:
                            reply = await read(disable_decoding=True)
                        except ResponseError as e:         # the public reader raises error replies
                            reply = e
                        on_reply(j, reply)
                    clean = True
                finally:
                    if not clean:                          # replies left unread: the connection is unusable
                        try:
                            await conn.disconnect(nowait=True)
                        except Exception:                  # noqa: BLE001
                            pass
                    await node.release(conn)
            return True
        except Exception as e:          # noqa: BLE001 - every failure is a miss, counted (TimeoutError included)
            self._failures[_failure_kind(e)] += 1
            if _topology_suspect(e):
                self._backend.mark_stale()
            return False

    async def _fanout(self, keys: Sequence[bytes], make: Callable, deadline: float) -> bool:
        """Prepare the backend, then one round trip per node owning any of ``keys``, concurrently.
        ``make(idx)`` (idx: the positions in ``keys`` that node owns, None for all) returns
        (chunks, n, on_reply). True if every round trip succeeded."""
        try:
            async with _timeout_at(deadline):
                await self._backend.ensure_ready()
        except Exception as e:          # noqa: BLE001
            self._failures[_failure_kind(e)] += 1
            return False
        jobs = []
        ok = True
        for node, idx in self._backend.route(keys):
            if node is None:                     # keys no node owns (cluster slot map incomplete)
                self._failures["cluster"] += 1
                ok = False
                continue
            chunks, n, on_reply = make(idx)
            jobs.append(self._roundtrip(node, chunks, n, on_reply, deadline))
        if len(jobs) == 1:
            return await jobs[0] and ok
        results = await asyncio.gather(*jobs)
        return all(results) and ok

    def _error_reply(self, reply) -> None:
        self._failures[_failure_kind(reply)] += 1
        if _topology_suspect(reply):
            self._backend.mark_stale()

    def _done(self, op: str, admitted: int, ok: bool, cancelled: bool, t0: float) -> None:
        if cancelled:                   # the caller gave up: says nothing about the server
            if admitted == 2:
                self._trial = False
        else:
            self._settle(admitted, ok)
        lat = self._latency[op]
        lat[0] += time.perf_counter() - t0
        lat[1] += 1

    # -- exists -----------------------------------------------------------------------------------

    async def exists(self, keys: list[bytes]) -> list[bool]:
        """Which keys the server holds: one pipelined round trip per node; failures are False."""
        n = len(keys)
        _check_keys(keys)
        self._n["lookups"] += n
        out = [False] * n
        if not n:
            return out
        admitted = self._admit()
        if not admitted:
            self._lookup_misses["circuit_open"] += n
            return out
        t0 = time.perf_counter()
        ok = cancelled = False
        absent = 0

        def make(idx):
            sel = keys if idx is None else [keys[i] for i in idx]
            chunk = b"".join([b"*2\r\n$6\r\nEXISTS\r\n$%d\r\n%s\r\n" % (len(k), k) for k in sel])
            pos = range(n) if idx is None else idx

            def on_reply(j, reply):
                nonlocal absent
                if reply == 1:
                    out[pos[j]] = True
                elif reply == 0:
                    absent += 1
                elif isinstance(reply, BaseException):
                    self._error_reply(reply)
            return [chunk], len(sel), on_reply

        try:
            ok = await self._fanout(keys, make, asyncio.get_running_loop().time() + self.settings.op_timeout)
            return out
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            hits = sum(out)
            self._n["lookup_hits"] += hits
            self._lookup_misses["absent"] += absent
            self._lookup_misses["error"] += n - hits - absent
            self._done("exists", admitted, ok, cancelled, t0)

    # -- get --------------------------------------------------------------------------------------

    async def get(self, keys: list[bytes], idents: list[tuple[bytes, int]], out) -> list[bool]:
        """Fetch and check ``keys``; good payloads are copied into ``out[i]`` and flagged True.
        One pipelined round trip per node; anything wrong is a miss counted by kind."""
        n = len(keys)
        _check_keys(keys)
        if len(idents) != n:
            raise UsageError(f"get: {n} keys but {len(idents)} idents")
        dst = _as_rows(out, "out", n, writable=True)
        page_bytes = dst.shape[1]
        want_len = HEADER_SIZE + page_bytes
        self._n["gets"] += n
        found = [False] * n
        if not n:
            return found
        admitted = self._admit()
        if not admitted:
            self._misses["circuit_open"] += n
            return found
        misses = self._misses
        counted = 0                     # keys with a verdict (hit or a miss of a kind)
        bytes_in = 0
        digest = self._digest
        frombuffer = np.frombuffer
        t0 = time.perf_counter()
        ok = cancelled = False

        def make(idx):
            sel = keys if idx is None else [keys[i] for i in idx]
            chunk = b"".join([b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in sel])
            pos = range(n) if idx is None else idx

            def on_reply(j, value):
                nonlocal counted, bytes_in
                counted += 1
                if value is None:
                    misses["absent"] += 1
                    return
                if not isinstance(value, bytes):
                    if isinstance(value, BaseException):
                        self._error_reply(value)
                    misses["error"] += 1
                    return
                size = len(value)
                bytes_in += size
                if size < HEADER_SIZE:
                    misses["corrupt"] += 1
                    return
                magic, version, lc, reserved, plen, kdig, csum = _unpack(value)
                if magic != MAGIC or version != VERSION or reserved != 0:
                    misses["corrupt"] += 1
                    return
                if plen != page_bytes:
                    misses["wrong_size"] += 1
                    return
                if size != want_len:
                    misses["corrupt"] += 1
                    return
                i = pos[j]
                bk, want_lc = idents[i]
                if lc != want_lc or kdig != digest(bk):
                    misses["mismatch"] += 1
                    return
                if _xxh3(memoryview(value)[HEADER_SIZE:]) != csum:
                    misses["corrupt"] += 1
                    return
                dst[i] = frombuffer(value, np.uint8, page_bytes, HEADER_SIZE)
                found[i] = True
            return [chunk], len(sel), on_reply

        try:
            ok = await self._fanout(keys, make, asyncio.get_running_loop().time() + self.settings.op_timeout)
            return found
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            hits = sum(found)
            self._n["hits"] += hits
            self._n["bytes_in"] += bytes_in
            misses["error"] += n - counted          # no reply: the round trip failed (or was cancelled)
            self._done("get", admitted, ok, cancelled, t0)

    # -- put --------------------------------------------------------------------------------------

    async def put(self, keys: list[bytes], idents: list[tuple[bytes, int]], rows, skip_existing: bool = False) -> int:
        """``SET key value PX ttl [NX]`` for every row, pipelined per node, in pipelines of at most
        ``max_inflight_bytes`` of values (one budget shared by concurrent puts). Returns how many
        keys hold their page afterwards: written now or, with ``skip_existing``, already there.
        ``rows`` must not change until the call returns. Failures are counted, never raised."""
        n = len(keys)
        _check_keys(keys)
        if len(idents) != n:
            raise UsageError(f"put: {n} keys but {len(idents)} idents")
        src = _as_rows(rows, "rows", n, writable=False)
        for _, lc in idents:
            if isinstance(lc, bool) or not isinstance(lc, int) or not 0 <= lc <= 255:
                raise UsageError(f"life cycle must be an int in 0..255, got {lc!r}")
        self._n["puts"] += n
        if not n:
            return 0
        page_bytes = src.shape[1]
        value_len = HEADER_SIZE + page_bytes
        per_chunk = max(1, self.settings.max_inflight_bytes // value_len)
        ttl = self.settings.ttl_ms
        head = b"*%d\r\n$3\r\nSET\r\n" % (3 + (2 if ttl is not None else 0) + (1 if skip_existing else 0))
        tail = b"\r\n"
        if ttl is not None:
            ttl_s = b"%d" % ttl
            tail += b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ttl_s), ttl_s)
        if skip_existing:
            tail += b"$2\r\nNX\r\n"
        vlen = b"$%d\r\n" % value_len
        contiguous = src.strides[1] == 1              # each row is one run of bytes (the rows need not be adjacent)
        digest = self._digest
        done = 0
        for start in range(0, n, per_chunk):
            stop = min(n, start + per_chunk)
            nbytes = (stop - start) * value_len
            await self._budget.acquire(nbytes)
            try:
                admitted = self._admit()
                if not admitted:
                    self._n["put_refused"] += n - start
                    break
                stored = skipped = 0
                ok = cancelled = False
                t0 = time.perf_counter()

                def make(idx, start=start, stop=stop):
                    pos = range(start, stop) if idx is None else [start + i for i in idx]
                    chunks: list = []
                    append = chunks.append
                    pending = head
                    for i in pos:
                        k = keys[i]
                        bk, lc = idents[i]
                        view = memoryview(src[i] if contiguous else np.ascontiguousarray(src[i]))
                        header = _pack(MAGIC, VERSION, lc, 0, page_bytes, digest(bk), _xxh3(view))
                        append(b"%s$%d\r\n%s\r\n%s%s" % (pending, len(k), k, vlen, header))
                        append(view)
                        pending = tail + head
                    append(tail)

                    def on_reply(j, reply):
                        nonlocal stored, skipped
                        if reply is None:
                            skipped += 1                # NX: the key was already there
                        elif isinstance(reply, BaseException):
                            self._error_reply(reply)
                        else:
                            stored += 1
                    return chunks, len(pos), on_reply

                try:
                    deadline = asyncio.get_running_loop().time() + self.settings.op_timeout
                    ok = await self._fanout(keys[start:stop], make, deadline)
                except asyncio.CancelledError:
                    cancelled = True
                    raise
                finally:
                    self._n["stored"] += stored
                    self._n["skipped"] += skipped
                    self._n["bytes_out"] += stored * value_len
                    self._n["put_failed"] += (stop - start) - stored - skipped
                    self._done("put", admitted, ok, cancelled, t0)
                done += stored + skipped
            finally:
                self._budget.release(nbytes)
        return done

    # -- stats, close -------------------------------------------------------------------------------

    def stats(self) -> dict:
        n = self._n
        return {
            "circuit": self.circuit_state(),
            "circuit_opens": n["circuit_opens"],
            "closed": self._closed,
            "lookups": n["lookups"],
            "lookup_hits": n["lookup_hits"],
            "lookup_misses": dict(self._lookup_misses),
            "gets": n["gets"],
            "hits": n["hits"],
            "misses": dict(self._misses),
            "puts": n["puts"],
            "stored": n["stored"],
            "skipped": n["skipped"],
            "put_failed": n["put_failed"],
            "put_refused": n["put_refused"],
            "bytes_in": n["bytes_in"],
            "bytes_out": n["bytes_out"],
            "round_trips": n["round_trips"],
            "failures": dict(self._failures),
            "latency": {op: {"sum": s, "count": c} for op, (s, c) in self._latency.items()},
            "inflight_bytes": self._budget.used,
            "inflight_peak_bytes": self._budget.peak,
        }

    async def close(self) -> None:
        """Close the connections; later calls return misses (counted as circuit_open)."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._backend.close()
        except Exception:               # noqa: BLE001 - closing a dead connection is not an error
            pass

    async def __aenter__(self) -> "RemoteTier":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

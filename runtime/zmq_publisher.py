"""KV-cache event batches over ZMQ, in vLLM's wire format.

KV-aware routers (NVIDIA Dynamo, llm-d) subscribe to vLLM workers' KV events;
speaking the same protocol lets them subscribe to kvtier unchanged. kvtier is
the publisher, so it *binds* both sockets and the routers connect.

Live stream (PUB socket at ``endpoint``), one message per batch, three frames::

    [topic (utf-8, may be b""), seq (8-byte big-endian unsigned), payload]

``payload`` is the caller's batch ``[ts, [events...], dp_rank]``, already
encoded (bytes) or packed here with ``msgpack.packb(batch, use_bin_type=True)``.
``seq`` counts batches from 0 with no gaps at the publisher, so a subscriber that sees a gap knows it lost
batches (PUB drops for a subscriber whose queue passed its high-water mark).

Replay (ROUTER socket at ``replay_endpoint``), vLLM's original protocol: a
client asks for everything from ``start_seq`` on. Request, as the ROUTER sees
it (identity first)::

    [identity, b"", start_seq (8-byte big-endian)]    REQ, or DEALER with a delimiter
    [identity, start_seq (8-byte big-endian)]         DEALER without one

Reply, one message per buffered batch with ``seq >= start_seq`` in order, then
an end marker; the empty delimiter is echoed only when the request had one::

    [identity, (b""), seq (8 bytes BE), payload]
    [identity, (b""), (-1).to_bytes(8, "big", signed=True), b""]     end marker

Only the last ``buffer_batches`` batches are kept, so a request older than the
window gets what is buffered (the client sees where it starts). Anything else
on the ROUTER socket is logged and ignored. A REQ client can read only the
first reply message (libzmq's REQ allows one reply per request); clients that
want the whole stream use DEALER, as Dynamo does.

Threading: ZMQ sockets are not thread-safe and the caller is an asyncio loop
that must never block, so ``publish`` only numbers a batch (encoding it if
it is not bytes yet) and appends it to a bounded queue; a batch dropped for a
full queue keeps its number, so subscribers see the gap. One background
thread owns both sockets: it sends batches, keeps the replay buffer and
answers replay requests. Python-side memory is bounded by ``queue_batches +
buffer_batches`` batches whatever subscribers do; ZMQ's own per-peer queues
are bounded by the high-water marks (``hwm`` batches per subscriber). PUB
drops for a subscriber past its mark without telling: ``published`` counts
batches handed to ZMQ, and a subscriber learns of its losses from the gaps.

Sockets come from ``zmq.Context.instance()``, so an ``inproc://`` endpoint is
reachable from peers in this process that use the same shared context.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import msgpack
import zmq

from tiers.errors import ConfigError

log = logging.getLogger("kvtier")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)   # seq frame of the replay end marker
SEQ_BYTES = 8

_REPLAY_POLL_S = 0.02        # an idle thread checks the replay socket this often (publish wakes it at once)
_SEND_SLICE = 64             # batches sent between replay checks while working off a backlog
_REQUESTS_PER_CHECK = 16     # replay requests answered per check, so a flood cannot starve the live stream
_JOIN_GRACE_S = 0.5          # close() waits this long past its flush timeout for the thread to finish
_ERROR_BACKOFF_S = 0.01      # pause after an unexpected error, so a persistent one cannot spin a core
_LOG_INTERVAL_S = 10.0       # at most one warning per kind this often (drops and bad requests can flood)


def _seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big")


class ZmqEventPublisher:
    """Publishes msgpack event batches on a PUB socket with vLLM's framing and replay.

    ``publish`` is safe to call from any thread and never blocks; everything
    that touches a socket runs on the publisher's own thread.
    """

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 buffer_batches: int = 10_000, queue_batches: int = 10_000, hwm: int = 100_000) -> None:
        _check_endpoint("endpoint", endpoint)
        if replay_endpoint is not None:
            _check_endpoint("replay_endpoint", replay_endpoint)
        if not isinstance(topic, str):
            raise ConfigError("topic", f"must be a str, got {type(topic).__name__}")
        _check_count("buffer_batches", buffer_batches, minimum=0)
        _check_count("queue_batches", queue_batches, minimum=1)
        _check_count("hwm", hwm, minimum=1)      # 0 would mean "no limit" to ZMQ: unbounded memory

        self._topic = topic.encode("utf-8")
        self._queue_max = queue_batches
        self._lock = threading.Lock()            # guards the queue, the counters and _closed
        self._queue: collections.deque[Any] = collections.deque()
        self._wake = threading.Event()           # set when the queue gains a batch or close() is called
        self._stop = threading.Event()
        self._deadline = float("inf")            # close(): stop flushing at this time.monotonic()
        self._closed = False
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_batches)
        self._next_seq = 0
        self._published = 0
        self._dropped = 0
        self._replay_requests = 0
        self._last_log: dict[str, float] = {}
        self._sockets_lock = threading.Lock()
        self._sockets_closed = False
        self._pub: zmq.Socket | None = None
        self._router: zmq.Socket | None = None
        self.endpoint: str = endpoint
        self.replay_endpoint: str | None = None

        ctx = zmq.Context.instance()
        try:
            self._pub = ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self.endpoint = _bind(self._pub, "endpoint", endpoint)
            if replay_endpoint is not None:
                self._router = ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                # One whole replay (buffer + end marker) must fit, or ROUTER drops its tail silently.
                self._router.setsockopt(zmq.SNDHWM, max(hwm, buffer_batches + 1))
                self.replay_endpoint = _bind(self._router, "replay_endpoint", replay_endpoint)
        except BaseException:
            self._close_sockets()
            raise

        self._poller = zmq.Poller()
        if self._router is not None:
            self._poller.register(self._router, zmq.POLLIN)
        # Without a replay socket only the queue can need the thread, and publish/close wake it.
        self._idle_wait_s: float | None = _REPLAY_POLL_S if self._router is not None else None
        self._thread = threading.Thread(target=self._run, name="kvtier-zmq-publisher", daemon=True)
        self._thread.start()

    # ---- caller side (any thread) ----

    def publish(self, batch: list | bytes) -> bool:
        """Queue ``batch`` (a batch, or its msgpack bytes) for sending; False (counted as a
        drop) if the queue is full or closed.

        The batch gets its sequence number here, so a batch dropped for a full queue leaves
        a gap subscribers can see. One that cannot be encoded is dropped without a number.
        """
        if isinstance(batch, bytes):
            payload = batch
        else:
            try:
                payload = msgpack.packb(batch, use_bin_type=True)
            except Exception as exc:        # noqa: BLE001 - a bad batch is the caller's, never the thread's
                with self._lock:
                    self._dropped += 1
                log.error("zmq event publisher %s: cannot encode a batch, dropped: %r", self.endpoint, exc)
                return False
        with self._lock:
            if not self._closed and len(self._queue) < self._queue_max:
                was_empty = not self._queue
                self._queue.append((self._next_seq, payload))
                self._next_seq += 1
                accepted = True
            else:
                self._dropped += 1
                if not self._closed:
                    self._next_seq += 1             # a gap: subscribers know a batch is missing
                accepted = False
                closed = self._closed
        if accepted:
            # A non-empty queue means the thread has not yet seen it empty, so it will get here too.
            if was_empty:
                self._wake.set()
            return True
        if not closed and self._should_log("queue_full"):
            log.warning("zmq event publisher %s: queue full (%d batches), dropping batches; "
                        "see stats()['dropped']", self.endpoint, self._queue_max)
        return False

    def stats(self) -> dict:
        """Counters for metrics; once a batch leaves the queue its publish() is counted once in published or dropped."""
        with self._lock:
            return {"published": self._published, "dropped": self._dropped, "queued": len(self._queue),
                    "replay_requests": self._replay_requests, "next_seq": self._next_seq,
                    "buffered": len(self._buffer)}

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (for at most ``timeout`` seconds), stop the thread, close the sockets.

        Batches still queued at the deadline are counted as dropped. Idempotent,
        and works when the thread has died.
        """
        timeout = max(0.0, float(timeout))
        with self._lock:
            first = not self._closed
            if first:
                self._closed = True
                self._deadline = time.monotonic() + timeout
        if first:
            self._stop.set()
            self._wake.set()
        thread = self._thread
        if thread is not threading.current_thread():
            thread.join(timeout + _JOIN_GRACE_S)
        if thread.is_alive():
            # Its sockets are its own until it exits; it closes them on the way out.
            log.warning("zmq event publisher %s: thread still busy after close(timeout=%.2f); "
                        "it closes its sockets when it finishes", self.endpoint, timeout)
            return
        self._discard_queue()
        self._close_sockets()

    # ---- publisher thread ----

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            with self._lock:
                self._closed = True       # nobody will send: later publishes are drops, not a silent backlog
            if not self._stop.is_set():
                log.error("zmq event publisher %s: thread exited unexpectedly", self.endpoint)
            self._discard_queue()
            self._close_sockets()

    def _loop(self) -> None:
        while True:
            try:
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()                # before draining: a batch queued after this sets it again
                self._pump()
                if self._stop.is_set() and (self._past_deadline() or not self._queue):
                    return
            except Exception:
                log.exception("zmq event publisher %s: unexpected error (continuing)", self.endpoint)
                if self._stop.is_set() and self._past_deadline():
                    return
                time.sleep(_ERROR_BACKOFF_S)
                self._wake.set()                  # the failed pass may have left batches queued

    def _pump(self) -> None:
        """Send queued batches one at a time (so the queue bound is the memory bound), then serve replay."""
        sent = 0
        while not (self._stop.is_set() and self._past_deadline()):
            with self._lock:
                if not self._queue:
                    break
                batch = self._queue.popleft()
            self._send_batch(batch)
            sent += 1
            if sent % _SEND_SLICE == 0:
                self._service_replay()
        self._service_replay()

    def has_room(self) -> bool:
        """Whether a publish now would be queued (a caller may hold its batch back instead)."""
        with self._lock:
            return len(self._queue) < self._queue_max

    def _send_batch(self, item: tuple[int, bytes]) -> None:
        seq, payload = item
        seq_frame = _seq_bytes(seq)
        # Buffered even if the send fails below: a subscriber that sees the gap can replay it.
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart([self._topic, seq_frame, payload], flags=zmq.NOBLOCK)
            sent = True
        except zmq.Again:
            sent = False
        except zmq.ZMQError as exc:
            sent = False
            if self._should_log("send_error"):
                log.warning("zmq event publisher %s: send failed: %s", self.endpoint, exc)
        with self._lock:
            if sent:
                self._published += 1
            else:
                self._dropped += 1

    def _service_replay(self) -> None:
        if self._router is None:
            return
        for _ in range(_REQUESTS_PER_CHECK):
            if not self._poller.poll(0):
                return
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._answer_replay(frames)

    def _answer_replay(self, frames: list[bytes]) -> None:
        if len(frames) == 3 and frames[1] == b"" and len(frames[2]) == SEQ_BYTES:
            envelope, start_frame = frames[:2], frames[2]
        elif len(frames) == 2 and len(frames[1]) == SEQ_BYTES:
            envelope, start_frame = frames[:1], frames[1]
        else:
            if self._should_log("bad_request"):
                log.warning("zmq event publisher %s: ignoring malformed replay request "
                            "(%d frames, sizes %s); expected [b'', 8-byte start seq]",
                            self.replay_endpoint, len(frames), [len(f) for f in frames[1:6]])
            return
        start = int.from_bytes(start_frame, "big")
        with self._lock:
            self._replay_requests += 1
        router = self._router
        try:
            for seq, payload in self._buffer:
                if seq >= start:
                    router.send_multipart([*envelope, _seq_bytes(seq), payload], flags=zmq.NOBLOCK)
            router.send_multipart([*envelope, END_OF_REPLAY, b""], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:       # a ROUTER drops rather than blocks; this is a dead peer or worse
            if self._should_log("replay_error"):
                log.warning("zmq event publisher %s: replay reply cut short: %s", self.replay_endpoint, exc)

    # ---- shared helpers ----

    def _past_deadline(self) -> bool:
        return time.monotonic() >= self._deadline

    def _discard_queue(self) -> None:
        with self._lock:
            n = len(self._queue)
            self._queue.clear()
            self._dropped += n
        if n:
            log.warning("zmq event publisher %s: %d queued batches not sent before close", self.endpoint, n)

    def _close_sockets(self) -> None:
        """Close with linger 0: a router that never reads must not hold up shutdown."""
        with self._sockets_lock:
            if self._sockets_closed:
                return
            self._sockets_closed = True
        for sock in (self._router, self._pub):
            if sock is not None:
                sock.close(linger=0)

    def _should_log(self, kind: str) -> bool:
        now = time.monotonic()
        last = self._last_log.get(kind)
        if last is not None and now - last < _LOG_INTERVAL_S:
            return False
        self._last_log[kind] = now
        return True


def _check_endpoint(field: str, endpoint: Any) -> None:
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise ConfigError(field, f"expected a ZMQ endpoint such as 'tcp://127.0.0.1:5557', got {endpoint!r}")


def _check_count(field: str, value: Any, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(field, f"must be an int >= {minimum}, got {value!r}")


def _bind(sock: zmq.Socket, field: str, endpoint: str) -> str:
    """Bind and return the endpoint actually bound (a ``*`` port resolved to the chosen one)."""
    if endpoint.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise ConfigError(field, f"cannot bind {endpoint!r}: {exc.strerror}") from exc
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)

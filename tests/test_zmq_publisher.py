"""ZmqEventPublisher against real ZMQ clients: vLLM's framing, replay, drops and shutdown."""
from __future__ import annotations

import logging
import socket
import threading
import time

import msgpack
import pytest
import zmq

from runtime.zmq_publisher import END_OF_REPLAY, ZmqEventPublisher
from tiers.errors import ConfigError

ANY_PORT = "tcp://127.0.0.1:*"
WAIT_S = 5.0
PROBE = [0.0, ["probe"], 0]


def batch(i: int) -> list:
    """A vLLM-shaped batch [ts, events, dp_rank], with bytes to check use_bin_type round-trips."""
    return [1_700_000_000.0 + i,
            [["BlockStored", [i, i + 1], None, [1, 2, 3, 4], 16, None, "GPU"],
             ["BlockRemoved", [b"\x00\xffhash" + bytes([i % 256])], "CPU"]],
            0]


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def wait_until(pred, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.001)


def recv(sock: zmq.Socket, timeout: float = WAIT_S) -> list[bytes]:
    if not sock.poll(int(timeout * 1000)):
        raise AssertionError("nothing received in time")
    return sock.recv_multipart()


def publisher_threads() -> int:
    return sum(t.name == "kvtier-zmq-publisher" for t in threading.enumerate())


class Clients:
    """Client sockets, each closed explicitly: one left to the GC warns and can hang the context's term()."""

    def __init__(self, context: zmq.Context) -> None:
        self.context = context
        self.sockets: list[zmq.Socket] = []

    def socket(self, kind: int) -> zmq.Socket:
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self.sockets.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)


@pytest.fixture
def ctx():
    clients = Clients(zmq.Context())
    yield clients
    clients.close()
    clients.context.term()


@pytest.fixture
def make_pub():
    pubs: list[ZmqEventPublisher] = []

    def make(endpoint: str = ANY_PORT, **kw) -> ZmqEventPublisher:
        pub = ZmqEventPublisher(endpoint, **kw)
        pubs.append(pub)
        return pub

    yield make
    for pub in pubs:
        pub.close()


def subscribed(ctx: Clients, pub: ZmqEventPublisher, topic: bytes = b"",
               opts: dict[int, int] | None = None) -> tuple[zmq.Socket, int]:
    """A SUB socket whose subscription is confirmed (PUB/SUB slow joiner): probes until one arrives.

    Returns the socket and how many probes were published (seqs 0..probes-1).
    """
    sub = ctx.socket(zmq.SUB)
    for opt, value in (opts or {}).items():
        sub.setsockopt(opt, value)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(pub.endpoint)
    probes = 0
    deadline = time.monotonic() + WAIT_S
    while not sub.poll(10):
        assert time.monotonic() < deadline, "subscription never confirmed"
        assert pub.publish(PROBE)
        probes += 1
    return sub, probes


def replay_dealer(ctx: Clients, pub: ZmqEventPublisher, start: int, *, delimiter: bool = True) -> list[list[bytes]]:
    """Ask for replay from ``start`` on a fresh DEALER; the reply messages up to and including the end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    dealer.send_multipart(([b""] if delimiter else []) + [seq_frame(start)])
    msgs = []
    while True:
        frames = recv(dealer)
        if delimiter:
            assert frames[0] == b""
            frames = frames[1:]
        assert len(frames) == 2
        msgs.append(frames)
        if frames[0] == END_OF_REPLAY:
            assert frames[1] == b""
            dealer.close()
            return msgs


def publish_all(pub: ZmqEventPublisher, n: int) -> None:
    for i in range(n):
        assert pub.publish(batch(i))
    wait_until(lambda: pub.stats()["queued"] == 0 and pub.stats()["buffered"] == min(n, pub._buffer.maxlen))


# ---- live stream ----

def test_sub_receives_batches_in_order_with_exact_frames(ctx, make_pub):
    pub = make_pub(topic="kv@worker-0")
    assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith("*")
    sub, probes = subscribed(ctx, pub, b"kv@worker-0")
    n = 50
    for i in range(n):
        assert pub.publish(batch(i))

    seqs, real = [], []
    while len(real) < n:
        frames = recv(sub)
        assert len(frames) == 3
        topic, seq_b, payload = frames
        assert topic == b"kv@worker-0"
        assert len(seq_b) == 8
        seqs.append(int.from_bytes(seq_b, "big"))
        decoded = msgpack.unpackb(payload)
        if decoded != PROBE:
            real.append((seqs[-1], decoded))
    # Consecutive from the first message this subscriber saw, and numbering started at 0.
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert [s for s, _ in real] == list(range(probes, probes + n))
    assert [b for _, b in real] == [batch(i) for i in range(n)]
    wait_until(lambda: pub.stats()["published"] == probes + n)
    assert pub.stats() == {"published": probes + n, "dropped": 0, "queued": 0, "replay_requests": 0,
                           "next_seq": probes + n, "buffered": probes + n}


def test_empty_topic_and_other_topics_filtered(ctx, make_pub):
    pub = make_pub()
    sub, _ = subscribed(ctx, pub)                     # b"" subscribes to everything
    frames = recv(sub)
    assert frames[0] == b"" and len(frames) == 3

    pub2 = make_pub(topic="other")
    sub2 = ctx.socket(zmq.SUB)
    sub2.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub2.connect(pub2.endpoint)
    confirm, _ = subscribed(ctx, pub2, b"other")      # pub2 is live and sending
    for i in range(5):
        assert pub2.publish(batch(i))
    while msgpack.unpackb(recv(confirm)[2]) != batch(4):
        pass
    assert not sub2.poll(50)


def test_ipc_and_inproc_endpoints(tmp_path, ctx, make_pub):
    ipc = make_pub(f"ipc://{tmp_path}/kv.ipc")
    assert ipc.endpoint == f"ipc://{tmp_path}/kv.ipc"
    inproc = make_pub(f"inproc://kvtier-test-{id(tmp_path)}", replay_endpoint=f"inproc://kvtier-replay-{id(tmp_path)}")
    shared = Clients(zmq.Context.instance())          # inproc peers share the publisher's context
    try:
        for pub, clients in ((ipc, ctx), (inproc, shared)):
            sub, probes = subscribed(clients, pub)
            _, seq_b, payload = recv(sub)
            assert msgpack.unpackb(payload) == PROBE and int.from_bytes(seq_b, "big") < probes
        msgs = replay_dealer(shared, inproc, 0)
        assert msgs[-1] == [END_OF_REPLAY, b""] and len(msgs) == inproc.stats()["next_seq"] + 1
    finally:
        shared.close()


# ---- replay ----

def test_replay_from_dealer_with_and_without_delimiter(ctx, make_pub):
    pub = make_pub(replay_endpoint=ANY_PORT)
    assert pub.replay_endpoint.startswith("tcp://127.0.0.1:") and pub.replay_endpoint != pub.endpoint
    n, k = 20, 7
    publish_all(pub, n)
    for delimiter in (True, False):
        msgs = replay_dealer(ctx, pub, k, delimiter=delimiter)
        assert msgs[-1] == [END_OF_REPLAY, b""]
        assert [int.from_bytes(s, "big") for s, _ in msgs[:-1]] == list(range(k, n))
        assert [msgpack.unpackb(p) for _, p in msgs[:-1]] == [batch(i) for i in range(k, n)]
    assert [len(m) for m in replay_dealer(ctx, pub, 0)] == [2] * (n + 1)
    assert replay_dealer(ctx, pub, n) == [[END_OF_REPLAY, b""]]           # nothing newer yet
    assert replay_dealer(ctx, pub, 2**64 - 1) == [[END_OF_REPLAY, b""]]
    wait_until(lambda: pub.stats()["replay_requests"] == 5)


def test_replay_from_req(ctx, make_pub):
    """A REQ reads one reply per request (libzmq): the first batch asked for, or the end marker."""
    pub = make_pub(replay_endpoint=ANY_PORT)
    n = 10
    publish_all(pub, n)
    for start, expect in ((3, [seq_frame(3), msgpack.packb(batch(3), use_bin_type=True)]),
                          (n, [END_OF_REPLAY, b""])):
        req = ctx.socket(zmq.REQ)
        req.connect(pub.replay_endpoint)
        req.send(seq_frame(start))
        assert recv(req) == expect
        req.close()


def test_replay_window_keeps_only_last_buffer_batches(ctx, make_pub):
    pub = make_pub(replay_endpoint=ANY_PORT, buffer_batches=5)
    publish_all(pub, 12)
    assert pub.stats()["buffered"] == 5
    for start in (0, 7):                              # older than the window: what is buffered
        msgs = replay_dealer(ctx, pub, start)
        assert [int.from_bytes(s, "big") for s, _ in msgs[:-1]] == [7, 8, 9, 10, 11]
        assert [msgpack.unpackb(p) for _, p in msgs[:-1]] == [batch(i) for i in range(7, 12)]
    assert [int.from_bytes(s, "big") for s, _ in replay_dealer(ctx, pub, 10)[:-1]] == [10, 11]


def test_malformed_replay_requests_are_ignored(ctx, make_pub, caplog):
    pub = make_pub(replay_endpoint=ANY_PORT)
    publish_all(pub, 3)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        for bad in ([b"", b"\x00" * 4],                       # wrong length
                    [b"", seq_frame(0), b"extra"],            # extra frame
                    [b"x", seq_frame(0)],                     # not a delimiter
                    [b"", b"", seq_frame(0)],
                    [b"\x00" * 9],
                    [b""]):
            dealer.send_multipart(bad)
        dealer.send_multipart([b"", seq_frame(1)])
        got = [recv(dealer) for _ in range(3)]
    # The first thing back answers the valid request: nothing was sent for the bad ones.
    assert got == [[b"", seq_frame(1), msgpack.packb(batch(1), use_bin_type=True)],
                   [b"", seq_frame(2), msgpack.packb(batch(2), use_bin_type=True)],
                   [b"", END_OF_REPLAY, b""]]
    assert pub.stats()["replay_requests"] == 1
    assert any("malformed replay request" in r.getMessage() for r in caplog.records if r.name == "kvtier")
    assert pub.publish(batch(3))                              # thread still alive and serving
    wait_until(lambda: pub.stats()["published"] == 4)


# ---- never blocking, bounded memory ----

def test_stalled_subscriber_does_not_block(ctx, make_pub):
    pub = make_pub(hwm=10)
    stalled, probes = subscribed(ctx, pub, opts={zmq.RCVHWM: 1, zmq.RCVBUF: 4096})   # reads one probe, then never again
    payload = "x" * 10_000
    n = 2000                                                       # ~20 MB: far past socket buffers
    t0 = time.monotonic()
    for i in range(n):
        assert pub.publish([float(i), [payload], 0])
    assert time.monotonic() - t0 < 1.0                              # publish never waited on the thread
    wait_until(lambda: pub.stats()["published"] == probes + n)      # the thread never waited on the subscriber
    assert pub.stats()["dropped"] == 0 and pub.stats()["queued"] == 0
    got = 0
    while stalled.poll(50):
        stalled.recv_multipart()
        got += 1
    assert got < n                                                 # PUB dropped for it instead of waiting


def test_full_queue_drops_and_stays_bounded(make_pub):
    pub = make_pub(queue_batches=4)
    gate, entered = threading.Event(), threading.Event()
    send = pub._send_batch

    def stuck_send(b):
        entered.set()
        assert gate.wait(WAIT_S)
        send(b)

    pub._send_batch = stuck_send
    try:
        assert pub.publish(batch(0))
        assert entered.wait(WAIT_S)                   # the thread holds batch 0 and is stuck
        for i in range(1, 5):
            assert pub.publish(batch(i))
        assert pub.stats()["queued"] == 4
        t0 = time.monotonic()
        assert not any(pub.publish(batch(i)) for i in range(5, 1005))
        assert time.monotonic() - t0 < 1.0
        st = pub.stats()
        assert st["queued"] == 4 and st["dropped"] == 1000 and st["published"] == 0
    finally:
        gate.set()
    wait_until(lambda: pub.stats()["published"] == 5)
    assert pub.stats() | {"buffered": None} == {"published": 5, "dropped": 1000, "queued": 0, "replay_requests": 0,
                                                "next_seq": 1005, "buffered": None}   # the drops left a gap
    assert pub.publish(batch(5))                      # room again


def test_unencodable_batch_is_dropped_and_thread_continues(ctx, make_pub, caplog):
    pub = make_pub(replay_endpoint=ANY_PORT)
    with caplog.at_level(logging.ERROR, logger="kvtier"):
        assert not pub.publish([0.0, [object()], 0])      # refused on the caller's side
        assert pub.publish(batch(0))
        wait_until(lambda: pub.stats()["published"] == 1)
    assert pub.stats()["dropped"] == 1 and pub.stats()["next_seq"] == 1   # no seq spent on it
    assert any("cannot encode" in r.getMessage() for r in caplog.records)
    msgs = replay_dealer(ctx, pub, 0)
    assert msgs == [[seq_frame(0), msgpack.packb(batch(0), use_bin_type=True)], [END_OF_REPLAY, b""]]


def test_unexpected_thread_error_is_logged_and_thread_continues(ctx, make_pub, caplog):
    pub = make_pub(replay_endpoint=ANY_PORT)
    serve = pub._service_replay
    failed = threading.Event()

    def fail_once():
        if not failed.is_set():
            failed.set()
            raise RuntimeError("boom")
        serve()

    pub._service_replay = fail_once
    with caplog.at_level(logging.ERROR, logger="kvtier"):
        assert failed.wait(WAIT_S)                    # the idle thread polls for replay requests
        publish_all(pub, 3)
    assert any("unexpected error" in r.getMessage() and r.exc_info for r in caplog.records)
    assert len(replay_dealer(ctx, pub, 0)) == 4


# ---- binding and shutdown ----

def rebind_ok(endpoint: str) -> bool:
    """Whether ``endpoint`` can be bound again (closing a ZMQ listener completes asynchronously)."""
    sock = zmq.Context.instance().socket(zmq.PUB)
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                sock.bind(endpoint)
                return True
            except zmq.ZMQError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.005)
    finally:
        sock.close(linger=0)


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bind_in_use_raises_config_error_and_leaves_nothing(make_pub):
    taken = make_pub(replay_endpoint=ANY_PORT)
    threads = publisher_threads()
    with pytest.raises(ConfigError, match="endpoint") as err:
        ZmqEventPublisher(taken.endpoint)
    assert taken.endpoint in str(err.value)

    # PUB binds, then the replay bind fails: the PUB socket must be closed again.
    pub_endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    with pytest.raises(ConfigError, match="replay_endpoint") as err:
        ZmqEventPublisher(pub_endpoint, replay_endpoint=taken.replay_endpoint)
    assert taken.replay_endpoint in str(err.value)
    assert publisher_threads() == threads
    assert rebind_ok(pub_endpoint)

    with pytest.raises(ConfigError, match="endpoint"):
        ZmqEventPublisher("tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5557")
    for bad in ("nonsense", "foo://bar", "tcp://no-such-interface.invalid:1"):
        with pytest.raises(ConfigError, match="endpoint"):
            ZmqEventPublisher(bad)
    with pytest.raises(ConfigError, match="queue_batches"):
        ZmqEventPublisher(ANY_PORT, queue_batches=0)
    with pytest.raises(ConfigError, match="hwm"):
        ZmqEventPublisher(ANY_PORT, hwm=0)
    assert publisher_threads() == threads


def test_close_flushes_queue_then_is_idempotent(ctx):
    pub = ZmqEventPublisher(ANY_PORT, replay_endpoint=ANY_PORT)
    threads = publisher_threads()
    for i in range(200):
        assert pub.publish(batch(i))
    pub.close(timeout=WAIT_S)
    assert pub.stats()["published"] == 200 and pub.stats()["dropped"] == 0 and pub.stats()["queued"] == 0
    assert publisher_threads() == threads - 1
    pub.close()
    assert not pub.publish(batch(0))
    assert pub.stats()["dropped"] == 1
    assert rebind_ok(pub.endpoint) and rebind_ok(pub.replay_endpoint)


def test_close_timeout_bounds_flush(make_pub):
    pub = make_pub(queue_batches=10)
    gate, entered = threading.Event(), threading.Event()
    send = pub._send_batch

    def stuck_send(b):
        entered.set()
        gate.wait(WAIT_S)
        send(b)

    pub._send_batch = stuck_send
    assert pub.publish(batch(0))
    assert entered.wait(WAIT_S)
    for i in range(1, 5):
        assert pub.publish(batch(i))
    timer = threading.Timer(0.05, gate.set)
    timer.start()
    pub.close(timeout=0)                              # deadline already past when the thread resumes
    timer.join()
    wait_until(lambda: pub.stats()["dropped"] == 4)   # the 4 still queued were discarded, not sent
    assert pub.stats()["published"] == 1 and pub.stats()["queued"] == 0
    assert not pub.publish(batch(9))


def test_close_works_when_thread_died(monkeypatch):
    monkeypatch.setattr(ZmqEventPublisher, "_run", lambda self: None)
    pub = ZmqEventPublisher(ANY_PORT, replay_endpoint=ANY_PORT)
    pub._thread.join(WAIT_S)
    assert pub.publish(batch(0))                      # queued; nobody will send it
    pub.close(timeout=0.1)
    pub.close()
    assert pub.stats()["queued"] == 0 and pub.stats()["dropped"] == 1
    assert not pub.publish(batch(1))
    assert rebind_ok(pub.endpoint) and rebind_ok(pub.replay_endpoint)

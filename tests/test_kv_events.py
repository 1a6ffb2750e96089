"""KV events (issue 14): an index built from the events alone equals what the
store's tiers hold, through moves, drops, corruption, restarts and wipes; the
payload is vLLM's layout exactly."""
from __future__ import annotations

import os
import random

import msgpack
import numpy as np
import pytest

from runtime import EventsConfig, Store
from runtime.core import Core
from runtime.events import default_topic
from runtime.tools.demo import bundled_trace
from runtime.tools.replay import replay
from runtime.tools.trace import read_trace
from tiers.errors import ConfigError, UsageError

from helpers import config, fill, prefill_keys, two_life_cycles

STORED_FIELDS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                 "lora_name", "group_idx", "kv_cache_spec_kind"]


class RouterIndex:
    """What a KV-aware router keeps: (block hash, medium, group) from the events alone."""

    def __init__(self, parents: dict[int, int | None] | None = None) -> None:
        self.held: set[tuple[int, str, int]] = set()
        self.batches = 0
        self.parents = parents          # each block hash's true parent, to check the chains against

    def apply(self, batch: list) -> None:
        ts, events, rank = batch
        assert isinstance(ts, float) and rank == 0
        self.batches += 1
        for e in events:
            if e["type"] == "AllBlocksCleared":
                assert list(e) == ["type"]
                self.held.clear()
            elif e["type"] == "BlockStored":
                fields = list(e)
                assert fields[:len(STORED_FIELDS)] == STORED_FIELDS
                assert fields[len(STORED_FIELDS):] in ([], ["kv_cache_spec_sliding_window"])
                n, bs = len(e["block_hashes"]), e["block_size"]
                assert n and len(e["token_ids"]) in (0, n * bs)
                assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in e["block_hashes"])
                assert e["lora_id"] is None and e["lora_name"] is None
                if self.parents is not None:        # a chain: each block the parent of the next ...
                    for i, h in enumerate(e["block_hashes"]):
                        parent = e["block_hashes"][i - 1] if i else e["parent_block_hash"]
                        assert self.parents.get(h, parent) == parent, (h, parent, e)
                        # ... and a full-attention block's parent is held somewhere before it is
                        assert parent is None or e["group_idx"] or i or \
                            any(p == parent and g == 0 for p, _, g in self.held), ("parent after child", e)
                self.held.update((h, e["medium"], e["group_idx"]) for h in e["block_hashes"])
            else:
                assert e["type"] == "BlockRemoved" and list(e) == ["type", "block_hashes", "medium", "group_idx"]
                for h in e["block_hashes"]:
                    assert (h, e["medium"], e["group_idx"]) in self.held, "removed a block it never stored"
                    self.held.discard((h, e["medium"], e["group_idx"]))

    def feed(self, store: Store) -> None:
        for b in store.take_events():
            self.apply(msgpack.unpackb(msgpack.packb(b)))


def workload(seed: int, n: int, width: int = 6) -> list[list[int]]:
    """Requests as walks over a small key tree: shared prefixes, as in a trace."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        depth = rng.randint(1, 8)
        reqs.append([1 + rng.randrange(width) * 1000 + d * 10 + rng.randrange(2 if d else 1) for d in range(depth)])
    return reqs


def chain_keys(path: list[int]) -> list[int]:
    out, acc = [], 0
    for k in path:
        acc = acc * 31 + k
        out.append(acc % (1 << 60) + 1)
    return out


def events_cfg(tmp_path, **kw):
    return config(gpu=12, host=24, disk=48, disk_dir=tmp_path, events=EventsConfig(), **kw)


async def run_workload(store: Store, index: RouterIndex | None, seed: int, n: int = 120) -> None:
    for i, path in enumerate(workload(seed, n)):
        if i % 3 == 0:          # tokens: BlockStored carries them
            await fill(store, [t for k in path for t in (k, k + 1, k + 2, k + 3)])
        else:
            await prefill_keys(store, chain_keys(path))
        if index is not None and i % 17 == 0:
            await store.drain()
            index.feed(store)


async def test_an_index_built_from_events_equals_every_tier(tmp_path):
    index = RouterIndex()
    async with Store.open(events_cfg(tmp_path)) as store:
        await run_workload(store, index, seed=1)
        await store.drain()
        index.feed(store)
        held = store.kv_events.holdings()
        assert index.held == held
        media = {m for _, m, _ in held}
        assert media == {"GPU", "CPU_PINNED", "DISK"}       # every tier took part
        st = store.stats()
        assert st["drops"] > 0 and st["events"]["dropped"] == 0


@pytest.mark.parametrize("seed", range(4))
async def test_chains_name_their_true_parents_after_every_step(tmp_path, seed):
    """Randomized (seeded) configurations, write-through on or off, one or two life cycles, a
    restart: after every request the events' index equals every tier, and each BlockStored's
    blocks form a chain under their true parents (int block keys are their own hashes). Moves
    land batches whose pages' parents are among them, the chains the core orders and merges."""
    rng = random.Random(seed)
    kw = dict(gpu=rng.choice([16, 24]), host=rng.choice([32, 48]), disk=rng.choice([64, 256]),
              disk_dir=tmp_path, events=EventsConfig())
    if rng.random() < 0.5:
        kw["layers"] = two_life_cycles()
    cfg = config(**kw)
    cfg.host.write, cfg.host.write_interval = rng.choice(["back", "through"]), 0.002
    cfg.disk.write, cfg.disk.write_interval = rng.choice(["back", "through"]), 0.002
    parents: dict[int, int | None] = {}
    index = RouterIndex(parents)
    for _ in range(2):                                      # the second life recovers from disk
        async with Store.open(cfg) as store:
            index.feed(store)
            for path in workload(seed, 60):
                keys = chain_keys(path)
                parents.update(zip(keys, [None] + keys[:-1]))
                await prefill_keys(store, keys)
                if rng.random() < 0.2:
                    await store.drain()
                index.feed(store)
                assert index.held == store.kv_events.holdings()
            await store.drain()
            store.check_consistency()


@pytest.mark.parametrize("host_write,disk_write", [("through", "back"), ("back", "through"), ("through", "through")])
async def test_clean_copies_are_reported_in_their_tiers(tmp_path, host_write, disk_write):
    """Write-through: a block with clean copies is held by several tiers at once, and routers are
    told so (a copy landing is a BlockStored in its tier, leaving a BlockRemoved; a demotion onto
    a copy only removes the block from the tier it left)."""
    index = RouterIndex()
    cfg = events_cfg(tmp_path)
    cfg.host.write, cfg.host.write_interval = host_write, 0.01
    cfg.disk.write, cfg.disk.write_interval = disk_write, 0.01
    async with Store.open(cfg) as store:
        await run_workload(store, index, seed=2)
        await store.drain()
        index.feed(store)
        assert index.held == store.kv_events.holdings()
        media: dict[tuple[int, int], set[str]] = {}
        for h, m, g in index.held:
            media.setdefault((h, g), set()).add(m)
        assert any(len(m) > 1 for m in media.values())      # a block and its copy, both told
        st = store.stats()
        wt = st["host_write_through" if host_write == "through" else "write_through"]
        assert wt["copies"] > 0 and wt["free_demotions"] > 0, wt
        store.check_consistency()


async def test_tokens_travel_with_their_blocks_between_tiers(tmp_path):
    """A block written with tokens= keeps them in every later BlockStored (host, disk)."""
    cfg = config(gpu=4, host=4, disk=16, disk_dir=tmp_path, events=EventsConfig())
    async with Store.open(cfg) as store:
        toks = list(range(100, 116))                        # 4 blocks of 4
        await fill(store, toks)
        for r in range(1, 6):                                # push it down to disk
            await fill(store, list(range(1000 * r, 1000 * r + 16)))
        await store.drain()
        seen: dict[str, list[int]] = {}
        for _, events, _ in store.take_events():
            for e in events:
                if e["type"] == "BlockStored" and e["token_ids"][:4] == [100, 101, 102, 103]:
                    seen.setdefault(e["medium"], e["token_ids"])
        assert set(seen) >= {"GPU", "CPU_PINNED", "DISK"}
        assert all(t == toks[:len(t)] for t in seen.values())


async def test_restart_and_wipe_clear_then_restate(tmp_path):
    index = RouterIndex()
    async with Store.open(events_cfg(tmp_path)) as store:
        await run_workload(store, index, seed=2, n=60)
    async with Store.open(events_cfg(tmp_path)) as store:
        batches = store.take_events()
        assert batches[0][1][0] == {"type": "AllBlocksCleared"}
        for b in batches:
            index.apply(b)
        assert index.held == store.kv_events.holdings() and index.held
        assert {m for _, m, _ in index.held} == {"DISK"}
        stored = [e for b in batches for e in b[1] if e["type"] == "BlockStored"]
        assert all(e["token_ids"] == [] for e in stored)     # the journal keeps keys, not tokens
        await run_workload(store, index, seed=3, n=30)
        await store.drain()
        index.feed(store)
        assert index.held == store.kv_events.holdings()
    # another layout over the same directory, wiped: the router is told to forget everything
    wiped = config(gpu=12, host=24, disk=48, disk_dir=tmp_path, events=EventsConfig(), tpb=8)
    wiped.disk.on_mismatch = "wipe"
    async with Store.open(wiped) as store:
        index.feed(store)
        assert index.held == set() == store.kv_events.holdings()


async def test_corrupt_pages_and_drops_are_removed(tmp_path):
    index = RouterIndex()
    async with Store.open(events_cfg(tmp_path)) as store:
        await run_workload(store, index, seed=4, n=80)
        await store.drain()
        index.feed(store)
        # a dropped root page takes its prefix-critical subtree with it
        roots = [k[0] for k in map(chain_keys, workload(4, 80)) if len(k) > 2 and k[2] in store.nodes]
        before = len(index.held)
        store._drop(store.nodes[roots[0]].pages[0])
        index.feed(store)
        assert len(index.held) < before - 1 and index.held == store.kv_events.holdings()
        # flip bytes of every disk segment page, then read them all back
        seg = os.path.join(tmp_path, "group-0.seg")
        data = bytearray(open(seg, "rb").read())
        for off in range(17, len(data), 512):
            data[off] ^= 0xFF
        open(seg, "wb").write(bytes(data))
        for path in workload(4, 80)[:40]:
            await prefill_keys(store, chain_keys(path))
        await store.drain()
        index.feed(store)
        assert store.stats()["corrupt_pages"] > 0
        assert index.held == store.kv_events.holdings()


async def test_two_life_cycles_name_their_groups_and_window(tmp_path):
    cfg = config(gpu=16, host=16, layers=two_life_cycles(), events=EventsConfig())
    async with Store.open(cfg) as store:
        index = RouterIndex()
        await run_workload(store, index, seed=5, n=40)
        await store.drain()
        batches = store.take_events()
        for b in batches:
            index.apply(b)
        assert index.held == store.kv_events.holdings()
        specs = {(e["group_idx"], e["kv_cache_spec_kind"], e.get("kv_cache_spec_sliding_window"))
                 for b in batches for e in b[1] if e["type"] == "BlockStored"}
        assert specs == {(0, "full_attention", None), (1, "sliding_window", 8)}


async def test_positional_layout_for_older_consumers():
    cfg = config(gpu=8, events=EventsConfig(positional=True))
    async with Store.open(cfg) as store:
        await fill(store, list(range(8)))
        batches = msgpack.unpackb(msgpack.packb(store.take_events()))
    events = [e for b in batches for e in b[1]]
    assert events[0] == ["AllBlocksCleared"]
    tag, hashes, parent, token_ids, block_size, lora_id, medium = events[1]
    assert (tag, parent, token_ids, block_size, lora_id, medium) == ("BlockStored", None, list(range(8)), 4, None, "GPU")
    assert len(hashes) == 2


async def test_int_block_keys_are_their_own_hashes():
    """A caller passing its engine's block hashes as block_keys sees them unchanged in events."""
    cfg = config(gpu=8, events=EventsConfig())
    async with Store.open(cfg) as store:
        await prefill_keys(store, [7, (1 << 64) - 1, 12345])
        await prefill_keys(store, [-5, 1 << 70])
        events = [e for b in store.take_events() for e in b[1]]
    first, second = [e for e in events if e["type"] == "BlockStored"]
    assert first["block_hashes"] == [7, (1 << 64) - 1, 12345] and first["parent_block_hash"] is None
    assert all(0 <= h < 1 << 64 for h in second["block_hashes"])
    assert second["block_hashes"][0] not in (7, 2**64 - 5)


async def test_off_by_default_and_typed_errors(tmp_path):
    async with Store.open(config(gpu=8)) as store:
        assert "events" not in store.stats()
        with pytest.raises(UsageError, match="KV events are off"):
            store.take_events()
    with pytest.raises(ConfigError, match="events.buffer_batches"):
        config(gpu=8, events=EventsConfig(buffer_batches=0))
    with pytest.raises(ConfigError, match="events.replay_endpoint"):
        config(gpu=8, events=EventsConfig(replay_endpoint="tcp://127.0.0.1:*"))
    assert default_topic("w1", "m") == "kv@w1@m"


async def test_async_iterator_sees_batches_as_they_are_made():
    cfg = config(gpu=8, events=EventsConfig(flush_interval=0.001))
    async with Store.open(cfg) as store:
        it = store.event_batches().__aiter__()
        first = await it.__anext__()
        assert first[1] == [{"type": "AllBlocksCleared"}]
        await fill(store, list(range(8)))
        nxt = await it.__anext__()
        assert nxt[1][0]["type"] == "BlockStored"


async def test_a_reader_that_never_reads_keeps_memory_bounded():
    cfg = config(gpu=8, host=8, events=EventsConfig(buffer_batches=3, flush_interval=0.001))
    async with Store.open(cfg) as store:
        for r in range(30):
            await fill(store, list(range(r * 100, r * 100 + 8)))
            store.kv_events.flush()
        st = store.stats()["events"]
        assert st["buffered"] == 3 and st["dropped"] == st["batches"] - 3 > 0


def test_external_hash_is_stable():
    """The rule in kv_events.hpp, pinned: routers in other processes must agree."""
    c = Core(4, [(False, 0, 0, 0)], [[0], [-1], [-1]], [[8], [], []])
    c.set_kv_events(True)
    ev = np.dtype([("hash", "<u8"), ("parent", "<u8"), ("token_at", "<i4"), ("kind", "u1"), ("tier", "i1"),
                   ("lc", "u1"), ("has_parent", "u1")])

    def hashes(keys):
        sid, _, _ = c.open(keys, 35)
        c.extend_now(sid, len(keys))
        assert c.commit(sid, len(keys)) == -1
        c.close(sid)
        out = np.frombuffer(c.take_kv_events()[0], dtype=ev)
        assert out["has_parent"].tolist() == [0] + [1] * (len(keys) - 1)
        assert out["parent"][1:].tolist() == out["hash"][:-1].tolist()
        return out["hash"].tolist()

    def mix(lo: int, hi: int, tag: int) -> int:
        m = (1 << 64) - 1
        x = lo ^ ((hi * 0x9E3779B97F4A7C15) & m) ^ (tag << 56) ^ 0xD6E8FEB86659FD93
        x ^= x >> 30; x = (x * 0xBF58476D1CE4E5B9) & m
        x ^= x >> 27; x = (x * 0x94D049BB133111EB) & m
        return x ^ (x >> 31)
    assert hashes([5, 1 << 80]) == [5, mix(0, 1 << 16, 0)]
    assert hashes([b"abc"]) == [mix(int.from_bytes(b"abc".ljust(8, b"\0"), "little"), 0, 3)]


# ---- over ZMQ, as a router receives them --------------------------------------------------------------

zmq = pytest.importorskip("zmq")


def _subscriber(ctx, endpoint: str, topic: bytes = b""):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


def _drain_sub(sub, index: RouterIndex, seqs: list[int], ctx=None, replay_endpoint: str | None = None,
               quiet_ms: int = 300) -> int:
    """Apply live batches after those already applied, as a router does: what replay gave
    is skipped, and a gap (a subscription that joined late) is filled from the replay
    socket. Returns how many batches came from replay to fill gaps."""
    filled = 0
    while sub.poll(quiet_ms):
        topic, seq, payload = sub.recv_multipart()
        n = int.from_bytes(seq, "big")
        if seqs and n <= seqs[-1]:
            continue
        if seqs and n > seqs[-1] + 1:
            assert replay_endpoint is not None, f"a gap: {seqs[-1]} then {n}"
            for m, missed in _replay_from(ctx, replay_endpoint, seqs[-1] + 1):
                if m < n:
                    seqs.append(m)
                    index.apply(msgpack.unpackb(missed))
                    filled += 1
            assert seqs[-1] == n - 1, "the replay window lost batches"
        seqs.append(n)
        index.apply(msgpack.unpackb(payload))
    return filled


def _replay_from(ctx, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while dealer.poll(5000):
            _, seq, payload = dealer.recv_multipart()
            n = int.from_bytes(seq, "big", signed=True)
            if n == -1:
                assert payload == b""
                return out
            out.append((n, payload))
        raise AssertionError("no end marker from the replay socket")
    finally:
        dealer.close(linger=0)


async def test_a_zmq_subscriber_and_a_late_joiner_reach_the_store_s_index(tmp_path):
    """A live SUB client and one that joins late and catches up through the replay
    socket both end with exactly what the tiers hold."""
    import asyncio
    ev = EventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", worker_id="w7",
                      model="m", flush_interval=0.001)
    ctx = zmq.Context.instance()
    async with Store.open(config(gpu=12, host=24, disk=48, disk_dir=tmp_path, events=ev)) as store:
        st = store.stats()["events"]
        assert st["endpoint"].startswith("tcp://127.0.0.1:") and not st["endpoint"].endswith("*")
        live = _subscriber(ctx, st["endpoint"], b"kv@w7@m")
        await asyncio.sleep(0.3)            # the subscription reaches the PUB socket (slow joiner)
        try:
            # seq 0 (AllBlocksCleared) went out before anyone listened: the live client catches up too
            live_index, seqs = RouterIndex(), []
            for n, payload in _replay_from(ctx, st["replay_endpoint"], 0):
                seqs.append(n)
                live_index.apply(msgpack.unpackb(payload))
            await run_workload(store, None, seed=6, n=80)
            requests, _ = read_trace(bundled_trace(), 120)        # a slice of the bundled Mooncake trace
            await replay(store, requests, content=True, verify=True, concurrency=4)
            await store.drain()
            store.kv_events.flush()
            await asyncio.sleep(0.05)
            replayed = len(seqs)
            _drain_sub(live, live_index, seqs, ctx, st["replay_endpoint"])
            assert seqs == list(range(len(seqs))) and len(seqs) > replayed + 10     # replay, then live, no gap
            assert live_index.held == store.kv_events.holdings()
            late = RouterIndex()
            for n, payload in _replay_from(ctx, st["replay_endpoint"], 0):
                late.apply(msgpack.unpackb(payload))
            assert late.held == store.kv_events.holdings() and late.held
            assert store.stats()["events"]["dropped"] == 0
        finally:
            live.close(linger=0)


async def test_a_stalled_subscriber_costs_nothing_but_dropped_batches(tmp_path):
    """A subscriber that never reads: the store goes on, Python memory stays within
    the configured buffers, and what the publisher could not queue is counted."""
    ev = EventsConfig(endpoint="tcp://127.0.0.1:*", buffer_batches=4, flush_interval=0.001)
    ctx = zmq.Context.instance()
    async with Store.open(config(gpu=12, host=24, events=ev)) as store:
        stalled = ctx.socket(zmq.SUB)
        stalled.setsockopt(zmq.RCVHWM, 1)
        stalled.setsockopt(zmq.RCVBUF, 1024)
        stalled.setsockopt(zmq.SUBSCRIBE, b"")
        stalled.connect(store.stats()["events"]["endpoint"])
        try:
            for i, path in enumerate(workload(7, 300)):
                await prefill_keys(store, chain_keys(path))
                store.kv_events.flush()            # a batch per request: far more than the buffers
                pub = store.kv_events.publisher.stats()
                assert pub["queued"] <= 4 and pub["buffered"] <= 4
            st = store.stats()["events"]
            assert st["batches"] > 200 and st["events"] > 1000
            assert st["published"] + st["dropped"] <= st["batches"]
        finally:
            stalled.close(linger=0)


# ---- the native encoder against a Python reference -----------------------------------------------------

def reference_events(raw: bytes, tokens: bytes, tpb: int, specs: list, positional: bool) -> list:
    """The events kv_event_codec.hpp must produce from these log entries, built in Python."""
    from runtime.events import EVENT, MEDIUM
    ev = np.frombuffer(raw, dtype=EVENT)
    toks = np.frombuffer(tokens, dtype=np.int32).tolist()
    out, a = [], 0
    while a < len(ev):
        b = a + 1
        while b < len(ev) and (ev["kind"][b], ev["tier"][b], ev["lc"][b]) == (ev["kind"][a], ev["tier"][a], ev["lc"][a]) \
                and (ev["kind"][a] == 1 or (ev["has_parent"][b] and ev["parent"][b] == ev["hash"][b - 1]
                                            and (ev["token_at"][b] >= 0) == (ev["token_at"][a] >= 0))):
            b += 1
        hashes, medium, lc = ev["hash"][a:b].tolist(), MEDIUM[int(ev["tier"][a])], int(ev["lc"][a])
        if ev["kind"][a] == 1:
            out.append(["BlockRemoved", hashes, medium] if positional else
                       {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": lc})
        else:
            parent = int(ev["parent"][a]) if ev["has_parent"][a] else None
            t0 = int(ev["token_at"][a])
            token_ids = toks[t0:t0 + (b - a) * tpb] if t0 >= 0 else []
            if positional:
                out.append(["BlockStored", hashes, parent, token_ids, tpb, None, medium])
            else:
                e = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                     "token_ids": token_ids, "block_size": tpb, "lora_id": None, "medium": medium,
                     "lora_name": None, "group_idx": lc, "kv_cache_spec_kind": specs[lc][0]}
                if specs[lc][1] is not None:
                    e["kv_cache_spec_sliding_window"] = specs[lc][1]
                out.append(e)
        a = b
    return out


@pytest.mark.parametrize("positional", [False, True])
def test_the_native_encoder_matches_the_python_reference_byte_for_byte(positional):
    """Two cores driven alike: one's raw log through the Python reference, the other's
    native payload; equal events, and bytes exactly as msgpack-python packs them."""
    specs = [("full_attention", None), ("sliding_window", 8)]
    rng = random.Random(3)
    cores = []
    for _ in range(2):
        c = Core(4, [(False, 0, 0, 0), (False, 8, 4, 1)], [[0, 0], [-1, -1], [-1, -1]], [[1000], [], []])
        c.set_kv_event_format(4, positional, ["GPU", "CPU_PINNED", "DISK", "EXTERNAL"],
                              [k for k, _ in specs], [-1 if w is None else w for _, w in specs])
        c.set_kv_events(True)
        cores.append(c)
    ops = []
    for i in range(60):
        path = [rng.choice([1, 2, 3]) * 10 + d for d in range(rng.randint(1, 6))]
        tokens = np.array([rng.choice([0, 5, 127, 128, 255, 65536, -1, -40, -200, 1 << 30, -(1 << 31)])
                           for _ in range(4 * len(path))], dtype=np.int32)
        ops.append((chain_keys(path) if i % 4 else [k << 64 for k in chain_keys(path)], tokens))
    for c in cores:
        for i, (keys, tokens) in enumerate(ops):
            sid, matched, _ = c.open(keys, 35)
            c.set_tokens(sid, 0, tokens, 4)
            assert c.extend_now(sid, len(keys) - c.num_blocks(sid)) is not None
            assert c.commit(sid, len(keys)) == -1
            c.close(sid)
            if i % 7 == 6:                      # a drop: removals (a subtree's, when it is the full lc's page)
                found = c.find(keys[len(keys) // 2])
                if found is not None:
                    c.drop_page(found[2][i % 2])
    raw, toks = cores[0].take_kv_events()
    want = reference_events(raw, toks, 4, specs, positional)
    n, body = cores[1].take_kv_event_payload(1 << 20)
    got = msgpack.Unpacker()
    got.feed(body)
    got = list(got)
    assert n == len(got) == len(want) and got == want
    assert b"".join(msgpack.packb(e) for e in got) == body
    assert any(e[0] == "BlockRemoved" if positional else e["type"] == "BlockRemoved" for e in got)


async def test_recovered_blocks_get_their_tokens_back_before_they_move(tmp_path):
    """A restarted store's disk pages have no tokens (the journal keeps keys); a sequence
    opened with the same tokens gives them back, so the promotion's BlockStored carries them."""
    cfg = config(gpu=8, host=8, disk=32, disk_dir=tmp_path, events=EventsConfig())
    toks = list(range(500, 516))
    async with Store.open(cfg) as store:
        await fill(store, toks)
    async with Store.open(cfg) as store:
        store.take_events()
        seq = await store.open_sequence(tokens=toks)
        assert seq.matched_by_tier["disk"] == 4
        await seq.acquire()
        await seq.close()
        stored = [e for b in store.take_events() for e in b[1] if e["type"] == "BlockStored"]
    gpu = [e for e in stored if e["medium"] == "GPU"]
    assert gpu and all(e["token_ids"] == toks[:len(e["token_ids"])] and e["token_ids"] for e in gpu)


def test_a_log_taken_in_small_pieces_while_it_grows_encodes_the_same():
    """Partial takes compact the log (its taken head and their tokens go); the events read
    piece by piece equal one core's whole log through the Python reference."""
    specs = [("full_attention", None)]
    cores = []
    for _ in range(2):
        c = Core(2, [(False, 0, 0, 0)], [[0], [-1], [-1]], [[40000], [], []])
        c.set_kv_event_format(2, False, ["GPU", "CPU_PINNED", "DISK", "EXTERNAL"], ["full_attention"], [-1])
        c.set_kv_events(True)
        cores.append(c)
    rng = random.Random(9)
    got = []
    for step in range(800):
        keys = [step * 100 + d + 1 for d in range(rng.randint(1, 60))]
        tokens = np.arange(2 * len(keys), dtype=np.int32) + step
        for i, c in enumerate(cores):
            sid, _, _ = c.open(keys, 35)
            if step % 3:
                c.set_tokens(sid, 0, tokens, 2)
            assert c.extend_now(sid, len(keys)) is not None
            assert c.commit(sid, len(keys)) == -1
            c.close(sid)
            if step % 5 == 4:
                c.drop_page(c.find(keys[0])[2][0])
            if i == 1:                          # takes smaller than what each step logs: a backlog, compacted
                n, body = c.take_kv_event_payload(rng.randint(1, 40))
                u = msgpack.Unpacker()
                u.feed(body)
                got += list(u)
    while cores[1].kv_event_count():
        u = msgpack.Unpacker()
        u.feed(cores[1].take_kv_event_payload(777)[1])
        got += list(u)
    raw, toks = cores[0].take_kv_events()
    want = reference_events(raw, toks, 2, specs, False)

    def blocks(events):      # runs split where a take cut them: compare block by block
        return [(e["type"], h, e.get("medium"), tuple(e.get("token_ids", ())[2 * i:2 * i + 2]))
                for e in events for i, h in enumerate(e["block_hashes"])]
    assert blocks(got) == blocks(want) and len(blocks(got)) > 20000


def test_bindings_refuse_a_tokens_per_block_that_is_not_the_core_s():
    c = Core(4, [(False, 0, 0, 0)], [[0], [-1], [-1]], [[8], [], []])
    c.set_kv_events(True)
    sid, _, _ = c.open([1, 2], 35)
    with pytest.raises(ValueError, match="tokens_per_block"):
        c.set_tokens(sid, 0, np.zeros(2, dtype=np.int32), 1)
    with pytest.raises(ValueError, match="tokens_per_block"):
        c.set_kv_event_format(64, False, ["GPU", "CPU_PINNED", "DISK"], ["full_attention"], [-1])
    with pytest.raises(ValueError, match="whole blocks"):
        c.set_tokens(sid, 0, np.zeros(6, dtype=np.int32), 4)

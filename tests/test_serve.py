"""scripts/serve.py end to end: a real server subprocess on 127.0.0.1 driven by
concurrent aiohttp clients; pages spill GPU -> host -> disk, their bytes are
verified, the server stops cleanly on SIGTERM/SIGINT and a restart on the same
disk directory serves the earlier prefixes from disk."""
from __future__ import annotations

import asyncio
import contextlib
import gzip
import inspect
import json
import random
import signal
import string
import sys
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

aiohttp = pytest.importorskip("aiohttp")
prom_parser = pytest.importorskip("prometheus_client.parser")

ROOT = Path(__file__).resolve().parent.parent
SERVE = ROOT / "scripts" / "serve.py"
TPB = 16                     # tokens_per_block of the embedded model
LAYERS = ("0", "1", "2", "3")
START_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0
HTTP_TIMEOUT = aiohttp.ClientTimeout(total=30)


class Server:
    """One ``scripts/serve.py`` subprocess."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    @classmethod
    async def start(cls, tmp_path: Path, *args: str, name: str = "server") -> "Server":
        log = tmp_path / f"{name}.stderr"
        with open(log, "wb") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, str(SERVE), "--host", "127.0.0.1", "--port", "0", *args,
                stdout=asyncio.subprocess.PIPE, stderr=err, cwd=str(tmp_path))
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            pytest.fail(f"server did not start: {log.read_text()}")
        text = line.decode().strip()
        if not text.startswith("listening on http://127.0.0.1:"):
            proc.kill()
            await proc.wait()
            pytest.fail(f"unexpected first line {text!r}; stderr:\n{log.read_text()}")
        return cls(proc, text.removeprefix("listening on "), log)

    async def stop(self, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        try:
            return await asyncio.wait_for(self.proc.wait(), STOP_TIMEOUT)
        except asyncio.TimeoutError:
            self.proc.kill()
            await self.proc.wait()
            pytest.fail(f"server ignored signal {sig} for {STOP_TIMEOUT} s; stderr:\n{self.log.read_text()}")

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()

    def stderr(self) -> str:
        return self.log.read_text()


@pytest.fixture
async def servers():
    started: list[Server] = []
    yield started
    for s in started:
        s.kill()
        if s.proc.returncode is None:
            await s.proc.wait()


class Client:
    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http, self.url = http, url
        self.answered: Counter[tuple[str, str]] = Counter()     # (method, status) of the answered requests
        self.scraped: Counter[tuple[str, str]] = Counter()      # ... of those the last /metrics counted

    async def call(self, method: str, path: str, body=None, data: bytes | None = None) -> tuple[int, dict]:
        kwargs = {"json": body} if data is None else {"data": data}
        async with self.http.request(method, self.url + path, **kwargs) as resp:
            payload = await resp.json(content_type=None)
            self.answered[method, str(resp.status)] += 1
            return resp.status, payload

    async def scrape(self) -> dict[tuple[str, tuple], float]:
        """/metrics, parsed; ``scraped``: the answers it counts (not its own)."""
        async with self.http.get(self.url + "/metrics") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain")
            samples = metric_samples(await resp.text())
        self.scraped = Counter(self.answered)
        self.answered["GET", "200"] += 1
        return samples

    async def settled_scrape(self) -> tuple[dict[tuple[str, tuple], float], dict]:
        """/metrics and the /stats it shows: a scrape between two equal /stats
        (the store's background moves and KV events are done)."""
        for _ in range(int(POLL_TIMEOUT / POLL)):
            before = await self.ok("GET", "/stats")
            samples = await self.scrape()
            after = await self.ok("GET", "/stats")
            if before == after:
                return samples, after
            await asyncio.sleep(POLL)
        pytest.fail("the store did not settle for a scrape")

    async def ok(self, method: str, path: str, body=None) -> dict:
        status, payload = await self.call(method, path, body)
        assert status == 200, (method, path, status, payload)
        return payload


class Busy(Exception):
    """A 503 (OutOfPagesError): the flow backs off and starts over."""


def prefix_tokens(p: int) -> list[int]:
    return [1_000_000 + p * 1000 + j for j in range(2 * TPB)]


def prompt_tokens(c: int, r: int) -> list[int]:
    """2 shared prefix blocks (4 distinct prefixes) + 4 blocks unique to (client, request)."""
    return prefix_tokens((c + r) % 4) + [10_000_000 + (c * 100 + r) * 1000 + j for j in range(4 * TPB)]


def generated_tokens(c: int, r: int) -> list[int]:
    return [50_000_000 + (c * 100 + r) * 1000 + j for j in range(TPB)]


async def expect(client: Client, method: str, path: str, body=None) -> dict:
    status, payload = await client.call(method, path, body)
    if status == 503:
        assert payload["error"] == "OutOfPagesError", payload
        raise Busy()
    assert status == 200, (method, path, status, payload)
    return payload


async def flow(client: Client, c: int, r: int, rng: random.Random, stats: dict) -> None:
    """Prefill 6 blocks (2 may be shared), generate a 7th, commit, verify, close."""
    prompt = prompt_tokens(c, r)
    for attempt in range(40):
        sid = None
        try:
            opened = await expect(client, "POST", "/sequences", {"tokens": prompt, "priority": 35})
            sid = opened["id"]
            m = opened["matched_blocks"]
            assert 0 <= m <= 6 and opened["num_keys"] == 6
            assert sum(opened["matched_by_tier"].values()) == m
            stats["matched"] += m
            ext = await expect(client, "POST", f"/sequences/{sid}/extend", {"num_blocks": 6 - m})
            assert ext["num_blocks"] == 6
            idx = ext["page_indices"]
            assert sorted(idx) == sorted(LAYERS)
            for layer, slots in idx.items():
                assert len(slots) == 6
                assert all(s >= 0 for s in slots[m:]), (layer, slots)        # new blocks live on the GPU
                if layer in ("0", "1"):                                      # full attention: all acquired
                    assert all(s >= 0 for s in slots), (layer, slots)
            assert (await expect(client, "POST", f"/sequences/{sid}/commit", {"num_blocks": 6}))["committed"] == 6
            # decode: a block for the generated tokens, then its tokens, then publish it
            assert (await expect(client, "POST", f"/sequences/{sid}/extend", {"num_blocks": 1}))["num_blocks"] == 7
            appended = await expect(client, "POST", f"/sequences/{sid}/append", {"tokens": generated_tokens(c, r)})
            assert appended == {"num_keys": 7, "num_blocks": 7}
            assert (await expect(client, "POST", f"/sequences/{sid}/commit", {"num_blocks": 7}))["committed"] == 7
            v = await expect(client, "GET", f"/sequences/{sid}/verify")
            assert v["corrupt"] == 0, v
            assert v["verified_pages"] >= 7 * 2 * 2, v     # layers 0-1, k and v, every block
            stats["verified"] += v["verified_pages"]
            await expect(client, "POST", f"/sequences/{sid}/release", {})
            if r % 2:                                       # re-acquire path of verify
                v = await expect(client, "GET", f"/sequences/{sid}/verify")
                assert v["corrupt"] == 0, v
                stats["verified"] += v["verified_pages"]
            await expect(client, "DELETE", f"/sequences/{sid}")
            return
        except Busy:
            stats["busy"] += 1
            if sid is not None:
                status, _ = await client.call("DELETE", f"/sequences/{sid}")
                assert status == 200
            await asyncio.sleep(rng.uniform(0.005, 0.05) * min(attempt + 1, 5))
    pytest.fail(f"client {c} request {r}: still out of pages after 40 attempts")


async def reopen_and_verify(client: Client, tokens: list[int], rng: random.Random) -> dict:
    """Open ``tokens`` again (bounded retries on 503), verify its pages, close."""
    for attempt in range(40):
        status, opened = await client.call("POST", "/sequences", {"tokens": tokens})
        if status == 503:
            await asyncio.sleep(rng.uniform(0.005, 0.05) * min(attempt + 1, 5))
            continue
        assert status == 200, opened
        sid = opened["id"]
        status, v = await client.call("GET", f"/sequences/{sid}/verify")
        await client.ok("DELETE", f"/sequences/{sid}")
        if status == 503:
            continue
        assert status == 200, v
        assert v["corrupt"] == 0, v
        opened["verify"] = v
        return opened
    pytest.fail("still out of pages after 40 attempts")


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    families = list(prom_parser.text_string_to_metric_families(text))
    names = Counter(f.name for f in families)
    assert max(names.values()) == 1, [n for n, k in names.items() if k > 1]     # no family exported twice
    for family in families:
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out, key
            out[key] = s.value
    return out


def sample(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def by_label(samples: dict, name: str, label: str) -> dict[str, float]:
    return {dict(k)[label]: v for (n, k), v in samples.items() if n == name}


# names of the metrics serve.py built by hand before runtime.metrics took over the store's
RETIRED = ("kvtier_hits", "kvtier_lookup_blocks", "kvtier_moved_", "kvtier_move_", "kvtier_slots",
           "kvtier_slot_pages", "kvtier_drops")


def check_store_metrics(samples: dict, stats: dict) -> None:
    """Every store metric equals its figure in ``stats`` (Store.stats() read at
    the scrape's moment), and none of serve.py's retired names is exported."""
    assert not [n for n, _ in samples if n.startswith(RETIRED)]
    assert sample(samples, "kvtier_prefix_cache_queries_total") == stats["lookup_blocks"]
    assert by_label(samples, "kvtier_prefix_cache_hits_total", "tier") == {
        t: float(n) for t, n in stats["hits"].items()}
    assert sample(samples, "kvtier_indexed_blocks") == stats["indexed_blocks"]
    groups = set()
    for tier, t in stats["tiers"].items():
        for g in t["groups"]:
            labels = {"tier": tier, "group": str(g["index"])}
            groups.add((tier, str(g["index"])))
            assert sample(samples, "kvtier_kv_cache_slots", **labels) == g["slots"]
            assert sample(samples, "kvtier_kv_cache_slots_used", **labels) == g["used"]
            assert sample(samples, "kvtier_kv_cache_usage_perc", **labels) == pytest.approx(g["used"] / g["slots"])
            assert sample(samples, "kvtier_kv_cache_slots_evictable", **labels) == g["evictable"]
            for state in ("locked", "held", "droppable"):
                assert sample(samples, "kvtier_kv_cache_pages", state=state, **labels) == g[state]
    assert {(dict(k)["tier"], dict(k)["group"]) for n, k in samples if n == "kvtier_kv_cache_slots_used"} == groups
    moves = stats["moves"]
    for metric, key in (("pages", "pages"), ("bytes", "bytes"), ("batches", "batches"),
                        ("failed_batches", "failures")):
        assert by_label(samples, f"kvtier_kv_offload_{metric}_total", "direction") == {
            d: float(m[key]) for d, m in moves.items()}, metric
    latency = by_label(samples, "kvtier_kv_offload_batch_latency_seconds_count", "direction")
    assert latency == {d: float(m["batches"]) for d, m in moves.items() if m["batches"]}
    assert sample(samples, "kvtier_dropped_pages_total") == stats["drops"]
    assert sample(samples, "kvtier_disk_full_dropped_pages_total") == stats["disk_full"]["dropped_pages"]
    assert sample(samples, "kvtier_disk_full_refused_spills_total") == stats["disk_full"]["refused_spills"]
    assert sample(samples, "kvtier_corrupt_pages_total") == stats["corrupt_pages"]
    assert sample(samples, "kvtier_recovered_pages") == stats["recovered_pages"]
    assert sample(samples, "kvtier_orphaned_pages_total") == stats["orphaned_pages"]
    assert sample(samples, "kvtier_discarded_pages_total") == stats["discarded_pages"]
    if "events" in stats:
        assert sample(samples, "kvtier_events_published_total") == stats["events"]["published"]
        assert sample(samples, "kvtier_events_dropped_total") == stats["events"]["dropped"]
        assert sample(samples, "kvtier_events_buffered") == stats["events"]["buffered"]
    else:
        assert not [n for n, _ in samples if n.startswith("kvtier_events_")]


def check_server_metrics(samples: dict, answered: Counter, open_sequences: int = 0, expired: int = 0,
                         verified: int | None = None) -> None:
    """The server's own metrics: requests per (method, status) as the client
    counted its answers, sequences, verified pages, and the lag monitor's
    samples in both the histogram and runtime.metrics' quantiles."""
    requests: Counter[tuple[str, str]] = Counter()
    for (n, k), v in samples.items():
        if n == "kvtier_http_requests_total":
            requests[dict(k)["method"], dict(k)["status"]] += int(v)
    assert requests == answered
    assert sample(samples, "kvtier_open_sequences") == open_sequences
    assert sample(samples, "kvtier_expired_sequences_total") == expired
    assert sample(samples, "kvtier_verified_pages_total", result="corrupt") == 0
    if verified is not None:
        assert sample(samples, "kvtier_verified_pages_total", result="ok") == verified
    ticks = sample(samples, "kvtier_event_loop_lag_samples_total")
    assert ticks > 0 and sample(samples, "kvtier_event_loop_lag_overshoot_seconds_count") == ticks
    lag = by_label(samples, "kvtier_event_loop_lag_seconds", "quantile")
    assert set(lag) == {"0.5", "0.99", "1"}
    assert 0 <= lag["0.5"] <= lag["0.99"] <= lag["1"] < 5


CLIENTS = 16
REQUESTS = 4


async def test_concurrent_clients_spill_verify_restart(tmp_path, servers):
    disk = tmp_path / "disk"
    args = ("--disk-dir", str(disk), "--gpu-slots", "160", "--host-slots", "128", "--disk-slots", "2048")
    server = await Server.start(tmp_path, *args, name="first")
    servers.append(server)
    stats = {"matched": 0, "verified": 0, "busy": 0}
    connector = aiohttp.TCPConnector(limit=CLIENTS * 2)
    async with aiohttp.ClientSession(connector=connector, timeout=HTTP_TIMEOUT) as http:
        client = Client(http, server.url)
        assert (await client.ok("GET", "/healthz"))["ok"] is True

        async def run_client(c: int) -> None:
            rng = random.Random(c)
            for r in range(REQUESTS):
                await flow(client, c, r, rng, stats)
            # the client's first request again, after everyone spilled it: promoted back and intact
            again = await reopen_and_verify(client, prompt_tokens(c, 0) + generated_tokens(c, 0), rng)
            assert again["matched_blocks"] == 7, again
            assert again["verify"]["verified_pages"] >= 7 * 2 * 2
            stats["verified"] += again["verify"]["verified_pages"]

        await asyncio.wait_for(asyncio.gather(*(run_client(c) for c in range(CLIENTS))), 120)
        assert stats["matched"] > 0        # shared prefixes were reused

        st = await client.ok("GET", "/stats")
        moves = st["moves"]
        assert moves["gpu->host"]["pages"] > 0 and moves["host->disk"]["pages"] > 0, moves
        assert moves.get("disk->gpu", {}).get("pages", 0) + moves.get("host->gpu", {}).get("pages", 0) > 0, moves
        assert st["tiers"]["disk"]["groups"][0]["used"] > 0
        assert sum(st["hits"].values()) > 0
        assert all(f["failures"] == 0 for f in moves.values()), moves

        samples, st = await client.settled_scrape()
        check_store_metrics(samples, st)
        check_server_metrics(samples, client.scraped, verified=stats["verified"])
        pages = by_label(samples, "kvtier_kv_offload_pages_total", "direction")
        assert pages["gpu->host"] > 0 and pages["host->disk"] > 0, pages
        assert sample(samples, "kvtier_kv_offload_bytes_total", direction="host->disk") == pages["host->disk"] * \
            st["tiers"]["disk"]["groups"][0]["slot_bytes"]
        assert sum(by_label(samples, "kvtier_prefix_cache_hits_total", "tier").values()) >= stats["matched"] > 0
        assert sample(samples, "kvtier_kv_cache_slots_used", tier="disk", group="0") > 0
        assert sample(samples, "kvtier_http_requests_total", method="GET", route="/sequences/{id}/verify",
                      status="200") >= CLIENTS * (REQUESTS + REQUESTS // 2 + 1)

        # a sequence left open at shutdown is closed by the server
        opened = await client.ok("POST", "/sequences", {"tokens": prompt_tokens(1, 1)})
        assert opened["matched_blocks"] == 6

    assert await server.stop(signal.SIGTERM) == 0, server.stderr()
    assert "Traceback" not in server.stderr(), server.stderr()

    # restart on the same directory: earlier prefixes come back from disk, byte for byte
    server = await Server.start(tmp_path, *args, name="second")
    servers.append(server)
    async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http:
        client = Client(http, server.url)
        st = await client.ok("GET", "/stats")
        assert st["recovered_pages"] > 0
        samples, st = await client.settled_scrape()
        check_store_metrics(samples, st)
        assert sample(samples, "kvtier_recovered_pages") == st["recovered_pages"] > 0
        assert sum(by_label(samples, "kvtier_kv_offload_pages_total", "direction").values()) == 0
        rng = random.Random(99)
        again = await reopen_and_verify(client, prompt_tokens(0, 0) + generated_tokens(0, 0), rng)
        assert again["matched_blocks"] == 7, again
        assert again["matched_by_tier"]["disk"] > 0, again
        assert again["verify"]["verified_pages"] >= 7 * 2 * 2
        # a shared prefix with a new continuation: the prefix from disk, the rest new
        shared = prefix_tokens(3) + [77] * (2 * TPB)
        opened = await client.ok("POST", "/sequences", {"tokens": shared})
        assert opened["matched_blocks"] == 2 and opened["matched_by_tier"]["disk"] == 2, opened
        sid = opened["id"]
        await client.ok("POST", f"/sequences/{sid}/extend", {"num_blocks": 2})
        await client.ok("POST", f"/sequences/{sid}/commit", {"num_blocks": 4})
        v = await client.ok("GET", f"/sequences/{sid}/verify")
        assert v["corrupt"] == 0 and v["verified_pages"] >= 4 * 2 * 2, v
    assert await server.stop(signal.SIGTERM) == 0, server.stderr()
    assert "Traceback" not in server.stderr(), server.stderr()


KV_TOML = """
tokens_per_block = 16
[[layers]]
ids = "0-1"
buffers = { k = 4096, v = 4096 }
reuse = "required"
[[layers]]
ids = [2, 3]
buffers = { k = 4096, v = 4096 }
window_tokens = 64
sink_tokens = 16
reuse = "sink_required_only"
[tiers.gpu]
quota = "512KiB"
device = "cpu"
[tiers.host]
quota = "1MiB"
[tiers.disk]
path = "kvdisk"
quota = "4MiB"
"""


async def test_errors_config_file_and_sigint(tmp_path, servers):
    (tmp_path / "kvdisk").mkdir()
    (tmp_path / "kv.toml").write_text(KV_TOML)
    server = await Server.start(tmp_path, "--config", str(tmp_path / "kv.toml"), "--gpu-slots", "16",
                                "--no-fsync", name="errors")
    servers.append(server)
    async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http:
        client = Client(http, server.url)
        st = await client.ok("GET", "/stats")
        assert st["tiers"]["gpu"]["groups"][0]["slots"] == 16             # --gpu-slots overrides the quota
        assert st["tiers"]["host"]["groups"][0]["slots"] == (1 << 20) // (4 * 4096)

        async def err(method, path, status, error, body=None, data=None):
            got, payload = await client.call(method, path, body, data)
            assert (got, payload.get("error")) == (status, error), (method, path, body, data, got, payload)
            assert isinstance(payload.get("message"), str)

        # malformed requests -> 400
        await err("POST", "/sequences", 400, "BadRequest", data=b'{"tokens": [1, 2')
        await err("POST", "/sequences", 400, "BadRequest", data=b"\xff\xfe")
        await err("POST", "/sequences", 400, "BadRequest", data=b"[" * 100_000)     # nesting past the parser
        await err("POST", "/sequences", 400, "BadRequest", body=[1, 2, 3])
        await err("POST", "/sequences", 400, "BadRequest", body={})
        await err("POST", "/sequences", 400, "BadRequest", body={"tokens": [1], "block_keys": [1]})
        await err("POST", "/sequences", 400, "BadRequest", body={"tokens": "abc"})
        await err("POST", "/sequences", 400, "BadRequest", body={"tokens": [1, "x"]})
        await err("POST", "/sequences", 400, "BadRequest", body={"tokens": [1, True]})
        await err("POST", "/sequences", 400, "BadRequest", body={"tokens": [2**70]})
        await err("POST", "/sequences", 400, "BadRequest", body={"block_keys": ["zz"]})
        await err("POST", "/sequences", 400, "BadRequest", body={"tokens": [1], "priority": 101})
        await err("POST", "/sequences", 400, "UsageError", body={"block_keys": [1, "00ff"]})   # mixed key types
        # unknown sequences -> 404
        for method, path in (("POST", "/sequences/nope/extend"), ("POST", "/sequences/42/commit"),
                             ("POST", "/sequences/42/release"), ("GET", "/sequences/42/verify"),
                             ("DELETE", "/sequences/42"), ("GET", "/sequences/42")):
            await err(method, path, 404, "UnknownSequence", body={"num_blocks": 1})
        await err("GET", "/no/such/route", 404, "HTTPNotFound")

        # a sequence by block keys (ints: the Mooncake trace's hash_ids)
        opened = await client.ok("POST", "/sequences", {"block_keys": [11, 12, 13], "priority": 50})
        sid = opened["id"]
        assert opened["matched_blocks"] == 0 and opened["num_keys"] == 3
        await err("POST", f"/sequences/{sid}/extend", 400, "BadRequest", body={"num_blocks": -1})
        await err("POST", f"/sequences/{sid}/extend", 400, "BadRequest", body={"num_blocks": "2"})
        await err("POST", f"/sequences/{sid}/extend", 400, "BadRequest", body={})
        # more than the GPU tier holds can never fit: too large (413), not "try later" (503, see the flow above)
        await err("POST", f"/sequences/{sid}/extend", 413, "RequestTooLargeError", body={"num_blocks": 1000})
        ext = await client.ok("POST", f"/sequences/{sid}/extend", {"num_blocks": 4})     # state unchanged by the 413
        assert ext["num_blocks"] == 4
        await err("POST", f"/sequences/{sid}/commit", 400, "UsageError", body={"num_blocks": 4})  # block 4 has no key
        await err("POST", f"/sequences/{sid}/append", 400, "UsageError", body={"tokens": [1] * 16})
        await err("POST", f"/sequences/{sid}/acquire", 400, "UsageError", body={})      # already acquired
        assert (await client.ok("POST", f"/sequences/{sid}/append", {"block_keys": [14]}))["num_keys"] == 4
        assert (await client.ok("POST", f"/sequences/{sid}/commit", {"num_blocks": 4}))["committed"] == 4
        v = await client.ok("GET", f"/sequences/{sid}/verify")
        assert v == {"verified_pages": 4 * 4 * 2, "corrupt": 0, "skipped": 0, "corrupt_pages": []}
        await client.ok("POST", f"/sequences/{sid}/release", {})
        # extend a released sequence: acquired for the write, released again
        await client.ok("POST", f"/sequences/{sid}/extend", {"num_blocks": 1})
        assert (await client.ok("GET", f"/sequences/{sid}"))["acquired"] is False
        await client.ok("POST", f"/sequences/{sid}/append", {"block_keys": [15]})
        await client.ok("POST", f"/sequences/{sid}/commit", {"num_blocks": 5})
        v = await client.ok("GET", f"/sequences/{sid}/verify")
        assert v["corrupt"] == 0 and v["verified_pages"] == 5 * 4 * 2 - v["skipped"], v
        await client.ok("DELETE", f"/sequences/{sid}")
        await err("DELETE", f"/sequences/{sid}", 404, "UnknownSequence")

        # the committed keys match again (from the GPU) and verify
        again = await client.ok("POST", "/sequences", {"block_keys": [11, 12, 13, 14, 15]})
        assert again["matched_blocks"] == 5 and again["matched_by_tier"]["gpu"] == 5
        v = await client.ok("GET", f"/sequences/{again['id']}/verify")
        assert v["corrupt"] == 0 and v["verified_pages"] > 0
        await client.ok("DELETE", f"/sequences/{again['id']}")

        # the server is still healthy after all that
        assert (await client.ok("GET", "/healthz"))["ok"] is True
        samples, st = await client.settled_scrape()
        check_store_metrics(samples, st)
        check_server_metrics(samples, client.scraped)
        assert sample(samples, "kvtier_http_requests_total", method="POST", route="/sequences", status="400") >= 10
        assert sample(samples, "kvtier_http_requests_total", method="GET", route="unmatched", status="404") == 1
        assert sample(samples, "kvtier_kv_cache_slots", tier="gpu", group="0") == 16
    assert await server.stop(signal.SIGINT) == 0, server.stderr()
    assert "Traceback" not in server.stderr(), server.stderr()
    assert (tmp_path / "kvdisk" / "HEADER").exists()


async def test_kv_events_config_file(tmp_path, servers):
    """A config file's [events] table reaches the store: it binds the ZMQ
    endpoint, and /metrics counts the KV events a request publishes."""
    (tmp_path / "kvdisk").mkdir()
    (tmp_path / "kv.toml").write_text(KV_TOML + '[events]\nendpoint = "tcp://127.0.0.1:*"\nmodel = "m"\n')
    server = await Server.start(tmp_path, "--config", str(tmp_path / "kv.toml"), "--no-fsync", name="events")
    servers.append(server)
    async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http:
        client = Client(http, server.url)
        samples, st = await client.settled_scrape()
        endpoint = st["events"]["endpoint"]
        assert endpoint.startswith("tcp://127.0.0.1:") and int(endpoint.rsplit(":", 1)[1]) > 0, endpoint
        check_store_metrics(samples, st)
        before = sample(samples, "kvtier_events_published_total")

        opened = await client.ok("POST", "/sequences", {"tokens": prefix_tokens(0)})
        await client.ok("POST", f"/sequences/{opened['id']}/extend", {"num_blocks": 2})
        await client.ok("POST", f"/sequences/{opened['id']}/commit", {"num_blocks": 2})     # BlockStored
        await client.ok("DELETE", f"/sequences/{opened['id']}")

        async def published():
            samples, st = await client.settled_scrape()
            return (samples, st) if sample(samples, "kvtier_events_published_total") > before else None
        samples, st = await until(published, "the request's KV events to be published")
        check_store_metrics(samples, st)
        check_server_metrics(samples, client.scraped)
        assert sample(samples, "kvtier_events_dropped_total") == 0
        assert st["events"]["endpoint"] == endpoint
    assert await server.stop(signal.SIGTERM) == 0, server.stderr()
    assert "Traceback" not in server.stderr(), server.stderr()


def _load_serve():
    """scripts/serve.py as a module (registered first: its dataclasses look their module up)."""
    import importlib.util
    if "kvtier_serve" in sys.modules:
        return sys.modules["kvtier_serve"]
    spec = importlib.util.spec_from_file_location("kvtier_serve", SERVE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return mod


async def test_verify_detects_corruption(tmp_path):
    """In process: the content check is not vacuous (a flipped byte or a
    swapped page is reported) and the content is a pure function of the key."""
    serve = _load_serve()
    a = serve.page_content(b"\x01" * 16, 0, "k", 4096)
    assert a.dtype.itemsize == 1 and a.numel() == 4096
    assert serve.page_content.__wrapped__(b"\x01" * 16, 0, "k", 4096).equal(a)
    assert not serve.page_content(b"\x01" * 16, 0, "v", 4096).equal(a)
    assert not serve.page_content(b"\x01" * 16, 1, "k", 4096).equal(a)
    assert not serve.page_content(b"\x02" * 16, 0, "k", 4096).equal(a)
    assert not a[:64].equal(a[64:128])                       # no repeating 64-byte chunk
    state = serve.ServerState(serve.default_config(str(tmp_path), 32, 32, 64))
    await state.open_store()
    try:
        seq = await state.store.open_sequence(tokens=list(range(3 * TPB)))
        sess = serve.Session("1", seq)
        await state.acquire(sess)
        await seq.extend(3)
        assert state.fill(sess) == 3 * 4 * 2
        assert state.fill(sess) == 0                         # written once
        seq.commit(3)
        assert state.check(sess) == {"verified_pages": 24, "corrupt": 0, "skipped": 0, "corrupt_pages": []}
        pool = state.store.pool_tensor(2, "v")
        slot = seq.page_indices(2)[1]
        pool[slot, 100] ^= 0xFF
        out = state.check(sess)
        assert out["corrupt"] == 1 and out["corrupt_pages"] == [{"block": 1, "layer": 2, "role": "v", "slot": slot}]
        pool[slot, 100] ^= 0xFF
        k0 = state.store.pool_tensor(0, "k")
        s0, s1 = seq.page_indices(0)[:2]
        k0[[s0, s1]] = k0[[s1, s0]].clone()                  # two pages swapped
        assert state.check(sess)["corrupt"] == 2
        await seq.close()
    finally:
        await state.close_store()


# -- hardening: leases, caps, request cost, ids, ports -------------------------------------------------
POLL = 0.02                  # seconds between polls of a condition the server reaches by itself
POLL_TIMEOUT = 5.0


async def until(predicate, what: str):
    """Poll ``predicate()`` (awaited if a coroutine) until it is truthy (bounded); return its value."""
    deadline = asyncio.get_running_loop().time() + POLL_TIMEOUT
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(POLL)


@contextlib.asynccontextmanager
async def in_process(tmp_path: Path, gpu_slots: int = 32, **limits):
    """serve.py's app on 127.0.0.1 (a free port) in this process, so a test
    can read its state; yields ``(client, state)``."""
    serve = _load_serve()
    disk = tmp_path / "disk"
    disk.mkdir(exist_ok=True)
    cfg = serve.default_config(str(disk), gpu_slots, 64, 256, fsync=False)
    app = serve.make_app(cfg, serve.Limits(**limits))
    runner = aiohttp.web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = "http://127.0.0.1:%d" % runner.addresses[0][1]
        async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http:
            yield Client(http, url), app[serve.STATE_KEY]
    finally:
        await runner.cleanup()


def gpu_group(st: dict) -> dict:
    return st["tiers"]["gpu"]["groups"][0]


async def test_vanished_clients_sequences_are_reclaimed(tmp_path, servers):
    """Clients that open sequences, lock the whole GPU pool and vanish: once
    their leases run out the sweeper releases and closes them, later clients
    get pages again, and what they committed is still matched."""
    server = await Server.start(tmp_path, "--gpu-slots", "16", "--lease-seconds", "0.5", name="leases")
    servers.append(server)
    async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http:
        client = Client(http, server.url)
        committed = prefix_tokens(0)                          # 2 blocks, committed before the client vanishes
        first = await client.ok("POST", "/sequences", {"tokens": committed})
        await client.ok("POST", f"/sequences/{first['id']}/extend", {"num_blocks": 2})
        await client.ok("POST", f"/sequences/{first['id']}/commit", {"num_blocks": 2})
        for p in range(1, 4):                                 # 3 more: 4 x 2 blocks x 2 pages = 16 slots
            opened = await client.ok("POST", "/sequences", {"tokens": prefix_tokens(p)})
            await client.ok("POST", f"/sequences/{opened['id']}/extend", {"num_blocks": 2})
        assert gpu_group(await client.ok("GET", "/stats"))["locked"] == 16
        late = await client.ok("POST", "/sequences", {"tokens": prefix_tokens(9)})
        status, payload = await client.call("POST", f"/sequences/{late['id']}/extend", {"num_blocks": 2})
        assert (status, payload["error"]) == (503, "OutOfPagesError"), payload
        # the late client keeps its sequence alive by using it; the four others are gone
        async def reclaimed():
            await client.ok("GET", f"/sequences/{late['id']}")
            return (await client.ok("GET", "/healthz"))["open_sequences"] == 1
        await until(reclaimed, "the abandoned sequences to be reclaimed")
        status, payload = await client.call("GET", f"/sequences/{first['id']}")
        assert (status, payload["error"]) == (404, "UnknownSequence")
        ext = await client.ok("POST", f"/sequences/{late['id']}/extend", {"num_blocks": 2})
        assert ext["num_blocks"] == 2
        assert gpu_group(await client.ok("GET", "/stats"))["locked"] == 4
        await client.ok("DELETE", f"/sequences/{late['id']}")
        again = await client.ok("POST", "/sequences", {"tokens": committed})
        assert again["matched_blocks"] == 2                   # nothing committed was lost
        await client.ok("DELETE", f"/sequences/{again['id']}")
        async with http.get(server.url + "/metrics") as resp:
            samples = metric_samples(await resp.text())
        assert samples[("kvtier_expired_sequences_total", ())] == 4
    assert await server.stop(signal.SIGTERM) == 0, server.stderr()
    assert "Traceback" not in server.stderr(), server.stderr()


async def test_metrics_are_runtime_metrics(tmp_path):
    """/metrics holds runtime.metrics' collector for the server's own store
    and lag monitor, next to the server's metrics, each family once; read
    in one step with Store.stats(), every figure equals the store's."""
    serve = _load_serve()
    from runtime.metrics import StoreCollector, register
    async with in_process(tmp_path, gpu_slots=16) as (client, state):
        assert isinstance(state.store_metrics, StoreCollector)
        assert state.store_metrics.store is state.store and state.store_metrics.lag is state.lag
        with pytest.raises(ValueError, match="Duplicated"):
            register(state.store, state.registry)        # the names are taken: nothing is exported twice
        verified = 0
        for p in range(6):                               # 6 x 2 blocks x 2 pages: past the 16 GPU slots
            opened = await client.ok("POST", "/sequences", {"tokens": prefix_tokens(p)})
            sid = opened["id"]
            await client.ok("POST", f"/sequences/{sid}/extend", {"num_blocks": 2})
            await client.ok("POST", f"/sequences/{sid}/commit", {"num_blocks": 2})
            verified += (await client.ok("GET", f"/sequences/{sid}/verify"))["verified_pages"]
            await client.ok("DELETE", f"/sequences/{sid}")
        again = await client.ok("POST", "/sequences", {"tokens": prefix_tokens(0)})
        assert again["matched_blocks"] == 2
        await asyncio.sleep(3 * serve.LAG_INTERVAL)      # a few lag ticks
        await state.store.drain()

        samples = metric_samples(serve.generate_latest(state.registry).decode())
        stats = state.store.stats()                      # the same moment: no await in between
        check_store_metrics(samples, stats)
        check_server_metrics(samples, client.answered, open_sequences=1, verified=verified)
        assert verified == 6 * 2 * 4 * 2                  # 4 layers, k and v
        assert sample(samples, "kvtier_prefix_cache_queries_total") == 7 * 2
        assert sum(by_label(samples, "kvtier_prefix_cache_hits_total", "tier").values()) == 2
        assert sample(samples, "kvtier_kv_offload_pages_total", direction="gpu->host") > 0
        assert sample(samples, "kvtier_kv_cache_slots", tier="gpu", group="0") == 16
        p = state.lag.percentiles_ms()
        assert sample(samples, "kvtier_event_loop_lag_samples_total") == p["count"] > 0
        assert sample(samples, "kvtier_event_loop_lag_seconds", quantile="1") == p["max"] / 1e3


async def test_lease_is_renewed_by_use(tmp_path):
    """A sequence that requests keep naming outlives its first lease; the
    sequence opened after it, and left alone, is reclaimed first."""
    async with in_process(tmp_path, lease_seconds=0.5) as (client, state):
        kept = await client.ok("POST", "/sequences", {"tokens": prefix_tokens(0)})
        left = await client.ok("POST", "/sequences", {"tokens": prefix_tokens(1)})
        await client.ok("POST", f"/sequences/{left['id']}/release", {})

        async def left_is_gone():
            await client.ok("GET", f"/sequences/{kept['id']}")          # renews kept's lease
            return left["id"] not in state.sessions
        await until(left_is_gone, "the unused sequence to expire")
        assert kept["id"] in state.sessions                  # its first lease ended before left's
        await client.ok("POST", f"/sequences/{kept['id']}/extend", {"num_blocks": 1})
        await until(lambda: not state.sessions, "the kept sequence to expire once unused")
        assert state.expired == 2 and not state.held
        assert gpu_group(state.store.stats())["locked"] == 0


async def test_sweeper_survives_failures(tmp_path, caplog):
    """A failing release, or a failing sweep, is logged; the sequence is still
    closed and the sweeper goes on reclaiming the others."""
    serve = _load_serve()
    state = serve.ServerState(serve.default_config(str(tmp_path), 32, 32, 64), serve.Limits(lease_seconds=0.05))
    await state.open_store()
    try:
        async def open_session(p: int):
            seq = await state.store.open_sequence(tokens=prefix_tokens(p))
            sess = serve.Session(f"s{p}", seq, "client")
            state.reserve("client")
            await state.acquire(sess)
            state.register(sess)
            return sess

        real_release, real_sweep = state.release, state.sweep
        sweeps = 0

        async def failing_release(sess):
            if sess.id == "s0":
                raise RuntimeError("release failed")
            await real_release(sess)

        async def sweep_failing_once():
            nonlocal sweeps
            sweeps += 1
            if sweeps == 1:
                raise RuntimeError("sweep failed")
            return await real_sweep()

        state.release, state.sweep = failing_release, sweep_failing_once
        bad, good = await open_session(0), await open_session(1)
        await until(lambda: not state.sessions, "both sequences to expire")
        assert bad.seq.closed and good.seq.closed and not state.held
        assert not state.sweeper.done()
        later = await open_session(2)
        await until(lambda: later.seq.closed, "a later sequence to expire")
        assert gpu_group(state.store.stats())["locked"] == 0
        logged = caplog.text
        assert "sweep failed" in logged and "release failed" in logged
    finally:
        await state.close_store()


async def test_open_sequence_caps(tmp_path):
    """Past the per-client or the server's cap an open is refused with 429
    naming the limit; a refused or failed open holds nothing; a closed
    sequence frees its place. A client is its peer address."""
    async with in_process(tmp_path, max_sequences=3, max_sequences_per_client=2) as (a, state):
        ids = [(await a.ok("POST", "/sequences", {"tokens": prefix_tokens(p)}))["id"] for p in range(2)]
        status, payload = await a.call("POST", "/sequences", {"tokens": prefix_tokens(2)})
        assert status == 429 and payload["error"] == "TooManySequences", payload
        assert payload["limit"] == "max_sequences_per_client" and "--max-sequences-per-client" in payload["message"]
        status, payload = await a.call("POST", "/sequences", {"tokens": [1, "x"]})
        assert status == 429                                 # the cap is checked before the body is read
        connector = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
        async with aiohttp.ClientSession(connector=connector, timeout=HTTP_TIMEOUT) as http:
            b = Client(http, a.url)
            status, payload = await b.call("POST", "/sequences", {"tokens": [1, "x"]})
            assert status == 400                             # a bad open holds no place
            other = await b.ok("POST", "/sequences", {"tokens": prefix_tokens(3)})
            status, payload = await b.call("POST", "/sequences", {"tokens": prefix_tokens(4)})
            assert status == 429 and payload["limit"] == "max_sequences", payload
            assert "--max-sequences" in payload["message"]
            assert dict(state.held) == {"127.0.0.1": 2, "127.0.0.2": 1}
            await b.ok("DELETE", f"/sequences/{other['id']}")
        await a.ok("DELETE", f"/sequences/{ids[0]}")
        await a.ok("POST", "/sequences", {"tokens": prefix_tokens(5)})
        assert dict(state.held) == {"127.0.0.1": 2}


async def test_sequence_ids_are_unguessable(tmp_path):
    """Ids are random: nobody closes another client's sequence by counting."""
    async with in_process(tmp_path) as (client, state):
        ids = [(await client.ok("POST", "/sequences", {"block_keys": [p]}))["id"] for p in range(3)]
        assert len(set(ids)) == 3
        for sid in ids:
            assert len(sid) >= 20 and not sid.isdigit()
            assert set(sid) <= set(string.ascii_letters + string.digits + "-_")
        for guess in ("0", "1", "2", "3", ids[0][:-1]):
            status, payload = await client.call("DELETE", f"/sequences/{guess}")
            assert (status, payload["error"]) == (404, "UnknownSequence")
        assert sorted(state.sessions) == sorted(ids)


async def test_request_size_limits(tmp_path):
    """Tokens, block keys, body bytes and compressed bodies past the limits
    get a typed 413/415 naming the limit, and change nothing."""
    limits = {"max_tokens": 256, "max_body_bytes": 8192, "max_inflight_bytes": 65536}
    async with in_process(tmp_path, **limits) as (client, state):
        async def refused(status, limit, path="/sequences", body=None, data=None, headers=None):
            kwargs = {"json": body} if data is None else {"data": data}
            async with client.http.post(client.url + path, headers=headers, **kwargs) as resp:
                payload = await resp.json(content_type=None)
            assert (resp.status, payload.get("limit")) == (status, limit), payload
            assert isinstance(payload["message"], str) and payload["message"]
            return payload

        p = await refused(413, "max_tokens", body={"tokens": [7] * 257})
        assert p["error"] == "PayloadTooLarge" and "--max-tokens" in p["message"]
        await refused(413, "max_tokens", body={"block_keys": list(range(17))})     # 256 // 16 keys at most
        await refused(413, "max_tokens", data=b'{"tokens": [1], "x": [' + b"0," * 400 + b"0]}")  # before parsing
        p = await refused(413, "max_body_bytes", body={"tokens": [1], "pad": "x" * 9000})
        assert "--max-body-bytes" in p["message"]

        async def chunks():
            yield b'{"tokens": [1], "pad": "'
            yield b"x" * 9000
            yield b'"}'
        await refused(413, "max_body_bytes", data=chunks())                       # chunked: no Content-Length
        small = json.dumps({"tokens": [1] * 16}).encode()
        p = await refused(415, None, data=gzip.compress(small),
                          headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
        assert p["error"] == "UnsupportedEncoding"
        assert not state.sessions and state.inflight_bytes == 0
        opened = await client.ok("POST", "/sequences", {"tokens": [1] * 256})       # at the limit: fine
        sid = opened["id"]
        async with client.http.post(client.url + "/sequences", data=small,
                                    headers={"Content-Encoding": "identity"}) as resp:
            assert resp.status == 200
        # a sequence grows to --max-tokens at most, and a refused append leaves it as it was
        p = await refused(413, "max_tokens", path=f"/sequences/{sid}/append", body={"tokens": [2] * 16})
        assert "would hold 272 tokens" in p["message"]
        assert (await client.ok("GET", f"/sequences/{sid}"))["num_keys"] == 16


async def test_large_bodies_decode_off_the_loop(tmp_path, monkeypatch):
    """A body over 64 KiB is decoded and checked on the parser thread, and
    its tokens reach the store as an int64 array (converted in C, hashed
    off the loop when long); a small body stays on the loop."""
    serve = _load_serve()
    threads: list[str] = []
    real = serve.decode_prompt

    def spy(*args):
        threads.append(threading.current_thread().name)
        return real(*args)
    monkeypatch.setattr(serve, "decode_prompt", spy)
    async with in_process(tmp_path) as (client, state):
        seen = []
        real_open = state.store.open_sequence

        async def open_spy(**kwargs):
            seen.append(kwargs["tokens"])
            return await real_open(**kwargs)
        monkeypatch.setattr(state.store, "open_sequence", open_spy)
        big = list(range(2**62, 2**62 + 8192))                   # 8192 19-digit tokens: a 160 KiB body
        opened = await client.ok("POST", "/sequences", {"tokens": big})
        assert opened["num_keys"] == 8192 // TPB
        await client.ok("POST", "/sequences", {"tokens": [1] * 32})
        status, payload = await client.call("POST", "/sequences", {"tokens": big[:-1] + [2**64]})
        assert (status, payload["error"]) == (400, "BadRequest") and str(2**64) in payload["message"]
        status, payload = await client.call("POST", "/sequences", {"tokens": big[:-1] + [True]})
        assert (status, payload["error"]) == (400, "BadRequest") and "True" in payload["message"]
    main = threading.main_thread().name
    assert threads[0].startswith("kvtier-serve-parse") and threads[1] == main
    assert all(t.startswith("kvtier-serve-parse") for t in threads[2:]) and len(threads) == 4
    assert [type(t) for t in seen] == [np.ndarray, np.ndarray]
    assert seen[0].dtype == np.int64 and seen[0].tolist() == big


async def test_big_bodies_do_not_stall_the_server(tmp_path, servers):
    """Eight 3.8 MiB bodies of 2 M tokens at once (they held the loop for
    seconds: /healthz took 2.3 s): refused before parsing, while /healthz
    stays prompt. The bound is loose (about 30 ms here) to stay deterministic."""
    server = await Server.start(tmp_path, name="big-bodies")
    servers.append(server)
    body = b'{"tokens": [' + b"1," * 2_000_000 + b"1]}"                 # 3.8 MiB: under --max-body-bytes
    async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http:
        async def post() -> tuple[int, str | None]:
            async with http.post(server.url + "/sequences", data=body) as resp:
                return resp.status, (await resp.json(content_type=None)).get("limit")

        posts = [asyncio.create_task(post()) for _ in range(8)]
        worst = 0.0
        loop = asyncio.get_running_loop()
        while not all(t.done() for t in posts):
            start = loop.time()
            async with http.get(server.url + "/healthz") as resp:
                assert resp.status == 200
            worst = max(worst, loop.time() - start)
            await asyncio.sleep(POLL)
        assert [t.result() for t in posts] == [(413, "max_tokens")] * 8
        assert worst < 1.0, worst
    assert await server.stop(signal.SIGTERM) == 0, server.stderr()


async def test_inflight_body_bytes_are_capped(tmp_path):
    """Bodies admitted but not yet answered count against --max-inflight-bytes:
    past it a request gets 503 naming the limit; the bytes free up once the
    admitted request is answered."""
    limits = {"max_body_bytes": 65536, "max_inflight_bytes": 98304}
    async with in_process(tmp_path, **limits) as (client, state):
        port = int(client.url.rsplit(":", 1)[1])
        body = json.dumps({"tokens": [1] * 32}).encode()
        body += b" " * (65536 - len(body))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"POST /sequences HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 65536\r\n\r\n" + body[:100])
            await writer.drain()
            await until(lambda: state.inflight_bytes == 65536, "the slow body to be admitted")
            status, payload = await client.call("POST", "/sequences", {"tokens": [2] * 32, "pad": " " * 40_000})
            assert (status, payload["error"], payload["limit"]) == (503, "ServerBusy", "max_inflight_bytes")
            small = await client.ok("POST", "/sequences", {"tokens": [3] * 32})       # still fits
            writer.write(body[100:])
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200"), head
        finally:
            writer.close()
            await writer.wait_closed()
        assert state.inflight_bytes == 0
        await client.ok("POST", "/sequences", {"tokens": [2] * 32, "pad": " " * 40_000})
        await client.ok("DELETE", f"/sequences/{small['id']}")


def test_cli_limits_and_port_range(capsys):
    """--port outside 0..65535 is an argparse error (0 still picks a free
    port); the limit flags reach Limits and are checked."""
    serve = _load_serve()
    for bad in ("99999", "65536", "-1"):
        with pytest.raises(SystemExit) as exc:
            serve.parse_args(["--port", bad])
        assert exc.value.code == 2
        assert "--port" in capsys.readouterr().err
    assert serve.parse_args(["--port", "65535"]).port == 65535
    assert serve.parse_args(["--port", "0"]).port == 0
    assert serve.limits_from(serve.parse_args([])) == serve.Limits()
    args = serve.parse_args(["--lease-seconds", "0.25", "--max-sequences", "9", "--max-sequences-per-client", "3",
                             "--max-tokens", "100", "--max-body-bytes", "2048", "--max-inflight-bytes", "4096"])
    assert serve.limits_from(args) == serve.Limits(0.25, 9, 3, 100, 2048, 4096)
    for flags in (["--lease-seconds", "0"], ["--lease-seconds", "nan"], ["--max-tokens", "0"],
                  ["--max-body-bytes", "8192", "--max-inflight-bytes", "4096"]):
        with pytest.raises(SystemExit):
            serve.parse_args(flags)
        capsys.readouterr()


def test_disk_dir_overrides_a_config_files_directory_that_does_not_exist(tmp_path, monkeypatch):
    """``serve.py --config kv.toml --disk-dir D``: D replaces the file's directory before the
    config is checked (the file's ``kvdisk`` is never made here), relative to the working
    directory; without the flag a missing directory stays an error that names it."""
    import runtime
    serve = _load_serve()
    (tmp_path / "conf").mkdir()
    toml = tmp_path / "conf" / "kv.toml"
    toml.write_text(KV_TOML)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    cfg = runtime.load_config(toml, disk_path="elsewhere")       # the working directory's, not conf/'s
    assert cfg.disk.path == str(tmp_path / "elsewhere")
    args = serve.parse_args(["--config", str(toml), "--disk-dir", "elsewhere"])
    assert serve.override_config(cfg, args).disk.path == "elsewhere"
    with pytest.raises(runtime.ConfigError, match="kvdisk.*does not exist"):
        runtime.load_config(toml)
    assert not (tmp_path / "conf" / "kvdisk").exists()


async def test_serve_makes_the_disk_dir_a_command_line_names_over_a_config_file(tmp_path, servers):
    """The script itself: ``--disk-dir`` over a config file whose own directory does not exist is
    made and served from; with a config that is refused, the directory it made is gone again."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "kv.toml").write_text(KV_TOML)
    server = await Server.start(tmp_path, "--config", "conf/kv.toml", "--disk-dir", "made/here", "--no-fsync",
                                name="made")
    servers.append(server)
    async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http:
        st = await Client(http, server.url).ok("GET", "/stats")
        assert st["tiers"]["disk"]["groups"][0]["slots"] > 0
    assert await server.stop() == 0
    assert (tmp_path / "made" / "here").is_dir() and not (tmp_path / "conf" / "kvdisk").exists()
    (tmp_path / "bad.toml").write_text(KV_TOML.replace('quota = "512KiB"', 'quota = "lots"'))
    r = await asyncio.create_subprocess_exec(sys.executable, str(SERVE), "--config", "bad.toml", "--disk-dir", "never",
                                             cwd=str(tmp_path), stderr=asyncio.subprocess.PIPE)
    _, err = await r.communicate()
    assert r.returncode == 2 and b"ConfigError" in err and b"quota" in err
    assert not (tmp_path / "never").exists()

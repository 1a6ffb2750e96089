"""scripts/serve.py end to end: a real server subprocess on 127.0.0.1 driven by
concurrent aiohttp clients; pages spill GPU -> host -> disk, their bytes are
verified, the server stops cleanly on SIGTERM/SIGINT and a restart on the same
disk directory serves the earlier prefixes from disk."""
from __future__ import annotations

import asyncio
import random
import signal
import sys
from pathlib import Path

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

    async def call(self, method: str, path: str, body=None, data: bytes | None = None) -> tuple[int, dict]:
        kwargs = {"json": body} if data is None else {"data": data}
        async with self.http.request(method, self.url + path, **kwargs) as resp:
            payload = await resp.json(content_type=None)
            return resp.status, payload

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
    for family in prom_parser.text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


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

        await asyncio.wait_for(asyncio.gather(*(run_client(c) for c in range(CLIENTS))), 120)
        assert stats["matched"] > 0        # shared prefixes were reused

        st = await client.ok("GET", "/stats")
        moves = st["moves"]
        assert moves["gpu->host"]["pages"] > 0 and moves["host->disk"]["pages"] > 0, moves
        assert moves.get("disk->gpu", {}).get("pages", 0) + moves.get("host->gpu", {}).get("pages", 0) > 0, moves
        assert st["tiers"]["disk"]["groups"][0]["used"] > 0
        assert sum(st["hits"].values()) > 0
        assert all(f["failures"] == 0 for f in moves.values()), moves

        async with http.get(server.url + "/metrics") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain")
            samples = metric_samples(await resp.text())
        assert samples[("kvtier_moved_pages_total", (("direction", "gpu->host"),))] > 0
        assert samples[("kvtier_moved_pages_total", (("direction", "host->disk"),))] > 0
        assert samples[("kvtier_moved_bytes_total", (("direction", "host->disk"),))] > 0
        assert sum(v for (n, _), v in samples.items() if n == "kvtier_hits_total") > 0
        for tier in ("gpu", "host", "disk"):
            assert ("kvtier_slots_in_use", (("group", "0"), ("tier", tier))) in samples
        assert samples[("kvtier_slots_in_use", (("group", "0"), ("tier", "disk")))] > 0
        assert ("kvtier_drops_total", ()) in samples
        for q in ("0.5", "0.99"):
            lag = samples[("kvtier_event_loop_lag_seconds", (("quantile", q),))]
            assert 0 <= lag < 5
        assert samples[("kvtier_event_loop_lag_overshoot_seconds_count", ())] > 0
        assert samples[("kvtier_verified_pages_total", (("result", "corrupt"),))] == 0
        assert samples[("kvtier_open_sequences", ())] == 0

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
        # more than the GPU tier holds can never fit: misuse (400), not "try later" (503, see the flow above)
        await err("POST", f"/sequences/{sid}/extend", 400, "UsageError", body={"num_blocks": 1000})
        ext = await client.ok("POST", f"/sequences/{sid}/extend", {"num_blocks": 4})     # state unchanged by the 400
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
        async with http.get(server.url + "/metrics") as resp:
            samples = metric_samples(await resp.text())
        assert samples[("kvtier_http_requests_total", (("method", "POST"), ("route", "/sequences"),
                                                       ("status", "400")))] >= 10
    assert await server.stop(signal.SIGINT) == 0, server.stderr()
    assert "Traceback" not in server.stderr(), server.stderr()
    assert (tmp_path / "kvdisk" / "HEADER").exists()


def _load_serve():
    import importlib.util
    spec = importlib.util.spec_from_file_location("kvtier_serve", SERVE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
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

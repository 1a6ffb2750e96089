"""Traces: hostile lines are skipped with a reason, and the replay streams a
trace (gzipped or not) in bounded memory without blocking the loop."""
from __future__ import annotations

import contextlib
import gc
import gzip
import json
import os
import subprocess
import sys
import types

import aiofiles
import pytest

from runtime import Store, UsageError
from runtime.lag import LoopLagMonitor
from runtime.tools import trace
from runtime.tools.cli import tune_gc
from runtime.tools.replay import replay
from runtime.tools.trace import TraceError, TraceStream, read_trace

from helpers import config


def line(ids, ts=0, input_length=1024, output_length=8) -> str:
    return json.dumps({"timestamp": ts, "input_length": input_length, "output_length": output_length,
                       "hash_ids": ids})


async def stream_all(path, **kw) -> tuple[list, TraceStream]:
    stream = TraceStream(str(path), **kw)
    return [r async for r in stream], stream


# -- hostile values ----------------------------------------------------------------------------------
OUT_OF_RANGE = [line([1, 2**127]), line([1, 2, 3]), line([-2**127 - 1]), line([-2**127, 2**127 - 1, 7])]


async def test_hash_ids_beyond_128_bits_are_skipped_and_reported_and_the_rest_replayed(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(OUT_OF_RANGE * 3) + "\n")
    requests, problems = read_trace(str(path))
    assert [p.split(":")[0] for p in problems] == ["line 1", "line 3", "line 5", "line 7", "line 9", "line 11"]
    assert all("128 bits" in p for p in problems)
    assert [r.hash_ids for r in requests] == [(1, 2, 3), (-2**127, 2**127 - 1, 7)] * 3
    async with Store.open(config(gpu=16)) as store:
        stream = TraceStream(str(path))
        res = await replay(store, stream)
    assert stream.skipped == 6 and stream.problems == problems
    assert res.requests == 6 and res.blocks == 18 and not res.errors and res.corrupt_pages == 0
    assert res.hit_blocks == 12 and res.verified_pages > 0


def test_the_cli_replay_reports_out_of_range_lines_and_goes_on(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(OUT_OF_RANGE) + "\n")
    r = subprocess.run([sys.executable, "-m", "runtime.tools.cli", "replay", str(path), "--device", "cpu",
                        "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    out = json.loads(r.stdout)
    assert out["requests"] == 2 and out["blocks"] == 6 and out["skipped_lines"] == 2
    assert "line 1: a hash_id does not fit in signed 128 bits" in r.stderr and "line 3:" in r.stderr
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    r = subprocess.run([sys.executable, "-m", "runtime.tools.cli", "replay", str(gz), "--device", "cpu", "--limit", "1",
                        "--json"], capture_output=True, text=True, timeout=300)
    out = json.loads(r.stdout)
    assert out["requests"] == 1 and out["blocks"] == 3 and out["skipped_lines"] == 1 and "line 3" not in r.stderr


@pytest.mark.parametrize("bad, reason", [
    (line([1, True]), "list of integers"),
    (line([1, 2.0]), "list of integers"),
    (line([1, "2"]), "list of integers"),
    (line([[1]]), "list of integers"),
    (line({"1": 2}), "list of integers"),
    (line([1], input_length=-1), "input_length"),
    (line([1], input_length=True), "input_length"),
    (line([1], output_length=1.5), "output_length"),
    (line([1], input_length=2**63), "input_length"),
    (line([1], ts=True), "timestamp"),
    ('{"timestamp": NaN, "input_length": 1, "output_length": 1, "hash_ids": [1]}', "timestamp"),
    ('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1' + "0" * 5000 + "]}", "digits"),
    (line(None), "list of integers"),
    ('{"timestamp": 0, "hash_ids": [1]}', "missing field"),
    ("[1, 2]", "not a json object"),
    ("[" * 100_000, "recursion"),
    (line([0] * (trace.MAX_HASH_IDS + 1)), "entries"),
    (line([1]) + " " * trace.MAX_LINE_BYTES, "longer than"),
])
async def test_hostile_values_are_skipped_with_a_reason(tmp_path, bad, reason):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([line([1]), bad, line([2])]) + "\n")
    requests, problems = read_trace(str(path))
    assert [r.hash_ids for r in requests] == [(1,), (2,)]
    assert len(problems) == 1 and problems[0].startswith("line 2: ") and reason in problems[0].lower(), problems
    streamed, stream = await stream_all(path)
    assert streamed == requests and stream.problems == problems and stream.skipped == 1


async def test_an_over_long_last_line_without_a_newline_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(trace, "MAX_LINE_BYTES", 100)
    path = tmp_path / "t.jsonl"
    path.write_text(line([1]) + "\n" + line(list(range(50))))
    for chunk in (16, 4096):
        monkeypatch.setattr(trace, "CHUNK_BYTES", chunk)
        requests, problems = read_trace(str(path))
        assert [r.hash_ids for r in requests] == [(1,)] and problems == ["line 2: longer than 100 bytes"]
        streamed, stream = await stream_all(path)
        assert streamed == requests and stream.problems == problems


# -- streaming = reading whole ------------------------------------------------------------------------
def sample_lines(n: int) -> list[str]:
    out = []
    for i in range(n):
        if i % 17 == 5:
            out.append("{not json")
        elif i % 23 == 7:
            out.append("")
        else:
            out.append(line([i % 11, i % 13, 100 + i], ts=i * 3.5, input_length=i))
    return out


def write_variants(tmp_path, lines: list[str]) -> dict:
    text = "\r\n".join(lines).encode()               # CRLF, and no newline at the end
    half = len(text) // 2
    paths = {"plain": tmp_path / "t.jsonl", "gzip": tmp_path / "t.jsonl.gz", "members": tmp_path / "m.jsonl.gz"}
    paths["plain"].write_bytes(text)
    paths["gzip"].write_bytes(gzip.compress(text))
    # two gzip members with zero padding between and after, as gzip.open reads them
    paths["members"].write_bytes(gzip.compress(text[:half]) + b"\0" * 5 + gzip.compress(text[half:]) + b"\0" * 3)
    return paths


@pytest.mark.parametrize("chunk", [7, 1000, trace.CHUNK_BYTES])
async def test_plain_and_gzipped_traces_stream_to_what_read_trace_gives(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(trace, "CHUNK_BYTES", chunk)     # small chunks split lines and gzip members anywhere
    lines = sample_lines(3000)
    expected = [trace._parse(json.loads(s)) for s in lines if s and not s.startswith("{not")]
    for kind, path in write_variants(tmp_path, lines).items():
        requests, problems = read_trace(str(path))
        assert requests == expected, kind
        assert len(problems) == sum(s.startswith("{not") for s in lines)
        streamed, stream = await stream_all(path)
        assert streamed == expected, kind
        assert stream.skipped == len(problems) and stream.problems == problems[:trace.REPORTED]
        limited, _ = await stream_all(path, limit=100)
        assert limited == expected[:100] == read_trace(str(path), limit=100)[0]


async def test_truncated_or_corrupt_gzip_is_a_clean_error(tmp_path):
    data = gzip.compress("\n".join(sample_lines(500)).encode())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(data[:len(data) // 2])
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(data[:20] + bytes(b ^ 0x55 for b in data[20:60]) + data[60:])
    for path in (cut, bad, tmp_path / "missing.jsonl", tmp_path):
        with pytest.raises(UsageError, match="cannot read trace"):
            read_trace(str(path))
        with pytest.raises(UsageError, match="cannot read trace"):
            await stream_all(path)


async def test_strict_stops_at_the_first_bad_line_with_requests_in_flight(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([line([i, i + 1]) for i in range(40)] + ["{not json"] + [line([1])] * 5) + "\n")
    async with Store.open(config(gpu=16)) as store:
        with pytest.raises(TraceError, match=":41:") as e:
            await replay(store, TraceStream(str(path), strict=True), concurrency=4)
        assert e.value.line == 41
        store.check_consistency()                    # the requests in flight ended before the error came out


async def test_concurrent_replay_of_a_list_keeps_order_and_bound_and_stops_at_a_failure():
    """The workers take requests in trace order, at most ``concurrency`` in flight; an error that is
    not a request's own stops them taking more, and comes out once the requests in flight ended."""
    requests = [trace._parse(json.loads(line([i, 1000 + i]))) for i in range(60)]
    async with Store.open(config(gpu=64)) as store:
        opened, live, peak = [], [0], [0]
        real_open = store.open_sequence

        async def open_sequence(**kw):
            key = kw["block_keys"][0]
            opened.append(key)
            if key == 30:
                raise RuntimeError("boom at request 30")
            live[0] += 1
            peak[0] = max(peak[0], live[0])
            return await real_open(**kw)

        def ended(n: int) -> None:
            live[0] -= n
        store.open_sequence = open_sequence
        res = await replay(store, requests[:30], content=True, verify=True, concurrency=4, progress=ended)
        assert opened == list(range(30)) and peak[0] == 4 and res.requests == 30 and res.corrupt_pages == 0
        opened.clear()
        with pytest.raises(RuntimeError, match="boom at request 30"):
            await replay(store, requests, content=False, verify=False, concurrency=4, progress=ended)
        assert opened == list(range(31)) and live[0] == 0      # none taken after it; those in flight ended
        store.check_consistency()


# -- a large trace: incremental, bounded, and the loop keeps ticking ---------------------------------------
@pytest.fixture(scope="module")
def large_traces(tmp_path_factory) -> dict:
    """200k lines (~19 MB), plain and gzipped."""
    plain = tmp_path_factory.mktemp("large") / "large.jsonl"
    with open(plain, "w") as f:
        for i in range(200_000):
            f.write(line([i % 1000, i % 997, i], ts=i, input_length=1536) + "\n")
    gz = plain.with_suffix(".gz")
    gz.write_bytes(gzip.compress(plain.read_bytes(), compresslevel=1))
    return {"plain": plain, "gzip": gz}


@pytest.fixture
def cli_gc():
    """The CLI's GC settings (cli.tune_gc): without them a full collection over
    torch's objects stalls any loop for ~100 ms, whatever the stream does."""
    thresholds = gc.get_threshold()
    tune_gc()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


@pytest.fixture
def read_sizes(monkeypatch) -> list[int]:
    """The sizes of the reads the stream makes, through aiofiles (so on its worker thread)."""
    sizes: list[int] = []

    @contextlib.asynccontextmanager
    async def counting_open(path, mode):
        async with aiofiles.open(path, mode) as f:
            async def read(n: int = -1) -> bytes:
                data = await real_read(n)
                sizes.append(len(data))
                return data
            real_read, f.read = f.read, read
            yield f
    monkeypatch.setattr(trace, "aiofiles", types.SimpleNamespace(open=counting_open))
    return sizes


@pytest.mark.parametrize("kind", ["plain", "gzip"])
async def test_a_large_trace_streams_from_its_first_chunk_without_stalling_the_loop(large_traces, read_sizes, kind,
                                                                                   cli_gc):
    path = large_traces[kind]
    size = path.stat().st_size
    lag = LoopLagMonitor().start()
    requests = aiter(TraceStream(str(path)))
    first = await anext(requests)
    assert first.hash_ids == (0, 0, 0)
    assert read_sizes == [trace.CHUNK_BYTES] and trace.CHUNK_BYTES < size / 10     # one chunk read, not the file
    n, last = 1, first
    async for last in requests:
        n += 1
    await lag.stop()
    assert n == 200_000 and last.hash_ids == (199_999 % 1000, 199_999 % 997, 199_999)
    assert sum(read_sizes) == size and max(read_sizes) <= trace.CHUNK_BYTES
    p = lag.percentiles_ms()
    # under scripts/sanitize.sh (its own core: KVTIER_CORE_LIB) every allocation goes through
    # ASan, and with other jobs on the 2 cores the gzip case passed 50 ms twice; never otherwise
    bound = 200 if os.environ.get("KVTIER_CORE_LIB") else 50
    assert p["count"] > 10 and p["max"] < bound, p


@pytest.mark.parametrize("kind", ["plain", "gzip"])
async def test_streaming_holds_a_chunk_not_the_trace(large_traces, kind):
    import tracemalloc
    tracemalloc.start()
    try:
        n = 0
        async for _ in TraceStream(str(large_traces[kind])):
            n += 1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert n == 200_000
    # ~0.6 MB here; read_trace holds ~50 MB of requests for this 19 MB file
    assert peak < 4 << 20, peak


async def test_many_skipped_lines_are_counted_and_the_first_few_shown(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(["{not json"] * 30 + [line([1])]) + "\n")
    streamed, stream = await stream_all(path)
    assert len(streamed) == 1 and stream.skipped == 30 and len(stream.problems) == trace.REPORTED
    trace.report_skipped(str(path), stream.problems, stream.skipped)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == trace.REPORTED + 1 and err[0].startswith(f"{path}: line 1: ")
    assert err[-1] == f"{path}: 20 more malformed lines skipped (30 in all)"

"""Reading Mooncake-format traces: one JSON object a line with
``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``.

A trace can be many GB, gzipped or not. ``TraceStream`` reads it in chunks as
the replay consumes it (bounded memory, file reads on aiofiles' thread, lines
parsed a chunk at a time on the loop); ``read_trace`` reads it whole, for the
benchmarks that want every request in memory before they time anything. Both
run the same decoder and parser, so they give the same requests and skip the
same lines.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import sys
import zlib
from typing import AsyncIterator, Iterator

import aiofiles

from tiers.errors import UsageError

CHUNK_BYTES = 64 << 10          # parsed in one go on the loop: a few ms of json.loads
MAX_LINE_BYTES = 4 << 20        # a longer line is skipped, not buffered without bound
MAX_HASH_IDS = 1 << 20          # more blocks than any real request: refused before the store sees them
KEY_MIN, KEY_END = -(1 << 127), 1 << 127    # block keys are signed 128-bit in the native core
LENGTH_END = 1 << 63
REPORTED = 10                   # reasons shown (and kept, when streaming) for skipped lines
GZIP_MAGIC = b"\x1f\x8b"
_INT = {int}


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class TraceError(UsageError):
    def __init__(self, path: str, line: int, problem: str) -> None:
        self.line = line
        super().__init__(f"{path}:{line}: {problem}")


# -- one line ---------------------------------------------------------------------------------------
def _check_ids(ids: object) -> tuple[int, ...]:
    """The block keys of a request. Bools, floats and ints outside signed
    128 bits are refused here: the store would refuse the whole request."""
    if not isinstance(ids, list) or not set(map(type, ids)) <= _INT:        # bool is not int here
        raise ValueError("hash_ids must be a list of integers")
    if len(ids) > MAX_HASH_IDS:
        raise ValueError(f"hash_ids has {len(ids)} entries (at most {MAX_HASH_IDS})")
    if ids and not (KEY_MIN <= min(ids) and max(ids) < KEY_END):
        raise ValueError("a hash_id does not fit in signed 128 bits (-2**127 <= id < 2**127)")
    return tuple(ids)


def _check_length(obj: dict, field: str) -> int:
    v = obj[field]
    if type(v) is not int or not 0 <= v < LENGTH_END:
        raise ValueError(f"{field} must be a non-negative integer below 2**63")
    return v


def _parse(obj: object) -> TraceRequest:
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    for field in ("timestamp", "input_length", "output_length", "hash_ids"):
        if field not in obj:
            raise ValueError(f"missing field {field!r}")
    ids = _check_ids(obj["hash_ids"])
    lengths = _check_length(obj, "input_length"), _check_length(obj, "output_length")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise ValueError("timestamp must be a finite number")
    return TraceRequest(float(ts), *lengths, ids)


# -- bytes to lines to requests ----------------------------------------------------------------------
class _Gunzip:
    """Incremental gzip decoding of members one after another (and zero
    padding between them), as ``gzip.open`` reads them. Output comes in
    pieces of at most ``size`` bytes, so a small compressed chunk cannot
    inflate into a huge one."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.z: zlib._Decompress | None = None       # None: between members

    def feed(self, data: bytes) -> Iterator[bytes]:
        while True:
            if self.z is None:
                data = data.lstrip(b"\0")
                if not data:
                    return
                self.z = zlib.decompressobj(wbits=31)
            out = self.z.decompress(data, self.size)
            if out:
                yield out
            if self.z.eof:
                data, self.z = self.z.unused_data, None
            else:
                data = self.z.unconsumed_tail
                if not data and len(out) < self.size:       # input used up and no output pending
                    return

    def end(self) -> None:
        if self.z is not None:
            raise EOFError("compressed file ended before the end-of-stream marker was reached")


class _Reader:
    """File bytes in, requests out: gunzips when the file starts with the
    gzip magic (traces are often shipped so), splits lines across chunks
    and parses them. Keeps the first ``keep`` problems (all when None) and
    counts every skipped line."""

    def __init__(self, path: str, limit: int | None, strict: bool, keep: int | None) -> None:
        self.path, self.strict, self.keep = path, strict, keep
        self.left = limit                   # requests still wanted; None: all
        self.gunzip: _Gunzip | None = None
        self.started = False
        self.line = 0                       # complete lines seen
        self.tail = b""                     # the start of a line whose end has not come yet
        self.dropping = False               # inside a line over MAX_LINE_BYTES, skipping to its end
        self.skipped = 0
        self.problems: list[str] = []

    @property
    def done(self) -> bool:
        return self.left == 0

    def decode(self, raw: bytes) -> Iterator[bytes]:
        """Trace text, at most CHUNK_BYTES a piece once gunzipped."""
        if not self.started:
            self.started = True
            if raw[:2] == GZIP_MAGIC:
                self.gunzip = _Gunzip(CHUNK_BYTES)
        if self.gunzip is None:
            yield raw
        else:
            yield from self.gunzip.feed(raw)

    def parse(self, text: bytes) -> list[TraceRequest]:
        """The requests on the lines that ``text`` completes."""
        if self.dropping:
            cut = text.find(b"\n")
            if cut < 0:
                return []
            self.dropping = False
            self.line += 1
            self._skip(self.line, f"longer than {MAX_LINE_BYTES} bytes")
            text = text[cut + 1:]
        lines = text.split(b"\n")
        lines[0] = self.tail + lines[0]     # (not (tail + text).split: a long tail is not rescanned per chunk)
        self.tail = lines.pop()
        if len(self.tail) > MAX_LINE_BYTES:
            self.tail, self.dropping = b"", True
        return self._parse_lines(lines)

    def end(self) -> list[TraceRequest]:
        """The last line, when the file does not end with a newline."""
        if self.done:
            return []
        if self.gunzip is not None:
            self.gunzip.end()
        if self.dropping:
            self.dropping = False
            self._skip(self.line + 1, f"longer than {MAX_LINE_BYTES} bytes")
            return []
        tail, self.tail = self.tail, b""
        return self._parse_lines([tail])

    def _parse_lines(self, lines: list[bytes]) -> list[TraceRequest]:
        out: list[TraceRequest] = []
        for raw in lines:
            if self.done:
                break
            self.line += 1
            if len(raw) > MAX_LINE_BYTES:
                self._skip(self.line, f"longer than {MAX_LINE_BYTES} bytes")
                continue
            if not raw.strip():
                continue
            try:
                out.append(_parse(json.loads(raw.decode("utf-8"))))
            except json.JSONDecodeError as exc:             # its own "line 1 column 1" read as a second line number
                self._skip(self.line, f"invalid JSON ({exc.msg} at column {exc.colno})")
                continue
            except UnicodeDecodeError:
                self._skip(self.line, "not UTF-8 text")
                continue
            except (ValueError, RecursionError) as exc:     # a request without what it needs, absurd nesting
                self._skip(self.line, str(exc))
                continue
            if self.left is not None:
                self.left -= 1
        return out

    def _skip(self, line: int, problem: str) -> None:
        if self.strict:
            raise TraceError(self.path, line, problem)
        self.skipped += 1
        if self.keep is None or len(self.problems) < self.keep:
            self.problems.append(f"line {line}: {problem}")     # the caller reports them (once)


def _unreadable(path: str, exc: BaseException) -> UsageError:
    """Unreadable, a truncated gzip stream or corrupt compressed data."""
    return UsageError(f"cannot read trace {path!r}: {getattr(exc, 'strerror', None) or exc}")


_READ_ERRORS = (OSError, EOFError, zlib.error)


# -- the whole trace, or a stream of it --------------------------------------------------------------
def read_trace(path: str, limit: int | None = None, strict: bool = False) -> tuple[list[TraceRequest], list[str]]:
    """Requests and the problems found (``line N: ...``), from a JSON-lines
    file, gzipped or not. With ``strict`` the first malformed line raises
    TraceError; otherwise it is skipped. Blocking, and the whole trace in
    memory: for benchmarks; ``TraceStream`` is the one for the event loop."""
    reader = _Reader(path, limit, strict, keep=None)
    out: list[TraceRequest] = []
    try:
        with open(path, "rb") as f:
            while not reader.done and (raw := f.read(CHUNK_BYTES)):
                for text in reader.decode(raw):
                    out += reader.parse(text)
            out += reader.end()
    except _READ_ERRORS as exc:
        raise _unreadable(path, exc) from None
    return out, reader.problems


class TraceStream:
    """The requests of a trace, read as they are consumed: ``async for req in
    TraceStream(path)``. Memory stays bounded by a chunk and a line however
    large the file; reads run on aiofiles' worker thread and each chunk's
    lines are parsed in one go, so the loop never waits for the disk and
    pays one await per chunk, not per line. Skipped lines are counted in
    ``skipped`` and the first few kept in ``problems``; with ``strict`` the
    first one raises TraceError where the stream has got to."""

    def __init__(self, path: str, limit: int | None = None, strict: bool = False) -> None:
        self.path = path
        self._reader = _Reader(path, limit, strict, keep=REPORTED)

    @property
    def skipped(self) -> int:
        return self._reader.skipped

    @property
    def problems(self) -> list[str]:
        return self._reader.problems

    def __aiter__(self) -> AsyncIterator[TraceRequest]:
        return self._requests()

    async def _requests(self) -> AsyncIterator[TraceRequest]:
        reader = self._reader
        try:
            async with aiofiles.open(self.path, "rb") as f:
                while not reader.done and (raw := await f.read(CHUNK_BYTES)):
                    for text in reader.decode(raw):
                        for req in reader.parse(text):
                            yield req
                        await asyncio.sleep(0)      # a gzip chunk inflates to many pieces: let the loop run
                last = reader.end()
        except _READ_ERRORS as exc:
            raise _unreadable(self.path, exc) from None
        for req in last:
            yield req


def report_skipped(path: str, problems: list[str], skipped: int | None = None) -> None:
    """Tell the user (on stderr) which lines were skipped: the first few
    reasons, then how many more (``skipped`` counts them all when only the
    first ``problems`` were kept)."""
    total = len(problems) if skipped is None else skipped
    for p in problems[:REPORTED]:
        print(f"{path}: {p} (skipped)", file=sys.stderr)
    if total > REPORTED:
        print(f"{path}: {total - REPORTED} more malformed lines skipped ({total} in all)", file=sys.stderr)

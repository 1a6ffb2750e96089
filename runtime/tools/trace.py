"""Reading Mooncake-format traces: one JSON object a line with
``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``."""
from __future__ import annotations

import dataclasses
import gzip
import json
import math
import sys
from typing import IO

from tiers.errors import UsageError


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


def _parse(obj: object) -> TraceRequest:
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    for field in ("timestamp", "input_length", "output_length", "hash_ids"):
        if field not in obj:
            raise ValueError(f"missing field {field!r}")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ValueError("hash_ids must be a list of integers")
    for field in ("input_length", "output_length"):
        v = obj[field]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{field} must be a non-negative integer")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise ValueError("timestamp must be a finite number")
    return TraceRequest(float(ts), obj["input_length"], obj["output_length"], tuple(ids))


def _open(path: str) -> IO[bytes]:
    f = open(path, "rb")
    if f.peek(2)[:2] == b"\x1f\x8b":                 # gzip, as traces are often shipped
        f.close()
        return gzip.open(path, "rb")
    return f


def read_trace(path: str, limit: int | None = None, strict: bool = False) -> tuple[list[TraceRequest], list[str]]:
    """Requests and the problems found (``line N: ...``), from a JSON-lines
    file, gzipped or not. With ``strict`` the first malformed line raises
    TraceError; otherwise it is skipped."""
    out: list[TraceRequest] = []
    problems: list[str] = []
    try:
        with _open(path) as f:
            for n, raw in enumerate(f, 1):
                if limit is not None and len(out) >= limit:
                    break
                if not raw.strip():
                    continue
                try:
                    out.append(_parse(json.loads(raw.decode("utf-8"))))
                except (ValueError, RecursionError) as exc:     # bad JSON, bad UTF-8, absurd nesting
                    if strict:
                        raise TraceError(path, n, str(exc)) from None
                    problems.append(f"line {n}: {exc}")      # the caller reports them (once)
    except (OSError, EOFError) as exc:                 # unreadable, or a truncated gzip stream
        raise UsageError(f"cannot read trace {path!r}: {getattr(exc, 'strerror', None) or exc}") from None
    return out, problems


def report_skipped(path: str, problems: list[str]) -> None:
    """Tell the user (on stderr) which lines ``read_trace`` skipped."""
    for p in problems:
        print(f"{path}: {p} (skipped)", file=sys.stderr)

#!/usr/bin/env python3
"""Spill-to-disk experiment: hit rates, traffic and bandwidth across tier sizes and codecs.

Replays a Mooncake trace (default: the bundled ``runtime/tools/data/synthetic_slice.jsonl``)
through a real ``runtime.Store`` once per configuration -- GPU, host and disk
capacities times cold-page codecs -- with real page bytes (``replay(content=True,
verify=True)``: every page that comes back to the GPU is checked against what was
written), a fresh temporary disk directory per configuration, and writes

* ``OUT/spill.csv``: one row per configuration (columns: ``COLUMNS`` below);
* ``OUT/spill.png``: (1) hit rate by tier, stacked gpu/host/disk, per codec;
  (2) MiB spilled to and recalled from disk; (3) spill/recall bandwidth --
  all against capacity.

The model is the two-life-cycle one of ``kvtier demo`` (4 full-attention layers
and 4 sliding-window layers with attention sinks and ``SINK_REQUIRED_ONLY``
reuse, sharing one pool group per tier), with 512-token blocks to match the
trace's ``hash_ids`` and fp16 ``k``/``v`` buffers of ``--buffer-bytes`` each.
One block therefore takes two pages (one per life cycle) in every tier, and a
capacity "in blocks" means ``2 x blocks`` slots.

Capacities:

* block mode (``--gpu/--host/--disk``): slots per tier given in blocks, the
  same for every codec;
* equal-bytes mode (``--host-mib/--disk-mib``, ``--equal-bytes``, and the
  default sweep): host and disk are given in MiB and converted to slots with
  each codec's cold page size, so ``int8`` (about 0.53x the bytes of
  ``concat``) holds about 1.9x the blocks in the same memory and disk. The GPU
  holds hot pages, the same size for every codec, so it is given in blocks.

Lists are comma-separated and combined as a cartesian product (``--zip``: pair
them element by element instead; a one-element list is broadcast). A size of 0,
or a list left out when the other cold tier is given, leaves the tier out
(``--host 0``: the GPU spills straight to disk).

The default sweep is equal bytes at a fixed GPU (the longest request rounded
up to 128 blocks), for both codecs: the disk doubles from 1/32 to 1x of the
next power of two above the trace's distinct-block footprint under
``concat``, and the host is a quarter of the disk (``default_mib``).
``--quick`` is 2 sizes x 2 codecs on the first 150 requests (the test uses it).

    python scripts/spill_experiment.py                       # default sweep -> ./spill-out
    python scripts/spill_experiment.py --quick --out /tmp/q
    python scripts/spill_experiment.py --trace ../shared/traces/conversation_trace.jsonl --limit 2000
    python scripts/spill_experiment.py --gpu 384 --host 0,256,1024 --disk 4096 --codecs concat
    python scripts/spill_experiment.py --host-mib 8,16 --disk-mib 64 --zip --json

Measurement notes:

* ``bytes_<src>_to_<dst>`` / ``pages_...`` are ``Store.stats()["moves"]``; the
  store counts bytes at the *destination* page size, so with ``int8`` the
  ``*_to_gpu`` directions count decoded (hot) bytes. ``disk_bytes_written`` and
  ``disk_bytes_read`` are the disk tier's own counters: cold bytes that
  actually hit the file.
* spill bandwidth = ``disk_bytes_written`` / busy seconds of the moves into the
  disk tier; recall bandwidth = ``disk_bytes_read`` / busy seconds of the moves
  out of it (those include the decode and the copy to the GPU).
* ``persist_on_close`` is off: the numbers describe the replay, not shutdown.
* requests are replayed one at a time by default (``--concurrency``), so hit
  rates are deterministic.

``main(argv)`` returns the exit status (1: a page came back corrupt; 2: bad flags,
an unreadable trace or a configuration that failed); the module does nothing on import.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import json
import math
import os
import sys
import tempfile
import textwrap
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from runtime.tools.demo import bundled_trace  # noqa: E402
from runtime.loop import run  # noqa: E402
from runtime.tools.replay import replay  # noqa: E402
from runtime.store import Store  # noqa: E402
from runtime.tools.trace import TraceRequest, read_trace, report_skipped  # noqa: E402
from tiers.codecs import get_codec  # noqa: E402
from tiers.config import DiskConfig, GpuConfig, HostConfig, StoreConfig  # noqa: E402
from tiers.errors import KvtierError  # noqa: E402
from tiers.grouping import Layout  # noqa: E402
from tiers.layers import LayerSpec, build_life_cycles  # noqa: E402
from tiers.policy import ReusePolicy  # noqa: E402

MiB = 1 << 20
TOKENS_PER_BLOCK = 512
CODECS = ("concat", "int8")
QUICK_LIMIT = 150
DIRECTIONS = ("gpu->host", "host->disk", "disk->gpu", "host->gpu", "gpu->disk", "disk->host")


class UsageError(Exception):
    """A bad flag or flag combination (exit status 2)."""


def _dcol(d: str) -> str:
    return d.replace("->", "_to_")


COLUMNS = (
    ["gpu_blocks", "host_blocks", "disk_blocks", "host_mib", "disk_mib", "codec", "page_bytes",
     "cold_page_bytes", "requests", "blocks", "hit_blocks", "hit_rate", "hit_rate_gpu", "hit_rate_host",
     "hit_rate_disk"]
    + [f"{k}_{_dcol(d)}" for d in DIRECTIONS for k in ("bytes", "pages")]
    + ["disk_bytes_written", "disk_bytes_read", "spill_busy_s", "recall_busy_s", "spill_mib_s", "recall_mib_s",
       "drops", "verified_pages", "corrupt_pages", "errors", "error_kinds", "loop_lag_p99_ms", "replay_s", "wall_s"]
)


# -- model and configurations ------------------------------------------------------------------
def model_layers(buffer_bytes: int, codec: str) -> list[LayerSpec]:
    """``kvtier demo``'s model: 4 full-attention layers + 4 windowed layers with sinks."""
    kv = (("k", buffer_bytes), ("v", buffer_bytes))
    layers = [LayerSpec(i, kv, codec=codec) for i in range(4)]
    layers += [LayerSpec(i, kv, window_tokens=2048, sink_tokens=512, reuse=ReusePolicy.SINK_REQUIRED_ONLY,
                         codec=codec) for i in range(4, 8)]
    return layers


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Page sizes of the model under one codec, and pages per block in each tier's group."""

    page_bytes: int           # hot page of one life cycle
    cold_page_bytes: int      # its cold (host/disk) page under the codec
    pages_per_block: dict     # tier -> pages one block takes in that tier's (single) pool group

    @property
    def cold_block_bytes(self) -> int:
        return self.cold_page_bytes * self.pages_per_block["host"]

    @property
    def hot_block_bytes(self) -> int:
        return self.page_bytes * self.pages_per_block["gpu"]


def geometry(buffer_bytes: int, codec: str) -> Geometry:
    lcs = build_life_cycles(model_layers(buffer_bytes, codec))
    for lc in lcs:
        get_codec(lc.codec, "--codecs").check(lc)
    layout = Layout.build(lcs)
    per_block = {}
    for tier, groups in layout.groups.items():
        if len(groups) != 1:   # the model is built so that this holds; slots= applies per group
            raise RuntimeError(f"expected one {tier} pool group, got {len(groups)}")
        per_block[tier] = len(groups[0].life_cycles)
    cold = {g.slot_bytes for g in layout.groups["host"]}.pop()
    return Geometry(lcs[0].page_bytes, cold, per_block)


@dataclasses.dataclass(frozen=True)
class Point:
    codec: str
    gpu_blocks: int
    host_blocks: int
    disk_blocks: int
    host_mib: float
    disk_mib: float

    def label(self) -> str:
        return f"{self.codec} gpu={self.gpu_blocks} host={self.host_blocks} disk={self.disk_blocks}"


def store_config(p: Point, geo: Geometry, buffer_bytes: int, disk_dir: str, fsync: bool,
                 device: str) -> StoreConfig:
    ppb = geo.pages_per_block
    return StoreConfig(
        layers=model_layers(buffer_bytes, p.codec), tokens_per_block=TOKENS_PER_BLOCK,
        gpu=GpuConfig(slots=p.gpu_blocks * ppb["gpu"], device=device),
        host=HostConfig(slots=p.host_blocks * ppb["host"], codec=p.codec) if p.host_blocks else None,
        disk=DiskConfig(path=disk_dir, slots=p.disk_blocks * ppb["disk"], fsync=fsync) if p.disk_blocks else None,
        persist_on_close=False,
    )


def _numbers(text: str | None, flag: str, cast: type = int) -> list | None:
    """A comma-separated list of non-negative ``cast`` values (None when the flag is absent)."""
    if text is None:
        return None
    what = "integers" if cast is int else "numbers"
    try:
        vals = [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated {what}, got {text!r}") from None
    if not vals or any(not math.isfinite(v) or v < 0 for v in vals):
        raise UsageError(f"{flag}: expected non-negative {what}, got {text!r}")
    return vals


def _combine(lists: Sequence[list], zipped: bool) -> list[tuple]:
    if not zipped:
        return list(itertools.product(*lists))
    n = max(len(x) for x in lists)
    if any(len(x) not in (1, n) for x in lists):
        raise UsageError(f"--zip: lists must have the same length (or one element), got {[len(x) for x in lists]}")
    return [tuple(x[i] if len(x) > 1 else x[0] for x in lists) for i in range(n)]


def trace_stats(requests: Sequence[TraceRequest]) -> dict:
    """Distinct blocks, longest request and the hit rate of an unbounded prefix cache."""
    seen: set[int] = set()
    hits = total = longest = 0
    for r in requests:
        ids = r.hash_ids
        total += len(ids)
        longest = max(longest, len(ids))
        for h in ids:           # ids are chained: a seen id means the whole prefix up to it was seen
            if h not in seen:
                break
            hits += 1
        seen.update(ids)
    return {"distinct_blocks": len(seen), "blocks": total, "longest": longest,
            "unbounded_hit_rate": hits / total if total else 0.0}


def default_mib(buffer_bytes: int, stats: dict, quick: bool) -> tuple[list[float], list[float]]:
    """Host and disk MiB of the default (or quick) equal-bytes sweep: the disk
    doubles from 1/32 to 1x of ``top``, the concat footprint of the trace's
    distinct blocks rounded up to a power of two (quick: 1/16 and 1/4), and the
    host is a quarter of the disk."""
    block = geometry(buffer_bytes, "concat").cold_block_bytes / MiB
    top = 2.0 ** math.ceil(math.log2(max(stats["distinct_blocks"] * block, 1.0)))
    disk = [top / 16, top / 4] if quick else [top / 2 ** k for k in range(5, -1, -1)]
    return [d / 4 for d in disk], disk


def plan(args, stats: dict) -> tuple[list[Point], bool]:
    """The configurations to run and whether capacities are equal-bytes."""
    codecs = list(dict.fromkeys(c.strip() for c in args.codecs.split(",") if c.strip()))
    if not codecs:
        raise UsageError("--codecs: name at least one codec")
    for c in codecs:
        try:
            get_codec(c, "--codecs")
        except KvtierError as e:
            raise UsageError(str(e)) from None
    geos = {c: geometry(args.buffer_bytes, c) for c in codecs}
    gpu = _numbers(args.gpu, "--gpu")
    host, disk = _numbers(args.host, "--host"), _numbers(args.disk, "--disk")
    host_mib, disk_mib = _numbers(args.host_mib, "--host-mib", float), _numbers(args.disk_mib, "--disk-mib", float)
    if (host or disk) and (host_mib or disk_mib or args.equal_bytes):
        raise UsageError("give capacities in blocks (--host/--disk) or in MiB (--host-mib/--disk-mib), not both")
    zipped = args.zip
    if gpu is None:
        gpu = [max(128, -(-(stats["longest"] + 1) // 128) * 128)]   # the longest request must fit
    equal = not (host or disk)
    if equal and not (host_mib or disk_mib):
        host_mib, disk_mib = default_mib(args.buffer_bytes, stats, args.quick)
        zipped = True
    points = []
    if equal:
        for g, hm, dm in _combine([gpu, host_mib or [0.0], disk_mib or [0.0]], zipped):
            for c in codecs:
                cb = geos[c].cold_block_bytes
                points.append(Point(c, g, int(hm * MiB // cb), int(dm * MiB // cb), hm, dm))
    else:
        for g, h, d in _combine([gpu, host or [0], disk or [0]], zipped):
            for c in codecs:
                cb = geos[c].cold_block_bytes
                points.append(Point(c, g, h, d, h * cb / MiB, d * cb / MiB))
    warned = set()
    for p in points:
        if p.gpu_blocks <= 0:
            raise UsageError("--gpu: the GPU tier needs at least one block")
        if p.gpu_blocks < stats["longest"] and p.gpu_blocks not in warned:
            warned.add(p.gpu_blocks)
            print(f"warning: {p.gpu_blocks} GPU blocks cannot hold the longest request ({stats['longest']} blocks);"
                  " such requests fail with OutOfPagesError (column 'errors')", file=sys.stderr)
        if equal and ((p.host_mib and not p.host_blocks) or (p.disk_mib and not p.disk_blocks)):
            print(f"warning: {p.host_mib:g}/{p.disk_mib:g} MiB holds less than one {p.codec} block; tier left out",
                  file=sys.stderr)
    return points, equal


# -- running one configuration ---------------------------------------------------------------
async def _replay_point(cfg: StoreConfig, requests, concurrency: int, advance) -> tuple[dict, dict]:
    async with Store.open(cfg) as store:
        res = await replay(store, requests, concurrency=concurrency, content=True, verify=True, progress=advance)
        await store.drain()           # background demotions still in flight count too
        stats = store.stats()
        device = store.device.name
    return res.as_dict() | {"device": device}, stats


def _busy_seconds(mv: dict) -> float:
    bw = mv.get("bandwidth_gbps", 0.0)
    return mv["bytes"] / (bw * 1e9) if bw > 0 else 0.0


def run_point(p: Point, geo: Geometry, requests, args, advance: Callable[[int], None]) -> dict:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvtier-spill-", dir=args.disk_dir) as tmp:
        cfg = store_config(p, geo, args.buffer_bytes, tmp, args.fsync, args.device)
        res, stats = run(_replay_point(cfg, requests, args.concurrency, advance))
    wall = time.perf_counter() - t0
    moves = stats["moves"]
    disk = stats.get("disk", {})
    spill_s = sum(_busy_seconds(m) for d, m in moves.items() if d.endswith("->disk"))
    recall_s = sum(_busy_seconds(m) for d, m in moves.items() if d.startswith("disk->"))
    written, read = disk.get("bytes_written", 0), disk.get("bytes_read", 0)
    row = {
        "gpu_blocks": p.gpu_blocks, "host_blocks": p.host_blocks, "disk_blocks": p.disk_blocks,
        "host_mib": round(p.host_mib, 3), "disk_mib": round(p.disk_mib, 3), "codec": p.codec,
        "page_bytes": geo.page_bytes, "cold_page_bytes": geo.cold_page_bytes,
        "requests": res["requests"], "blocks": res["blocks"], "hit_blocks": res["hit_blocks"],
        "hit_rate": round(res["hit_rate"], 6),
        **{f"hit_rate_{t}": round(res["hit_rate_by_tier"][t], 6) for t in ("gpu", "host", "disk")},
    }
    for d in DIRECTIONS:
        row[f"bytes_{_dcol(d)}"] = moves.get(d, {}).get("bytes", 0)
        row[f"pages_{_dcol(d)}"] = moves.get(d, {}).get("pages", 0)
    row.update({
        "disk_bytes_written": written, "disk_bytes_read": read,
        "spill_busy_s": round(spill_s, 4), "recall_busy_s": round(recall_s, 4),
        "spill_mib_s": round(written / MiB / spill_s, 2) if spill_s > 0 else 0.0,
        "recall_mib_s": round(read / MiB / recall_s, 2) if recall_s > 0 else 0.0,
        "drops": stats.get("drops", 0), "verified_pages": res["verified_pages"],
        "corrupt_pages": res["corrupt_pages"], "errors": sum(res["errors"].values()),
        "error_kinds": " ".join(f"{k}:{v}" for k, v in sorted(res["errors"].items())),
        "loop_lag_p99_ms": res["loop_lag_ms"].get("p99", 0.0), "replay_s": res["seconds"],
        "wall_s": round(wall, 3),
    })
    row["_device"] = res["device"]
    return row


@contextmanager
def _progress(total: int, enabled: bool) -> Iterator[tuple[Callable[[int], None], Callable[[str], None]]]:
    """(advance, describe) callbacks of a rich progress bar on a terminal; no-ops otherwise."""
    if not enabled or not sys.stderr.isatty():
        yield (lambda n=1: None), (lambda text: None)
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn, TimeRemainingColumn
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("spill sweep", total=total)
        yield (lambda n=1: bar.advance(task, n)), (lambda text: bar.update(task, description=text))


# -- outputs ---------------------------------------------------------------------------------------
def write_csv(rows: Sequence[dict], path: str) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def _capacity_key(r: dict, equal: bool) -> tuple:
    if equal:
        return (r["host_mib"] + r["disk_mib"], r["gpu_blocks"], r["host_mib"], r["disk_mib"])
    return (r["gpu_blocks"] + r["host_blocks"] + r["disk_blocks"], r["gpu_blocks"], r["host_blocks"], r["disk_blocks"])


def _tick(key: tuple, equal: bool, vary_gpu: bool) -> str:
    total, g, h, d = key
    if equal:
        head = f"{total:g} MiB"
        split = f"{h:g}+{d:g}" + (f"\ngpu {g}" if vary_gpu else "")
    else:
        head = f"{total}"
        split = f"{g}/{h}/{d}"
    return f"{head}\n{split}"


def plot(rows: Sequence[dict], path: str, equal: bool, title: str, subtitle: str, unbounded: float | None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    keys = sorted({_capacity_key(r, equal) for r in rows})
    pos = {k: i for i, k in enumerate(keys)}
    codecs = list(dict.fromkeys(r["codec"] for r in rows))
    vary_gpu = len({k[1] for k in keys}) > 1
    tier_colors = {"gpu": "#2ca02c", "host": "#1f77b4", "disk": "#ff7f0e"}
    hatches = ["", "///", "xx", "..", "\\\\"]
    codec_colors = ["#1f77b4", "#d62728", "#9467bd", "#8c564b", "#17becf"]
    width = 0.8 / max(len(codecs), 1)

    fig, axes = plt.subplots(3, 1, figsize=(max(9.0, 0.9 * len(keys) * max(len(codecs), 1) + 3), 13),
                             sharex=True, constrained_layout=True)
    ax1, ax2, ax3 = axes
    for ci, codec in enumerate(codecs):
        rs = sorted((r for r in rows if r["codec"] == codec), key=lambda r: _capacity_key(r, equal))
        xs = [pos[_capacity_key(r, equal)] for r in rs]
        bar_x = [x - 0.4 + width * (ci + 0.5) for x in xs]
        bottom = [0.0] * len(rs)
        for tier in ("gpu", "host", "disk"):
            vals = [r[f"hit_rate_{tier}"] for r in rs]
            ax1.bar(bar_x, vals, width * 0.92, bottom=bottom, color=tier_colors[tier],
                    hatch=hatches[ci % len(hatches)], edgecolor="white", linewidth=0.6)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for x, r in zip(bar_x, rs):
            ax1.text(x, r["hit_rate"] + 0.01, f"{r['hit_rate']:.0%}", ha="center", va="bottom", fontsize=7.5)
        color = codec_colors[ci % len(codec_colors)]
        ax2.plot(xs, [r["disk_bytes_written"] / MiB for r in rs], "o-", color=color, label=f"{codec}: spilled to disk")
        ax2.plot(xs, [r["disk_bytes_read"] / MiB for r in rs], "s--", color=color, label=f"{codec}: recalled from disk")
        ax3.plot(xs, [r["spill_mib_s"] for r in rs], "o-", color=color, label=f"{codec}: spill (write)")
        ax3.plot(xs, [r["recall_mib_s"] for r in rs], "s--", color=color, label=f"{codec}: recall (disk->gpu)")

    handles = [Patch(facecolor=c, label=f"hit on {t}") for t, c in tier_colors.items()]
    handles += [Patch(facecolor="#bbbbbb", edgecolor="white", hatch=hatches[i % len(hatches)], label=f"codec {c}")
                for i, c in enumerate(codecs)]
    if unbounded is not None:
        ax1.axhline(unbounded, color="black", linestyle=":", linewidth=1)
        handles.append(plt.Line2D([], [], color="black", linestyle=":", label=f"unbounded cache ({unbounded:.0%})"))
    ax1.set_ylim(0, min(1.0, max([r["hit_rate"] for r in rows] + [unbounded or 0]) * 1.15 + 0.02))
    ax1.set_ylabel("hit rate (share of blocks)")
    ax1.set_title("(1) prefix hit rate by tier (stacked gpu / host / disk)", loc="left", fontsize=11)
    ax1.legend(handles=handles, loc="upper left", fontsize=8.5, ncol=2, framealpha=0.9)
    ax2.set_ylabel("MiB (cold bytes on disk)")
    ax2.set_title("(2) traffic to and from the disk tier", loc="left", fontsize=11)
    ax2.legend(loc="best", fontsize=8.5, framealpha=0.9)
    ax3.set_ylabel("MiB/s (bytes / busy seconds)")
    ax3.set_title("(3) spill and recall bandwidth", loc="left", fontsize=11)
    ax3.legend(loc="best", fontsize=8.5, framealpha=0.9)
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    ax3.set_xticks(range(len(keys)))
    ax3.set_xticklabels([_tick(k, equal, vary_gpu) for k in keys], fontsize=8.5)
    if equal:
        gpus = sorted({k[1] for k in keys})
        ax3.set_xlabel("host + disk capacity, MiB (host+disk split below; equal bytes for every codec)"
                       + ("" if vary_gpu else f"; GPU {gpus[0]} blocks"))
    else:
        ax3.set_xlabel("total capacity in blocks (gpu/host/disk below)")
    # about nine characters an inch at this size: a narrow (quick) figure wraps its subtitle
    fig.suptitle(f"{title}\n" + textwrap.fill(subtitle, int(fig.get_figwidth() * 9)), fontsize=12)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _kib(n: int) -> str:
    return f"{n / 1024:g} KiB"


def print_table(rows: Sequence[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=title, title_justify="left", caption="capacities in blocks (gpu/host/disk) and MiB of cold pages (host+disk)", caption_justify="left")
    cols = ["codec", "gpu/host/disk", "h+d MiB", "hit", "gpu", "host", "disk", "spill MiB", "recall MiB",
            "spill MiB/s", "recall MiB/s", "verified", "corrupt", "errors", "wall s"]
    for c in cols:
        t.add_column(c, justify="left" if c == "codec" else "right", no_wrap=True)
    for r in rows:
        t.add_row(r["codec"], f"{r['gpu_blocks']}/{r['host_blocks']}/{r['disk_blocks']}",
                  f"{r['host_mib']:g}+{r['disk_mib']:g}", f"{r['hit_rate']:.1%}",
                  f"{r['hit_rate_gpu']:.1%}", f"{r['hit_rate_host']:.1%}", f"{r['hit_rate_disk']:.1%}",
                  f"{r['disk_bytes_written'] / MiB:.1f}", f"{r['disk_bytes_read'] / MiB:.1f}",
                  f"{r['spill_mib_s']:.0f}", f"{r['recall_mib_s']:.0f}", str(r["verified_pages"]),
                  str(r["corrupt_pages"]), str(r["errors"]), f"{r['wall_s']:.1f}")
    console = Console()
    if not console.is_terminal:          # piped or captured: do not squeeze the table into 80 columns
        console = Console(width=180)
    console.print(t)


# -- command line ------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="spill_experiment.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=None, help="Mooncake trace (JSONL); default: the bundled synthetic slice")
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--out", default="spill-out", help="output directory for spill.csv and spill.png (default ./spill-out)")
    ap.add_argument("--quick", action="store_true", help=f"2 sizes x the codecs on the first {QUICK_LIMIT} requests (about 20 s)")
    ap.add_argument("--gpu", help="GPU capacities in blocks, e.g. 384,512 (default: longest request rounded up to 128)")
    ap.add_argument("--host", help="host capacities in blocks (0: no host tier)")
    ap.add_argument("--disk", help="disk capacities in blocks (0: no disk tier)")
    ap.add_argument("--host-mib", help="host capacities in MiB of cold pages (equal-bytes mode)")
    ap.add_argument("--disk-mib", help="disk capacities in MiB of cold pages (equal-bytes mode)")
    ap.add_argument("--equal-bytes", action="store_true",
                    help="capacities in MiB, converted to slots per codec (the default sweep already is)")
    ap.add_argument("--zip", action="store_true", help="pair the capacity lists element-wise instead of a product")
    ap.add_argument("--codecs", default=",".join(CODECS), help="cold-page codecs, comma-separated (default concat,int8)")
    ap.add_argument("--buffer-bytes", type=int, default=2048,
                    help="bytes per block of each fp16 k and v buffer (multiple of 128 for int8; default 2048)")
    ap.add_argument("--fsync", action="store_true", help="turn the disk tier's durability barriers on (default off)")
    ap.add_argument("--disk-dir", default=None, help="where the per-configuration temporary disk directories go")
    ap.add_argument("--device", default="auto", help="GPU tier device: auto, cpu (emulated), cuda, cuda:N")
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight (default 1: deterministic)")
    ap.add_argument("--no-plot", action="store_true", help="write the CSV only")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of the summary table")
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit <= 0:
        ap.error("--limit must be positive")
    if args.buffer_bytes <= 0:
        ap.error("--buffer-bytes must be positive")
    if args.concurrency <= 0:
        ap.error("--concurrency must be positive")
    if args.quick and args.limit is None:
        args.limit = QUICK_LIMIT
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    trace_path = args.trace or bundled_trace()
    try:
        requests, problems = read_trace(trace_path, args.limit)
    except KvtierError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report_skipped(trace_path, problems)
    if not requests:
        print(f"error: no requests in {trace_path}", file=sys.stderr)
        return 2
    stats = trace_stats(requests)
    try:
        points, equal = plan(args, stats)
        geos = {c: geometry(args.buffer_bytes, c) for c in {p.codec for p in points}}
    except (KvtierError, UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    if args.disk_dir:
        os.makedirs(args.disk_dir, exist_ok=True)

    rows: list[dict] = []
    failed: list[Point] = []
    t0 = time.perf_counter()
    with _progress(len(points) * len(requests), not args.json) as (advance, describe):
        for i, p in enumerate(points, 1):
            describe(f"[{i}/{len(points)}] {p.label()}")
            try:
                rows.append(run_point(p, geos[p.codec], requests, args, advance))
            except KvtierError as e:      # e.g. DiskFullError: report it, keep sweeping
                failed.append(p)
                print(f"error: {p.label()}: {type(e).__name__}: {e}", file=sys.stderr)
    elapsed = time.perf_counter() - t0
    device = rows[0].pop("_device") if rows else "?"
    for r in rows:
        r.pop("_device", None)

    name = os.path.basename(trace_path)
    csv_path = os.path.join(args.out, "spill.csv")
    png_path = os.path.join(args.out, "spill.png")
    write_csv(rows, csv_path)
    plotted = False
    if rows and not args.no_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("matplotlib is not installed (pip install 'kvtier[plots]'): no plot written", file=sys.stderr)
        else:
            geo = next(iter(geos.values()))
            cold = ", ".join(f"{c} {_kib(g.cold_page_bytes)}" for c, g in sorted(geos.items()))
            subtitle = (f"{stats['blocks']} blocks in {len(requests)} requests, {stats['distinct_blocks']} distinct; "
                        f"2 life cycles x {_kib(geo.page_bytes)} hot pages per block ({cold} cold); "
                        f"fsync {'on' if args.fsync else 'off'}; {device}")
            plot(rows, png_path, equal, f"kvtier spill-to-disk sweep: {name}", subtitle, stats["unbounded_hit_rate"])
            plotted = True
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_table(rows, f"Spill sweep over {name}: {len(requests)} requests, {stats['blocks']} blocks "
                          f"(unbounded-cache hit rate {stats['unbounded_hit_rate']:.1%})")
        print(f"{len(rows)} configurations in {elapsed:.1f} s on {device}; wrote {csv_path}"
              + (f" and {png_path}" if plotted else ""))
    corrupt = sum(r["corrupt_pages"] for r in rows)
    if corrupt:
        print(f"error: {corrupt} corrupt pages came back", file=sys.stderr)
        return 1
    if failed:
        print(f"error: {len(failed)} of {len(points)} configurations failed", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

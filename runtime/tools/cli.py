"""The ``kvtier`` command: demo, groups, replay, stress, bench."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from contextlib import contextmanager
from typing import Callable, Iterator

from tiers.config import DiskConfig, GpuConfig, HostConfig, StoreConfig
from tiers.errors import KvtierError, UsageError
from tiers.grouping import TIERS
from tiers.units import human_bytes

from ..config import load_config
from ..loop import run


def tune_gc() -> None:
    """Python's cyclic GC rescans every live object now and then: with torch
    imported a full pass takes ~60 ms, all of it on the event loop. Freeze
    what exists after imports (it is never garbage) and collect less often.
    Servers embedding kvtier should do the same (README)."""
    import gc
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)


# -- output helpers ----------------------------------------------------------------------------
def _console():
    from rich.console import Console
    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return Console()
    return Console(width=200)       # piped: rich would assume 80 columns and cut the cells


@contextmanager
def progress_bar(total: int, label: str, enabled: bool) -> Iterator:
    """A rich progress bar on a terminal; a no-op callback otherwise."""
    if not enabled or not sys.stderr.isatty():
        yield lambda n=1: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), transient=True, console=_err_console()) as p:
        task = p.add_task(label, total=total)
        yield lambda n=1: p.advance(task, n)


def _err_console():
    from rich.console import Console
    return Console(stderr=True)


def _table(title: str, columns: list[str], rows: list[list]) -> None:
    from rich.table import Table
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*[str(x) for x in r])
    _console().print(t)


# -- groups ----------------------------------------------------------------------------------------
def groups_report(cfg: StoreConfig) -> dict:
    out = {}
    lcs = cfg.layout.life_cycles
    for tier in TIERS:
        rows = []
        slots = cfg.slots_per_group(tier)
        for g, n in zip(cfg.layout.groups[tier], slots):
            rows.append({
                "index": g.index, "key": g.key_dict(), "life_cycles": [lcs[i].describe() for i in g.life_cycles],
                "layers": sorted(l for i in g.life_cycles for l in lcs[i].layer_ids),
                "slot_bytes": list(g.slot_sizes), "slots": n,
            })
        out[tier] = rows if cfg.tier_config(tier) is not None else []
    return out


def print_groups(report: dict) -> None:
    rows = []
    for tier, groups in report.items():
        for g in groups:
            key = _key_text(g["key"])
            lcs = "; ".join(f"#{lc['index']} {lc['reuse']}{' w' + str(lc['window_tokens']) if lc['window_tokens'] else ''}"
                            f" L{_ranges(lc['layers'])}" for lc in g["life_cycles"])
            rows.append([tier, g["index"], key, lcs, human_bytes(sum(g["slot_bytes"])), g["slots"]])
    _table("Pool groups", ["tier", "group", "key", "life cycles", "page", "slots"], rows)


def _key_text(key: dict) -> str:
    parts = [key["pool_reuse_policy"]]
    if "page_shape" in key:
        shape = key["page_shape"]
        sizes = sorted(set(shape))
        parts.append(f"{len(shape)}x{human_bytes(sizes[0])}" if len(sizes) == 1 else "+".join(human_bytes(x) for x in shape))
        parts.append(f"sparsity={key['sparsity']}" if key["sparsity"] else "dense")
    else:
        parts.append(f"cold {human_bytes(key['cold_page_bytes'])}")
    return " | ".join(parts)


def _ranges(ids: list[int]) -> str:
    out, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            out.append(f"{start}-{x}" if x != start else str(x))
            start = None
    return ",".join(out)


def cmd_groups(args) -> int:
    report = groups_report(load_config(args.config))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_groups(report)
    return 0


# -- replay --------------------------------------------------------------------------------------------
# replay's store flags and their defaults (the flags default to None, so that one given beside
# --config, which sets all of it, is refused instead of ignored)
_REPLAY_FLAGS = {"gpu_blocks": 1024, "host_blocks": 4096, "disk_blocks": 0, "page_bytes": 4096,
                 "tokens_per_block": 512, "device": "auto"}


def _flag_config(args, disk_dir: str | None) -> StoreConfig:
    from tiers.layers import LayerSpec
    v = {k: d if getattr(args, k, None) is None else getattr(args, k) for k, d in _REPLAY_FLAGS.items()}
    half = max(1, v["page_bytes"] // 2)
    layers = [LayerSpec(0, (("k", half), ("v", v["page_bytes"] - half)))]
    return StoreConfig(
        layers=layers, tokens_per_block=v["tokens_per_block"],
        gpu=GpuConfig(slots=v["gpu_blocks"], device=v["device"]),
        host=HostConfig(slots=v["host_blocks"]) if v["host_blocks"] else None,
        disk=DiskConfig(path=disk_dir, slots=v["disk_blocks"], fsync=False) if v["disk_blocks"] else None,
    )


def cmd_replay(args) -> int:
    from .replay import replay
    from ..store import Store
    from .trace import TraceStream, report_skipped
    # streamed as the replay goes: a multi-GB trace starts at once, in bounded memory
    requests = TraceStream(args.trace, args.limit, args.strict)

    async def main(cfg: StoreConfig) -> dict:
        async with Store.open(cfg) as store:
            try:
                with progress_bar(args.limit, "replay", not args.json) as advance:     # no total known before the end
                    res = await replay(store, requests, concurrency=args.concurrency,
                                       honor_timestamps=args.honor_timestamps, speed=args.speed,
                                       content=not args.no_content, verify=not args.no_content, progress=advance)
            finally:
                report_skipped(args.trace, requests.problems, requests.skipped)
            out = res.as_dict()
            out["skipped_lines"] = requests.skipped
            if store.write_throughs:                # clean copies are not moves: their own counts
                await store.drain()
                stats = store.stats()
                for key in ("write_through", "host_write_through"):
                    if stats[key]["on"]:
                        out[key] = stats[key]
            return out

    if args.config:
        given = [f"--{k.replace('_', '-')}" for k in _REPLAY_FLAGS if getattr(args, k) is not None]
        if given:
            raise UsageError(f"{', '.join(given)} cannot be combined with --config: the config sets the tiers, "
                             "page size, tokens per block and device")
    if args.speed != 1.0 and not args.honor_timestamps:
        raise UsageError("--speed needs --honor-timestamps (without it requests start back to back)")
    with tempfile.TemporaryDirectory(prefix="kvtier-replay-") as tmp:
        cfg = load_config(args.config) if args.config else _flag_config(args, tmp)
        out = run(main(cfg))
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print_replay(out)
    if not out["requests"]:
        print(f"kvtier: error: no request in {args.trace!r} could be read", file=sys.stderr)
        return 1
    failed = sum(out["errors"].values())
    if failed:      # a script must not take a replay that dropped requests for a clean one
        print(f"kvtier: error: {failed} of {out['requests']} requests failed: "
              + "; ".join(f"{k}: {out['error_examples'].get(k, '')}" for k in out["errors"]), file=sys.stderr)
    return 1 if out["corrupt_pages"] or failed else 0


def _copy_rows(tier: str, c: dict) -> list[list]:
    """Table rows of one tier's clean copies (``stats()["write_through"]`` and the like)."""
    return [[f"{tier} copies written", c["copied_pages"]], ["  demotions onto a copy", c["free_demotions"]],
            ["  copies kept on promotion", c["kept_on_promotion"]], ["  copies evicted", c["evicted_copies"]]]


def _print_replay(out: dict) -> None:
    rows = [["requests", out["requests"]], ["blocks", out["blocks"]], ["hit rate", f"{out['hit_rate']:.2%}"]]
    rows += [[f"  hits on {t}", f"{r:.2%}"] for t, r in out["hit_rate_by_tier"].items()]
    for tier, key in (("host", "host_write_through"), ("disk", "write_through")):
        wt = out.get(key)
        if wt:
            rows += _copy_rows(tier, wt)
    rows += [["blocks/s", f"{out['blocks_per_s']:.0f}"], ["cached pages verified", out["verified_pages"]],
             ["pages corrupt", out["corrupt_pages"]],
             ["loop lag p50 / p99 / max", f"{out['loop_lag_ms']['p50']} / {out['loop_lag_ms']['p99']} / "
                                          f"{out['loop_lag_ms']['max']} ms"]]
    if out.get("errors"):
        examples = out.get("error_examples", {})
        rows.append(["errors", "; ".join(f"{k}: {v}" + (f" (first: {examples[k]})" if k in examples else "")
                                         for k, v in out["errors"].items())])
    _table("Replay", ["", "value"], rows)
    _print_moves(out["moved"])


def _print_moves(moved: dict) -> None:
    rows = [[d, m["pages"], human_bytes(m["bytes"]), m["batches"], f"{m['bandwidth_gbps']:.2f}", m["failures"]]
            for d, m in moved.items()]
    if not rows:                        # an empty table is a header alone
        _console().print("Moves: none (every page stayed in its tier)")
        return
    _table("Moves", ["direction", "pages", "bytes", "batches", "GB/s", "failed"], rows)


# -- demo -------------------------------------------------------------------------------------------------
def cmd_demo(args) -> int:
    from .demo import run_demo
    out = run(run_demo(args.requests, args.json, args.concurrency))
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print_replay(out["replay"])
        print_groups(out["groups"])
    return 1 if out["replay"]["corrupt_pages"] else 0


# -- stress / bench ------------------------------------------------------------------------------------------
def cmd_stress(args) -> int:
    from .stress import run_stress
    out = run(run_stress(ops=args.ops, seed=args.seed, concurrency=args.concurrency, faults=args.faults,
                         restarts=args.restarts, quiet=args.json, write=args.write, host_write=args.host_write))
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        rows = []
        for k, v in out.items():
            if k == "clean_copies":
                continue
            if isinstance(v, dict):         # errors_by_type, scrub: a row per entry, not a Python dict
                rows += [[f"{k}: {name}", n] for name, n in v.items()] or [[k, "none"]]
            else:
                rows.append([k, v])
        for tier, c in out["clean_copies"].items():
            rows += _copy_rows(tier, c)
        _table("Stress", ["", "value"], rows)
    return 0 if out["corrupt"] == 0 and out["lost"] == 0 and out["leaked_slots"] == 0 else 1


def cmd_bench(args) -> int:
    from .bench import print_bench, run_bench
    out = run_bench(quick=args.quick, quiet=args.json, trace=args.trace, directory=args.dir)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print_bench(out)
    return 0


def at_least(least: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``least``."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {n}")
        return n
    return parse


def _speed(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(x) or x <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return x


def _directory(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return text


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("kvtier")
    except Exception:           # noqa: BLE001 - a source tree that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier", description="Tiered KV-cache page runtime")
    p.add_argument("--version", action="version", version=f"kvtier {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, summary: str) -> argparse.ArgumentParser:
        """A subcommand whose summary is its line in ``kvtier --help`` and the head of its own."""
        return sub.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".")

    d = command("demo", "replay a bundled trace slice with real pages through all three tiers")
    d.add_argument("--requests", type=at_least(1), default=300, help="requests replayed (default 300; the bundled slice has 393)")
    d.add_argument("--concurrency", type=at_least(1), default=4, help="requests in flight (default 4)")
    d.add_argument("--json", action="store_true", help="print the result as JSON")
    d.set_defaults(func=cmd_demo)

    g = command("groups", "show the pool groups a config produces")
    g.add_argument("config", help="TOML config")
    g.add_argument("--json", action="store_true", help="print the groups as JSON")
    g.set_defaults(func=cmd_groups)

    r = command("replay", "replay a Mooncake-format trace")
    r.add_argument("trace", help="Mooncake-format JSONL trace, plain or gzipped")
    r.add_argument("--config", help="TOML config (else the --*-blocks flags)")
    r.add_argument("--gpu-blocks", type=at_least(1), help="GPU slots (default 1024)")
    r.add_argument("--host-blocks", type=at_least(0), help="host slots, 0 for none (default 4096)")
    r.add_argument("--disk-blocks", type=at_least(0),
                   help="disk slots in a temporary directory, fsync off (default 0: no disk tier)")
    r.add_argument("--page-bytes", type=at_least(2), help="bytes per page (default 4096)")
    r.add_argument("--tokens-per-block", type=at_least(1),
                   help="tokens per block, for the key format only: each trace hash_id is one block (default 512)")
    r.add_argument("--device", help="auto, cpu, cuda or cuda:N (default auto)")
    r.add_argument("--limit", type=at_least(1), help="replay only the first N requests")
    r.add_argument("--concurrency", type=at_least(1), default=1, help="requests in flight (default 1)")
    r.add_argument("--honor-timestamps", action="store_true", help="start each request at its trace time")
    r.add_argument("--speed", type=_speed, default=1.0,
                   help="with --honor-timestamps: replay this many times faster than the trace (default 1)")
    r.add_argument("--strict", action="store_true", help="a malformed line is fatal")
    r.add_argument("--no-content", action="store_true",
                   help="metadata only: no page bytes written or checked (much faster with large pages)")
    r.add_argument("--json", action="store_true", help="print the result as JSON")
    r.set_defaults(func=cmd_replay)

    s = command("stress", "random concurrent sequences under memory pressure, every page verified")
    s.add_argument("--ops", type=at_least(1), default=2000, help="sequence operations in all (default 2000)")
    s.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    s.add_argument("--concurrency", type=at_least(1), default=8, help="workers at once (default 8)")
    s.add_argument("--restarts", type=at_least(0), default=2,
                   help="times the store is closed and reopened on the same directory (default 2)")
    s.add_argument("--faults", action="store_true",
                   help="inject move failures, disk EIO and cancelled acquires (warnings on stderr are expected)")
    s.add_argument("--write", choices=("back", "through"), default="back",
                   help="the disk tier's write policy (through: clean copies written in the background)")
    s.add_argument("--host-write", choices=("back", "through"), default="back",
                   help="the host tier's write policy (through: clean copies of GPU pages in host memory); a tier "
                        "that writes through gets three times the slots above it")
    s.add_argument("--json", action="store_true", help="print the result as JSON")
    s.set_defaults(func=cmd_stress)

    b = command("bench", "benchmarks as ratios against raw limits measured in the same run")
    b.add_argument("--quick", action="store_true", help="one page size and a trace slice (well under a minute)")
    b.add_argument("--trace", help="trace for the control-plane replay (default: the conversation trace "
                                   "when ../shared/traces is beside the checkout, else the bundled slice)")
    b.add_argument("--dir", type=_directory, help="where to put the disk files (default: the system temp dir)")
    b.add_argument("--json", action="store_true", help="print the rows as JSON")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tune_gc()
    try:
        return args.func(args)
    except KvtierError as exc:
        print(f"kvtier: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader left (``kvtier demo --json | head``): no traceback, and none again when
        # Python flushes stdout at exit (the documented way: stdout pointed at devnull)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())

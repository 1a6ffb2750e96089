#!/usr/bin/env python3
"""Control-plane benchmark: replay a trace metadata-first (pages of a few KiB)
through the full store (GPU, host and disk tiers) and through the bare LRU
prefix cache, in one run, and print blocks/s and their ratio. Also printed,
two bounds that are not kvtier: the lean bound, the same tiered LRU with
only its bookkeeping (a Python record per block, no bytes, no awaits), and
the movement floor, the blocks/s the same page moves would allow at the raw
copy and page-cache I/O speeds measured in this run, copies and disk
overlapped (bookkeeping aside).

Then the native core's rows (runtime.tools.bench_core): GPU-only replays,
three tiers with fsync on and their movement floor, metadata bytes per
indexed page, the loop held by one 4096-block request, concurrency 32
against 1, reopening a disk tier of a million pages, KV events on against
off, disk write-through against write-back, and the disk tier's spills
beside a thread running Python against alone (``--no-core`` skips them,
``--quick`` shrinks them). README.md's "Reading the benchmark numbers"
explains each row; there ``store``, ``lean`` and ``floor`` below are the
``replay``, ``replay lean bound`` and ``replay movement floor`` rows of
``kvtier bench``.

    python scripts/bench_runtime.py [--trace PATH] [--limit N] [--quick] [--no-core] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from runtime.tools.bench import bench_replay, default_trace
from runtime.tools.bench_core import control_plane_rows
from runtime.tools.trace import read_trace
from runtime.tools.cli import tune_gc
from runtime.loop import run
from tiers.errors import KvtierError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=default_trace(),
                   help="a Mooncake-format trace (default: ../shared/traces/conversation_trace.jsonl, "
                        "else the bundled slice)")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--json", action="store_true", help="the rows as JSON")
    p.add_argument("--quick", action="store_true", help="smaller core rows (100k-page reopen, 128 Ki pages)")
    p.add_argument("--no-core", action="store_true", help="only the three-tier replay")
    args = p.parse_args(argv)
    tune_gc()
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-runtime-") as tmp:
        try:
            row = run(bench_replay(args.trace, args.limit, tmp))
            core_rows = [] if args.no_core else run(control_plane_rows(
                read_trace(args.trace, args.limit)[0], tempfile.mkdtemp(dir=tmp), quick=args.quick))
        except KvtierError as exc:
            print(f"bench_runtime: {exc}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps({"replay": row, "core": core_rows}, indent=2))
    else:
        print(f"trace      {os.path.basename(args.trace)}")
        print(f"store      {row['value']:>12,} blocks/s   hit rate {row['hit_rate']:.2%}")
        print(f"bare LRU   {row['baseline']:>12,} blocks/s   hit rate {row['oracle_hit_rate']:.2%}")
        print(f"ratio      {row['ratio']:.4f}  (store / bare)")
        print(f"lean       {row['lean_bound']:>12,} blocks/s   the same tiered LRU, one Python record per block, "
              f"no bytes, no awaits")
        print(f"           {row['lean_ratio']:.4f}  (lean / bare)    {row['ratio_to_lean']:.3f}  (store / lean)")
        if row["movement_floor"] is None:
            print("floor      none: nothing moved between tiers, or a raw limit could not be measured")
        else:
            print(f"floor      {row['movement_floor']:>12,} blocks/s   the same page moves at raw copy and "
                  f"page-cache I/O speed, overlapped, no bookkeeping")
            print(f"           {row['floor_ratio']:.4f}  (floor / bare)   {row['ratio_to_floor']:.3f}  (store / floor)")
        width = max([62] + [len(r["bench"]) for r in core_rows])
        for r in core_rows:
            ratio = "" if r["ratio"] is None else \
                f"ratio {r['ratio']:.4g} to {r['baseline']:,} {r['unit']} ({r['baseline_is']})"
            extra = r["baseline_is"] if r["ratio"] is None else ratio
            print(f"{r['bench']:<{width}} {r['value']:>12,} {r['unit']:<9} {extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

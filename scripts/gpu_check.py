#!/usr/bin/env python3
"""The CUDA path in one go, for a machine with a GPU (about 3 minutes on an
H200):

1. the whole test suite with the GPU tier on ``cuda`` (torch.cuda streams
   and events, pinned host pools), bounded so that a hang still leaves a
   table;
2. the migration benchmark: pages moved GPU<->host by the engine against one
   plain ``cudaMemcpyAsync`` (a non_blocking tensor copy between device memory
   and pinned host memory) of the same bytes, and disk spill/recall against
   plain sequential file I/O;

and prints a short table last. Without CUDA it says so and exits 0.

    python scripts/gpu_check.py
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS_TIMEOUT = 300        # the suite took 140 s on an H200


def main(argv: list[str] | None = None) -> int:
    import argparse
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check")
        return 0
    name = torch.cuda.get_device_name(0)
    t0 = time.perf_counter()
    env = dict(os.environ, KVTIER_TEST_DEVICE="cuda")
    try:      # bounded, so a hang on the device still leaves time for the benchmark and the table
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-o", "faulthandler_timeout=60", "tests"],
                               cwd=ROOT, env=env, timeout=TESTS_TIMEOUT)
        tests_rc = tests.returncode
    except subprocess.TimeoutExpired:
        print(f"gpu_check: the CUDA tests did not finish in {TESTS_TIMEOUT} s (see the faulthandler dumps above)")
        tests_rc = 124
    test_secs = time.perf_counter() - t0

    from runtime.tools.bench import bench_moves
    from runtime.loop import run
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtier-gpu-check-") as tmp:
        for page, n in ((64 << 10, 4096), (256 << 10, 2048), (2 << 20, 512)):
            rows += run(bench_moves(page, n, tempfile.mkdtemp(dir=tmp)))
        rows += run(bench_moves(64 << 10, 4096, tempfile.mkdtemp(dir=tmp), scattered=True))
    print()
    print(f"kvtier gpu_check on {name}: tests {'passed' if tests_rc == 0 else 'FAILED'} "
          f"in {test_secs:.0f} s")
    print(f"{'bench':<34} {'GB/s':>8} {'raw GB/s':>9} {'ratio':>6}  raw limit")
    for r in rows:
        if r["baseline"] is None:
            print(f"{r['bench']:<34} {r['value']:>8} {'':>9} {'':>6}  {r['unit']}")
        else:
            print(f"{r['bench']:<34} {r['value']:>8.2f} {r['baseline']:>9.2f} {r['ratio']:>6.2f}  "
                  f"{r['baseline_is'].replace('cuda tensor copy', 'cudaMemcpyAsync (pinned)')}")
    return tests_rc


if __name__ == "__main__":
    sys.exit(main())

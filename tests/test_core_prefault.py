"""A new core writes its page and block tables up front (``PageTable::prefault``) for its GPU and
host tiers' pages, at most ``prefault_pages``, so that the requests filling them take no page
faults: that memory is resident when it is built, not as the store fills. The disk tier's pages
(many more, filling slowly) are left to grow."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from runtime.core import Core

FULL = (False, 0, 0, 0)
PER_PAGE = 40 + 44 + 4      # a Page, a Block, the block's page of its one life cycle


def gpu_core(slots: int, **kw) -> Core:
    return Core(4, [FULL], [[0], [-1], [-1]], [[slots], [], []], **kw)


MEASURE = """
import json, os, sys
from runtime.core import Core
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
n, out, keep = int(sys.argv[1]), {}, []
for name, kw in (("lazy", {"prefault_pages": 0}), ("half", {"prefault_pages": n // 2}), ("eager", {}),
                 ("disk", {})):
    before = rss()
    if name == "disk":          # n slots on the disk, 64 on the GPU
        keep.append(Core(4, [(False, 0, 0, 0)], [[0], [-1], [0]], [[64], [], [n]], **kw))
    else:
        keep.append(Core(4, [(False, 0, 0, 0)], [[0], [-1], [-1]], [[n], [], []], **kw))
    out[name] = rss() - before
print(json.dumps(out))
"""


def test_the_tables_are_written_when_the_core_is_built_and_only_as_far_as_asked():
    """Measured in a fresh interpreter: in this one, memory freed by earlier tests may be
    reused without growing the RSS."""
    n = 1 << 19
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    got = json.loads(subprocess.run([sys.executable, "-c", MEASURE, str(n)], check=True, capture_output=True,
                                    text=True, cwd=root).stdout)
    assert got["eager"] - got["lazy"] >= 0.9 * n * PER_PAGE             # the default: up to a million pages
    assert 0.4 * n * PER_PAGE <= got["half"] - got["lazy"] <= 0.65 * n * PER_PAGE     # 2 MiB pages round up
    assert got["disk"] - got["lazy"] <= 0.25 * n * PER_PAGE              # the disk's pages: as they come


def test_a_prefaulted_core_fills_and_recycles_its_tables_as_any():
    c = gpu_core(64, prefault_pages=1 << 30)                # more than its slots: capped, no error
    for round_ in range(3):
        sids = []
        for i in range(8):
            keys = [round_ * 1000 + i * 8 + k + 1 for k in range(8)]
            sid, matched, _ = c.open(keys, 35)
            assert matched == 0 and c.extend_now(sid, 8) is not None and c.commit(sid, 8) == -1
            sids.append(sid)
        c.check()
        for sid in sids:
            c.close(sid)
        assert c.free(0, 0) == 0                           # all 64 slots hold committed pages
        _, freed = c.drop_victims(0, c.pick_victims(0, 0, 64, 0)[0])
        c.give_back(0, 0, freed)                            # dropped: the next round reuses every id
        assert c.free(0, 0) == 64
        c.check()

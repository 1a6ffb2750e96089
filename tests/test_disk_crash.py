"""A real crash: a child process writes and frees pages in a loop and is killed with SIGKILL mid-way.

After every ``write()`` returns the child prints the slots and keys it wrote (and after every ``free()``
the slots it freed), flushing stdout. Page bytes are a function of the block key, so whatever the parent
recovers can be checked on its own. The parent then reopens the directory and checks:

- every recovered page reads back exactly the bytes of its key, with the record the child gave it;
- every page whose ``write()`` had returned (and that was not freed afterwards) is recovered, with
  that key; a page freed shortly before the kill may come back (frees are journaled lazily), and a
  write that was in flight may or may not be there - but never with wrong bytes.

Two rounds run on the same directory, the second child continuing from what the first left.

With deferred writes (``durable=False``, group commit) the child prints "D" after each ``flush()``: then
every page live at the last "D" and not freed or rewritten since is recovered; what came after may or
may not be, never with wrong bytes.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tiers.disk import DiskTier

from helpers import run_until_killed
FP = {"test": "crash"}
GROUPS = [(65536, 384), (12288, 256)]

CHILD = r"""
import sys
import numpy as np
import torch
from tiers.disk import DiskTier, PageRecord

def page_bytes(key, width):
    return np.random.default_rng(key).integers(0, 256, width, dtype=np.uint8)

path, seed, durable = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
groups = [(65536, 384), (12288, 256)]
tier = DiskTier.open(path, {"test": "crash"}, groups)
live = [{}, {}]
key = 1
for p in tier.recovered:
    live[p.group][p.slot] = p.record.key
    key = max(key, p.record.key + 1)
print("S", key, flush=True)
rng = np.random.default_rng(seed)
while True:
    g = int(rng.integers(0, 2))
    width, nslots = groups[g]
    free = [s for s in range(nslots) if s not in live[g]]
    if live[g] and (len(free) < 32 or rng.random() < 0.25):
        victims = rng.choice(sorted(live[g]), size=min(len(live[g]), int(rng.integers(1, 25))), replace=False)
        victims = [int(s) for s in victims]
        tier.free(g, victims)
        for s in victims:
            del live[g][s]
        print("F", g, *victims, flush=True)
        continue
    slots = [int(s) for s in rng.choice(free, size=int(rng.integers(1, 33)), replace=False)]
    keys = list(range(key, key + len(slots)))
    key += len(slots)
    rows = torch.from_numpy(np.stack([page_bytes(k, width) for k in keys]))
    tier.write(g, slots, rows, [PageRecord(k, k - 1, k % 100, g) for k in keys], durable=durable)
    for s, k in zip(slots, keys):
        live[g][s] = k
    print("W", g, *[f"{s}:{k}" for s, k in zip(slots, keys)], flush=True)
    if not durable and key % 5 == 0:
        tier.flush()
        print("D", flush=True)
"""


def page_bytes(key: int, width: int) -> np.ndarray:
    return np.random.default_rng(key).integers(0, 256, width, dtype=np.uint8)


def run_and_kill(path: str, seed: int, writes_before_kill: int, delay: float = 0.0,
                 durable: bool = True) -> list[str]:
    """Run the child until it has reported ``writes_before_kill`` writes, wait ``delay`` s, SIGKILL it
    (the next write() is already under way); returns the complete lines it printed."""
    writes = 0

    def enough(lines: list[str]) -> bool:
        nonlocal writes
        writes += bool(lines) and lines[-1].startswith("W")     # called once per line read
        return writes >= writes_before_kill
    return run_until_killed(CHILD, [path, str(seed), "1" if durable else "0"], enough, delay)[0]


def expectations(lines: list[str], state: list[dict]) -> tuple[list[dict], list[dict], int]:
    """Replay the child's report over ``state`` (slot -> key per group): (must-have, the keys a slot
    freed since may still show, top key)."""
    must = [dict(d) for d in state]
    maybe: list[dict] = [{}, {}]
    top = 0
    for line in lines:
        parts = line.split()
        if parts[0] == "W":
            g = int(parts[1])
            for item in parts[2:]:
                s, k = map(int, item.split(":"))
                must[g][s] = k
                maybe[g].pop(s, None)
                top = max(top, k)
        elif parts[0] == "F":
            g = int(parts[1])
            for s in map(int, parts[2:]):
                maybe[g][s] = {must[g].pop(s)}
    return must, maybe, top


def deferred_expectations(lines: list[str], state: list[dict]) -> tuple[list[dict], list[dict], int]:
    """As ``expectations``, for deferred writes: what counts is the state at the last "D" (flush);
    a slot written or freed after it may hold any page the child put there since, or its last
    flushed one."""
    last_d = max((i for i, line in enumerate(lines) if line.startswith("D")), default=-1)
    must, maybe, top = expectations(lines[:last_d + 1], state)
    for line in lines[last_d + 1:]:
        parts = line.split()
        if parts[0] in ("W", "F"):
            g = int(parts[1])
            for item in parts[2:]:
                s = int(item.split(":")[0])
                allowed = maybe[g].setdefault(s, set())
                if s in must[g]:
                    allowed.add(must[g].pop(s))
                if parts[0] == "W":
                    k = int(item.split(":")[1])
                    allowed.add(k)
                    top = max(top, k)
    return must, maybe, top


def check_recovery(path: str, state: list[dict], lines: list[str], durable: bool = True) -> list[dict]:
    must, maybe, top = (expectations if durable else deferred_expectations)(lines, state)
    tier = DiskTier.open(path, FP, GROUPS)
    try:
        assert tier.discarded == []                     # data is made durable before its record
        got: list[dict] = [{}, {}]
        for p in tier.recovered:
            got[p.group][p.slot] = p.record.key
            k = p.record.key
            assert (p.record.parent, p.record.depth, p.record.life_cycle) == (k - 1, k % 100, p.group)
        for g, (width, _) in enumerate(GROUPS):
            for s, k in must[g].items():                # every write that returned is there
                assert got[g].get(s) == k, (g, s, k, got[g].get(s))
            for s, k in got[g].items():
                if s not in must[g]:                    # freed just before the kill, or a write in flight
                    assert k in maybe[g].get(s, ()) or k > top, (g, s, k)
            slots = sorted(got[g])
            for a in range(0, len(slots), 64):          # every recovered page has its key's bytes
                part = slots[a:a + 64]
                out = torch.empty((len(part), width), dtype=torch.uint8)
                tier.read(g, part, out)
                for i, s in enumerate(part):
                    assert np.array_equal(out[i].numpy(), page_bytes(got[g][s], width)), (g, s)
        return got
    finally:
        tier.close()


@pytest.mark.parametrize("durable", [True, False], ids=["durable", "deferred"])
def test_sigkill_mid_write_loses_nothing_acknowledged(tmp_path, durable):
    path = str(tmp_path / "disk")
    state: list[dict] = [{}, {}]
    total = 0
    for seed, writes, delay in ((11, 70, 0.0), (12, 45, 0.003)):
        lines = run_and_kill(path, seed, writes, delay, durable)
        assert lines[0].startswith("S")
        assert durable or any(line.startswith("D") for line in lines)
        state = check_recovery(path, state, lines[1:], durable)
        total += sum(len(d) for d in state)
        assert sum(len(d) for d in state) > 0
    assert total > 100

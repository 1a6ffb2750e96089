"""The prefix index and the tiers under random request mixes (hypothesis,
stateful): sequences sharing prefixes open, acquire, extend, write, commit,
release and close in any order, under memory pressure that cascades pages
through host and disk, with failed moves and store restarts. After every step the store's
invariants hold; every match is a prefix some commit published; every page
an acquire brings back holds the bytes written for its key."""
from __future__ import annotations

import asyncio
import shutil
import tempfile

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from runtime import LayerSpec, OutOfPagesError, ReusePolicy, Store, TierIOError
from runtime.keys import hash_blocks
from runtime.pages import TIER_NAMES

from helpers import config, expected_block, read_block, two_life_cycles, write_blocks

TPB = 2
MAX_BLOCKS = 5
KV = (("k", 64), ("v", 64))
# name -> (layers, pages per block in the busiest pool group)
LAYOUTS = {
    "required": (None, 1),
    "sink_required_only": (two_life_cycles(ReusePolicy.SINK_REQUIRED_ONLY, window=2 * TPB, sinks=TPB), 2),
    "required_window": (two_life_cycles(ReusePolicy.REQUIRED, window=2 * TPB, sinks=TPB), 2),
    "optional_and_private": ([LayerSpec(0, KV), LayerSpec(1, KV, window_tokens=2 * TPB, reuse=ReusePolicy.OPTIONAL),
                              LayerSpec(2, KV, reuse=ReusePolicy.PRIVATE)], 1),     # three pool groups
}
PRIORITIES = st.sampled_from([0, 35, 90])


def tokens_for(family: int, branch_at: int, branch: int, n_blocks: int) -> list[int]:
    """Requests of one family share their first ``branch_at`` blocks."""
    shared = [family * 10_000 + i for i in range(branch_at * TPB)]
    own = [family * 10_000 + 1_000 * (branch + 1) + i for i in range(branch_at * TPB, n_blocks * TPB)]
    return shared + own


class StoreMachine(RuleBasedStateMachine):
    @initialize(layout=st.sampled_from(sorted(LAYOUTS)))
    def setup(self, layout):
        self.loop = asyncio.new_event_loop()
        self.dir = tempfile.mkdtemp(prefix="kvtier-model-")
        layers, per = LAYOUTS[layout]
        # small tiers: a few requests fill the GPU, and pages cascade to host and disk
        self.cfg = config(gpu=6 * per, host=6 * per, disk=10 * per, disk_dir=self.dir, tpb=TPB, layers=layers,
                          persist_on_close=True)
        self.store = self.run(Store.open(self.cfg).__aenter__())
        self.seqs: list = []
        self.published: set = set()        # (position, key) of every block a commit published
        self.verified = 0
        self.armed: set[tuple[int, int]] = set()     # (source tier, destination tier) whose next move fails
        self.store.engine.fault = self._fault

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def _fault(self, src: int, dst: int) -> None:
        if (src, dst) in self.armed:
            self.armed.discard((src, dst))
            raise TierIOError(f"injected: {TIER_NAMES[src]}->{TIER_NAMES[dst]}")


    # -- requests --------------------------------------------------------------------------
    requests = dict(family=st.integers(0, 1), branch_at=st.integers(0, MAX_BLOCKS), branch=st.integers(0, 2),
                    n_blocks=st.integers(1, MAX_BLOCKS), priority=PRIORITIES)

    @rule(**requests)
    def request(self, family, branch_at, branch, n_blocks, priority):
        """A whole prefill, as an engine runs it; it pushes other pages down the tiers."""
        self.open(family, branch_at, branch, n_blocks, priority)
        seq = self.seqs[-1]
        try:
            self.run(seq.acquire())
            self._verify(seq)
            start = seq.num_blocks
            self.run(seq.extend(len(seq.keys) - start))
        except (OutOfPagesError, TierIOError):    # the other open sequences hold the pool; a move failed
            pass
        else:
            self._write_new(seq, start)
            seq.commit(seq.num_blocks)
            self.published.update((i, k) for i, k in enumerate(seq.keys[:seq.committed]))
        self.run(seq.close())
        self.seqs.remove(seq)

    @precondition(lambda self: len(self.seqs) < 3)
    @rule(**requests)
    def open(self, family, branch_at, branch, n_blocks, priority):
        tokens = tokens_for(family, min(branch_at, n_blocks), branch, n_blocks)
        seq = self.run(self.store.open_sequence(tokens=tokens, priority=priority))
        keys = hash_blocks(tokens, TPB, self.cfg.hash_salt)
        assert seq.keys == keys
        for i in range(seq.matched_blocks):      # a match is a prefix that some commit published
            assert (i, keys[i]) in self.published, f"block {i} matched but never committed there"
        assert sum(seq.matched_by_tier.values()) <= seq.matched_blocks
        self.seqs.append(seq)

    @precondition(lambda self: any(not s.acquired for s in self.seqs))
    @rule(data=st.data())
    def acquire(self, data):
        seq = data.draw(st.sampled_from([s for s in self.seqs if not s.acquired]))
        try:
            self.run(seq.acquire())
        except (OutOfPagesError, TierIOError):
            assert not seq.acquired                # the pool is locked, or a move failed: nothing locked
            return
        self._verify(seq)

    @precondition(lambda self: any(s.acquired and s.num_blocks < len(s.keys) for s in self.seqs))
    @rule(data=st.data())
    def extend_and_write(self, data):
        seq = data.draw(st.sampled_from([s for s in self.seqs if s.acquired and s.num_blocks < len(s.keys)]))
        start = seq.num_blocks
        try:
            self.run(seq.extend(len(seq.keys) - start))
        except (OutOfPagesError, TierIOError):
            assert seq.num_blocks == start
            return
        self._write_new(seq, start)

    def _write_new(self, seq, start: int) -> None:
        """Write blocks ``start`` on and those the store says to recompute, as an engine must."""
        redo = {b for lc in self.store.lcs for b in seq.recompute_blocks(lc.layers[0].id)}
        write_blocks(self.store, seq, sorted(set(range(start, len(seq.keys))) | redo))

    @precondition(lambda self: any(s.acquired and s.committed == s.num_blocks == len(s.keys) < MAX_BLOCKS + 2
                                   for s in self.seqs))
    @rule(data=st.data())
    def decode(self, data):
        """One generated block: append its tokens, extend, write, commit (the decode loop's step)."""
        seq = data.draw(st.sampled_from([s for s in self.seqs
                                         if s.acquired and s.committed == s.num_blocks == len(s.keys) < MAX_BLOCKS + 2]))
        seq.append(tokens=[seq.num_tokens * 7 + i for i in range(TPB)])
        start = seq.num_blocks
        try:
            self.run(seq.extend(1))
        except (OutOfPagesError, TierIOError):
            assert seq.num_blocks == start
            return
        write_blocks(self.store, seq, [start])
        seq.commit(seq.num_blocks)
        self.published.update((i, k) for i, k in enumerate(seq.keys[:seq.committed]))

    @precondition(lambda self: any(s.acquired and s.num_blocks > s.committed for s in self.seqs))
    @rule(data=st.data())
    def commit(self, data):
        seq = data.draw(st.sampled_from([s for s in self.seqs if s.acquired and s.num_blocks > s.committed]))
        seq.commit(seq.num_blocks)
        for i in range(seq.committed):
            self.published.add((i, seq.keys[i]))

    @precondition(lambda self: any(s.acquired for s in self.seqs))
    @rule(data=st.data())
    def release(self, data):
        seq = data.draw(st.sampled_from([s for s in self.seqs if s.acquired]))
        self.run(seq.release())

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def close(self, data):
        seq = data.draw(st.sampled_from(self.seqs))
        self.run(seq.close())
        self.seqs.remove(seq)

    @rule()
    def restart(self):
        """Close everything and reopen on the same disk directory: committed pages come back from disk."""
        for seq in self.seqs:
            self.run(seq.close())
        self.seqs = []
        self.run(self.store.close())
        self.store = self.run(Store.open(self.cfg).__aenter__())
        self.store.engine.fault = self._fault
        self.store.check_consistency()

    # -- checks ---------------------------------------------------------------------------------
    def _verify(self, seq):
        """Every page the acquire brought to the GPU for a matched block holds its key's bytes; a
        PRIVATE life cycle's pages are never shared, so a matched block must recompute them."""
        for lc in self.store.lcs:
            layer = lc.layers[0].id
            idx = seq.page_indices(layer)
            redo = set(seq.recompute_blocks(layer))
            if lc.reuse is ReusePolicy.PRIVATE:
                assert redo >= set(range(seq.matched_blocks)), "a PRIVATE page was served from the cache"
            for b in range(seq.matched_blocks):
                if idx[b] >= 0 and b not in redo:
                    got, want = read_block(self.store, seq, lc.index, b), expected_block(self.store, seq, lc.index, b)
                    assert bool((got == want).all()), f"block {b} (life cycle {lc.index}) came back wrong"
                    self.verified += 1

    @invariant()
    def consistent(self):
        if hasattr(self, "store"):
            self.run(self.store.drain())
            self.store.check_consistency()

    def teardown(self):
        if not hasattr(self, "store"):
            return
        try:
            for seq in self.seqs:
                self.run(seq.close())
            self.run(self.store.drain())
            self.store.check_consistency()
            gpu = self.store.stats()["tiers"]["gpu"]["groups"]
            assert all(g["locked"] == 0 and g["held"] == 0 for g in gpu)    # nothing left behind
            self.run(self.store.close())
        finally:
            self.loop.close()
            shutil.rmtree(self.dir, ignore_errors=True)


class FailingMovesMachine(StoreMachine):
    """The same, with moves failing: requests get the error and change nothing, pages stay where they were."""

    @precondition(lambda self: not self.armed)
    @rule(src=st.integers(0, 2), dst=st.integers(0, 2))
    def fail_next_move(self, src, dst):
        """The next move in that direction fails (a background demotion, a promotion, a spill)."""
        if src != dst:
            self.armed.add((src, dst))


for machine in (StoreMachine, FailingMovesMachine):
    machine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None, derandomize=True)
TestStoreMachine = StoreMachine.TestCase
TestFailingMovesMachine = FailingMovesMachine.TestCase

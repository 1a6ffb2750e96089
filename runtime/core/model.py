"""The pure-Python model of kvtier's native core.

``ModelCore`` has exactly the Python-visible API of ``runtime.core._core.Core``
(the same methods, arguments and results) and makes the same decisions with
plain Python objects: the same slots, stamps and clock, the same victims in the
same order, the same claim ids, fences, drops, disk frees and relabels, the
same counters. It is the reference the C++ is checked against
(tests/test_core_differential.py drives both through the same operations and
compares every result) and the readable statement of the policy: what the
core decides, in what order, and why.

The policy itself is the one the pure-Python Store made (runtime/store.py
before the core took over, at commit 62fb7e6, with runtime/pages.py,
runtime/eviction.py, tiers/slots.py and runtime/recovery.py); the core keeps
its decisions and adds flat ids. Where the ids show through they are
modelled too: page ids (``Pages``), sequence ids and claim ids are allocated
exactly as the core allocates them (free lists are stacks, the newest freed
id is reused first), so the two can be compared call by call.

Where the core deliberately differs from the old store, the model follows
the core:
- an allocator cannot ask whether a fence passed (no event objects here):
  fenced slots wait in their FIFO until the ready stack runs out, and keep
  their fence, which the next owner gets back;
- fences come back sorted and distinct, and most results are plain lists;
- late pages of equal stamp (only refilled holes, stamp 0) pop in page-id
  order, where the old queue popped them in push order;
- ``open`` refuses a priority outside 0..100 (the Store checked it before);
- a page refilled in an uncommitted row (fill_holes, after its page was
  found corrupt on disk) becomes its block's page when the block is
  committed (the old store published it without indexing it);
- recovery skips a record of a pool group that does not exist and discards
  one whose depth is negative or whose slot another record already took;
- clean copies (write-through to the host or the disk), which the old store
  never had: a published page may have a copy in each colder tier, chained
  warmest first (``copy_map``), made by ``take_copies``/``land_copies`` or
  kept when a cold page is promoted, taken over by a demotion
  (``swap_to_copies``), evicted alone.

Everything here is single-threaded bookkeeping; it does no I/O and never
waits, exactly like the core.
"""
from __future__ import annotations

import hashlib
from collections import deque
from typing import Iterable

import numpy as np

from tiers import journal
from tiers.layers import LifeCycle as _LayerLifeCycle
from tiers.policy import ReusePolicy

GPU, HOST, DISK = 0, 1, 2
WINDOW = 1024            # the disk sweep's first pass skips slots freed within this many frees, at most (allocator.hpp)
TIERS = 3
PRIORITIES = 101                      # 0..100
REQUIRED, SINK_REQUIRED_ONLY, OPTIONAL, PRIVATE = 0, 1, 2, 3
_REUSE = (ReusePolicy.REQUIRED, ReusePolicy.SINK_REQUIRED_ONLY, ReusePolicy.OPTIONAL, ReusePolicy.PRIVATE)
_INT32_MAX = (1 << 31) - 1
_INT32_MIN = -(1 << 31)

NOT_QUEUED, IN_ORDER, LATE = 0, 1, 2


COMMIT_PAST_BLOCKS = -2     # commit's answers for a count past the sequence's blocks, or keys
COMMIT_PAST_KEYS = -3
MAX_HOLDERS = 65535         # the core's 16-bit holder count: a page this shared is not matched again


class CoreError(RuntimeError):
    """A broken precondition or invariant (the core's ``CoreError``)."""


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise CoreError(what)


# -- keys ------------------------------------------------------------------------------------

def to_key(k: object) -> int | bytes:
    """A caller's block key in the core's form (keys.hpp). Ints must fit in
    signed 128 bits; bytes of 1..16 are kept, longer ones are digested to 16
    bytes (BLAKE2b-128), so both spellings of a long key meet in one block;
    b'' is reserved. An int and a bytes key never collide (different types)."""
    if isinstance(k, int) and not isinstance(k, bool):
        if not -(1 << 127) <= k < (1 << 127):
            raise ValueError("an int block key must fit in 128 bits (-2**127 <= key < 2**127)")
        return int(k)
    if isinstance(k, bytes):
        if not k:
            raise ValueError("block key b'' is reserved (the disk tier's mark for uncommitted pages)")
        if len(k) <= 16:
            return bytes(k)
        return hashlib.blake2b(k, digest_size=16).digest()
    raise TypeError("a block key must be an int or bytes")


def to_keys(keys: Iterable) -> list[int | bytes]:
    """A caller's keys: all ints or all bytes."""
    try:
        items = list(keys)
    except TypeError:
        raise TypeError("block keys must be a sequence") from None
    out = []
    for k in items:
        out.append(to_key(k))
        if len(out) > 1 and isinstance(out[-1], int) != isinstance(out[0], int):
            raise ValueError("block_keys mixes int and bytes keys")
    return out


def chain_block_keys(tokens: bytes, tokens_per_block: int, salt: bytes, parent: bytes) -> list[bytes]:
    """Chained BLAKE2b-128 keys of every full block of ``tokens`` (little-endian
    int64 bytes): ``key[i] = blake2b(key[i-1] || tokens of block i || salt)``."""
    if tokens_per_block == 0:
        raise ValueError("tokens_per_block must be positive")
    if len(tokens) % 8:
        raise ValueError("tokens must be whole little-endian int64s (8 bytes each)")
    width = tokens_per_block * 8
    n_blocks = (len(tokens) // 8) // tokens_per_block
    keys, prev = [], bytes(parent)
    for i in range(n_blocks):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(tokens[i * width:(i + 1) * width])
        h.update(salt)
        prev = h.digest()
        keys.append(prev)
    return keys


# -- page lists --------------------------------------------------------------------------------

class Pages:
    """An opaque array of page ids, passed back to the core (the core's ``Pages``)."""

    __slots__ = ("_ids",)

    def __init__(self, ids: Iterable[int] = ()) -> None:
        self._ids = [int(i) for i in ids]

    def __len__(self) -> int:
        return len(self._ids)

    def __bool__(self) -> bool:
        return bool(self._ids)

    def tolist(self) -> list[int]:
        return list(self._ids)

    def slice(self, a: int, b: int) -> "Pages":
        if a < 0 or b < 0:
            raise TypeError("slice bounds are unsigned")
        n = len(self._ids)
        a = min(a, n)
        b = min(max(a, b), n)
        return Pages(self._ids[a:b])

    def __repr__(self) -> str:
        return f"Pages({self._ids!r})"


def _page_ids(pages: object) -> list[int]:
    if not isinstance(pages, Pages):
        raise TypeError(f"expected Pages, got {type(pages).__name__}")
    return pages._ids


# -- life cycles -------------------------------------------------------------------------------

class LifeCycle:
    """A life cycle as the core takes it, ``(ssm, window, sinks, reuse)``
    (window 0: full attention; reuse 0..3 as REQUIRED, SINK_REQUIRED_ONLY,
    OPTIONAL, PRIVATE), answering with tiers.layers.LifeCycle's arithmetic."""

    __slots__ = ("ssm", "window", "sinks", "reuse", "_lc")

    def __init__(self, index: int, ssm: bool, window: int, sinks: int, reuse: int) -> None:
        self.ssm, self.window, self.sinks, self.reuse = bool(ssm), int(window), int(sinks), int(reuse)
        self._lc = _LayerLifeCycle(index, "ssm" if ssm else "attention", window or None, sinks, _REUSE[reuse],
                                   None, "", "float16", ())

    def needed_blocks(self, h: int, tpb: int) -> list[int]:
        """Blocks whose pages the next token (position h) reads, ascending."""
        return self._lc.needed_blocks(h, tpb)

    def required_blocks(self, h: int, tpb: int) -> list[int]:
        """Blocks that must be present for a prefix of h tokens to match."""
        return self._lc.required_blocks(h, tpb)

    def prefix_critical(self, block: int, tpb: int) -> bool:
        """True when every longer prefix needs this block's page."""
        return self._lc.is_prefix_critical(block, tpb)

    def limits_match(self) -> bool:
        """Only these can make a match shorter than the indexed path (a
        full-attention REQUIRED page is prefix-critical: always present)."""
        return self.reuse == REQUIRED and (self.window != 0 or self.ssm)


# -- slot allocation ----------------------------------------------------------------------------

class SlotAllocator:
    """One (tier, pool group): all-or-nothing.

    A freed slot keeps the fence (event id, 0: none) of the last copy that
    touched it; allocation leaves it in place: its new owner waits on it.

    Memory tiers (a stack): ``ready``, the slots freed without a fence, the
    last freed first; then ``fresh``, the slots never handed out since the
    pool was built (or recovered), lowest first; then ``fenced``, oldest
    first (the core cannot ask an event whether it passed: no refresh).

    The disk (``sweep``): free slots in address order from ``cursor``,
    wrapping, so that a spill's pages land in runs of adjacent slots. A
    first pass skips slots freed within the last ``window`` frees (half the
    free slots, at most WINDOW), whose free may not be journaled yet; if the
    rest falls short, those it skipped go, in its order. Past the extent (1 + the
    highest slot handed out) the sweep wraps to slot 0 while an eighth of
    the extent is free, else grows it. See allocator.hpp."""

    __slots__ = ("capacity", "sweep", "ready", "fresh", "fenced", "free_mark", "fence", "freed_at", "frees",
                 "n_free", "cursor", "extent")

    def __init__(self, capacity: int, sweep: bool = False) -> None:
        self.capacity = capacity
        self.sweep = sweep
        self.ready: list[int] = []
        self.fresh = [] if sweep else list(range(capacity - 1, -1, -1))     # slot 0 next (at the end)
        self.fenced: deque[int] = deque()
        self.free_mark = bytearray(b"\x01" * capacity)
        self.fence = [0] * capacity
        self.freed_at = [0] * capacity if sweep else []
        self.frees = WINDOW             # from WINDOW: a never-used slot counts as freed long since
        self.n_free = capacity
        self.cursor = 0
        self.extent = 0

    @property
    def free(self) -> int:
        return self.n_free if self.sweep else len(self.ready) + len(self.fresh) + len(self.fenced)

    @property
    def used(self) -> int:
        return self.capacity - self.free

    def is_free(self, s: int) -> bool:
        return bool(self.free_mark[s])

    def allocate(self, n: int) -> list[int] | None:
        if n < 0 or n > self.free:
            return None
        out: list[int] = []
        if self.sweep:
            self._sweep(n, out)
            return out
        for _ in range(n):
            s = self.ready.pop() if self.ready else self.fresh.pop() if self.fresh else self.fenced.popleft()
            self.free_mark[s] = 0
            out.append(s)
        return out

    def _sweep(self, n: int, out: list[int]) -> None:
        window = min(WINDOW, self.n_free // 2)
        start = self.cursor
        wrap_first = self.n_free - (self.capacity - self.extent) >= max(WINDOW, self.extent // 8)
        skipped: list[int] = []
        need = self._take(start, self.extent, n, window, out, skipped)
        if wrap_first:
            need = self._take(0, start, need, window, out, skipped)
            need = self._take(self.extent, self.capacity, need, 0, out, skipped)
        else:
            need = self._take(self.extent, self.capacity, need, 0, out, skipped)
            need = self._take(0, start, need, window, out, skipped)
        for s in skipped[:need]:            # short: the first pass saw every free slot
            self._hand_out(s, out)
        self.n_free -= n

    def _take(self, lo: int, hi: int, need: int, window: int, out: list[int], skipped: list[int]) -> int:
        s = lo
        while need > 0 and s < hi:
            s = self.free_mark.find(1, s, hi)
            if s < 0:
                break
            if window == 0 or (self.frees - self.freed_at[s]) % (1 << 32) >= window:
                self._hand_out(s, out)
                need -= 1
            else:
                skipped.append(s)
            s += 1
        return need

    def _hand_out(self, s: int, out: list[int]) -> None:
        self.free_mark[s] = 0
        out.append(s)
        self.cursor = s + 1 if s + 1 < self.capacity else 0
        self.extent = max(self.extent, s + 1)

    def release(self, slots: list[int], fence: int) -> None:
        """Nothing changes if a slot is out of range, already free or repeated."""
        marked = []
        for s in slots:
            if not 0 <= s < self.capacity or self.free_mark[s]:
                for m in marked:
                    self.free_mark[m] = 0
                raise ValueError(f"slot {s} released twice or never allocated")
            self.free_mark[s] = 1
            marked.append(s)
        for s in slots:
            self.fence[s] = fence
            if self.sweep:
                self.frees = (self.frees + 1) % (1 << 32)
                self.freed_at[s] = self.frees
            else:
                (self.ready if fence == 0 else self.fenced).append(s)
        if self.sweep:
            self.n_free += len(slots)

    def give_back(self, s: int) -> None:
        """A slot taken and never used goes back with the fence it carries."""
        self.release([s], self.fence[s])

    def reset_used(self, keep: bytearray) -> None:
        """Recovery: exactly the slots in ``keep`` are in use; the lowest free slots go first."""
        self.ready = []
        self.fenced = deque()
        self.n_free = 0
        self.extent = 0
        self.cursor = 0
        for s in range(self.capacity):
            self.free_mark[s] = 0 if keep[s] else 1
            self.fence[s] = 0
            if keep[s]:
                self.extent = s + 1
            else:
                self.n_free += 1
                if self.sweep:
                    self.freed_at[s] = (self.frees - WINDOW) % (1 << 32)
        self.fresh = [] if self.sweep else [s for s in range(self.capacity - 1, -1, -1) if not keep[s]]


# -- records -------------------------------------------------------------------------------------

class Page:
    """One (block, life cycle) page. LOCKED when ``locks``, HELD when
    ``holders`` (or unpublished), else DROPPABLE."""

    __slots__ = ("stamp", "block", "slot", "claim", "ready", "locks", "holders", "lc", "tier", "group",
                 "priority", "queued", "published", "dead", "relabel", "in_use", "copy", "copy_ready")

    def __init__(self) -> None:
        self.stamp = 0            # recency: larger is more recent
        self.block = -1
        self.slot = -1
        self.claim = 0            # the in-flight operation holding it (0: none)
        self.ready = 0            # event of the last copy that wrote it (0: none)
        self.locks = 0            # active sequences that need it on the GPU
        self.holders = 0          # sequence rows naming it
        self.lc = 0
        self.tier = -1
        self.group = 0
        self.priority = 0
        self.queued = NOT_QUEUED
        self.published = False    # indexed for reuse
        self.dead = False         # left the store; its slot is freed once no claim holds it
        self.relabel = False      # published while claimed: relabel its journal record if it ends on disk
        self.in_use = False       # the id is allocated
        self.copy = False         # a clean copy (write-through): a disk page of a block whose index page
                                  # (the primary) lives in a warmer tier; never held, locked or published
        self.copy_ready = False   # write-through: its bytes are final (published unlocked, or released since)


class Block:
    __slots__ = ("key", "parent", "children", "depth", "refs", "indexed", "has_key", "in_use", "pages")

    def __init__(self, parent: int, depth: int, n_lcs: int) -> None:
        self.key: int | bytes | None = None
        self.parent = parent
        self.children: list[int] = []      # indexed children, oldest first
        self.depth = depth
        self.refs = 0                      # sequence rows + live pages naming it + 1 while indexed
        self.indexed = False
        self.has_key = False
        self.in_use = True
        self.pages = [-1] * n_lcs          # the index's page per life cycle


class Seq:
    __slots__ = ("keys", "blocks", "pages", "recompute", "locked", "committed", "priority", "acquired", "in_use")

    def __init__(self) -> None:
        self.keys: list = []
        self.blocks: list[int] = []            # block per position (matched, then extended)
        self.pages: list[list[int]] = []       # per block, per life cycle: the sequence's page (-1: none)
        self.recompute: list[list[bool]] = []  # same shape: the page holds no cached data
        self.locked: list[int] = []            # exactly the pages this sequence's acquire locked
        self.committed = 0
        self.priority = 35
        self.acquired = False
        self.in_use = False


class Counters:
    __slots__ = ("hits", "lookup_blocks", "drops", "recovered", "orphaned", "discarded", "copies_made",
                 "copies_kept", "copy_swaps", "copies_evicted", "copies")

    def __init__(self) -> None:
        self.hits = [0, 0, 0]
        self.lookup_blocks = 0
        self.drops = 0
        self.recovered = 0
        self.orphaned = 0
        self.discarded = 0
        # per tier of the copy, as hits
        self.copies_made = [0, 0, 0]      # copies landed by land_copies
        self.copies_kept = [0, 0, 0]      # cold slots kept as copies when their page was promoted
        self.copy_swaps = [0, 0, 0]       # demotions onto a copy: no bytes moved
        self.copies_evicted = [0, 0, 0]   # copies dropped by their tier's eviction (the primary stays)
        self.copies = [0, 0, 0]           # live copy records now


# -- the prioritised LRU ----------------------------------------------------------------------------

class LruQueue:
    """The evictable pages of one (tier, group): lowest priority first, then
    least recently used.

    Per priority, ``order`` holds pages in ascending stamp (a touched page
    gets the newest stamp and goes to its end; a page pushed with a stamp no
    older than the tail appends) and ``late`` the pages pushed with an older
    stamp (a demoted page keeps its recency). Pop takes whichever is older:
    the head of ``order`` or the late page with the lowest (stamp, page id);
    on equal stamps ``order`` goes first."""

    __slots__ = ("pt", "order", "late", "size")

    def __init__(self, pt: list[Page]) -> None:
        self.pt = pt
        self.order: list[dict[int, None]] = [{} for _ in range(PRIORITIES)]
        self.late: list[set[int]] = [set() for _ in range(PRIORITIES)]
        self.size = 0

    def push(self, pid: int) -> None:
        p = self.pt[pid]
        assert p.queued == NOT_QUEUED
        order = self.order[p.priority]
        if not order or self.pt[next(reversed(order))].stamp <= p.stamp:
            order[pid] = None
            p.queued = IN_ORDER
        else:
            self.late[p.priority].add(pid)
            p.queued = LATE
        self.size += 1

    def touch(self, pid: int) -> None:
        """``pid`` (queued) just got the newest stamp."""
        p = self.pt[pid]
        order = self.order[p.priority]
        if p.queued == IN_ORDER:
            del order[pid]
        else:
            self.late[p.priority].discard(pid)
        order[pid] = None
        p.queued = IN_ORDER

    def remove(self, pid: int) -> None:
        p = self.pt[pid]
        if p.queued == NOT_QUEUED:
            return
        if p.queued == IN_ORDER:
            del self.order[p.priority][pid]
        else:
            self.late[p.priority].discard(pid)
        p.queued = NOT_QUEUED
        self.size -= 1

    def pop_many(self, n: int) -> list[int]:
        """Up to ``n`` victims, best first (and unqueued)."""
        out: list[int] = []
        pt = self.pt
        for prio in range(PRIORITIES):
            if len(out) >= n:
                break
            order, late = self.order[prio], self.late[prio]
            while len(out) < n and (order or late):
                first = next(iter(order)) if order else -1
                oldest_late = min(late, key=lambda i: (pt[i].stamp, i)) if late else -1
                if oldest_late < 0 or (first >= 0 and pt[first].stamp <= pt[oldest_late].stamp):
                    pid = first
                    del order[pid]
                else:
                    pid = oldest_late
                    late.discard(pid)
                pt[pid].queued = NOT_QUEUED
                self.size -= 1
                out.append(pid)
        return out


# -- the core ----------------------------------------------------------------------------------------

class ModelCore:
    """The core's decisions over plain Python records (see the module docstring)."""

    def __init__(self, tokens_per_block: int, life_cycles: list, group_of: list, capacity: list) -> None:
        lcs = []
        for i, (ssm, window, sinks, reuse) in enumerate(life_cycles):
            if not 0 <= reuse <= 3:
                raise ValueError("reuse must be 0..3")
            lcs.append((i, ssm, window, sinks, reuse))
        group_of = [list(row) for row in group_of]
        capacity = [list(row) for row in capacity]
        _require(tokens_per_block > 0, "tokens_per_block must be positive")
        _require(0 < len(lcs) < 128, "1..127 life cycles")
        _require(len(group_of) == TIERS and len(capacity) == TIERS, "group_of and capacity need a row per tier")
        _require(len(capacity[GPU]) > 0, "the GPU tier needs a pool group")
        self.tpb = tokens_per_block
        self.lcs = [LifeCycle(*lc) for lc in lcs]
        self.group_of = group_of                 # [tier][lc]
        self.allocs: list[list[SlotAllocator]] = []
        self.pt: list[Page] = []                 # the page table, by page id
        self.queues: list[list[LruQueue]] = []
        self.owners: list[list[list[int]]] = []  # [tier][group][slot] -> page id (-1)
        self.hit_pages_: list[list[int]] = []      # [tier][group]: pages matched there (open_sequence)
        self.sole_group: list[int | None] = []   # per tier: the one group every lc maps to
        self.next_tier = [-1, -1, -1]
        self._last_tier = GPU
        prev = -1
        for t in range(TIERS):
            _require(len(group_of[t]) == len(lcs), "group_of needs a group per life cycle")
            _require(len(capacity[t]) < 256, "at most 255 pool groups per tier")
            self.allocs.append([])
            self.queues.append([])
            self.owners.append([])
            self.hit_pages_.append([0] * len(capacity[t]))
            for cap in capacity[t]:
                _require(cap >= 0, "a capacity must not be negative")
                self.allocs[t].append(SlotAllocator(cap, sweep=t == DISK))
                self.queues[t].append(LruQueue(self.pt))
                self.owners[t].append([-1] * cap)
            if capacity[t]:
                for g in group_of[t]:
                    _require(0 <= g < len(capacity[t]), "group out of range")
                if prev >= 0:
                    self.next_tier[prev] = t
                prev = t
                self._last_tier = t
            row = group_of[t]
            self.sole_group.append(row[0] if all(g == row[0] for g in row) else None)
        # every lc is full attention: an acquire needs every page
        self.reads_all = not any(lc.ssm or lc.window for lc in self.lcs)
        # every lc PRIVATE: nothing is indexed or matched
        self.shares_nothing = all(lc.reuse == PRIVATE for lc in self.lcs)
        # the lcs whose pages a match must check
        self.limiting_lcs = [i for i, lc in enumerate(self.lcs) if lc.limits_match()]
        self.free_page_ids: list[int] = []
        self.live = 0
        self.blocks: list[Block] = []
        self.free_block_ids: list[int] = []
        self.index: dict[int | bytes, int] = {}  # key -> indexed block, in indexing order
        self.seqs: list[Seq] = []
        self.free_seqs: list[int] = []
        self._clock = 0
        self.claim_counter = 0
        self.copy_claim_counter = 0                         # copy claims count down from -1
        # Clean copies (write-through): copy_map[page] -> the next, colder link of its chain (absent:
        # none); wt_on[t] / wt_pending[t] (t HOST or DISK): pages published warmer than t, to copy
        # there (ids may go stale: take_copies filters them).
        self.wt_on = {HOST: False, DISK: False}
        self.copy_map: dict[int, int] = {}
        self.wt_pending: dict[int, deque[int]] = {HOST: deque(), DISK: deque()}
        self.counters_ = Counters()
        self.disk_frees: list[tuple[int, list[int]]] = []   # drained by take_disk_frees
        self.relabels: list[int] = []                       # filtered when taken
        self.pending_records: list[_Record] = []            # recover_add's, until recover

    @property
    def _n_lcs(self) -> int:
        return len(self.lcs)

    @property
    def clock(self) -> int:
        return self._clock

    # -- ids ------------------------------------------------------------------------------------
    def _new_page_id(self) -> int:
        if self.free_page_ids:
            pid = self.free_page_ids.pop()
            self.pt[pid] = Page()
        else:
            pid = len(self.pt)
            self.pt.append(Page())
        self.pt[pid].in_use = True
        self.live += 1
        return pid

    def _recyclable(self, pid: int) -> bool:
        p = self.pt[pid]
        return p.in_use and p.dead and p.holders == 0 and p.locks == 0 and p.claim == 0

    def _maybe_recycle(self, pid: int) -> None:
        """A dead page no row, lock or claim names any more gives its id back."""
        if self._recyclable(pid):
            self._set_block(pid, -1)
            self.pt[pid].in_use = False
            self.pt[pid].tier = -1              # as the core marks a free id (its other fields stay)
            self.free_page_ids.append(pid)
            self.live -= 1

    def _new_block(self, parent: int, depth: int) -> int:
        if self.free_block_ids:
            b = self.free_block_ids.pop()
            self.blocks[b] = Block(parent, depth, self._n_lcs)
        else:
            b = len(self.blocks)
            self.blocks.append(Block(parent, depth, self._n_lcs))
        return b

    def _ref(self, b: int) -> None:
        self.blocks[b].refs += 1

    def _unref(self, b: int) -> None:
        x = self.blocks[b]
        assert x.refs > 0
        x.refs -= 1
        if x.refs == 0:
            assert not x.indexed
            x.in_use = False
            self.free_block_ids.append(b)

    def _find(self, key) -> int:
        return self.index.get(key, -1)

    def _insert(self, b: int) -> None:
        """Index block ``b`` (its key set) under its parent."""
        x = self.blocks[b]
        assert not x.indexed and x.has_key and x.key not in self.index
        x.indexed = True
        x.refs += 1
        self.index[x.key] = b
        if x.parent >= 0:
            self.blocks[x.parent].children.append(b)

    def _erase(self, b: int) -> None:
        """Take ``b`` out of the index and out of its parent's children (if
        the parent still lists it: a subtree drop unindexes parents first)."""
        x = self.blocks[b]
        assert x.indexed
        x.indexed = False
        del self.index[x.key]
        if x.parent >= 0:
            siblings = self.blocks[x.parent].children
            if b in siblings:
                siblings.remove(b)
        x.children = []

    def _next_claim(self) -> int:
        self.claim_counter = 1 if self.claim_counter == _INT32_MAX else self.claim_counter + 1
        return self.claim_counter

    def _next_copy_claim(self) -> int:
        self.copy_claim_counter = -1 if self.copy_claim_counter <= _INT32_MIN + 1 else self.copy_claim_counter - 1
        return self.copy_claim_counter

    def _live_seq(self, s: int) -> Seq:
        if not 0 <= s < len(self.seqs) or not self.seqs[s].in_use:
            raise CoreError("no such sequence")
        return self.seqs[s]

    def _seq_lc(self, s: int, lc: int) -> Seq:
        q = self._live_seq(s)
        _require(0 <= lc < self._n_lcs, "no such life cycle")
        return q

    def _check_tier_group(self, tier: int, group: int) -> None:
        if not 0 <= tier < TIERS or not 0 <= group < len(self.allocs[tier]):
            raise IndexError("no such tier and pool group")

    def _slots_by_group(self, tier: int, slots: dict) -> list[list[int]]:
        if not isinstance(slots, dict):
            raise TypeError("slots must be a {group: [slots]} dict")
        out: list[list[int]] = [[] for _ in self.allocs[tier]]
        for g, v in slots.items():
            if not 0 <= g < len(self.allocs[tier]):
                raise ValueError("slots for a pool group that does not exist")
            out[g] = [int(s) for s in v]            # a copy: the caller's lists are left alone
        return out

    # -- page bookkeeping ---------------------------------------------------------------------------
    def _set_block(self, pid: int, b: int) -> None:
        p = self.pt[pid]
        if p.block == b:
            return
        if b >= 0:
            self._ref(b)
        if p.block >= 0:
            self._unref(p.block)
        p.block = b

    def _new_page(self, block: int, lc: int, tier: int, group: int, slot: int, priority: int) -> int:
        pid = self._new_page_id()
        p = self.pt[pid]
        p.lc, p.tier, p.group, p.slot, p.priority = lc, tier, group, slot, priority
        self._set_block(pid, block)
        self.owners[tier][group][slot] = pid
        return pid

    def _touch(self, pid: int) -> None:
        p = self.pt[pid]
        self._clock += 1
        p.stamp = self._clock
        if p.queued:
            self.queues[p.tier][p.group].touch(pid)
        c = self.copy_map.get(pid, -1)
        while c >= 0:                       # a copy is as recent as its primary: cold tiers keep hot prefixes
            cp = self.pt[c]
            cp.stamp = p.stamp
            if cp.queued:
                self.queues[cp.tier][cp.group].touch(c)
            c = self.copy_map.get(c, -1)

    def _has_copy(self, pid: int) -> bool:
        return self.copy_map.get(pid, -1) >= 0

    def _any_write_through(self) -> bool:
        return self.wt_on[HOST] or self.wt_on[DISK]

    def _copy_in(self, pid: int, tier: int) -> int:
        """The chain's copy in ``tier`` (-1: none)."""
        c = self.copy_map.get(pid, -1)
        while c >= 0:
            if self.pt[c].tier == tier:
                return c
            c = self.copy_map.get(c, -1)
        return -1

    def _link_copy(self, primary: int, c: int) -> None:
        """``c`` joins its primary's chain in its tier's place."""
        prev = primary
        while self.copy_map.get(prev, -1) >= 0 and self.pt[self.copy_map[prev]].tier < self.pt[c].tier:
            prev = self.copy_map[prev]
        nxt = self.copy_map.get(prev, -1)
        if nxt >= 0:
            self.copy_map[c] = nxt
        self.copy_map[prev] = c
        self.counters_.copies[self.pt[c].tier] += 1

    def _unlink_copy(self, c: int) -> None:
        """``c`` leaves its chain (not freed)."""
        p = self.pt[c]
        prev = self.blocks[p.block].pages[p.lc]
        while prev >= 0 and self.copy_map.get(prev, -1) != c:
            prev = self.copy_map.get(prev, -1)
        _require(prev >= 0, "unlink_copy: a copy that is in no chain")
        nxt = self.copy_map.pop(c, -1)
        if nxt >= 0:
            self.copy_map[prev] = nxt
        else:
            del self.copy_map[prev]
        self.counters_.copies[p.tier] -= 1

    def _free_copies(self, primary: int, tier: int = DISK) -> None:
        """The chain's copies in ``tier`` and warmer leave the store (slots freed, or kept by a claim:
        a drop in flight)."""
        c = self.copy_map.get(primary, -1)
        while c >= 0 and self.pt[c].tier <= tier:
            nxt = self.copy_map.get(c, -1)
            self._unlink_copy(c)
            self._free_page(c)
            c = nxt

    def _queue_copy(self, pid: int) -> None:
        """Into the pending queue of each write-through tier colder than the page (without a copy there)."""
        for t in (HOST, DISK):
            if self.wt_on[t] and self.pt[pid].tier < t and self._copy_in(pid, t) < 0:
                self.wt_pending[t].append(pid)

    def _publish(self, pid: int) -> None:
        """Indexed for reuse; with write-through on, the page is queued for its copies."""
        self.pt[pid].published = True
        if self._any_write_through() and not self.pt[pid].locks:
            self.pt[pid].copy_ready = True
            self._queue_copy(pid)           # bytes final now; a locked page is queued when released

    def _unpublish(self, pid: int) -> None:
        self.pt[pid].published = False
        if self._has_copy(pid):
            self._free_copies(pid)

    def _evictable(self, p: Page) -> bool:
        return (not p.locks and not p.claim and not p.dead
                and (p.copy or p.tier != self._last_tier or (p.published and not p.holders)))

    def _requeue(self, pid: int) -> None:
        """Make queue membership match evictability (a queued page keeps its place)."""
        p = self.pt[pid]
        ev = self._evictable(p)
        if p.queued:
            if not ev:
                self.queues[p.tier][p.group].remove(pid)
        elif ev:
            self.queues[p.tier][p.group].push(pid)

    def _queue_all(self, pids: list[int]) -> None:
        """Queue the evictable ones among unqueued pages (ascending stamps: they append)."""
        for pid in pids:
            p = self.pt[pid]
            if not p.queued and self._evictable(p):
                self.queues[p.tier][p.group].push(pid)

    def _unqueue(self, pid: int) -> None:
        p = self.pt[pid]
        if p.queued:
            self.queues[p.tier][p.group].remove(pid)

    def _release_slot(self, tier: int, group: int, slot: int, fence: int) -> None:
        self.owners[tier][group][slot] = -1
        self.allocs[tier][group].release([slot], fence)
        if tier == DISK:
            self.disk_frees.append((group, [slot]))

    def _free_page(self, pid: int, release_slot: bool = True) -> None:
        """The page leaves the store (its slot is freed once no claim holds it)."""
        p = self.pt[pid]
        if p.dead:
            return
        p.dead = True
        self._unqueue(pid)
        if p.block >= 0 and self.blocks[p.block].pages[p.lc] == pid:
            self.blocks[p.block].pages[p.lc] = -1
        if not p.claim and release_slot:
            self._release_slot(p.tier, p.group, p.slot, p.ready)
        self._maybe_recycle(pid)

    def _drop(self, pid: int, release_slot: bool = True) -> None:
        """Drop a published page from the index (the last tier's eviction):
        a prefix-critical page takes its block's subtree along; a block left
        with no page and no child leaves the index."""
        p = self.pt[pid]
        if not p.dead:
            self.counters_.drops += 1
        b, lc = p.block, p.lc
        self._unpublish(pid)
        if b < 0:
            self._free_page(pid, release_slot)
            return
        self._ref(b)                    # keep the block while the page (maybe recycled) lets go of it
        self._free_page(pid, release_slot)
        blk = self.blocks[b]
        if blk.indexed and self.lcs[lc].prefix_critical(blk.depth, self.tpb):
            self._drop_subtree(b)
        elif blk.indexed and not blk.children and all(q < 0 for q in blk.pages):
            self._unindex(b)
        self._unref(b)

    def _drop_subtree(self, root: int) -> None:
        """Unindex ``root`` and its descendants (newest child first); their
        pages are freed, or unpublished where a live sequence still holds them."""
        stack = [root]
        self._ref(root)
        pinned = [root]
        while stack:
            node = stack.pop()
            for c in self.blocks[node].children:     # oldest first: the newest is popped first
                stack.append(c)
                self._ref(c)
                pinned.append(c)
            for q in self.blocks[node].pages:
                if q < 0 or self.pt[q].dead:
                    continue
                self._unpublish(q)
                if self.pt[q].holders:
                    self._requeue(q)            # a live sequence keeps it; freed when it closes
                else:
                    self._free_page(q)
            self._unindex(node)
        for b in pinned:
            self._unref(b)

    def _unindex(self, b: int) -> None:
        x = self.blocks[b]
        if not x.indexed:
            return
        self._erase(b)
        self._unref(b)

    # -- sequences -------------------------------------------------------------------------------------
    def open(self, keys, priority: int) -> tuple:
        """A new sequence matching the longest reusable indexed prefix of
        ``keys``: (sequence id, matched blocks, matched blocks by their
        coldest page's tier (gpu, host, disk, none))."""
        keys = to_keys(keys)
        if not 0 <= priority < PRIORITIES:
            raise ValueError("priority must be in 0..100")
        if self.free_seqs:
            s = self.free_seqs.pop()
            self.seqs[s] = Seq()
        else:
            s = len(self.seqs)
            self.seqs.append(Seq())
        q = self.seqs[s]
        q.in_use = True
        q.priority = priority
        by_tier = [0, 0, 0, 0]
        matched = 0
        self.counters_.lookup_blocks += len(keys)
        if not self.shares_nothing:
            path: list[int] = []
            parent = -1
            for i, k in enumerate(keys):
                b = self._find(k)
                if b < 0 or self.blocks[b].parent != parent or self.blocks[b].depth != i:
                    break
                if any(pid >= 0 and self.pt[pid].holders >= MAX_HOLDERS for pid in self.blocks[b].pages):
                    break                   # shared by as many sequences as the core's counters hold
                path.append(b)
                parent = b
            k = len(path)
            while k > 0 and not self._reusable(path, k):
                k -= 1
            del path[k:]
            held = []
            for b in path:
                q.blocks.append(b)
                self._ref(b)
                coldest = -1
                row = []
                for lc in range(self._n_lcs):
                    pid = self.blocks[b].pages[lc]
                    if pid >= 0 and (self.pt[pid].dead or not self.pt[pid].published):
                        pid = -1
                    row.append(pid)
                    if pid < 0:
                        continue
                    p = self.pt[pid]
                    p.holders += 1
                    self.hit_pages_[p.tier][p.group] += 1
                    if p.tier == self._last_tier:
                        self._requeue(pid)      # a held page leaves the last tier's drop queue
                    held.append(pid)
                    coldest = max(coldest, p.tier)
                q.pages.append(row)
                q.recompute.append([False] * self._n_lcs)
                by_tier[3 if coldest < 0 else coldest] += 1
            q.committed = matched = k
            for pid in reversed(held):          # deepest first
                self._touch(pid)
        for t in range(TIERS):
            self.counters_.hits[t] += by_tier[t]
        q.keys = keys
        return (s, matched, tuple(by_tier))

    def _reusable(self, path: list[int], k: int) -> bool:
        h = k * self.tpb
        for lc in self.limiting_lcs:
            for b in self.lcs[lc].required_blocks(h, self.tpb):
                pid = self.blocks[path[b]].pages[lc]
                if pid < 0 or self.pt[pid].dead:
                    return False
        return True

    def append_keys(self, s: int, keys) -> None:
        keys = to_keys(keys)
        self._live_seq(s).keys.extend(keys)

    def close(self, s: int) -> int:
        """Release, then committed pages become droppable and the rest are freed.
        Returns the blocks the sequence had committed."""
        q = self._live_seq(s)
        committed = q.committed
        self.release(s, 0)
        unheld = []
        for row in reversed(q.pages):           # deepest (oldest stamp) first
            for pid in row:
                if pid < 0:
                    continue
                p = self.pt[pid]
                p.holders -= 1
                if p.dead:
                    self._maybe_recycle(pid)
                elif not p.published:
                    if not p.holders:           # else another sequence still holds it
                        self._free_page(pid)
                elif p.tier == self._last_tier:  # holders only gate the last tier's queue
                    unheld.append(pid)
        self._queue_all(unheld)
        for b in q.blocks:
            self._unref(b)
        self.seqs[s] = Seq()
        self.free_seqs.append(s)
        return committed

    def num_blocks(self, s: int) -> int:
        return len(self.seqs[s].blocks)

    def committed(self, s: int) -> int:
        return self.seqs[s].committed

    def acquired(self, s: int) -> bool:
        return self.seqs[s].acquired

    def seq_pages(self, s: int) -> list[int]:
        """Per block, per life cycle: page id or -1 (flattened)."""
        return [pid for row in self.seqs[s].pages for pid in row]

    def place_extension(self, s: int, n: int, slots: dict) -> list[int]:
        """GPU pages for ``n`` new blocks, each life cycle's slot popped from
        the back of its group's list; returns the slots' fences (sorted, distinct)."""
        slots_of = self._slots_by_group(GPU, slots)
        q = self._live_seq(s)
        nl = self._n_lcs
        start = len(q.blocks)
        locks = 1 if q.acquired else 0
        stamp = self._clock + n * nl            # stamped as a touch of the new blocks deepest first would
        self._clock = stamp
        fences = []
        parent = q.blocks[start - 1] if start else -1
        for i in range(start, start + n):
            b = self._new_block(parent, i)
            blk = self.blocks[b]
            if i < len(q.keys):
                blk.key = q.keys[i]
                blk.has_key = True
            self._ref(b)                        # the sequence's row
            q.blocks.append(b)
            stamp -= nl
            row = []
            for lc in range(nl):
                g = self.group_of[GPU][lc]
                mine = slots_of[g]
                _require(bool(mine), "place_extension: too few slots")
                slot = mine.pop()
                f = self.allocs[GPU][g].fence[slot]
                if f:
                    fences.append(f)
                pid = self._new_page(b, lc, GPU, g, slot, q.priority)
                p = self.pt[pid]
                p.holders = 1
                p.locks = locks
                p.stamp = stamp + lc + 1
                blk.pages[lc] = pid
                row.append(pid)
            q.pages.append(row)
            q.recompute.append([False] * nl)
            parent = b
        new_rows = q.pages[start:]
        if locks:
            q.locked.extend(pid for row in new_rows for pid in row)
        else:                                   # oldest stamp first: they append
            self._queue_all([pid for row in reversed(new_rows) for pid in row])
        return sorted(set(fences))

    def extend_now(self, s: int, n: int) -> list[int] | None:
        """The common case in one call: every GPU group has the free slots
        for ``n`` more blocks; allocates and places them (fences), else None
        with nothing changed."""
        self._live_seq(s)
        need = [0] * len(self.allocs[GPU])
        for lc in range(self._n_lcs):
            need[self.group_of[GPU][lc]] += n
        if any(k > a.free for k, a in zip(need, self.allocs[GPU])):
            return None
        slots = {}
        for g, k in enumerate(need):
            if k:
                slots[g] = self.allocs[GPU][g].allocate(k) or []
        return self.place_extension(s, n, slots)

    def undo_extend(self, s: int, n: int) -> None:
        """Take back up to ``n`` uncommitted blocks from the end."""
        q = self._live_seq(s)
        k = min(n, len(q.blocks) - q.committed)
        for _ in range(k):
            for pid in q.pages[-1]:
                if pid < 0:
                    continue
                self.pt[pid].holders -= 1
                if self.pt[pid].dead:
                    self._maybe_recycle(pid)
                elif not self.pt[pid].holders:
                    self._free_page(pid)
            q.pages.pop()
            q.recompute.pop()
            self._unref(q.blocks.pop())

    # -- acquire / release ---------------------------------------------------------------------------------
    def _needed(self, q: Seq) -> list[tuple[int, int]]:
        """(block, life cycle) of the pages an acquire locks, deepest first
        (then the higher life cycle first): what the next token reads, and
        every uncommitted block (its pages are being written)."""
        n, nl = len(q.blocks), self._n_lcs
        if self.reads_all:
            return [(b, lc) for b in range(n - 1, -1, -1) for lc in range(nl - 1, -1, -1)]
        h = n * self.tpb
        out = set()
        for lc in range(nl):
            out.update((b, lc) for b in self.lcs[lc].needed_blocks(h, self.tpb))
            out.update((b, lc) for b in range(q.committed, n))
        return sorted(out, reverse=True)

    def acquire_now(self, s: int) -> int:
        """Lock the needed pages if every one is on the GPU, live and unclaimed:
        1 done, 0 not (the slow path), -1 the sequence is already acquired."""
        q = self._live_seq(s)
        if q.acquired:
            return -1
        pages = []
        for b, lc in self._needed(q):
            pid = q.pages[b][lc]
            if pid < 0:
                return 0
            p = self.pt[pid]
            if p.dead or p.tier != GPU or p.claim > 0:     # a copy (claim < 0) reads it in place
                return 0
            pages.append(pid)
        for pid in pages:
            self.pt[pid].locks += 1
            self._unqueue(pid)
        for pid in pages:
            self._touch(pid)
        q.acquired = True
        q.locked = pages
        return 1

    def acquire_scan(self, s: int) -> tuple[list[int], list[int]]:
        """(holes, claims): needed (block, lc) pairs (flattened) with no live
        page; else the distinct claims on needed pages (moves in flight)."""
        q = self._live_seq(s)
        _require(not q.acquired, "sequence is already acquired")
        need = self._needed(q)
        holes: list[int] = []
        claims: list[int] = []
        for b, lc in need:
            pid = q.pages[b][lc]
            if pid < 0 or self.pt[pid].dead:
                holes += [b, lc]
        if holes:
            return (holes, claims)
        for b, lc in need:
            p = self.pt[q.pages[b][lc]]
            c = p.claim
            if c < 0 and p.tier == GPU:
                continue                        # a copy reads it in place: it can be locked meanwhile
            if c and c not in claims:
                claims.append(c)
        return (holes, claims)

    def fill_holes(self, s: int, holes: list[int], slots: dict) -> list[int]:
        """New empty GPU pages for holes (the caller recomputes them)."""
        slots_of = self._slots_by_group(GPU, slots)
        q = self._live_seq(s)
        nl = self._n_lcs
        fences = []
        first_critical = None            # the first refilled block whose page the prefix needed
        for i in range(0, len(holes) - 1, 2):
            b, lc = holes[i], holes[i + 1]
            _require(0 <= b < len(q.blocks) and 0 <= lc < nl, "fill_holes: bad hole")
            if self.lcs[lc].prefix_critical(b, self.tpb):
                first_critical = b if first_critical is None else min(first_critical, b)
            g = self.group_of[GPU][lc]
            _require(bool(slots_of[g]), "fill_holes: too few slots")
            slot = slots_of[g].pop()
            fences.append(self.allocs[GPU][g].fence[slot])
            old = q.pages[b][lc]
            pid = self._new_page(q.blocks[b], lc, GPU, g, slot, q.priority)
            self.pt[pid].holders = 1
            self._requeue(pid)
            q.pages[b][lc] = pid
            q.recompute[b][lc] = True
            if old >= 0:                        # a dead page the row still named
                self.pt[old].holders -= 1
                self._maybe_recycle(old)
        # an engine recomputes a suffix: from a lost prefix-critical page on, every matched block's
        # pages are rewritten
        if first_critical is not None:
            for b in range(first_critical, q.committed):
                for lc in range(nl):
                    if q.pages[b][lc] >= 0:
                        q.recompute[b][lc] = True
        fences = sorted(set(fences))
        if fences and fences[0] == 0:
            fences.pop(0)
        return fences

    def lock_needed(self, s: int) -> Pages:
        """Lock (and unqueue) the needed pages; every one must be live."""
        q = self._live_seq(s)
        pages = []
        for b, lc in self._needed(q):
            pid = q.pages[b][lc]
            _require(pid >= 0 and not self.pt[pid].dead, "lock_needed: a needed page is missing")
            pages.append(pid)
        for pid in pages:
            self.pt[pid].locks += 1
            self._unqueue(pid)
        return Pages(pages)

    def finish_acquire(self, s: int, pages: Pages) -> None:
        ids = _page_ids(pages)
        q = self._live_seq(s)
        for pid in ids:
            self._touch(pid)
        q.acquired = True
        q.locked = list(ids)

    def unlock(self, pages: Pages) -> None:
        for pid in _page_ids(pages):
            p = self.pt[pid]
            p.locks -= 1
            if not p.dead:
                self._requeue(pid)
            else:
                self._maybe_recycle(pid)

    def undo_acquire(self, s: int, pages: Pages) -> None:
        _page_ids(pages)
        q = self._live_seq(s)
        q.acquired = False
        q.locked = []
        self.unlock(pages)

    def release(self, s: int, event: int) -> None:
        """Unlock exactly the pages this sequence locked, oldest first; a
        caller's event (non-zero) becomes the ready fence of its GPU pages."""
        q = self._live_seq(s)
        if not q.acquired:
            return
        q.acquired = False
        locked, q.locked = q.locked, []
        locked.sort(key=lambda pid: self.pt[pid].stamp)
        for pid in locked:
            p = self.pt[pid]
            if event and p.tier == GPU:
                p.ready = event
            p.locks -= 1
            # write-through: a published page's bytes are final once a sequence that held it releases it
            if self._any_write_through() and p.published and not p.dead:
                p.copy_ready = True
                self._queue_copy(pid)
        self._queue_all(locked)
        for pid in locked:
            self._maybe_recycle(pid)

    def ready_events(self, s: int) -> list[int]:
        q = self._live_seq(s)
        out = set()
        for b, lc in self._needed(q):
            pid = q.pages[b][lc]
            if pid >= 0 and self.pt[pid].ready:
                out.add(self.pt[pid].ready)
        return sorted(out)

    def prefetch_pages(self, s: int) -> Pages:
        """Needed pages that are live, cold and unclaimed."""
        q = self._live_seq(s)
        out = []
        for b, lc in self._needed(q):
            pid = q.pages[b][lc]
            if pid >= 0 and not self.pt[pid].dead and self.pt[pid].tier != GPU and not self.pt[pid].claim:
                out.append(pid)
        return Pages(out)

    # -- commit --------------------------------------------------------------------------------------------------
    def _commit_conflict(self, s: int, n: int) -> int:
        """-1, or the first position whose key is indexed at another position or repeated."""
        q = self._live_seq(s)
        _require(n <= len(q.blocks) and n <= len(q.keys), "commit past the sequence's blocks or keys")
        if n <= q.committed:
            return -1
        keys = q.keys[q.committed:n]
        if all(k not in self.index for k in keys) and len(set(keys)) == len(keys):
            return -1                           # the common case: every key new, none repeated
        parent = q.blocks[q.committed - 1] if q.committed else -1
        new_keys: set = set()
        new_blocks: set[int] = set()
        for i in range(q.committed, n):
            if parent >= 0 and not self.blocks[parent].indexed and parent not in new_blocks:
                return -1                       # an ancestor was dropped: the commit stops there
            key = q.keys[i]
            node = self._find(key)
            if key in new_keys or (node >= 0 and (self.blocks[node].parent != parent
                                                  or self.blocks[node].depth != i)):
                return i
            if node < 0:
                parent = q.blocks[i]
                new_keys.add(key)
                new_blocks.add(parent)
            else:
                parent = node
        return -1

    def _published_cold(self, pid: int) -> None:
        """``pid`` was just published: a page resting on disk carries an
        anonymous journal record, relabel it; a claimed one, when its claim ends."""
        p = self.pt[pid]
        if p.claim:
            p.relabel = True
        elif p.tier == DISK:
            self.relabels.append(pid)

    def _adopt(self, node: int, q: Seq, i: int) -> None:
        """Publish row ``i``'s pages into ``node`` where it has none (or only an idle colder copy)."""
        for lc in range(self._n_lcs):
            pid = q.pages[i][lc]
            if pid < 0:
                continue
            p = self.pt[pid]
            if p.dead or p.published or self.lcs[lc].reuse == PRIVATE:
                continue
            if q.recompute[i][lc] and self.lcs[lc].reuse != OPTIONAL:
                continue
            theirs = self.blocks[node].pages[lc]
            if theirs >= 0 and not self.pt[theirs].dead:
                t = self.pt[theirs]
                if t.holders or t.locks or t.claim or t.tier <= p.tier:
                    continue
                self._unpublish(theirs)
                self.blocks[node].pages[lc] = -1
                self._free_page(theirs)
            self._set_block(pid, node)
            self._publish(pid)
            self.blocks[node].pages[lc] = pid
            self._requeue(pid)
            self._published_cold(pid)

    def commit(self, s: int, n: int) -> int:
        """Publish blocks [0, n). Returns -1, or (nothing changed) the first
        position whose key is already indexed at another position or repeated,
        or COMMIT_PAST_BLOCKS / COMMIT_PAST_KEYS."""
        q = self._live_seq(s)
        if n > len(q.blocks):
            return COMMIT_PAST_BLOCKS
        if n > len(q.keys):
            return COMMIT_PAST_KEYS
        bad = self._commit_conflict(s, n)
        if bad >= 0:
            return bad
        start = q.committed
        nl = self._n_lcs
        if self.shares_nothing:                 # the sequence keeps its pages; an index entry would serve nothing
            q.committed = max(q.committed, n)
        else:
            for i in range(n):
                b = q.blocks[i]
                if i < q.committed:
                    if self.blocks[b].indexed:
                        self._adopt(b, q, i)
                    continue
                parent = q.blocks[i - 1] if i else -1
                if parent >= 0 and not self.blocks[parent].indexed:
                    break                       # an ancestor was dropped meanwhile
                key = q.keys[i]
                node = self._find(key)
                if node < 0:
                    blk = self.blocks[b]
                    blk.key, blk.has_key, blk.parent = key, True, parent
                    self._insert(b)
                    for lc in range(nl):
                        pid = q.pages[i][lc]
                        if pid < 0:
                            continue
                        p = self.pt[pid]
                        if self.lcs[lc].reuse == PRIVATE or p.dead:
                            blk.pages[lc] = -1  # the sequence keeps it; the index never sees it
                        else:
                            self._set_block(pid, b)     # a page refilled in the row (fill_holes) becomes the block's
                            blk.pages[lc] = pid
                            self._publish(pid)
                            if not p.locks:
                                self._requeue(pid)
                            self._published_cold(pid)
                else:
                    self._ref(node)
                    q.blocks[i] = node
                    self._unref(b)
                    self._adopt(node, q, i)
                q.committed = max(q.committed, i + 1)
        for i in range(start, q.committed):     # the newly committed blocks have their data now
            q.recompute[i] = [False] * nl
        for i in range(n - 1, -1, -1):
            for pid in q.pages[i]:
                if pid >= 0:
                    self._touch(pid)
        return -1

    def page_indices(self, s: int, lc: int) -> list[int]:
        """GPU slot per block for life cycle ``lc`` (-1: no live GPU page)."""
        q = self._seq_lc(s, lc)
        out = []
        for row in q.pages:
            p = self.pt[row[lc]] if row[lc] >= 0 else None
            out.append(p.slot if p is not None and p.tier == GPU and not p.dead else -1)
        return out

    def locked_slots(self, s: int, lc: int) -> list[int]:
        """GPU slot per block of the pages this sequence's acquire locked, else -1."""
        q = self._seq_lc(s, lc)
        out = [-1] * len(q.blocks)
        if not q.acquired:
            return out
        locked = set(q.locked)
        for b, row in enumerate(q.pages):
            pid = row[lc]
            if pid >= 0 and pid in locked and self.pt[pid].tier == GPU and not self.pt[pid].dead:
                out[b] = self.pt[pid].slot
        return out

    def recompute_blocks(self, s: int, lc: int) -> list[int]:
        return [b for b, row in enumerate(self._seq_lc(s, lc).recompute) if row[lc]]

    # -- slots ---------------------------------------------------------------------------------------------------
    def allocate(self, tier: int, group: int, n: int) -> list[int] | None:
        self._check_tier_group(tier, group)
        return self.allocs[tier][group].allocate(n)

    def release_slots(self, tier: int, group: int, slots: list[int], fence: int = 0) -> None:
        self._check_tier_group(tier, group)
        self.allocs[tier][group].release(list(slots), fence)

    def give_back(self, tier: int, group: int, slots: list[int]) -> None:
        self._check_tier_group(tier, group)
        for s in slots:
            self.allocs[tier][group].give_back(s)

    def slot_fences(self, tier: int, group: int, slots: list[int]) -> list[int]:
        self._check_tier_group(tier, group)
        return sorted({f for f in (self.allocs[tier][group].fence[s] for s in slots) if f})

    def free(self, tier: int, group: int) -> int:
        self._check_tier_group(tier, group)
        return self.allocs[tier][group].free

    def capacity(self, tier: int, group: int) -> int:
        self._check_tier_group(tier, group)
        return self.allocs[tier][group].capacity

    def used(self, tier: int, group: int) -> int:
        self._check_tier_group(tier, group)
        return self.allocs[tier][group].used

    def is_free(self, tier: int, group: int, slot: int) -> bool:
        self._check_tier_group(tier, group)
        if not 0 <= slot < self.allocs[tier][group].capacity:
            raise IndexError("no such slot")
        return self.allocs[tier][group].is_free(slot)

    def queue_len(self, tier: int, group: int) -> int:
        self._check_tier_group(tier, group)
        return self.queues[tier][group].size

    def n_groups(self, tier: int) -> int:
        if not 0 <= tier < TIERS:
            raise IndexError("no such tier")
        return len(self.allocs[tier])

    # -- claims, eviction and moves -------------------------------------------------------------------------------
    def claim(self, pages: Pages, to_tier: int, one_queue: bool = False) -> list[int]:
        """Mark pages as moving to ``to_tier`` (-1: dropped): one claim per
        batch the move will run (source tier and group, destination group),
        or one for all when they were just popped from one queue and the
        destination has one group. Returns the new claim ids."""
        ids = _page_ids(pages)
        fresh = []
        dst_row = DISK if to_tier < 0 else to_tier     # drops key by the disk's groups: any stable key does
        dst_group = self.group_of[dst_row]
        if one_queue and self.sole_group[dst_row] is not None:
            c = self._next_claim()
            fresh.append(c)
            for pid in ids:
                self.pt[pid].claim = c
            return fresh
        return self._claim_batches(ids, dst_group, self._next_claim)

    def _claim_batches(self, ids: list[int], dst_group: list[int], next_claim) -> list[int]:
        """One claim (from ``next_claim``) per (source tier, source group, destination group),
        in order of first appearance; the new claim ids."""
        fresh = []
        claims: dict[tuple[int, int, int], int] = {}
        key, cur = None, 0
        for pid in ids:
            p = self.pt[pid]
            _require(not p.dead, "claiming a freed page")
            _require(not p.claim, "claiming a page already claimed")
            d = dst_group[p.lc]
            if (p.tier, p.group, d) != key:
                key = (p.tier, p.group, d)
                cur = claims.get(key, 0)
                if not cur:
                    cur = claims[key] = next_claim()
                    fresh.append(cur)
            p.claim = cur
            self._unqueue(pid)
        return fresh

    def claims_of(self, pages: Pages) -> list[int]:
        out = []
        for pid in _page_ids(pages):
            c = self.pt[pid].claim
            if c and c not in out:
                out.append(c)
        return out

    def cold_pages(self, pages: Pages) -> Pages:
        return Pages(pid for pid in _page_ids(pages) if self.pt[pid].tier != GPU)

    def group_counts(self, pages: Pages, tier: int) -> list[tuple[int, int]]:
        """(group, count) per destination group of ``tier``, in order of first appearance."""
        ids = _page_ids(pages)
        if self.sole_group[tier] is not None:
            return [(self.sole_group[tier], len(ids))] if ids else []
        counts: dict[int, int] = {}
        for pid in ids:
            g = self.group_of[tier][self.pt[pid].lc]
            counts[g] = counts.get(g, 0) + 1
        return list(counts.items())

    def _end_claims(self, pids: list[int]) -> tuple[list[int], list[int]]:
        """Clear the claims on ``pids`` in stamp order: (claims settled, live
        pages oldest first); a page that died meanwhile frees its slot now."""
        settled, live = [], []
        cur = 0                                 # no claim (-1 is a copy claim)
        for pid in sorted(pids, key=lambda i: self.pt[i].stamp):
            p = self.pt[pid]
            if p.claim != cur:
                cur = p.claim
                if cur and cur not in settled:
                    settled.append(cur)
            p.claim = 0
            if p.dead:
                self._release_slot(p.tier, p.group, p.slot, p.ready)
                self._maybe_recycle(pid)
            else:
                live.append(pid)
        return settled, live

    def _relabel_later(self, pids: list[int]) -> None:
        for pid in pids:
            p = self.pt[pid]
            if p.in_use and p.relabel:
                p.relabel = False
                self.relabels.append(pid)

    def unclaim(self, pages: Pages) -> list[int]:
        """End the claims after a failure or give-up: settle them, free the
        slots of pages that died meanwhile, requeue the rest."""
        if self._any_write_through():           # a copy that failed is tried again later
            for pid in _page_ids(pages):
                if self.pt[pid].claim < 0:
                    self._queue_copy(pid)
        settled, live = self._end_claims(_page_ids(pages))
        self._queue_all(live)
        self._relabel_later(live)
        return settled

    def pick_victims(self, tier: int, group: int, need: int, extra: int):
        """Claim up to need + extra victims of (tier, group) for the next tier
        (or a drop): (Pages, claims); None (nothing taken) if fewer than need."""
        self._check_tier_group(tier, group)
        q = self.queues[tier][group]
        victims = q.pop_many(need + extra)
        if len(victims) < need:
            for pid in victims:
                q.push(pid)
            return None
        claims = self.claim(Pages(victims), self.next_tier[tier], True)
        return (Pages(victims), claims)

    def droppable(self, pages: Pages) -> bool:
        return all(self.pt[pid].copy or (self.pt[pid].published and not self.pt[pid].holders)
                   for pid in _page_ids(pages))

    def drop_victims(self, tier: int, pages: Pages) -> tuple[list[int], list[int]]:
        """Drop claimed victims, deepest first; their slots go to the caller: (claims, slots)."""
        victims = _page_ids(pages)
        order = sorted(victims, key=lambda pid: -self.blocks[self.pt[pid].block].depth)
        for pid in order:
            self.pt[pid].relabel = False
        group = self.pt[victims[0]].group if victims else 0
        claims, slots = [], []
        for pid in order:
            p = self.pt[pid]
            if p.claim and p.claim not in claims:
                claims.append(p.claim)
            p.claim = 0
            self.owners[p.tier][p.group][p.slot] = -1
            self.allocs[p.tier][p.group].fence[p.slot] = p.ready   # its next owner waits on the page's last copy
            slots.append(p.slot)
            # a page already freed by an ancestor's subtree drop keeps its slot for the caller too
            if p.dead:
                self._maybe_recycle(pid)
            elif p.copy:                        # its primary stays: only the copy leaves
                self._unlink_copy(pid)
                self.counters_.copies_evicted[p.tier] += 1
                p.dead = True
                self._maybe_recycle(pid)
            else:
                self._drop(pid, release_slot=False)
        if tier == DISK and slots:
            self.disk_frees.append((group, list(slots)))
        return (claims, slots)

    def split_batches(self, pages: Pages, dst_tier: int) -> list[tuple]:
        """One batch per (source tier, source group, destination group), in
        order of first appearance, each sorted by source slot; host pages into
        the disk keep the order given (see core.cpp)."""
        batches: dict[tuple[int, int, int], list[int]] = {}
        ids = _page_ids(pages)
        for pid in (ids if dst_tier == DISK else sorted(ids, key=lambda i: self.pt[i].slot)):
            p = self.pt[pid]
            batches.setdefault((p.tier, p.group, self.group_of[dst_tier][p.lc]), []).append(pid)
        if dst_tier == DISK:
            for (t, _, _), got in batches.items():
                if t != HOST:
                    got.sort(key=lambda i: self.pt[i].slot)
        return [(t, g, d, Pages(ids)) for (t, g, d), ids in batches.items()]

    def batch_view(self, pages: Pages) -> tuple:
        """(source tier, source group, source slots, life cycles, distinct ready events)."""
        ids = _page_ids(pages)
        slots, lcs, ready = [], [], []
        for pid in ids:
            p = self.pt[pid]
            slots.append(p.slot)
            lcs.append(p.lc)
            if p.ready and p.ready not in ready:
                ready.append(p.ready)
        tier = self.pt[ids[0]].tier if ids else -1
        group = self.pt[ids[0]].group if ids else -1
        return (tier, group, slots, lcs, ready)

    def disk_records(self, pages: Pages) -> bytes:
        """The journal records (``tiers.journal.RECORD``) of ``pages``; anonymous for unpublished ones."""
        ids = _page_ids(pages)
        out = np.zeros(len(ids), dtype=journal.RECORD)
        for i, pid in enumerate(ids):
            p = self.pt[pid]
            out[i]["lc"], out[i]["priority"], out[i]["ptag"] = p.lc, p.priority, journal.TAG_NONE
            if (p.published or (p.copy and not p.dead)) and p.block >= 0:   # a live copy names its block as its primary does
                b = self.blocks[p.block]
                out[i]["key_lo"], out[i]["key_hi"], out[i]["ktag"] = journal.encode_key(b.key)
                out[i]["depth"] = b.depth
                if b.parent >= 0:
                    out[i]["parent_lo"], out[i]["parent_hi"], out[i]["ptag"] = \
                        journal.encode_key(self.blocks[b.parent].key)
            else:
                out[i]["ktag"] = journal.TAG_ANONYMOUS
        return out.tobytes()

    def land(self, pages: Pages, dst_tier: int, dst_group: int, dst_slots: list[int], event: int,
             handoff: bool, fence: int | None = None) -> tuple[list[int], list[int]]:
        """A batch (one source tier and group) moved into ``dst_slots`` with
        ``event``: the source slots go to the caller (handoff) or back to their
        pool fenced by ``fence`` (default ``event``; 0 for a batch whose source
        rows were copied out before it landed). Returns (claims settled,
        handed-off slots)."""
        self._check_tier_group(dst_tier, dst_group)
        if fence is not None and fence < 0:
            raise ValueError("land: fence must be an event id >= 0 (0: none)")
        fence = event if fence is None else fence
        batch = _page_ids(pages)
        _require(len(batch) == len(dst_slots) and len(batch) > 0, "land: one slot per page")
        for pid in batch:
            _require(not self.pt[pid].copy, "land: a clean copy moves nowhere (swap_to_copies sheds it)")
        src_tier, src_group = self.pt[batch[0]].tier, self.pt[batch[0]].group
        freed = []
        # write-through: a published page promoted from a cold tier keeps its slot there as a clean copy
        keep = self.wt_on.get(src_tier, False) and dst_tier < src_tier and not handoff
        kept: list[tuple[int, int]] = []
        for pid, s in zip(batch, dst_slots):
            c = self.copy_map.get(pid, -1)
            if c >= 0 and self.pt[c].tier <= dst_tier:
                self._free_copies(pid, dst_tier)    # it lands where (or colder than) its copy: that goes
            p = self.pt[pid]
            self.owners[src_tier][src_group][p.slot] = -1
            if (keep and not p.dead and p.published and not p.relabel and p.block >= 0
                    and self.blocks[p.block].pages[p.lc] == pid):
                kept.append((pid, p.slot))
            else:
                freed.append(p.slot)
            p.tier, p.group, p.slot, p.ready = dst_tier, dst_group, s, event
            self.owners[dst_tier][dst_group][s] = pid
        for pid, slot in kept:
            p = self.pt[pid]
            c = self._new_page(p.block, p.lc, src_tier, src_group, slot, p.priority)
            cp = self.pt[c]
            cp.copy = True
            cp.stamp = p.stamp
            cp.ready = event                    # the slot's last reader: this move
            self._link_copy(pid, c)
            self.counters_.copies_kept[src_tier] += 1
            self.queues[src_tier][src_group].push(c)
        if src_tier == DISK and freed:
            self.disk_frees.append((src_group, list(freed)))
        if handoff:                     # the caller's next writer waits on this batch's reads
            for s in freed:
                self.allocs[src_tier][src_group].fence[s] = fence
            out_slots = freed
        else:
            self.allocs[src_tier][src_group].release(freed, fence)
            out_slots = []
        settled, live = self._end_claims(batch)
        for pid in live:
            p = self.pt[pid]
            if not p.queued and self._evictable(p):
                self.queues[dst_tier][dst_group].push(pid)
        self._relabel_later(live)
        return (settled, out_slots)

    # -- clean copies (write-through to the host or the disk) -------------------------------------------------------
    def _cold_tier(self, tier: int) -> None:
        _require(tier in (HOST, DISK), "write-through is for the host or the disk tier")

    def set_write_through(self, tier: int, on: bool) -> None:
        """With write-through on for a cold tier, every page published warmer than it is queued for a copy."""
        self._cold_tier(tier)
        _require(not on or len(self.allocs[tier]) > 0, "write-through needs the tier")
        if not on:
            _require(self.counters_.copies[tier] == 0, "write-through cannot be turned off while copies exist")
        self.wt_on[tier] = bool(on)
        if not on:
            self.wt_pending[tier].clear()

    def write_through(self, tier: int) -> bool:
        return self.wt_on.get(tier, False)

    def copies_pending(self, tier: int) -> int:
        self._cold_tier(tier)
        return len(self.wt_pending[tier])

    def copy_of(self, pid: int) -> int:
        _require(0 <= pid < len(self.pt), "no such page")
        return self.copy_map.get(pid, -1)

    def take_copies(self, tier: int, max_pages: int) -> tuple:
        """Claim up to ``max_pages`` of the tier's queued pages that are free
        to read now (unclaimed), in publish order, with copy claims: negative
        ids, one per (source tier, source group, destination group), which an
        acquire of a GPU page does not wait for. Busy ones stay queued; gone
        ones (dead, in the tier or colder, unpublished, with a copy there)
        leave. (Pages, claims)."""
        if max_pages < 0:
            raise ValueError("max_pages must not be negative")
        _require(self.write_through(tier), "take_copies: write-through is off for that tier")
        taken: list[int] = []
        pending = self.wt_pending[tier]
        budget = len(pending)
        while budget > 0 and len(taken) < max_pages:
            budget -= 1
            pid = pending.popleft()
            if not 0 <= pid < len(self.pt):
                continue
            p = self.pt[pid]
            # not copy_ready: a stale entry whose id was recycled into a page still being written
            if (not p.in_use or p.dead or not p.published or p.copy or not p.copy_ready or p.tier >= tier
                    or self._copy_in(pid, tier) >= 0
                    or p.block < 0 or self.blocks[p.block].pages[p.lc] != pid):
                continue                        # gone, or in the tier (or colder), or copied there
            if p.claim:                         # moving: to the back, tried again later
                pending.append(pid)
                continue
            taken.append(pid)
            p.claim = -1                        # a placeholder: a duplicate entry now reads as busy
        for pid in taken:                       # the placeholders go: real copy claims, as claim() makes them
            self.pt[pid].claim = 0
        return (Pages(taken), self._claim_batches(taken, self.group_of[tier], self._next_copy_claim))

    def _tier_stamp(self, b: int, lc: int, tier: int) -> float:
        """Recency of block ``b``'s page (``lc``) in ``tier``, primary or copy (inf: none there)."""
        if b < 0:
            return float("inf")
        pid = self.blocks[b].pages[lc]
        if pid < 0:
            return float("inf")
        if self.pt[pid].tier == tier:
            return self.pt[pid].stamp
        c = self._copy_in(pid, tier)
        return self.pt[c].stamp if c >= 0 else float("inf")

    def land_copies(self, pages: Pages, tier: int, group: int, slots: list[int], event: int) -> list[int]:
        """The claimed batch was written to (tier, group) at ``slots``: each
        page still the live, published primary of its block, warmer than the
        tier and without a copy there, gets its copy there; the other slots
        are freed. Returns the claims ended."""
        batch = _page_ids(pages)
        _require(len(batch) == len(slots), "land_copies: one slot per page")
        _require(tier in (HOST, DISK) and 0 <= group < len(self.allocs[tier]),
                 "land_copies: no such cold tier and group")
        for pid, s in zip(batch, slots):
            a = self.allocs[tier][group]
            _require(0 <= s < a.capacity and not a.is_free(s) and self.owners[tier][group][s] < 0,
                     "land_copies: a slot that is not allocated, or owned")
            _require(self.pt[pid].claim < 0, "land_copies: a page without a copy claim")
        for pid, s in zip(batch, slots):
            p = self.pt[pid]
            if (not p.dead and p.published and p.tier < tier and p.block >= 0
                    and self.blocks[p.block].pages[p.lc] == pid and self._copy_in(pid, tier) < 0
                    and self.group_of[tier][p.lc] == group):
                # never newer than what its parent has in the tier: a child's copy is evicted first
                stamp = min(p.stamp, self._tier_stamp(self.blocks[p.block].parent, p.lc, tier))
                c = self._new_page(p.block, p.lc, tier, group, s, p.priority)
                cp = self.pt[c]
                cp.copy = True
                cp.stamp = stamp
                cp.ready = event
                self._link_copy(pid, c)
                self.counters_.copies_made[tier] += 1
                self.queues[tier][group].push(c)
            else:
                self._release_slot(tier, group, s, event)
        settled, live = self._end_claims(batch)
        self._queue_all(live)
        self._relabel_later(live)
        return settled

    def swap_to_copies(self, pages: Pages, dst_tier: int) -> tuple:
        """Victims claimed for a move to ``dst_tier``: a victim that is itself
        a copy leaves (its primary stays), and one whose chain has an
        unclaimed copy in ``dst_tier`` takes over that copy's slot (no bytes
        move; its copies warmer than ``dst_tier`` go). (claims that no
        remaining victim holds, their source slots (fenced as drop_victims
        does), the victims still to move)."""
        _require(0 <= dst_tier < TIERS, "swap_to_copies: no such tier")
        claims: list[int] = []
        slots: list[int] = []
        rest: list[int] = []
        done: list[int] = []
        shed_disk: list[int] = []               # slots of disk copies shed
        disk_group = -1
        for pid in _page_ids(pages):
            p = self.pt[pid]
            c = -1                              # the copy a primary swaps onto
            if not p.dead and not p.copy and p.tier < dst_tier:
                c = self._copy_in(pid, dst_tier)
                if c >= 0 and self.pt[c].claim:
                    c = -1
            # a copy leaves even if it died since it was claimed (freed with its chain, its slot kept
            # for this claim): moved down, it would be written under its block's key
            if not p.copy and (p.dead or c < 0):
                rest.append(pid)
                continue
            _require(p.claim > 0, "swap_to_copies: a victim that is not claimed")
            self.owners[p.tier][p.group][p.slot] = -1
            self.allocs[p.tier][p.group].fence[p.slot] = p.ready   # its next owner waits on the page's last copy
            slots.append(p.slot)
            done.append(pid)
            if p.copy:                          # a clean copy leaves; its primary stays
                if not p.dead:
                    self._unlink_copy(pid)
                    self.counters_.copies_evicted[p.tier] += 1
                if p.tier == DISK:              # the disk forgets it, as drop_victims has it
                    shed_disk.append(p.slot)
                    disk_group = p.group
                continue
            cp = self.pt[c]
            self._unqueue(c)
            self._unlink_copy(c)
            self._free_copies(pid, dst_tier)    # copies warmer than its new tier (skipped to the disk)
            p.tier, p.group, p.slot, p.ready = cp.tier, cp.group, cp.slot, cp.ready
            self.owners[p.tier][p.group][p.slot] = pid
            cp.dead = True
            self._maybe_recycle(c)
            self.counters_.copy_swaps[p.tier] += 1
        if not done:
            return (claims, slots, Pages(rest))
        if shed_disk:
            self.disk_frees.append((disk_group, shed_disk))
        still: list[int] = []                   # claims a victim still to move holds stay open
        for pid in rest:
            c = self.pt[pid].claim
            if c and c not in still:
                still.append(c)
        moved: list[int] = []
        for pid in sorted(done, key=lambda i: self.pt[i].stamp):
            p = self.pt[pid]
            if p.claim not in still and p.claim not in claims:
                claims.append(p.claim)
            p.claim = 0
            if p.copy:
                p.dead = True
                self._maybe_recycle(pid)
                continue
            moved.append(pid)
            if not p.queued and self._evictable(p):
                self.queues[p.tier][p.group].push(pid)
        self._relabel_later(moved)
        return (claims, slots, Pages(rest))

    def discard_unwritten(self, pages: Pages, event: int) -> list[int]:
        """A spill that landed before its write, and the write failed: its pages still on
        the disk with ``event`` as their ready event and not claimed are dropped (or freed),
        as ``discard_corrupt`` does. Returns their depths."""
        _require(event > 0, "discard_unwritten: an event id > 0")
        return [self._discard_page(pid) for pid in _page_ids(pages)
                if (p := self.pt[pid]).in_use and not p.dead and p.tier == DISK and p.ready == event
                and p.claim == 0]

    def _discard_page(self, pid: int) -> int:
        """Drop (a published page), free, or (a clean copy: its primary stays) unlink and free a
        disk page that will never be served; its depth."""
        p = self.pt[pid]            # not counted in discarded: the disk tier counts the pages it found bad
        depth = self.blocks[p.block].depth if p.block >= 0 else -1
        if p.copy:
            self._unlink_copy(pid)
            self._free_page(pid)
        elif p.published:
            self._drop(pid)
        else:
            self._free_page(pid)
        return depth

    def discard_corrupt(self, pages: Pages, bad_slots: list[int]) -> list[int]:
        """Disk pages found corrupt (at these slots) are never served: drop
        (or free) them. Returns their depths."""
        bad = set(bad_slots)
        return [self._discard_page(pid) for pid in _page_ids(pages)
                if (p := self.pt[pid]).in_use and not p.dead and p.tier == DISK and p.slot in bad]

    # -- the disk tier across restarts ------------------------------------------------------------------------------
    def _reaches_disk(self, b: int, chosen: set[int], memo: dict[int, bool]) -> bool:
        """A block reaches the disk when one of its pages does (on disk, with
        a copy, or chosen) and every prefix-critical one does, and so does its
        parent: recovery needs the parent's key to attach a record."""
        path = []
        x = b
        while x >= 0 and x not in memo:
            path.append(x)
            x = self.blocks[x].parent
        ok = x < 0 or memo[x]
        for node in reversed(path):
            blk = self.blocks[node]
            any_there, critical = False, True
            for lc, pid in enumerate(blk.pages):
                if pid < 0:
                    continue
                p = self.pt[pid]
                there = not p.dead and (p.tier == DISK or self._copy_in(pid, DISK) >= 0 or pid in chosen)
                any_there = any_there or there
                if not there and self.lcs[lc].prefix_critical(blk.depth, self.tpb):
                    critical = False
            ok = ok and any_there and critical
            memo[node] = ok
        return ok

    def persist_anchors(self, candidates: list[Pages]) -> Pages:
        """The evictable disk pages (primaries there, and copies) of every block
        above a persist candidate; claimed while persisting, so that making room
        never evicts an ancestor of a page being persisted."""
        seen: set[int] = set()
        out: set[int] = set()

        def climb(b: int) -> None:
            x = self.blocks[b].parent
            while x >= 0 and x not in seen:
                seen.add(x)
                for q in self.blocks[x].pages:
                    if q < 0 or self.pt[q].dead:
                        continue
                    d = q if self.pt[q].tier == DISK else self._copy_in(q, DISK)
                    if d >= 0 and self.pt[d].queued:
                        out.add(d)
                x = self.blocks[x].parent

        for pages in candidates:
            for pid in pages.tolist():
                if 0 <= pid < len(self.pt) and self.pt[pid].in_use and self.pt[pid].block >= 0:
                    climb(self.pt[pid].block)
        if self.wt_on[DISK]:                    # copies interleave in recency: every disk page's ancestors
            for owners in self.owners[DISK]:
                for pid in owners:
                    if pid >= 0 and self.pt[pid].block >= 0:
                        climb(self.pt[pid].block)
        return Pages(sorted(out))

    def persist_candidates(self) -> list[Pages]:
        """Per disk group: published pages not on disk (nor with a copy there),
        unclaimed and unlocked, most recent first, at most the group's
        capacity; only those whose blocks reach the disk (their ancestors'
        pages do too), before and after the capacity cut: a page persisted
        under an ancestor that stays behind is unreachable after a restart."""
        out: list[list[int]] = [[] for _ in self.allocs[DISK]]
        if not out:
            return []
        pending = []
        chosen: set[int] = set()
        for b in self.index.values():
            for pid in self.blocks[b].pages:
                if pid < 0:
                    continue
                p = self.pt[pid]
                if (not p.dead and p.published and p.tier != DISK and not p.claim and not p.locks
                        and self._copy_in(pid, DISK) < 0):
                    pending.append(pid)
                    chosen.add(pid)

        def keep_reachable(pids: list[int]) -> list[int]:
            memo: dict[int, bool] = {}
            kept = []
            for pid in pids:
                if self._reaches_disk(self.pt[pid].block, chosen, memo):
                    kept.append(pid)
                else:
                    chosen.discard(pid)
            return kept

        pending = keep_reachable(pending)
        pending.sort(key=lambda pid: (-self.pt[pid].stamp, pid))    # most recent first; ties by id
        room = [a.capacity for a in self.allocs[DISK]]
        capped = []
        for pid in pending:
            g = self.group_of[DISK][self.pt[pid].lc]
            if room[g] > 0:
                room[g] -= 1
                capped.append(pid)
            else:
                chosen.discard(pid)
        for pid in keep_reachable(capped):
            out[self.group_of[DISK][self.pt[pid].lc]].append(pid)
        return [Pages(ids) for ids in out]

    def still_persistable(self, pages: Pages, group: int) -> Pages:
        """Those of ``pages`` (ids taken before awaits) that are still the
        index's pages, bound for disk group ``group``, idle and not on disk."""
        out = []
        for pid in _page_ids(pages):
            if not 0 <= pid < len(self.pt):
                continue
            p = self.pt[pid]
            if (p.in_use and not p.dead and not p.claim and p.tier != DISK and p.published and p.block >= 0
                    and self.blocks[p.block].pages[p.lc] == pid and self.group_of[DISK][p.lc] == group
                    and self._copy_in(pid, DISK) < 0):
                out.append(pid)
        return Pages(out)

    def recover_add(self, records, groups) -> None:
        """Recovered journal records (``RECORD`` bytes as a uint8 array, in
        write order) and the disk group of each; ``recover`` then rebuilds
        the index from all of them."""
        groups = np.asarray(groups)
        raw = np.asarray(records)
        if raw.dtype != np.uint8 or raw.ndim != 1 or groups.dtype != np.int32 or groups.ndim != 1:
            raise TypeError("recover_add: records must be a 1-d uint8 array and groups a 1-d int32 array")
        if len(raw) != len(groups) * journal.RECORD.itemsize:
            raise ValueError("recover_add: records must be 64 bytes per group entry")
        for g, r in zip(groups.tolist(), np.frombuffer(raw.tobytes(), dtype=journal.RECORD)):
            ktag, ptag = int(r["ktag"]), int(r["ptag"])
            anonymous = ktag == journal.TAG_ANONYMOUS
            has_parent = ptag != journal.TAG_NONE
            bad = (not anonymous and ktag > 16) or (has_parent and ptag > 16)
            key = None if anonymous or bad else journal.decode_key(r["key_lo"], r["key_hi"], ktag)
            parent = journal.decode_key(r["parent_lo"], r["parent_hi"], ptag) if has_parent and not bad else None
            depth, slot, gen = int(r["depth"]), int(r["slot"]), int(r["gen"])
            # a record the core cannot hold (bad key form, depth past int32) is discarded
            self.pending_records.append(_Record(key, parent, has_parent, anonymous,
                                                -1 if bad or depth >= 1 << 31 else depth, int(r["lc"]), g,
                                                -1 if slot >= 1 << 31 else slot, int(r["priority"]),
                                                min(gen, (1 << 63) - 1)))

    def recover(self) -> list[list[int]]:
        """Rebuild the index from the records added. Returns the slots to
        forget per disk group: records that cannot be recovered, then pages
        unreachable because an ancestor's prefix-critical page is missing.
        Counters: recovered and orphaned (set), discarded (added to)."""
        forget = self._recover(self.pending_records)
        self.pending_records = []
        return forget

    def _recover(self, records: list["_Record"]) -> list[list[int]]:
        ng = len(self.allocs[DISK])
        forget: list[list[int]] = [[] for _ in range(ng)]
        taken = [bytearray(a.capacity) for a in self.allocs[DISK]]
        unreachable = 0                                     # records whose parent is not on disk: orphaned, not bad
        for r in sorted(records, key=lambda r: r.depth):    # parents before children (stable)
            if not 0 <= r.group < ng:
                continue                                    # no such group: nothing to forget either
            in_range = 0 <= r.slot < self.allocs[DISK][r.group].capacity
            if r.anonymous:                                 # a page no index knew: nothing to recover
                if in_range:
                    forget[r.group].append(r.slot)
                continue
            ok = (in_range and 0 <= r.lc < self._n_lcs and self.group_of[DISK][r.lc] == r.group and r.depth >= 0
                  and not taken[r.group][r.slot])
            parent = self._find(r.parent) if ok and r.has_parent else -1
            if ok and r.depth > 0 and r.has_parent and parent < 0:   # well formed; its parent never reached the disk
                unreachable += 1
                if not taken[r.group][r.slot]:
                    forget[r.group].append(r.slot)
                continue
            if ok and r.depth > 0 and (parent < 0 or self.blocks[parent].depth != r.depth - 1):
                ok = False
            if ok and r.depth == 0 and r.has_parent:
                ok = False
            node = self._find(r.key) if ok else -1
            if ok and node >= 0 and (self.blocks[node].parent != parent or self.blocks[node].pages[r.lc] >= 0):
                ok = False
            if not ok:
                self.counters_.discarded += 1
                if in_range and not taken[r.group][r.slot]:
                    forget[r.group].append(r.slot)
                continue
            if node < 0:
                node = self._new_block(parent, r.depth)
                self.blocks[node].key, self.blocks[node].has_key = r.key, True
                self._insert(node)
            pid = self._new_page_id()
            p = self.pt[pid]
            p.lc, p.tier, p.group, p.slot = r.lc, DISK, r.group, r.slot
            p.priority = min(max(r.priority, 0), 100)
            p.published = True
            self._set_block(pid, node)
            self.blocks[node].pages[r.lc] = pid
            self.owners[DISK][r.group][r.slot] = pid
            taken[r.group][r.slot] = 1
        for g, a in enumerate(self.allocs[DISK]):
            a.reset_used(taken[g])
        # blocks missing a prefix-critical page can never match: drop them with their subtrees
        before = self._count_disk()
        nodes = sorted(self.index.values(), key=lambda b: (self.blocks[b].depth, b))
        for b in nodes:
            blk = self.blocks[b]
            if not blk.in_use or not blk.indexed:
                continue
            if any(self.lcs[lc].prefix_critical(blk.depth, self.tpb) and blk.pages[lc] < 0
                   for lc in range(self._n_lcs)):
                self._drop_subtree(b)
        self.counters_.orphaned = unreachable + before - self._count_disk()
        # Recency is not journaled. Deepest first, then in write order: a block is never older than
        # its descendants, and shallow blocks, which more requests share, go last.
        gen = {}
        for r in records:                                   # in write order: a slot's last record wins
            gen[(r.group, r.slot)] = r.generation
        pages = [pid for owners in self.owners[DISK] for pid in owners if pid >= 0]
        pages.sort(key=lambda pid: (-self.blocks[self.pt[pid].block].depth,
                                    gen.get((self.pt[pid].group, self.pt[pid].slot), 0)))
        for pid in pages:
            self._clock += 1
            self.pt[pid].stamp = self._clock
            self._requeue(pid)
        self.counters_.recovered = len(pages)
        for g, slots in self.disk_frees:
            forget[g].extend(slots)
        self.disk_frees = []
        return forget

    def _count_disk(self) -> int:
        return sum(1 for owners in self.owners[DISK] for pid in owners if pid >= 0)

    # -- drains ------------------------------------------------------------------------------------------------
    def take_disk_frees(self) -> list[tuple[int, list[int]]]:
        """Disk slots to forget since the last call, (group, slots) with runs of one group merged."""
        out: list[tuple[int, list[int]]] = []
        for g, slots in self.disk_frees:
            if out and out[-1][0] == g:
                out[-1][1].extend(slots)
            else:
                out.append((g, list(slots)))
        self.disk_frees = []
        return out

    def take_relabels(self) -> list[tuple[int, list[int], Pages]]:
        """Pages published while resting on disk (and still there, live and
        published): (disk group, slots, pages) per group in order of first appearance."""
        by_group: dict[int, list[int]] = {}
        for pid in self.relabels:
            p = self.pt[pid]
            if not p.in_use or p.dead or p.tier != DISK or not p.published:
                continue
            by_group.setdefault(p.group, []).append(pid)
        self.relabels = []
        return [(g, [self.pt[pid].slot for pid in ids], Pages(ids)) for g, ids in by_group.items()]

    # -- tools and tests -------------------------------------------------------------------------------------------
    def tier_pages(self, tier: int, group: int) -> Pages:
        """The pages owning slots of (tier, group), by slot."""
        self._check_tier_group(tier, group)
        return Pages(pid for pid in self.owners[tier][group] if pid >= 0)

    def claim_resident(self, tier: int, group: int, lo: int, hi: int) -> tuple[int, Pages]:
        """For a scrub: claims, one claim for all, the pages owning slots [lo, hi) of (tier,
        group) that are live and unclaimed, clean copies too, by slot: (the claim id, 0 when
        none; the pages)."""
        self._check_tier_group(tier, group)
        own = self.owners[tier][group]
        out, claim = [], 0
        for s in range(max(lo, 0), min(hi, len(own))):
            pid = own[s]
            if pid < 0:
                continue
            p = self.pt[pid]
            if p.dead or p.claim:
                continue
            if not claim:
                claim = self._next_claim()
            p.claim = claim
            self._unqueue(pid)                  # claimed pages are no eviction's victims (unclaim requeues)
            out.append(pid)
        return claim, Pages(out)

    def drop_page(self, pid: int) -> None:
        """Drop a published page as the last tier's eviction would."""
        _require(0 <= pid < len(self.pt) and self.pt[pid].in_use and not self.pt[pid].dead
                 and self.pt[pid].published and not self.pt[pid].claim,
                 "drop_page: not a live, published, unclaimed page")
        self._drop(pid)

    # -- queries -------------------------------------------------------------------------------------------------
    def hit_pages(self) -> list[list[int]]:
        """Pages open_sequence matched in each pool group, [tier][group]."""
        return [list(row) for row in self.hit_pages_]

    def counters(self) -> dict:
        c = self.counters_
        return {"hits": tuple(c.hits), "lookup_blocks": c.lookup_blocks, "drops": c.drops,
                "recovered": c.recovered, "orphaned": c.orphaned, "discarded": c.discarded,
                "copies_made": tuple(c.copies_made), "copies_kept": tuple(c.copies_kept),
                "copy_swaps": tuple(c.copy_swaps), "copies_evicted": tuple(c.copies_evicted),
                "copies": tuple(c.copies)}

    def state_counts(self) -> list[list[list[int]]]:
        """Per (tier, group): [locked, held, droppable] page counts."""
        out = []
        for t in range(TIERS):
            row = []
            for owners in self.owners[t]:
                c = [0, 0, 0]
                for pid in owners:
                    if pid < 0:
                        continue
                    p = self.pt[pid]
                    c[0 if p.locks else 2 if p.copy else 1 if (p.holders or not p.published) else 2] += 1
                row.append(c)
            out.append(row)
        return out

    def indexed_blocks(self) -> int:
        return len(self.index)

    def live_pages(self) -> int:
        return self.live

    def live_blocks(self) -> int:
        return sum(1 for b in self.blocks if b.in_use)

    def memory_bytes(self) -> int:
        """A rough figure (the model's objects are not the core's arrays)."""
        return 64 * len(self.pt) + (48 + 4 * self._n_lcs) * len(self.blocks) + 8 * len(self.index) + \
            4 * sum(a.capacity for t in self.allocs for a in t)

    def last_tier(self) -> int:
        return self._last_tier

    def page_info(self, pid: int) -> dict:
        p = self.pt[pid]
        return {"tier": p.tier, "group": p.group, "slot": p.slot, "lc": p.lc, "locks": p.locks,
                "holders": p.holders, "published": p.published, "dead": p.dead, "copy": p.copy, "claim": p.claim,
                "stamp": p.stamp, "priority": p.priority,
                "depth": self.blocks[p.block].depth if p.block >= 0 else -1,
                "key": self.blocks[p.block].key if p.block >= 0 and self.blocks[p.block].has_key else None}

    def find(self, key) -> tuple | None:
        """An indexed block: (depth, parent key or None, [page id per life cycle]), or None."""
        b = self._find(to_key(key))
        if b < 0:
            return None
        x = self.blocks[b]
        return (x.depth, self.blocks[x.parent].key if x.parent >= 0 else None, list(x.pages))

    def check(self) -> None:
        """Raise CoreError naming the first broken invariant (core.cpp's order)."""
        copies = [0] * TIERS
        for t in range(TIERS):
            for g, a in enumerate(self.allocs[t]):
                used = queued = 0
                for s in range(a.capacity):
                    pid = self.owners[t][g][s]
                    if pid < 0:
                        continue
                    used += 1
                    p = self.pt[pid]
                    _require(p.in_use and not p.dead, "a dead page owns a slot")
                    _require(not a.is_free(s), "a slot is owned and free")
                    _require(p.tier == t and p.group == g and p.slot == s, "a page is misfiled")
                    _require((p.queued != NOT_QUEUED) == self._evictable(p),
                             "queue membership differs from evictability")
                    if p.copy:
                        copies[t] += 1
                        _require(t in (HOST, DISK) and not p.published and not p.holders and not p.locks,
                                 "a copy outside the cold tiers, or held")
                        _require(p.block >= 0 and self.blocks[p.block].indexed,
                                 "a copy of a block that is not indexed")
                        primary = self.blocks[p.block].pages[p.lc]
                        _require(primary >= 0 and self._copy_in(primary, t) == pid,
                                 "a copy its block's chain does not name")
                    queued += p.queued != NOT_QUEUED
                _require(used == a.used, "owned slots differ from allocated slots")
                _require(queued == self.queues[t][g].size, "a queue's length differs from its members")
        indexed = 0
        for b, x in enumerate(self.blocks):
            if not x.in_use or not x.indexed:
                continue
            indexed += 1
            _require(self._find(x.key) == b, "an indexed block is not found under its key")
            _require(x.parent < 0 or self.blocks[x.parent].indexed, "an indexed block's parent is not indexed")
            for pid in x.pages:
                if pid < 0:
                    continue
                p = self.pt[pid]
                _require(p.in_use and p.published and not p.dead and not p.copy,
                         "an index page is unpublished, dead or a copy")
                prev, c, n = pid, self.copy_map.get(pid, -1), 0
                while c >= 0:
                    cp = self.pt[c]
                    _require(cp.in_use and cp.copy and not cp.dead, "a chain names no live copy")
                    _require(cp.block == b and cp.lc == p.lc, "a chain's copy of another block")
                    _require(cp.tier > self.pt[prev].tier, "a chain that does not grow colder")
                    prev, c, n = c, self.copy_map.get(c, -1), n + 1
                _require(n < TIERS, "a chain longer than the tiers")
                _require(self.owners[p.tier][p.group][p.slot] == pid, "an index page does not own its slot")
        _require(indexed == len(self.index), "the key map's size differs from the indexed blocks")
        for t in range(TIERS):
            _require(copies[t] == self.counters_.copies[t], "the copy count differs from the copies")
        # every link names a live copy from a live page of its chain (a recycled id has no entry)
        for pid, c in sorted(self.copy_map.items()):
            p = self.pt[pid]
            _require(p.in_use and not p.dead and (p.copy or (p.block >= 0 and self.blocks[p.block].pages[p.lc] == pid)),
                     "a copy link from a page that is neither a primary nor a copy")
            _require(self.pt[c].in_use and self.pt[c].copy and not self.pt[c].dead and self.pt[c].block == p.block,
                     "a link to no live copy")

    def _check_deep(self) -> None:
        """Invariants beyond check() (the model's own bookkeeping; tests call
        it between operations, when no acquire is half done): holders count
        sequence rows, locks count acquired sequences' locked lists, block
        references add up, queues hold their pages in eviction order."""
        holders: dict[int, int] = {}
        locks: dict[int, int] = {}
        refs: dict[int, int] = {}
        for q in self.seqs:
            if not q.in_use:
                continue
            for b in q.blocks:
                refs[b] = refs.get(b, 0) + 1
            for row in q.pages:
                for pid in row:
                    if pid >= 0:
                        holders[pid] = holders.get(pid, 0) + 1
            for pid in q.locked:
                locks[pid] = locks.get(pid, 0) + 1
        for pid, p in enumerate(self.pt):
            if not p.in_use:
                continue
            assert p.holders == holders.get(pid, 0), f"page {pid}: {p.holders} holders, {holders.get(pid, 0)} rows"
            assert p.locks == locks.get(pid, 0), f"page {pid}: {p.locks} locks, {locks.get(pid, 0)} locked lists"
            if p.block >= 0:
                refs[p.block] = refs.get(p.block, 0) + 1
            assert not p.dead or p.holders or p.locks or p.claim, f"page {pid}: dead and unreferenced, not recycled"
        for b, x in enumerate(self.blocks):
            if x.in_use:
                assert x.refs == refs.get(b, 0) + x.indexed, f"block {b}: {x.refs} refs"
                assert all(self.blocks[c].indexed and self.blocks[c].parent == b for c in x.children)
        for t in self.queues:
            for q in t:
                for order in q.order:
                    stamps = [self.pt[pid].stamp for pid in order]
                    assert stamps == sorted(stamps), "a queue's in-order list is out of order"


class _Record:
    __slots__ = ("key", "parent", "has_parent", "anonymous", "depth", "lc", "group", "slot", "priority",
                 "generation")

    def __init__(self, key, parent, has_parent, anonymous, depth, lc, group, slot, priority, generation):
        self.key, self.parent, self.has_parent, self.anonymous = key, parent, has_parent, anonymous
        self.depth, self.lc, self.group, self.slot = depth, lc, group, slot
        self.priority, self.generation = priority, generation

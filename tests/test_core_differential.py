"""Differential tests: the native core (runtime.core.Core) against its
pure-Python model (runtime.core.model.ModelCore).

A ``Pair`` holds one of each, built from the same configuration, and makes
every call on both: results must be equal (page lists compared by their ids,
errors by kind and message), and after every mutating call the clock,
counters, free counts and queue lengths must agree; after every step of a
state machine, everything the API shows does (state counts, check(), the
pages owning each slot and their records, the sequences' rows, the index).

A ``Driver`` performs the store's multi-call operations on a pair the way the
asyncio side (runtime/sequence.py, runtime/moves.py) drives the core: extend
(allocate, or evict: pick victims, then demote them a tier down, cascading, or drop them in the last tier),
acquire (fast path, else scan / fill holes / wait for claims / lock / promote
cold pages / finish, or give up and unlock), release, commit, close,
prefetch, background demotion, persisting to disk, restarting from the disk's
records, with moves that land (with events, handing source slots off or
freeing them fenced) or fail (slots given back, claims ended, corrupt disk
pages discarded). Moves can be left in flight across steps, so pages die,
get published or are needed while claimed. With write-through on for the
host or the disk (a share of the runs with that tier; all of
test_core_matches_model_write_through and ..._host_write_through) it also
copies published pages there as the Store does (take_copies, slots,
land_copies or a failure; in flight too), demotes victims onto their copies
and sheds the copies among them (swap_to_copies). Every claim made must be settled
exactly once, and the open claims are exactly those pages hold.

What these tests found in the core's first cut (all fixed since) has a
regression test at the end, with its minimal repro. A discrepancy found
later gets a strict xfail test there, naming the line in core.cpp, while
the model keeps the old store's semantics. scripts/sanitize.sh runs this
file against an ASan+UBSan build of the core.
"""
from __future__ import annotations

import collections
import itertools
import json
import pathlib
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from runtime.core import Core, CoreError, Pages as CPages
from runtime.core import _core
from runtime.core.model import CoreError as MCoreError, ModelCore, Pages as MPages, chain_block_keys
from tiers import journal
from tiers.errors import UsageError

GPU, HOST, DISK = 0, 1, 2
REQUIRED, SINK_REQUIRED_ONLY, OPTIONAL, PRIVATE = 0, 1, 2, 3
ANON = b""

# -- both sides at once --------------------------------------------------------------------------------------


class PP:
    """A page list on both sides (the core's Pages and the model's)."""

    __slots__ = ("core", "model")

    def __init__(self, core: CPages, model: MPages) -> None:
        self.core, self.model = core, model

    @classmethod
    def of(cls, ids) -> "PP":
        return cls(CPages(list(ids)), MPages(list(ids)))

    def tolist(self) -> list[int]:
        return self.model.tolist()

    def __len__(self) -> int:
        n = len(self.model)
        assert len(self.core) == n and bool(self.core) == bool(self.model)
        return n

    def slice(self, a: int, b: int) -> "PP":
        c, m = self.core.slice(a, b), self.model.slice(a, b)
        assert c.tolist() == m.tolist(), ("slice", a, b, c.tolist(), m.tolist())
        return PP(c, m)

    def __repr__(self) -> str:
        return f"PP({self.model.tolist()})"


def _side(x, i: int):
    if isinstance(x, PP):
        return x.core if i == 0 else x.model
    if isinstance(x, list):
        return [_side(v, i) for v in x]
    if isinstance(x, tuple):
        return tuple(_side(v, i) for v in x)
    if isinstance(x, dict):
        return {k: _side(v, i) for k, v in x.items()}
    return x


def _join(a, b, where: str):
    """Assert the core's result ``a`` equals the model's ``b`` (types too);
    returns it with page lists as PP."""
    if isinstance(a, CPages) and isinstance(b, MPages):
        assert a.tolist() == b.tolist(), f"{where}: pages {a.tolist()} != {b.tolist()}"
        return PP(a, b)
    assert type(a) is type(b), f"{where}: {type(a).__name__} {a!r} != {type(b).__name__} {b!r}"
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: {_plain(a)} != {_plain(b)}"
        return type(a)(_join(x, y, where) for x, y in zip(a, b))
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: {a!r} != {b!r}"
        return {k: _join(a[k], b[k], where) for k in a}
    assert a == b, f"{where}: {a!r} != {b!r}"
    return a


def _plain(x):
    if isinstance(x, (CPages, MPages, PP)):
        return ("Pages", x.tolist())
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    return x


def _error_kind(e: BaseException) -> str:
    if isinstance(e, (CoreError, MCoreError)):
        return "CoreError"
    for kind in (IndexError, ValueError, TypeError):
        if isinstance(e, kind):
            return kind.__name__
    return type(e).__name__


class Raised(Exception):
    """Both sides raised the same kind of error (with the same message, but for TypeErrors)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(kind, message)
        self.kind, self.message = kind, message


QUERIES = {"free", "capacity", "used", "is_free", "queue_len", "n_groups", "counters", "state_counts",
           "indexed_blocks", "live_pages", "live_blocks", "last_tier", "check", "page_info", "seq_pages", "find",
           "num_blocks", "committed", "acquired", "page_indices", "locked_slots", "recompute_blocks",
           "ready_events", "prefetch_pages", "claims_of", "cold_pages", "group_counts", "droppable",
           "split_batches", "batch_view", "disk_records", "slot_fences", "persist_candidates", "still_persistable",
           "persist_anchors",
           "tier_pages", "copy_of", "copies_pending", "write_through"}


KV_EVENT = np.dtype([("hash", "<u8"), ("parent", "<u8"), ("token_at", "<i4"), ("kind", "u1"), ("tier", "i1"),
                     ("lc", "u1"), ("has_parent", "u1")])
CALLS: collections.Counter = collections.Counter()     # calls made, by name and outcome (coverage at a glance)


class Pair:
    def __init__(self, tpb: int, lcs: list, group_of: list, capacity: list, write_through: tuple = ()) -> None:
        self.config = (tpb, lcs, group_of, capacity)
        self.write_through = write_through
        self.core = Core(tpb, lcs, group_of, capacity)
        self.core.set_kv_events(True)
        self.held: set[tuple[int, int, int]] = set()    # (hash, tier, lc) as a router learns it from KV events
        self.model = ModelCore(tpb, lcs, group_of, capacity)
        self.groups = [len(row) for row in capacity]
        self.calls = 0
        self.log: collections.deque = collections.deque(maxlen=40)
        self.open_claims: set[int] = set()      # claims made and not settled yet (each settles once)
        for tier in write_through:      # as the Store sets it up: right after construction
            self.call("set_write_through", tier, True)

    def call(self, name: str, *args):
        self.calls += 1
        self.log.append((name, args))
        try:
            rc, ce = getattr(self.core, name)(*_side(args, 0)), None
        except Exception as e:      # noqa: BLE001
            rc, ce = None, e
        try:
            rm, me = getattr(self.model, name)(*_side(args, 1)), None
        except Exception as e:      # noqa: BLE001
            rm, me = None, e
        CALLS[name] += 1
        if ce is not None or me is not None:
            CALLS[f"{name} raised"] += 1
            assert ce is not None and me is not None, \
                f"{self.where()}: only one side raised: core {ce!r}, model {me!r}"
            kind = _error_kind(ce)
            same = kind == _error_kind(me) and (kind == "TypeError" or str(ce) == str(me))
            assert same, f"{self.where()}: core raised {ce!r}, model {me!r}"
            raise Raised(kind, str(ce))
        try:
            out = _join(rc, rm, name)
        except AssertionError as e:
            raise AssertionError(f"{self.where()}: {e}") from None
        if name not in QUERIES:
            self.track_claims(name, out)
            self.compare_light()
            self.check_kv_events()
        return out

    OPENS = {"claim": lambda r: r, "pick_victims": lambda r: r[1] if r is not None else [],
             "take_copies": lambda r: r[1], "claim_resident": lambda r: [r[0]] if r[0] else []}
    SETTLES = {"unclaim": lambda r: r, "land_copies": lambda r: r, "land": lambda r: r[0],
               "drop_victims": lambda r: r[0], "swap_to_copies": lambda r: r[0]}

    def track_claims(self, name: str, out) -> None:
        """What the Store's futures need: a claim is made once, and settled once (by a call that
        returns it), after which no page holds it."""
        if name in self.OPENS:
            made = self.OPENS[name](out)
            assert not set(made) & self.open_claims, f"{self.where()}: claims {made} made twice"
            self.open_claims.update(made)
        elif name in self.SETTLES:
            settled = self.SETTLES[name](out)
            assert len(set(settled)) == len(settled) and set(settled) <= self.open_claims, \
                f"{self.where()}: settled {settled}, open {sorted(self.open_claims)}"
            self.open_claims.difference_update(settled)

    def check_claims(self) -> None:
        """Exactly the open claims are held by pages (a claim nobody settles hangs its waiters)."""
        held = {p.claim for p in self.model.pt if p.in_use and p.claim}   # the core's: compare_full compares them
        assert held == self.open_claims, \
            f"after {self.where()}: pages hold claims {sorted(held)}, open {sorted(self.open_claims)}"

    def check_kv_events(self) -> None:
        """The core's KV events, applied in order, give exactly the pages it publishes per tier."""
        ev = np.frombuffer(self.core.take_kv_events()[0], dtype=KV_EVENT)
        for h, kind, tier, lc in zip(ev["hash"].tolist(), ev["kind"].tolist(), ev["tier"].tolist(), ev["lc"].tolist()):
            entry = (h, tier, lc)
            if kind == 0:
                assert entry not in self.held, f"{self.where()}: stored twice: {entry}"
                self.held.add(entry)
            else:
                assert entry in self.held, f"{self.where()}: removed, never stored: {entry}"
                self.held.discard(entry)
        h, t, l = self.core.published_hashes()
        truth = set(zip(np.frombuffer(h, np.uint64).tolist(), np.frombuffer(t, np.int8).tolist(),
                        np.frombuffer(l, np.uint8).tolist()))
        assert self.held == truth, f"{self.where()}: events say {sorted(self.held ^ truth)} wrongly"

    def where(self) -> str:
        """The last calls (the failing one last), for a failure's message."""
        return "calls " + "; ".join(f"{n}{_plain(a)}" for n, a in list(self.log)[-15:])

    def query(self, name: str, *args):
        """A query whose answer must agree (no state check)."""
        return self.call(name, *args)

    @staticmethod
    def light_state(side, groups) -> tuple:
        return (side.clock, side.counters(), side.hit_pages(), side.live_pages(), side.write_through(HOST),
                side.write_through(DISK),
                side.copies_pending(HOST), side.copies_pending(DISK),
                [(side.free(t, g), side.queue_len(t, g)) for t in range(3) for g in range(groups[t])])

    def compare_light(self) -> None:
        """Clock, counters, live pages, free counts and queue lengths."""
        c, m = self.light_state(self.core, self.groups), self.light_state(self.model, self.groups)
        assert c == m, f"after {self.where()}: core {c} != model {m}"

    def check_result(self) -> str | None:
        outcomes = []
        for side in (self.core, self.model):
            try:
                side.check()
                outcomes.append(None)
            except (CoreError, MCoreError) as e:
                outcomes.append(str(e))
        assert outcomes[0] == outcomes[1], f"check(): core {outcomes[0]!r}, model {outcomes[1]!r}"
        return outcomes[0]

    def snapshot(self, side, seqs, keys) -> dict:
        """Everything the API shows of one side (page lists as id lists)."""
        out = {"light": self.light_state(side, self.groups)}
        for name in ("state_counts", "indexed_blocks", "live_blocks", "last_tier"):
            out[name] = getattr(side, name)()
        for t in range(3):
            for g in range(self.groups[t]):
                pages = side.tier_pages(t, g)
                out[("pages", t, g)] = (side.capacity(t, g), side.used(t, g), pages.tolist(), side.batch_view(pages),
                                        side.disk_records(pages),
                                        [side.page_info(pid) for pid in pages.tolist()])
        for s in seqs:
            out[("seq", s)] = (side.seq_pages(s), side.num_blocks(s), side.committed(s), side.acquired(s),
                               [(side.page_indices(s, lc), side.locked_slots(s, lc), side.recompute_blocks(s, lc))
                                for lc in range(len(self.config[1]))])
        out["all pages"] = [side.page_info(pid) for pid in range(len(self.model.pt))]   # dead and free ids too
        out["copies"] = [side.copy_of(pid) for pid in range(len(self.model.pt))]
        out["find"] = [side.find(k) for k in keys]
        out["persist"] = [p.tolist() for p in side.persist_candidates()]
        return out

    def compare_full(self, seqs=(), keys=()) -> None:
        """Everything the API shows, compared (a step's invariant)."""
        c, m = self.snapshot(self.core, seqs, keys), self.snapshot(self.model, seqs, keys)
        if c != m:
            diff = next(k for k in c if c[k] != m.get(k))
            raise AssertionError(f"after {self.where()}: {diff}: core {c[diff]} != model {m[diff]}")
        self.check_result()
        self.check_claims()


def _key_form(key) -> tuple[int, int, int]:
    """(lo, hi, tag) of a key as a record holds it; a key no writer could encode gets tag 200
    (a form the core refuses), None or b'' the anonymous tag."""
    if key is None or key == ANON:
        return 0, 0, journal.TAG_ANONYMOUS
    try:
        return journal.encode_key(key)
    except UsageError:
        return 0, 0, 200


def to_records(rows) -> tuple[np.ndarray, np.ndarray]:
    """Rows of (key, parent, depth, life cycle, group, slot, priority, generation), any values, as
    recover_add takes them: journal records (uint8) and a group per record. Values the record cannot
    hold are kept as a hostile journal would spell them: -1 as all ones, priorities saturated."""
    recs = np.zeros(len(rows), dtype=journal.RECORD)
    groups = np.zeros(len(rows), dtype=np.int32)
    for i, (key, parent, depth, lc, group, slot, prio, gen) in enumerate(rows):
        recs[i]["key_lo"], recs[i]["key_hi"], recs[i]["ktag"] = _key_form(key)
        if parent is None:
            recs[i]["ptag"] = journal.TAG_NONE
        else:
            lo, hi, tag = _key_form(parent)
            recs[i]["parent_lo"], recs[i]["parent_hi"], recs[i]["ptag"] = lo, hi, 200 if tag == 255 else tag
        recs[i]["depth"] = depth & 0xFFFFFFFF
        recs[i]["lc"] = lc & 0xFFFF
        recs[i]["slot"] = slot & 0xFFFFFFFF
        recs[i]["priority"] = min(max(prio, 0), 255)
        recs[i]["gen"] = gen
        groups[i] = group
    return recs.view(np.uint8), groups


def from_records(raw: bytes) -> list[tuple]:
    """(key, parent, depth, life cycle, priority) per record of disk_records' bytes."""
    out = []
    for r in np.frombuffer(raw, dtype=journal.RECORD):
        d = journal.decode(r)
        out.append((None if d.key == ANON else d.key, d.parent, d.depth, d.life_cycle, d.priority))
    return out


# -- the Store's operations, on a pair -----------------------------------------------------------------------

class Failed(Exception):
    """What the Store would raise: OutOfPagesError, or a failed move."""


class MoveFailed(Failed):
    """A copy failed (the engine's error, or a corrupt disk page); ``full``: a disk write the
    full filesystem refused (the Store's DiskFullError)."""

    def __init__(self, msg: str, full: bool = False) -> None:
        super().__init__(msg)
        self.full = full


class Pending:
    """A move left in flight: a prefetch's promotion, a background demotion or
    a write-through batch of copies (``batches``: [pages, disk group, slots
    taken or None] of those still claimed)."""

    def __init__(self, kind: str, pages: PP, claims: list[int], tier: int = GPU, group: int = 0) -> None:
        self.kind, self.pages, self.claims, self.tier, self.group = kind, pages, claims, tier, group
        self.batches: list[list] = []


class Driver:
    def __init__(self, pair: Pair, rng: random.Random, fail_rate: float = 0.0) -> None:
        self.pair = pair
        self.rng = rng
        self.fail_rate = fail_rate
        tpb, lcs, group_of, capacity = pair.config
        self.lcs, self.group_of, self.capacity = lcs, group_of, capacity
        present = [t for t in range(3) if capacity[t]]
        self.next_tier = {t: (present[i + 1] if i + 1 < len(present) else -1) for i, t in enumerate(present)}
        self.last_tier = present[-1]
        self.lcs_per_gpu_group: dict[int, int] = {}
        for lc in range(len(lcs)):
            g = group_of[GPU][lc]
            self.lcs_per_gpu_group[g] = self.lcs_per_gpu_group.get(g, 0) + 1
        self.seqs: dict[int, list] = {}         # open sequence id -> its keys
        self.pending: list[Pending] = []
        self.events = itertools.count(1)

    def call(self, name, *args):
        return self.pair.call(name, *args)

    # slots ----------------------------------------------------------------------------------------------
    def obtain_many(self, tier: int, counts) -> dict[int, list[int]]:
        got: dict[int, list[int]] = {}
        try:
            for g, n in counts:
                got[g] = self.obtain(tier, g, n)
        except Failed:
            for g, slots in got.items():
                self.call("give_back", tier, g, slots)
            raise
        return got

    def obtain(self, tier: int, group: int, n: int) -> list[int]:
        try:
            return self._obtain(tier, group, n)
        except Failed as exc:
            CALLS[f"obtain from tier {tier} failed: {exc}"] += 1
            raise

    def _obtain(self, tier: int, group: int, n: int) -> list[int]:
        free = self.call("free", tier, group)
        if n <= free:
            return self.call("allocate", tier, group, n)
        got = self.call("allocate", tier, group, free)
        try:
            extra = self.rng.choice((0, 0, 1, 2)) if tier != self.last_tier else 0
            picked = self.call("pick_victims", tier, group, n - len(got), extra)
            if picked is None:
                raise Failed("out of pages")
            victims, _claims = picked
            freed = self.evict(tier, victims, group)
        except Failed:
            self.call("give_back", tier, group, got)
            raise
        need = n - len(got)
        if len(freed) > need:
            self.call("release_slots", tier, group, freed[need:], 0)
        return got + freed[:need]

    @property
    def write_through(self) -> tuple:
        return self.pair.write_through

    def evict(self, tier: int, victims: PP, group: int) -> list[int]:
        """Demote (or drop) claimed victims of (tier, group); their slots go to the caller. With
        write-through, copies among the victims leave and victims with a copy in the next tier
        take it over first (no bytes move), as the Store does; when a colder tier was full and
        the victims skip to the disk, only sometimes onto their disk copies, so that the rest land
        on the disk with their copies (which then go), or, refused by a full disk, swap then."""
        nxt = self.next_tier[tier]
        handed: list[int] = []
        first = True
        declined = -1                   # the tier whose copies the victims passed over (the Store's _may_swap)
        try:
            if self.write_through and nxt == -1:        # the last tier: its copies leave before the drop
                _claims, slots, victims = self.call("swap_to_copies", victims, tier)
                handed += slots
                if not len(victims):
                    return handed
            while nxt != -1:
                declined = -1
                if self.write_through and (first or self.rng.random() < 0.5):
                    _claims, slots, victims = self.call("swap_to_copies", victims, nxt)
                    handed += slots
                    if not len(victims):
                        return handed
                elif self.write_through:
                    declined = nxt
                first = False
                try:
                    slots = self.obtain_many(nxt, self.call("group_counts", victims, nxt))
                except Failed as exc:
                    if isinstance(exc, MoveFailed):
                        self.call("unclaim", victims)
                        raise
                    if declined != -1:          # as the Store: the copies passed over, before going on
                        _claims, slots, victims = self.call("swap_to_copies", victims, declined)
                        handed += slots
                        if not len(victims):
                            return handed
                    nxt = self.next_tier[nxt]
                    if nxt == -1 and not self.call("droppable", victims):
                        self.call("unclaim", victims)
                        raise
                else:
                    freed, failed, _src = self.move_batches(victims, nxt, slots, handoff=True, hold_full=True)
                    handed += freed
                    if not failed:
                        return handed
                    # as the Store: a full disk keeps the batches that landed; the refused victims
                    # (still claimed) swap onto the copies they passed over, and are dropped when
                    # they may be; else they are unclaimed and the error raised
                    held = [b for b, e in failed.items() if e.full]
                    victims = PP.of([i for b in held for i in b.tolist()])
                    if len(held) < len(failed):
                        if held:
                            self.call("unclaim", victims)
                        raise next(e for e in failed.values() if not e.full)
                    if declined != -1:
                        _claims, slots, victims = self.call("swap_to_copies", victims, declined)
                        handed += slots
                        if not len(victims):
                            return handed
                    if not self.call("droppable", victims):
                        self.call("unclaim", victims)
                        raise next(iter(failed.values()))
                    break
            _claims, freed = self.call("drop_victims", tier, victims)
            return handed + freed
        except Failed:
            if handed:                  # slots of the victims that took over their copies: nobody takes them now
                self.call("give_back", tier, group, handed)
            raise

    def move_claimed(self, pages: PP, dst_tier: int, slots: dict[int, list[int]], handoff: bool) -> list[int]:
        freed, failed, src = self.move_batches(pages, dst_tier, slots, handoff)
        if failed:
            if handoff and freed:
                self.call("release_slots", *src, freed, 0)
            raise next(iter(failed.values()))
        return freed

    def move_batches(self, pages: PP, dst_tier: int, slots: dict[int, list[int]], handoff: bool,
                     hold_full: bool = False) -> tuple[list[int], dict, tuple[int, int]]:
        """The slots the landed batches freed, {failed batch: its error}, and the source (tier, group);
        with ``hold_full`` a batch the full disk refused keeps its claims."""
        freed, failed = [], {}
        batches = self.call("split_batches", pages, dst_tier)
        for _src_tier, _src_group, g, batch in batches:
            mine = sorted(slots[g][:len(batch)])
            del slots[g][:len(batch)]
            try:
                freed += self.move_batch(batch, dst_tier, g, mine, handoff, hold_full)
            except MoveFailed as exc:
                failed[batch] = exc
        return freed, failed, (batches[0][0], batches[0][1])

    def move_batch(self, batch: PP, dst_tier: int, g: int, dst_slots: list[int], handoff: bool,
                   hold_full: bool = False) -> list[int]:
        src_tier, _src_group, src_slots, _lcs, _ready = self.call("batch_view", batch)
        self.call("slot_fences", dst_tier, g, dst_slots)
        self.call("disk_records", batch)
        if self.fail_rate and self.rng.random() < self.fail_rate:
            full = dst_tier == DISK and self.rng.random() < 0.5
            self.call("give_back", dst_tier, g, dst_slots)
            if not (hold_full and full):
                self.call("unclaim", batch)
            if src_tier == DISK and self.rng.random() < 0.6:
                bad = self.rng.sample(src_slots, self.rng.randint(1, len(src_slots)))
                self.call("discard_corrupt", batch, bad)
            raise MoveFailed("copy failed", full=full)
        event = next(self.events) if self.rng.random() < 0.9 else 0
        if src_tier == HOST and dst_tier == DISK and self.rng.random() < 0.5:
            # a spill written behind: its source rows were copied out, its slots need no fence
            _claims, freed = self.call("land", batch, dst_tier, g, dst_slots, event, handoff, 0)
            if handoff:
                assert not self.call("slot_fences", src_tier, _src_group, freed), "a fenced slot after fence=0"
            if event and self.rng.random() < 0.15:
                self.call("discard_unwritten", batch, event)    # its write failed after it landed
        else:
            _claims, freed = self.call("land", batch, dst_tier, g, dst_slots, event, handoff)
        return freed

    # sequences ---------------------------------------------------------------------------------------------
    def open(self, keys: list, priority: int) -> tuple:
        s, matched, by_tier = self.call("open", keys, priority)
        self.seqs[s] = list(keys)
        return s, matched, by_tier

    def append(self, s: int, keys: list) -> None:
        self.call("append_keys", s, keys)
        self.seqs[s].extend(keys)

    def extend(self, s: int, n: int) -> bool:
        counts = [(g, n * k) for g, k in self.lcs_per_gpu_group.items()]
        if any(c > self.capacity[GPU][g] for g, c in counts):
            return False                        # the Store refuses it (UsageError)
        if self.rng.random() < 0.8:
            if self.call("extend_now", s, n) is not None:        # the Store's fast path
                return True
        elif all(self.call("free", GPU, g) >= c for g, c in counts):
            self.call("place_extension", s, n, {g: self.call("allocate", GPU, g, c) for g, c in counts})
            return True
        if n == 0:
            return True
        try:
            slots = self.obtain_many(GPU, counts)
        except Failed:
            return False
        self.call("place_extension", s, n, slots)
        return True

    def acquire(self, s: int) -> bool:
        if self.call("acquire_now", s):
            return True
        for _ in range(8):
            holes, claims = self.call("acquire_scan", s)
            if holes:
                counts: dict[int, int] = {}
                for lc in holes[1::2]:
                    g = self.group_of[GPU][lc]
                    counts[g] = counts.get(g, 0) + 1
                try:
                    slots = self.obtain_many(GPU, list(counts.items()))
                except Failed:
                    return False
                self.call("fill_holes", s, holes, slots)
                continue
            if not claims:
                break
            waits = [op for op in self.pending if set(op.claims) & set(claims)]
            assert waits, f"claims {claims} held by no operation in flight"
            if self.rng.random() < 0.15:
                return False                    # the caller gave up waiting
            for op in waits:
                self.complete(op)
        else:
            return False
        pages = self.call("lock_needed", s)
        try:
            cold = self.call("cold_pages", pages)
            if cold.tolist():
                self.call("claim", cold, GPU, False)
                try:
                    slots = self.obtain_many(GPU, self.call("group_counts", cold, GPU))
                except Failed:
                    self.call("unclaim", cold)
                    raise
                self.move_claimed(cold, GPU, slots, handoff=False)
        except Failed as exc:
            CALLS[f"acquire: promotion failed: {exc}"] += 1
            if self.rng.random() < 0.5:
                self.call("unlock", pages)
            else:
                self.call("undo_acquire", s, pages)
            return False
        self.call("finish_acquire", s, pages)
        self.call("ready_events", s)
        return True

    def release(self, s: int, event: bool) -> None:
        self.call("release", s, next(self.events) if event else 0)

    def commit(self, s: int, n: int) -> int:
        before = (self.pair.core.clock, self.pair.core.counters(), self.pair.core.state_counts())
        bad = self.call("commit", s, n)
        if bad >= 0:        # nothing changed
            assert (self.pair.core.clock, self.pair.core.counters(), self.pair.core.state_counts()) == before
        return bad

    def close(self, s: int) -> None:
        self.call("close", s)
        del self.seqs[s]

    # moves in flight -----------------------------------------------------------------------------------------
    def prefetch(self, s: int, now: bool) -> None:
        pages = self.call("prefetch_pages", s)
        if not pages.tolist():
            return
        claims = self.call("claim", pages, GPU, False)
        op = Pending("promote", pages, claims)
        self.pending.append(op)
        if now:
            self.complete(op)

    def background_demotion(self, tier: int, group: int, want: int) -> None:
        """A reclaimer's batch: victims claimed now, moved when completed."""
        picked = self.call("pick_victims", tier, group, want, 0)
        if picked is not None:
            victims, claims = picked
            self.pending.append(Pending("demote", victims, claims, tier, group))

    def complete(self, op: Pending) -> None:
        self.pending.remove(op)
        if op.kind == "promote":
            try:
                slots = self.obtain_many(GPU, self.call("group_counts", op.pages, GPU))
            except Failed:
                self.call("unclaim", op.pages)
                return
            try:
                self.move_claimed(op.pages, GPU, slots, handoff=False)
            except Failed:
                pass
        elif op.kind == "copy":
            self.finish_copies(op)
        elif op.kind == "scrub":
            self.end_scrub(op.pages)
        else:
            try:
                freed = self.evict(op.tier, op.pages, op.group)
            except Failed:
                return
            self.call("release_slots", op.tier, op.group, freed, 0)

    def scrub(self, g: int, lo: int, hi: int, now: bool) -> None:
        """A piece of the disk scrub (runtime/scrub.py): its pages claimed while a thread reads them,
        here left in flight (other operations meanwhile) unless ``now``."""
        claim, pages = self.call("claim_resident", DISK, g, lo, hi)
        if claim:
            op = Pending("scrub", pages, [claim], DISK, g)
            self.pending.append(op)
            if now:
                self.complete(op)

    def end_scrub(self, pages: PP) -> None:
        """The piece read: unclaimed, now and then some dropped as found bad."""
        slots = self.call("batch_view", pages)[2]
        self.call("unclaim", pages)
        if self.rng.random() < 0.3:
            self.call("discard_corrupt", pages, self.rng.sample(list(slots), self.rng.randint(0, min(2, len(slots)))))

    def give_up(self, op: Pending) -> None:
        self.pending.remove(op)
        if op.kind == "copy":
            for batch, g, slots in op.batches:
                if slots is not None:
                    self.call("give_back", op.tier, g, slots)
                self.call("unclaim", batch)
        else:
            self.call("unclaim", op.pages)

    # write-through -------------------------------------------------------------------------------------------
    def copy_step(self, tier: int, n: int, leave: int = 0) -> None:
        """The Store's write-through to ``tier``: claim up to ``n`` queued pages, then per batch (source
        tier and group, destination group) take slots (evicting, copies too), copy and land them, or
        fail. leave: 0 done now; 1 left in flight before its slots are taken; 2 in flight with its
        slots taken."""
        pages, claims = self.call("take_copies", tier, n)
        if not len(pages):
            assert claims == []
            return
        op = Pending("copy", pages, claims, tier)
        op.batches = [[batch, g, None] for _t, _g, g, batch in self.call("split_batches", pages, tier)]
        if leave == 2:
            for entry in list(op.batches):
                try:
                    entry[2] = self.obtain(tier, entry[1], len(entry[0]))
                except Failed:
                    self.call("unclaim", entry[0])
                    op.batches.remove(entry)
        if leave == 0:
            self.finish_copies(op)
        elif op.batches:
            self.pending.append(op)

    def finish_copies(self, op: Pending) -> None:
        batches, op.batches = op.batches, []
        for batch, g, slots in batches:
            if slots is None:
                try:
                    slots = self.obtain(op.tier, g, len(batch))
                except Failed:
                    self.call("unclaim", batch)
                    continue
            slots = sorted(slots)
            self.call("batch_view", batch)
            self.call("slot_fences", op.tier, g, slots)
            if op.tier == DISK:
                self.call("disk_records", batch)
            if self.fail_rate and self.rng.random() < self.fail_rate:
                self.call("give_back", op.tier, g, slots)
                self.call("unclaim", batch)
                continue
            event = next(self.events) if self.rng.random() < 0.9 else 0
            self.call("land_copies", batch, op.tier, g, slots, event)

    def persist(self, chunk: int) -> None:
        candidates = self.call("persist_candidates")
        anchors = self.call("persist_anchors", candidates)     # pinned: eviction takes only leaves
        if anchors.tolist():
            self.call("claim", anchors, DISK, False)
        try:
            self._persist(candidates, chunk)
        finally:
            if anchors.tolist():
                self.call("unclaim", anchors)

    def _persist(self, candidates, chunk: int) -> None:
        for g, pages in enumerate(candidates):
            for i in range(0, len(pages), chunk):
                part = self.call("still_persistable", pages.slice(i, i + chunk), g)
                if not part.tolist():
                    continue
                self.call("claim", part, DISK, False)
                try:
                    slots = self.obtain(DISK, g, len(part))
                except Failed:
                    self.call("unclaim", part)
                    break
                try:
                    self.move_claimed(part, DISK, {g: slots}, handoff=False)
                except Failed:
                    pass

    def drain(self) -> None:
        self.call("take_disk_frees")
        self.call("take_relabels")

    def settle_all(self) -> None:
        while self.pending:
            self.complete(self.pending[0])

    # restart -----------------------------------------------------------------------------------------------------
    def disk_records(self, spoil: float) -> list[list]:
        """Recovery columns for the pages on disk (as the disk tier's journal
        would give them back), some spoiled: anonymous, bad life cycle, bad
        slot, a missing parent, a duplicate, a key the core cannot hold."""
        rng = self.rng
        rows = []
        gen = itertools.count(1)
        for g in range(len(self.capacity[DISK])):
            pages = self.call("tier_pages", DISK, g)
            _, _, slots, _, _ = self.call("batch_view", pages)
            for (key, parent, depth, lc, prio), slot in zip(from_records(self.call("disk_records", pages)), slots):
                rows.append([key if key is not None else ANON, parent, depth, lc, g, slot, prio, next(gen)])
        rng.shuffle(rows)
        out = []
        for r in rows:
            if rng.random() < spoil:
                what = rng.randrange(7)
                r = list(r)
                if what == 0:
                    r[3] = rng.choice((-1, len(self.lcs), 99))                 # bad life cycle
                elif what == 1:
                    r[5] = rng.choice((-1, self.capacity[DISK][r[4]], 10_000))  # bad slot
                elif what == 2:
                    r[1] = 1 << 90                                              # a parent nobody has
                elif what == 3:
                    out.append(list(r))                                          # a duplicate (same slot)
                elif what == 4:
                    out.append(list(r))
                    r[5] = rng.randrange(self.capacity[DISK][r[4]])              # the same block elsewhere
                elif what == 5:
                    r[0] = rng.choice((None, ANON))                              # anonymous
                else:
                    r[0] = rng.choice((1 << 130, 1.5, "text"))                   # a key the core cannot hold
            out.append(r)
        return out

    def restart(self, spoil: float) -> bool:
        rows = self.disk_records(spoil)
        fresh = Pair(*self.pair.config, write_through=self.pair.write_through)
        fresh.calls = self.pair.calls
        for i in range(0, max(len(rows), 1), 5):        # added in chunks, as the Store does
            chunk = rows[i:i + 5]
            fresh.call("recover_add", *to_records(chunk))
        forget = fresh.call("recover")
        assert len(forget) == len(self.capacity[DISK])
        self.pair = fresh
        self.seqs = {}
        self.pending = []
        self.drain()
        return True


# -- configurations ------------------------------------------------------------------------------------------

TPB = 2
FULL = (False, 0, 0, REQUIRED)
SINK_WINDOW = (False, 6, 2, SINK_REQUIRED_ONLY)     # window: 3 blocks; sinks: 1 block
REQ_WINDOW = (False, 4, 2, REQUIRED)                # windowed REQUIRED: it limits matches
SSM = (True, 0, 0, REQUIRED)
OPT = (False, 0, 0, OPTIONAL)
PRIV = (False, 0, 0, PRIVATE)

# name: (life cycles, GPU group per lc, cold group per lc)
LAYOUTS = {
    "full": ([FULL], [0], [0]),
    "sink_window": ([FULL, SINK_WINDOW], [0, 0], [0, 0]),
    "req_window": ([REQ_WINDOW], [0], [0]),
    "ssm": ([SSM], [0], [0]),
    # two GPU groups; the cold tiers split the first and merge the second's lc into it
    "two_gpu_groups": ([FULL, SINK_WINDOW, SSM], [0, 0, 1], [0, 1, 1]),
    "optional": ([FULL, OPT], [0, 1], [0, 1]),
    "private": ([FULL, PRIV], [0, 1], [0, 1]),
    "all_private": ([PRIV], [0], [0]),
    "mix": ([FULL, SINK_WINDOW, REQ_WINDOW, SSM, OPT], [0, 0, 0, 1, 2], [0, 0, 1, 1, 2]),
}
TIER_SETS = ((GPU,), (GPU, HOST), (GPU, HOST, DISK), (GPU, DISK))


def make_config(layout: str, tiers: tuple, gpu_blocks: int, host: int, disk: int) -> tuple:
    lcs, gpu_of, cold_of = LAYOUTS[layout]
    n = len(lcs)
    group_of = [list(gpu_of), list(cold_of) if HOST in tiers else [-1] * n,
                list(cold_of) if DISK in tiers else [-1] * n]
    per_gpu_group = collections.Counter(gpu_of)
    capacity = [[per_gpu_group[g] * gpu_blocks for g in range(max(gpu_of) + 1)],
                [host] * (max(cold_of) + 1) if HOST in tiers else [],
                [disk] * (max(cold_of) + 1) if DISK in tiers else []]
    return TPB, list(lcs), group_of, capacity


# Chains of keys that share prefixes; sequences take a prefix of one and maybe a few stray keys
# (which repeat keys or put them at other positions: commit conflicts).
CHAINS = [
    [1, 2, 3, 4, 5, 6, 7],
    [1, 2, 3, 8, 9],
    [1, 2, 10, 11, 12],
    [1, 13, 14],
    [20, 21, 22, 23],
    [b"a", b"b", b"c", b"d"],
    [b"a", b"b", b"x" * 20, b"long key, digested" * 2],
    [1 << 100, -5, 2],
    [3, 4],
]
STRAY_INT = [1, 2, 3, 4, 7, 30, 31, -(1 << 127), (1 << 127) - 1]
STRAY_BYTES = [b"a", b"b", b"c", b"z", b"y" * 17]
UNIVERSE = sorted({k for c in CHAINS for k in c} | set(STRAY_INT) | set(STRAY_BYTES), key=repr)


@st.composite
def keys_strategy(draw):
    chain = draw(st.sampled_from(CHAINS))
    ints = isinstance(chain[0], int)
    keys = chain[:draw(st.integers(0, len(chain)))]
    fresh = st.integers(100, 400) if ints else st.binary(min_size=1, max_size=3)    # new blocks: churn
    keys += draw(st.lists(st.one_of(st.sampled_from(STRAY_INT if ints else STRAY_BYTES), fresh), max_size=4))
    if draw(st.integers(0, 24)) == 0:
        keys.append(b"q" if ints else 9)        # int and bytes keys mixed: refused
    return keys


priorities = st.sampled_from((35, 35, 0, 100, 50))


class CoreMachine(RuleBasedStateMachine):
    """One weighted ``step`` rule picks the next operation, so that the
    Store's common path (a request: open, extend, acquire, commit, release,
    close) dominates and the rest interleaves with it."""

    layout = "full"
    force_write_through: tuple = ()     # these tiers in every run, with write-through on

    def __init__(self) -> None:
        super().__init__()
        self.d: Driver | None = None

    @initialize(tiers=st.sampled_from(TIER_SETS), gpu_blocks=st.integers(4, 10), host=st.integers(2, 10),
                disk=st.integers(2, 12), seed=st.integers(0, 2 ** 16), fail=st.sampled_from((0.0, 0.1, 0.3)),
                wt=st.integers(0, 5))
    def setup(self, tiers, gpu_blocks, host, disk, seed, fail, wt):
        # write-through (clean copies) to the disk in 2 runs of 3 with a disk tier, to the host in
        # 1 of 2 with a host tier: all four combinations
        write_through = tuple(t for t, on in ((HOST, wt % 2), (DISK, wt % 3)) if on and t in tiers)
        if self.force_write_through:
            tiers = tuple(sorted(set(tiers) | set(self.force_write_through)))
            write_through = tuple(sorted(set(write_through) | set(self.force_write_through)))
        self.d = Driver(Pair(*make_config(self.layout, tiers, gpu_blocks, host, disk), write_through=write_through),
                        random.Random(seed), fail)

    OPS = (["request"] * 6 + ["twins"] * 2 + ["open"] * 2 + ["extend"] * 4 + ["append"] * 2 + ["acquire"] * 4
           + ["release"] * 3 + ["commit"] * 4 + ["close"] * 3 + ["prefetch"] * 2 + ["demote"] * 2 + ["settle"] * 3
           + ["drain"] * 2 + ["copy"] * 3 + ["undo_extend", "persist", "drop_page", "restart", "queries"] + ["scrub"] * 2)
    NEEDS_SEQ = {"extend", "append", "acquire", "release", "commit", "close", "undo_extend", "prefetch"}

    @rule(data=st.data(), op=st.sampled_from(OPS))
    def step(self, data, op):
        if op in self.NEEDS_SEQ and not self.d.seqs:
            op = "request"
        if op == "settle" and not self.d.pending:
            op = "demote"
        if op == "copy" and not self.d.write_through:
            op = "request"
        getattr(self, "op_" + op)(data)

    def _seq(self, data):
        return data.draw(st.sampled_from(sorted(self.d.seqs)))

    def _open(self, data):
        try:
            s, matched, _ = self.d.open(data.draw(keys_strategy()), data.draw(priorities))
        except Raised as e:
            assert e.kind == "ValueError", e        # int and bytes keys mixed
            return None
        return s

    def _acquire(self, s):
        try:
            return self.d.acquire(s)
        except Raised as e:                         # already acquired
            assert e.kind == "CoreError", e
            return False

    def op_request(self, data):
        if len(self.d.seqs) >= 3:
            s = self._seq(data)
            self.d.release(s, True)
            self.d.close(s)
        s = self._open(data)
        if s is None:
            return
        have, blocks = len(self.d.seqs[s]), self.d.call("num_blocks", s)
        if self.d.extend(s, max(0, have - blocks) + data.draw(st.integers(0, 1))) and self._acquire(s):
            stage = data.draw(st.sampled_from((0, 1, 2, 3, 3, 3)))   # how far it gets before the next step
            if stage >= 1:
                self.d.commit(s, min(have, self.d.call("num_blocks", s)))
            if stage >= 2:
                self.d.release(s, data.draw(st.booleans()))
            if stage >= 3:
                self.d.close(s)

    def op_twins(self, data):
        """Two requests for the same new blocks: the first commits, its pages
        go colder, then the second commits and adopts (a warmer copy replaces
        an idle colder one)."""
        if len(self.d.seqs) > 1:
            return
        base = data.draw(st.integers(500, 10_000))
        keys = [base + i for i in range(data.draw(st.integers(1, 3)))]
        a, _, _ = self.d.open(keys, 35)
        b, _, _ = self.d.open(keys, data.draw(priorities))
        if not (self.d.extend(a, len(keys)) and self.d.extend(b, len(keys))):
            return
        self.d.commit(a, len(keys))
        self.d.close(a)
        if self.d.capacity[HOST] or self.d.capacity[DISK]:
            self.d.background_demotion(GPU, data.draw(st.integers(0, len(self.d.capacity[GPU]) - 1)), 2 * len(keys))
            self.d.settle_all()
        self.d.commit(b, len(keys))

    def op_open(self, data):
        if len(self.d.seqs) < 4:
            self._open(data)

    def op_extend(self, data):
        s = self._seq(data)
        have, blocks = len(self.d.seqs[s]), self.d.call("num_blocks", s)
        self.d.extend(s, data.draw(st.sampled_from((max(0, have - blocks), 1, 2, 0))))

    def op_append(self, data):
        s = self._seq(data)
        have = self.d.seqs[s]
        pool = STRAY_BYTES if have and isinstance(have[0], bytes) else STRAY_INT + [5, 6, 9]
        self.d.append(s, data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=2)))

    def op_acquire(self, data):
        self._acquire(self._seq(data))

    def op_release(self, data):
        self.d.release(self._seq(data), data.draw(st.booleans()))

    def op_commit(self, data):
        s = self._seq(data)
        limit = min(self.d.call("num_blocks", s), len(self.d.seqs[s]))
        n = data.draw(st.sampled_from((limit, limit, max(0, limit - 1), limit + 1)))
        try:
            self.d.commit(s, n)
        except Raised as e:     # past the blocks or keys
            assert e.kind == "CoreError" and n > limit, e

    def op_close(self, data):
        self.d.close(self._seq(data))

    def op_undo_extend(self, data):
        self.d.call("undo_extend", self._seq(data), data.draw(st.integers(0, 2)))

    def op_prefetch(self, data):
        self.d.prefetch(self._seq(data), data.draw(st.booleans()))

    def op_demote(self, data):
        # the disk's reclaimer drops (or writes back) from the last tier too; the host's, only above one
        tiers = [t for t in (GPU, HOST, DISK) if self.d.capacity[t] and (t != self.d.last_tier or t == DISK)]
        if tiers:
            tier = data.draw(st.sampled_from(tiers))
            group = data.draw(st.integers(0, len(self.d.capacity[tier]) - 1))
            self.d.background_demotion(tier, group, data.draw(st.integers(1, 3)))

    def op_copy(self, data):
        self.d.copy_step(data.draw(st.sampled_from(self.d.write_through)),
                         data.draw(st.sampled_from((0, 1, 2, 3, 5, 8, 64))), data.draw(st.sampled_from((0, 1, 1, 2))))

    def op_settle(self, data):
        op = data.draw(st.sampled_from(self.d.pending))
        if op.kind == "demote" or data.draw(st.integers(0, 3)):
            self.d.complete(op)
        else:
            self.d.give_up(op)

    def op_persist(self, data):
        if self.d.capacity[DISK]:
            self.d.persist(data.draw(st.integers(1, 4)))

    def op_drop_page(self, data):
        t = self.d.last_tier
        candidates = []
        for g in range(len(self.d.capacity[t])):
            for pid in self.d.call("tier_pages", t, g).tolist():
                info = self.d.call("page_info", pid)
                if info["published"] and not info["claim"]:
                    candidates.append(pid)
        if candidates:
            self.d.call("drop_page", data.draw(st.sampled_from(candidates)))

    def op_scrub(self, data):
        if self.d.capacity[DISK]:
            g = data.draw(st.integers(0, len(self.d.capacity[DISK]) - 1))
            lo = data.draw(st.integers(-2, self.d.capacity[DISK][g]))
            self.d.scrub(g, lo, lo + data.draw(st.integers(0, 9)), data.draw(st.booleans()))

    def op_drain(self, data):
        self.d.drain()

    def op_restart(self, data):
        if self.d.capacity[DISK]:
            self.d.settle_all()
            self.d.persist(4)
            self.d.restart(data.draw(st.sampled_from((0.0, 0.3))))

    def op_queries(self, data):
        d = self.d
        for s in sorted(d.seqs):
            d.call("ready_events", s)
            pages = d.call("prefetch_pages", s)
            rows = PP.of([p for p in d.call("seq_pages", s) if p >= 0])
            for name in ("claims_of", "cold_pages", "droppable"):
                d.call(name, rows)
            for g in range(len(d.capacity[2])):
                d.call("still_persistable", rows, g)
            d.call("group_counts", rows, GPU)
            d.call("split_batches", pages, GPU)
        for t in range(3):
            for g in range(len(d.capacity[t])):
                cap = d.capacity[t][g]
                slots = data.draw(st.lists(st.integers(0, max(0, cap - 1)), max_size=3))
                d.call("slot_fences", t, g, slots)
                for slot in slots:
                    d.call("is_free", t, g, slot)
        # misuse: answered with the same error on both sides, nothing changed
        closed = max(d.seqs, default=-1) + 1
        misuse = [("commit", closed, 0), ("acquire_now", closed), ("close", closed), ("release", closed, 0),
                  ("free", 3, 0), ("allocate", GPU, 7, 1), ("is_free", GPU, 0, 10_000), ("pick_victims", 5, 0, 1, 0),
                  ("release_slots", GPU, 0, [10_000], 0), ("open", [b""], 35), ("open", [1 << 127], 35),
                  ("open", [True], 35), ("append_keys", closed, [1]), ("place_extension", closed, 0, {9: []}),
                  ("extend_now", closed, 1), ("drop_page", 10_000), ("take_copies", DISK, -1), ("copy_of", 10_000),
                  ("take_copies", GPU, 1), ("land_copies", PP.of([]), DISK, 99, [], 0),
                  ("land_copies", PP.of([]), GPU, 0, [], 0), ("set_write_through", GPU, True),
                  ("copies_pending", GPU), ("swap_to_copies", PP.of([]), 3)]
        for t in (HOST, DISK):
            if not d.capacity[t]:
                misuse.append(("set_write_through", t, True))   # no such tier
            elif d.pair.core.counters()["copies"][t]:
                misuse.append(("set_write_through", t, False))  # copies exist
            if t not in d.write_through:
                misuse.append(("take_copies", t, 1))            # write-through off
        for call in data.draw(st.lists(st.sampled_from(misuse), max_size=3)):
            try:
                d.call(*call)
            except Raised:
                pass
        if d.call("free", GPU, 0):
            slots = d.call("allocate", GPU, 0, 1)
            try:
                d.call("release_slots", GPU, 0, slots + slots, 0)     # repeated: nothing released
            except Raised as e:
                assert e.kind == "ValueError"
            d.call("give_back", GPU, 0, slots)

    @invariant()
    def agree(self):
        if self.d is None:
            return
        self.d.pair.compare_full(sorted(self.d.seqs), UNIVERSE)
        self.d.pair.model._check_deep()
        if not self.d.pending:
            assert self.d.pair.check_result() is None

    def teardown(self):
        if self.d is not None:
            self.d.settle_all()
            for s in sorted(self.d.seqs):
                self.d.close(s)
            self.d.drain()
            self.d.pair.compare_full((), UNIVERSE)
            assert self.d.pair.check_result() is None


MACHINE_SETTINGS = settings(max_examples=8, stateful_step_count=50, derandomize=True, database=None,
                            deadline=None, print_blob=False,
                            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_core_matches_model(layout):
    machine = type(f"CoreMachine_{layout}", (CoreMachine,), {"layout": layout})
    run_state_machine_as_test(machine, settings=MACHINE_SETTINGS)


@pytest.mark.parametrize("layout", ["full", "sink_window", "two_gpu_groups", "mix"])
def test_core_matches_model_write_through(layout):
    """Clean copies: copies taken, landed, kept on promotion, swapped onto, evicted, waited for."""
    machine = type(f"CoreMachineWT_{layout}", (CoreMachine,), {"layout": layout, "force_write_through": (DISK,)})
    run_state_machine_as_test(machine, settings=MACHINE_SETTINGS)


@pytest.mark.parametrize("layout", ["full", "sink_window", "two_gpu_groups", "mix"])
def test_core_matches_model_host_write_through(layout):
    """Clean copies in the host tier too (chains of a primary, a host copy and a disk copy): shed
    when the host evicts them, swapped onto by GPU demotions, kept when a host page is promoted."""
    machine = type(f"CoreMachineHWT_{layout}", (CoreMachine,),
                   {"layout": layout, "force_write_through": (HOST, DISK)})
    run_state_machine_as_test(machine, settings=MACHINE_SETTINGS)


# -- recovery from records (fresh pairs) ---------------------------------------------------------------------

record_rows = st.lists(st.tuples(
    st.sampled_from(UNIVERSE + [None, ANON, 1.5]),                 # key
    st.sampled_from(UNIVERSE[:8] + [None, None, None, 1 << 200]),  # parent
    st.integers(-1, 4),                                            # depth
    st.integers(-1, 2),                                            # life cycle
    st.integers(-1, 2),                                            # disk group
    st.integers(-1, 6),                                            # slot
    st.integers(-5, 120),                                          # priority
    st.integers(0, 5)), max_size=24)                               # generation


@pytest.mark.parametrize("layout", ["full", "sink_window", "mix"])
def test_recover_matches_model(layout):
    @settings(max_examples=60, derandomize=True, database=None, deadline=None, print_blob=False)
    @given(rows=record_rows, chained=st.booleans())
    def check(rows, chained):
        config = make_config(layout, (GPU, HOST, DISK), 2, 4, 6)
        pair = Pair(*config)
        if chained:     # a well-formed tree first, so that some records are accepted
            rows = [(k, CHAINS[0][i - 1] if i else None, i, 0, 0, i, 35, i) for i, k in enumerate(CHAINS[0][:5])] + rows
        records, groups = to_records(rows)
        pair.call("recover_add", records, groups)
        if rows:
            try:        # a record count that does not match the groups: refused, nothing added
                pair.call("recover_add", records, groups[:-1])
            except Raised as e:
                assert e.kind == "ValueError"
        pair.call("recover")
        pair.compare_full((), UNIVERSE)
        pair.call("take_disk_frees")
        d = Driver(pair, random.Random(len(rows)))
        s, matched, _ = d.open(CHAINS[0][:4], 35)
        d.extend(s, 4 - matched)
        d.acquire(s)
        pair.compare_full([s], UNIVERSE)
    check()


# -- a slice of the conversation trace -----------------------------------------------------------------------

TRACE = pathlib.Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"


def _trace_slice(n: int) -> list[list[int]]:
    out = []
    with TRACE.open() as f:
        for line in itertools.islice(f, n):
            out.append(json.loads(line)["hash_ids"])
    return out


@pytest.mark.skipif(not TRACE.exists(), reason="the shared conversation trace is not here")
@pytest.mark.parametrize("layout, tiers, gpu_blocks", [
    ("full", (GPU, HOST, DISK), 64),
    ("sink_window", (GPU, HOST, DISK), 48),
    ("full", (GPU, DISK), 48),
])
def test_trace_slice_matches_model(layout, tiers, gpu_blocks):
    """Replay the trace's first 300 requests (hash_ids as int keys) on small
    tiers, every move landing at once; then persist, restart from the disk's
    records and serve the last 40 again, newest first (the newest pages were
    persisted: disk hits, promoted)."""
    requests = _trace_slice(300)
    pair = Pair(*make_config(layout, tiers, gpu_blocks, 96, 160))
    d = Driver(pair, random.Random(7))

    def serve(keys: list[int]) -> bool:
        s, matched, _ = d.open(keys, 35)
        if matched > 1:
            d.prefetch(s, now=False)            # the acquire waits for it
        done = d.extend(s, len(keys) - matched) and d.acquire(s)
        if done:
            assert d.call("commit", s, len(keys)) == -1
            d.call("page_indices", s, 0)
            d.release(s, event=True)
        d.close(s)
        d.settle_all()
        d.drain()
        return done

    served = 0
    for i, keys in enumerate(requests):
        served += serve(keys)
        if i % 25 == 0:
            d.pair.compare_full((), keys[:4])
            assert d.pair.check_result() is None
    assert served > len(requests) // 2
    if DISK in tiers:
        d.persist(16)
        d.drain()
        d.restart(0.0)
        probe = [k for keys in requests[-20:] for k in keys[:3]]
        d.pair.compare_full((), probe)
        assert d.pair.core.counters()["recovered"] > 0
        for keys in reversed(requests[-40:]):
            serve(keys)
        d.pair.compare_full((), probe)
        assert d.pair.core.counters()["hits"][DISK] > 0
        assert d.pair.check_result() is None


# -- odds and ends -------------------------------------------------------------------------------------------

def test_constructor_errors_match():
    bad = [
        (0, [FULL], [[0], [0], [0]], [[2], [2], [2]]),
        (2, [], [[], [], []], [[2], [], []]),
        (2, [FULL], [[0], [0]], [[2], [2]]),
        (2, [FULL], [[0], [-1], [-1]], [[], [], []]),
        (2, [FULL, FULL], [[0], [-1], [-1]], [[2], [], []]),
        (2, [FULL], [[1], [-1], [-1]], [[2], [], []]),
        (2, [FULL], [[0], [-1], [-1]], [[-1], [], []]),
        (2, [(False, 0, 0, 7)], [[0], [-1], [-1]], [[2], [], []]),
    ]
    for args in bad:
        outcomes = []
        for make in (Core, ModelCore):
            try:
                make(*args)
                outcomes.append(None)
            except Exception as e:      # noqa: BLE001
                outcomes.append((_error_kind(e), str(e)))
        assert outcomes[0] == outcomes[1] and outcomes[0] is not None, (args, outcomes)


def test_chain_block_keys_match():
    rng = random.Random(3)
    for _ in range(20):
        tokens = b"".join(rng.randrange(-2 ** 63, 2 ** 63).to_bytes(8, "little", signed=True)
                          for _ in range(rng.randrange(0, 40)))
        tpb = rng.randrange(1, 9)
        salt = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 5)))
        parent = rng.choice((b"", bytes(16), b"p" * 16))
        assert _core.chain_block_keys(tokens, tpb, salt, parent) == chain_block_keys(tokens, tpb, salt, parent)
    for args in ((b"x" * 12, 1, b"", b""), (b"x" * 16, 0, b"", b"")):
        errors = []
        for f in (_core.chain_block_keys, chain_block_keys):
            with pytest.raises(ValueError) as e:
                f(*args)
            errors.append(str(e.value))
        assert errors[0] == errors[1]


def test_pages_objects_match():
    for ids in ([], [3], [5, 1, 9, 2]):
        c, m = CPages(ids), MPages(ids)
        assert (len(c), bool(c), c.tolist()) == (len(m), bool(m), m.tolist())
        for a, b in ((0, 2), (1, 1), (3, 1), (2, 99), (99, 100)):
            assert c.slice(a, b).tolist() == m.slice(a, b).tolist()


# -- regressions: what the core's first cut got wrong (found by these tests and the sanitizer; fixed) --------

def test_open_refuses_a_priority_out_of_range():
    """The first cut took any priority (uint8_t(priority)): 101..255 indexed
    past LruQueue::classes_ once its pages were queued, and 256 and up wrapped."""
    pair = Pair(2, [FULL], [[0], [0], [-1]], [[2], [2], []])
    for priority in (101, 255, 256, -1):
        with pytest.raises(Raised) as e:
            pair.call("open", [1], priority)
        assert e.value.kind == "ValueError"
    s, _, _ = pair.call("open", [1], 100)
    pair.call("extend_now", s, 1)
    assert pair.call("queue_len", GPU, 0) == 1
    victims, _ = pair.call("pick_victims", GPU, 0, 1, 0)            # priority 100 is still evictable
    assert victims.tolist() == pair.call("seq_pages", s)


def test_hot_path_answers_are_codes():
    """The calls of every request answer misuse with codes the Store turns into UsageErrors
    (no exception on the hot path): a second acquire_now, a commit past the blocks with
    pages or with keys; close returns the blocks committed. Both sides, the same codes."""
    from runtime.core import COMMIT_PAST_BLOCKS, COMMIT_PAST_KEYS
    from runtime.core import model as core_model
    assert (COMMIT_PAST_BLOCKS, COMMIT_PAST_KEYS) == (core_model.COMMIT_PAST_BLOCKS, core_model.COMMIT_PAST_KEYS)
    assert len({-1, COMMIT_PAST_BLOCKS, COMMIT_PAST_KEYS}) == 3
    pair = Pair(2, [FULL], [[0], [0], [-1]], [[4], [4], []])
    s, _, _ = pair.call("open", [1, 2], 35)
    assert pair.call("acquire_now", s) == 1
    assert pair.call("acquire_now", s) == -1                       # already acquired: nothing changed
    pair.call("extend_now", s, 1)
    assert pair.call("commit", s, 2) == COMMIT_PAST_BLOCKS         # one block has a page
    pair.call("extend_now", s, 2)
    assert pair.call("commit", s, 3) == COMMIT_PAST_KEYS           # three pages, two keys
    assert pair.call("commit", s, 2) == -1
    assert pair.call("close", s) == 2
    t, matched, _ = pair.call("open", [1, 2], 35)
    assert matched == 2 and pair.call("close", t) == 2             # matched blocks count as committed
    assert pair.check_result() is None


def test_commit_indexes_a_refilled_page():
    """A page refilled by fill_holes in an uncommitted row (its page was found
    corrupt on disk) becomes the block's page at commit. The first cut (and
    the old store) published it but left the index without a page: the block
    was indexed without its prefix-critical page and later requests matched
    it with no page at all."""
    pair = Pair(4, [FULL], [[0], [-1], [0]], [[1], [], [2]])       # GPU: 1 slot; disk: 2
    d = Driver(pair, random.Random(0))
    s, _, _ = d.open([1], 35)
    d.extend(s, 1)                                                  # an uncommitted page on the GPU ...
    victims, _ = pair.call("pick_victims", GPU, 0, 1, 0)
    (_, _, _, batch), = pair.call("split_batches", victims, DISK)
    _, freed = pair.call("land", batch, DISK, 0, pair.call("allocate", DISK, 0, 1), 1, True)
    pair.call("release_slots", GPU, 0, freed, 0)                    # ... demoted to disk
    pages = pair.call("lock_needed", s)                             # an acquire promotes it ...
    cold = pair.call("cold_pages", pages)
    pair.call("claim", cold, GPU, False)
    dst = pair.call("allocate", GPU, 0, 1)
    disk_slots = pair.call("batch_view", cold)[2]
    pair.call("give_back", GPU, 0, dst)                             # ... and the read finds it corrupt
    pair.call("unclaim", cold)
    assert pair.call("discard_corrupt", cold, disk_slots) == [0]
    pair.call("unlock", pages)
    holes, _ = pair.call("acquire_scan", s)
    pair.call("fill_holes", s, holes, {0: pair.call("allocate", GPU, 0, 1)})   # recomputed by the caller
    assert pair.call("acquire_now", s)
    assert pair.call("commit", s, 1) == -1
    page = pair.call("seq_pages", s)[0]
    assert pair.call("page_info", page)["published"]
    assert pair.call("find", 1)[2] == [page]
    d.release(s, event=False)
    d.close(s)
    s, matched, by_tier = d.open([1], 35)
    assert (matched, by_tier) == (1, (1, 0, 0, 0))
    pair.compare_full([s], [1])
    assert pair.check_result() is None


def test_recover_record_with_a_negative_group():
    """The first cut keyed generations by int64_t(group) << 32: a left shift of
    a negative value (undefined; UBSan aborted under scripts/sanitize.sh)."""
    pair = Pair(2, [FULL], [[0], [-1], [0]], [[2], [], [2]])
    pair.call("recover_add", *to_records([(1, None, 0, 0, -1, 0, 35, 1), (2, None, 0, 0, 0, 1, 35, 2)]))
    assert pair.call("recover") == [[]]
    assert pair.call("counters")["recovered"] == 1
    pair.compare_full((), [1, 2])


def test_subtree_drop_with_children_matches():
    """Dropping a block whose subtree holds indexed children (the first cut of
    the core crashed there: BlockIndex::erase walked an unindexed parent's
    emptied child list; the old store unlinked only from a listing parent)."""
    pair = Pair(4, [FULL], [[0], [-1], [-1]], [[4], [], []])
    d = Driver(pair, random.Random(0))
    s, _, _ = d.open([1], 0)                    # block 1 at priority 0 ...
    d.extend(s, 1)
    d.commit(s, 1)
    d.close(s)
    s, _, _ = d.open([1, 2, 3], 50)             # ... its descendants at priority 50
    d.extend(s, 2)
    d.commit(s, 3)
    d.close(s)
    victims, _ = pair.call("pick_victims", GPU, 0, 1, 0)
    assert victims.tolist() == pair.call("find", 1)[2]
    assert pair.call("drop_victims", GPU, victims) == ([1], [0])
    assert pair.call("indexed_blocks") == 0 and pair.call("free", GPU, 0) == 3
    pair.call("release_slots", GPU, 0, [0], 0)   # the victim's slot, handed to the caller
    pair.compare_full((), [1, 2, 3])
    assert pair.check_result() is None


def test_recover_takes_a_slots_generation_in_write_order():
    """Two records for one slot (a spoiled journal): recency comes from the slot's last record in
    write order, as the core reads them. The model took it in depth order (its records were sorted
    in place): pages of equal depth were stamped in another order."""
    pair = Pair(2, [FULL], [[0], [-1], [0]], [[2], [], [4]])
    rows = [(3, 1, 1, 0, 0, 0, 35, 9),          # block 1's child at block 1's slot: discarded
            (1, None, 0, 0, 0, 0, 35, 5),
            (2, None, 0, 0, 0, 1, 35, 7)]
    pair.call("recover_add", *to_records(rows))
    pair.call("recover")
    pair.compare_full((), [1, 2, 3])


def _page_with_a_copy(pair: Pair, key: int) -> int:
    """A committed GPU page of block ``key``, copied to the disk by write-through: its id."""
    s, _, _ = pair.call("open", [key], 35)
    pair.call("extend_now", s, 1)
    assert pair.call("commit", s, 1) == -1
    pair.call("close", s)
    pages, claims = pair.call("take_copies", DISK, 8)
    ((_, _, g, batch),) = pair.call("split_batches", pages, DISK)
    assert pair.call("land_copies", batch, DISK, g, pair.call("allocate", DISK, g, 1), 7) == claims
    (pid,) = pages.tolist()
    assert pair.call("copy_of", pid) >= 0
    return pid


def test_a_page_landing_on_disk_loses_its_copy():
    """A victim with a copy that moves to the disk itself (the host tier was full and it skipped
    there without swap_to_copies) kept its copy in the core's first cut of write-through: a primary
    on the disk named a copy (check(): "a copy its block's primary does not name") and the block
    held two disk slots. land() now frees the copy."""
    pair = Pair(2, [FULL], [[0], [0], [0]], [[2], [1], [4]], write_through=(DISK,))
    pid = _page_with_a_copy(pair, 1)
    victims, _ = pair.call("pick_victims", GPU, 0, 1, 0)
    assert victims.tolist() == [pid]
    before = pair.call("free", DISK, 0)
    _, freed = pair.call("land", victims, DISK, 0, pair.call("allocate", DISK, 0, 1), 8, True)
    pair.call("release_slots", GPU, 0, freed, 0)                    # the victim's GPU slot, handed over
    assert pair.call("copy_of", pid) == -1 and pair.call("free", DISK, 0) == before
    assert pair.call("counters")["copies"] == (0, 0, 0)
    pair.compare_full((), [1])
    assert pair.check_result() is None


def test_a_page_landing_on_disk_while_its_copy_is_dropped():
    """The copy is claimed by the disk's eviction (a drop in flight, such as a write-back) when its
    primary is demoted: swap_to_copies leaves it to move, and it lands on the disk. Its copy goes
    at once and keeps its slot for the drop, which hands it over."""
    pair = Pair(2, [FULL], [[0], [-1], [0]], [[2], [], [4]], write_through=(DISK,))
    pid = _page_with_a_copy(pair, 1)
    copy = pair.call("copy_of", pid)
    drops, _ = pair.call("pick_victims", DISK, 0, 1, 0)           # the copy: its drop in flight
    assert drops.tolist() == [copy]
    victims, _ = pair.call("pick_victims", GPU, 0, 1, 0)
    claims, slots, rest = pair.call("swap_to_copies", victims, DISK)
    assert (claims, slots, rest.tolist()) == ([], [], [pid])
    _, freed = pair.call("land", rest, DISK, 0, pair.call("allocate", DISK, 0, 1), 8, True)
    pair.call("release_slots", GPU, 0, freed, 0)
    assert pair.call("copy_of", pid) == -1 and pair.call("page_info", copy)["dead"]
    assert pair.call("counters")["copies"] == (0, 0, 0)
    slot = pair.call("page_info", copy)["slot"]
    assert pair.call("drop_victims", DISK, drops)[1] == [slot]     # the copy's slot, to the drop's caller
    pair.call("release_slots", DISK, 0, [slot], 0)
    assert pair.call("find", 1)[2] == [pid] and pair.call("page_info", pid)["tier"] == DISK
    pair.compare_full((), [1])
    assert pair.check_result() is None


def test_copy_claim_minus_one_is_settled():
    """The first copy claim is -1, which end_claims used as its "no claim yet" mark: landing or
    failing that batch settled nothing, and a Store future on it (an acquire of a host page
    being copied waits for it) would never have resolved."""
    pair = Pair(2, [FULL], [[0], [0], [0]], [[2], [2], [4]], write_through=(DISK,))
    s, _, _ = pair.call("open", [1, 2], 35)
    pair.call("extend_now", s, 2)
    assert pair.call("commit", s, 2) == -1
    pair.call("close", s)
    pages, claims = pair.call("take_copies", DISK, 1)
    assert claims == [-1] and len(pages) == 1
    assert pair.call("unclaim", pages) == [-1]                     # a failed copy
    pages, claims = pair.call("take_copies", DISK, 1)                    # the other page
    assert claims == [-2]
    assert pair.call("land_copies", pages, DISK, 0, pair.call("allocate", DISK, 0, 1), 3) == [-2]
    assert pair.call("copies_pending", DISK) == 1                       # the failed one is tried again
    pages, claims = pair.call("take_copies", DISK, 4)
    assert claims == [-3] and len(pages) == 1
    assert pair.call("land_copies", pages, DISK, 0, pair.call("allocate", DISK, 0, 1), 4) == [-3]
    assert pair.call("copies_pending", DISK) == 0 and pair.call("counters")["copies"] == (0, 0, 2)
    pair.compare_full((), [1, 2])
    assert pair.check_result() is None


def test_a_copy_that_died_while_claimed_is_shed_not_moved():
    """A host copy claimed as an eviction's victim dies before swap_to_copies runs (its prefix is
    dropped; the claim keeps its slot). The first cut returned it with the victims to move: the
    Store would have written it to the disk under its block's key, and disk_records read the key
    of a parent block whose id had been recycled (the core gave stale bytes, the model raised).
    It is shed now: its slot goes to the caller, with nothing to move."""
    pair = Pair(2, [FULL], [[0], [0], [0]], [[4], [4], [8]], write_through=(HOST,))
    s, _, _ = pair.call("open", [1, 2], 35)
    pair.call("extend_now", s, 2)
    assert pair.call("commit", s, 2) == -1
    pair.call("close", s)
    pages, _ = pair.call("take_copies", HOST, 8)
    ((_, _, g, batch),) = pair.call("split_batches", pages, HOST)
    pair.call("land_copies", batch, HOST, g, pair.call("allocate", HOST, g, len(batch)), 7)
    p1, p2 = pages.tolist()
    victims, _ = pair.call("pick_victims", HOST, 0, 1, 0)       # the LRU host page: block 2's copy
    (copy,) = victims.tolist()
    assert copy == pair.call("copy_of", p2)
    slot = pair.call("page_info", copy)["slot"]
    pair.call("drop_page", p1)                                  # drops the prefix: both copies die
    s2, _, _ = pair.call("open", [], 35)                        # a keyless block reuses block 1's id
    pair.call("extend_now", s2, 1)
    claims, slots, rest = pair.call("swap_to_copies", victims, DISK)
    assert (len(claims), slots, rest.tolist()) == (1, [slot], [])
    pair.call("release_slots", HOST, 0, slots, 0)
    assert pair.call("counters")["copies"] == (0, 0, 0)
    pair.call("close", s2)
    pair.compare_full((), [1, 2])
    assert pair.check_result() is None

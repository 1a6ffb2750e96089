"""The prioritised LRU against a plain model: pages leave in (priority, stamp)
order whatever mix of pushes (in order and late), touches and removals
came before."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from runtime.eviction import EvictionQueue


class P:
    __slots__ = ("name", "priority", "stamp", "qentry")

    def __init__(self, name: int, priority: int, stamp: int) -> None:
        self.name, self.priority, self.stamp, self.qentry = name, priority, stamp, None

    def __repr__(self) -> str:
        return f"P{self.name}(prio={self.priority}, stamp={self.stamp})"


ops = st.lists(st.tuples(st.sampled_from(["push_new", "push_old", "push_many", "touch", "remove", "pop"]),
                         st.integers(0, 3), st.integers(0, 1000)), max_size=300)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_pops_follow_priority_then_stamp(script):
    q = EvictionQueue()
    clock = 0
    queued: dict[int, P] = {}
    out: list[P] = []           # popped pages, pushed again later with old stamps
    names = iter(range(10**9))
    for op, prio, r in script:
        if op == "push_new" or (op == "push_old" and not out):
            clock += 1
            p = P(next(names), prio, clock)
            q.push(p)
            queued[p.name] = p
        elif op == "push_old":
            p = out.pop(r % len(out))           # comes back with the stamp it had (a demoted page)
            q.push(p)
            queued[p.name] = p
        elif op == "push_many" and out:
            # a batch coming back (a move landing): mostly ascending stamps, maybe mixed priorities
            batch = [out.pop(i % len(out)) for i in range(min(len(out), r % 7 + 1))]
            batch.sort(key=lambda p: p.stamp if r % 3 else -p.stamp)
            for i, p in enumerate(batch):
                if r % 2:
                    p.priority = (prio + i) % 4
            q.push_many(batch)
            queued.update((p.name, p) for p in batch)
        elif op == "touch" and queued:
            p = list(queued.values())[r % len(queued)]
            clock += 1
            p.stamp = clock
            q.touch(p)
        elif op == "remove" and queued:
            p = queued.pop(list(queued)[r % len(queued)])
            q.remove(p)
            assert p.qentry is None
            out.append(p)
        elif op == "pop":
            k = r % 5 + 1
            want = sorted(queued.values(), key=lambda p: (p.priority, p.stamp))[:k]
            got = q.pop_many(k)
            assert [p.name for p in got] == [p.name for p in want]
            for p in got:
                assert p.qentry is None
                del queued[p.name]
                out.append(p)
        assert len(q) == len(queued)
        assert all(p.qentry is not None for p in queued.values())
    rest = q.pop_many(len(queued) + 3)
    assert [p.name for p in rest] == [p.name for p in sorted(queued.values(), key=lambda p: (p.priority, p.stamp))]
    assert q.pop() is None and len(q) == 0


def test_many_late_pushes_and_removals_compact_the_side_heap():
    q = EvictionQueue()
    first = P(0, 1, 10_000)
    q.push(first)
    late = [P(i, 1, i) for i in range(1, 500)]         # all older than the first: the side heap
    for p in late:
        q.push(p)
    for p in late[:400]:
        q.remove(p)
    assert len(q._classes[1].late) < 250               # rebuilt, not 499 entries with 400 blanks
    got = q.pop_many(1000)
    assert [p.name for p in got] == [p.name for p in late[400:]] + [0]

"""Core.import_pages: blocks fetched from outside the store (the remote tier)
published in host slots, continuing a sequence's match; its refusals."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.core import Core, CoreError

FULL, PRIVATE = (False, 0, 0, 0), (False, 0, 0, 3)


def core(lcs=(FULL,)) -> Core:
    n = len(lcs)
    c = Core(2, list(lcs), [[0] * n, [0] * n, [-1] * n], [[16 * n], [16 * n], []])
    c.set_kv_events(True)
    return c


def test_imported_blocks_match_and_hold_their_slots():
    c = core()
    sid, matched, _ = c.open([1, 2], 35)
    assert c.extend_now(sid, 2) is not None and c.commit(sid, 2) == -1
    c.close(sid)
    sid, matched, _ = c.open([1, 2, 3, 4, 5], 35)
    assert matched == 2
    slots = c.allocate(1, 0, 3)
    assert c.import_pages(sid, 2, 3, 1, [slots]) == 3
    c.check()
    c.close(sid)
    sid, matched, by_tier = c.open([1, 2, 3, 4, 5], 35)
    assert matched == 5 and list(by_tier)[:3] == [2, 3, 0]
    depth, parent, pages = c.find(4)
    assert depth == 3 and parent == 3 and c.page_info(pages[0])["slot"] == slots[1]
    assert c.page_info(pages[0])["tier"] == 1 and c.page_info(pages[0])["published"]
    ev = np.frombuffer(c.take_kv_events()[0], dtype=[("hash", "<u8"), ("parent", "<u8"), ("token_at", "<i4"),
                                                      ("kind", "u1"), ("tier", "i1"), ("lc", "u1"), ("has_parent", "u1")])
    assert [(int(h), int(t)) for h, k, t in zip(ev["hash"], ev["kind"], ev["tier"]) if k == 0][-3:] == \
        [(3, 1), (4, 1), (5, 1)]
    c.close(sid)
    c.check()


def test_an_import_stops_at_the_first_block_it_cannot_take_whole():
    c = core((FULL, FULL))
    sid, _, _ = c.open([7, 8, 9], 35)
    slots = c.allocate(1, 0, 6)
    assert c.import_pages(sid, 0, 3, 1, [slots[:3], [slots[3], -1, slots[5]]]) == 1    # block 8's 2nd page missing
    assert c.find(8) is None and c.find(7) is not None
    c.give_back(1, 0, [slots[1], slots[2], slots[4], slots[5]])       # the caller's, unused
    c.check()
    c.close(sid)


def test_private_life_cycles_are_not_imported_and_bad_slots_are_refused():
    c = core((FULL, PRIVATE))
    sid, _, _ = c.open([1, 2], 35)
    slots = c.allocate(1, 0, 2)
    assert c.import_pages(sid, 0, 2, 1, [slots, [-1, -1]]) == 2
    assert c.find(2)[2][1] == -1
    c.check()
    c.close(sid)
    sid, _, _ = c.open([1, 2, 3], 35)
    with pytest.raises(CoreError, match="not allocated"):
        c.import_pages(sid, 2, 1, 1, [[15], [-1]])
    with pytest.raises(CoreError, match="host tier"):
        c.import_pages(sid, 2, 1, 0, [[0], [-1]])
    with pytest.raises(CoreError, match="beyond"):
        c.import_pages(sid, 2, 5, 1, [[0] * 5, [-1] * 5])
    c.check()


def test_a_slot_given_twice_is_refused():
    c = core()
    sid, _, _ = c.open([1, 2], 35)
    s = c.allocate(1, 0, 1)[0]
    with pytest.raises(CoreError, match="twice"):
        c.import_pages(sid, 0, 2, 1, [[s, s]])
    c.give_back(1, 0, [s])
    c.check()

"""Read-only views of the native core's tables, for tests, tools and
debugging: a page or an index node as a small Python object, built on
demand (never on a hot path)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, NamedTuple

if TYPE_CHECKING:
    from .core import Core
    from .store import Store


class PageView(NamedTuple):
    id: int
    tier: int
    group: int
    slot: int
    lc: int
    locks: int
    holders: int
    published: bool
    dead: bool
    claim: int
    stamp: int
    priority: int
    depth: int
    key: object             # its block's key (None: not known yet)
    copy: bool = False      # a clean copy on disk of a page the index names elsewhere (write-through)

    @property
    def state(self) -> str:
        if self.locks:
            return "LOCKED"
        if self.copy:
            return "DROPPABLE"
        if self.holders or not self.published:
            return "HELD"
        return "DROPPABLE"


def page_view(core: "Core", page_id: int) -> PageView:
    return PageView(page_id, **core.page_info(page_id))


def page_rows(core: "Core", sid: int, n_lcs: int) -> list[list[PageView | None]]:
    ids = core.seq_pages(sid)
    return [[page_view(core, i) if i >= 0 else None for i in ids[b:b + n_lcs]] for b in range(0, len(ids), n_lcs)]


class NodeView(NamedTuple):
    key: object
    depth: int
    parent: object          # the parent's key, or None
    pages: list             # PageView or None per life cycle


class IndexView:
    """``store.nodes``: the prefix index as a read-only mapping key -> NodeView."""

    __slots__ = ("_store",)

    def __init__(self, store: "Store") -> None:
        self._store = store

    def _find(self, key):
        core = self._store.core
        if core is None:
            return None
        try:
            return core.find(key)
        except (TypeError, ValueError):
            return None

    def __len__(self) -> int:
        core = self._store.core
        return 0 if core is None else core.indexed_blocks()

    def __bool__(self) -> bool:
        return len(self) > 0

    def __contains__(self, key) -> bool:
        return self._find(key) is not None

    def __getitem__(self, key) -> NodeView:
        found = self._find(key)
        if found is None:
            raise KeyError(key)
        depth, parent, pages = found
        core = self._store.core
        return NodeView(key, depth, parent, [page_view(core, i) if i >= 0 else None for i in pages])

    def get(self, key, default=None):
        try:
            return self[key]
        except KeyError:
            return default

    def __iter__(self) -> Iterator:
        raise TypeError("the index is not iterable; look keys up")

"""kvtier's native core (C++, built by the package's own build): the page
table, prefix index, slot allocators, prioritised LRU queues and the
decisions over them. See core.hpp for the invariants it keeps."""
from __future__ import annotations

from ._core import Core, CoreError, Pages, chain_block_keys

__all__ = ["Core", "CoreError", "Pages", "chain_block_keys"]

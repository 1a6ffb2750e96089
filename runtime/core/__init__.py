"""kvtier's native core (C++, built by the package's own build): the page
table, prefix index, slot allocators, prioritised LRU queues and the
decisions over them. See core.hpp for the invariants it keeps.

``KVTIER_CORE_LIB`` names another build of the extension to load instead
(scripts/sanitize.sh points it at an AddressSanitizer build).
"""
from __future__ import annotations

import os

if os.environ.get("KVTIER_CORE_LIB"):
    import importlib.util
    import sys

    _spec = importlib.util.spec_from_file_location(__name__ + "._core", os.environ["KVTIER_CORE_LIB"])
    _core = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _core
    _spec.loader.exec_module(_core)

from ._core import COMMIT_PAST_BLOCKS, COMMIT_PAST_KEYS, Core, CoreError, Pages, chain_block_keys  # noqa: E402

__all__ = ["COMMIT_PAST_BLOCKS", "COMMIT_PAST_KEYS", "Core", "CoreError", "Pages", "chain_block_keys"]

"""Typed errors shared by the data plane and the runtime.

They live in ``tiers`` because the data plane raises them and ``tiers`` must
never import ``runtime``; ``runtime`` re-exports every one of them.
"""
from __future__ import annotations


class KvtierError(Exception):
    """Base of every error kvtier raises on purpose."""


class ConfigError(KvtierError, ValueError):
    """A configuration value is invalid; the message names the field."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


class UsageError(KvtierError, ValueError):
    """An API call that does not fit the object's state or its arguments."""


class OutOfPagesError(KvtierError):
    """Not enough slots even after evicting everything allowed; nothing changed."""


class RequestTooLargeError(OutOfPagesError, UsageError):
    """A request needs more GPU slots of a pool group than the group has in all: it can never
    fit this store, so a server must not queue it for a retry. An ``OutOfPagesError`` (DESIGN.md
    names that one for any request that cannot fit) and a ``UsageError``; nothing changed."""


class StoreClosedError(KvtierError):
    """The store (or sequence) is closed."""


class CorruptPageError(KvtierError):
    """A stored page failed its checksum or could not be read whole."""


class DiskFullError(KvtierError, OSError):
    """The disk tier cannot take more data (quota or filesystem full)."""


class TierIOError(KvtierError, OSError):
    """An I/O error while moving pages; the source page stays where it was."""

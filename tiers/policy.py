"""Reuse policies: what a prefix match requires of a life cycle's pages."""
from __future__ import annotations

import enum

from .errors import ConfigError


class ReusePolicy(enum.Enum):
    REQUIRED = "required"
    SINK_REQUIRED_ONLY = "sink_required_only"
    OPTIONAL = "optional"
    PRIVATE = "private"

    @classmethod
    def parse(cls, value: "str | ReusePolicy", field: str = "reuse") -> "ReusePolicy":
        if isinstance(value, ReusePolicy):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            names = ", ".join(p.value for p in cls)
            raise ConfigError(field, f"unknown reuse policy {value!r} (expected one of {names})") from None


def pool_reuse_policy(policy: ReusePolicy) -> ReusePolicy:
    """The policy pools are grouped by: sink-only reuse changes what a match
    requires, never which memory a page lives in."""
    return ReusePolicy.REQUIRED if policy is ReusePolicy.SINK_REQUIRED_ONLY else policy

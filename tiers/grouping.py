"""Pool grouping: which life cycles share a slot allocator in each tier.

GPU groups are keyed by ``(pool reuse policy, page shape, sparsity)``; cold
groups (host and disk) by ``(pool reuse policy, cold page bytes)``. Grouping
uses the pool reuse policy, so ``SINK_REQUIRED_ONLY`` shares with ``REQUIRED``.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

from .codecs import cold_page_bytes
from .errors import ConfigError
from .layers import LifeCycle
from .policy import pool_reuse_policy

GPU = "gpu"
HOST = "host"
DISK = "disk"
TIERS = (GPU, HOST, DISK)


@dataclasses.dataclass(frozen=True, slots=True)
class PoolGroupSpec:
    tier: str
    index: int
    key: tuple
    life_cycles: tuple[int, ...]
    slot_sizes: tuple[int, ...]     # one per pool; a cold group has one pool

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot across all pools of the group (one page)."""
        return sum(self.slot_sizes)

    def key_dict(self) -> dict:
        if self.tier == GPU:
            policy, shape, sparsity = self.key
            return {"pool_reuse_policy": policy.value, "page_shape": list(shape), "sparsity": sparsity}
        policy, nbytes = self.key
        return {"pool_reuse_policy": policy.value, "cold_page_bytes": nbytes}


def gpu_key(lc: LifeCycle) -> tuple:
    return (pool_reuse_policy(lc.reuse), lc.slot_sizes, lc.sparsity)


def cold_key(lc: LifeCycle) -> tuple:
    return (pool_reuse_policy(lc.reuse), cold_page_bytes(lc))


def group_life_cycles(lcs: Sequence[LifeCycle], tier: str) -> list[PoolGroupSpec]:
    """Groups in order of their first life cycle."""
    keyf = gpu_key if tier == GPU else cold_key
    members: dict[tuple, list[int]] = {}
    for lc in lcs:
        members.setdefault(keyf(lc), []).append(lc.index)
    out = []
    for i, (key, idx) in enumerate(members.items()):
        sizes = key[1] if tier == GPU else (key[1],)
        out.append(PoolGroupSpec(tier, i, key, tuple(idx), tuple(sizes)))
    return out


def split_quota(quota_bytes: int, groups: Sequence[PoolGroupSpec], lcs: Sequence[LifeCycle],
                field: str) -> list[int]:
    """Slots per group. A quarter of the quota is shared out evenly (the floor
    that keeps small groups from starving); the rest follows each group's
    demand, the bytes it holds per block of sequence (sum of its pages)."""
    if not groups:
        return []
    demand = [sum(lcs[i].page_bytes if g.tier == GPU else cold_page_bytes(lcs[i]) for i in g.life_cycles)
              for g in groups]
    total = sum(demand)
    floor = quota_bytes // (4 * len(groups))
    rest = quota_bytes - floor * len(groups)
    slots = [(floor + rest * d // total) // g.slot_bytes for g, d in zip(groups, demand)]
    for g, n in zip(groups, slots):
        if n < 1:
            raise ConfigError(field, f"quota {quota_bytes} bytes leaves pool group {g.index} "
                                     f"({g.slot_bytes}-byte pages) without a single slot")
    return slots


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """Life cycles and their pool groups in every tier."""

    life_cycles: tuple[LifeCycle, ...]
    groups: dict[str, tuple[PoolGroupSpec, ...]]     # tier -> groups

    @classmethod
    def build(cls, lcs: Sequence[LifeCycle]) -> "Layout":
        gpu = tuple(group_life_cycles(lcs, GPU))
        cold = tuple(group_life_cycles(lcs, HOST))
        disk = tuple(dataclasses.replace(g, tier=DISK) for g in cold)
        return cls(tuple(lcs), {GPU: gpu, HOST: cold, DISK: disk})

    def group_of(self, tier: str, lc: int) -> int:
        for g in self.groups[tier]:
            if lc in g.life_cycles:
                return g.index
        raise KeyError((tier, lc))

    def group_map(self, tier: str) -> dict[int, int]:
        return {lc: g.index for g in self.groups[tier] for lc in g.life_cycles}

    def fingerprint(self, tokens_per_block: int, hash_salt: bytes = b"") -> dict:
        """What a disk tier written by another store must agree on: a page's
        bytes mean the same only with the same buffers (layer, role, size)
        in the same order, and its key only with the same hash salt."""
        return {
            "tokens_per_block": tokens_per_block,
            "life_cycles": [[lc.kind, lc.window_tokens, lc.sink_tokens, lc.reuse.value, lc.sparsity,
                             lc.codec, lc.dtype, list(lc.layer_ids), list(lc.slot_sizes),
                             [[layer, role, size] for layer, role, size in lc.buffers]] for lc in self.life_cycles],
            "cold_groups": [[g.key[0].value, g.key[1], list(g.life_cycles)] for g in self.groups[DISK]],
            "hash_salt": hashlib.blake2b(hash_salt, digest_size=8).hexdigest(),
        }

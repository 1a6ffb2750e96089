"""Block keys: chained content hashes, stable across processes.

``key[i] = blake2b(key[i-1] || tokens of block i || salt)`` (16-byte digest).
Callers may pass precomputed keys instead (ints, like the Mooncake trace's
``hash_ids``, or bytes); they must already be chained.
"""
from __future__ import annotations

import numbers
from typing import Sequence

import numpy as np

from tiers.errors import UsageError

from .core import chain_block_keys

BlockKey = int | bytes


def hash_blocks(tokens: Sequence[int], tokens_per_block: int, salt: bytes = b"",
                parent: bytes = b"") -> list[bytes]:
    """Keys of every full block of ``tokens``, chained from ``parent``."""
    try:
        arr = np.asarray(tokens, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise UsageError("tokens must be a sequence of integers") from None
    if arr.ndim != 1:
        raise UsageError(f"tokens must be one-dimensional, got shape {arr.shape}")
    # hashed natively, with the GIL released: a 4096-block prompt takes about a millisecond
    return chain_block_keys(arr.astype("<i8", copy=False).tobytes(), tokens_per_block, bytes(salt), bytes(parent))


def _as_int(x: object) -> int | None:
    """``x`` as an int if it is an integer of any kind (numpy's too), not a bool; else None."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        return None
    return int(x)


def check_tokens(tokens: Sequence[int]) -> list[int]:
    """Token ids as a new list of ints; anything else is a UsageError (nothing half-applied)."""
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__iter__"):
        raise UsageError(f"tokens must be a sequence of integers, got {type(tokens).__name__}")
    if hasattr(tokens, "tolist"):          # numpy arrays and torch tensors
        tokens = tokens.tolist()
    out = list(tokens)
    if not set(map(type, out)) <= {int}:   # the common case (all ints) is checked in C
        for i, t in enumerate(out):
            v = _as_int(t)
            if v is None:
                raise UsageError(f"token {t!r} is a {type(t).__name__}; tokens are integers")
            out[i] = v
    if out and not (-(1 << 63) <= min(out) and max(out) < 1 << 63):
        bad = next(t for t in out if not -(1 << 63) <= t < 1 << 63)
        raise UsageError(f"token {bad} does not fit in 64 bits")
    return out


_KEY_TYPES = {int, bytes}


def check_block_keys(keys: Sequence[BlockKey]) -> list[BlockKey]:
    """Validate caller-supplied keys: all ints or all bytes, no bools."""
    if isinstance(keys, (str, bytes)) or not hasattr(keys, "__iter__"):
        raise UsageError(f"block_keys must be a sequence of int or bytes keys, got {type(keys).__name__}")
    out = list(keys)
    types = set(map(type, out))
    if len(types) <= 1 and types <= _KEY_TYPES:        # the common case, checked in C
        if types == {bytes} and b"" in out:
            raise UsageError("block key b'' is reserved (the disk tier's mark for uncommitted pages)")
        return out
    for i, k in enumerate(out):
        if isinstance(k, bytes):
            continue
        v = _as_int(k)
        if v is None:
            raise UsageError(f"block key {k!r} is a {type(k).__name__}; keys are int or bytes")
        out[i] = v
    if len(set(map(type, out))) > 1:
        raise UsageError("block_keys mixes int and bytes keys")
    if b"" in out:
        raise UsageError("block key b'' is reserved (the disk tier's mark for uncommitted pages)")
    return out

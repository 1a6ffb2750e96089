"""Deterministic page content for replays, stress runs and the demo: a pure
function of (block key, life cycle), valid fp16 in [-1, 1] so that lossy
codecs can be checked against their bound as well."""
from __future__ import annotations

import zlib

import torch

from tiers.codecs import INT8_GROUP


def key_seed(key, lc: int) -> int:
    raw = key if isinstance(key, bytes) else int(key).to_bytes(16, "little", signed=True)
    return (zlib.crc32(raw) ^ (lc * 0x9E3779B1)) & 0xFFFFFF


def pattern(seeds: list[int], nbytes: int) -> torch.Tensor:
    """``[len(seeds), nbytes]`` uint8: fp16 ``sin`` waves, phase from the seed."""
    n = nbytes // 2
    pos = torch.arange(n, dtype=torch.float32).unsqueeze(0)
    s = torch.tensor(seeds, dtype=torch.float32).unsqueeze(1)
    return torch.sin(pos * 0.37 + s * 0.61).to(torch.float16).view(torch.uint8)


def matches(actual: torch.Tensor, expected: torch.Tensor, lossless: bool) -> torch.Tensor:
    """Per row: equal bytes, or (lossy) within the int8 codec's bound."""
    if lossless:
        return (actual == expected).all(dim=1)
    a = actual.contiguous().view(torch.float16).float()
    e = expected.contiguous().view(torch.float16).float()
    amax = e.view(e.shape[0], -1, INT8_GROUP).abs().amax(-1, keepdim=True).expand(-1, -1, INT8_GROUP)
    bound = amax.reshape(e.shape) / 254 + e.abs() * 2.0 ** -10 + 2.0 ** -24
    return ((a - e).abs() <= bound * 1.001).all(dim=1)

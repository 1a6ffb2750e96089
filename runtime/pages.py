"""Tier ids as the native core numbers them."""
from __future__ import annotations

GPU, HOST, DISK = 0, 1, 2
TIER_NAMES = ("gpu", "host", "disk")

"""kvtier's control plane on asyncio: the Store and what surrounds it."""
from __future__ import annotations

from tiers.config import DiskConfig, EventsConfig, GpuConfig, HostConfig, StoreConfig
from tiers.remote import RemoteSettings
from tiers.errors import (ConfigError, CorruptPageError, DiskFullError, KvtierError, OutOfPagesError,
                          RequestTooLargeError, StoreClosedError, TierIOError, UsageError)
from tiers.layers import LayerSpec
from tiers.policy import ReusePolicy

from .config import load_config
from .loop import run
from .sequence import Sequence
from .store import Store

__all__ = [
    "Store", "Sequence", "StoreConfig", "GpuConfig", "HostConfig", "DiskConfig", "EventsConfig", "RemoteSettings", "LayerSpec", "ReusePolicy",
    "load_config", "run", "ConfigError", "CorruptPageError", "DiskFullError", "KvtierError", "OutOfPagesError",
    "RequestTooLargeError", "StoreClosedError", "TierIOError", "UsageError",
]

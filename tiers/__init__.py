"""kvtier's data plane: policies, life cycles, pool grouping, codecs, devices,
streams and events, slot pools and the tier backends. No asyncio policy here,
and nothing here imports ``runtime``."""
from .errors import (ConfigError, CorruptPageError, DiskFullError, KvtierError, OutOfPagesError, StoreClosedError,
                     TierIOError, UsageError)
from .grouping import DISK, GPU, HOST, TIERS, Layout, PoolGroupSpec
from .layers import LayerSpec, LifeCycle
from .policy import ReusePolicy, pool_reuse_policy

__all__ = ["ConfigError", "CorruptPageError", "DiskFullError", "KvtierError", "OutOfPagesError", "StoreClosedError",
           "TierIOError", "UsageError", "DISK", "GPU", "HOST", "TIERS", "Layout", "PoolGroupSpec", "LayerSpec",
           "LifeCycle", "ReusePolicy", "pool_reuse_policy"]

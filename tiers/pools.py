"""Slab pools for the GPU and host tiers.

A pool group's memory is one ``[slots, page_bytes]`` uint8 tensor: slot k of
every pool is row k, and each pool is a column slice of it. A page is thus one
contiguous row, so a batch of pages moves with one gather and one scatter.
``pool_view`` gives the ``[slots, slot_bytes]`` tensor a kernel indexes by slot.
"""
from __future__ import annotations

import torch

from .device import Device
from .errors import ConfigError
from .grouping import GPU, PoolGroupSpec


class SlabPool:
    __slots__ = ("spec", "tensor", "array", "offsets", "slots")

    def __init__(self, spec: PoolGroupSpec, slots: int, device: Device) -> None:
        self.spec = spec
        alloc = device.empty if spec.tier == GPU else device.host_slab
        try:
            self.tensor = alloc(slots, spec.slot_bytes)
        except (RuntimeError, MemoryError) as exc:     # torch's out-of-memory errors are RuntimeErrors
            tier = "gpu" if spec.tier == GPU else "host"
            raise ConfigError(f"tiers.{tier}.quota", f"cannot allocate {slots} slots of {spec.slot_bytes} bytes "
                                                     f"for pool group {spec.index}: {str(exc).splitlines()[0]}") from None
        # host memory (a host slab, or an emulated GPU's) also as numpy, made once: copies on the
        # loop use it, where each tensor.numpy() call would give up the GIL
        self.array = self.tensor.numpy() if self.tensor.device.type == "cpu" else None
        offs, o = [], 0
        for size in spec.slot_sizes:
            offs.append(o)
            o += size
        self.offsets = tuple(offs)
        self.slots = slots

    def release(self) -> None:
        """Let go of the slab (a closed store's pools): its memory goes back now, not when
        a garbage-collection pass finds the store's reference cycles (views a caller still
        holds keep their part alive)."""
        self.tensor = self.array = None

    def pool_view(self, pool: int) -> torch.Tensor:
        off = self.offsets[pool]
        return self.tensor[:, off:off + self.spec.slot_sizes[pool]]

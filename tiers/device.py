"""Where the GPU tier's memory lives: a CUDA device, or host memory with
emulated streams so that the same code runs (and is tested) without a GPU."""
from __future__ import annotations

import logging
import os
import re
import weakref

import torch

from .errors import ConfigError
from .streams import CudaStream, HostStream, Stream

log = logging.getLogger("kvtier")


def host_available_bytes() -> int:
    """Host memory a new allocation can have: MemAvailable, capped by the
    cgroup's limit when the process runs in a container."""
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            avail = min(avail, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return avail


class Device:
    __slots__ = ("torch_device", "is_cuda", "pin_host")

    def __init__(self, spec: str = "auto", pin_host: bool | None = None) -> None:
        if spec == "auto":
            spec = "cuda" if torch.cuda.is_available() else "cpu"
        if not isinstance(spec, str) or not (spec in ("cpu", "cuda") or re.fullmatch(r"cuda:\d+", spec)):
            raise ConfigError("tiers.gpu.device", f"unknown device {spec!r} (auto, cuda, cuda:N, cpu)")
        if spec.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("tiers.gpu.device", f"{spec!r} asked for, but CUDA is not available")
        self.torch_device = torch.device(spec)
        if self.torch_device.type == "cuda" and self.torch_device.index is None:
            # an explicit index: set_device needs one, and "cuda" != "cuda:0" when devices are compared
            self.torch_device = torch.device("cuda", torch.cuda.current_device())
        self.is_cuda = self.torch_device.type == "cuda"
        self.pin_host = self.is_cuda if pin_host is None else pin_host

    def free_bytes(self) -> int | None:
        """Free memory on the CUDA device; None when the GPU tier is emulated in host memory."""
        if not self.is_cuda:
            return None
        return torch.cuda.mem_get_info(self.torch_device)[0]

    @property
    def name(self) -> str:
        return str(self.torch_device) if self.is_cuda else "cpu (emulated gpu)"

    def empty(self, rows: int, cols: int) -> torch.Tensor:
        """A GPU-tier slab: ``rows`` slots of ``cols`` bytes (page-aligned
        when emulated, like device memory)."""
        if self.is_cuda:
            return torch.zeros((rows, cols), dtype=torch.uint8, device=self.torch_device)
        return aligned_empty(rows, cols, zero=True)

    def host_empty(self, rows: int, cols: int, zero: bool = True) -> torch.Tensor:
        """A staging buffer, pinned when CUDA copies use it, page-aligned
        either way (so the disk tier can use O_DIRECT on it without bounce
        copies). Torch's pinned allocator caches these for reuse."""
        if self.pin_host and torch.cuda.is_available():
            fn = torch.zeros if zero else torch.empty
            return fn((rows, cols), dtype=torch.uint8, pin_memory=True)   # cudaHostAlloc: page-aligned
        return aligned_empty(rows, cols, zero=zero)

    def host_slab(self, rows: int, cols: int) -> torch.Tensor:
        """A host tier's slab, zeroed: page-aligned memory of exactly its
        size, pinned in place with ``cudaHostRegister`` when CUDA copies use
        it. (Torch's pinned allocator rounds every size up to a power of
        two: a 40 GiB tier would pin 64 GiB.) If registering fails, the slab
        comes from that allocator after all, with a warning."""
        out = aligned_empty(rows, cols, zero=True)
        if not (self.pin_host and torch.cuda.is_available()) or out.numel() == 0:
            return out
        try:
            return pin_in_place(out)
        except RuntimeError as exc:
            log.warning("pinning a %d-byte host slab in place failed (%s); using torch's pinned allocator",
                        out.numel(), exc)
            del out
            return torch.zeros((rows, cols), dtype=torch.uint8, pin_memory=True)

    def new_stream(self, name: str) -> Stream:
        return CudaStream(self.torch_device, name) if self.is_cuda else HostStream(name)


PAGE = 4096


def pin_in_place(t: torch.Tensor) -> torch.Tensor:
    """Page-lock the memory under ``t`` (a CPU tensor) for CUDA copies;
    unlocked when ``t`` is collected. The whole storage is registered, not
    just the view: torch's ``is_pinned`` looks at the storage's base. Views
    that outlive ``t`` keep the memory alive, merely pageable, so memory is
    never freed while locked."""
    cudart = torch.cuda.cudart()
    storage = t.untyped_storage()
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        reason = cudart.cudaGetErrorString(err)
        try:            # the failed call left CUDA's last error set: a launch reads (and clears) it here,
            torch.empty(1, device="cuda").zero_()    # not in the next unrelated kernel the store runs
        except RuntimeError:
            pass
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes: {reason}")
    weakref.finalize(t, cudart.cudaHostUnregister, ptr)
    return t


def aligned_empty(rows: int, cols: int, zero: bool = False) -> torch.Tensor:
    """A CPU ``[rows, cols]`` uint8 tensor whose first byte is 4096-aligned."""
    n = rows * cols
    raw = torch.empty(n + PAGE, dtype=torch.uint8)
    off = (-raw.data_ptr()) % PAGE
    out = raw[off:off + n].view(rows, cols) if n else torch.empty((rows, cols), dtype=torch.uint8)
    if zero:
        out.zero_()
    return out

"""Where the GPU tier's memory lives: a CUDA device, or host memory with
emulated streams so that the same code runs (and is tested) without a GPU."""
from __future__ import annotations

import re

import torch

from .errors import ConfigError
from .streams import CudaStream, HostStream, Stream


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
        self.is_cuda = self.torch_device.type == "cuda"
        self.pin_host = self.is_cuda if pin_host is None else pin_host

    @property
    def name(self) -> str:
        return str(self.torch_device) if self.is_cuda else "cpu (emulated gpu)"

    def empty(self, rows: int, cols: int) -> torch.Tensor:
        """A GPU-tier slab: ``rows`` slots of ``cols`` bytes."""
        return torch.zeros((rows, cols), dtype=torch.uint8, device=self.torch_device)

    def host_empty(self, rows: int, cols: int) -> torch.Tensor:
        """A host slab, pinned when CUDA copies will read or write it."""
        return torch.zeros((rows, cols), dtype=torch.uint8, pin_memory=self.pin_host and torch.cuda.is_available())

    def new_stream(self, name: str) -> Stream:
        return CudaStream(self.torch_device, name) if self.is_cuda else HostStream(name)

"""Cold-page codecs: a hot page (one contiguous row of a GPU pool group) <->
one fixed-size cold page. They run batched, on whatever device the rows are on.

``concat`` is lossless: the cold page is the hot page's bytes.

``int8`` quantises fp16/bf16 pages in groups of ``INT8_GROUP`` consecutive
elements, each group with its own fp32 scale ``amax/127``. Error bound, per
element: ``|decoded - x| <= amax(group)/254 + ulp(decoded)/2`` where ``ulp`` is
that of the page dtype (the final cast back). Groups never straddle a buffer
(each buffer must hold a multiple of ``INT8_GROUP`` elements). Cold bytes:
``E + 4*E/INT8_GROUP`` for ``E`` elements, about 0.53x of an fp16 page.
Non-finite inputs are not representable and decode as garbage.
"""
from __future__ import annotations

import abc

import torch

from .errors import ConfigError
from .layers import LifeCycle

INT8_GROUP = 64
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "uint8": torch.uint8, "int8": torch.int8}


class Codec(abc.ABC):
    name = ""
    lossless = True

    def check(self, lc: LifeCycle) -> None:
        """Raise ConfigError if the life cycle's pages cannot use this codec."""

    @abc.abstractmethod
    def cold_page_bytes(self, lc: LifeCycle) -> int:
        """Fixed size of this life cycle's cold page."""

    @abc.abstractmethod
    def encode(self, hot: torch.Tensor, lc: LifeCycle) -> torch.Tensor:
        """[B, page_bytes] uint8 -> [B, cold_page_bytes] uint8."""

    @abc.abstractmethod
    def decode(self, cold: torch.Tensor, lc: LifeCycle) -> torch.Tensor:
        """[B, cold_page_bytes] uint8 -> [B, page_bytes] uint8."""


class ConcatCodec(Codec):
    name = "concat"

    def cold_page_bytes(self, lc: LifeCycle) -> int:
        return lc.page_bytes

    def encode(self, hot: torch.Tensor, lc: LifeCycle) -> torch.Tensor:
        return hot

    def decode(self, cold: torch.Tensor, lc: LifeCycle) -> torch.Tensor:
        return cold


class Int8Codec(Codec):
    name = "int8"
    lossless = False

    def check(self, lc: LifeCycle) -> None:
        if lc.dtype not in ("float16", "bfloat16"):
            raise ConfigError(f"layers[{lc.layers[0].id}].codec", f"int8 needs float16 or bfloat16 pages, not {lc.dtype}")
        for layer, role, size in lc.buffers:
            if size % (2 * INT8_GROUP):
                raise ConfigError(f"layers[{layer}].buffers.{role}",
                                  f"int8 needs a multiple of {2 * INT8_GROUP} bytes, got {size}")

    def cold_page_bytes(self, lc: LifeCycle) -> int:
        elems = lc.page_bytes // 2
        return elems + 4 * (elems // INT8_GROUP)

    def encode(self, hot: torch.Tensor, lc: LifeCycle) -> torch.Tensor:
        b = hot.shape[0]
        x = hot.contiguous().view(DTYPES[lc.dtype]).float().view(b, -1, INT8_GROUP)
        scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
        return torch.cat([q.view(b, -1).view(torch.uint8), scale.view(b, -1).view(torch.uint8)], dim=1)

    def decode(self, cold: torch.Tensor, lc: LifeCycle) -> torch.Tensor:
        b = cold.shape[0]
        elems = lc.page_bytes // 2
        cold = cold.contiguous()
        q = cold[:, :elems].view(torch.int8).float().view(b, -1, INT8_GROUP)
        scale = cold[:, elems:].contiguous().view(torch.float32).view(b, -1, 1)
        return (q * scale).to(DTYPES[lc.dtype]).view(b, -1).view(torch.uint8)


CODECS: dict[str, Codec] = {c.name: c for c in (ConcatCodec(), Int8Codec())}


def get_codec(name: str, field: str = "codec") -> Codec:
    if not isinstance(name, str):
        raise ConfigError(field, f"codec must be a string, got {name!r}")
    try:
        return CODECS[name]
    except KeyError:
        raise ConfigError(field, f"unknown codec {name!r} (expected one of {', '.join(CODECS)})") from None


def cold_page_bytes(lc: LifeCycle) -> int:
    return get_codec(lc.codec).cold_page_bytes(lc)

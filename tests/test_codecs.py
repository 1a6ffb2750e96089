"""Cold-page codecs: concat (lossless) and int8 (per-group scaled quantisation)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiers.codecs import CODECS, DTYPES, INT8_GROUP, ConcatCodec, Int8Codec, cold_page_bytes, get_codec
from tiers.errors import ConfigError
from tiers.layers import LayerSpec, build_life_cycles

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def lc_with(buffers=(("k", 1024), ("v", 1024)), layers=1, codec="concat", dtype="float16"):
    (lc,) = build_life_cycles([LayerSpec(i, buffers, codec=codec, dtype=dtype) for i in range(layers)])
    return lc


def test_registry_and_lookup():
    assert set(CODECS) == {"concat", "int8"}
    assert isinstance(get_codec("concat"), ConcatCodec)
    assert isinstance(get_codec("int8"), Int8Codec)
    assert get_codec("concat").lossless and not get_codec("int8").lossless
    for bad in ("zstd", "", "INT8", 8, None, ["int8"]):
        with pytest.raises(ConfigError) as ei:
            get_codec(bad, "tiers.host.codec")
        assert ei.value.field == "tiers.host.codec"


# -- concat ------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(data=st.data(), batch=st.integers(1, 4), sizes=st.lists(st.integers(1, 300), min_size=1, max_size=4))
def test_concat_round_trip_is_bit_exact(data, batch, sizes):
    lc = lc_with(tuple((f"b{i}", n) for i, n in enumerate(sizes)))
    codec = get_codec("concat")
    assert codec.cold_page_bytes(lc) == cold_page_bytes(lc) == sum(sizes) == lc.page_bytes
    raw = data.draw(st.binary(min_size=batch * lc.page_bytes, max_size=batch * lc.page_bytes))
    hot = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(batch, lc.page_bytes)
    cold = codec.encode(hot, lc)
    assert cold.dtype == torch.uint8 and tuple(cold.shape) == (batch, cold_page_bytes(lc))
    assert bytes(cold.contiguous().numpy().tobytes()) == raw
    back = codec.decode(cold, lc)
    assert tuple(back.shape) == (batch, lc.page_bytes)
    assert bytes(back.contiguous().numpy().tobytes()) == raw


# -- int8 --------------------------------------------------------------------

def test_cold_page_bytes_values():
    assert cold_page_bytes(lc_with(codec="concat")) == 2048
    # 2048 bytes of fp16 = 1024 elements = 16 groups -> 1024 + 16 * 4
    assert cold_page_bytes(lc_with(codec="int8")) == 1024 + 64
    assert cold_page_bytes(lc_with(codec="int8", dtype="bfloat16")) == 1088
    # two layers, k and v: 4096 bytes -> 2048 elements -> 32 groups
    assert cold_page_bytes(lc_with(layers=2, codec="int8")) == 2048 + 128
    assert cold_page_bytes(lc_with((("state", 128),), codec="int8")) == 64 + 4
    assert cold_page_bytes(lc_with((("k", 65536), ("v", 65536)), layers=32, codec="int8")) == 2_228_224
    assert cold_page_bytes(lc_with((("k", 65536), ("v", 65536)), layers=32, codec="concat")) == 4_194_304


def int8_bound(x: torch.Tensor, decoded: torch.Tensor, tdtype) -> torch.Tensor:
    """The documented bound ``amax(group)/254 + ulp(decoded)/2`` per element, as float64."""
    b = x.shape[0]
    amax = x.double().view(b, -1, INT8_GROUP).abs().amax(dim=-1, keepdim=True)
    mag = decoded.abs()
    up = torch.nextafter(mag, torch.full_like(mag, float("inf"))).double()
    down = torch.nextafter(mag, torch.zeros_like(mag)).double()
    # at the dtype's largest finite value the next one up is inf: use the gap below
    ulp = torch.where(torch.isinf(up), mag.double() - down, up - mag.double())
    assert torch.isfinite(ulp).all()
    return (amax / 254).expand(-1, -1, INT8_GROUP).reshape(b, -1) + ulp / 2


def check_int8_round_trip(x: torch.Tensor, lc) -> torch.Tensor:
    codec = get_codec("int8")
    tdtype = TORCH_DTYPES[lc.dtype]
    assert x.dtype == tdtype and torch.isfinite(x).all()
    b = x.shape[0]
    hot = x.contiguous().view(torch.uint8)
    assert tuple(hot.shape) == (b, lc.page_bytes)
    cold = codec.encode(hot, lc)
    assert cold.dtype == torch.uint8 and tuple(cold.shape) == (b, cold_page_bytes(lc))
    out = codec.decode(cold, lc)
    assert out.dtype == torch.uint8 and tuple(out.shape) == (b, lc.page_bytes)
    decoded = out.contiguous().view(tdtype)
    assert torch.isfinite(decoded).all()
    err = (decoded.double() - x.double()).abs()
    bound = int8_bound(x, decoded, tdtype)
    worst = (err - bound).max().item()
    assert worst <= 0, f"int8 error exceeds the documented bound by {worst}"
    return decoded


def finite(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from(["float16", "bfloat16"]),
       batch=st.integers(1, 3), layers=st.integers(1, 2), mode=st.sampled_from(["normal", "bits", "mixed"]))
def test_int8_round_trip_within_documented_bound(seed, dtype, batch, layers, mode):
    lc = lc_with((("k", 512), ("v", 256)), layers=layers, codec="int8", dtype=dtype)
    tdtype = TORCH_DTYPES[dtype]
    g = torch.Generator().manual_seed(seed)
    n = lc.page_bytes // 2
    if mode == "bits":
        # random bit patterns: every exponent, subnormals, signed zeros (non-finite replaced by 0)
        x = finite(torch.randint(0, 256, (batch, lc.page_bytes), dtype=torch.uint8, generator=g).view(tdtype))
    else:
        x = torch.randn((batch, n), generator=g)
        if mode == "mixed":
            # every group its own magnitude, from tiny to near the dtype's maximum, some groups all zero
            top = 60000.0 if dtype == "float16" else 3e38
            mags = torch.tensor([0.0, 1e-4, 1.0, 1e3, top], dtype=torch.float64)
            pick = torch.randint(0, len(mags), (batch, n // INT8_GROUP, 1), generator=g)
            x = (x.view(batch, -1, INT8_GROUP).double() * mags[pick] / 4).clamp(-top, top).view(batch, n)
        x = x.to(tdtype)
    check_int8_round_trip(x, lc)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_int8_extremes_and_all_zero_groups(dtype):
    lc = lc_with((("k", 256), ("v", 256)), codec="int8", dtype=dtype)    # 256 elements = 4 groups
    tdtype = TORCH_DTYPES[dtype]
    big = torch.finfo(tdtype).max
    x = torch.zeros((2, 256), dtype=torch.float32)
    x[0, 0:64] = torch.linspace(-1, 1, 64) * big              # largest magnitudes the dtype holds
    x[0, 64:128] = 0.0                                         # all-zero group
    x[0, 128:192] = torch.linspace(-1, 1, 64)
    x[0, 192:256] = -0.0                                       # negative zeros
    x[1, 0:64] = torch.finfo(tdtype).tiny                      # smallest normal everywhere
    x[1, 64:128] = big
    x[1, 128:192] = torch.arange(64) - 32.0
    x = x.to(tdtype)
    decoded = check_int8_round_trip(x, lc)
    assert (decoded[0, 64:128] == 0).all() and (decoded[0, 192:256] == 0).all()
    assert decoded[1, 64:128].float().eq(float(big)).all()          # amax itself is exact (q = 127)
    assert decoded[0, 0].item() == -big and decoded[0, 63].item() == big


def test_int8_groups_do_not_straddle_buffers():
    # k holds huge values, v tiny ones: v keeps its own scales, so its error stays tiny
    lc = lc_with((("k", 128), ("v", 128)), codec="int8")
    x = torch.cat([torch.full((1, 64), 30000.0), torch.linspace(-1e-2, 1e-2, 64).view(1, 64)], dim=1).half()
    decoded = check_int8_round_trip(x, lc)
    assert (decoded[0, 64:].float() - x[0, 64:].float()).abs().max().item() <= 1e-2 / 254 + 2**-17


def test_int8_batch_rows_are_independent_and_views_encode():
    lc = lc_with(codec="int8")
    codec = get_codec("int8")
    g = torch.Generator().manual_seed(7)
    slab = (torch.randn((5, lc.page_bytes // 2), generator=g) * 10).half().view(torch.uint8)
    batch = codec.encode(slab[1:4], lc)                       # a view with a storage offset
    for i, row in enumerate(range(1, 4)):
        single = codec.encode(slab[row:row + 1].clone(), lc)
        assert torch.equal(batch[i:i + 1], single)
    # decode of rows gathered out of a cold slab
    cold_slab = torch.zeros((6, cold_page_bytes(lc)), dtype=torch.uint8)
    cold_slab[[5, 0, 2]] = batch
    back = codec.decode(cold_slab[[5, 0, 2]], lc)
    assert torch.equal(back, codec.decode(batch, lc))
    # and a lossless re-encode of decoded data is stable
    assert torch.equal(codec.encode(back, lc), batch)


@pytest.mark.parametrize("dtype", ["float32", "uint8", "int8"])
def test_int8_check_rejects_dtype(dtype):
    lc = lc_with(codec="int8", dtype=dtype)
    with pytest.raises(ConfigError) as ei:
        Int8Codec().check(lc)
    assert ei.value.field == "layers[0].codec"
    assert dtype in ei.value.problem


@pytest.mark.parametrize("size", [2, 64, 126, 192, 1000])
def test_int8_check_rejects_buffer_sizes(size):
    (lc,) = build_life_cycles([LayerSpec(3, (("k", 256), ("v", size)), codec="int8"),
                               LayerSpec(4, (("k", 256), ("v", 256)), codec="int8")])
    with pytest.raises(ConfigError) as ei:
        Int8Codec().check(lc)
    assert ei.value.field == "layers[3].buffers.v"
    assert str(2 * INT8_GROUP) in ei.value.problem


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_int8_check_accepts_good_pages(dtype):
    Int8Codec().check(lc_with((("k", 128), ("v", 384)), layers=2, codec="int8", dtype=dtype))
    ConcatCodec().check(lc_with(dtype="float32"))      # concat takes anything
    assert DTYPES[dtype] == TORCH_DTYPES[dtype]

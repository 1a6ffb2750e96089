"""Pool grouping in the GPU and cold tiers, and quota splitting."""
from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiers.codecs import cold_page_bytes
from tiers.device import Device
from tiers.errors import ConfigError
from tiers.grouping import DISK, GPU, HOST, TIERS, Layout, cold_key, gpu_key, group_life_cycles, split_quota
from tiers.layers import LayerSpec, build_life_cycles
from tiers.policy import ReusePolicy
from tiers.pools import SlabPool

R = ReusePolicy
KV = (("k", 1024), ("v", 1024))


def layer(i, buffers=KV, **kw):
    kw.setdefault("codec", "concat")
    return LayerSpec(i, buffers, **kw)


def full(i, **kw):
    return layer(i, reuse=R.REQUIRED, **kw)


def sink_window(i, **kw):
    return layer(i, window_tokens=256, sink_tokens=16, reuse=R.SINK_REQUIRED_ONLY, **kw)


def optional_window(i, **kw):
    return layer(i, window_tokens=256, reuse=R.OPTIONAL, **kw)


def members(groups):
    return [g.life_cycles for g in groups]


def three_life_cycles():
    lcs = build_life_cycles([full(0), sink_window(1), optional_window(2)])
    assert [(lc.reuse, lc.window_tokens) for lc in lcs] == \
        [(R.REQUIRED, None), (R.SINK_REQUIRED_ONLY, 256), (R.OPTIONAL, 256)]
    return lcs


def test_sink_required_only_shares_the_required_gpu_group_optional_does_not():
    lcs = three_life_cycles()
    layout = Layout.build(lcs)
    gpu = layout.groups[GPU]
    assert len(gpu) == 2
    assert members(gpu) == [(0, 1), (2,)]
    assert layout.group_of(GPU, 0) == layout.group_of(GPU, 1) == 0
    assert layout.group_of(GPU, 2) == 1
    assert layout.group_map(GPU) == {0: 0, 1: 0, 2: 1}
    shared, opt = gpu
    assert shared.key == (R.REQUIRED, (1024, 1024), None)
    assert opt.key == (R.OPTIONAL, (1024, 1024), None)
    assert shared.slot_sizes == (1024, 1024) and shared.slot_bytes == 2048
    # "same pools": one slab per group, so both life cycles index the same tensors
    dev = Device("cpu")
    pools = [SlabPool(g, 8, dev) for g in gpu]
    pool_of = {lc: pools[g] for lc, g in layout.group_map(GPU).items()}
    assert pool_of[0] is pool_of[1]
    assert pool_of[0].pool_view(0).data_ptr() == pool_of[1].pool_view(0).data_ptr()
    assert pool_of[2] is not pool_of[0]
    assert pool_of[2].tensor.data_ptr() != pool_of[0].tensor.data_ptr()


def test_sink_required_only_shares_the_required_cold_group():
    lcs = three_life_cycles()
    layout = Layout.build(lcs)
    for tier in (HOST, DISK):
        cold = layout.groups[tier]
        assert len(cold) == 2
        assert members(cold) == [(0, 1), (2,)]
        assert [g.key for g in cold] == [(R.REQUIRED, 4096 // 2), (R.OPTIONAL, 2048)]
        assert [g.tier for g in cold] == [tier, tier]
        assert [g.slot_sizes for g in cold] == [(2048,), (2048,)]     # one pool: one whole cold page
        assert layout.group_map(tier) == {0: 0, 1: 0, 2: 1}


def test_different_cold_page_size_splits_a_shared_gpu_group():
    # same GPU shape and pool policy, but the window life cycle is int8 in the cold tiers
    lcs = build_life_cycles([full(0), sink_window(1, codec="int8")])
    layout = Layout.build(lcs)
    assert len(layout.groups[GPU]) == 1
    assert members(layout.groups[GPU]) == [(0, 1)]
    assert cold_page_bytes(lcs[0]) == 2048
    assert cold_page_bytes(lcs[1]) == 1024 + 4 * (1024 // 64)
    for tier in (HOST, DISK):
        cold = layout.groups[tier]
        assert len(cold) == 2
        assert members(cold) == [(0,), (1,)]
        assert [g.key for g in cold] == [(R.REQUIRED, 2048), (R.REQUIRED, 1088)]
        assert [g.slot_sizes for g in cold] == [(2048,), (1088,)]
        assert layout.group_of(tier, 0) != layout.group_of(tier, 1)


def test_same_cold_bytes_merge_life_cycles_from_different_gpu_groups():
    lcs = build_life_cycles([
        full(0),                                                       # shape (1024, 1024)
        layer(1, (("kv", 2048),), window_tokens=64, reuse=R.REQUIRED),  # shape (2048,)
        layer(2, (("k", 512), ("v", 1536)), kind="ssm"),                # shape (512, 1536)
    ])
    layout = Layout.build(lcs)
    gpu = layout.groups[GPU]
    assert len(gpu) == 3
    assert members(gpu) == [(0,), (1,), (2,)]
    assert [g.slot_sizes for g in gpu] == [(1024, 1024), (2048,), (512, 1536)]
    for tier in (HOST, DISK):
        cold = layout.groups[tier]
        assert len(cold) == 1
        assert members(cold) == [(0, 1, 2)]
        assert cold[0].key == (R.REQUIRED, 2048)


def test_different_sparsity_splits_gpu_groups_but_not_cold_groups():
    lcs = build_life_cycles([full(0), full(1, sparsity="topk"), full(2, sparsity="block")])
    assert [lc.sparsity for lc in lcs] == [None, "topk", "block"]
    layout = Layout.build(lcs)
    gpu = layout.groups[GPU]
    assert len(gpu) == 3
    assert members(gpu) == [(0,), (1,), (2,)]
    assert [g.key[2] for g in gpu] == [None, "topk", "block"]
    assert members(layout.groups[HOST]) == [(0, 1, 2)]


def test_private_never_shares_with_required():
    lcs = build_life_cycles([
        full(0),
        layer(1, window_tokens=256, reuse=R.PRIVATE),
        sink_window(2),
        optional_window(3),
        layer(4, reuse=R.PRIVATE, kind="ssm"),
    ])
    layout = Layout.build(lcs)
    for tier in TIERS:
        groups = layout.groups[tier]
        assert len(groups) == 3, tier
        assert members(groups) == [(0, 2), (1, 4), (3,)], tier
        assert [g.key[0] for g in groups] == [R.REQUIRED, R.PRIVATE, R.OPTIONAL]
        by_policy = {lc.index: lc.reuse for lc in lcs}
        for g in groups:
            pols = {R.REQUIRED if by_policy[i] is R.SINK_REQUIRED_ONLY else by_policy[i] for i in g.life_cycles}
            assert len(pols) == 1


def test_keys_and_key_dict():
    lcs = build_life_cycles([sink_window(0, sparsity="s"), layer(1, window_tokens=8, reuse=R.PRIVATE, codec="int8")])
    assert gpu_key(lcs[0]) == (R.REQUIRED, (1024, 1024), "s")
    assert cold_key(lcs[0]) == (R.REQUIRED, 2048)
    assert cold_key(lcs[1]) == (R.PRIVATE, 1088)
    layout = Layout.build(lcs)
    assert layout.groups[GPU][0].key_dict() == {"pool_reuse_policy": "required", "page_shape": [1024, 1024],
                                                 "sparsity": "s"}
    assert layout.groups[DISK][1].key_dict() == {"pool_reuse_policy": "private", "cold_page_bytes": 1088}
    with pytest.raises(KeyError):
        layout.group_of(GPU, 7)


def test_fingerprint_describes_life_cycles_and_cold_groups():
    lcs = build_life_cycles([full(0), sink_window(1), full(2)])
    fp = Layout.build(lcs).fingerprint(32)
    assert fp == {
        "tokens_per_block": 32,
        "life_cycles": [
            ["attention", None, 0, "required", None, "concat", "float16", [0, 2], [1024, 1024, 1024, 1024],
             [[0, "k", 1024], [0, "v", 1024], [2, "k", 1024], [2, "v", 1024]]],
            ["attention", 256, 16, "sink_required_only", None, "concat", "float16", [1], [1024, 1024],
             [[1, "k", 1024], [1, "v", 1024]]],
        ],
        "cold_groups": [["required", 4096, [0]], ["required", 2048, [1]]],
        "hash_salt": hashlib.blake2b(b"", digest_size=8).hexdigest(),
    }
    assert Layout.build(lcs).fingerprint(32, b"other")["hash_salt"] != fp["hash_salt"]


def test_split_quota_follows_demand_above_an_even_floor():
    lcs = build_life_cycles([full(0), full(1), full(2), optional_window(3)])   # 6144-byte vs 2048-byte pages
    groups = group_life_cycles(lcs, GPU)
    assert members(groups) == [(0,), (1,)]
    assert [g.slot_bytes for g in groups] == [6144, 2048]
    quota = 8 * 2**20
    slots = split_quota(quota, groups, lcs, "tiers.gpu.quota")
    floor = quota // 8
    rest = quota - 2 * floor
    assert slots == [(floor + rest * 6144 // 8192) // 6144, (floor + rest * 2048 // 8192) // 2048]
    assert sum(n * g.slot_bytes for n, g in zip(slots, groups)) <= quota
    assert split_quota(quota, [], lcs, "f") == []


def test_split_quota_too_small_names_the_field():
    lcs = build_life_cycles([full(0), optional_window(1)])
    groups = group_life_cycles(lcs, GPU)
    with pytest.raises(ConfigError) as ei:
        split_quota(4095, groups, lcs, "tiers.gpu.quota")
    assert ei.value.field == "tiers.gpu.quota"
    assert "without a single slot" in ei.value.problem
    assert split_quota(4096, groups, lcs, "tiers.gpu.quota") == [1, 1]
    assert split_quota(16384, groups, lcs, "tiers.gpu.quota") == [4, 4]


# -- property tests ------------------------------------------------------------

SIZES = st.sampled_from([128, 256, 384, 512])


@st.composite
def layer_lists(draw):
    n = draw(st.integers(1, 8))
    out = []
    for i in range(n):
        kind = draw(st.sampled_from(["attention", "attention", "ssm"]))
        window = None if kind == "ssm" else draw(st.sampled_from([None, 64, 128]))
        sinks = 0 if window is None else draw(st.sampled_from([0, 4]))
        policies = [R.REQUIRED, R.OPTIONAL, R.PRIVATE] + ([R.SINK_REQUIRED_ONLY] if window else [])
        reuse = draw(st.sampled_from(policies))
        roles = draw(st.sampled_from([("k", "v"), ("kv",), ("state",)]))
        buffers = tuple((r, draw(SIZES)) for r in roles)
        sparsity = draw(st.sampled_from([None, None, "topk"]))
        codec = draw(st.sampled_from(["concat", "int8"]))
        # codec is per life cycle: derive it from the life-cycle key so layers of one cycle agree
        out.append((i, buffers, kind, window, sinks, reuse, sparsity, codec))
    first_codec = {}
    layers = []
    for i, buffers, kind, window, sinks, reuse, sparsity, codec in out:
        key = (kind, window, sinks, reuse, sparsity)
        codec = first_codec.setdefault(key, codec)
        layers.append(LayerSpec(i, buffers, kind=kind, window_tokens=window, sink_tokens=sinks, reuse=reuse,
                                sparsity=sparsity, codec=codec))
    return layers


@settings(max_examples=120, deadline=None)
@given(layers=layer_lists(), quota=st.integers(1, 200_000))
def test_grouping_is_a_partition_by_key(layers, quota):
    lcs = build_life_cycles(layers)
    layout = Layout.build(lcs)
    for tier, keyf in ((GPU, gpu_key), (HOST, cold_key), (DISK, cold_key)):
        groups = layout.groups[tier]
        # a partition of the life cycles, groups ordered by their first life cycle
        flat = [i for g in groups for i in g.life_cycles]
        assert sorted(flat) == [lc.index for lc in lcs]
        assert len(flat) == len(set(flat))
        assert [g.index for g in groups] == list(range(len(groups)))
        firsts = [g.life_cycles[0] for g in groups]
        assert firsts == sorted(firsts)
        for g in groups:
            assert g.tier == tier
            assert list(g.life_cycles) == sorted(g.life_cycles)
            assert all(keyf(lcs[i]) == g.key for i in g.life_cycles)
            if tier == GPU:
                assert all(lcs[i].slot_sizes == g.slot_sizes for i in g.life_cycles)
            else:
                assert g.slot_sizes == (cold_page_bytes(lcs[g.life_cycles[0]]),)
        assert len({g.key for g in groups}) == len(groups)
        # pool policy: SINK_REQUIRED_ONLY lives with REQUIRED, nothing else mixes
        for g in groups:
            pols = {lcs[i].reuse for i in g.life_cycles}
            assert pols <= {R.REQUIRED, R.SINK_REQUIRED_ONLY} or len(pols) == 1
        assert layout.group_map(tier) == {i: g.index for g in groups for i in g.life_cycles}

        # quota split: within the quota, every group >= 1 slot, or ConfigError naming the field
        field = f"tiers.{tier}.quota"
        try:
            slots = split_quota(quota, groups, lcs, field)
        except ConfigError as e:
            assert e.field == field
            assert quota < 4 * len(groups) * max(g.slot_bytes for g in groups)
        else:
            assert len(slots) == len(groups)
            assert all(n >= 1 for n in slots)
            assert sum(n * g.slot_bytes for n, g in zip(slots, groups)) <= quota

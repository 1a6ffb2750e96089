"""Reuse policies, layer specs, life cycles and the stale-block arithmetic."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiers.errors import ConfigError
from tiers.layers import LayerSpec, LifeCycle, build_life_cycles, parse_layer_ids
from tiers.policy import ReusePolicy, pool_reuse_policy

R = ReusePolicy
KV = (("k", 256), ("v", 256))


def lc_of(kind="attention", window=None, sinks=0, reuse=R.REQUIRED, sparsity=None) -> LifeCycle:
    (lc,) = build_life_cycles([LayerSpec(0, KV, kind=kind, window_tokens=window, sink_tokens=sinks,
                                         reuse=reuse, sparsity=sparsity)])
    return lc


# -- reuse policies ---------------------------------------------------------------

def test_pool_reuse_policy_maps_only_sink_required_only():
    assert pool_reuse_policy(R.SINK_REQUIRED_ONLY) is R.REQUIRED
    assert pool_reuse_policy(R.REQUIRED) is R.REQUIRED
    assert pool_reuse_policy(R.OPTIONAL) is R.OPTIONAL
    assert pool_reuse_policy(R.PRIVATE) is R.PRIVATE
    assert {p: pool_reuse_policy(p) for p in R} == {
        R.REQUIRED: R.REQUIRED, R.SINK_REQUIRED_ONLY: R.REQUIRED, R.OPTIONAL: R.OPTIONAL, R.PRIVATE: R.PRIVATE}


@pytest.mark.parametrize("text,expected", [
    ("required", R.REQUIRED), ("sink_required_only", R.SINK_REQUIRED_ONLY), ("optional", R.OPTIONAL),
    ("private", R.PRIVATE), ("REQUIRED", R.REQUIRED), ("Sink_Required_Only", R.SINK_REQUIRED_ONLY),
])
def test_parse_accepts_values_case_insensitively(text, expected):
    assert R.parse(text) is expected


def test_parse_passes_policies_through():
    for p in R:
        assert R.parse(p) is p


@pytest.mark.parametrize("bad", ["bogus", "", "sink-required-only", "require", 3, None, ["required"]])
def test_parse_errors_name_the_field(bad):
    with pytest.raises(ConfigError) as ei:
        R.parse(bad, "layers[2].reuse")
    assert ei.value.field == "layers[2].reuse"
    assert "unknown reuse policy" in ei.value.problem
    for p in R:      # the message lists what is accepted
        assert p.value in ei.value.problem


def test_parse_default_field_is_reuse():
    with pytest.raises(ConfigError) as ei:
        R.parse("nope")
    assert ei.value.field == "reuse"
    assert isinstance(ei.value, ValueError)


# -- needed / required blocks: hand-computed tables ----------------------------------

TPB = 16


@pytest.mark.parametrize("h,expected", [
    (0, []), (1, [0]), (15, [0]), (16, [0]), (17, [0, 1]), (32, [0, 1]), (33, [0, 1, 2]), (40, [0, 1, 2]),
])
def test_full_attention_needs_every_block(h, expected):
    lc = lc_of()
    assert lc.needed_blocks(h, TPB) == expected
    assert lc.required_blocks(h, TPB) == expected


@pytest.mark.parametrize("h", [0, 1, 2, 15, 16, 17, 100, 1000])
def test_window_of_one_token_needs_no_cached_block(h):
    # The next token (position h) attends only to itself: no cached token is read.
    lc = lc_of(window=1)
    assert lc.needed_blocks(h, TPB) == []
    assert lc.required_blocks(h, TPB) == []


@pytest.mark.parametrize("h,expected", [
    (0, []),
    (1, [0]),          # reads token 0
    (3, [0]),          # tokens [0, 2]
    (16, [0]),         # tokens [12, 15]
    (17, [0, 1]),      # tokens [13, 16]
    (19, [0, 1]),      # tokens [15, 18]
    (20, [1]),         # tokens [16, 19]
    (21, [1]),         # tokens [17, 20]
    (32, [1]),         # tokens [28, 31]
    (33, [1, 2]),      # tokens [29, 32]
    (36, [2]),         # tokens [32, 35]
])
def test_window_smaller_than_a_block(h, expected):
    lc = lc_of(window=5)
    assert lc.needed_blocks(h, TPB) == expected


@pytest.mark.parametrize("h,expected", [
    (0, []), (1, [0]), (16, [0]), (17, [0, 1]),
    (20, [0, 1]),      # sink block 0 + window tokens [16, 19]
    (36, [0, 2]),      # sink block 0 + window tokens [32, 35]
    (40, [0, 2]),      # window tokens [36, 39]
    (49, [0, 2, 3]),   # window tokens [45, 48]
])
def test_window_smaller_than_a_block_with_sinks(h, expected):
    lc = lc_of(window=5, sinks=4, reuse=R.SINK_REQUIRED_ONLY)
    assert lc.needed_blocks(h, TPB) == expected
    assert lc.required_blocks(h, TPB) == ([0] if h > 0 else [])


@pytest.mark.parametrize("h,needed,sinks", [
    (0, [], []),
    (10, [0], [0]),
    (20, [0, 1], [0, 1]),
    (33, [0, 1, 2], [0, 1, 2]),
    (48, [0, 1, 2], [0, 1, 2]),            # window tokens [17, 47]
    (64, [0, 1, 2, 3], [0, 1, 2]),         # window tokens [33, 63]
    (100, [0, 1, 2, 4, 5, 6], [0, 1, 2]),  # window tokens [69, 99]: blocks 4..6, gap at 3
    (200, [0, 1, 2, 10, 11, 12], [0, 1, 2]),
])
def test_sinks_spanning_several_blocks(h, needed, sinks):
    # 40 sink tokens at 16 tokens per block: blocks 0, 1 and 2 (the last one partly).
    lc = lc_of(window=32, sinks=40, reuse=R.SINK_REQUIRED_ONLY)
    assert lc.sink_blocks(TPB) == 3
    assert lc.needed_blocks(h, TPB) == needed
    assert lc.required_blocks(h, TPB) == sinks
    req = lc_of(window=32, sinks=40, reuse=R.REQUIRED)
    assert req.required_blocks(h, TPB) == needed


@pytest.mark.parametrize("h,expected", [(0, []), (1, [0]), (16, [0]), (17, [1]), (32, [1]), (33, [2]), (100, [6])])
def test_ssm_needs_only_its_last_block(h, expected):
    lc = lc_of(kind="ssm")
    assert lc.needed_blocks(h, TPB) == expected
    assert lc.required_blocks(h, TPB) == expected


def test_window_without_sinks_drops_old_blocks():
    lc = lc_of(window=32)
    assert lc.needed_blocks(32, TPB) == [0, 1]       # tokens [1, 31]
    assert lc.needed_blocks(33, TPB) == [0, 1, 2]    # tokens [2, 32]
    assert lc.needed_blocks(46, TPB) == [0, 1, 2]    # tokens [15, 45]
    assert lc.needed_blocks(47, TPB) == [1, 2]       # tokens [16, 46]
    assert lc.needed_blocks(48, TPB) == [1, 2]       # tokens [17, 47]
    assert lc.needed_blocks(1000, TPB) == [60, 61, 62]


@pytest.mark.parametrize("reuse", [R.OPTIONAL, R.PRIVATE])
def test_optional_and_private_require_nothing(reuse):
    for lc in (lc_of(reuse=reuse), lc_of(window=8, sinks=4, reuse=reuse), lc_of(kind="ssm", reuse=reuse)):
        for h in (0, 1, 17, 100):
            assert lc.required_blocks(h, TPB) == []
        assert lc.needed_blocks(40, TPB) != []     # they still read pages, they just never limit a match
        assert not any(lc.is_prefix_critical(b, TPB) for b in range(10))


def test_prefix_critical_table():
    full = lc_of()
    assert all(full.is_prefix_critical(b, TPB) for b in range(20))
    for reuse in (R.REQUIRED, R.SINK_REQUIRED_ONLY):
        win = lc_of(window=32, sinks=40, reuse=reuse)
        assert [win.is_prefix_critical(b, TPB) for b in range(6)] == [True, True, True, False, False, False]
        nosink = lc_of(window=32, reuse=R.REQUIRED if reuse is R.REQUIRED else R.SINK_REQUIRED_ONLY)
        assert not any(nosink.is_prefix_critical(b, TPB) for b in range(6))
    ssm = lc_of(kind="ssm")
    assert not any(ssm.is_prefix_critical(b, TPB) for b in range(6))


# -- brute-force token-level reference -----------------------------------------------------

def ref_needed(kind, window, sinks, h, tpb):
    if h <= 0:
        return []
    if kind == "ssm":
        return [(h - 1) // tpb]
    if window is None:
        positions = set(range(h))
    else:
        # the next token (position h) attends to [h + 1 - window, h]; position h is not cached
        positions = set(range(max(0, h + 1 - window), h)) | set(range(min(sinks, h)))
    return sorted({p // tpb for p in positions})


def ref_required(kind, window, sinks, reuse, h, tpb):
    if reuse is R.REQUIRED:
        return ref_needed(kind, window, sinks, h, tpb)
    if reuse is R.SINK_REQUIRED_ONLY:
        return sorted({p // tpb for p in range(min(sinks, h))})
    return []


@st.composite
def life_cycle_params(draw):
    kind = draw(st.sampled_from(["attention", "ssm"]))
    window = None if kind == "ssm" else draw(st.one_of(st.none(), st.integers(1, 80)))
    sinks = 0 if window is None else draw(st.integers(0, 50))
    policies = [R.REQUIRED, R.OPTIONAL, R.PRIVATE] + ([R.SINK_REQUIRED_ONLY] if window is not None else [])
    reuse = draw(st.sampled_from(policies))
    return kind, window, sinks, reuse


@settings(max_examples=300, deadline=None)
@given(params=life_cycle_params(), tpb=st.integers(1, 20), h=st.integers(0, 220))
def test_blocks_match_token_level_reference(params, tpb, h):
    kind, window, sinks, reuse = params
    lc = lc_of(kind=kind, window=window, sinks=sinks, reuse=reuse)
    needed = lc.needed_blocks(h, tpb)
    assert needed == ref_needed(kind, window, sinks, h, tpb)
    assert needed == sorted(set(needed))                      # sorted, no duplicates
    assert all(0 <= b <= (h - 1) // tpb for b in needed)      # only blocks holding cached tokens
    required = lc.required_blocks(h, tpb)
    assert required == ref_required(kind, window, sinks, reuse, h, tpb)
    assert set(required) <= set(needed)


@settings(max_examples=150, deadline=None)
@given(params=life_cycle_params(), tpb=st.integers(1, 12), block=st.integers(0, 12))
def test_prefix_critical_means_every_longer_prefix_requires_it(params, tpb, block):
    kind, window, sinks, reuse = params
    lc = lc_of(kind=kind, window=window, sinks=sinks, reuse=reuse)
    # every prefix that contains the whole block, up to well past the point where a
    # window block would fall out of the window
    horizon = (block + 1) * tpb + (window or 0) + 3 * tpb + 2
    always = all(block in ref_required(kind, window, sinks, reuse, h, tpb)
                 for h in range((block + 1) * tpb, horizon))
    assert lc.is_prefix_critical(block, tpb) == always


# -- layer specs --------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,field", [
    (dict(kind="mlp"), "layers[3].kind"),
    (dict(buffers=()), "layers[3].buffers"),
    (dict(buffers=(("k", 8), ("k", 8))), "layers[3].buffers"),
    (dict(buffers=(("k", 0),)), "layers[3].buffers.k"),
    (dict(buffers=(("k", 8), ("v", -8))), "layers[3].buffers.v"),
    (dict(buffers=(("k", 8.0),)), "layers[3].buffers.k"),
    (dict(buffers=(("k", True),)), "layers[3].buffers.k"),
    (dict(window_tokens=0), "layers[3].window_tokens"),
    (dict(window_tokens=-4), "layers[3].window_tokens"),
    (dict(window_tokens=8, sink_tokens=-1), "layers[3].sink_tokens"),
    (dict(sink_tokens=4), "layers[3].sink_tokens"),
    (dict(kind="ssm", window_tokens=8), "layers[3].window_tokens"),
    (dict(reuse=R.SINK_REQUIRED_ONLY), "layers[3].reuse"),
])
def test_layer_spec_errors(kwargs, field):
    args = dict(id=3, buffers=KV)
    args.update(kwargs)
    with pytest.raises(ConfigError) as ei:
        LayerSpec(**args)
    assert ei.value.field == field


def test_build_life_cycles_groups_layers_in_order_of_first_appearance():
    layers = [
        LayerSpec(5, (("k", 64), ("v", 32)), window_tokens=128, sink_tokens=4, reuse=R.SINK_REQUIRED_ONLY),
        LayerSpec(0, (("k", 64), ("v", 32))),
        LayerSpec(2, (("state", 512),), kind="ssm"),
        LayerSpec(1, (("k", 64), ("v", 32))),
        LayerSpec(3, (("k", 64), ("v", 32)), window_tokens=128, sink_tokens=4, reuse=R.SINK_REQUIRED_ONLY),
        LayerSpec(4, (("k", 64), ("v", 32)), sparsity="topk"),
    ]
    lcs = build_life_cycles(layers)
    assert [lc.index for lc in lcs] == [0, 1, 2, 3]
    assert [lc.layer_ids for lc in lcs] == [(0, 1), (2,), (3, 5), (4,)]
    full, ssm, win, sparse = lcs
    assert (full.kind, full.window_tokens, full.sink_tokens, full.reuse, full.sparsity) == \
        ("attention", None, 0, R.REQUIRED, None)
    assert (ssm.kind, ssm.reuse) == ("ssm", R.REQUIRED)
    assert (win.window_tokens, win.sink_tokens, win.reuse) == (128, 4, R.SINK_REQUIRED_ONLY)
    assert sparse.sparsity == "topk"
    # page layout: layer order, then role order
    assert full.buffers == ((0, "k", 64), (0, "v", 32), (1, "k", 64), (1, "v", 32))
    assert full.slot_sizes == (64, 32, 64, 32)
    assert full.page_bytes == 192
    assert ssm.buffers == ((2, "state", 512),)
    d = win.describe()
    assert d == {"index": 2, "kind": "attention", "window_tokens": 128, "sink_tokens": 4,
                 "reuse": "sink_required_only", "sparsity": None, "codec": "", "layers": [3, 5],
                 "page_bytes": 192}


def test_build_life_cycles_errors():
    with pytest.raises(ConfigError) as ei:
        build_life_cycles([LayerSpec(1, KV), LayerSpec(1, KV, kind="ssm")])
    assert ei.value.field == "layers.ids"
    assert "1" in ei.value.problem
    with pytest.raises(ConfigError) as ei:
        build_life_cycles([])
    assert ei.value.field == "layers"
    with pytest.raises(ConfigError) as ei:
        build_life_cycles([LayerSpec(0, KV, codec="int8"), LayerSpec(1, KV, codec="concat")])
    assert ei.value.field == "layers[0].codec"
    with pytest.raises(ConfigError) as ei:
        build_life_cycles([LayerSpec(0, KV), LayerSpec(1, KV, dtype="bfloat16")])
    assert ei.value.field == "layers[0].dtype"


@pytest.mark.parametrize("value,expected", [
    ("0-31", list(range(32))),
    ("0-3,8", [0, 1, 2, 3, 8]),
    ("8,0-3", [0, 1, 2, 3, 8]),
    (" 4 - 6 , 10 ", [4, 5, 6, 10]),
    ("7", [7]),
    ("5-5", [5]),
    (7, [7]),
    ([3, 1, 2], [1, 2, 3]),
    ((9, 0), [0, 9]),
])
def test_parse_layer_ids(value, expected):
    assert parse_layer_ids(value, "layers[0].ids") == expected


@pytest.mark.parametrize("value", [
    "3-1", "a", "", "1-", "-1", "0-3,2", "1,1", [], [1, 1], [1.5], ["1"], [True], True, -1, [-2], 1.0, None,
])
def test_parse_layer_ids_errors(value):
    with pytest.raises(ConfigError) as ei:
        parse_layer_ids(value, "layers[4].ids")
    assert ei.value.field == "layers[4].ids"

"""StoreConfig: the TOML shape, sizes, layer ids, and every invalid config."""
from __future__ import annotations

import copy
import os
import tomllib

import pytest
import torch

from tiers.config import DiskConfig, GpuConfig, HostConfig, StoreConfig, parse_size
from tiers.device import Device
from tiers.errors import ConfigError
from tiers.grouping import DISK, GPU, HOST
from tiers.layers import LayerSpec
from tiers.policy import ReusePolicy

R = ReusePolicy

FULL_TOML = """
tokens_per_block = 16
hash_salt = "model-a"
default_priority = 40
persist_on_close = false

[[layers]]
ids = "0-3,8"
kind = "attention"
buffers = { k = 4096, v = 4096 }

[[layers]]
ids = [4, 5]
buffers = { k = 4096, v = 4096 }
window_tokens = 128
sink_tokens = 20
reuse = "sink_required_only"

[[layers]]
ids = "6-7"
buffers = { k = 4096, v = 4096 }
window_tokens = 128
reuse = "optional"
codec = "concat"

[[layers]]
ids = 9
kind = "ssm"
buffers = { state = 8192 }
reuse = "private"

[[layers]]
ids = "10"
buffers = { k = 4096, v = 4096 }
sparsity = "topk"
dtype = "bfloat16"

[tiers.gpu]
quota = "8GiB"
device = "cpu"

[tiers.host]
quota = "1.5GB"
codec = "int8"
pinned = false

[tiers.disk]
path = "spill"
quota = 1099511627776
on_mismatch = "wipe"
o_direct = "off"
min_free = "512MiB"
fsync = false
"""


@pytest.fixture
def full_dict(tmp_path):
    (tmp_path / "spill").mkdir()
    return tomllib.loads(FULL_TOML)


def test_full_toml(full_dict, tmp_path):
    cfg = StoreConfig.from_dict(full_dict, base_dir=str(tmp_path))
    assert cfg.tokens_per_block == 16
    assert cfg.hash_salt == b"model-a"
    assert cfg.default_priority == 40
    assert cfg.persist_on_close is False
    assert cfg.tiers() == [GPU, HOST, DISK]

    assert isinstance(cfg.gpu, GpuConfig) and cfg.gpu.quota == 8 * 2**30 and cfg.gpu.device == "cpu"
    assert isinstance(cfg.host, HostConfig) and cfg.host.quota == 1_500_000_000 and cfg.host.codec == "int8"
    assert cfg.host.pinned is False
    assert isinstance(cfg.disk, DiskConfig)
    assert cfg.disk.quota == 2**40
    assert cfg.disk.path == os.path.join(str(tmp_path), "spill")
    assert (cfg.disk.on_mismatch, cfg.disk.o_direct, cfg.disk.min_free, cfg.disk.fsync) == ("wipe", "off", 2**29, False)

    by_id = {l.id: l for l in cfg.layers}
    assert sorted(by_id) == list(range(11))
    assert [l.id for l in cfg.layers] == [0, 1, 2, 3, 8, 4, 5, 6, 7, 9, 10]      # entry order, then id order
    assert by_id[8].kind == "attention" and by_id[8].window_tokens is None and by_id[8].reuse is R.REQUIRED
    assert by_id[8].buffers == (("k", 4096), ("v", 4096))
    assert (by_id[5].window_tokens, by_id[5].sink_tokens, by_id[5].reuse) == (128, 20, R.SINK_REQUIRED_ONLY)
    assert (by_id[6].reuse, by_id[6].codec) == (R.OPTIONAL, "concat")
    assert by_id[0].codec == "int8"                       # the host's default codec fills unset codecs
    assert (by_id[9].kind, by_id[9].reuse, by_id[9].buffers) == ("ssm", R.PRIVATE, (("state", 8192),))
    assert (by_id[10].sparsity, by_id[10].dtype) == ("topk", "bfloat16")

    lcs = cfg.layout.life_cycles
    assert [lc.layer_ids for lc in lcs] == [(0, 1, 2, 3, 8), (4, 5), (6, 7), (9,), (10,)]
    assert [lc.codec for lc in lcs] == ["int8", "int8", "concat", "int8", "int8"]
    assert [g.life_cycles for g in cfg.layout.groups[GPU]] == [(0,), (1,), (2,), (3,), (4,)]
    for tier, quota in ((GPU, 8 * 2**30), (HOST, 1_500_000_000), (DISK, 2**40)):
        slots = cfg.slots_per_group(tier)
        groups = cfg.layout.groups[tier]
        assert len(slots) == len(groups) and all(n >= 1 for n in slots)
        assert sum(n * g.slot_bytes for n, g in zip(slots, groups)) <= quota


def test_cold_groups_of_the_full_toml(full_dict, tmp_path):
    cfg = StoreConfig.from_dict(full_dict, base_dir=str(tmp_path))
    cold = cfg.layout.groups[HOST]
    # int8 cold bytes of one fp16 k/v layer (8192 bytes): 4096 + 4 * 64
    one = 4096 + 4 * 4096 // 64
    assert [(g.key, g.life_cycles) for g in cold] == [
        ((R.REQUIRED, 5 * one), (0,)),
        ((R.REQUIRED, 2 * one), (1,)),
        ((R.OPTIONAL, 2 * 8192), (2,)),
        ((R.PRIVATE, one), (3,)),
        ((R.REQUIRED, one), (4,)),
    ]
    assert cfg.layout.groups[DISK] == tuple(
        type(g)(DISK, g.index, g.key, g.life_cycles, g.slot_sizes) for g in cold)


def test_explicit_slots_per_group_and_minimal_config():
    cfg = StoreConfig.from_dict({"layers": [{"ids": "0-1", "buffers": {"k": 256, "v": 256}},
                                            {"ids": 2, "buffers": {"k": 256, "v": 256}, "window_tokens": 8,
                                             "reuse": "optional"}],
                                 "tiers": {"gpu": {"slots": 10}}})
    assert cfg.tokens_per_block == 32 and cfg.hash_salt == b"" and cfg.default_priority == 35
    assert cfg.host is None and cfg.disk is None and cfg.tiers() == [GPU]
    assert cfg.gpu.device == "auto" and cfg.gpu.quota is None
    assert cfg.slots_per_group(GPU) == [10, 10]
    assert cfg.slots_per_group(HOST) == [0, 0]
    assert all(l.codec == "concat" for l in cfg.layers)


@pytest.mark.parametrize("ids,expected", [
    ("0-31", list(range(32))), ("0-3,8", [0, 1, 2, 3, 8]), ([5, 2, 9], [2, 5, 9]), (7, [7]), ("4", [4]),
])
def test_layer_id_forms_in_the_toml_shape(ids, expected):
    text = f"""
[[layers]]
ids = {ids!r}
buffers = {{ k = 256, v = 256 }}
[tiers.gpu]
quota = "64MiB"
""".replace("'", '"')
    cfg = StoreConfig.from_dict(tomllib.loads(text))
    assert [l.id for l in cfg.layers] == expected
    assert cfg.layout.life_cycles[0].layer_ids == tuple(expected)
    assert cfg.layout.life_cycles[0].page_bytes == 512 * len(expected)


@pytest.mark.parametrize("value,expected", [
    ("8GiB", 8 * 2**30), ("1.5GB", 1_500_000_000), ("1.5 GB", 1_500_000_000), (4096, 4096), ("4096", 4096),
    ("512MiB", 512 * 2**20), ("1KiB", 1024), ("2k", 2000), ("3kb", 3000), ("1TiB", 2**40), ("2tb", 2 * 10**12),
    ("10b", 10), (" 7 MB ", 7_000_000), (".5KiB", 512), (2.0, 2), ("0.5k", 500),
    ("4.1GB", 4_100_000_000), ("8.2GB", 8_200_000_000), ("0.35GB", 350_000_000),    # exact, not floats (review)
])
def test_parse_size(value, expected):
    assert parse_size(value, "f") == expected


@pytest.mark.parametrize("value", [0, -1, "0", "-5GiB", "abc", "5XB", "5 G i B", "", True, None, [], {},
                                   "0.1", float("inf"), float("nan"), 0.5, "1e3",
                                   2.7, 16.5, 16777216.9, "16.5", "1.0001KiB"])    # no silent truncation (new user)
def test_parse_size_errors(value):
    with pytest.raises(ConfigError) as ei:
        parse_size(value, "tiers.host.quota")
    assert ei.value.field == "tiers.host.quota"


@pytest.mark.parametrize("value", ["-5GiB", " -1", "-0.5 MiB"])
def test_a_negative_size_is_named_as_such(value):
    with pytest.raises(ConfigError, match="must be positive"):
        parse_size(value, "tiers.host.quota")
    with pytest.raises(ConfigError, match="invalid size"):
        parse_size("-" + value.strip() + "x", "tiers.host.quota")     # not a size at all


# -- invalid configs ------------------------------------------------------------

def base(tmp_path=None):
    d = {"tokens_per_block": 16,
         "layers": [{"ids": "0-1", "buffers": {"k": 256, "v": 256}},
                    {"ids": "2-3", "buffers": {"k": 256, "v": 256}, "window_tokens": 64, "sink_tokens": 4,
                     "reuse": "sink_required_only"}],
         "tiers": {"gpu": {"quota": "1MiB", "device": "cpu"}, "host": {"quota": "4MiB"}}}
    if tmp_path is not None:
        d["tiers"]["disk"] = {"quota": "16MiB", "path": str(tmp_path)}
    return d


def error_of(d, base_dir="."):
    with pytest.raises(ConfigError) as ei:
        StoreConfig.from_dict(d, base_dir=base_dir)
    assert str(ei.value).startswith(ei.value.field + ": ")
    return ei.value


def test_base_configs_are_valid(tmp_path):
    StoreConfig.from_dict(base())
    cfg = StoreConfig.from_dict(base(tmp_path))
    assert cfg.disk.path == str(tmp_path)


INVALID = {
    # quotas and slots
    "gpu quota zero": (lambda d: d["tiers"]["gpu"].update(quota=0), "tiers.gpu.quota"),
    "gpu quota negative": (lambda d: d["tiers"]["gpu"].update(quota=-4096), "tiers.gpu.quota"),
    "gpu quota negative string": (lambda d: d["tiers"]["gpu"].update(quota="-1GiB"), "tiers.gpu.quota"),
    "host quota zero string": (lambda d: d["tiers"]["host"].update(quota="0GiB"), "tiers.host.quota"),
    "host quota garbage": (lambda d: d["tiers"]["host"].update(quota="lots"), "tiers.host.quota"),
    "gpu quota too small for a slot": (lambda d: d["tiers"]["gpu"].update(quota=1000), "tiers.gpu.quota"),
    "gpu quota and slots missing": (lambda d: d["tiers"]["gpu"].pop("quota"), "tiers.gpu.quota"),
    "gpu slots zero": (lambda d: d["tiers"]["gpu"].update(slots=0), "tiers.gpu.slots"),
    "host slots negative": (lambda d: d["tiers"]["host"].update(slots=-3), "tiers.host.slots"),
    "gpu tier missing": (lambda d: d["tiers"].pop("gpu"), "tiers.gpu"),
    "tier not a table": (lambda d: d["tiers"].update(host=5), "tiers.host"),
    # disk
    "disk without path": (lambda d: d["tiers"].update(disk={"quota": "1GiB"}), "tiers.disk.path"),
    "disk path missing dir": (lambda d: d["tiers"].update(disk={"quota": "1GiB", "path": "/nonexistent/kvtier/x"}),
                              "tiers.disk.path"),
    "disk path not a string": (lambda d: d["tiers"].update(disk={"quota": "1GiB", "path": 5}), "tiers.disk.path"),
    "disk quota missing": (lambda d: d["tiers"].update(disk={"path": "/tmp"}), "tiers.disk.quota"),
    "disk on_mismatch": (lambda d: d["tiers"].update(disk={"quota": "1GiB", "path": "/tmp", "on_mismatch": "overwrite"}),
                         "tiers.disk.on_mismatch"),
    "disk on_mismatch not a string": (lambda d: d["tiers"].update(disk={"quota": "1GiB", "path": "/tmp",
                                                                        "on_mismatch": 1}), "tiers.disk.on_mismatch"),
    "disk o_direct": (lambda d: d["tiers"].update(disk={"quota": "1GiB", "path": "/tmp", "o_direct": "yes"}),
                      "tiers.disk.o_direct"),
    "disk min_free": (lambda d: d["tiers"].update(disk={"quota": "1GiB", "path": "/tmp", "min_free": "x"}),
                      "tiers.disk.min_free"),
    "disk fsync not bool": (lambda d: d["tiers"].update(disk={"quota": "1GiB", "path": "/tmp", "fsync": "no"}),
                            "tiers.disk.fsync"),
    # policies, windows, sinks
    "unknown policy": (lambda d: d["layers"][0].update(reuse="sometimes"), "layers[0].reuse"),
    "sinks without a window": (lambda d: d["layers"][0].update(sink_tokens=4), "layers[0].sink_tokens"),
    "sink_required_only without a window": (lambda d: d["layers"][0].update(reuse="sink_required_only"),
                                            "layers[0].reuse"),
    "window zero": (lambda d: d["layers"][0].update(window_tokens=0), "layers[0].window_tokens"),
    "window not an int": (lambda d: d["layers"][1].update(window_tokens="64"), "layers[1].window_tokens"),
    "window float": (lambda d: d["layers"][1].update(window_tokens=64.0), "layers[1].window_tokens"),
    "negative sinks": (lambda d: d["layers"][1].update(sink_tokens=-1), "layers[1].sink_tokens"),
    "ssm with a window": (lambda d: d["layers"][1].update(kind="ssm"), "layers[1].window_tokens"),
    "unknown kind": (lambda d: d["layers"][0].update(kind="mlp"), "layers[0].kind"),
    "kind not a string": (lambda d: d["layers"][0].update(kind=["attention"]), "layers[0].kind"),
    # layer ids
    "duplicate ids across entries": (lambda d: d["layers"][1].update(ids="1-2"), "layers[1].ids"),
    "duplicate ids within an entry": (lambda d: d["layers"][0].update(ids="0-3,2"), "layers[0].ids"),
    "duplicate ids within a list": (lambda d: d["layers"][0].update(ids=[0, 1, 1]), "layers[0].ids"),
    "bad id range": (lambda d: d["layers"][0].update(ids="3-0"), "layers[0].ids"),
    "ids missing": (lambda d: d["layers"][0].pop("ids"), "layers[0].ids"),
    "no layers": (lambda d: d.update(layers=[]), "layers"),
    "layers missing": (lambda d: d.pop("layers"), "layers"),
    "layer not a table": (lambda d: d["layers"].append(3), "layers[2]"),
    # buffers
    "buffer of size 0": (lambda d: d["layers"][0]["buffers"].update(v=0), "layers[0].buffers.v"),
    "buffer negative": (lambda d: d["layers"][1]["buffers"].update(k=-256), "layers[1].buffers.k"),
    "buffer float": (lambda d: d["layers"][0]["buffers"].update(k=256.0), "layers[0].buffers.k"),
    "buffer bool": (lambda d: d["layers"][0]["buffers"].update(k=True), "layers[0].buffers.k"),
    "buffers empty": (lambda d: d["layers"][0].update(buffers={}), "layers[0].buffers"),
    "buffers missing": (lambda d: d["layers"][0].pop("buffers"), "layers[0].buffers"),
    # unknown keys
    "unknown top-level key": (lambda d: d.update(block_size=16), "block_size"),
    "unknown tier": (lambda d: d["tiers"].update(ssd={"quota": 1}), "tiers.ssd"),
    "unknown gpu key": (lambda d: d["tiers"]["gpu"].update(qouta="1GiB"), "tiers.gpu.qouta"),
    "unknown host key": (lambda d: d["tiers"]["host"].update(path="/tmp"), "tiers.host.path"),
    "unknown layer key": (lambda d: d["layers"][1].update(windw_tokens=8), "layers[1].windw_tokens"),
    # codecs and dtypes
    "unknown host codec": (lambda d: d["tiers"]["host"].update(codec="zstd"), "tiers.host.codec"),
    "host codec not a string": (lambda d: d["tiers"]["host"].update(codec=["int8"]), "tiers.host.codec"),
    "unknown layer codec": (lambda d: d["layers"][0].update(codec="zstd"), "layers[0].codec"),
    "layer codec not a string": (lambda d: d["layers"][0].update(codec=["int8"]), "layers[0].codec"),
    "int8 on float32": (lambda d: d["layers"][0].update(codec="int8", dtype="float32"), "layers[0].codec"),
    "int8 on odd buffer": (lambda d: d["layers"][1].update(codec="int8", buffers={"k": 256, "v": 100}),
                           "layers[1].buffers.v"),
    "unknown dtype": (lambda d: d["layers"][0].update(dtype="float64"), "layers[0].dtype"),
    "dtype not a string": (lambda d: d["layers"][0].update(dtype=2), "layers[0].dtype"),
    "sparsity not a string": (lambda d: d["layers"][0].update(sparsity=["topk"]), "layers[0].sparsity"),
    "one life cycle, two codecs": (lambda d: d["layers"].append({"ids": 9, "buffers": {"k": 256, "v": 256},
                                                                 "codec": "int8"}), "layers[0].codec"),
    "pinned not bool": (lambda d: d["tiers"]["host"].update(pinned="yes"), "tiers.host.pinned"),
    # devices
    "unknown device": (lambda d: d["tiers"]["gpu"].update(device="tpu"), "tiers.gpu.device"),
    "device cuda:x": (lambda d: d["tiers"]["gpu"].update(device="cuda:x"), "tiers.gpu.device"),
    "device not a string": (lambda d: d["tiers"]["gpu"].update(device=0), "tiers.gpu.device"),
    # top-level scalars
    "tokens_per_block zero": (lambda d: d.update(tokens_per_block=0), "tokens_per_block"),
    "tokens_per_block float": (lambda d: d.update(tokens_per_block=16.0), "tokens_per_block"),
    "priority out of range": (lambda d: d.update(default_priority=101), "default_priority"),
    "priority bool": (lambda d: d.update(default_priority=True), "default_priority"),
    "salt not a string": (lambda d: d.update(hash_salt=5), "hash_salt"),
    "persist_on_close not bool": (lambda d: d.update(persist_on_close="yes"), "persist_on_close"),
    # past what the core, msgpack or ZMQ take (review finds: they raised TypeError, OverflowError)
    "tokens_per_block past 32 bits": (lambda d: d.update(tokens_per_block=2**31), "tokens_per_block"),
    "events rank past an int": (lambda d: d.update(events={"data_parallel_rank": 2**64}), "events.data_parallel_rank"),
    "events buffer past ZMQ's int": (lambda d: d.update(events={"endpoint": "tcp://127.0.0.1:*",
                                                                "buffer_batches": 2**31 - 1}), "events.buffer_batches"),
}


@pytest.mark.parametrize("name", sorted(INVALID))
def test_invalid_config_names_the_field(name):
    fn, field = INVALID[name]
    d = copy.deepcopy(base())
    fn(d)
    err = error_of(d)
    assert err.field == field, (name, err)
    assert isinstance(err, ValueError)


def test_layer_errors_name_the_entry_and_the_layer():
    d = base()
    d["layers"].append({"ids": "7-9", "buffers": {"k": 256, "v": 256}, "window_tokens": 64, "sink_tokens": -2})
    err = error_of(d)
    assert err.field == "layers[2].sink_tokens"
    assert "layer 7" in err.problem
    d = base()
    d["layers"].append({"ids": [12, 3], "buffers": {"k": 256, "v": 256}})
    err = error_of(d)
    assert err.field == "layers[2].ids"
    assert "duplicate layer id 3" in err.problem and "layers[1]" in err.problem
    d = base()
    d["layers"].append({"ids": 20, "buffers": {"k": 256, "v": 256}, "window_tokens": 32, "dtype": "float8"})
    err = error_of(d)
    assert err.field == "layers[2].dtype" and "layer 20" in err.problem


def test_relative_disk_path_resolves_against_base_dir(tmp_path):
    (tmp_path / "cache").mkdir()
    d = base()
    d["tiers"]["disk"] = {"quota": "16MiB", "path": "cache"}
    assert StoreConfig.from_dict(d, base_dir=str(tmp_path)).disk.path == str(tmp_path / "cache")
    assert error_of(d, base_dir=str(tmp_path / "elsewhere")).field == "tiers.disk.path"
    (tmp_path / "file").write_text("x")
    d["tiers"]["disk"]["path"] = "file"
    assert error_of(d, base_dir=str(tmp_path)).field == "tiers.disk.path"   # a file is not a directory


def test_cuda_device_string_is_accepted_by_the_config():
    # the config names a device; whether it exists is decided where the store opens it
    for dev in ("cuda", "cuda:0", "cuda:3", "auto", "cpu"):
        d = base()
        d["tiers"]["gpu"]["device"] = dev
        assert StoreConfig.from_dict(d).gpu.device == dev


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:1"])
def test_cuda_requested_without_cuda(spec):
    d = base()
    d["tiers"]["gpu"]["device"] = spec
    cfg = StoreConfig.from_dict(d)
    with pytest.raises(ConfigError) as ei:
        Device(cfg.gpu.device)
    assert ei.value.field == "tiers.gpu.device"
    assert "CUDA is not available" in ei.value.problem


@pytest.mark.parametrize("spec", ["tpu", "cuda:x", "", "CPU", 0, None])
def test_device_rejects_unknown_specs(spec):
    with pytest.raises(ConfigError) as ei:
        Device(spec)
    assert ei.value.field == "tiers.gpu.device"


def test_cpu_and_auto_devices():
    dev = Device("cpu")
    assert not dev.is_cuda and dev.torch_device == torch.device("cpu") and dev.name == "cpu (emulated gpu)"
    assert dev.pin_host is False
    slab = dev.empty(3, 5)
    assert slab.shape == (3, 5) and slab.dtype == torch.uint8 and int(slab.sum()) == 0
    host = dev.host_empty(2, 4)
    assert host.shape == (2, 4) and not host.is_pinned()
    auto = Device("auto")
    assert auto.is_cuda == torch.cuda.is_available()


def test_direct_construction_validates_too():
    from tiers.layers import LayerSpec
    layers = [LayerSpec(0, (("k", 256),))]
    with pytest.raises(ConfigError) as ei:
        StoreConfig(layers=layers, gpu=GpuConfig(quota="1MiB"), host=HostConfig(quota="1MiB", codec="lz4"))
    assert ei.value.field == "tiers.host.codec"
    with pytest.raises(ConfigError) as ei:
        StoreConfig(layers=layers, gpu=GpuConfig(quota="1MiB"), tokens_per_block=-1)
    assert ei.value.field == "tokens_per_block"
    cfg = StoreConfig(layers=layers, gpu=GpuConfig(quota="1MiB"))
    assert cfg.gpu.quota == 2**20 and cfg.layers[0].codec == "concat"


# ---- sizes that overflow, memory that does not exist (issue 12.10) --------------------------------------

_ONE = [LayerSpec(0, (("k", 4096),))]


@pytest.mark.parametrize("make, field", [
    (lambda d: StoreConfig(layers=_ONE, gpu=GpuConfig(quota="99999999TiB")), "tiers.gpu.quota"),
    (lambda d: StoreConfig(layers=_ONE, gpu=GpuConfig(quota=1e300)), "tiers.gpu.quota"),
    (lambda d: StoreConfig(layers=_ONE, gpu=GpuConfig(slots=2**63 - 1)), "tiers.gpu.slots"),
    (lambda d: StoreConfig(layers=[LayerSpec(0, (("k", 2**63 - 1),))], gpu=GpuConfig(slots=4)), "layers[0].buffers.k"),
    (lambda d: StoreConfig.from_dict({"layers": [{"ids": "0-999999999", "buffers": {"k": 64}}],
                                      "tiers": {"gpu": {"slots": 4}}}), "layers[0].ids"),
    (lambda d: StoreConfig(layers=_ONE, gpu=GpuConfig(slots=4), disk=DiskConfig(path=d, quota="100TiB")),
     "tiers.disk.quota"),
    (lambda d: StoreConfig(layers=_ONE, gpu=GpuConfig(slots=4), disk=DiskConfig(path=os.path.join(d, "f"), slots=4)),
     "tiers.disk.path"),
    (lambda d: StoreConfig(layers=_ONE, gpu=GpuConfig(slots=4), disk=DiskConfig(path=d, slots=4, min_free="1000PB")),
     "tiers.disk.min_free"),
])
def test_overflowing_configs_are_config_errors(tmp_path, make, field):
    (tmp_path / "f").write_text("a file, not a directory")
    with pytest.raises(ConfigError) as e:
        make(str(tmp_path))
    assert e.value.field == field
    if field == "tiers.disk.path":
        assert "is not a directory" in str(e.value)


def test_memory_that_does_not_exist_is_refused_before_allocating():
    cfg = StoreConfig(layers=_ONE, gpu=GpuConfig(quota="2GiB"), host=HostConfig(quota="3GiB"))
    cfg.check_memory(None, 6 << 30)                        # fits
    with pytest.raises(ConfigError) as e:
        cfg.check_memory(None, 4 << 30)                    # host slabs + emulated GPU slabs do not fit
    assert e.value.field == "tiers.host.quota" and "available" in str(e.value)
    with pytest.raises(ConfigError) as e:
        cfg.check_memory(1 << 30, 8 << 30)                 # the CUDA device has 1 GiB free
    assert e.value.field == "tiers.gpu.quota"
    big = StoreConfig(layers=[LayerSpec(0, (("k", 65536),))], gpu=GpuConfig(slots=4),
                      disk=DiskConfig(path="/tmp", quota="100TiB"))
    with pytest.raises(ConfigError) as e:                  # 1.7 G disk slots: the core's tables alone need 40 GB
        big.check_memory(None, 16 << 30)
    assert e.value.field == "tiers.disk.quota" and "slot tables" in str(e.value)


async def test_a_store_too_big_for_this_machine_fails_to_open_cleanly():
    from runtime import Store
    from tiers.device import host_available_bytes
    cfg = StoreConfig(layers=_ONE, gpu=GpuConfig(quota=host_available_bytes() + (1 << 30), device="cpu"))
    with pytest.raises(ConfigError) as e:
        async with Store.open(cfg):
            pass
    assert e.value.field == "tiers.gpu.quota"


def test_remote_tier_from_toml():
    from tiers.config import StoreConfig
    base = {"layers": [{"ids": [0], "buffers": {"k": 64}}],
            "tiers": {"gpu": {"slots": 8, "device": "cpu"}, "host": {"slots": 8}}}

    def remote(**kw):
        d = {**base, "tiers": {**base["tiers"], "remote": {"url": "redis://127.0.0.1:6379/0", "model": "m", **kw}}}
        return StoreConfig.from_dict(d)
    r = remote(ttl="2h", timeout="250ms", connect_timeout=2, breaker_cooldown="5s", max_inflight_bytes="64MiB").remote
    assert (r.ttl_ms, r.op_timeout, r.connect_timeout, r.breaker_cooldown, r.max_inflight_bytes) == \
        (7_200_000, 0.25, 2.0, 5.0, 64 << 20)
    assert remote(ttl=0).remote.ttl_ms is None
    for kw, field in (({"timeout": -1}, "tiers.remote.timeout"), ({"ttl": True}, "tiers.remote.ttl"),
                      ({"ttl": float("inf")}, "tiers.remote.ttl"), ({"write": "around"}, "tiers.remote.write"),
                      ({"model": ""}, "tiers.remote.model"), ({"namespace": "a b"}, "tiers.remote.namespace"),
                      ({"bogus": 1}, "tiers.remote.bogus"), ({"breaker_failures": 0}, "tiers.remote.breaker_failures"),
                      ({"ttl": "²s"}, "tiers.remote.ttl"), ({"timeout": "³ms"}, "tiers.remote.timeout")):
        with pytest.raises(ConfigError) as e:
            remote(**kw)
        assert str(e.value).startswith(field), (kw, str(e.value))
    with pytest.raises(ConfigError, match="needs a host tier"):
        StoreConfig.from_dict({**base, "tiers": {"gpu": base["tiers"]["gpu"],
                                                 "remote": {"url": "redis://127.0.0.1:6379/0", "model": "m"}}})

"""Bad input gets a typed error that names the problem, and changes nothing
(found in a review of the public surfaces: config, sequences, traces, CLI)."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest

from runtime import (ConfigError, GpuConfig, KvtierError, LayerSpec, ReusePolicy, Store, StoreConfig, UsageError,
                     load_config)
from runtime.tools.trace import read_trace

from helpers import config, fill, toks

KV = (("k", 256), ("v", 256))


def kvtier(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.tools.cli", *args], capture_output=True, text=True, timeout=120)


# ---- config built in Python takes what TOML spells, or says what is wrong ----------------------

def test_layer_specs_take_the_toml_spellings():
    spec = LayerSpec(1, {"k": 256, "v": 256}, window_tokens=8, sink_tokens=4, reuse="sink_required_only")
    assert spec.buffers == KV and spec.reuse is ReusePolicy.SINK_REQUIRED_ONLY
    cfg = StoreConfig(layers=[LayerSpec(0, KV), spec], gpu=GpuConfig(slots=8, device="cpu"), tokens_per_block=4,
                      hash_salt="tenant")
    assert len(cfg.layout.groups["gpu"]) == 1 and cfg.hash_salt == b"tenant"


@pytest.mark.parametrize("kw, field", [
    ({"buffers": [("k",)]}, "layers[0].buffers"),
    ({"buffers": [(1, 256)]}, "layers[0].buffers"),
    ({"reuse": "sometimes"}, "layers[0].reuse"),
    ({"window_tokens": 8.5}, "layers[0].window_tokens"),
    ({"window_tokens": 8, "sink_tokens": None}, "layers[0].sink_tokens"),
    ({"kind": 3}, "layers[0].kind"),
])
def test_bad_layer_specs_name_the_field(kw, field):
    args = {"id": 0, "buffers": KV, **kw}
    with pytest.raises(ConfigError) as e:
        LayerSpec(**args)
    assert e.value.field == field


def test_a_bad_hash_salt_or_layer_list_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        StoreConfig(layers=[LayerSpec(0, KV)], gpu=GpuConfig(slots=8, device="cpu"), hash_salt=7)
    assert e.value.field == "hash_salt"
    with pytest.raises(ConfigError) as e:
        StoreConfig(layers=[{"id": 0}], gpu=GpuConfig(slots=8, device="cpu"))
    assert e.value.field == "layers"


async def test_private_pages_are_never_matched_even_when_every_life_cycle_is_private():
    cfg = StoreConfig(layers=[LayerSpec(0, KV, reuse="private")], gpu=GpuConfig(slots=8, device="cpu"),
                      tokens_per_block=4)
    async with Store.open(cfg) as store:
        await fill(store, list(range(8)))
        seq = await store.open_sequence(tokens=list(range(8)))
        assert seq.matched_blocks == 0 and not store.nodes
        await seq.close()


# ---- sequences: a failed call changes nothing ---------------------------------------------------

async def test_a_commit_with_a_repeated_key_changes_nothing():
    async with Store.open(config(gpu=8)) as store:
        seq = await store.open_sequence(block_keys=[11, 12, 11])
        await seq.acquire()
        await seq.extend(3)
        with pytest.raises(UsageError, match="already indexed"):
            seq.commit(3)
        assert seq.committed == 0 and not store.nodes
        seq.commit(2)
        assert seq.committed == 2 and len(store.nodes) == 2
        await seq.release()
        await seq.close()
        store.check_consistency()


async def test_a_bad_append_leaves_the_sequence_usable():
    async with Store.open(config(gpu=8)) as store:
        seq = await store.open_sequence(tokens=list(range(4)))
        with pytest.raises(UsageError, match="64 bits"):
            seq.append(tokens=[2**70] * 4)
        assert seq.num_tokens == 4
        seq.append(tokens=[1, 2, 3, 4])
        assert len(seq.keys) == 2
        await seq.close()


async def test_a_stream_on_an_emulated_gpu_is_refused_before_anything_changes():
    cfg = config(gpu=4)
    cfg.gpu.device = "cpu"                  # emulated even where the suite runs on CUDA
    async with Store.open(cfg) as store:
        seq = await store.open_sequence(tokens=toks(1, 4))
        with pytest.raises(UsageError, match="CUDA"):
            await seq.acquire(stream=object())
        await seq.acquire()
        await seq.extend(4)
        seq.commit(4)
        with pytest.raises(UsageError, match="CUDA"):
            await seq.release(stream=object())
        await seq.release()
        await seq.close()
        assert store.stats()["tiers"]["gpu"]["groups"][0]["locked"] == 0
        await fill(store, toks(2, 4))              # the pool is free again


async def test_a_closed_sequence_answers_no_more_questions():
    async with Store.open(config(gpu=8)) as store:
        seq = await store.open_sequence(tokens=toks(1, 2))
        await seq.extend(2)
        with pytest.raises(UsageError, match="unknown layer"):
            seq.page_indices([0])
        await seq.close()
        for call in (lambda: seq.page_indices(0), lambda: seq.recompute_blocks(0)):
            with pytest.raises(KvtierError):
                call()


# ---- traces, config files and the CLI ------------------------------------------------------------

def test_traces_read_gzipped_and_skip_bad_bytes_and_infinite_times(tmp_path):
    good = '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1, 2]}\n'
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(good.encode() * 3))
    assert [r.hash_ids for r in read_trace(str(gz))[0]] == [(1, 2)] * 3
    mixed = tmp_path / "t.jsonl"
    mixed.write_bytes(b"\xff\xfe\n" + good.encode() + b'{"timestamp": 1e400, "input_length": 1, '
                      b'"output_length": 1, "hash_ids": [3]}\n' + b"[" * 100_000 + b"\n")
    requests, problems = read_trace(str(mixed))
    assert len(requests) == 1 and [p.split(":")[0] for p in problems] == ["line 1", "line 3", "line 4"]
    broken = tmp_path / "cut.jsonl.gz"
    broken.write_bytes(gzip.compress(good.encode() * 50)[:40])
    with pytest.raises(UsageError, match="cannot read trace"):
        read_trace(str(broken))


def test_config_files_that_cannot_be_read_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path)                       # a directory
    bad = tmp_path / "kv.toml"
    bad.write_bytes(b"\xff\xfe = 1")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)


@pytest.mark.parametrize("args", [
    ("stress", "--concurrency", "0"), ("stress", "--restarts", "-1"), ("demo", "--requests", "-5"),
    ("replay", "x.jsonl", "--limit", "-1"), ("replay", "x.jsonl", "--speed", "nan"),
    ("bench", "--dir", "/nonexistent/kvtier"),
])
def test_nonsense_arguments_are_refused_by_name(args):
    r = kvtier(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"argument {args[1]}" in r.stderr or f"argument {args[2]}" in r.stderr


def test_a_trace_that_is_not_text_is_a_clean_replay_error(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_bytes(b"\x1f\x8b\x08\x00binary")        # gzip magic, truncated stream
    r = kvtier("replay", str(p), "--json")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "cannot read trace" in r.stderr
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n'
                  '{"timestamp": 1e400, "input_length": 1, "output_length": 1, "hash_ids": [2]}\n')
    r = kvtier("replay", str(ok), "--honor-timestamps", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["skipped_lines"] == 1


async def test_numpy_integers_are_tokens_and_keys_and_oversized_extends_are_misuse():
    import numpy as np
    async with Store.open(config(gpu=8)) as store:
        seq = await store.open_sequence(tokens=[np.int64(t) for t in range(8)])
        same = await store.open_sequence(tokens=list(range(8)))
        assert seq.keys == same.keys
        keyed = await store.open_sequence(block_keys=[np.int32(5), 6])
        assert keyed.keys == [5, 6] and all(type(k) is int for k in keyed.keys)
        with pytest.raises(UsageError, match="mixes int and bytes") as e:
            await store.open_sequence(block_keys=[1, b"ab"])
        assert e.value.__context__ is None          # the core's own ValueError is not shown beside it
        with pytest.raises(UsageError, match="holds 8"):
            await seq.extend(10**30)
        assert seq.num_blocks == 0
        for s in (seq, same, keyed):
            await s.close()


def test_quota_with_slots_a_numeric_sparsity_and_odd_layer_ids_are_config_errors():
    with pytest.raises(ConfigError, match="not both"):
        StoreConfig(layers=[LayerSpec(0, KV)], gpu=GpuConfig(quota="1MiB", slots=8, device="cpu"))
    with pytest.raises(ConfigError) as e:
        LayerSpec(0, KV, sparsity=3)
    assert e.value.field == "layers[0].sparsity"
    from tiers.layers import parse_layer_ids
    with pytest.raises(ConfigError, match="1_0"):
        parse_layer_ids("1_0", "layers[0].ids")


async def test_a_quota_beyond_memory_is_a_config_error():
    cfg = StoreConfig(layers=[LayerSpec(0, KV)], gpu=GpuConfig(quota=2**39, device="cpu"))
    with pytest.raises(ConfigError, match="available") as e:      # refused before allocating anything
        async with Store.open(cfg):
            pass
    assert e.value.field == "tiers.gpu.quota"
    with pytest.raises(ConfigError, match="a group can have") as e:   # more slots than the core addresses
        StoreConfig(layers=[LayerSpec(0, KV)], gpu=GpuConfig(quota=2**50, device="cpu"))
    assert e.value.field == "tiers.gpu.quota"


async def test_a_commit_precheck_follows_blocks_extended_before_their_keys_were_known():
    async with Store.open(config(gpu=8)) as store:
        seq = await store.open_sequence(block_keys=[1])
        await seq.acquire()
        await seq.extend(3)                           # blocks 1 and 2 have no key yet
        seq.append(block_keys=[2, 1])                 # key 1 again, at depth 2
        with pytest.raises(UsageError, match="already indexed"):
            seq.commit(3)
        assert seq.committed == 0 and not store.nodes
        await seq.close()


async def test_bench_replay_reports_skipped_lines_and_refuses_a_trace_with_no_requests(tmp_path, capsys):
    from runtime.tools.bench import bench_replay
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [1, 2]}\nnot json\n')
    huge = json.dumps({"timestamp": 2, "input_length": 5, "output_length": 1, "hash_ids": list(range(9, 5009))})
    mixed.write_text(mixed.read_text() + huge + "\n")   # longer than the bench's GPU tier: refused, not a crash
    row = await bench_replay(str(mixed), None, str(tmp_path))
    assert row["value"] > 0 and row["lean_bound"] > 0
    assert "line 2" in capsys.readouterr().err           # said, not silently dropped
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    with pytest.raises(UsageError, match="no requests"):
        await bench_replay(str(bad), None, str(tmp_path))


async def test_bad_block_counts_are_usage_errors_and_change_nothing():
    """extend() and commit() name a bad count in a UsageError: not a number, a bool, negative,
    or past what the sequence has (a count past 2**31 too, which the core's int32 would not take)."""
    async with Store.open(config(gpu=8)) as store:
        seq = await store.open_sequence(tokens=toks(1, 2))
        for bad in ("3", None, [1], True, -1, 1.5):
            with pytest.raises(UsageError, match="non-negative integer"):
                await seq.extend(bad)
            with pytest.raises(UsageError, match="non-negative integer"):
                seq.commit(bad)
        assert seq.num_blocks == 0
        await seq.extend(2)
        for past in (3, 2**31, 10**30):
            with pytest.raises(UsageError, match=r"cannot commit \d+ blocks: only 2 have pages"):
                seq.commit(past)
        assert seq.committed == 0
        seq.commit(2)
        assert seq.committed == 2
        await seq.close()

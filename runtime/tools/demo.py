"""``kvtier demo``: the main job on embedded defaults.

A small two-life-cycle model (4 full-attention layers, 4 sliding-window
layers with sinks and ``SINK_REQUIRED_ONLY`` reuse, sharing one GPU pool
group) replays a slice of the bundled synthetic Mooncake trace with real page
bytes through GPU (emulated without CUDA), host and a temporary disk tier.
"""
from __future__ import annotations

import os
import sys
import tempfile
from importlib import resources

from tiers.config import DiskConfig, GpuConfig, HostConfig, StoreConfig
from tiers.layers import LayerSpec
from tiers.policy import ReusePolicy

from ..store import Store
from .replay import replay
from .trace import read_trace

TRACE = "synthetic_slice.jsonl"


def demo_config(disk_dir: str, gpu_slots: int = 1024, host_slots: int = 4096, disk_slots: int = 16384) -> StoreConfig:
    kv = (("k", 2048), ("v", 2048))
    layers = [LayerSpec(i, kv) for i in range(4)]
    layers += [LayerSpec(i, kv, window_tokens=2048, sink_tokens=512, reuse=ReusePolicy.SINK_REQUIRED_ONLY)
               for i in range(4, 8)]
    return StoreConfig(layers=layers, tokens_per_block=512, gpu=GpuConfig(slots=gpu_slots, device="auto"),
                       host=HostConfig(slots=host_slots), disk=DiskConfig(path=disk_dir, slots=disk_slots))


def bundled_trace() -> str:
    return str(resources.files("runtime.tools") / "data" / TRACE)


async def run_demo(requests: int = 300, quiet: bool = False, concurrency: int = 4) -> dict:
    from .cli import groups_report, progress_bar
    trace, _ = read_trace(bundled_trace(), limit=requests)
    if len(trace) < requests and not quiet:
        print(f"kvtier demo: the bundled trace slice has {len(trace)} requests; replaying all of them",
              file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
        cfg = demo_config(tmp)
        async with Store.open(cfg) as store:
            with progress_bar(len(trace), "demo replay", not quiet) as advance:
                res = await replay(store, trace, concurrency=concurrency, progress=advance)
            stats = store.stats()
        return {"replay": res.as_dict(), "groups": groups_report(cfg), "stats": stats,
                "device": store.device.name, "disk_dir": tmp if os.path.exists(tmp) else None}

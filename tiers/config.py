"""Typed configuration and its validation. Every problem raises ConfigError
naming the offending field; ``StoreConfig.from_dict`` takes the TOML shape."""
from __future__ import annotations

import dataclasses
import decimal
import math
import os
import re
from typing import Any, Mapping

from .codecs import DTYPES, get_codec
from .errors import ConfigError
from .grouping import DISK, GPU, HOST, Layout, split_quota
from .remote import RemoteSettings
from .layers import LayerSpec, build_life_cycles, parse_layer_ids
from .policy import ReusePolicy
from .units import human_bytes

MAX_BYTES = 1 << 60            # any size above 1 EiB is a typo
MAX_SLOTS = (1 << 31) - 1      # slots per pool group: the native core addresses them with int32
CORE_BYTES_PER_SLOT = 24       # the core's per-slot tables (owner, allocator stack, flags, fence; recovery)

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: Any, field: str) -> int:
    """``"8GiB"``, ``"1.5 GB"``, ``4096`` -> bytes (a positive integer)."""
    hint = '(use e.g. 4096, "512MiB", "8GiB")'
    if isinstance(value, bool):
        raise ConfigError(field, f"invalid size {str(value).lower()} {hint}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(field, f"invalid size {value!r} {hint}")
    if isinstance(value, (int, float)):
        x = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(-?)\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(1):
            raise ConfigError(field, f"must be positive, got {value!r}")
        if not m or m.group(3).lower() not in _UNITS:
            raise ConfigError(field, f"invalid size {value!r} {hint}")
        x = decimal.Decimal(m.group(2)) * _UNITS[m.group(3).lower()]     # exact: 4.1 GB is 4,100,000,000
    else:
        raise ConfigError(field, f"invalid size {value!r} {hint}")
    if x != int(x):         # 16.5 was 16 bytes, silently
        raise ConfigError(field, f"{value!r} is not a whole number of bytes {hint}")
    n = int(x)
    if n <= 0:
        raise ConfigError(field, f"must be positive, got {value!r}")
    if n > MAX_BYTES:
        raise ConfigError(field, f"{value!r} is above the 1 EiB ({MAX_BYTES} bytes) this build handles")
    return n


def _check_type(value: Any, types: tuple, field: str, what: str) -> None:
    if not isinstance(value, types):
        raise ConfigError(field, f"must be {what}, got {value!r}")


def _positive_int(value: Any, field: str, most: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(field, f"must be a positive integer, got {value!r}")
    if most is not None and value > most:
        raise ConfigError(field, f"must be at most {most:,}, got {value:,}")
    return value


@dataclasses.dataclass(slots=True)
class TierConfig:
    """One tier's capacity: a byte ``quota`` split across its pool groups, or
    an explicit ``slots`` count per pool group (handy for experiments)."""

    quota: int | str | None = None
    slots: int | None = None
    reserve: float = 0.01   # share of each group (of at most a third of the store's slots) kept free by background
                            # demotion, refilled by one step (runtime/reclaim.py); not in the last tier, except
                            # the disk, where a reserve > 0 means two spill batches if that and a step fit in 3 %
                            # of it (0: none)

    def resolve(self, field: str) -> None:
        if self.quota is None and self.slots is None:
            raise ConfigError(f"{field}.quota", "set quota or slots")
        if self.quota is not None and self.slots is not None:
            raise ConfigError(f"{field}.slots", "set quota or slots, not both")
        if isinstance(self.reserve, bool) or not isinstance(self.reserve, (int, float)) \
                or not 0 <= self.reserve <= 0.5:
            raise ConfigError(f"{field}.reserve", f"must be a number in 0..0.5, got {self.reserve!r}")
        if self.quota is not None:
            self.quota = parse_size(self.quota, f"{field}.quota")
        if self.slots is not None:
            _positive_int(self.slots, f"{field}.slots")
            if self.slots > MAX_SLOTS:
                raise ConfigError(f"{field}.slots", f"{self.slots} is above the {MAX_SLOTS} slots a pool group can have")


@dataclasses.dataclass(slots=True)
class GpuConfig(TierConfig):
    device: str = "auto"            # "auto", "cuda", "cuda:N", "cpu" (emulated)


@dataclasses.dataclass(slots=True)
class ColdTierConfig(TierConfig):
    """A tier below the GPU, with its write policy. "back": a page reaches the tier when the tier
    above evicts it (the disk: or at a clean close). "through": committed pages are also copied
    down in the background (clean copies), so that demoting a page that has its copy moves no
    bytes, and (the disk) a SIGKILL loses at most the commits of the last write_interval."""

    write: str = "back"
    write_interval: float | str = 0.05      # write-through: seconds (or "50ms") between batches, at most
    max_inflight_bytes: int | str = "64MiB"  # write-through: bytes being copied at once

    def resolve_write(self, field: str) -> None:
        if self.write not in ("back", "through"):
            raise ConfigError(f"{field}.write", f"expected 'back' or 'through', got {self.write!r}")
        bad = ConfigError(f"{field}.write_interval", "expected a duration above 0 and at most 60 s, such as "
                                                     f"'50ms', '1s' or 0.05 (seconds), got {self.write_interval!r}")
        try:
            ms = _duration_ms(self.write_interval, f"{field}.write_interval")
        except ConfigError:
            raise bad from None
        if ms is None or ms > 60_000:
            raise bad
        self.write_interval = ms / 1000
        self.max_inflight_bytes = parse_size(self.max_inflight_bytes, f"{field}.max_inflight_bytes")
        if self.max_inflight_bytes <= 0:
            raise ConfigError(f"{field}.max_inflight_bytes", "must be positive")


@dataclasses.dataclass(slots=True)
class HostConfig(ColdTierConfig):
    codec: str = "concat"           # default cold-page codec of layers that name none
    pinned: bool | None = None      # None: pinned exactly when CUDA is used


@dataclasses.dataclass(slots=True)
class DiskConfig(ColdTierConfig):
    path: str = ""
    on_mismatch: str = "error"      # "error" or "wipe" when the directory holds another layout
    o_direct: str = "auto"          # "auto" (probe), "on", "off"
    min_free: int | str | None = None   # keep this much free on the filesystem
    fsync: bool = True              # durability barriers; off only for throwaway experiments
    scrub: str = "off"              # "on_open": check every page's checksum in the background after open
    scrub_rate: int | str = "64MB"  # bytes a scrub reads per second, at most (per second of its run)


MAX_BUFFER_BATCHES = 1_000_000      # ZMQ's high-water mark is a C int; the batches are held in memory
MAX_RANK = (1 << 31) - 1            # an int in vLLM's event batches
MAX_TOKENS_PER_BLOCK = 1 << 20      # the core's block and token positions are 32-bit


@dataclasses.dataclass(slots=True)
class EventsConfig:
    """KV events for routers (runtime/events.py). Present means on; with no
    ``endpoint`` they reach only Python readers (``Store.take_events``)."""

    endpoint: str | None = None         # ZMQ PUB address kvtier binds, e.g. "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None  # ZMQ ROUTER address for catching up on missed batches
    topic: str | None = None            # default "kv@<worker_id>@<model>"
    worker_id: str | None = None        # default "<hostname>-<pid>"
    model: str = ""
    buffer_batches: int = 10_000        # batches kept for replay, queued for sending, buffered for readers
    positional: bool = False            # events as arrays, the older vLLM layout
    data_parallel_rank: int = 0
    flush_interval: float = 0.005       # seconds between turning the core's log into batches

    def check(self) -> None:
        for name in ("endpoint", "replay_endpoint", "topic", "worker_id"):
            _check_type(getattr(self, name), (str, type(None)), f"events.{name}", "a string")
        _check_type(self.model, (str,), "events.model", "a string")
        _check_type(self.positional, (bool,), "events.positional", "true or false")
        _positive_int(self.buffer_batches, "events.buffer_batches", MAX_BUFFER_BATCHES)
        if not isinstance(self.data_parallel_rank, int) or isinstance(self.data_parallel_rank, bool) \
                or not 0 <= self.data_parallel_rank <= MAX_RANK:
            raise ConfigError("events.data_parallel_rank",
                              f"must be an integer in 0..{MAX_RANK}, got {self.data_parallel_rank!r}")
        if isinstance(self.flush_interval, bool) or not isinstance(self.flush_interval, (int, float)) \
                or not 0.0001 <= self.flush_interval <= 10:
            raise ConfigError("events.flush_interval", f"must be a number of seconds in 0.0001..10, got {self.flush_interval!r}")
        if self.replay_endpoint is not None and self.endpoint is None:
            raise ConfigError("events.replay_endpoint", "needs events.endpoint (replay serves the published batches)")


@dataclasses.dataclass(slots=True)
class StoreConfig:
    layers: list[LayerSpec]
    gpu: GpuConfig
    host: HostConfig | None = None
    disk: DiskConfig | None = None
    tokens_per_block: int = 32
    hash_salt: bytes = b""
    default_priority: int = 35
    persist_on_close: bool = True   # spill committed GPU/host pages to disk at close
    events: EventsConfig | None = None  # KV events for routers; off when None
    remote: RemoteSettings | None = None    # [tiers.remote]: a Redis/Valkey store shared by many stores
    layout: Layout = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        _positive_int(self.tokens_per_block, "tokens_per_block", MAX_TOKENS_PER_BLOCK)
        if isinstance(self.hash_salt, str):
            self.hash_salt = self.hash_salt.encode()
        _check_type(self.hash_salt, (bytes,), "hash_salt", "a string or bytes")
        if not isinstance(self.layers, (list, tuple)) or not all(isinstance(l, LayerSpec) for l in self.layers):
            raise ConfigError("layers", "must be a list of LayerSpec")
        if (not isinstance(self.default_priority, int) or isinstance(self.default_priority, bool)
                or not 0 <= self.default_priority <= 100):
            raise ConfigError("default_priority", "must be an integer in 0..100")
        _check_type(self.persist_on_close, (bool,), "persist_on_close", "true or false")
        if self.events is not None:
            if not isinstance(self.events, EventsConfig):
                raise ConfigError("events", "must be an EventsConfig")
            self.events.check()
        if self.remote is not None:
            if not isinstance(self.remote, RemoteSettings):
                raise ConfigError("tiers.remote", "must be a RemoteSettings")
            self.remote.validate()
            if not self.remote.model:
                raise ConfigError("tiers.remote.model", "required: the model the pages belong to (stores of "
                                  "different models with the same layout must never share pages)")
            if self.host is None:
                raise ConfigError("tiers.remote", "needs a host tier: remote pages are fetched into host slots")
        _check_type(self.gpu.device, (str,), "tiers.gpu.device", "a string")
        if self.host is not None:
            _check_type(self.host.codec, (str,), "tiers.host.codec", "a string")
            _check_type(self.host.pinned, (bool, type(None)), "tiers.host.pinned", "true or false")
        if self.disk is not None:
            for name in ("path", "on_mismatch", "o_direct"):
                _check_type(getattr(self.disk, name), (str,), f"tiers.disk.{name}", "a string")
            _check_type(self.disk.fsync, (bool,), "tiers.disk.fsync", "true or false")
        default_codec = self.host.codec if self.host else "concat"
        get_codec(default_codec, "tiers.host.codec")
        self.layers = [l if l.codec else dataclasses.replace(l, codec=default_codec) for l in self.layers]
        lcs = build_life_cycles(self.layers)
        for lc in lcs:
            if lc.dtype not in DTYPES:
                raise ConfigError(f"layers[{lc.layers[0].id}].dtype",
                                  f"unknown dtype {lc.dtype!r} (expected one of {', '.join(DTYPES)})")
            get_codec(lc.codec, f"layers[{lc.layers[0].id}].codec").check(lc)
        self.gpu.resolve("tiers.gpu")
        if self.gpu.device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", self.gpu.device):
            raise ConfigError("tiers.gpu.device", f"unknown device {self.gpu.device!r} (auto, cuda, cuda:N, cpu)")
        if self.host is not None:
            self.host.resolve("tiers.host")
            self.host.resolve_write("tiers.host")
        if self.disk is not None:
            self.disk.resolve("tiers.disk")
            if not self.disk.path:
                raise ConfigError("tiers.disk.path", "a directory is required")
            if not os.path.exists(self.disk.path):
                raise ConfigError("tiers.disk.path",
                                  f"directory {self.disk.path!r} does not exist (make it: mkdir -p {self.disk.path})")
            if not os.path.isdir(self.disk.path):
                raise ConfigError("tiers.disk.path", f"{self.disk.path!r} is not a directory")
            if self.disk.on_mismatch not in ("error", "wipe"):
                raise ConfigError("tiers.disk.on_mismatch", f"expected 'error' or 'wipe', got {self.disk.on_mismatch!r}")
            if self.disk.o_direct not in ("auto", "on", "off"):
                raise ConfigError("tiers.disk.o_direct", f"expected auto, on or off, got {self.disk.o_direct!r}")
            self.disk.resolve_write("tiers.disk")
            if self.disk.scrub not in ("off", "on_open"):
                raise ConfigError("tiers.disk.scrub", f"expected 'off' or 'on_open', got {self.disk.scrub!r}")
            self.disk.scrub_rate = parse_size(self.disk.scrub_rate, "tiers.disk.scrub_rate")
            if self.disk.min_free is not None:
                self.disk.min_free = parse_size(self.disk.min_free, "tiers.disk.min_free")
                st = os.statvfs(self.disk.path)
                if self.disk.min_free >= st.f_blocks * st.f_frsize:
                    raise ConfigError("tiers.disk.min_free", f"{self.disk.min_free} bytes is not less than the "
                                                             f"filesystem of {self.disk.path!r} "
                                                             f"({st.f_blocks * st.f_frsize} bytes)")
        self.layout = Layout.build(lcs)
        for tier in self.tiers():
            self.slots_per_group(tier)     # validates that every group gets a slot

    def tiers(self) -> list[str]:
        return [t for t, c in ((GPU, self.gpu), (HOST, self.host), (DISK, self.disk)) if c is not None]

    def tier_config(self, tier: str) -> TierConfig | None:
        return {GPU: self.gpu, HOST: self.host, DISK: self.disk}[tier]

    def slots_per_group(self, tier: str) -> list[int]:
        cfg = self.tier_config(tier)
        groups = self.layout.groups[tier]
        if cfg is None:
            return [0] * len(groups)
        if cfg.slots is not None:
            return [cfg.slots] * len(groups)
        slots = split_quota(cfg.quota, groups, self.layout.life_cycles, f"tiers.{tier}.quota")
        for g, n in zip(groups, slots):
            if n > MAX_SLOTS:
                raise ConfigError(f"tiers.{tier}.quota", f"gives pool group {g.index} {n} slots of {g.slot_bytes} "
                                                         f"bytes, above the {MAX_SLOTS} a group can have")
        return slots

    def check_memory(self, gpu_free: int | None, host_free: int) -> None:
        """Refuse, before anything is allocated, a config whose slabs and core
        tables do not fit the memory that exists: ``gpu_free`` bytes on the
        CUDA device (None: the GPU tier is emulated in host memory) and
        ``host_free`` bytes of host memory."""
        need = {t: 0 for t in (GPU, HOST, DISK)}
        core = 0
        for tier in self.tiers():
            for g, n in zip(self.layout.groups[tier], self.slots_per_group(tier)):
                if tier != DISK:
                    need[tier] += n * g.slot_bytes
                core += n * CORE_BYTES_PER_SLOT
        if gpu_free is not None and need[GPU] > gpu_free:
            raise ConfigError("tiers.gpu.quota", f"the GPU tier needs {need[GPU]} bytes ({human_bytes(need[GPU])}); "
                                                 f"the device has {gpu_free} ({human_bytes(gpu_free)}) free")
        host = need[HOST] + core + (need[GPU] if gpu_free is None else 0)
        if host > host_free:
            parts = {"tiers.host.quota": need[HOST], "tiers.gpu.quota": need[GPU] if gpu_free is None else 0,
                     "tiers.disk.quota": core}
            field = max(parts, key=parts.get)
            raise ConfigError(field, f"the store needs {host} bytes ({human_bytes(host)}) of host memory (host "
                                     f"slabs {need[HOST]}, emulated GPU slabs {parts['tiers.gpu.quota']}, the core's "
                                     f"slot tables {core}); {host_free} ({human_bytes(host_free)}) are available")

    # -- TOML shape -------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], base_dir: str = ".") -> "StoreConfig":
        d = dict(d)
        _reject_unknown(d, {"tokens_per_block", "layers", "tiers", "hash_salt", "default_priority",
                            "persist_on_close", "events"}, "")
        if "events" in d:
            d["events"] = _tier(EventsConfig, d["events"], "events")
        raw_tiers = d.pop("tiers", None) or {}
        if not isinstance(raw_tiers, Mapping):
            raise ConfigError("tiers", "must be a table")
        tiers = dict(raw_tiers)
        _reject_unknown(tiers, {GPU, HOST, DISK, "remote"}, "tiers.")
        if GPU not in tiers:
            raise ConfigError("tiers.gpu", "the gpu tier is required")
        gpu = _tier(GpuConfig, tiers[GPU], "tiers.gpu")
        host = _tier(HostConfig, tiers[HOST], "tiers.host") if HOST in tiers else None
        disk = _tier(DiskConfig, tiers[DISK], "tiers.disk") if DISK in tiers else None
        if "remote" in tiers:
            d["remote"] = _remote(tiers["remote"])
        if disk is not None and isinstance(disk.path, str) and disk.path:
            disk.path = os.path.join(base_dir, os.path.expanduser(disk.path))
        raw_layers = d.pop("layers", None)
        if not isinstance(raw_layers, list) or not raw_layers:
            raise ConfigError("layers", "at least one [[layers]] entry is required")
        layers: list[LayerSpec] = []
        entry_of: dict[int, int] = {}       # layer id -> index of its [[layers]] entry
        for n, entry in enumerate(raw_layers):
            for layer in _layers(entry, n):
                if layer.id in entry_of:
                    raise ConfigError(f"layers[{n}].ids",
                                      f"duplicate layer id {layer.id} (already in layers[{entry_of[layer.id]}])")
                entry_of[layer.id] = n
                layers.append(layer)
        salt = d.pop("hash_salt", "")
        if not isinstance(salt, str):
            raise ConfigError("hash_salt", "must be a string")
        try:
            return cls(layers=layers, gpu=gpu, host=host, disk=disk, hash_salt=salt.encode(), **d)
        except ConfigError as e:
            raise _entry_field(e, entry_of) from None


def _entry_field(e: ConfigError, entry_of: Mapping[int, int]) -> ConfigError:
    """Per-layer checks name ``layers[<layer id>]``; in the TOML shape the field
    is the ``[[layers]]`` entry, so ``layers[<entry>]`` with the layer id in the
    message."""
    m = re.fullmatch(r"layers\[(\d+)\](.*)", e.field)
    if m is None or int(m.group(1)) not in entry_of:
        return e
    layer_id = int(m.group(1))
    return ConfigError(f"layers[{entry_of[layer_id]}]{m.group(2)}", f"layer {layer_id}: {e.problem}")


def _reject_unknown(d: Mapping[str, Any], allowed: set[str], prefix: str) -> None:
    for k in d:
        if k not in allowed:
            raise ConfigError(f"{prefix}{k}", f"unknown field (expected one of {', '.join(sorted(allowed))})")


_DURATION = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration_ms(value: Any, field: str) -> int | None:
    """``"24h"``, ``"90s"``, ``"500ms"`` or a number of seconds; 0 or "none": no expiry."""
    if isinstance(value, bool):
        raise ConfigError(field, f"expected a duration such as '24h', '90s' or seconds, got {value!r}")
    if value in (0, "none"):
        return None
    if isinstance(value, (int, float)) and 0 < value < 10 ** 9:      # under 30 years: finite, and Redis takes it
        return max(1, int(value * 1000))
    if isinstance(value, str):
        for unit in sorted(_DURATION, key=len, reverse=True):
            num = value.strip()[:-len(unit)].strip()
            # ASCII digits only: str.isdigit takes "²", which float() refuses
            if value.strip().endswith(unit) and num.isascii() and num.replace(".", "", 1).isdigit() and \
                    0 < float(num) * _DURATION[unit] < 10 ** 9:
                return max(1, int(float(num) * _DURATION[unit] * 1000))
    raise ConfigError(field, f"expected a duration such as '24h', '90s' or seconds, got {value!r}")


def _remote(raw: Any) -> RemoteSettings:
    """``[tiers.remote]``: TOML spellings into the backend's settings."""
    field = "tiers.remote"
    if not isinstance(raw, Mapping):
        raise ConfigError(field, "must be a table")
    raw = dict(raw)
    _reject_unknown(raw, {"url", "urls", "cluster", "namespace", "ttl", "max_inflight_bytes", "connect_timeout",
                          "timeout", "write", "breaker_failures", "breaker_cooldown", "model"}, field + ".")
    kw: dict[str, Any] = {k: raw.pop(k) for k in ("url", "urls", "cluster", "namespace", "breaker_failures",
                                                   "model", "write") if k in raw}
    if "ttl" in raw:
        kw["ttl_ms"] = _duration_ms(raw.pop("ttl"), f"{field}.ttl")
    for name, attr in (("timeout", "op_timeout"), ("connect_timeout", "connect_timeout"),
                       ("breaker_cooldown", "breaker_cooldown")):
        if name in raw:
            ms = _duration_ms(raw.pop(name), f"{field}.{name}")
            if ms is None:
                raise ConfigError(f"{field}.{name}", "must be positive")
            kw[attr] = ms / 1000
    if "max_inflight_bytes" in raw:
        kw["max_inflight_bytes"] = parse_size(raw.pop("max_inflight_bytes"), f"{field}.max_inflight_bytes")
    settings = RemoteSettings(**kw)
    try:
        settings.validate()
    except ConfigError as e:            # the backend's field names, spelled as in the TOML
        names = {"op_timeout": "timeout", "ttl_ms": "ttl"}
        raise ConfigError(f"{field}.{names.get(e.field.rsplit('.', 1)[-1], e.field.rsplit('.', 1)[-1])}",
                          e.problem) from None
    return settings


def _tier(cls, raw: Any, field: str):
    if not isinstance(raw, Mapping):
        raise ConfigError(field, "must be a table")
    names = {f.name for f in dataclasses.fields(cls)}
    _reject_unknown(raw, names, field + ".")
    return cls(**raw)


def _layers(entry: Any, n: int) -> list[LayerSpec]:
    """The layers of the ``n``-th ``[[layers]]`` entry."""
    field = f"layers[{n}]"
    if not isinstance(entry, Mapping):
        raise ConfigError(field, "must be a table")
    allowed = {"ids", "kind", "buffers", "window_tokens", "sink_tokens", "reuse", "sparsity", "codec", "dtype"}
    _reject_unknown(entry, allowed, field + ".")
    if "ids" not in entry:
        raise ConfigError(f"{field}.ids", "required")
    buffers = entry.get("buffers")
    if not isinstance(buffers, Mapping) or not buffers:
        raise ConfigError(f"{field}.buffers", "a table of role = bytes per block is required")
    bufs = tuple((str(r), b) for r, b in buffers.items())
    for r, b in bufs:
        if not isinstance(b, int) or isinstance(b, bool) or b <= 0:
            raise ConfigError(f"{field}.buffers.{r}", f"bytes per block must be a positive integer, got {b!r}")
    common = dict(
        buffers=bufs,
        kind=entry.get("kind", "attention"),
        window_tokens=entry.get("window_tokens"),
        sink_tokens=entry.get("sink_tokens", 0),
        reuse=ReusePolicy.parse(entry.get("reuse", "required"), f"{field}.reuse"),
        sparsity=entry.get("sparsity"),
        codec=entry.get("codec", ""),
        dtype=entry.get("dtype", "float16"),
    )
    for name in ("window_tokens", "sink_tokens"):
        v = common[name]
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise ConfigError(f"{field}.{name}", f"must be an integer, got {v!r}")
    for name in ("kind", "codec", "dtype", "sparsity"):
        v = common[name]
        if not isinstance(v, str) and not (name == "sparsity" and v is None):
            raise ConfigError(f"{field}.{name}", f"must be a string, got {v!r}")
    out = []
    for i in parse_layer_ids(entry["ids"], f"{field}.ids"):
        try:
            out.append(LayerSpec(id=i, **common))
        except ConfigError as e:
            raise _entry_field(e, {i: n}) from None
    return out

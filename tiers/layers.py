"""Layer specs, life cycles and the stale-block arithmetic.

Layers that share kind, window, sinks, reuse policy and sparsity share a life
cycle; all their buffers for one block form the life cycle's *page*. The page
is laid out contiguously (layer order, then role order), which is what lets a
migration move a whole page with one row copy.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from .errors import ConfigError
from .policy import ReusePolicy

MAX_LAYERS = 1 << 16            # layer ids in one config (the journal keeps a life cycle in 16 bits)
MAX_LAYER_ID = (1 << 31) - 1
MAX_BUFFER_BYTES = 1 << 40      # bytes per block of one buffer

KINDS = ("attention", "ssm")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True, slots=True)
class LayerSpec:
    id: int
    buffers: tuple[tuple[str, int], ...]          # (role, bytes per block)
    kind: str = "attention"
    window_tokens: int | None = None
    sink_tokens: int = 0
    reuse: ReusePolicy = ReusePolicy.REQUIRED
    sparsity: str | None = None
    codec: str = ""          # "" = the store's default codec (tiers.host.codec)
    dtype: str = "float16"

    def __post_init__(self) -> None:
        if not _is_int(self.id) or self.id < 0:
            raise ConfigError("layers", f"a layer id must be a non-negative integer, got {self.id!r}")
        f = f"layers[{self.id}]"
        # the Python API takes what TOML spells: a {role: bytes} table and a policy name
        if isinstance(self.buffers, dict):
            object.__setattr__(self, "buffers", tuple(self.buffers.items()))
        try:
            buffers = tuple((role, size) for role, size in self.buffers)
        except (TypeError, ValueError):
            raise ConfigError(f"{f}.buffers", f"expected (role, bytes) pairs or a {{role: bytes}} table, "
                                              f"got {self.buffers!r}") from None
        object.__setattr__(self, "buffers", buffers)
        object.__setattr__(self, "reuse", ReusePolicy.parse(self.reuse, f"{f}.reuse"))
        for name in ("kind", "codec", "dtype"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{f}.{name}", f"must be a string, got {getattr(self, name)!r}")
        if self.sparsity is not None and not isinstance(self.sparsity, str):
            raise ConfigError(f"{f}.sparsity", f"must be a string or absent, got {self.sparsity!r}")
        if self.window_tokens is not None and not _is_int(self.window_tokens):
            raise ConfigError(f"{f}.window_tokens", f"must be an integer, got {self.window_tokens!r}")
        if not _is_int(self.sink_tokens):
            raise ConfigError(f"{f}.sink_tokens", f"must be an integer, got {self.sink_tokens!r}")
        if self.kind not in KINDS:
            raise ConfigError(f"{f}.kind", f"unknown kind {self.kind!r} (expected attention or ssm)")
        if not self.buffers:
            raise ConfigError(f"{f}.buffers", "a layer needs at least one buffer")
        roles = [r for r, _ in self.buffers]
        if not all(isinstance(r, str) and r for r in roles):
            raise ConfigError(f"{f}.buffers", f"buffer roles must be non-empty strings, got {roles!r}")
        if len(set(roles)) != len(roles):
            raise ConfigError(f"{f}.buffers", "duplicate buffer role")
        for role, size in self.buffers:
            if not _is_int(size) or size <= 0:
                raise ConfigError(f"{f}.buffers.{role}", f"bytes per block must be a positive integer, got {size!r}")
            if size > MAX_BUFFER_BYTES:
                raise ConfigError(f"{f}.buffers.{role}",
                                  f"{size} bytes per block is above the {MAX_BUFFER_BYTES} (1 TiB) this build handles")
        if self.window_tokens is not None and self.window_tokens <= 0:
            raise ConfigError(f"{f}.window_tokens", "must be positive")
        if self.sink_tokens < 0:
            raise ConfigError(f"{f}.sink_tokens", "must not be negative")
        if self.sink_tokens and self.window_tokens is None:
            raise ConfigError(f"{f}.sink_tokens", "sinks need a window (window_tokens)")
        if self.kind == "ssm" and self.window_tokens is not None:
            raise ConfigError(f"{f}.window_tokens", "an ssm layer has no window")
        if self.reuse is ReusePolicy.SINK_REQUIRED_ONLY and self.window_tokens is None:
            raise ConfigError(f"{f}.reuse", "sink_required_only needs a windowed layer (window_tokens)")

    @property
    def life_cycle_key(self) -> tuple:
        return (self.kind, self.window_tokens, self.sink_tokens, self.reuse, self.sparsity)


@dataclasses.dataclass(frozen=True, slots=True)
class LifeCycle:
    """Layers that age together. ``index`` is the life cycle's id in the model."""

    index: int
    kind: str
    window_tokens: int | None
    sink_tokens: int
    reuse: ReusePolicy
    sparsity: str | None
    codec: str
    dtype: str
    layers: tuple[LayerSpec, ...]

    @property
    def buffers(self) -> tuple[tuple[int, str, int], ...]:
        """(layer id, role, bytes) per pool, in page order."""
        return tuple((l.id, r, b) for l in self.layers for r, b in l.buffers)

    @property
    def slot_sizes(self) -> tuple[int, ...]:
        """The hot page shape: one slot size per pool."""
        return tuple(b for _, _, b in self.buffers)

    @property
    def page_bytes(self) -> int:
        return sum(self.slot_sizes)

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(l.id for l in self.layers)

    def describe(self) -> dict:
        return {
            "index": self.index, "kind": self.kind, "window_tokens": self.window_tokens,
            "sink_tokens": self.sink_tokens, "reuse": self.reuse.value, "sparsity": self.sparsity,
            "codec": self.codec, "layers": list(self.layer_ids), "page_bytes": self.page_bytes,
        }

    # -- stale-block arithmetic -------------------------------------------------
    def sink_blocks(self, tokens_per_block: int) -> int:
        return -(-self.sink_tokens // tokens_per_block)

    def needed_blocks(self, h: int, tokens_per_block: int) -> list[int]:
        """Blocks whose pages the next token (position ``h``) reads."""
        if h <= 0:
            return []
        last = (h - 1) // tokens_per_block
        if self.kind == "ssm":
            return [last]
        if self.window_tokens is None:
            return list(range(last + 1))
        lo_tok = max(0, h + 1 - self.window_tokens)
        sinks = range(min(self.sink_blocks(tokens_per_block), last + 1))
        window = range(lo_tok // tokens_per_block, last + 1) if lo_tok <= h - 1 else range(0)
        return sorted(set(sinks) | set(window))

    def required_blocks(self, h: int, tokens_per_block: int) -> list[int]:
        """Blocks that must be present for a prefix of ``h`` tokens to match."""
        if self.reuse is ReusePolicy.REQUIRED:
            return self.needed_blocks(h, tokens_per_block)
        if self.reuse is ReusePolicy.SINK_REQUIRED_ONLY and h > 0:
            return list(range(min(self.sink_blocks(tokens_per_block), (h - 1) // tokens_per_block + 1)))
        return []

    def is_prefix_critical(self, block: int, tokens_per_block: int) -> bool:
        """True when every longer prefix needs this block's page."""
        if self.reuse not in (ReusePolicy.REQUIRED, ReusePolicy.SINK_REQUIRED_ONLY) or self.kind == "ssm":
            return False
        if self.window_tokens is None:
            return self.reuse is ReusePolicy.REQUIRED
        return block < self.sink_blocks(tokens_per_block)


def build_life_cycles(layers: Iterable[LayerSpec]) -> list[LifeCycle]:
    """Deduplicate layers into life cycles, in order of first appearance."""
    by_key: dict[tuple, list[LayerSpec]] = {}
    seen: set[int] = set()
    for layer in sorted(layers, key=lambda l: l.id):
        if layer.id in seen:
            raise ConfigError("layers.ids", f"duplicate layer id {layer.id}")
        seen.add(layer.id)
        by_key.setdefault(layer.life_cycle_key, []).append(layer)
    out = []
    for i, (key, group) in enumerate(by_key.items()):
        for attr in ("codec", "dtype"):
            values = {getattr(l, attr) for l in group}
            if len(values) > 1:
                raise ConfigError(f"layers[{group[0].id}].{attr}",
                                  f"layers of one life cycle disagree on {attr}: {sorted(values)}")
        kind, window, sinks, reuse, sparsity = key
        out.append(LifeCycle(i, kind, window, sinks, reuse, sparsity, group[0].codec, group[0].dtype, tuple(group)))
    if not out:
        raise ConfigError("layers", "at least one layer is required")
    return out


def parse_layer_ids(value: "str | int | Sequence[int]", field: str) -> list[int]:
    """``"0-31"``, ``"0-3,8"``, ``7`` or ``[0, 1, 2]`` -> sorted list of ids."""
    if isinstance(value, bool):
        raise ConfigError(field, f"invalid layer ids {value!r}")
    if isinstance(value, int):
        ids = [value]
    elif isinstance(value, str):
        ids = []
        for part in value.replace(" ", "").split(","):
            lo, sep, hi = part.partition("-")
            if not (lo.isascii() and lo.isdigit() and (not sep or (hi.isascii() and hi.isdigit()))):
                raise ConfigError(field, f"invalid layer id range {part!r}")
            a, b = int(lo), int(hi) if sep else int(lo)
            if b < a:
                raise ConfigError(field, f"empty layer id range {part!r}")
            if b - a + 1 + len(ids) > MAX_LAYERS:
                raise ConfigError(field, f"more than {MAX_LAYERS} layer ids ({part!r})")
            ids.extend(range(a, b + 1))
    elif isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        ids = list(value)
    else:
        raise ConfigError(field, f"invalid layer ids {value!r}")
    if any(i < 0 for i in ids):
        raise ConfigError(field, "layer ids must not be negative")
    if len(ids) > MAX_LAYERS or any(i > MAX_LAYER_ID for i in ids):
        raise ConfigError(field, f"at most {MAX_LAYERS} layer ids, each at most {MAX_LAYER_ID}")
    if len(set(ids)) != len(ids):
        raise ConfigError(field, "duplicate layer id in one entry")
    if not ids:
        raise ConfigError(field, "no layer ids")
    return sorted(ids)

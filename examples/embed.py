"""kvtier embedded in an async server: the request cycle a model runner goes through.

Multi-turn conversations share a system prompt and grow turn by turn, so each
turn's prompt starts with the previous turn's. Every request opens a sequence
on its prompt, acquires the cached prefix onto the GPU tier, extends fresh
pages for the rest, and plays the model: it checks the bytes of every cached
page it was handed and writes the pages it "computes" (a pattern derived from
each block's key, as real KV is a function of the prefix). Then it commits,
releases and closes. Pages evicted from the GPU tier go to the host tier and
from there to disk; run it twice on the same disk directory and the second run
starts from the pages the first left on disk.

    python examples/embed.py                       # examples/small.toml, its disk in examples/disk/small/
    python examples/embed.py --disk-dir /tmp/kv    # any directory (made if missing)

Exit status 1 if a cached page came back with wrong bytes.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import sys

import torch

import runtime

HERE = os.path.dirname(os.path.abspath(__file__))


def expected_pages(keys: list[bytes], layer: int, role: str, nbytes: int) -> torch.Tensor:
    """The bytes the "model" computes for these blocks of one layer's buffer: ``[blocks, nbytes]``,
    each block's whole 16-byte key tiled across its page and mixed with a pattern of the column,
    layer and role, so that a page of any other block, layer or buffer reads as wrong."""
    salt = layer * 2 + (role == "v")
    key = torch.frombuffer(bytearray(b"".join(keys)), dtype=torch.uint8).view(len(keys), 16)
    tiled = key.repeat(1, -(-nbytes // 16))[:, :nbytes]
    col = ((torch.arange(nbytes) * (7 + 2 * salt) + salt) & 0xFF).to(torch.uint8)
    return tiled ^ col


class Model:
    """Stands in for the attention kernels: reads cached pages, writes computed ones."""

    def __init__(self, store: runtime.Store, cfg: runtime.StoreConfig) -> None:
        self.store = store
        self.buffers = [(spec.id, role) for spec in cfg.layers for role, _ in spec.buffers]
        self.checked = 0
        self.wrong = 0
        self.written = 0

    def run(self, seq: runtime.Sequence) -> None:
        """One prefill: the first ``matched_blocks`` blocks were cached, the rest are new."""
        store = self.store
        for layer, role in self.buffers:
            pool = store.pool_tensor(layer, role)                 # [slots, bytes], on the GPU tier's device
            dev = pool.device
            slots = torch.tensor(seq.page_indices(layer), dtype=torch.int64, device=dev)  # -1: none (out of window)
            cached = torch.zeros(len(slots), dtype=torch.bool, device=dev)
            cached[:seq.matched_blocks] = True
            cached[seq.recompute_blocks(layer)] = False           # cached blocks whose page holds no data
            want = expected_pages(seq.keys[:len(slots)], layer, role, pool.shape[1]).to(dev)
            read, fill = cached & (slots >= 0), ~cached & (slots >= 0)
            self.checked += int(read.sum())
            self.wrong += int((pool[slots[read]] != want[read]).any(dim=1).sum())
            pool[slots[fill]] = want[fill]
            self.written += int(fill.sum())


class Admission:
    """What a server does with ``OutOfPagesError``: the GPU pool is locked by the requests in
    flight, so the request waits for one of them to end and tries again. A request larger than
    the pool (``RequestTooLargeError``) never fits: it is refused, not retried."""

    def __init__(self) -> None:
        self.running = 0
        self.finished = 0                   # requests that ended holding no more pages, ever
        self.ended = asyncio.Condition()

    async def serve(self, request) -> bool:
        """Run ``request()`` (one open .. close) until it fits; False if it never can."""
        while True:
            seen = self.finished
            self.running += 1
            refused = False
            try:
                await request()
                return True
            except runtime.RequestTooLargeError as exc:
                print(f"refused: {exc}", file=sys.stderr)
                return False
            except runtime.OutOfPagesError:
                if self.running == 1:       # nobody else holds pages: waiting would never end
                    raise
                refused = True
            finally:
                self.running -= 1
                if not refused:             # a refused try freed nothing: it wakes nobody
                    self.finished += 1
                    async with self.ended:
                        self.ended.notify_all()
            async with self.ended:          # until a request ends (one may have ended already)
                await self.ended.wait_for(lambda: self.finished != seen)


async def conversation(store: runtime.Store, model: Model, admission: Admission, rng: random.Random,
                       system: list[int], turns: int, tally: collections.Counter) -> None:
    history = list(system)
    for _ in range(turns):
        history += [rng.randrange(32_000) for _ in range(rng.randrange(2_000, 5_000))]

        async def request(tokens=list(history)) -> None:
            seq = await store.open_sequence(tokens=tokens, priority=35)
            try:
                await seq.acquire()                               # cached prefix on the GPU, locked, ready
                await seq.extend(len(seq.keys) - seq.num_blocks)  # fresh pages for the rest of the prompt
                model.run(seq)
                seq.commit(len(seq.keys))                         # published for later turns and requests
                await seq.release()
                tally.update(seq.matched_by_tier)
                tally["blocks"] += len(seq.keys)
            finally:
                await seq.close()
        if not await admission.serve(request):
            return
        history += [rng.randrange(32_000) for _ in range(200)]    # the reply, part of the next turn's prompt
        await asyncio.sleep(0)


async def main(args: argparse.Namespace) -> int:
    if args.disk_dir is not None:
        try:
            os.makedirs(args.disk_dir, exist_ok=True)
        except OSError as exc:
            raise runtime.ConfigError("--disk-dir", f"cannot make {args.disk_dir}: {exc.strerror}") from None
    cfg = runtime.load_config(args.config, disk_path=args.disk_dir)
    rng = random.Random(args.seed)
    system = [rng.randrange(32_000) for _ in range(2_048)]        # a system prompt every conversation shares
    tally: collections.Counter = collections.Counter()
    async with runtime.Store.open(cfg) as store:
        model, admission = Model(store, cfg), Admission()
        await asyncio.gather(*(conversation(store, model, admission, random.Random(args.seed * 1000 + c), system,
                                            args.turns, tally) for c in range(args.conversations)))
        moved = store.stats()["moves"]
    blocks = tally.pop("blocks", 0)
    tiers = [t for t in ("gpu", "host", "disk", "remote") if t != "remote" or cfg.remote is not None]
    print(f"{args.conversations} conversations x {args.turns} turns: {blocks} blocks requested, "
          + ", ".join(f"{tally[tier]} cached on {tier}" for tier in tiers))
    print("pages moved: " + (", ".join(f"{d} {m['pages']}" for d, m in sorted(moved.items()) if m["pages"])
                             or "none"))
    print(f"cached buffers checked {model.checked} (a block's k or v of one layer), wrong {model.wrong}; "
          f"computed {model.written}")
    if cfg.disk is not None:
        print(f"disk tier: {cfg.disk.path} (run again to start from the pages left there)")
    return 1 if model.wrong else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join(HERE, "small.toml"))
    p.add_argument("--disk-dir", default=None, help="the disk tier's directory instead of the config's")
    p.add_argument("--conversations", type=int, default=96)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    try:
        sys.exit(runtime.run(main(args)))
    except (runtime.KvtierError, OSError) as exc:     # a bad config or disk directory: one line, as kvtier says it
        sys.exit(f"embed.py: {exc}")

"""The metadata of a big legacy checkpoint, parsed by every rank at once before an in-memory reshard.

The resharder needs every shard's metadata; one reader at 6 ms a file makes rank 0 parse for 50 s at 8,192 shards
while every other rank waits. Above :data:`COOPERATIVE_ABOVE` files, rank 0 sends the list of shard files (from the
directory listing), each rank parses its share (every ``world``-th file: the metadata only, as rank 0 would), and
rank 0 gathers the results (compact: RNG states left out, zlib'd) and runs discovery on them — its checks and
problems exactly as if it had read every file itself — before it sends the layout to all (:mod:`legacy_load`).
Each rank reads a few small metadata records of files it is about to read tensors from anyway.
"""

from __future__ import annotations

import io
import os
import pickle
import zlib
from typing import Any

from megatron_preflight import reshard  # its modules load on first use (a lazy package)
from megatron_preflight.errors import PreflightError
from megatron_preflight.hook import consensus
from megatron_preflight.hook.state import STATE
from megatron_preflight.layout import naming
from megatron_preflight.layout.discover import discover, read_shard, read_shards
from megatron_preflight.layout.model import Format, Shard
from megatron_preflight.layout.transport import NOT_SENT, ArgsDelta, _Pickler, apply_delta, delta

COOPERATIVE_ABOVE = int(os.environ.get("MEGATRON_PREFLIGHT_COOPERATIVE_ABOVE", "32") or 32)


def _error(exc: BaseException) -> tuple[str, str, str | None, str | None, str]:
    kind = "optimizer" if isinstance(exc, reshard.OptimizerNotReshardable) else "error"
    if isinstance(exc, PreflightError):
        return kind, exc.message, exc.path, exc.fix, exc.code
    return kind, f"{type(exc).__name__}: {exc}", None, None, "corrupt_file"


def rebuild_error(e: tuple) -> PreflightError:
    kind, message, path, fix, code = e
    cls = reshard.OptimizerNotReshardable if kind == "optimizer" else PreflightError
    return cls(message, path=path, fix=fix, code=code)


def parse_share(items: list[tuple[str, str]], trust: bool, with_dist: bool) -> bytes:
    """Parse the model file (and ``distrib_optim.pt``) of each (shard name, shard dir); the results as bytes."""
    out = []
    base = None  # the share's first args: the others travel as deltas from it (they differ in rank, local_rank)
    for name, path in items:
        shard, err = read_shard(Shard(name, None, None, None, path=path), trust)
        meta = {k: v for k, v in shard.meta.items() if k not in NOT_SENT} if isinstance(shard.meta, dict) else None
        if meta is not None and meta.get("args") is not None:
            if base is None:
                base = meta["args"]
            else:
                meta["args"] = delta(base, meta["args"])
        dist, dist_err = None, None
        if with_dist and err is None:
            try:
                dist = reshard.read_dist_meta(shard, trust)
            except Exception as exc:  # noqa: BLE001 - sent to rank 0, which decides as if it had read it
                dist_err = _error(exc)
        out.append((name, meta, None if err is None else _error(err), dist, dist_err))
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(out)
    return zlib.compress(buf.getvalue(), 6)


class Gathered:
    """What the ranks parsed, by shard name: a :data:`discover.ShardReader` and the distributed optimizer's files."""

    def __init__(self, payloads: list[bytes]) -> None:
        self.items: dict[str, tuple] = {}
        for data in payloads:
            base = None
            for item in pickle.loads(zlib.decompress(data)):  # noqa: S301 - bytes made by this job's own ranks
                meta = item[1]
                if isinstance(meta, dict) and isinstance(meta.get("args"), ArgsDelta):
                    meta["args"] = apply_delta(base, meta["args"])
                elif isinstance(meta, dict) and meta.get("args") is not None and base is None:
                    base = meta["args"]
                self.items[item[0]] = item

    def __call__(self, shards: list[Shard], trust: bool) -> list[tuple[Shard, Exception | None]]:
        out, rest = [], []
        for s in shards:
            item = self.items.get(s.name)
            if s.meta is not None or item is None:
                rest.append(s)  # already parsed (the sample's first file), or listed after the others parsed
                continue
            s.meta = item[1]
            out.append((s, None if item[2] is None else rebuild_error(item[2])))
        return out + read_shards(rest, trust)

    def attach_dist(self, shards: list[Shard]) -> None:
        """Give each shard its parsed ``distrib_optim.pt``; a file that is there but unreadable fails as on rank 0."""
        for s in shards:
            item = self.items.get(s.name)
            if item is None:
                continue
            if item[4] is not None:
                err = rebuild_error(item[4])
                if item[4][0] != "optimizer":
                    raise err
            elif item[3] is not None:
                s.dist_meta = item[3]


def gather(load_dir: str, iteration: Any, trust: bool, with_dist: bool) -> Gathered | None:
    """Collective (every rank calls it at the same point): on rank 0, what every rank parsed of its share of the
    shard files; None on the other ranks, and on every rank when the checkpoint is small or not legacy."""
    def listing() -> list[tuple[str, str]]:
        index = STATE.indexes.get(os.path.abspath(load_dir))  # the check's read, when it ran
        layout = index.layout if index is not None else None
        if layout is None:
            layout = discover(load_dir, iteration=iteration, trust_checkpoint=trust, shards="sample")
        files = [(s.name, s.path) for s in layout.shards if s.files.get(naming.MODEL_FILENAME)]
        return files if layout.format == Format.TORCH and len(files) > COOPERATIVE_ABOVE else []

    world = consensus.world_size()
    items = consensus.decide_on_rank0(listing, lambda exc: []) if world > 1 else []
    if not items:
        return None
    rank = consensus.rank()
    mine = parse_share(items[rank::world], trust, with_dist)
    payloads = consensus.gather_to_rank0(mine)
    return Gathered(payloads) if payloads is not None else None

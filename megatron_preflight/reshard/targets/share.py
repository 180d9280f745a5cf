"""Offline resharding under torchrun: every rank writes its share of the target shards into one temp dir.

Rank 0 checks the destination and names the temp dir; the shards are dealt out by size (largest first, to the least
loaded rank); every rank reports success or its error; rank 0 writes the tracker last and renames only when every
rank succeeded, and every rank ends with the same outcome. The destination must be on a filesystem all ranks see.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class Share:
    """This process's place in a torchrun job (gloo, CPU only: nothing here needs a GPU)."""

    rank: int
    world: int
    owns_group: bool = False

    def broadcast(self, obj: Any) -> Any:
        import torch.distributed as dist  # deferred: torch only in a distributed run

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist  # deferred: torch only in a distributed run

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def close(self, meet: bool = True) -> None:
        """End the group this process made. ``meet``: every rank got this far (a barrier first, so that no rank
        closes its sockets while a peer is still in the last exchange: gloo aborts that peer); False after an error,
        when a peer may never come."""
        if self.owns_group:
            import torch.distributed as dist  # deferred: torch only in a distributed run

            if meet:
                dist.barrier()
            dist.destroy_process_group()


def from_env() -> Share | None:
    """The torchrun job this process is part of (None when run alone)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1 or "MASTER_ADDR" not in os.environ:
        return None
    import torch.distributed as dist  # deferred: torch only in a distributed run

    owns = False
    if not dist.is_initialized():
        dist.init_process_group("gloo")
        owns = True
    return Share(dist.get_rank(), dist.get_world_size(), owns)


def deal(sizes: dict[str, int], world: int) -> dict[str, int]:
    """{shard: rank}: largest shard first, each to the rank with the fewest bytes so far (ties: lowest rank)."""
    load = [0] * world
    out: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world), key=lambda i: (load[i], i))
        out[name] = r
        load[r] += sizes[name]
    return out

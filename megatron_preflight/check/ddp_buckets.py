"""The distributed optimizer's buckets across a resume: Megatron cuts each gradient buffer into buckets of
``--ddp-bucket-size`` elements (with ``--overlap-grad-reduce``; by default max(40M, 1M x DP x CP); one bucket per buffer
without it), and its reload of a distributed optimizer state — legacy ``distrib_optim.pt`` or torch_dist
``dp_reshardable`` — needs every bucket at the size it had at the save, after the model and optimizer are built
(legacy: "Number of unpadded elements must be same in current run ... and checkpoint ..."; torch_dist: "Global shape
mismatch for loaded ... and expected ... tensor for key optimizer.distributed....bucket_idx_0.param", both measured in
real Megatron-LM). A run whose bucket size
differs (another --ddp-bucket-size, --overlap-grad-reduce toggled, or DP x CP crossing 40 under the default) fails so
for any buffer larger than the smaller size. Said before the build, with the flag that keeps the saved buckets."""

from __future__ import annotations

import os
import re
from typing import Any

from megatron_preflight.check.findings import Finding, Severity
from megatron_preflight.check.runtime_args import RuntimeArgs
from megatron_preflight.layout.dist import metadata_facts
from megatron_preflight.layout.model import Format, Layout

# a dp_reshardable bucket's tensor: <part.>optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<b>.dtype_(...).bucket_idx_<k>
_BUCKET = re.compile(r"^(?:chained_\d+\.)?optimizer\.distributed\.dp_group_idx_\d+\.gbuf_idx_\d+\.dtype_.*\.bucket_idx_"
                     r"\d+\.param$")


def bucket_findings(layout: Layout, rt: RuntimeArgs, *, same_layout: bool) -> list[Finding]:
    """A distributed optimizer state whose buckets the run would cut otherwise, when it is loaded as saved
    (``same_layout``: the run's TP/PP/EP and placement are the checkpoint's, so Megatron's own loader reads it)."""
    saved = layout.saved_args
    if saved is None or rt.no_load_optim or rt.finetune or not same_layout or not rt.world_size:
        return []
    legacy = layout.format == Format.TORCH and bool(layout.distributed_optimizer)
    if not (legacy or (layout.format == Format.TORCH_DIST and layout.dist_optimizer_sharding == "dp_reshardable")):
        return []
    # deferred: the distributed optimizer's reader, for a checkpoint saved with it only
    from megatron_preflight.reshard.optimizer.distributed import bucket_size

    dp_cp = rt.world_size // (rt.tp * rt.pp)  # the distributed optimizer's shard domain: DP x CP
    old, new = bucket_size(saved), bucket_size(rt, dp=dp_cp)
    if old == new:
        return []
    largest = _largest_buffer(layout) if legacy else _largest_dist_buffer(layout)
    smaller = min(x for x in (old, new) if x is not None)
    if largest is None or largest <= smaller:
        return []  # one bucket per buffer either way

    def said(size: int | None) -> str:
        return "one bucket per buffer (no --overlap-grad-reduce)" if size is None else f"{size:,} elements"

    if old is None:
        fix = "remove --overlap-grad-reduce (the checkpoint was saved without it)"
    elif getattr(saved, "ddp_bucket_size", None) or new is None:
        fix = f"pass --overlap-grad-reduce --ddp-bucket-size {old} (the saved bucket size)"
    else:
        fix = f"pass --ddp-bucket-size {old} (the saved default for DP x CP = {_dp_cp(saved)})"
    fails = ("asserts ('Number of unpadded elements must be same in current run ... and checkpoint ...')" if legacy
             else "fails ('Global shape mismatch for loaded ... and expected ... tensor for key optimizer.distributed."
                  "dp_group_idx_0.gbuf_idx_0...bucket_idx_0.param')")
    return [Finding("ddp_bucket_size", said(old), said(new), Severity.FATAL,
                    f"the distributed optimizer's gradient buffers were cut into buckets of {said(old)} and this run "
                    f"cuts them into {said(new)}; a buffer of {largest:,} elements then has other buckets, and "
                    f"Megatron's reload of the state {fails} after the model and optimizer are built",
                    f"{fix}; or add --no-load-optim (and keep the weights)")]


def _dp_cp(args: Any) -> int:
    return int(getattr(args, "data_parallel_size", 1) or 1) * int(getattr(args, "context_parallel_size", 1) or 1)


def _largest_buffer(layout: Layout) -> int | None:
    """The largest gradient buffer of the legacy distrib_optim.pt files read (its recorded unpadded size)."""
    from megatron_preflight.reshard.optimizer.distributed import read_dist_meta  # deferred: as in bucket_findings

    largest = None
    for shard in layout.shards:
        if shard.meta is None or not os.path.isfile(os.path.join(shard.path, "distrib_optim.pt")):
            continue
        try:
            meta = read_dist_meta(shard)
        except Exception:  # noqa: BLE001 - unreadable: the optimizer check reports it; no prediction here
            return None
        for part in meta if isinstance(meta, list) else [meta]:
            for gbuf, by_dtype in (part or {}).items():
                if not isinstance(gbuf, int) or not isinstance(by_dtype, dict):
                    continue
                for state in by_dtype.values():
                    n = state.get("numel_unpadded") if isinstance(state, dict) else None
                    if isinstance(n, int):
                        largest = max(largest or 0, n)
    return largest


def _largest_dist_buffer(layout: Layout) -> int | None:
    """The largest gradient buffer of a dp_reshardable torch_dist state: the sum of its buckets' sizes."""
    try:
        tensors = metadata_facts(layout.iter_dir or "").tensors
    except Exception:  # noqa: BLE001 - unreadable: reported elsewhere
        return None
    buffers: dict[str, int] = {}
    for fqn, (shape, _dtype) in tensors.items():
        if _BUCKET.match(fqn) and shape:
            key = fqn.split(".bucket_idx_")[0]
            buffers[key] = buffers.get(key, 0) + int(shape[0])
    return max(buffers.values()) if buffers else None

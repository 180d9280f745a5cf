"""Can a checkpoint's optimizer state follow a layout change? One answer for inspect, check and the hook."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_preflight import dtypes
from megatron_preflight.errors import PreflightError
from megatron_preflight.layout import optimizer_entry
from megatron_preflight.layout.model import Format, Layout
from megatron_preflight.layout.optimizer_kinds import describe_chain, primary_of
from megatron_preflight.reshard.optimizer.plain import parse_optimizer


@dataclass(frozen=True)
class OptimizerStatus:
    """What a legacy checkpoint's optimizer state is, and whether it can follow a layout change."""

    kind: str  # none | plain | distributed
    reshardable: bool  # offline (megatron-preflight reshard)
    reason: str = ""  # why it cannot (empty when it can)
    detail: str = ""  # fp32 or fp32 masters, parts, group order
    in_memory: bool = True  # also by the hook's in-memory loader (--preflight auto)

    def describe(self) -> str:
        if self.kind == "none":
            return "none saved (--no-save-optim)"
        if not self.reshardable:
            return f"{self.kind}, not reshardable: {self.reason}"
        where = "with the weights" if self.in_memory else "offline with `megatron-preflight reshard` (not yet in memory)"
        return f"{self.kind}, {self.detail}; reshardable {where}"


def optimizer_status(layout: Layout, index: Any = None) -> OptimizerStatus | None:
    """THE answer to "can this checkpoint's optimizer state follow a layout change?" (check and inspect both ask
    here), from metadata only. None for a checkpoint this does not apply to (not legacy, or unreadable). ``index``:
    the checkpoint's :class:`~megatron_preflight.reshard.checkpoint_index.CheckpointIndex` (its optimizer state
    indexed once; asked through it, see ``CheckpointIndex.optimizer_status``)."""
    if layout.format == Format.TORCH_DIST:
        return _dist_status(layout)
    if layout.format == Format.FSDP_DTENSOR:
        if layout.dist_optimizer_sharding is None:
            return OptimizerStatus("none", False, "the checkpoint holds no optimizer state", in_memory=False)
        return OptimizerStatus("distributed", True, detail="fsdp_dtensor (model space, per-parameter group settings): "
                               "Megatron-FSDP reloads it at any DP/TP/EP; the resharder converts it to legacy and "
                               "torch_dist at any layout")
    first = layout.shards[0].meta if layout.shards else None
    if layout.format != Format.TORCH or not isinstance(first, dict):
        return None
    if "optimizer" not in first:
        return OptimizerStatus("none", False, "the checkpoint holds no optimizer state")
    if layout.sampled:  # the per-shard state was not indexed: the resharder checks it before it moves a byte
        kind = "distributed" if layout.distributed_optimizer else "plain"
        return OptimizerStatus(kind, True, detail="per-shard state not indexed (sampled verdict; --all-shards "
                                                  "indexes it)")
    source = index.optimizer
    kind = "distributed" if layout.distributed_optimizer else "plain"
    if source.problem is not None:
        return OptimizerStatus(kind, False, source.problem.message)
    if layout.distributed_optimizer:
        dist = source.distributed
        half = any(dtypes.name_of(d) != "float32" for d in dist.grad_dtype)
        parts = 2 if dist.expert_groups else 1
        return OptimizerStatus("distributed", True, detail=f"{'fp32 masters (bf16/fp16 run)' if half else 'fp32'}, "
                               f"{parts} part(s), {len(dist.fields)} parameters placed in distrib_optim.pt's buffers")
    try:
        parts = parse_optimizer(first["optimizer"], layout.shards[0].path)
    except PreflightError as e:
        return OptimizerStatus("plain", False, e.message)
    half = "fp32 masters (bf16/fp16 run)" if parts[0].wrapped else "fp32"
    plain = source.plain
    order = "ordered per rank" if plain and plain.per_rank_order else "in the same order on every rank"
    what = describe_chain(layout.saved_args, [g for p in parts for g in p.groups])
    return OptimizerStatus("plain", True, detail=f"{what}; {half}, {len(parts)} part(s), param groups {order}"
                           + _local_note(layout.saved_args))


def _local_note(saved_args: Any) -> str:
    """What a kind with per-shard state (SOAP) cannot carry."""
    kind = primary_of(saved_args or {})
    return (f"; {kind.exact_note}: carried only where each parameter's shard stays the same (TP and ETP unchanged)"
            if kind.has_local else "")


def _dist_status(layout: Layout) -> OptimizerStatus | None:
    """A torch_dist checkpoint's optimizer state, from its common state: what Megatron and the resharder can do."""
    common = layout.common_state
    if not isinstance(common, dict):
        return None
    if common.get("optimizer") is None:
        return OptimizerStatus("none", False, "the checkpoint holds no optimizer state", in_memory=False)
    both = ("Megatron reloads it at any TP/PP (not across an EP change); the resharder converts it to legacy at any "
            "layout")
    if not layout.dist_optimizer_sharding:
        what = describe_chain(layout.saved_args, optimizer_entry.param_groups(common["optimizer"]))
        if not primary_of(layout.saved_args or {}).torch_dist_loads:
            both = ("Megatron cannot load it, at any layout (its torch_dist load of SGD's state fails after the "
                    "build); `--preflight auto` loads it in memory; the resharder converts it to legacy at any layout")
        return OptimizerStatus("plain", True, detail=f"model space, {what} per parameter: {both}")
    sharding = layout.dist_optimizer_sharding
    if sharding == "fully_reshardable":
        return OptimizerStatus("distributed", True, detail=f"{sharding} (model space): {both}")
    if sharding == "fully_sharded_model_space":  # flattened ranges: refused by megatron-core 0.16 and later
        return OptimizerStatus("distributed", True, detail=f"{sharding} (model space, flattened ranges: the default "
                               "of megatron-core <= 0.14): Megatron up to megatron-core 0.15 reloads it at any TP/PP "
                               "(not across an EP change), 0.16 and later cannot load it at all (`--preflight auto` "
                               "loads it in memory; `megatron-preflight reshard SRC DST --ckpt-format torch_dist` "
                               "converts it); the resharder converts it to legacy at any layout")
    if sharding == "dp_reshardable":
        return OptimizerStatus("distributed", True, detail="dp_reshardable (flat buckets per DP rank): Megatron reloads "
                               "it only at the same TP/PP (a DP change is fine); the resharder converts it to legacy "
                               "at any layout")
    return OptimizerStatus("distributed", False, f"saved as {sharding}, a form megatron-preflight does not read",
                           in_memory=False)

"""A checkpoint's global tensors: planned as the one rank of TP1·PP1·EP1 (the optimizer state in model space: per
parameter its fp32 master, ``exp_avg``, ``exp_avg_sq``), named by their legacy keys (``key#exp_avg`` for optimizer
state), each built on demand from the planned source slices. What ``diff`` and ``fingerprint`` read."""

from __future__ import annotations

from typing import Any

from megatron_preflight.layout import naming
from megatron_preflight.reshard.checkpoint_index import CheckpointIndex
from megatron_preflight.reshard.execute.executor import build_tensor
from megatron_preflight.reshard.optimizer.plain import iter_plans
from megatron_preflight.reshard.plan.rules import canonical_name
from megatron_preflight.reshard.plan.spec import spec_of
from megatron_preflight.reshard.plan.types import RankPlan, TensorPlan
from megatron_preflight.reshard.resharder import Resharder, open_resharder
from megatron_preflight.reshard.sources.files import SourceFiles
from megatron_preflight.reshard.target import TargetLayout


def global_resharder(index: CheckpointIndex, keep: bool, like: CheckpointIndex | None) -> Resharder:
    """The resharder that plans ``index``'s global tensors (named, laid out and in the Adam family of ``like``)."""
    extra: dict[str, Any] = {}
    if like is not None:
        saved = like.view.saved_args
        extra = {"transformer_impl": spec_of(saved) if saved is not None else None,
                 "moe_grouped_gemm": bool(getattr(saved, "moe_grouped_gemm", False)) if saved is not None else None,
                 "optimizer_family": like.adam_family}
    return open_resharder(index, TargetLayout(tp=1, pp=1, ep=1, etp=1, distributed_optimizer=False, **extra),
                          keep_optimizer=keep)


def global_plan(r: Resharder) -> RankPlan:
    (name, coords), = list(naming.shard_writers(r.tgt).items())[:1]
    return r.plan_for_coords(coords, name)


def named_tensors(plan: RankPlan, optimizer: bool) -> dict[str, TensorPlan | Any]:
    """The plan's entries by global name (:func:`~megatron_preflight.reshard.plan.rules.canonical_name`)."""
    out: dict[str, Any] = {canonical_name(t.key): t for t in plan.tensors}
    if optimizer and plan.optimizer is not None:
        # per-parameter steps are one number per run: compared once (DiffReport.steps), in either Adam family
        # (the wrapper's own entries, e.g. fp16's grad scaler, are not parameter state: not compared)
        for _, tp in iter_plans(plan.optimizer):
            if "#" in tp.key and not tp.key.endswith("#step"):
                key, _, what = tp.key.partition("#")
                out[f"{canonical_name(key)}#{what}"] = tp
    return out


def value_of(tp: Any, files: SourceFiles) -> Any:
    """A planned entry's value: its tensor built from the sources, or the carried value."""
    if isinstance(tp, TensorPlan) and tp.shape is not None:
        return build_tensor(tp, files, release=True)
    return tp.value if isinstance(tp, TensorPlan) else tp

"""Prove a plan before any byte moves: every target tensor (and flat optimizer buffer) is tiled exactly."""

from __future__ import annotations

from megatron_preflight.errors import PreflightError
from megatron_preflight.reshard.plan.types import FlatPlan, PlanError, RankPlan, TensorPlan, flat_parts
from megatron_preflight.tree import iter_leaves


def validate_plan(plan: RankPlan) -> None:
    """Prove the plan before any byte moves (as torch DCP validates a global plan): every target tensor is tiled
    exactly by its copy ops — whole-tensor copies of the same shape, or slices along one dim with no gap and no
    overlap, each the same shape at both ends and inside its source — and the only rows left to zeros are vocab
    padding at or after the real vocab. Raises :class:`PlanError` naming the tensor."""
    tensors = [(f"{tp.chunk}.{tp.key}", tp) for tp in plan.tensors]
    tensors += [(f"optimizer.{tp.key}", tp) for _, tp in iter_leaves(plan.optimizer) if isinstance(tp, TensorPlan)]
    if plan.dist_optimizer is not None:
        for _, fp in flat_parts(plan.dist_optimizer):
            validate_flat(fp)
            tensors += [(f"{fp.key}.{tp.key}", tp) for _, tp in fp.parts]
    for name, tp in tensors:
        validate_tensor_plan(tp, name)


def validate_tensor_plan(tp: TensorPlan, name: str) -> None:
    def fail(why: str) -> None:
        raise PlanError(f"the plan for {name} {why}")

    if tp.shape is None:
        if tp.ops:
            fail("carries a value and copy ops at once")
        return
    if not tp.ops and not tp.zero_fill:
        fail("has no source")
    whole = [op for op in tp.ops if op.dst is None]
    if whole:
        if len(tp.ops) != 1 or tp.zero_fill or whole[0].src is not None:
            fail("mixes a whole-tensor copy with other ops")
        if tuple(whole[0].ref.shape) != tuple(tp.shape):
            fail(f"copies a {tuple(whole[0].ref.shape)} source into a {tuple(tp.shape)} target")
        return
    dims = {op.dst[0] for op in tp.ops if op.dst is not None} or {0}  # only padding: vocab rows (dim 0)
    if len(dims) != 1:
        fail(f"slices along several dims {sorted(dims)}")
    dim = dims.pop()
    if not 0 <= dim < len(tp.shape):
        fail(f"slices along dim {dim} of a {len(tp.shape)}-dim tensor")
    runs: list[tuple[int, int, str]] = []
    for op in tp.ops:
        assert op.dst is not None
        if op.src is None or op.src[0] != dim or op.src[2] != op.dst[2] or op.dst[2] <= 0:
            fail(f"has a copy from {op.shard} whose source and target slices differ")
        src_shape = list(op.ref.shape)
        if not 0 <= op.src[1] <= op.src[1] + op.src[2] <= src_shape[dim]:
            fail(f"reads rows {op.src[1]}:{op.src[1] + op.src[2]} of a source with {src_shape[dim]} in {op.shard}")
        if [d for i, d in enumerate(src_shape) if i != dim] != [d for i, d in enumerate(tp.shape) if i != dim]:
            fail(f"copies from a {tuple(src_shape)} source in {op.shard} into a {tuple(tp.shape)} target")
        runs.append((op.dst[1], op.dst[2], op.shard))
    for start, length in tp.zero_fill:
        if tp.pad_from is None or start < tp.pad_from:
            fail(f"leaves rows {start}:{start + length} along dim {dim} without a source (only vocab padding, "
                 "after the real vocab, may be zero-filled)")
        runs.append((start, length, "<zeros>"))
    pos = 0
    for start, length, shard in sorted(runs):
        if start < pos:
            fail(f"writes rows {start}:{start + length} along dim {dim} twice (overlap, from {shard})")
        if start > pos:
            fail(f"leaves rows {pos}:{start} along dim {dim} uncovered (a gap)")
        pos = start + length
    if pos != tp.shape[dim]:
        fail(f"covers {pos} of its {tp.shape[dim]} rows along dim {dim}")


def validate_flat(fp: FlatPlan) -> None:
    pos = 0
    for start, tp in sorted(fp.parts, key=lambda x: x[0]):
        n = 1
        for s in tp.shape or ():
            n *= s
        if start < pos or start + n > fp.numel:
            raise PreflightError(f"the plan for {fp.key} places {tp.key} at {start}:{start + n}, overlapping or "
                                 f"outside its {fp.numel} elements", code="plan")
        pos = start + n

"""Toggling --use-distributed-optimizer: the plain optimizer's state as a distributed one, and back.

Both index the same thing — per global parameter, its fp32 master (a bf16/fp16 run's master copy, or the fp32 weight
itself), ``exp_avg`` and ``exp_avg_sq`` — in two forms: the plain form numbers parameters inside param groups
(:class:`.plain.OptimizerIndex`), the distributed form keeps group settings only, positions come from the buffers
(:class:`.distributed.DistOptimizerIndex`). Converting one index into the other lets either writer serve either
source. The distributed optimizer keeps ``step`` in its param groups, the plain one per parameter.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from megatron_preflight import dtypes
from megatron_preflight.layout.model import Layout
from megatron_preflight.layout.optimizer_kinds import MASTER_FIELD, primary_of
from megatron_preflight.parallel import ParallelLayout
from megatron_preflight.reshard.optimizer.distributed import FIX, DistOptimizerIndex, source_params
from megatron_preflight.reshard.optimizer.family import is_fused_adam, step_value
from megatron_preflight.reshard.optimizer.plain import (
    MASTER,
    OptimizerIndex,
    OptimizerNotReshardable,
    SubOptimizer,
    _candidates,
    _signature,
    group_traits,
)
from megatron_preflight.reshard.plan.types import GlobalEntry, GlobalKey, SourcePiece

_HALF = frozenset({"float16", "bfloat16"})


def plain_to_distributed(plain: OptimizerIndex, model: dict[GlobalKey, GlobalEntry], step: float,
                         grad_in_fp32: bool) -> DistOptimizerIndex:
    """The plain optimizer's state in the distributed form: masters (or the fp32 weights themselves), moments,
    group settings with their ``step``."""
    out = DistOptimizerIndex(template_shard=plain.template_shard)
    for gkey, fields in plain.fields.items():
        master = fields.get(MASTER)
        if master is None:
            master = model.get(gkey)
        kind = plain.kind(plain.membership[gkey])
        if not kind.distributed_fields:  # Megatron-LM's distributed optimizer runs Adam (an emerging one fails at start)
            raise OptimizerNotReshardable(
                f"the checkpoint's {kind.name} optimizer state cannot become a distributed optimizer's: Megatron's "
                "distributed optimizer holds Adam's state only", fix="run without --use-distributed-optimizer, or "
                "start with --no-load-optim (weights only)", code="optimizer")
        moments = kind.distributed_fields  # (Adam's exp_avg, exp_avg_sq: layout/optimizer_kinds.py)
        if not isinstance(master, GlobalEntry) or not all(isinstance(fields.get(n), GlobalEntry) for n in moments):
            raise OptimizerNotReshardable(f"parameter {gkey.suffix} has no Adam moments to carry over", fix=FIX,
                                          code="optimizer")
        out.fields[gkey] = OrderedDict([(MASTER_FIELD, master), *((n, fields[n]) for n in moments)])
    for sig in plain.order:
        settings = {k: v for k, v in plain.settings[sig].items() if k != "params"}
        settings["step"] = step
        new = _signature(settings)
        out.order.append(new)
        out.settings[new] = settings
        if sig in plain.expert:
            out.expert_groups.add(new)
    template = plain.template
    if template.wrapped:
        out.outer = OrderedDict((k, v) for k, v in template.outer.items() if k not in ("optimizer",
                                                                                       "fp32_from_fp16_params"))
    half = {e.first().ref.dtype for e in model.values()
            if dtypes.name_of(getattr(e.first().ref, "dtype", None)) in _HALF}
    f32 = dtypes.dtype("float32")
    out.grad_dtype = {d: f32 if grad_in_fp32 else d for d in half}
    out.grad_dtype[f32] = f32
    return out


def distributed_to_plain(dist: DistOptimizerIndex, layout: Layout, src: ParallelLayout) -> OptimizerIndex:
    """The distributed optimizer's state in the plain form: each parameter placed in its param group by Megatron's
    group rules (expert-parallel or not, no weight decay for biases and 1-D tensors, decoupled LR for the embedding
    and head; exactly one group must fit), with ``step`` per parameter and fp32 master copies for a half run."""
    # the group settings without the part flag (set per part by the target layout): the dense and expert parts'
    # groups with the same settings are one group here; without step (per parameter in torch's Adam), unless the
    # optimizer is a fused Adam (TE's or apex's: bias_correction in its groups), which keeps one step per group
    fused = any(is_fused_adam(dist.settings[s]) for s in dist.order)
    drop = ("is_expert_parallel",) if fused else ("step", "is_expert_parallel")
    groups = [{k: v for k, v in dist.settings[s].items() if k not in drop} for s in dist.order]
    steps = {dist.settings[s].get("step") for s in dist.order} - {None}
    if len(steps) > 1:
        raise OptimizerNotReshardable(f"the param groups record different steps {sorted(steps)}", fix=FIX,
                                      code="optimizer")
    step = float(steps.pop()) if steps else 0.0
    params = [p for ps in source_params(layout, src).values() for p in ps]
    half = any(dtypes.name_of(p.dtype) in _HALF for p in params)
    outer: OrderedDict[str, Any] = OrderedDict()
    if half:
        outer["optimizer"] = None
        outer["fp32_from_fp16_params"] = None
        outer.update(dist.outer)
    template = SubOptimizer(half, outer, OrderedDict(), groups, [[] for _ in groups], {}, None)
    plain = OptimizerIndex(template, dist.template_shard, primary=primary_of(layout.saved_args or {}))
    expert_parallel = src.experts_are_expert_parallel()
    key_order = {k: i for i, k in enumerate(dist.settings[dist.order[0]])} if dist.order else {}
    for g in groups:
        sig = _signature(g)
        if sig not in plain.settings:
            plain.order.append(sig)
            # the keys in the order Megatron's groups have them (is_expert_parallel first), as its own files do
            settings = {**g, "is_expert_parallel": False}
            plain.settings[sig] = dict(sorted(settings.items(), key=lambda kv: key_order.get(kv[0], len(key_order))))
    tied = any(p.key == "output_layer.weight" and p.shared_embedding for p in params)
    sigs = [_signature(g) for g in groups]
    chosen: dict[tuple[bool, bool, bool], list[tuple[int, int]]] = {}  # group traits -> candidates (DSV3: ~31k params)
    for p in params:
        sk = p.source
        assert sk is not None
        if tied and p.key == "output_layer.weight":
            continue
        if sk.gkey in plain.membership:
            continue
        traits = group_traits(sk, expert_parallel, plain.primary)
        if traits not in chosen:
            chosen[traits] = _candidates([template], sk, expert_parallel, plain.primary)
        cands = chosen[traits]
        if len({sigs[c[1]] for c in cands}) != 1:  # (the dense and expert parts' twins are one)
            raise OptimizerNotReshardable(f"cannot tell which param group holds {sk.key} ({len(cands)} candidates) "
                                          "in the plain optimizer: the groups do not follow Megatron's default rules",
                                          fix=FIX, code="optimizer")
        sig = sigs[cands[0][1]]
        plain.membership[sk.gkey] = sig
        (plain.expert if sk.info.expert is not None else plain.dense).add(sig)
        fields = dist.fields.get(sk.gkey)
        if fields is None:
            raise OptimizerNotReshardable(f"no distributed optimizer state for {sk.key}", fix=FIX, code="optimizer")
        kind = plain.kind(sig)
        # torch's Adam (and SOAP): a step of its own per parameter (a tensor, incremented in place); a fused Adam
        # keeps it in its groups; momentum-only kinds (SGD, Lion, Muon) count none
        out: OrderedDict[str, Any] = OrderedDict()
        if not fused and "step" in kind.fields:
            out["step"] = SourcePiece(sk.shard, step_value(step) if kind.step_tensor else int(step), 0, 1)
        missing = [n for n in kind.moments if n not in fields]
        if missing and not kind.stateless_allowed:  # (SGD without momentum keeps no buffer)
            raise OptimizerNotReshardable(f"no saved {' / '.join(missing)} for {sk.key} (its param group is "
                                          f"{kind.name}'s)", fix=FIX, code="optimizer")
        for name in kind.param_fields:
            if name in fields:
                out[name] = fields[name]
        if dtypes.name_of(p.dtype) in _HALF:
            out[MASTER] = fields["param"]
        plain.fields[sk.gkey] = out
    return plain

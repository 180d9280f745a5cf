"""The plain (non-distributed) optimizer state of a legacy checkpoint, resharded with the parameters' own rules.

What Megatron stores under ``optimizer`` in ``model_optim_rng.pt``:

* fp32 (``FP32Optimizer``): the torch optimizer's state dict, ``{'state': {i: {...}}, 'param_groups': [{...,
  'params': [i, ...]}]}``;
* fp16 / bf16 (``Float16OptimizerWithFloat16Params``): ``{'optimizer': <that>, 'fp32_from_fp16_params': [[fp32 master
  per half-precision param] per group], 'grad_scaler': ...}``;
* a ChainedOptimizer of several parts (dense + expert): a list of those.

Torch numbers the parameters group after group; Megatron fills each group in ``named_parameters()`` order over the
model chunks. Expert weights are "expert-parallel" (their own optimizer part, groups flagged ``is_expert_parallel``)
only when EP > 1 or ETP != TP; otherwise they sit in the dense groups, and a single part is saved as a dict, not a
list. So the target's parts are laid out for the target layout, not copied from the source. Which group a parameter is in is inferred from the group settings (expert-parallel or not, no weight
decay for biases and 1-D tensors, decoupled LR for the embedding and head) and then checked against every group's
size and every state tensor's shape on disk: a checkpoint whose groups follow other rules is refused, never guessed.

The distributed optimizer keeps its tensors in ``distrib_optim.pt`` (flat per-bucket buffers): see :mod:`.distributed`
(and :mod:`.convert` to turn one form into the other).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from megatron_preflight import dtypes
from megatron_preflight.layout.model import Layout
from megatron_preflight.layout.optimizer_kinds import (
    KINDS,
    Kind,
    OptimizerNotReshardable,
    Split,
    goes_to_scalar,
    group_kind,
    kinds_of,
    primary_of,
)
from megatron_preflight.parallel import ParallelLayout
from megatron_preflight.reshard.carried import PROVENANCE_KEY
from megatron_preflight.reshard.plan.index import iter_source_keys
from megatron_preflight.reshard.plan.planner import plan_tensor
from megatron_preflight.reshard.plan.rules import parse_key
from megatron_preflight.reshard.plan.spec import unpack_legacy_grouped
from megatron_preflight.reshard.plan.topology import is_tied, model_chunks
from megatron_preflight.reshard.plan.types import (
    CopyOp,
    GlobalEntry,
    GlobalKey,
    RankPlan,
    SourceKey,
    SourcePiece,
    TensorPlan,
    VocabPlan,
)
from megatron_preflight.torch_file import TensorRef
from megatron_preflight.tree import iter_leaves, map_leaves

MASTER = "@master"  # field name of a Float16 optimizer's fp32 master copy




_BUFFERS = ("router.expert_bias",)  # persistent buffers in the model state dict: not parameters


_HALF = frozenset({"float16", "bfloat16"})  # dtype names of a bf16 / fp16 run's weights


_DECOUPLED = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass
class SubOptimizer:
    """One part of the (possibly chained) optimizer state of one shard."""

    wrapped: bool  # Float16 wrapper around the torch state dict
    outer: OrderedDict[str, Any]  # the wrapper's entries (None placeholders where the torch sd / masters go)
    inner_extra: OrderedDict[str, Any]  # torch state dict entries other than state / param_groups
    groups: list[dict[str, Any]]  # group settings, without 'params'
    group_params: list[list[int]]
    state: dict[int, dict[str, Any]]
    masters: list[list[Any]] | None


def parse_optimizer(value: Any, where: str) -> list[SubOptimizer]:
    """The parts of a shard's ``optimizer`` entry (a chained optimizer saves a list, a single one a dict)."""
    parts = value if isinstance(value, list) else [value]
    subs = []
    for part in parts:
        if not isinstance(part, dict):
            raise OptimizerNotReshardable(f"the optimizer state has an unknown form ({type(part).__name__})",
                                          path=where, code="optimizer")
        wrapped = "optimizer" in part and isinstance(part["optimizer"], dict)
        inner = part["optimizer"] if wrapped else part
        groups = inner.get("param_groups")
        if not isinstance(groups, list) or "state" not in inner or any("params" not in g for g in groups):
            raise OptimizerNotReshardable(
                "the optimizer state holds no per-parameter tensors here (distributed optimizer: they are in "
                "distrib_optim.pt as flat buffers tied to the saved layout)", path=where, code="optimizer")
        masters = part.get("fp32_from_fp16_params") if wrapped else None
        outer = OrderedDict((k, None if k in ("optimizer", "fp32_from_fp16_params") else v)
                            for k, v in part.items()) if wrapped else OrderedDict()
        subs.append(SubOptimizer(
            wrapped, outer, OrderedDict((k, v) for k, v in inner.items() if k not in ("state", "param_groups")),
            [{k: v for k, v in g.items() if k != "params"} for g in groups], [list(g["params"]) for g in groups],
            dict(inner["state"]), list(masters) if masters is not None else None))
    return subs


def is_param(key: str, value: Any) -> bool:
    """Whether a model state-dict entry is a parameter (not extra state, not a persistent buffer)."""
    return (isinstance(value, (TensorRef, TensorPlan)) or dtypes.is_tensor(value)) and not key.endswith(("_extra_state", *_BUFFERS))


def _signature(settings: dict[str, Any]) -> str:
    """A param group's identity across optimizer parts: its settings, whichever part it is in (and whatever step a
    fused Adam recorded in it: see :func:`add_settings`)."""
    return repr(sorted((k, repr(v)) for k, v in settings.items() if k not in ("params", "is_expert_parallel", "step")))


def add_settings(order: list[str], settings: dict[str, dict[str, Any]], group: dict[str, Any]) -> str:
    """Record a param group's settings under its signature, once, in the order first met; its signature. A fused
    Adam (TE's, apex's) keeps the step in the group and sets it at the first step the group takes: a group that held
    no parameter on some rank (a pipeline stage without experts) has none there, and takes the step of the ranks where
    it stepped (else it would restart Adam's bias correction for the parameters it gets at the target)."""
    sig = _signature(group)
    known = settings.get(sig)
    if known is None:
        order.append(sig)
        settings[sig] = group
    elif "step" in group and "step" not in known:
        settings[sig] = {**known, "step": group["step"]}
    return sig


@dataclass
class OptimizerIndex:
    """The optimizer state of every source shard, indexed by global parameter (like the model index)."""

    template: SubOptimizer  # wrapper structure, from the first shard's first part
    template_shard: str
    order: list[str] = field(default_factory=list)  # group signatures, in Megatron's group order
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)  # signature -> settings (without params)
    dense: set[str] = field(default_factory=set)  # signatures holding non-expert params (anywhere)
    expert: set[str] = field(default_factory=set)  # signatures holding expert params (anywhere)
    membership: dict[GlobalKey, str] = field(default_factory=dict)  # param -> group signature
    fields: dict[GlobalKey, OrderedDict[str, GlobalEntry | SourcePiece]] = field(default_factory=dict)
    # Megatron-LM before ~2026 orders each rank's groups by the first parameter it meets (then the groups only other
    # ranks have); newer ones sort them the same on every rank. True when the source shows per-rank orders.
    per_rank_order: bool = False
    primary: Kind = KINDS["adam"]  # the optimizer the run was trained with (a chain's scalar part is named per group)

    def kind(self, sig: str) -> Kind:
        """The optimizer kind of the param group ``sig``."""
        return group_kind(self.settings[sig], self.primary)


def is_decoupled_group(settings: dict[str, Any]) -> bool:
    """A --decoupled-lr group (the embedding and head): flagged by older Megatron-LM; Megatron-LM main marks it only
    as a group whose LR schedule is not the default one."""
    return bool(settings.get("is_decoupled_lr")) or settings.get("default_config") is False


def no_weight_decay(key: str, shape: tuple[int, ...]) -> bool:
    """Megatron's default rule: biases and 1-D tensors (norms) are in a group without weight decay."""
    return key.endswith(".bias") or len(shape) == 1


def group_traits(sk: SourceKey, expert_parallel: bool, primary: Kind) -> tuple[bool, bool, bool, bool]:
    """What decides a parameter's param group by Megatron's default rules: (expert-parallel, no weight decay,
    decoupled LR, handed to an emerging optimizer's scalar optimizer) — all :func:`_candidates` reads of it."""
    shape = tuple(sk.value.shape)
    return (sk.info.expert is not None and expert_parallel, no_weight_decay(sk.key, shape),
            sk.info.suffix in _DECOUPLED, goes_to_scalar(sk.key, shape, primary))


def _candidates(subs: list[SubOptimizer], sk: SourceKey, expert_parallel: bool, primary: Kind) -> list[tuple[int, int]]:
    expert, no_wd, decoupled, scalar = group_traits(sk, expert_parallel, primary)
    decoupled_any = any(is_decoupled_group(g) for sub in subs for g in sub.groups)
    chained = primary.emerging and any("optimizer" in g for sub in subs for g in sub.groups)
    out = []
    for s, sub in enumerate(subs):
        for g, st in enumerate(sub.groups):
            if "is_expert_parallel" in st and bool(st["is_expert_parallel"]) != expert:
                continue
            if chained and ("optimizer" in st) != scalar:
                continue
            wd = st.get("wd_mult", st.get("weight_decay"))
            if wd is not None and (float(wd) == 0.0) != no_wd:
                continue
            if decoupled_any and is_decoupled_group(st) != decoupled:
                continue
            out.append((s, g))
    if len({s for s, _ in out}) > 1 and len(subs) == 2 and not chained:  # old dense + expert parts without the flag
        out = [c for c in out if c[0] == (1 if expert else 0)]
    return out


def _assign(subs: list[SubOptimizer], params: list[SourceKey], where: str, expert_parallel: bool,
            primary: Kind) -> dict[str, tuple[int, int, int, int | None]]:
    """{chunk:key: (part, group, optimizer index, position among the group's fp32 masters)} for one shard, checked
    against the group sizes and the state shapes."""
    fix = "start the run with --no-load-optim (weights only), or reshard offline with --drop-optimizer"
    by_group: dict[tuple[int, int], list[SourceKey]] = {}
    for sk in params:
        cands = _candidates(subs, sk, expert_parallel, primary)
        if len(cands) != 1:
            raise OptimizerNotReshardable(
                f"cannot tell which optimizer param group holds {sk.key} ({len(cands)} candidates): the groups do "
                "not follow Megatron's default rules (custom lr-mult / weight-decay settings?)", path=where, fix=fix,
                code="optimizer")
        by_group.setdefault(cands[0], []).append(sk)
    out: dict[str, tuple[int, int, int, int | None]] = {}
    for s, sub in enumerate(subs):
        for g, ids in enumerate(sub.group_params):
            members = by_group.get((s, g), [])
            if len(members) != len(ids):
                raise OptimizerNotReshardable(
                    f"optimizer param group {g}{f' of part {s}' if len(subs) > 1 else ''} holds {len(ids)} "
                    f"parameters, but the model entries that belong to it number {len(members)}", path=where,
                    fix=fix, code="optimizer")
            half = [sk for sk in members if dtypes.name_of(sk.value.dtype) in _HALF]
            if sub.masters is not None and len(sub.masters[g]) != len(half):
                raise OptimizerNotReshardable(
                    f"optimizer param group {g} holds {len(sub.masters[g])} fp32 master copies for {len(half)} "
                    "half-precision parameters", path=where, fix=fix, code="optimizer")
            master_pos = {id(sk): i for i, sk in enumerate(half)}
            kind = group_kind(sub.groups[g], primary)
            for sk, idx in zip(members, ids, strict=True):
                for name, v in sub.state.get(idx, {}).items():
                    rule = kind.rule(name, where)
                    if rule == Split.PARAM and isinstance(v, TensorRef) and v.shape and \
                            tuple(v.shape) != tuple(sk.value.shape):
                        raise OptimizerNotReshardable(
                            f"optimizer state {name} of entry {idx} has shape {tuple(v.shape)}, but the parameter "
                            f"placed there ({sk.key}) has {tuple(sk.value.shape)}: the param order is not Megatron's",
                            path=where, fix=fix, code="optimizer")
                out[f"{sk.chunk}:{sk.key}"] = (s, g, idx, master_pos.get(id(sk)))
    return out


def packed_params(layout: Layout, shard_name: str, keys: list[SourceKey]
                  ) -> tuple[list[SourceKey], dict[str, list[SourceKey]]]:
    """The shard's parameters as its optimizer holds them: the legacy GroupedMLP's ``weight1`` / ``weight2`` are one
    parameter each (one state entry, one fp32 master, one range of the distributed optimizer's buffer, of the packed
    shape), however many experts the index unpacked them into. Returns (one source key per optimizer parameter — a
    packed one carries the packed tensor —, each packed key's "chunk:key" -> the experts' source keys)."""
    meta = next(s.meta for s in layout.shards if s.name == shard_name)
    chunk_names = dict(model_chunks(meta))
    out: list[SourceKey] = []
    experts: dict[str, list[SourceKey]] = {}
    for sk in keys:
        if parse_key(sk.key).style != "legacy_grouped":
            out.append(sk)
            continue
        where = f"{sk.chunk}:{sk.key}"
        if where not in experts:
            out.append(sk._replace(value=meta[chunk_names[sk.chunk]][sk.key]))
        experts.setdefault(where, []).append(sk)
    return out, experts


def unpacked(value: Any, sk: SourceKey, experts: int, where: str) -> Any:
    """A packed parameter's state tensor (its moments, its fp32 master) read as the one expert's linear ``sk`` is:
    the same strided views as the weights (:func:`unpack_legacy_grouped`)."""
    if not isinstance(value, TensorRef) or not value.shape:
        return value  # a per-parameter scalar (step): every expert's
    packed = parse_key(sk.key).suffix
    assert sk.info.expert is not None
    return unpack_legacy_grouped(packed, value, experts, where)[sk.info.expert][1]


def index_optimizer(layout: Layout, src: ParallelLayout) -> OptimizerIndex | None:
    """Index the optimizer state of every source shard; None when the checkpoint has none. Raises
    :class:`OptimizerNotReshardable` when it cannot be mapped safely."""
    shards = [s for s in layout.shards if s.meta is not None and "optimizer" in s.meta]
    if not shards:
        return None
    tied = is_tied(layout)
    parsed = {s.name: parse_optimizer(s.meta["optimizer"], s.path) for s in shards}
    by_shard: dict[str, list[SourceKey]] = {}
    for sk in iter_source_keys(layout, src):
        by_shard.setdefault(sk.shard, []).append(sk)
    first = min(parsed, key=lambda n: [s.name for s in layout.shards].index(n))
    index = OptimizerIndex(parsed[first][0], first, primary=primary_of(layout.saved_args or {}))
    expert_parallel = src.experts_are_expert_parallel()
    # An earlier reshard by this tool records the rule (a one-rank checkpoint cannot show it).
    marks = [s.meta.get(PROVENANCE_KEY) for s in shards]
    index.per_rank_order = any(isinstance(m, dict) and m.get("optimizer_group_order") == "per_rank" for m in marks)
    seen_orders: dict[int, list[str]] = {}
    for shard in shards:
        subs = parsed[shard.name]
        for part, sub in enumerate(subs):
            sigs = [_signature(settings) for settings in sub.groups]
            if seen_orders.setdefault(part, sigs) != sigs:
                index.per_rank_order = True
            for settings in sub.groups:
                add_settings(index.order, index.settings, {**settings, "is_expert_parallel": False})
        keys = by_shard.get(shard.name, [])
        params = [sk for sk in keys if is_param(sk.key, sk.value)]
        whole, packed = packed_params(layout, shard.name, params)
        slots = _assign(subs, whole, shard.path, expert_parallel, index.primary)
        for sk in params:
            s, g, idx, mpos = slots[f"{sk.chunk}:{sk.key}"]
            n_packed = len(packed.get(f"{sk.chunk}:{sk.key}", ()))
            sig = _signature(subs[s].groups[g])
            (index.expert if sk.info.expert is not None else index.dense).add(sig)
            if tied and sk.key == "output_layer.weight":
                continue  # the tied head copy: its state equals the embedding's, which serves it
            known = index.membership.setdefault(sk.gkey, sig)
            if known != sig:
                raise OptimizerNotReshardable(f"{sk.key} sits in different optimizer groups on different shards",
                                              path=shard.path, code="optimizer")
            fields = index.fields.setdefault(sk.gkey, OrderedDict())
            kind = group_kind(subs[s].groups[g], index.primary)
            for name, v in subs[s].state.get(idx, {}).items():
                v = unpacked(v, sk, n_packed, shard.path) if n_packed else v
                if kind.rule(name) in (Split.LOCAL, Split.PARAM_OR_LOCAL) and not _param_shaped(v, sk):
                    fields.setdefault(name, LocalState(name, kind.exact_note)).pieces[sk.shard] = v
                else:
                    _add_field(fields, name, v, sk)
            masters = subs[s].masters
            if masters is not None and mpos is not None:
                v = masters[g][mpos]
                _add_field(fields, MASTER, unpacked(v, sk, n_packed, shard.path) if n_packed else v, sk)
    return index


@dataclass
class LocalState:
    """A state field of each shard's own (SOAP's preconditioners): per source shard, its value; carried only to a
    target whose piece of the parameter is exactly one source shard's."""

    name: str
    note: str
    pieces: dict[str, Any] = field(default_factory=dict)

    def carried(self, param: TensorPlan) -> Any:
        """This field for the target piece ``param``, or raises when that piece is not one source shard's whole."""
        op = param.ops[0] if len(param.ops) == 1 else None
        if op is None or not _whole(op, param) or param.zero_fill or op.shard not in self.pieces:
            raise OptimizerNotReshardable(
                f"the optimizer state {self.name} of {param.key} cannot follow this layout change: {self.note}, and "
                "the target splits the parameter differently (it carries only where each parameter's shard stays the "
                "same: a PP / DP / EP change at the same TP and ETP)",
                fix="start the run with --no-load-optim (weights only), or reshard offline with --drop-optimizer",
                code="optimizer")
        return self.pieces[op.shard], op.shard


def _whole(op: CopyOp, param: TensorPlan) -> bool:
    """Whether ``op`` copies one source tensor whole into the whole target piece (the same shard at both ends)."""
    shape = tuple(op.ref.shape)
    if param.shape is None or shape != tuple(param.shape):
        return False
    return all(run is None or (run[1] == 0 and run[2] == shape[run[0]]) for run in (op.src, op.dst))


def _param_shaped(value: Any, sk: SourceKey) -> bool:
    return isinstance(value, TensorRef) and bool(value.shape) and tuple(value.shape) == tuple(sk.value.shape)


def _add_field(fields: OrderedDict[str, Any], name: str, value: Any, sk: SourceKey) -> None:
    if _param_shaped(value, sk):
        entry = fields.get(name)
        if entry is None:
            entry = fields[name] = GlobalEntry(sk.gkey, sk.info, sk.rule)
        entry.add(SourcePiece(sk.shard, value, sk.group_rank, sk.group_size))
    else:
        fields.setdefault(name, SourcePiece(sk.shard, value, 0, 1))  # per-param scalars (step): carried


def _carry(shard: str, value: Any, path: str) -> Any:
    """A carried value with each tensor inside made a whole-tensor copy plan."""

    def leaf(v: Any, sub: tuple) -> Any:
        if not isinstance(v, TensorRef):
            return v
        where = path + "".join(f"[{k}]" for k in sub)
        return TensorPlan("optimizer", where, tuple(v.shape), v.dtype, [CopyOp(shard, v, None, None)])

    return map_leaves(value, leaf)


def plan_optimizer(index: OptimizerIndex, plan: RankPlan, src: ParallelLayout, tgt: ParallelLayout,
                   vocab: VocabPlan | None) -> Any:
    """The target rank's optimizer state, as a tree whose tensors are :class:`TensorPlan` leaves: one part (a dict),
    or a dense and an expert part (a list) when the target's experts are expert-parallel."""
    split = bool(index.expert) and tgt.experts_are_expert_parallel()
    layout = part_layout(index, tgt)
    part_of = {(sig, is_expert): p for p, (is_expert, sigs) in enumerate(layout) for sig in sigs}
    members: dict[tuple[int, str], list[TensorPlan]] = {}
    for tp in plan.tensors:
        if tp.shape is None or tp.gkey is None or not is_param(tp.key, tp):
            continue
        sig = index.membership.get(tp.gkey)
        if sig is None:
            raise OptimizerNotReshardable(f"no optimizer state found for parameter {tp.key}",
                                          fix="start the run with --no-load-optim", code="optimizer")
        members.setdefault((part_of[(sig, split and tp.gkey[1] is not None)], sig), []).append(tp)
    if index.per_rank_order:  # this rank's groups in the order it meets their first parameter, then the others
        layout = [(is_expert, _first_met(sigs, [tp for (p, _), tps in members.items() if p == part for tp in tps],
                                         plan, index)) for part, (is_expert, sigs) in enumerate(layout)]
    parts = [_plan_part(index, plan, src, tgt, vocab, p, is_expert, sigs, members)
             for p, (is_expert, sigs) in enumerate(layout)]
    return parts if len(parts) > 1 else parts[0]


def part_layout(index: OptimizerIndex, tgt: ParallelLayout) -> list[tuple[bool, list[str]]]:
    """The target's optimizer parts as Megatron chains them: per optimizer kind (in the source's order: an emerging
    optimizer, then its scalar one), the dense part, then the expert-parallel one where ``tgt`` makes experts
    expert-parallel; each as (expert-parallel, its group signatures in order). One part is saved as a dict."""
    split = bool(index.expert) and tgt.experts_are_expert_parallel()
    out: list[tuple[bool, list[str]]] = []
    for kind in kinds_of([index.settings[s] for s in index.order], index.primary):
        sigs = [s for s in index.order if index.kind(s) == kind]
        if not split:
            out.append((False, [s for s in sigs if s in index.dense | index.expert]))
            continue
        for is_expert, pool in ((False, index.dense), (True, index.expert)):
            mine = [s for s in sigs if s in pool]
            if mine or not is_expert:
                out.append((is_expert, mine))
    return out


def _first_met(sigs: list[str], tensors: list[TensorPlan], plan: RankPlan, index: OptimizerIndex) -> list[str]:
    mine = {id(t) for t in tensors}
    met: list[str] = []
    for tp in plan.tensors:
        if id(tp) in mine:
            sig = index.membership[tp.gkey]  # type: ignore[index]
            if sig not in met:
                met.append(sig)
    return met + [g for g in sigs if g not in met]


GROUP_KEY = ("wd_mult", "lr_mult", "is_decoupled_lr", "is_expert_parallel", "optimizer")


def align_groups(state: Any, live: list[list[tuple[tuple, int]]]) -> Any:
    """Reorder the param groups of a planned/built optimizer state to the running optimizer's: ``live`` lists, per
    optimizer part, each group's (settings key over :data:`GROUP_KEY`, parameter count) in the optimizer's order.
    Parameters are renumbered and fp32 masters follow their groups. Raises when the groups cannot be matched."""
    parts = state if isinstance(state, list) else [state]
    if len(parts) != len(live):
        raise OptimizerNotReshardable(f"the run's optimizer has {len(live)} part(s) but the resharded state has "
                                      f"{len(parts)}", fix="start the run with --no-load-optim", code="optimizer")
    return [_align_part(p, groups) for p, groups in zip(parts, live, strict=True)] if isinstance(state, list) \
        else _align_part(state, live[0])


def _align_part(part: Any, live: list[tuple[tuple, int]]) -> Any:
    inner = part["optimizer"] if "fp32_from_fp16_params" in part else part
    groups = inner["param_groups"]
    keys = [(tuple(g.get(k) for k in GROUP_KEY), len(g["params"])) for g in groups]
    if keys == list(live):
        return part
    order: list[int] = []
    for want in live:
        match = next((i for i, k in enumerate(keys) if k == want and i not in order), None)
        if match is None:
            raise OptimizerNotReshardable(
                f"the run's optimizer has a param group {dict(zip(GROUP_KEY, want[0], strict=True))} of {want[1]} "
                "parameters that the resharded state does not", fix="start the run with --no-load-optim",
                code="optimizer")
        order.append(match)
    if len(order) != len(groups):
        raise OptimizerNotReshardable("the run's optimizer and the resharded state have different param groups",
                                      fix="start the run with --no-load-optim", code="optimizer")
    renumber: dict[int, int] = {}
    new_groups = []
    for i in order:
        ids = []
        for old in groups[i]["params"]:
            renumber[old] = len(renumber)
            ids.append(renumber[old])
        new_groups.append({**groups[i], "params": ids})
    inner["param_groups"] = new_groups
    inner["state"] = {renumber[k]: v for k, v in inner["state"].items()}
    if "fp32_from_fp16_params" in part:
        part["fp32_from_fp16_params"] = [part["fp32_from_fp16_params"][i] for i in order]
    return part


def _plan_part(index: OptimizerIndex, plan: RankPlan, src: ParallelLayout, tgt: ParallelLayout, vocab: VocabPlan | None,
               part: int, is_expert: bool, sigs: list[str], members: dict[tuple[int, str], list[TensorPlan]]) -> Any:
    sub = index.template
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    masters: list[list[Any]] = []
    idx = 0
    for sig in sigs:
        ids, group_masters = [], []
        for tp in members.get((part, sig), []):
            ids.append(idx)
            entry_state: dict[str, Any] = {}
            for name, f in index.fields.get(tp.gkey, {}).items():
                where = f"{tp.key}#{name}"
                if isinstance(f, GlobalEntry):
                    fp = plan_tensor(f, "optimizer", where, plan.coords, tgt, vocab)
                    fp.gkey, fp.param = None, tp
                elif isinstance(f, LocalState):
                    value, shard = f.carried(tp)
                    fp = _carry(shard, value, where)
                else:
                    fp = _carry(f.shard, f.ref, where)
                if name == MASTER:
                    group_masters.append(fp)
                else:
                    entry_state[name] = fp
            if entry_state:
                state[idx] = entry_state
            idx += 1
        groups.append({**index.settings[sig], "is_expert_parallel": is_expert, "params": ids})
        masters.append(group_masters)
    inner: OrderedDict[str, Any] = OrderedDict([("state", state), ("param_groups", groups)])
    for k, v in sub.inner_extra.items():
        inner[k] = _carry(index.template_shard, v, f"optimizer.{k}")
    if not sub.wrapped:
        return inner
    outer: OrderedDict[str, Any] = OrderedDict()
    for k, v in sub.outer.items():
        if k == "optimizer":
            outer[k] = inner
        elif k == "fp32_from_fp16_params":
            outer[k] = masters
        else:
            outer[k] = _carry(index.template_shard, v, f"optimizer.{k}")
    return outer


def iter_plans(tree: Any) -> Any:
    """(path, TensorPlan) for every tensor plan inside an optimizer tree."""
    return ((path, leaf) for path, leaf in iter_leaves(tree) if isinstance(leaf, TensorPlan))

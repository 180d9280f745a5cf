"""The distributed optimizer's state of a legacy checkpoint (``distrib_optim.pt``), as pieces of global tensors, and
written back at another TP/PP/EP/ETP/VPP/DP layout.

What Megatron writes (``DistributedOptimizer.save_parameter_state``): one file per (tp, pp, ep) dir, by the rank that
is data-parallel rank 0 of each optimizer part after gathering every DP rank's shard. A chained optimizer (MoE: a
dense part and an expert-parallel part, each with its own DP group) saves a list with ``None`` for the parts whose
DP rank 0 is another rank. Each part holds, per gradient buffer (``gbuf_idx``: the buffers of model chunk 0, then of
chunk 1, ...) and per (param dtype, grad dtype): fp32 "world" tensors ``param`` (the fp32 master), ``exp_avg`` and
``exp_avg_sq`` of ``numel_unpadded`` elements — the buffer's buckets without their end padding, concatenated.
``model_optim_rng.pt['optimizer']`` keeps only the param groups (settings and ``step``) and the grad scaler.

Inside a buffer, modelled as Megatron-LM lays it out from 2024-07 (megatron-core 0.8) to main (2026-08; the same
rules in core_r0.14): the buffer holds the parameters of one model chunk with one (param dtype, grad dtype,
expert-parallel) key, in reverse ``model.parameters()`` order; each parameter starts at a multiple of 64 elements; a
bucket closes after the parameter whose end reaches ``bucket_size`` elements from the bucket start (only with
``--overlap-grad-reduce``: ``--ddp-bucket-size``, by default max(40M, 1M x DP)), and the tied embedding and its
last-stage copy (``shared_embedding``, PP > 1) sit in buckets of their own. The size this model gives must equal
every buffer's recorded ``numel_unpadded``, and the fp32 masters read at the modelled places must equal the model's
weights (sampled on every run); otherwise the state is refused, never guessed.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatron_preflight.errors import PreflightError
from megatron_preflight.layout import naming, optimizer_kinds
from megatron_preflight.layout.model import Layout
from megatron_preflight.parallel import ParallelLayout
from megatron_preflight.reshard.arrays import BYTES, float_values, has_values
from megatron_preflight.reshard.optimizer.plain import (
    OptimizerNotReshardable,
    add_settings,
    is_decoupled_group,
    is_param,
    no_weight_decay,
    packed_params,
    unpacked,
)
from megatron_preflight.reshard.plan.index import iter_source_keys
from megatron_preflight.reshard.plan.planner import plan_tensor
from megatron_preflight.reshard.plan.rules import canonical_name
from megatron_preflight.reshard.plan.topology import is_tied
from megatron_preflight.reshard.plan.types import (
    FlatPlan,
    GlobalEntry,
    GlobalKey,
    RankPlan,
    SourceKey,
    SourcePiece,
    TensorPlan,
    VocabPlan,
)
from megatron_preflight.reshard.plan.validate import validate_flat
from megatron_preflight.torch_file import StorageRef, TensorRef, read_torch_file

if TYPE_CHECKING:
    import torch

ALIGN = 64
STATE_KEYS = optimizer_kinds.DISTRIBUTED_STATE  # the master and Adam's moments (layout/optimizer_kinds.py)
FIX = "start the run with --no-load-optim (weights only), or reshard offline with --drop-optimizer"
_EMBEDDING_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class Slot:
    """One parameter in a gradient buffer."""

    name: str  # "chunk:key"
    numel: int
    shared_embedding: bool = False


def world_offsets(slots: list[Slot], bucket_size: int | None) -> tuple[dict[str, int], list[int]]:
    """Where each parameter of one buffer (``slots`` in ``model.parameters()`` order) starts in the buffer's world
    tensors, and the unpadded size of each bucket (their sum is the buffer's ``numel_unpadded``)."""
    offsets: dict[str, int] = {}
    buckets: list[int] = []
    world = 0  # where the current bucket starts in the world tensors
    pos = 0  # position inside the current bucket (bucket starts are multiples of 128: alignment is relative)
    count = 0
    for slot in reversed(slots):
        pos = -(-pos // ALIGN) * ALIGN
        if slot.shared_embedding and count:
            buckets.append(pos)
            world, pos, count = world + pos, 0, 0
        offsets[slot.name] = world + pos
        end = pos + slot.numel
        count += 1
        if (bucket_size is not None and end >= bucket_size) or slot.shared_embedding:
            buckets.append(end)
            world, pos, count = world + end, 0, 0
        else:
            pos = end
    if count:
        buckets.append(pos)
    return offsets, buckets


def bucket_size(args: Any, dp: int | None = None) -> int | None:
    """Megatron's DDP bucket size for a run with ``args``: none (one bucket per buffer) without
    --overlap-grad-reduce; else --ddp-bucket-size, by default max(40M, 1M x DP x CP) (the distributed optimizer shards
    over DP x CP; ``dp``: that product when given)."""
    if not getattr(args, "overlap_grad_reduce", False):
        return None
    given = getattr(args, "ddp_bucket_size", None)
    if given:
        return int(given)
    if dp is None:
        dp = int(getattr(args, "data_parallel_size", 1) or 1) * int(getattr(args, "context_parallel_size", 1) or 1)
    return max(40_000_000, 1_000_000 * dp)


@dataclass
class Param:
    """A parameter of one shard's model chunk, as the buffers see it."""

    chunk: int
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    expert: bool  # in the expert-parallel buffers
    shared_embedding: bool
    source: SourceKey | None = None  # source side: the model entry it is
    plan: TensorPlan | None = None  # target side: the planned weight
    unpacked: tuple[SourceKey, ...] = ()  # source side, a legacy GroupedMLP weight: the experts it holds

    @property
    def name(self) -> str:
        return f"{self.chunk}:{self.key}"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def buffers_of(params: list[Param], expert: bool) -> list[tuple[torch.dtype, list[Param]]]:
    """The gradient buffers of one optimizer part, in ``gbuf_idx`` order: model chunk after chunk, and inside a chunk
    one buffer per param dtype in the order the dtypes first appear."""
    out: list[tuple[torch.dtype, list[Param]]] = []
    for chunk in sorted({p.chunk for p in params}):
        by_dtype: OrderedDict[torch.dtype, list[Param]] = OrderedDict()
        for p in params:
            if p.chunk == chunk and p.expert == expert:
                by_dtype.setdefault(p.dtype, []).append(p)
        out.extend(by_dtype.items())
    return out


@dataclass
class DistOptimizerIndex:
    """The distributed optimizer's state of every source shard, by global parameter."""

    fields: dict[GlobalKey, OrderedDict[str, GlobalEntry]] = field(default_factory=dict)
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)  # group signature -> settings
    order: list[str] = field(default_factory=list)  # group signatures in the source's order
    expert_groups: set[str] = field(default_factory=set)  # signatures found in an expert part
    outer: OrderedDict[str, Any] = field(default_factory=OrderedDict)  # a part's entries besides 'optimizer'
    grad_dtype: dict[torch.dtype, torch.dtype] = field(default_factory=dict)
    template_shard: str = ""
    checked: list[tuple[str, TensorRef, str, TensorRef]] = field(default_factory=list)  # (weight, master) pairs


def _parts(value: Any, where: str) -> list[Any]:
    parts = value if isinstance(value, list) else [value]
    for p in parts:
        if p is not None and not isinstance(p, dict):
            raise OptimizerNotReshardable(f"the distributed optimizer state has an unknown form ({type(p).__name__})",
                                          path=where, fix=FIX, code="optimizer")
    return parts


def source_params(layout: Layout, src: ParallelLayout) -> dict[str, list[Param]]:
    """Every source shard's parameters, per model chunk in ``model.parameters()`` order."""
    tied = is_tied(layout)
    expert_parallel = src.experts_are_expert_parallel()
    by_shard: dict[str, list[SourceKey]] = {}
    for sk in iter_source_keys(layout, src):
        if is_param(sk.key, sk.value):
            by_shard.setdefault(sk.shard, []).append(sk)
    out: dict[str, list[Param]] = {}
    for shard, keys in by_shard.items():
        whole, packed = packed_params(layout, shard, keys)  # the legacy GroupedMLP: one range per packed weight
        for sk in whole:
            if tied and src.pp == 1 and sk.key == "output_layer.weight":
                continue
            shared = tied and src.pp > 1 and sk.key in _EMBEDDING_KEYS
            out.setdefault(shard, []).append(Param(sk.chunk, sk.key, tuple(sk.value.shape), sk.value.dtype,
                                                   sk.info.expert is not None and expert_parallel, shared, source=sk,
                                                   unpacked=tuple(packed.get(f"{sk.chunk}:{sk.key}", ()))))
    return out


def read_dist_meta(shard: Any, trust: bool = False) -> Any:
    """A shard's distrib_optim.pt metadata (no tensor bytes), read once and kept on the shard (so rank 0's read
    travels with the layout it sends to the other ranks)."""
    if shard.dist_meta is None:
        path = os.path.join(shard.path, naming.DISTRIB_OPTIM_FILENAME)
        if not os.path.isfile(path):
            raise OptimizerNotReshardable("the distributed optimizer's distrib_optim.pt is missing", path=path,
                                          fix=FIX, code="optimizer")
        shard.dist_meta = read_torch_file(path, trust=trust)
    return shard.dist_meta


def index_dist_optimizer(layout: Layout, src: ParallelLayout, *, trust: bool = False) -> DistOptimizerIndex:
    """Read every shard's ``distrib_optim.pt`` metadata (no tensor bytes) and place each parameter's fp32 master,
    ``exp_avg`` and ``exp_avg_sq`` in its global tensor. Raises :class:`OptimizerNotReshardable` when the files do not
    match the modelled buffer layout exactly."""
    index = DistOptimizerIndex()
    args = layout.saved_args
    size = bucket_size(args)
    tied = is_tied(layout)
    params = source_params(layout, src)
    for shard in layout.shards:
        if shard.meta is None or shard.name not in params:
            continue
        path = os.path.join(shard.path, naming.DISTRIB_OPTIM_FILENAME)
        files = _parts(read_dist_meta(shard, trust), path)
        groups = _parts(shard.meta.get("optimizer"), os.path.join(shard.path, naming.MODEL_FILENAME))
        if len(groups) != len(files):
            raise OptimizerNotReshardable(f"model_optim_rng.pt has {len(groups)} optimizer part(s) but "
                                          f"distrib_optim.pt {len(files)}", path=path, fix=FIX, code="optimizer")
        chained = len(files) > 1
        for part_no, (state, part) in enumerate(zip(files, groups, strict=True)):
            expert = chained and part_no == 1
            _add_settings(index, part, expert, path, shard.name)
            if state is None:
                continue  # saved by the DP rank 0 of this part, in another dir
            mine = params[shard.name] if not chained else [p for p in params[shard.name] if p.expert == expert]
            _index_part(index, state, buffers_of(mine, expert) if chained else _all_buffers(mine), size, path,
                        shard.name, tied)
    missing = [k for k, f in index.fields.items() if set(f) != set(STATE_KEYS)]
    every = {p.source.gkey for ps in params.values() for p in ps if p.source is not None
             and not (tied and p.key == "output_layer.weight")}
    missing += sorted(every - set(index.fields), key=str)
    if missing:
        raise OptimizerNotReshardable(f"no distributed optimizer state found for {len(missing)} parameter(s), e.g. "
                                      f"{missing[0].suffix}", path=layout.iter_dir, fix=FIX, code="optimizer")
    return index


def _all_buffers(params: list[Param]) -> list[tuple[torch.dtype, list[Param]]]:
    """A single optimizer: dense buffers then expert-parallel ones, per chunk (one DDP per chunk)."""
    out: list[tuple[torch.dtype, list[Param]]] = []
    for chunk in sorted({p.chunk for p in params}):
        mine = [p for p in params if p.chunk == chunk]
        out += buffers_of(mine, False) + buffers_of(mine, True)
    return out


def _add_settings(index: DistOptimizerIndex, part: Any, expert: bool, path: str, shard: str) -> None:
    inner = part.get("optimizer") if isinstance(part, dict) else None
    groups = inner.get("param_groups") if isinstance(inner, dict) else None
    if not isinstance(groups, list) or any(not isinstance(g, dict) or "params" in g for g in groups):
        raise OptimizerNotReshardable("model_optim_rng.pt holds no distributed-optimizer param groups", path=path,
                                      fix=FIX, code="optimizer")
    if not index.template_shard:
        index.template_shard = shard
        index.outer = OrderedDict((k, v) for k, v in part.items() if k != "optimizer")
    for g in groups:
        sig = add_settings(index.order, index.settings, dict(g))
        if expert:
            index.expert_groups.add(sig)


def _index_part(index: DistOptimizerIndex, state: dict[str, Any], buffers: list[tuple[torch.dtype, list[Param]]],
                size: int | None, path: str, shard: str, tied: bool) -> None:
    if not state.get("buckets_coalesced"):
        raise OptimizerNotReshardable(
            "distrib_optim.pt is in the pre-2024-04 layout (buckets not coalesced), which is not modelled", path=path,
            fix="load it once at its own layout with --ckpt-convert-update-legacy-dist-opt-format and save again, "
                "or " + FIX, code="optimizer")
    recorded = sorted(k for k in state if isinstance(k, int))
    if recorded != list(range(len(buffers))):
        raise OptimizerNotReshardable(f"distrib_optim.pt holds {len(recorded)} gradient buffer(s) where the model's "
                                      f"parameters make {len(buffers)}", path=path, fix=FIX, code="optimizer")
    for gbuf, (dtype, members) in enumerate(buffers):
        by_dtype = state[gbuf]
        if not isinstance(by_dtype, dict) or len(by_dtype) != 1:
            raise OptimizerNotReshardable(f"gradient buffer {gbuf} has {len(by_dtype)} dtypes (one expected)",
                                          path=path, fix=FIX, code="optimizer")
        (key, world), = by_dtype.items()
        if not (isinstance(key, tuple) and len(key) == 2 and key[0] == dtype):
            raise OptimizerNotReshardable(f"gradient buffer {gbuf} is keyed {key}, but its parameters are {dtype}",
                                          path=path, fix=FIX, code="optimizer")
        index.grad_dtype[dtype] = key[1]
        slots = [Slot(p.name, p.numel, p.shared_embedding) for p in members]
        offsets, buckets = world_offsets(slots, size)
        numel = sum(buckets)
        if world.get("numel_unpadded") != numel or any(
                not isinstance(world.get(k), TensorRef) or world[k].shape != (numel,) for k in STATE_KEYS):
            raise OptimizerNotReshardable(
                f"gradient buffer {gbuf} records {world.get('numel_unpadded')} elements, but its {len(members)} "
                f"parameters laid out by Megatron's DDP rules (64-element aligned, buckets of {size or 'any'} "
                f"elements) take {numel}: another Megatron version's buffer layout, or other bucket settings",
                path=path, fix=FIX, code="optimizer")
        for p in members:
            assert p.source is not None
            views = {name: world[name].window(offsets[p.name], p.shape) for name in STATE_KEYS}
            # a packed GroupedMLP weight's range holds every local expert's state: each read as the expert's linear
            for sk in p.unpacked or (p.source,):
                gkey = sk.gkey
                if tied and p.key == "output_layer.weight":
                    gkey = GlobalKey(None, None, "plain", "embedding.word_embeddings.weight")  # a replica of it
                fields = index.fields.setdefault(gkey, OrderedDict())
                mine = {name: unpacked(v, sk, len(p.unpacked), path) if p.unpacked else v for name, v in views.items()}
                for name, view in mine.items():
                    entry = fields.get(name)
                    if entry is None:
                        entry = fields[name] = GlobalEntry(gkey, sk.info, sk.rule)
                    entry.add(SourcePiece(shard, view, sk.group_rank, sk.group_size))
                index.checked.append((shard, sk.value, shard, mine["param"]))


def check_masters(index: DistOptimizerIndex, files: Any, *, sample: int = 8, shards: set[str] | None = None) -> int:
    """The fp32 masters read at the modelled places equal the model's weights (cast to the weight's dtype): a wrong
    buffer model would read another parameter's values. Sampled; returns the number of parameters checked."""
    checked = 0
    for shard, weight_ref, _, master_ref in index.checked:
        if shards is not None and shard not in shards:
            continue
        same = _master_matches(files, shard, weight_ref, master_ref, sample)
        if same is None:
            continue
        if checked % _RELEASE_EVERY == _RELEASE_EVERY - 1:  # keep the resident set small: a few pages of every
            files.release_pages()  # parameter were read (each release spans every open file's whole mapping)
        if not same:
            raise OptimizerNotReshardable(
                "the fp32 masters in distrib_optim.pt do not line up with the model's weights: its buffer layout is "
                "not the one modelled (another Megatron version or DDP settings)",
                path=os.path.join(files.iter_dir, shard, naming.DISTRIB_OPTIM_FILENAME), fix=FIX, code="optimizer")
        checked += 1
    files.release_pages()
    return checked


_RELEASE_EVERY = 64  # parameters checked between two releases of the mapped pages read


def _picks(n: int, sample: int) -> list[int]:
    return sorted({0, n // 3, n // 2, n - 1, *range(0, n, max(1, n // sample))})


def _master_matches(files: Any, shard: str, weight_ref: Any, master_ref: Any, sample: int) -> bool | None:
    """Whether the master, cast to the weight's dtype, equals the weight at the sampled elements (None: no elements).
    Legacy pieces are compared as numpy values (no torch), anything else as tensors."""
    legacy = type(weight_ref) is TensorRef and type(master_ref) is TensorRef
    return (_master_matches_bytes if legacy else _master_matches_tensors)(files, shard, weight_ref, master_ref, sample)


def _master_matches_tensors(files: Any, shard: str, weight_ref: Any, master_ref: Any, sample: int) -> bool | None:
    import torch  # deferred: torch only where tensors are made (metadata paths run without it)

    w, m = files.tensor(shard, weight_ref), files.tensor(shard, master_ref)
    if w.numel() == 0:
        return None
    flat_w, flat_m = w.reshape(-1), m.reshape(-1)
    picks = _picks(flat_w.numel(), sample)
    return torch.equal(flat_m[picks].to(flat_w.dtype), flat_w[picks])


def _master_matches_bytes(files: Any, shard: str, weight_ref: TensorRef, master_ref: TensorRef, sample: int
                          ) -> bool | None:
    """:func:`_master_matches_tensors` of two legacy pieces of the floats numpy reads, cast as torch casts (other
    dtypes: as tensors)."""
    if not (has_values(weight_ref.dtype) and has_values(master_ref.dtype)):
        return _master_matches_tensors(files, shard, weight_ref, master_ref, sample)
    w, m = files.array(shard, weight_ref).reshape(-1), files.array(shard, master_ref).reshape(-1)
    if w.size == 0:
        return None
    picks = _picks(w.size, sample)
    cast = BYTES.converted(m[picks], master_ref.dtype, weight_ref.dtype)
    return bool((float_values(cast, weight_ref.dtype) == float_values(w[picks], weight_ref.dtype)).all())


# -- the target side --------------------------------------------------------------------------------------------
def target_params(plan: RankPlan, tgt: ParallelLayout, tied: bool) -> list[Param]:
    expert_parallel = tgt.experts_are_expert_parallel()
    out = []
    for tp in plan.tensors:
        if tp.shape is None or tp.gkey is None or not is_param(tp.key, tp):
            continue
        chunk = 0 if tp.chunk == "model" else int(tp.chunk[5:])
        shared = tied and tgt.pp > 1 and tp.key in _EMBEDDING_KEYS
        out.append(Param(chunk, tp.key, tuple(tp.shape), tp.dtype, tp.gkey.expert is not None and expert_parallel,
                         shared, plan=tp))
    return out


def plan_dist_optimizer(index: DistOptimizerIndex, plan: RankPlan, tgt: ParallelLayout, vocab: VocabPlan | None,
                        *, tied: bool, size: int | None) -> tuple[Any, Any]:
    """The target rank's distributed optimizer: (the ``optimizer`` entry of model_optim_rng.pt, the content of
    distrib_optim.pt with :class:`FlatPlan` world tensors). As Megatron's ChainedOptimizer saves it: a part is in the
    file of a rank that is data-parallel rank 0 of that part (``dp`` for the dense part, ``edp`` for the expert
    part, from ``plan.coords``), None in the others' (Megatron reads only the parts of which the reading rank is DP
    rank 0). Coordinates without them (the hook's live ranks) keep every part."""
    params = target_params(plan, tgt, tied)
    split = any(p.expert for p in params) or (bool(index.expert_groups) and tgt.experts_are_expert_parallel())
    parts: list[tuple[bool, list[tuple[torch.dtype, list[Param]]]]]
    if split:
        parts = [(False, [b for c in _chunks(params) for b in buffers_of(c, False)]),
                 (True, [b for c in _chunks(params) for b in buffers_of(c, True)])]
    else:
        parts = [(False, _all_buffers(params))]
    entries, files = [], []
    for expert, buffers in parts:
        state: dict[Any, Any] = {"buckets_coalesced": True}
        for gbuf, (dtype, members) in enumerate(buffers):
            offsets, buckets = world_offsets([Slot(p.name, p.numel, p.shared_embedding) for p in members], size)
            numel = sum(buckets)
            world: dict[str, Any] = {}
            for name in STATE_KEYS:
                flat = []
                for p in members:
                    assert p.plan is not None and p.plan.gkey is not None
                    gkey = p.plan.gkey
                    if tied and p.key == "output_layer.weight":
                        gkey = GlobalKey(None, None, "plain", "embedding.word_embeddings.weight")
                    entry = index.fields.get(gkey, {}).get(name)
                    if entry is None:
                        raise OptimizerNotReshardable(f"no distributed optimizer state for {p.key}", fix=FIX,
                                                      code="optimizer")
                    fp = plan_tensor(entry, "optimizer", f"{p.key}#{name}", plan.coords, tgt, vocab)
                    fp.gkey, fp.param = None, p.plan
                    flat.append((offsets[p.name], fp))
                world[name] = FlatPlan(numel, flat, key=f"distrib_optim[{gbuf}].{name}",
                                       names=[p.name for p in members])
            world["numel_unpadded"] = numel
            state[gbuf] = {(dtype, index.grad_dtype.get(dtype, dtype)): world}
        files.append(state)
        sigs = index.order if not split or not expert else [s for s in index.order if s in index.expert_groups] \
            or _expert_groups(index, [p for p in params if p.expert]) or index.order
        groups = [{**index.settings[s], "is_expert_parallel": expert} for s in sigs]
        entry: OrderedDict[str, Any] = OrderedDict([("optimizer", {"param_groups": groups})])
        entry.update(index.outer)
        entries.append(entry)
    if len(entries) == 1:
        return entries[0], files[0]
    holds = (plan.coords.get("dp", 0) == 0, plan.coords.get("edp", 0) == 0)
    return entries, [f if held else None for f, held in zip(files, holds, strict=True)]


def _expert_groups(index: DistOptimizerIndex, experts: list[Param]) -> list[str]:
    """The expert part's groups when the source recorded none (saved with its experts in the dense groups: EP1): the
    groups Megatron's default rules put an expert parameter in (weight decay or not; a decoupled LR is the embedding's
    and head's), as Megatron gives that part only the groups its parameters need (aligned over all ranks)."""
    kinds = {no_weight_decay(p.key, p.shape) for p in experts}
    out = []
    for s in index.order:
        st = index.settings[s]
        wd = st.get("wd_mult", st.get("weight_decay"))
        if not is_decoupled_group(st) and (wd is None or (float(wd) == 0.0) in kinds):
            out.append(s)
    return out


def _chunks(params: list[Param]) -> list[list[Param]]:
    return [[p for p in params if p.chunk == c] for c in sorted({p.chunk for p in params})]


def relocate(fp: FlatPlan, offsets: dict[str, int]) -> int:
    """Place each part at the offset the running optimizer gives its parameter (``offsets`` by "chunk:key", keys by
    their global name: :func:`~megatron_preflight.reshard.plan.rules.canonical_name`); returns
    how many places differ from the modelled ones. Raises when a parameter is unknown to the running optimizer."""
    moved = 0
    parts = []
    for planned, (start, tp) in zip(fp.names, fp.parts, strict=True):
        chunk, _, key = planned.partition(":")
        name = f"{chunk}:{canonical_name(key)}"  # the running modules may name an MTP layer otherwise
        if name not in offsets:
            raise PreflightError(f"the running distributed optimizer has no parameter {name.split(':', 1)[1]} in "
                                 f"{fp.key}", fix=FIX, code="optimizer")
        moved += offsets[name] != start
        parts.append((offsets[name], tp))
    fp.parts = parts
    validate_flat(fp)
    return moved


__all__ = ["StorageRef", "check_masters", "index_dist_optimizer", "plan_dist_optimizer"]

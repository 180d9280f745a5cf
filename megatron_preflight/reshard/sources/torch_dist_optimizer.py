"""The optimizer state of a torch_dist source, as pieces of the model's global tensors.

Megatron saves it in model space for the plain optimizer (``optimizer.state.{exp_avg,exp_avg_sq}.<param>``, plus
``fp32_param`` — the fp32 master — for bf16/fp16 runs; ``common_step`` in the common state) and for the distributed
optimizer's ``fully_reshardable`` / ``fully_sharded_model_space`` forms (``optimizer.state.{param,exp_avg,
exp_avg_sq}.<param>``; ``step`` in each param group). Each tensor has its parameter's global shape, so its piece for a
legacy shard is the parameter's own region (:class:`~megatron_preflight.reshard.dist_source.RegionRef`) with the
optimizer's key. The result is a :class:`DistOptimizerIndex` (settings per group, fields per parameter), which the
resharder converts to whichever optimizer the target runs (:mod:`optimizer_convert`).

The ``dp_reshardable`` form (flat per-bucket buffers per DP rank) is read as the legacy ``distrib_optim.pt`` it
equals (:func:`attach_dp_reshardable`); the forms not read (``fully_sharded_bucket_space``, ``dp_zero_gather_scatter``)
are refused with the fix.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from megatron_preflight import dtypes
from megatron_preflight.layout import naming, optimizer_entry, optimizer_kinds
from megatron_preflight.layout.dist import COMMON_PT, object_index, read_dcp_metadata, read_object
from megatron_preflight.layout.model import Layout
from megatron_preflight.layout.optimizer_kinds import KINDS, group_kind, primary_of
from megatron_preflight.parallel import ParallelLayout
from megatron_preflight.reshard.optimizer.distributed import FIX, DistOptimizerIndex
from megatron_preflight.reshard.optimizer.plain import OptimizerNotReshardable, add_settings, is_param
from megatron_preflight.reshard.plan.index import iter_source_keys
from megatron_preflight.reshard.plan.topology import is_tied
from megatron_preflight.reshard.plan.types import GlobalEntry, SourcePiece
from megatron_preflight.reshard.sources.torch_dist_reader import RegionRef, Slab, source_metadata
from megatron_preflight.torch_file import StorageRef, TensorRef, TorchFile
from megatron_preflight.tree import map_leaves

if TYPE_CHECKING:
    import torch

MODEL_SPACE = ("fully_reshardable", "fully_sharded_model_space")
# torch_dist state name -> the name the index uses ("param": the fp32 master; then every kind's param-shaped fields)
FIELDS = {"param": "param", "fp32_param": "param",
          **{n: n for kind in KINDS.values() for n in kind.param_fields}}


def _groups(common_optimizer: Any) -> list[dict[str, Any]]:
    """The param groups of the common state's optimizer (see :func:`optimizer_entry.param_groups`)."""
    groups = optimizer_entry.param_groups(common_optimizer)
    if groups is None:
        raise OptimizerNotReshardable("the common state's optimizer has no param groups", fix=FIX, code="optimizer")
    return groups


def _sharding(common_optimizer: Any) -> str | None:
    kinds = optimizer_entry.sharding_kinds(common_optimizer)
    return kinds.pop() if len(kinds) == 1 else (None if not kinds else "mixed")


def _find(tree: Any, name: str) -> Any:
    if isinstance(tree, dict):
        if name in tree:
            return tree[name]
        for v in tree.values():
            found = _find(v, name)
            if found is not None:
                return found
    elif isinstance(tree, list):
        for v in tree:
            found = _find(v, name)
            if found is not None:
                return found
    return None


def read_common(iter_dir: str, md: Any, trust: bool = False) -> Any:
    """The common state (common.pt, or the ``common_state`` item of a .distcp file) with its few tensors read (the
    step, a loss scale): small, read whole. Without torch loaded (the check), one-element tensors are read as numbers
    and bigger ones stay references."""
    path, window = os.path.join(iter_dir, COMMON_PT), None
    if not os.path.isfile(path):
        for index, info in md.storage_data.items():
            if getattr(index, "fqn", "").startswith("common_state"):
                path, window = os.path.join(iter_dir, info.relative_path), (int(info.offset), int(info.length))
                break
        else:
            return None
    with TorchFile(path, trust=trust, window=window) as f:
        common = f.load_metadata()
        if dtypes.torch_loaded():
            common = map_leaves(common, lambda v, _p: f.tensor(v).clone() if isinstance(v, TensorRef) else v)
        else:
            common = map_leaves(common, lambda v, _p: f.item(v) if isinstance(v, TensorRef) else v)
    return common[0] if isinstance(common, list) and common else common


def index_dist_source_optimizer(source: Layout, virtual: Layout, src: ParallelLayout, *,
                                trust: bool = False) -> DistOptimizerIndex:
    """The optimizer state of the torch_dist checkpoint ``source`` (read as ``virtual``'s legacy shards)."""
    iter_dir = source.iter_dir or ""
    common = (source.common_state or {}).get("optimizer")
    if common is None:
        raise OptimizerNotReshardable("the common state holds no optimizer entry", path=iter_dir, fix=FIX,
                                      code="optimizer")
    sharding = _sharding(common)
    if sharding is not None and sharding not in MODEL_SPACE:
        raise OptimizerNotReshardable(
            f"its distributed optimizer state is saved as {sharding!r} (flat buffers per DP rank), which is not read "
            "yet", path=iter_dir, fix=FIX, code="optimizer")
    saved = source_metadata(iter_dir, trust=trust).state_dict_metadata
    _known_fields(saved, iter_dir)
    md = read_dcp_metadata(iter_dir, trust=trust)
    out = DistOptimizerIndex(template_shard=virtual.shards[0].name if virtual.shards else "")
    full = read_common(iter_dir, md, trust=trust) or {}
    first = optimizer_entry.parts(full.get("optimizer") if isinstance(full, dict) else None)[0]
    if isinstance(first, dict):  # a wrapper's other entries (an fp16 run's grad scaler); not the model-space forms'
        # per-parameter common entries (``param_state``: fully_sharded_model_space's step per parameter), which
        # describe the source's state, not a legacy file's: Megatron's load then asks for their sharding type
        out.outer = OrderedDict((k, v) for k, v in first.items()
                                if k not in ("optimizer", "param_state_sharding_type", "param_state", "state",
                                             "param_groups"))
    step = None
    if sharding is None:
        found = _find(full.get("optimizer") if isinstance(full, dict) else None, "common_step")
        step = float(found) if isinstance(found, (int, float)) or hasattr(found, "item") else None
        primary = primary_of(source.saved_args or {})
        counted = any("step" in group_kind(g, primary).fields for g in _groups(common))  # (SGD, Lion, Muon: none)
        if step is None and counted and not all("step" in g for g in _groups(common)):  # a fused Adam: per group
            raise OptimizerNotReshardable("the plain optimizer's step is in neither the common state (common_step, "
                                          "torch's Adam) nor its param groups (a fused Adam)", path=iter_dir, fix=FIX,
                                          code="optimizer")
    for settings in _groups(common):
        settings = {k: v for k, v in settings.items() if k != "params"}
        if step is not None:
            settings["step"] = step
        sig = add_settings(out.order, out.settings, settings)
        if settings.get("is_expert_parallel"):
            out.expert_groups.add(sig)
    tied = is_tied(virtual)
    memo: dict[tuple[Slab, str], tuple[Slab, Any] | None] = {}  # a replicated parameter's slabs recur in each replica
    refs: dict[tuple[int, str], RegionRef | None] = {}  # (and the view shares one region among a stage's EP ranks)
    for sk in iter_source_keys(virtual, src):
        if not is_param(sk.key, sk.value) or not isinstance(sk.value, RegionRef):
            continue
        if tied and sk.key == "output_layer.weight":
            continue  # the tied head copy: served by the embedding
        fields = out.fields.setdefault(sk.gkey, OrderedDict())
        for state, name in FIELDS.items():
            at = (id(sk.value), state)  # (the view holds every region while this runs: ids stay unique)
            if at not in refs:
                refs[at] = _state_ref(sk.value, state, saved, memo)
            ref = refs[at]
            if ref is None:
                continue
            entry = fields.get(name)
            if entry is None:
                entry = fields[name] = GlobalEntry(sk.gkey, sk.info, sk.rule)
            entry.add(SourcePiece(sk.shard, ref, sk.group_rank, sk.group_size))
        if not fields:
            raise OptimizerNotReshardable(f"no saved optimizer state for {sk.key}", path=iter_dir, fix=FIX,
                                          code="optimizer")
    return out


def _known_fields(saved: dict[str, Any], where: str) -> None:
    """Every ``optimizer.state.<field>.`` tensor must be a field the kinds table names (never dropped)."""
    names = {k.split(".", 3)[2] for k in saved if k.startswith("optimizer.state.") and k.count(".") >= 3}
    unknown = sorted(n for n in names if n not in FIELDS)
    if unknown:
        local = [n for n in unknown if any(n in k.fields for k in KINDS.values())]
        raise OptimizerNotReshardable(
            f"the optimizer state holds {', '.join(unknown)} per parameter, " + (
                "matrices of each shard's own (SOAP's preconditioners), which cannot be carried from model space"
                if local else "a field megatron-preflight does not know how to carry"), path=where, fix=FIX,
            code="optimizer")


def fragments(state_shape: tuple[int, ...], param_shape: tuple[int, ...], dims: int) -> tuple[int, ...] | None:
    """The fragment shape of an optimizer tensor saved flattened by fragments (``fully_sharded_model_space``: see
    :class:`~megatron_preflight.reshard.sources.torch_dist_reader.Slab`) — ``param_shape`` is ``lead + G`` with
    ``dims`` = len(G), ``state_shape`` ``lead + F + (numel,)`` —, None when the shapes are not that relation."""
    lead = len(param_shape) - dims
    if len(state_shape) != lead + dims + 1 or state_shape[:lead] != param_shape[:lead]:
        return None
    counts, whole = state_shape[lead:lead + dims], param_shape[lead:]
    if any(c < 1 or g % c for c, g in zip(counts, whole, strict=True)):
        return None
    frag = tuple(g // c for c, g in zip(counts, whole, strict=True))
    return frag if math.prod(frag) == state_shape[-1] else None


def _state_ref(param: RegionRef, state: str, saved: dict[str, Any],
               memo: dict[tuple[Slab, str], tuple[Slab, Any] | None]) -> RegionRef | None:
    """The optimizer tensor ``state`` of a parameter, at the parameter's own region: the same global shape
    (``fully_reshardable``, the plain optimizer), or flattened by fragments (``fully_sharded_model_space``)."""
    slabs = []
    dtype = None
    for s in param.slabs:
        key = (s, state)
        if key not in memo:
            memo[key] = _state_slab(s, state, saved, len(param.shape))
        found = memo[key]
        if found is None:
            return None
        slab, dtype = found
        slabs.append(slab)
    assert dtype is not None
    numel = param.storage.numel
    return RegionRef(param.file, StorageRef(slabs[0].fqn, dtype, numel), 0, param.shape, param.stride,
                     slabs=tuple(slabs))


def _state_slab(s: Slab, state: str, saved: dict[str, Any], dims: int) -> tuple[Slab, Any] | None:
    """A parameter's slab as the optimizer tensor ``state``'s slab, and that tensor's dtype (None: not saved)."""
    fqn = f"optimizer.state.{state}.{s.fqn}"
    tm = saved.get(fqn)
    if tm is None or not hasattr(tm, "size"):
        return None
    state_shape = tuple(int(d) for d in tm.size)
    param_shape = tuple(int(d) for d in saved[s.fqn].size)
    frag = None
    if state_shape != param_shape:
        frag = fragments(state_shape, param_shape, dims)
        if frag is None:
            raise OptimizerNotReshardable(f"{fqn} has shape {state_shape}, its parameter {param_shape}: neither "
                                          "the parameter's shape nor its fragments flattened (the "
                                          "fully_sharded_model_space form)", fix=FIX, code="optimizer")
    return dataclasses.replace(s, fqn=fqn, fragment=frag), tm.properties.dtype


# -- dp_reshardable: the distributed optimizer's flat buckets, per model-parallel domain -----------------------------
_DPR = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.(.+)$")
_BUCKET = re.compile(r"^gbuf_idx_(\d+)\.dtype_\((torch\.\w+), (torch\.\w+)\)\.bucket_idx_(\d+)\.("
                     + "|".join(optimizer_kinds.DISTRIBUTED_STATE) + ")$")


def _dtype(name: str) -> Any:
    short = name.split(".", 1)[1]
    if short not in dtypes.NAMES:
        raise OptimizerNotReshardable(f"unknown dtype {name} in a dp_reshardable key", fix=FIX, code="optimizer")
    return dtypes.dtype(short)


def attach_dp_reshardable(source: Layout, virtual: Layout, *, trust: bool = False) -> None:
    """Give each of ``virtual``'s shards what a legacy save at the same layout holds for the distributed optimizer:
    the param groups under ``optimizer`` and ``distrib_optim.pt``'s content (per gradient buffer, the buckets
    concatenated without their end padding) as regions of the saved buckets. The legacy reader then models and
    checks the buffers as it does for ``distrib_optim.pt`` (its masters check catches a wrong domain mapping).

    Domains (``dp_group_idx``): the dense part's is the rank in the model-parallel group (tp + TP x pp); a chained
    optimizer's expert part (``chained_1.``) uses the expert model-parallel group (etp + ETP x (ep + EP x pp))."""
    iter_dir = source.iter_dir or ""
    par = virtual.parallel
    if par is None:
        raise OptimizerNotReshardable("the layout that saved the dp_reshardable state is unknown", path=iter_dir,
                                      fix=FIX, code="optimizer")
    # (context parallelism: the buckets are sharded over DP x CP, the domains stay the model-parallel ranks tp + TP x
    # pp; each bucket is read whole, so the shard domain only sizes the buckets, as the legacy model computes)
    md = read_dcp_metadata(iter_dir, trust=trust)
    buckets: dict[tuple[int, int], dict[int, dict[tuple[torch.dtype, torch.dtype], dict[int, dict[str, tuple]]]]] = {}
    objects: dict[tuple[int, int], dict[str, str]] = {}
    for fqn, tm in md.state_dict_metadata.items():
        m = _DPR.match(fqn)
        if not m:
            continue
        part, group, rest = int(m.group(1) or 0), int(m.group(2)), m.group(3)
        b = _BUCKET.match(rest)
        if b and hasattr(tm, "size"):
            gbuf, key, bucket = int(b.group(1)), (_dtype(b.group(2)), _dtype(b.group(3))), int(b.group(4))
            (buckets.setdefault((part, group), {}).setdefault(gbuf, {}).setdefault(key, {})
             .setdefault(bucket, {}))[b.group(5)] = (fqn, int(tm.size[0]), tm.properties.dtype)
        elif "/shard_" in rest:
            objects.setdefault((part, group), {})[rest.split("/shard_")[0]] = fqn
    chained = any(part > 0 for part, _ in buckets) or any(part > 0 for part, _ in objects)
    items = object_index(md)

    def item(fqn: str) -> Any:
        return read_object(iter_dir, fqn, items[fqn], trust=trust)

    cache: dict[tuple[int, int], tuple[Any, Any]] = {}

    def part_of(part: int, group: int) -> tuple[Any, Any]:
        if (part, group) not in cache:
            names = objects.get((part, group), {})
            if "optimizer" not in names or (part, group) not in buckets:
                raise OptimizerNotReshardable(f"no dp_reshardable state for optimizer part {part}, model-parallel "
                                              f"domain {group}", path=iter_dir, fix=FIX, code="optimizer")
            groups = item(names["optimizer"])
            entry = OrderedDict([("optimizer", groups)])
            for name, fqn in names.items():
                if name not in ("optimizer", "per_bucket_numel", "per_bucket_numel_unpadded"):
                    entry[name] = item(fqn)
            state: dict[Any, Any] = {"buckets_coalesced": True}
            for gbuf, by_key in sorted(buckets[(part, group)].items()):
                state[gbuf] = {}
                for key, per_bucket in by_key.items():
                    world: dict[str, Any] = {}
                    total = 0
                    for name in optimizer_kinds.DISTRIBUTED_STATE:
                        slabs, acc, dtype = [], 0, dtypes.dtype("float32")
                        for _b, fields in sorted(per_bucket.items()):
                            if name not in fields:
                                raise OptimizerNotReshardable(f"bucket {_b} of buffer {gbuf} has no {name}",
                                                              path=iter_dir, fix=FIX, code="optimizer")
                            fqn, n, dtype = fields[name]
                            slabs.append(Slab(fqn, (0,), (n,), 0, acc))
                            acc += n
                        world[name] = RegionRef(iter_dir, StorageRef(slabs[0].fqn, dtype, acc), 0, (acc,), (1,),
                                                slabs=tuple(slabs))
                        total = acc
                    world["numel_unpadded"] = total
                    state[gbuf][key] = world
            cache[(part, group)] = (entry, state)
        return cache[(part, group)]

    dirs = naming.shard_writers(par)
    for shard in virtual.shards:
        c = dirs[shard.name]
        dense_group = c["tp"] + par.tp * c["pp"]
        entry, state = part_of(0, dense_group)
        if not chained:
            shard.meta["optimizer"], shard.dist_meta = entry, state
            continue
        expert_group = c["etp"] + par.etp_eff * (c["ep"] + par.ep * c["pp"])
        e_entry, e_state = part_of(1, expert_group)
        holds_dense = c["ep"] == 0  # the dense part's DP rank 0 sits in the ep-0 dir (as a legacy save)
        shard.meta["optimizer"] = [entry, e_entry]
        shard.dist_meta = [state if holds_dense else None, e_state if c["tp"] == c["etp"] else None]

"""Plan a target rank's state dict from the on-disk shards: which source tensors, which slices, where they go.

Every local tensor is a piece of a *global* tensor (as in megatron-core's ShardedTensor: a global shape, and an
offset along the split dim). The planner indexes the source pieces by global key, then for each tensor the target
rank owns, intersects its target segments with the source segments. The plan is data; nothing is read here but
metadata, so planning any layout is instant.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from megatron_preflight.errors import PreflightError
from megatron_preflight.layout.model import Layout
from megatron_preflight.reshard.rules import KeyInfo, Rule, parse_key, rule_for, segments
from megatron_preflight.reshard.topology import Topology
from megatron_preflight.torch_file import TensorRef

GlobalKey = tuple  # (layer or None, expert or None, style, suffix)


@dataclass
class SourcePiece:
    shard: str
    ref: Any  # TensorRef, or a plain value (extra state)
    group_rank: int
    group_size: int


@dataclass
class GlobalEntry:
    key: GlobalKey
    info: KeyInfo
    rule: Rule
    pieces: dict[int, SourcePiece] = field(default_factory=dict)
    order: tuple[int, int] = (0, 0)  # where the key sits in its layer (or section), as Megatron's modules order it

    def global_len(self) -> int | None:
        """Length of the global tensor along the split dim (None for replicated / extra)."""
        if self.rule.dim is None:
            return None
        piece = next(iter(self.pieces.values()))
        ref = piece.ref
        return ref.shape[self.rule.dim] * piece.group_size


@dataclass(frozen=True)
class CopyOp:
    shard: str
    ref: TensorRef
    src: tuple[int, int, int] | None  # (dim, start, length) in the source tensor; None = whole tensor
    dst: tuple[int, int, int] | None  # (dim, start, length) in the target tensor


@dataclass
class TensorPlan:
    chunk: str  # "model" or "model{v}"
    key: str
    shape: tuple[int, ...] | None  # None for non-tensor values
    dtype: Any
    ops: list[CopyOp]
    value: Any = None  # non-tensor value (extra state)
    zero_fill: bool = False  # rows not covered by any op (re-made vocab padding) are zeros
    gkey: GlobalKey | None = None  # the global tensor this is a piece of (None: not a model tensor)


@dataclass
class RankPlan:
    coords: dict[str, int]
    shard_name: str
    chunks: list[str]
    tensors: list[TensorPlan]
    optimizer: Any = None  # the optimizer state tree (TensorPlan leaves), when it is resharded

    @property
    def sources(self) -> list[str]:
        return sorted({op.shard for t in self.tensors for op in t.ops})

    @property
    def nbytes(self) -> int:
        total = 0
        for t in self.tensors:
            if t.shape is not None:
                n = 1
                for s in t.shape:
                    n *= s
                total += n * t.dtype.itemsize
        return total


def _arg(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default) if args is not None else default


def source_topology(layout: Layout) -> Topology:
    args = layout.saved_args
    topo = Topology(
        num_layers=int(_arg(args, "num_layers", 0) or _count_layers(layout)),
        tp=layout.tp or 1, pp=layout.pp or 1, ep=layout.ep or 1, etp=layout.etp, vpp=layout.vpp,
        first_stage_layers=_arg(args, "decoder_first_pipeline_num_layers"),
        last_stage_layers=_arg(args, "decoder_last_pipeline_num_layers"),
        num_experts=_arg(args, "num_experts") or _count_experts(layout),
        cp=layout.cp or 1,
        order="tp-cp-ep-pp-dp" if _arg(args, "use_tp_pp_dp_mapping", False) else "tp-cp-ep-dp-pp",
        embedding_in_split=bool(_arg(args, "account_for_embedding_in_pipeline_split", False)),
        loss_in_split=bool(_arg(args, "account_for_loss_in_pipeline_split", False)),
    )
    observed = _observed_layer_counts(layout, topo)
    return dataclasses.replace(topo, observed=observed) if observed is not None else topo


def _observed_layer_counts(layout: Layout, topo: Topology) -> tuple[tuple[int, ...], ...] | None:
    """Layers per (chunk, stage) as the shards hold them: whatever scheme placed them (uneven stages, the
    embedding/loss counted as layers, a custom pipeline layout), the keys say where each layer is. None when a
    stage was not read or the counts do not add up to the model's layers."""
    dirs = topo.shard_dirs()
    counts: dict[tuple[int, int], int] = {}
    for s in layout.shards:
        coords = dirs.get(s.name)
        if coords is None or not isinstance(s.meta, dict):
            continue
        for chunk, ck in _chunks_of(s.meta):
            layers = {parse_key(k).layer for k in s.meta[ck]} - {None}
            key = (chunk, coords["pp"])
            counts[key] = max(counts.get(key, 0), len(layers))
    table = tuple(tuple(counts.get((c, p), -1) for p in range(topo.pp)) for c in range(topo.chunks))
    if any(n < 0 for row in table for n in row) or sum(map(sum, table)) != topo.num_layers:
        return None
    return table


def _chunks_of(meta: dict[str, Any]) -> list[tuple[int, str]]:
    if "model" in meta and isinstance(meta["model"], dict):
        return [(0, "model")]
    out = [(int(k[5:]), k) for k in meta if k.startswith("model") and k[5:].isdigit() and isinstance(meta[k], dict)]
    return sorted(out)


def _count_layers(layout: Layout) -> int:
    total = 0
    for s in layout.shards:
        if s.meta is None or s.tp_rank != 0 or s.ep_rank not in (0, None):
            continue
        for _, ck in _chunks_of(s.meta):
            total += len({parse_key(k).layer for k in s.meta[ck] if parse_key(k).layer is not None})
    return total


def _count_experts(layout: Layout) -> int | None:
    local = set()
    for s in layout.shards:
        if s.meta is None:
            continue
        for _, ck in _chunks_of(s.meta):
            for k in s.meta[ck]:
                info = parse_key(k)
                if info.expert is not None:
                    local.add(info.expert)
        break
    return len(local) * (layout.ep or 1) if local else None


def is_tied(layout: Layout) -> bool:
    args = layout.saved_args
    if args is not None and hasattr(args, "untie_embeddings_and_output_weights"):
        return not bool(args.untie_embeddings_and_output_weights)
    # No args: tied iff a PP=1 shard has no output_layer.weight.
    for s in layout.shards:
        if s.meta and (layout.pp or 1) == 1:
            return all("output_layer.weight" not in s.meta[ck] for _, ck in _chunks_of(s.meta))
    return True


@dataclass(frozen=True)
class SourceKey:
    """One entry of a source shard's model chunk, placed in the global model."""

    shard: str
    chunk: int
    key: str
    value: Any
    info: KeyInfo
    rule: Rule
    gkey: GlobalKey
    group_rank: int
    group_size: int
    order: tuple[int, int]


def _layer_orders(keys: list[str]) -> dict[str, tuple[int, int]]:
    """Each key's place inside its layer, as (slot, sub-slot) independent of the local expert index: Megatron's
    module order, read from the source. Sequential experts form one block (expert-major inside it); TE-grouped
    expert weights sort by name, then expert."""
    out: dict[str, tuple[int, int]] = {}
    first: dict[tuple[int | None, str, str], int] = {}
    block: dict[int | None, int] = {}
    pos: dict[int | None, int] = {}
    for key in keys:
        info = parse_key(key)
        layer = info.layer
        p = pos[layer] = pos.get(layer, -1) + 1
        slot = first.setdefault((layer, info.style, info.suffix), p)
        if info.style == "seq_expert":
            start = block.setdefault(layer, p)
            out[key] = (start, slot - start)
        else:
            out[key] = (slot, 0)
    return out


def iter_source_keys(layout: Layout, src: Topology) -> Any:
    """Every model-chunk entry of every source shard, with its global key and split group coordinates."""
    swiglu = bool(_arg(layout.saved_args, "swiglu", False))
    dirs = src.shard_dirs()
    shards = sorted(layout.shards, key=lambda s: (s.pp_rank or 0, s.tp_rank or 0, s.ep_rank or 0))
    for shard in shards:
        coords = dirs.get(shard.name)
        if coords is None or shard.meta is None:
            continue
        for chunk_idx, ck in _chunks_of(shard.meta):
            orders = _layer_orders(list(shard.meta[ck]))
            for key, value in shard.meta[ck].items():
                info = parse_key(key)
                rule = rule_for(info, swiglu=swiglu)
                layer = src.global_layer(coords["pp"], chunk_idx, info.layer) if info.layer is not None else None
                expert = src.global_expert(coords["ep"], info.expert) if info.expert is not None else None
                if rule.group == "etp":
                    grank, gsize = coords["etp"], src.etp_eff
                else:
                    grank, gsize = coords["tp"], src.tp
                yield SourceKey(shard.name, chunk_idx, key, value, info, rule, (layer, expert, info.style, info.suffix),
                                grank, gsize, orders[key])


def index_sources(layout: Layout, src: Topology) -> OrderedDict[GlobalKey, GlobalEntry]:
    """Every global tensor of the checkpoint and the source pieces that hold it."""
    tied = is_tied(layout)
    index: OrderedDict[GlobalKey, GlobalEntry] = OrderedDict()
    for sk in iter_source_keys(layout, src):
        if tied and sk.key == "output_layer.weight":
            continue  # the tied copy of the word embeddings: served from the embedding
        entry = index.get(sk.gkey)
        if entry is None:
            order = sk.order if sk.info.layer is not None else (len(index), 0)
            entry = index[sk.gkey] = GlobalEntry(sk.gkey, sk.info, sk.rule, order=order)
        entry.pieces.setdefault(sk.group_rank, SourcePiece(sk.shard, sk.value, sk.group_rank, sk.group_size))
    check_complete(index, layout)
    return index


def check_complete(index: Any, layout: Layout) -> None:
    """Every split tensor has a piece from every rank of its group."""
    for entry in index.values():
        if entry.rule.dim is not None:
            size = next(iter(entry.pieces.values())).group_size
            missing = [r for r in range(size) if r not in entry.pieces]
            if missing:
                raise PreflightError(
                    f"tensor {entry.info.render(entry.key[0], entry.key[1])} has no source for "
                    f"{'expert-' if entry.rule.group == 'etp' else ''}tensor-parallel rank(s) {missing}",
                    path=layout.iter_dir, fix="the checkpoint is incomplete: restore the missing shards",
                    code="missing_shard")


@dataclass
class VocabInfo:
    source_padded: int | None
    target_padded: int | None


def target_vocab(layout: Layout, tgt: Topology, padded_vocab_size: int | None, vocab_size: int | None,
                 divisible_by: int | None) -> int | None:
    """Padded vocab rows at the target TP (Megatron's rule), from the true vocab size when it is known."""
    if padded_vocab_size:
        return padded_vocab_size
    args = layout.saved_args
    div = divisible_by or int(_arg(args, "make_vocab_size_divisible_by", 128) or 128)
    true = vocab_size or _arg(args, "vocab_size")
    src_padded = _arg(args, "padded_vocab_size")
    m = div * tgt.tp
    if true:
        return ((int(true) + m - 1) // m) * m
    if src_padded is None:
        return None
    src_m = div * (layout.tp or 1)
    if m % src_m == 0:  # rounding up the padded size to a coarser multiple gives the same result
        return ((src_padded + m - 1) // m) * m
    raise PreflightError(
        f"the checkpoint does not record its true vocab size (padded_vocab_size={src_padded} at TP{layout.tp}), "
        f"so the padded vocab at TP{tgt.tp} is ambiguous", path=layout.iter_dir,
        fix="pass --vocab-size (the tokenizer's vocab size) or --padded-vocab-size", code="usage")


def plan_rank(index: OrderedDict[GlobalKey, GlobalEntry], src: Topology, tgt: Topology, coords: dict[str, int],
              *, tied: bool, target_padded_vocab: int | None, shard_name: str = "") -> RankPlan:
    """The plan for the target rank at ``coords`` (its tp, pp, ep, etp ranks)."""
    stage, ep_rank = coords["pp"], coords["ep"]
    chunk_names = ["model"] if tgt.chunks == 1 else [f"model{v}" for v in range(tgt.chunks)]
    tensors: list[tuple[tuple, TensorPlan]] = []
    emb_key = (None, None, "plain", "embedding.word_embeddings.weight")
    for gkey, entry in index.items():
        layer, expert, _style, suffix = gkey
        if layer is not None:
            t_stage, chunk, local = tgt.place_layer(layer)
            if t_stage != stage:
                continue
            section = 1
        else:
            local = None
            if suffix.startswith("embedding."):
                if stage != 0:
                    continue
                chunk, section = 0, 0
            elif suffix.startswith(("decoder.final_", "output_layer.")):
                if stage != tgt.pp - 1:
                    continue
                chunk, section = tgt.chunks - 1, 2
            else:
                raise PreflightError(f"no placement rule for non-layer key {suffix}", code="unknown_key")
        local_expert = None
        if expert is not None:
            e_rank, local_expert = tgt.place_expert(expert)
            if e_rank != ep_rank:
                continue
        key = entry.info.render(local, local_expert)
        # Megatron's module order: chunk, then embedding / layers / head, then the key's place in its layer.
        order = (chunk, section, local or 0, entry.order[0], local_expert or 0,
                 entry.order[1])
        tensors.append((order, _plan_tensor(entry, chunk_names[chunk], key, coords, src, tgt, target_padded_vocab)))
    tensors.sort(key=lambda item: item[0])
    out = [t for _, t in tensors]
    if tied and tgt.pp > 1 and stage == tgt.pp - 1 and emb_key in index:
        # The last stage holds its own copy of the tied word embeddings as output_layer.weight (a parameter: it
        # comes before the head's _extra_state, as in the module's state dict).
        head = _plan_tensor(index[emb_key], chunk_names[-1], "output_layer.weight", coords, src, tgt,
                            target_padded_vocab)
        at = next((i for i, t in enumerate(out) if t.chunk == head.chunk and t.key == "output_layer._extra_state"),
                  len(out))
        out.insert(at, head)
    return RankPlan(coords, shard_name, chunk_names, out)


def _plan_tensor(entry: GlobalEntry, chunk: str, key: str, coords: dict[str, int], src: Topology, tgt: Topology,
                 target_padded_vocab: int | None) -> TensorPlan:
    rule = entry.rule
    first = next(iter(entry.pieces.values()))
    if rule.kind == "extra" or not isinstance(first.ref, TensorRef):
        if isinstance(first.ref, TensorRef):
            return TensorPlan(chunk, key, first.ref.shape, first.ref.dtype, [CopyOp(first.shard, first.ref, None, None)],
                              gkey=entry.key)
        return TensorPlan(chunk, key, None, None, [], value=first.ref, gkey=entry.key)
    ref: TensorRef = first.ref
    if rule.dim is None:  # replicated
        return TensorPlan(chunk, key, ref.shape, ref.dtype, [CopyOp(first.shard, ref, None, None)], gkey=entry.key)
    dim = rule.dim
    t_rank, t_size = (coords["etp"], tgt.etp_eff) if rule.group == "etp" else (coords["tp"], tgt.tp)
    g_len = entry.global_len()
    assert g_len is not None
    if rule.kind == "vocab":
        t_global = target_padded_vocab or g_len
    else:
        t_global = g_len
    if t_global % t_size or (rule.kind == "glu" and (t_global // 2) % t_size):
        raise PreflightError(f"tensor {key}: {t_global} rows along dim {dim} do not split over {t_size} ranks",
                             code="layout")
    shape = list(ref.shape)
    shape[dim] = t_global // t_size
    ops: list[CopyOp] = []
    covered = 0
    t_rule = rule if rule.kind != "vocab" else Rule("column", rule.group)
    s_rule = t_rule
    for tg, tn, tl in segments(t_rule, t_global, t_size, t_rank):
        for piece in entry.pieces.values():
            for sg, sn, sl in segments(s_rule, g_len, piece.group_size, piece.group_rank):
                lo, hi = max(tg, sg), min(tg + tn, sg + sn)
                if lo >= hi:
                    continue
                ops.append(CopyOp(piece.shard, piece.ref, (dim, sl + lo - sg, hi - lo), (dim, tl + lo - tg, hi - lo)))
                covered += hi - lo
    return TensorPlan(chunk, key, tuple(shape), ref.dtype, ops, zero_fill=covered < shape[dim], gkey=entry.key)


def rewrite_args(args: Any, tgt: Topology, padded_vocab: int | None) -> Any:
    """The saved args, rewritten to the target layout (what Megatron's check_checkpoint_args compares)."""
    if args is None:
        return None
    new = argparse.Namespace(**vars(args))
    new.tensor_model_parallel_size = tgt.tp
    new.pipeline_model_parallel_size = tgt.pp
    new.expert_model_parallel_size = tgt.ep
    new.expert_tensor_parallel_size = tgt.etp_eff
    new.virtual_pipeline_model_parallel_size = tgt.vpp
    if hasattr(new, "num_layers_per_virtual_pipeline_stage") or tgt.vpp:
        new.num_layers_per_virtual_pipeline_stage = (tgt.num_layers // (tgt.pp * tgt.vpp)) if tgt.vpp else None
    if hasattr(new, "num_virtual_stages_per_pipeline_rank"):
        new.num_virtual_stages_per_pipeline_rank = None
    new.decoder_first_pipeline_num_layers = tgt.first_stage_layers
    new.decoder_last_pipeline_num_layers = tgt.last_stage_layers
    for name, value in (("account_for_embedding_in_pipeline_split", tgt.embedding_in_split),
                        ("account_for_loss_in_pipeline_split", tgt.loss_in_split)):
        if hasattr(new, name) or value:
            setattr(new, name, value)
    if padded_vocab is not None:
        new.padded_vocab_size = padded_vocab
    world = tgt.sizes.min_world()
    if hasattr(new, "world_size"):
        new.world_size = world
    if hasattr(new, "data_parallel_size"):
        new.data_parallel_size = world // (tgt.tp * tgt.pp * tgt.cp)
    for name in ("tensor_parallel_num_weight_shards", "expert_tensor_parallel_num_weight_shards"):
        if hasattr(new, name):
            setattr(new, name, tgt.tp if name.startswith("tensor") else tgt.etp_eff)
    return new

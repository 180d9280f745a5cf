"""Plan a target rank's state dict from the index: which source pieces, which slices, where they go.

For each tensor the target rank owns, its target segments are intersected with the source segments. Nothing is read
here but metadata, so planning any layout is instant.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import OrderedDict
from typing import Any

from megatron_preflight.errors import PreflightError
from megatron_preflight.layout import naming
from megatron_preflight.layout.model import Format, Layout
from megatron_preflight.parallel import VOCAB_DIVISOR, ParallelLayout, pad_vocab
from megatron_preflight.reshard.plan.index import EMBEDDING
from megatron_preflight.reshard.plan.rules import Rule, mtp_index, mtp_place, segments
from megatron_preflight.reshard.plan.topology import saved_arg
from megatron_preflight.reshard.plan.types import (
    CopyOp,
    GlobalEntry,
    GlobalKey,
    RankPlan,
    TensorPlan,
    VocabPlan,
)
from megatron_preflight.torch_file import TensorRef


def target_vocab(layout: Layout, tgt: ParallelLayout, padded_vocab_size: int | None, vocab_size: int | None,
                 divisible_by: int | None, source_padded: int) -> VocabPlan:
    """The vocab rows at the target (Megatron's padding rule), from the true vocab size when it is known. The target
    never has fewer rows than the real vocab: real rows are never cut."""
    args = layout.saved_args
    if layout.format == Format.HF and padded_vocab_size:
        # a Hugging Face model's rows are all its vocab, and the run pads from its tokenizer's size: rows past the
        # run's padded vocab are ids its tokenizer never produces (dropped); the rest are the model's, copied
        target = int(padded_vocab_size)
        return VocabPlan(min(source_padded, target), source_padded, target)
    div = divisible_by or int(saved_arg(args, "make_vocab_size_divisible_by", VOCAB_DIVISOR) or VOCAB_DIVISOR)
    true = vocab_size or saved_arg(args, "vocab_size")
    real = int(true) if true else source_padded
    if true and int(true) > source_padded:
        raise PreflightError(f"the vocab size {true} is larger than the checkpoint's {source_padded} embedding rows",
                             path=layout.iter_dir, fix="pass the vocab size of the tokenizer the checkpoint was "
                             "trained with (--vocab-size)", code="usage")
    if padded_vocab_size:
        target = int(padded_vocab_size)
    elif true:
        target = pad_vocab(int(true), div, tgt.tp)
    else:
        m, src_m = div * tgt.tp, div * (layout.tp or 1)
        if m % src_m:
            raise PreflightError(
                f"the checkpoint does not record its true vocab size (padded_vocab_size={source_padded} at "
                f"TP{layout.tp}), so the padded vocab at TP{tgt.tp} is ambiguous", path=layout.iter_dir,
                fix="pass --vocab-size (the tokenizer's vocab size) or --padded-vocab-size", code="usage")
        target = pad_vocab(source_padded, div, tgt.tp)  # a coarser multiple of the padded size: same as from true
    if target < real:
        raise PreflightError(
            f"a padded vocab of {target} rows would cut real vocabulary rows (the checkpoint has {real}"
            f"{' real' if true else ''} rows)", path=layout.iter_dir,
            fix=f"pass a --padded-vocab-size of at least {real}, a multiple of {div} x TP (or leave it out)",
            code="usage")
    most = max(source_padded, pad_vocab(real, div, tgt.tp))
    if target > most:  # refused by arithmetic before anything is planned or allocated
        raise PreflightError(
            f"a padded vocab of {target:,} rows is more than the checkpoint's {source_padded:,} rows and more than "
            f"Megatron builds for {real:,} vocabulary rows at TP{tgt.tp} (make-vocab-size-divisible-by {div}: "
            f"{pad_vocab(real, div, tgt.tp):,} rows); the run could not load it", path=layout.iter_dir,
            fix=f"leave --padded-vocab-size out (it follows the target TP), or pass at most {most} (to pad further, "
                "give the new run's --make-vocab-size-divisible-by after --)", code="usage")
    return VocabPlan(real, source_padded, target, None if padded_vocab_size else div)


Groups = dict[int | None, dict[int | None, list[tuple[GlobalKey, GlobalEntry]]]]


def by_layer(index: OrderedDict[GlobalKey, GlobalEntry]) -> Groups:
    """The index's entries by global layer (None: the embedding, final norm, MTP and head), then by global expert
    (None: not an expert's), each group in index order: a rank plans its own stage's layers and its own experts, not
    every entry of the model (a DeepSeek-V3 at PP16 EP64: 1/16 of its layers' 31k entries per rank, 4 of each layer's
    256 experts). The resharder makes it once per index (:meth:`~megatron_preflight.reshard.resharder.Resharder._plan`)."""
    groups: Groups = {}
    for gkey, entry in index.items():
        groups.setdefault(gkey[0], {}).setdefault(gkey[1], []).append((gkey, entry))
    return groups


def plan_rank(index: OrderedDict[GlobalKey, GlobalEntry], src: ParallelLayout, tgt: ParallelLayout,
              coords: dict[str, int], *, tied: bool, vocab: VocabPlan | None, shard_name: str = "",
              mtp: bool = False, groups: Groups | None = None) -> RankPlan:
    """The plan for the target rank at ``coords`` (its tp, pp, ep, etp ranks; ``mtp``: the model has MTP layers);
    see :func:`validate_plan`. ``groups``: :func:`by_layer` of ``index``, when the caller keeps it."""
    stage, ep_rank = coords["pp"], coords["ep"]
    chunk_names = ["model"] if tgt.chunks == 1 else [f"model{v}" for v in range(tgt.chunks)]
    tensors: list[tuple[tuple, TensorPlan]] = []
    own = _own_extra_state(src, tgt, coords)
    last = tgt.pp - 1
    # MTP layers run on the last stage, which then builds its own embedding too (its input is the next token's)
    mtp_embedding = mtp and last > 0 and stage == last
    groups = by_layer(index) if groups is None else groups
    placed = {layer: tgt.place_layer(layer) for layer in groups if layer is not None}
    experts: dict[int, tuple[int, int]] = {}  # global expert -> (its EP rank, its local index), asked once each
    here = []  # this stage's layers and the model's other entries; of experts, this rank's only
    for layer, by_expert in groups.items():
        if layer is not None and placed[layer][0] != stage:
            continue
        for e, items in by_expert.items():
            if e is not None:
                at = experts.get(e)
                if at is None:
                    at = experts[e] = tgt.place_expert(e)
                if at[0] != ep_rank:
                    continue
            here += items
    for gkey, entry in here:
        layer, expert, _style, suffix = gkey
        if layer is not None:
            _, chunk, local = placed[layer]
            section = 1
        else:
            local = None
            if suffix.startswith("embedding."):
                if stage != 0 and not mtp_embedding:
                    continue
                chunk, section = (0 if stage == 0 else tgt.chunks - 1), 0
            elif suffix.startswith("decoder.final_"):
                if stage != last:
                    continue
                chunk, section = tgt.chunks - 1, 2
            elif mtp_index(suffix) is not None:  # Megatron's module order: decoder, MTP layers, output layer
                if stage != last:
                    continue
                chunk, section = tgt.chunks - 1, 3
                local = mtp_place(suffix)
            elif suffix.startswith("output_layer."):
                if stage != last:
                    continue
                chunk, section = tgt.chunks - 1, 4
            else:
                raise PreflightError(f"no placement rule for non-layer key {suffix}", code="unknown_key")
        local_expert = None if expert is None else experts[expert][1]
        key = entry.info.render(local, local_expert)
        if entry.rule.kind == "extra" and own is not None:
            entry = own(entry)
        # Megatron's module order: chunk, then embedding / layers / head, then the key's place in its layer.
        order = (chunk, section, local or 0, entry.order[0], local_expert or 0, entry.order[1])
        tensors.append((order, plan_tensor(entry, chunk_names[chunk], key, coords, tgt, vocab)))
    tensors.sort(key=lambda item: item[0])
    out = [t for _, t in tensors]
    if tied and tgt.pp > 1 and stage == tgt.pp - 1 and EMBEDDING in index:
        # The last stage holds its own copy of the tied word embeddings as output_layer.weight (a parameter: it
        # comes before the head's _extra_state, as in the module's state dict).
        head = plan_tensor(index[EMBEDDING], chunk_names[-1], "output_layer.weight", coords, tgt, vocab)
        at = next((i for i, t in enumerate(out) if t.chunk == head.chunk and t.key == "output_layer._extra_state"),
                  len(out))
        out.insert(at, head)
    return RankPlan(coords, shard_name, chunk_names, out)


def _own_extra_state(src: ParallelLayout, tgt: ParallelLayout, coords: dict[str, int]) -> Any:
    """Extra state (TE's FP8 scales and amax history, per module and rank) follows its tensor's slice: when the
    target rank holds the same TP (ETP for experts) slice as a source rank, it gets that rank's own extra state, as
    Megatron's legacy save and load keep it; when the tensor is re-split, TP rank 0's (the main replica), which is
    what Megatron's own torch_dist reshard gives every rank (it saves a TE extra state once, replica_id keyed by TP
    rank and DP rank). None: no rank keeps its slice."""
    dense, expert = src.tp == tgt.tp, src.etp_eff == tgt.etp_eff
    if not (dense or expert):
        return None
    ranks = {name: c for name, c in naming.shard_writers(src).items()}

    def pick(entry: GlobalEntry) -> GlobalEntry:
        is_expert = entry.key.expert is not None or entry.key.suffix.startswith("mlp.experts.")
        if not (expert if is_expert else dense):
            return entry
        axis = "etp" if is_expert else "tp"
        pieces = [p for ps in entry.pieces.values() for p in ps]
        mine = [p for p in pieces if ranks.get(p.shard, {}).get(axis) == coords[axis]]
        if not mine or mine[0] is pieces[0]:
            return entry
        return dataclasses.replace(entry, pieces={0: mine + [p for p in pieces if p not in mine]})

    return pick


def plan_tensor(entry: GlobalEntry, chunk: str, key: str, coords: dict[str, int], tgt: ParallelLayout,
                vocab: VocabPlan | None) -> TensorPlan:
    """The copy ops that build the target rank's piece of ``entry``: its target segments along the split dim,
    intersected with every source piece's segments."""
    rule = entry.rule
    main_rank = min(entry.pieces)
    first = entry.main(main_rank)
    if rule.kind == "extra" or not isinstance(first.ref, TensorRef) or rule.dim is None:
        if isinstance(first.ref, TensorRef):  # replicated (or TE extra state held as a tensor): one whole copy
            # a TE extra state is per rank (FP8 scales from each rank's own amax): its copies are not replicas that
            # must agree
            replicas = () if rule.kind == "extra" else entry.replicas(main_rank)
            op = CopyOp(first.shard, first.ref, None, None, replicas)
            return TensorPlan(chunk, key, tuple(first.ref.shape), first.ref.dtype, [op], gkey=entry.key)
        return TensorPlan(chunk, key, None, None, [], value=first.ref, gkey=entry.key)
    ref: TensorRef = first.ref
    dim = rule.dim
    t_rank, t_size = (coords["etp"], tgt.etp_eff) if rule.group == "etp" else (coords["tp"], tgt.tp)
    g_len = entry.global_len()
    assert g_len is not None
    t_global, real = g_len, g_len
    if rule.kind == "vocab" and vocab is not None:
        t_global, real = vocab.target_padded, vocab.real
    if t_global % t_size or (rule.kind == "glu" and (t_global // 2) % t_size) or any(p % t_size for p in rule.parts):
        raise PreflightError(f"tensor {key}: {t_global} rows along dim {dim} do not split over {t_size} ranks",
                             code="layout")
    shape = list(ref.shape)
    shape[dim] = t_global // t_size
    ops: list[CopyOp] = []
    gaps: list[tuple[int, int]] = []
    pad_from = None
    t_rule = rule if rule.kind != "vocab" else Rule("column", rule.group)
    for tg, tn, tl in segments(t_rule, t_global, t_size, t_rank):
        covered: list[tuple[int, int]] = []
        for grank in sorted(entry.pieces):
            piece = entry.pieces[grank][0]
            for sg, sn, sl in segments(t_rule, g_len, piece.group_size, piece.group_rank):
                lo, hi = max(tg, sg), min(tg + tn, sg + sn)
                if lo >= hi:
                    continue
                ops.append(CopyOp(piece.shard, piece.ref, (dim, sl + lo - sg, hi - lo), (dim, tl + lo - tg, hi - lo),
                                  entry.replicas(grank)))
                covered.append((lo, hi))
        pos = tg
        for lo, hi in sorted(covered):
            if lo > pos:
                gaps.append((tl + pos - tg, lo - pos))
            pos = max(pos, hi)
        if pos < tg + tn:
            gaps.append((tl + pos - tg, tg + tn - pos))
        if rule.kind == "vocab":
            pad_from = tl + max(0, min(real, tg + tn) - tg)
    return TensorPlan(chunk, key, tuple(shape), ref.dtype, ops, zero_fill=tuple(gaps), pad_from=pad_from,
                      gkey=entry.key)


def rewrite_args(args: Any, tgt: ParallelLayout, padded_vocab: int | None,
                 distributed_optimizer: bool | None = None) -> Any:
    """The saved args, rewritten to the target layout (what Megatron's check_checkpoint_args compares)."""
    if args is None:
        return None
    new = argparse.Namespace(**vars(args))
    sizes = tgt.to_args()  # the one translation of a layout into Megatron args
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                 "expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size",
                 "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        setattr(new, name, sizes[name])
    for name in ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
                 "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
                 "pipeline_model_parallel_layout"):
        if hasattr(new, name) or sizes[name]:  # flags the saving Megatron-LM had, or ones the target needs
            setattr(new, name, sizes[name])
    if tgt.hybrid_pattern is not None:  # the layers' pipeline cuts (Megatron derives num_layers and VPP from it)
        new.hybrid_layer_pattern = tgt.hybrid_pattern
        new.num_layers = tgt.num_layers  # (a GPT checkpoint's layers are two hybrid layers each)
        if getattr(new, "hybrid_override_pattern", None):
            new.hybrid_override_pattern = tgt.hybrid_pattern
    if padded_vocab is not None:
        new.padded_vocab_size = padded_vocab
    if distributed_optimizer is not None:
        new.use_distributed_optimizer = distributed_optimizer
    if getattr(new, "use_megatron_fsdp", False):  # (a Megatron-FSDP source: what is written is 3D-parallel)
        new.use_megatron_fsdp = False
    world = tgt.min_world()
    if hasattr(new, "world_size"):
        new.world_size = world
    if hasattr(new, "data_parallel_size"):
        new.data_parallel_size = world // (tgt.tp * tgt.pp * tgt.cp)
    for name in ("tensor_parallel_num_weight_shards", "expert_tensor_parallel_num_weight_shards"):
        if hasattr(new, name):
            setattr(new, name, tgt.tp if name.startswith("tensor") else tgt.etp_eff)
    return new

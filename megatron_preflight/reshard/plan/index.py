"""The global index of a checkpoint: every global tensor and every source piece that holds it."""

from __future__ import annotations

import itertools
import operator
from collections import OrderedDict
from typing import Any

from megatron_preflight import parallel
from megatron_preflight.layout import naming
from megatron_preflight.layout.model import Layout
from megatron_preflight.parallel import ParallelLayout
from megatron_preflight.reshard.plan import sections
from megatron_preflight.reshard.plan.consistency import complete_problems, raise_first
from megatron_preflight.reshard.plan.rules import KeyInfo, mtp_index, parse_key, rule_for
from megatron_preflight.reshard.plan.spec import unpack_legacy_grouped
from megatron_preflight.reshard.plan.topology import is_tied, model_chunks, saved_arg
from megatron_preflight.reshard.plan.types import GlobalEntry, GlobalKey, SourceKey, SourcePiece
from megatron_preflight.torch_file import TensorRef


def _layer_orders(keys: list[str]) -> dict[str, tuple[int, int]]:
    """Each key's place inside its layer, as (slot, sub-slot) independent of the local expert index: Megatron's
    module order, read from the source. Sequential experts form one block (expert-major inside it); TE-grouped
    expert weights sort by name, then expert."""
    out: dict[str, tuple[int, int]] = {}
    first: dict[tuple[int | None, str, str, str], int] = {}
    block: dict[tuple[int | None, str], int] = {}
    pos: dict[tuple[int | None, str], int] = {}
    for key in keys:
        info = parse_key(key)
        layer = (info.layer, info.head)  # a decoder layer, an MTP layer's transformer layer, or neither
        p = pos[layer] = pos.get(layer, -1) + 1
        slot = first.setdefault((*layer, info.style, info.suffix), p)
        if info.style in ("seq_expert", "legacy_grouped"):  # GroupedMLP's weight1, weight2: one expert block
            start = block.setdefault(layer, p)
            out[key] = (start, slot - start)
        else:
            out[key] = (slot, 0)
    return out


def iter_source_keys(layout: Layout, src: ParallelLayout) -> Any:
    """Every model-chunk entry of every source shard, with its global key and split group coordinates. The legacy
    GroupedMLP's packed expert weights are unpacked into each expert's linear."""
    swiglu = parallel.gated_mlp(layout.saved_args)
    num_local = (saved_arg(layout.saved_args, "num_experts", 0) or 0) // max(src.ep, 1)
    dirs = naming.shard_writers(src)
    shards = sorted(layout.shards, key=lambda s: (s.pp_rank or 0, s.tp_rank or 0, s.ep_rank or 0))
    for shard in shards:
        coords = dirs.get(shard.name)
        if coords is None or shard.meta is None:
            continue
        for chunk_idx, ck in model_chunks(shard.meta):
            orders = _layer_orders(list(shard.meta[ck]))
            layers: dict[int, int] = {}
            experts: dict[int, int] = {}
            etp, tp = (coords["etp"], src.etp_eff), (coords["tp"], src.tp)
            for key, value in shard.meta[ck].items():
                info = parse_key(key)
                if info.style == "legacy_grouped":
                    for j, (suffix, view) in enumerate(unpack_legacy_grouped(info.suffix, value, num_local,
                                                                             f"{shard.name}: {key}")):
                        expert_info = KeyInfo(info.layer, j, suffix, "seq_expert")
                        rule = rule_for(expert_info, swiglu=swiglu)
                        layer = src.global_layer(coords["pp"], chunk_idx, info.layer)
                        gkey = GlobalKey(layer, src.global_expert(coords["ep"], j), "seq_expert", suffix)
                        yield SourceKey(shard.name, chunk_idx, key, view, expert_info, rule, gkey, coords["etp"],
                                        src.etp_eff, orders[key])
                    continue
                rule = rule_for(info, swiglu=swiglu)
                layer = info.layer
                if layer is not None:  # (asked once per local layer and expert: they recur in every key of them)
                    layer = layers.get(layer)
                    if layer is None:
                        layer = layers[info.layer] = src.global_layer(coords["pp"], chunk_idx, info.layer)
                expert = info.expert
                if expert is not None:
                    expert = experts.get(expert)
                    if expert is None:
                        expert = experts[info.expert] = src.global_expert(coords["ep"], info.expert)
                if rule.dim is None:  # replicated: every holder is a replica of one piece
                    grank, gsize = 0, 1
                elif rule.group == "etp":
                    grank, gsize = etp
                else:
                    grank, gsize = tp
                # (the tuples made directly: their classes' __new__ is a Python call, 62k keys in a DeepSeek-V3)
                yield _new(SourceKey, (shard.name, chunk_idx, key, value, info, rule,
                                       _new(GlobalKey, (layer, expert, info.style, info.global_suffix)), grank, gsize,
                                       orders[key]))


_new = tuple.__new__
_SUFFIX = operator.attrgetter("suffix")

GlobalIndex = OrderedDict[GlobalKey, GlobalEntry]  # every global tensor of a checkpoint, in model order
EMBEDDING = GlobalKey(None, None, "plain", "embedding.word_embeddings.weight")


VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias")


def index_sources(layout: Layout, src: ParallelLayout, *, check: bool = True
                  ) -> GlobalIndex:
    """Every global tensor of the checkpoint and every source piece that holds it (replicas included: the same piece
    on several shards, e.g. a layernorm on every TP rank or a dense weight on every EP rank; with tied embeddings, the
    last stage's ``output_layer.weight`` is a replica of the word embeddings)."""
    tied = is_tied(layout)
    index: OrderedDict[GlobalKey, GlobalEntry] = OrderedDict()
    head_copies: list[SourceKey] = []
    for sk in iter_source_keys(layout, src):
        if tied and sk.key == "output_layer.weight":
            head_copies.append(sk)  # the tied copy of the word embeddings: served from the embedding
            continue
        entry = index.get(sk.gkey)
        if entry is None:
            order = sk.order if sk.info.layer is not None or sk.info.head else (len(index), 0)
            entry = index[sk.gkey] = GlobalEntry(sk.gkey, sk.info, sk.rule, order=order)
        entry.add(SourcePiece(sk.shard, sk.value, sk.group_rank, sk.group_size))
    # with MTP on the last stage, the stage's own word embedding is the tied weight (its output layer is handed it
    # in forward): its output_layer.weight is a parameter Megatron never uses, left at its init, not a replica
    if EMBEDDING in index and not has_mtp(index):
        for sk in head_copies:
            if isinstance(sk.value, TensorRef) and sk.value.shape == index[EMBEDDING].first().ref.shape:
                index[EMBEDDING].add(SourcePiece(sk.shard, sk.value, sk.group_rank, sk.group_size))
    sections.resolve(index, layout.saved_args, layout.iter_dir)
    if check:
        raise_first(complete_problems(index, layout))
    return index


def has_mtp(index: GlobalIndex) -> bool:
    """Whether the model has multi-token prediction layers."""
    if not any(map(str.startswith, map(_SUFFIX, index), itertools.repeat("mtp.layers."))):  # (C speed: 62k keys)
        return False
    return any(k.suffix.startswith("mtp.layers.") and mtp_index(k.suffix) is not None for k in index)


def has_legacy_grouped(layout: Layout) -> bool:
    """Whether the checkpoint holds the legacy GroupedMLP's packed expert weights (``experts.weight1``)."""
    for shard in layout.shards:
        for _chunk, ck in model_chunks(shard.meta or {}):
            if any(parse_key(k).style == "legacy_grouped" for k in shard.meta[ck]):
                return True
    return False

"""Plan a target rank's state dict from the on-disk shards: which source tensors, which slices, where they go.

Every local tensor is a piece of a *global* tensor (as in megatron-core's ShardedTensor: a global shape, and an
offset along the split dim). The planner indexes the source pieces by global key, then for each tensor the target
rank owns, intersects its target segments with the source segments. The plan is data; nothing is read here but
metadata, so planning any layout is instant.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from megatron_preflight.errors import PreflightError
from megatron_preflight.layout.model import Layout
from megatron_preflight.parallel import ParallelLayout, pad_vocab
from megatron_preflight.reshard.rules import KeyInfo, Rule, parse_key, rule_for, segments
from megatron_preflight.torch_file import TensorRef


class GlobalKey(NamedTuple):
    """A global tensor of the model: its global layer and expert (None outside layers / experts), key style and the
    parameter name after the layer / expert prefix."""

    layer: int | None
    expert: int | None
    style: str
    suffix: str


class PlanError(PreflightError):
    """A plan that does not tile its target exactly, or whose sources disagree: nothing is written."""

    def __init__(self, message: str, path: str | None = None, fix: str | None = None) -> None:
        super().__init__(message, path=path, fix=fix or "this is a bug in megatron-preflight or a damaged checkpoint; "
                         "run `megatron-preflight inspect` on the source and report the message", code="plan")


@dataclass
class SourcePiece:
    shard: str
    ref: Any  # TensorRef, or a plain value (extra state)
    group_rank: int
    group_size: int


def _by_shard(p: SourcePiece) -> str:
    return p.shard


@dataclass
class GlobalEntry:
    """One global tensor and every source piece of it: per rank of its split group, the piece held by each source
    shard (replicas: the same piece on several shards; the main one first, by shard name)."""

    key: GlobalKey
    info: KeyInfo
    rule: Rule
    pieces: dict[int, list[SourcePiece]] = field(default_factory=dict)
    order: tuple[int, int] = (0, 0)  # where the key sits in its layer (or section), as Megatron's modules order it

    def add(self, piece: SourcePiece) -> None:
        # kept in shard-name order as pieces arrive (a layernorm has one replica per TP x EP rank: sorting the whole
        # list on every arrival was quadratic in them)
        bisect.insort(self.pieces.setdefault(piece.group_rank, []), piece, key=_by_shard)

    def main(self, group_rank: int) -> SourcePiece:
        return self.pieces[group_rank][0]

    def first(self) -> SourcePiece:
        return self.pieces[min(self.pieces)][0]

    def global_len(self) -> int | None:
        """Length of the global tensor along the split dim (None for replicated / extra)."""
        if self.rule.dim is None:
            return None
        piece = self.first()
        return piece.ref.shape[self.rule.dim] * piece.group_size


@dataclass(frozen=True)
class CopyOp:
    shard: str
    ref: TensorRef
    src: tuple[int, int, int] | None  # (dim, start, length) in the source tensor; None = whole tensor
    dst: tuple[int, int, int] | None  # (dim, start, length) in the target tensor
    replicas: tuple[tuple[str, TensorRef], ...] = ()  # other shards holding the same source tensor (must agree)


@dataclass
class TensorPlan:
    chunk: str  # "model" or "model{v}"
    key: str
    shape: tuple[int, ...] | None  # None for non-tensor values
    dtype: Any
    ops: list[CopyOp]
    value: Any = None  # non-tensor value (extra state)
    # (start, length) runs along the split dim that no op covers and that are made zeros: only re-made vocab
    # padding, at or after ``pad_from`` (a local row index; None: no row may be zero-filled)
    zero_fill: tuple[tuple[int, int], ...] = ()
    pad_from: int | None = None
    gkey: GlobalKey | None = None  # the global tensor this is a piece of (None: not a model tensor)


@dataclass(frozen=True)
class VocabPlan:
    """The vocab rows of the embedding / output layer: ``real`` rows must be carried (the true vocab, or every source
    row when the true vocab is unknown); rows from ``real`` on are padding."""

    real: int
    source_padded: int
    target_padded: int


@dataclass
class RankPlan:
    coords: dict[str, int]
    shard_name: str
    chunks: list[str]
    tensors: list[TensorPlan]
    optimizer: Any = None  # the optimizer state tree (TensorPlan leaves), when it is resharded
    dist_optimizer: Any = None  # a distributed optimizer's distrib_optim.pt (FlatPlan world tensors)

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


def source_topology(layout: Layout) -> ParallelLayout:
    """The source's parallel layout, completed from its shards: layer and expert counts when the args lack them, and
    the layers each (chunk, stage) actually holds."""
    base = layout.parallel or ParallelLayout(tp=layout.tp or 1, pp=layout.pp or 1, ep=layout.ep or 1,
                                             etp=layout.etp, vpp=layout.vpp, cp=layout.cp or 1)
    topo = dataclasses.replace(base, num_layers=base.num_layers or _count_layers(layout),
                               num_experts=base.num_experts or _count_experts(layout))
    observed = _observed_layer_counts(layout, topo)
    return dataclasses.replace(topo, observed=observed) if observed is not None else topo


def _observed_layer_counts(layout: Layout, topo: ParallelLayout) -> tuple[tuple[int, ...], ...] | None:
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


def iter_source_keys(layout: Layout, src: ParallelLayout) -> Any:
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
                if rule.dim is None:  # replicated: every holder is a replica of one piece
                    grank, gsize = 0, 1
                elif rule.group == "etp":
                    grank, gsize = coords["etp"], src.etp_eff
                else:
                    grank, gsize = coords["tp"], src.tp
                yield SourceKey(shard.name, chunk_idx, key, value, info, rule, GlobalKey(layer, expert, info.style, info.suffix),
                                grank, gsize, orders[key])


EMBEDDING = GlobalKey(None, None, "plain", "embedding.word_embeddings.weight")
VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias")


def index_sources(layout: Layout, src: ParallelLayout, *, check: bool = True
                  ) -> OrderedDict[GlobalKey, GlobalEntry]:
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
            order = sk.order if sk.info.layer is not None else (len(index), 0)
            entry = index[sk.gkey] = GlobalEntry(sk.gkey, sk.info, sk.rule, order=order)
        entry.add(SourcePiece(sk.shard, sk.value, sk.group_rank, sk.group_size))
    if EMBEDDING in index:
        for sk in head_copies:
            if isinstance(sk.value, TensorRef) and sk.value.shape == index[EMBEDDING].first().ref.shape:
                index[EMBEDDING].add(SourcePiece(sk.shard, sk.value, sk.group_rank, sk.group_size))
    if check:
        from megatron_preflight.reshard.consistency import complete_problems, raise_first

        raise_first(complete_problems(index, layout))
    return index


def target_vocab(layout: Layout, tgt: ParallelLayout, padded_vocab_size: int | None, vocab_size: int | None,
                 divisible_by: int | None, source_padded: int) -> VocabPlan:
    """The vocab rows at the target (Megatron's padding rule), from the true vocab size when it is known. The target
    never has fewer rows than the real vocab: real rows are never cut."""
    args = layout.saved_args
    div = divisible_by or int(_arg(args, "make_vocab_size_divisible_by", 128) or 128)
    true = vocab_size or _arg(args, "vocab_size")
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
    return VocabPlan(real, source_padded, target)


def plan_rank(index: OrderedDict[GlobalKey, GlobalEntry], src: ParallelLayout, tgt: ParallelLayout,
              coords: dict[str, int], *, tied: bool, vocab: VocabPlan | None, shard_name: str = "") -> RankPlan:
    """The plan for the target rank at ``coords`` (its tp, pp, ep, etp ranks); see :func:`validate_plan`."""
    stage, ep_rank = coords["pp"], coords["ep"]
    chunk_names = ["model"] if tgt.chunks == 1 else [f"model{v}" for v in range(tgt.chunks)]
    tensors: list[tuple[tuple, TensorPlan]] = []
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


def _replicas(replicas: list[SourcePiece]) -> tuple[tuple[str, TensorRef], ...]:
    return tuple((p.shard, p.ref) for p in replicas[1:] if isinstance(p.ref, TensorRef))


def plan_tensor(entry: GlobalEntry, chunk: str, key: str, coords: dict[str, int], tgt: ParallelLayout,
                vocab: VocabPlan | None) -> TensorPlan:
    """The copy ops that build the target rank's piece of ``entry``: its target segments along the split dim,
    intersected with every source piece's segments."""
    rule = entry.rule
    main_rank = min(entry.pieces)
    first = entry.main(main_rank)
    if rule.kind == "extra" or not isinstance(first.ref, TensorRef) or rule.dim is None:
        if isinstance(first.ref, TensorRef):  # replicated (or TE extra state held as a tensor): one whole copy
            op = CopyOp(first.shard, first.ref, None, None, _replicas(entry.pieces[main_rank]))
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
    if t_global % t_size or (rule.kind == "glu" and (t_global // 2) % t_size):
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
            replicas = entry.pieces[grank]
            piece = replicas[0]
            for sg, sn, sl in segments(t_rule, g_len, piece.group_size, piece.group_rank):
                lo, hi = max(tg, sg), min(tg + tn, sg + sn)
                if lo >= hi:
                    continue
                ops.append(CopyOp(piece.shard, piece.ref, (dim, sl + lo - sg, hi - lo), (dim, tl + lo - tg, hi - lo),
                                  _replicas(replicas)))
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


def validate_plan(plan: RankPlan) -> None:
    """Prove the plan before any byte moves (as torch DCP validates a global plan): every target tensor is tiled
    exactly by its copy ops — whole-tensor copies of the same shape, or slices along one dim with no gap and no
    overlap, each the same shape at both ends and inside its source — and the only rows left to zeros are vocab
    padding at or after the real vocab. Raises :class:`PlanError` naming the tensor."""
    from megatron_preflight.reshard.tree import iter_leaves

    tensors = [(f"{tp.chunk}.{tp.key}", tp) for tp in plan.tensors]
    tensors += [(f"optimizer.{tp.key}", tp) for _, tp in iter_leaves(plan.optimizer) if isinstance(tp, TensorPlan)]
    if plan.dist_optimizer is not None:
        from megatron_preflight.reshard.dist_optimizer import flat_parts, validate_flat

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


def rewrite_args(args: Any, tgt: ParallelLayout, padded_vocab: int | None,
                 distributed_optimizer: bool | None = None) -> Any:
    """The saved args, rewritten to the target layout (what Megatron's check_checkpoint_args compares)."""
    if args is None:
        return None
    new = argparse.Namespace(**vars(args))
    new.tensor_model_parallel_size = tgt.tp
    new.pipeline_model_parallel_size = tgt.pp
    new.expert_model_parallel_size = tgt.ep
    new.expert_tensor_parallel_size = tgt.etp_eff
    new.virtual_pipeline_model_parallel_size = tgt.vpp
    for name, value in tgt.vpp_args().items():
        if hasattr(new, name) or value is not None:
            setattr(new, name, value)
    new.decoder_first_pipeline_num_layers = tgt.first_stage_layers
    new.decoder_last_pipeline_num_layers = tgt.last_stage_layers
    for name, value in (("account_for_embedding_in_pipeline_split", tgt.embedding_in_split),
                        ("account_for_loss_in_pipeline_split", tgt.loss_in_split)):
        if hasattr(new, name) or value:
            setattr(new, name, value)
    if padded_vocab is not None:
        new.padded_vocab_size = padded_vocab
    if distributed_optimizer is not None:
        new.use_distributed_optimizer = distributed_optimizer
    world = tgt.min_world()
    if hasattr(new, "world_size"):
        new.world_size = world
    if hasattr(new, "data_parallel_size"):
        new.data_parallel_size = world // (tgt.tp * tgt.pp * tgt.cp)
    for name in ("tensor_parallel_num_weight_shards", "expert_tensor_parallel_num_weight_shards"):
        if hasattr(new, name):
            setattr(new, name, tgt.tp if name.startswith("tensor") else tgt.etp_eff)
    return new

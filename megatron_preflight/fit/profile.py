"""A checkpoint's model as parameter counts by placement and split: what any layout puts on each rank, in O(layers).

Read from one shard per pipeline stage (TP rank 0, EP rank 0: what a sampled verdict parses) through the resharder's
own key parser and split-rule table (:mod:`~megatron_preflight.reshard.plan.rules`): every tensor's global size from
its local shape and its split, each layer's dense part (replicated, or split over TP), each expert's part (replicated,
or split over ETP; the experts of a layer are alike, so EP rank 0's stand for all), and the tensors outside the layers
by where Megatron places them (the embedding on the first stage and, with MTP, the last; the final norm, MTP layers
and the output layer on the last; with tied embeddings and PP > 1 the last stage's own copy of the word embeddings).
:meth:`ModelProfile.stage_numel` then gives the elements of each stage's rank at any layout, the same count as the
resharder's plan of that rank (``check``'s memory, :mod:`megatron_preflight.check.memory`): a test holds them equal.
TE extra states and the router's ``expert_bias`` (a buffer) are not parameters and are not counted.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from megatron_preflight import reshard  # its modules load on first use (a lazy package)
from megatron_preflight.errors import PreflightError
from megatron_preflight.layout import naming
from megatron_preflight.layout.model import Layout
from megatron_preflight.parallel import LayoutError, ParallelLayout
from megatron_preflight.torch_file import TensorRef

SKIPPED_SUFFIXES = ("_extra_state", "expert_bias")  # not parameters: no gradient, no optimizer state


@dataclass
class Part:
    """Parameter elements of a group of tensors, by how they split: ``whole`` (the same on every rank of the group),
    ``split`` (divided over TP, or ETP inside an expert), ``vocab_cols`` (tensors with one row per padded vocab entry,
    divided over TP: the elements per row) and ``gcd`` (the greatest common divisor of the split lengths: a TP or ETP
    size that does not divide it cannot hold the tensors)."""

    whole: int = 0
    split: int = 0
    vocab_cols: int = 0
    gcd: int = 0

    def add(self, numel: int, split_len: int | None, vocab: bool) -> None:
        if vocab:
            self.vocab_cols += numel // max(split_len or 1, 1)
        elif split_len is None:
            self.whole += numel
        else:
            self.split += numel
            self.gcd = math.gcd(self.gcd, split_len)

    def on_rank(self, size: int, vocab_rows: int = 0) -> int:
        return self.whole + self.split // size + self.vocab_cols * (vocab_rows // size)


@dataclass
class Block:
    """A decoder layer, or the tensors outside the layers that sit together: its dense part and its experts."""

    dense: Part = field(default_factory=Part)
    expert: Part = field(default_factory=Part)  # one expert's tensors (the layer's experts are alike)
    experts: int = 0  # experts in this block (0: no MoE)

    def on_rank(self, tp: int, ep: int, etp: int, vocab_rows: int = 0) -> int:
        n = self.dense.on_rank(tp, vocab_rows)
        if self.experts:
            n += (self.experts // ep) * self.expert.on_rank(etp)
        return n

    def expert_on_rank(self, ep: int, etp: int) -> int:
        return (self.experts // ep) * self.expert.on_rank(etp) if self.experts else 0


@dataclass
class ModelProfile:
    """The model's parameters by placement (see the module doc)."""

    layers: list[Block]  # by global decoder layer
    first: Block  # on the first stage: the embedding
    last: Block  # on the last stage: final norm, MTP layers, output layer
    tied: bool  # the output layer is the word embeddings (the last stage holds a copy when PP > 1)
    mtp: bool  # MTP layers: the last stage builds its own embedding too
    embedding: Part  # the word embeddings (vocab rows)
    source: ParallelLayout  # the checkpoint's layout (layer and expert counts, placement)
    padded_vocab: int  # the checkpoint's embedding rows
    _stage_memo: dict[Any, tuple[int, ...]] = field(default_factory=dict, repr=False, compare=False)
    _numel_memo: dict[Any, list[tuple[int, int]]] = field(default_factory=dict, repr=False, compare=False)
    _first_memo: dict[tuple[int, ...], tuple[int, int]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def moe_layers(self) -> set[int]:
        return {i for i, b in enumerate(self.layers) if b.experts}

    def tp_gcd(self) -> int:
        """Every TP size must divide this (0: no TP-split tensor)."""
        g = 0
        for b in (*self.layers, self.first, self.last):
            g = math.gcd(g, b.dense.gcd)
        return g

    def etp_gcd(self) -> int:
        g = 0
        for b in (*self.layers, self.first, self.last):
            g = math.gcd(g, b.expert.gcd)
        return g

    def stage_numel(self, tgt: ParallelLayout, vocab_rows: int) -> list[tuple[int, int]]:
        """(dense, expert) parameter elements of one rank of each pipeline stage of ``tgt`` (every TP and EP rank of
        a stage holds as many), with ``vocab_rows`` padded vocabulary rows. Kept per placement and TP / EP / ETP
        size: the planner asks for thousands of layouts that differ only in DP or CP."""
        stages = self._stages(tgt)  # (raises LayoutError when the layout cannot hold the layers)
        tp, ep, etp, last = tgt.tp, tgt.ep, tgt.etp_eff, tgt.pp - 1
        key = (stages, tgt.pp, tp, ep, etp, vocab_rows)
        known = self._numel_memo.get(key)
        if known is not None:
            return known
        out = [[0, 0] for _ in range(tgt.pp)]
        for stage, block in zip(stages, self.layers):  # noqa: B905 - one stage per layer (see _stages)
            out[stage][0] += block.dense.on_rank(tp, vocab_rows)
            out[stage][1] += block.expert_on_rank(ep, etp)
        out[0][0] += self.first.dense.on_rank(tp, vocab_rows)
        if self.mtp and last > 0:  # the MTP layers' input embedding, on the last stage
            out[last][0] += self.first.dense.on_rank(tp, vocab_rows)
        out[last][0] += self.last.dense.on_rank(tp, vocab_rows)
        out[last][1] += self.last.expert_on_rank(ep, etp)
        if self.tied and last > 0:
            out[last][0] += self.embedding.on_rank(tp, vocab_rows)
        known = self._numel_memo[key] = [(d, x) for d, x in out]
        return known

    def layers_on_first_stage(self, tgt: ParallelLayout) -> tuple[int, int]:
        """(decoder layers, MoE layers) on the first pipeline stage of ``tgt``."""
        stages = self._stages(tgt)
        known = self._first_memo.get(stages)
        if known is None:
            on = [i for i, stage in enumerate(stages) if stage == 0]
            moe = self.moe_layers
            known = self._first_memo[stages] = (len(on), sum(1 for i in on if i in moe))
        return known

    def _stages(self, tgt: ParallelLayout) -> tuple[int, ...]:
        """The pipeline stage of each decoder layer at ``tgt`` (global layer order: Megatron numbers the layers
        chunk-major), from its layer counts."""
        counts = tgt.chunk_layer_counts()
        key = (tgt.pp, tuple(map(tuple, counts)))
        stages = self._stage_memo.get(key)
        if stages is None:
            stages = self._stage_memo[key] = tuple(p for row in counts for p, c in enumerate(row) for _ in range(c))
        if len(stages) < self.num_layers:
            raise LayoutError(f"{tgt.describe()} places {len(stages)} decoder layers, the model has "
                              f"{self.num_layers}", field="num_layers")
        return stages


def _sample(layout: Layout, src: ParallelLayout) -> Layout:
    """The layout with one parsed shard per pipeline stage (TP rank 0, EP rank 0)."""
    wanted = {naming.shard_dir_name(0, pp, 0, pp_size=src.pp, ep_size=src.ep) for pp in range(src.pp)}
    shards = [s for s in layout.shards if s.name in wanted and s.meta is not None]
    if {s.name for s in shards} != wanted:
        missing = sorted(wanted - {s.name for s in shards})
        raise PreflightError(f"the model's parameters are read from one shard per pipeline stage; "
                             f"{', '.join(missing)} could not be read", path=layout.iter_dir or layout.path,
                             fix="run `megatron-preflight inspect` on the checkpoint: it names what is missing or "
                                 "damaged", code="checkpoint")
    return dataclasses.replace(layout, shards=shards)


def profile(view: Layout) -> ModelProfile:
    """The model profile of a checkpoint's legacy view (a legacy layout, sampled or not; a torch_dist or
    fsdp_dtensor checkpoint's virtual one)."""
    src = reshard.source_topology(view)
    sample = _sample(view, src)
    num_experts = int(reshard.saved_arg(view.saved_args, "num_experts", 0) or src.num_experts or 0)
    layers = [Block() for _ in range(src.num_layers or 0)]
    first, last, embedding = Block(), Block(), Part()
    tied = reshard.is_tied(view)
    first_expert: dict[int | None, int] = {}  # block (a layer, or None: outside the layers) -> its first expert seen
    expert_parts: dict[int | None, Part] = {}
    mtp = padded = 0
    counted: set[Any] = set()
    for sk in reshard.iter_source_keys(sample, src):
        suffix = sk.gkey.suffix
        if not isinstance(sk.value, TensorRef) or suffix.endswith(SKIPPED_SUFFIXES) or sk.rule.kind == "extra":
            continue
        if tied and sk.key == "output_layer.weight":
            continue  # the last stage's copy of the tied word embeddings (counted from the embedding)
        if sk.gkey in counted:  # a replica (the MTP stage's own embedding)
            continue
        counted.add(sk.gkey)
        shape = list(sk.value.shape)
        dim = sk.rule.dim
        if dim is not None:
            shape[dim] *= sk.group_size
        numel = math.prod(shape)
        split_len = shape[dim] if dim is not None else None
        if sk.rule.kind == "glu":
            split_len = shape[dim] // 2
        vocab = sk.rule.kind == "vocab"
        if vocab:
            padded = shape[dim]
        layer, expert = sk.gkey.layer, sk.gkey.expert
        if layer is not None:
            block = layers[layer]
        elif suffix.startswith("embedding."):
            block = first
        else:
            block = last
            mtp = mtp or reshard.mtp_index(suffix) is not None
        if expert is not None:  # the block's first expert stands for each of its experts
            if first_expert.setdefault(layer, expert) == expert:
                expert_parts.setdefault(layer, Part()).add(numel, split_len, False)
            block.experts = num_experts
            continue
        block.dense.add(numel, split_len, vocab)
        if suffix == "embedding.word_embeddings.weight":
            embedding.add(numel, split_len, True)
    for key, part in expert_parts.items():
        (layers[key] if key is not None else last).expert = part
    return ModelProfile(layers, first, last, tied, bool(mtp), embedding, src, padded)


def profile_of(index: Any) -> ModelProfile:
    """The profile of a :class:`~megatron_preflight.reshard.CheckpointIndex` (its legacy view)."""
    return profile(index.view)

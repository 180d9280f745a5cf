"""The plan's data: global tensors and their source pieces, copy ops, tensor / flat-buffer / rank plans.

Every local tensor is a piece of a *global* tensor (as in megatron-core's ShardedTensor: a global shape, and an
offset along the split dim). Plans are data; nothing here reads a byte.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from megatron_preflight import dtypes
from megatron_preflight.errors import PreflightError
from megatron_preflight.reshard.plan.rules import KeyInfo, Rule
from megatron_preflight.torch_file import TensorRef
from megatron_preflight.tree import iter_leaves


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
    _replicas: dict[int, tuple[tuple[str, TensorRef], ...]] = field(default_factory=dict, init=False, repr=False,
                                                                    compare=False)

    def add(self, piece: SourcePiece) -> None:
        # kept in shard-name order as pieces arrive (a layernorm has one replica per TP x EP rank: sorting the whole
        # list on every arrival was quadratic in them)
        held = self.pieces.get(piece.group_rank)
        if held is None:  # (the first piece of a rank: most entries have one)
            self.pieces[piece.group_rank] = [piece]
            return
        bisect.insort(held, piece, key=_by_shard)
        self._replicas.pop(piece.group_rank, None)

    def replicas(self, group_rank: int) -> tuple[tuple[str, TensorRef], ...]:
        """(shard, ref) of every copy of ``group_rank``'s piece after the main one (tensors only), made once: every
        target rank's plan lists them (a DeepSeek-V3 layernorm has 64, planned for each of hundreds of ranks)."""
        found = self._replicas.get(group_rank)
        if found is None:
            found = self._replicas[group_rank] = tuple(
                (p.shard, p.ref) for p in self.pieces[group_rank][1:] if isinstance(p.ref, TensorRef))
        return found

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
    # an optimizer state's parameter (its plan): the state is laid out, split and placed in the global tensor as it is
    param: TensorPlan | None = None


@dataclass(frozen=True)
class VocabPlan:
    """The vocab rows of the embedding / output layer: ``real`` rows must be carried (the true vocab, or every source
    row when the true vocab is unknown); rows from ``real`` on are padding."""

    real: int
    source_padded: int
    target_padded: int
    divisor: int | None = None  # the --make-vocab-size-divisible-by the target was padded for (None: a size given)


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


class SourceKey(NamedTuple):  # (a tuple: a DeepSeek-V3's index is made of 62k of them)
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


@dataclass
class FlatPlan:
    """A 1-D fp32 world tensor of ``numel`` elements: each planned parameter state flattened at its offset, zeros
    between (the 64-element alignment padding)."""

    numel: int
    parts: list[tuple[int, TensorPlan]]
    key: str = ""
    dtype: Any = field(default_factory=lambda: dtypes.dtype("float32"))
    names: list[str] = field(default_factory=list)  # "chunk:key" of each part's parameter, in parts' order

    @property
    def shape(self) -> tuple[int]:
        return (self.numel,)


def planned(plan: RankPlan) -> Iterator[TensorPlan]:
    """Every TensorPlan of ``plan``: its model tensors, then the optimizer state's."""
    yield from plan.tensors
    for _, leaf in iter_leaves(plan.optimizer):
        if isinstance(leaf, TensorPlan):
            yield leaf


def flat_parts(tree: Any) -> list[tuple[tuple, FlatPlan]]:
    """(path, FlatPlan) for every world tensor inside a planned distrib_optim.pt."""
    return [(p, v) for p, v in iter_leaves(tree) if isinstance(v, FlatPlan)]

"""Where things live in a layout: global layer <-> (pp stage, virtual chunk, local index), experts per EP rank,
and the (tp, pp, ep, etp) coordinates of each shard dir."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from megatron_preflight.errors import PreflightError
from megatron_preflight.layout import naming


@dataclass(frozen=True)
class Topology:
    """A parallel layout of one model."""

    num_layers: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int | None = None
    first_stage_layers: int | None = None  # --decoder-first-pipeline-num-layers
    last_stage_layers: int | None = None  # --decoder-last-pipeline-num-layers
    num_experts: int | None = None
    cp: int = 1
    order: str = "tp-cp-ep-dp-pp"
    embedding_in_split: bool = False  # --account-for-embedding-in-pipeline-split
    loss_in_split: bool = False  # --account-for-loss-in-pipeline-split
    observed: tuple[tuple[int, ...], ...] | None = None  # [chunk][stage] layer counts read from the shards

    @property
    def etp_eff(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def chunks(self) -> int:
        return self.vpp or 1

    @property
    def sizes(self) -> naming.ParallelSizes:
        return naming.ParallelSizes(tp=self.tp, pp=self.pp, ep=self.ep, etp=self.etp, cp=self.cp, order=self.order)

    def _planned_stage_counts(self) -> list[int]:
        """Layers on each pipeline stage (Megatron's even split, or uneven first/last stages)."""
        first, last, pp, n = self.first_stage_layers, self.last_stage_layers, self.pp, self.num_layers
        if pp == 1:
            return [n]
        if first is None and last is None:
            if n % pp:
                raise PreflightError(f"{n} layers cannot be split evenly over PP{pp}",
                                     fix="set --decoder-first/last-pipeline-num-layers", code="layout")
            return [n // pp] * pp
        middle_stages = pp - (first is not None) - (last is not None)
        rest = n - (first or 0) - (last or 0)
        if rest < 0 or (middle_stages and rest % middle_stages) or (not middle_stages and rest):
            raise PreflightError(f"uneven stages first={first} last={last} do not split {n} layers over PP{pp}",
                                 code="layout")
        mid = rest // middle_stages if middle_stages else 0
        counts = [mid] * pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return counts

    def chunk_layer_counts(self) -> list[list[int]]:
        """Layers in each (virtual chunk, stage), ``[chunk][stage]``: as read from the shards when known (any scheme
        Megatron used), else Megatron's rules: an even split, uneven first/last stages, or the embedding / loss
        counted as a layer of the first / last stage (``--account-for-*-in-pipeline-split``)."""
        if self.observed is not None:
            return [list(row) for row in self.observed]
        v, pp, n = self.chunks, self.pp, self.num_layers
        if (self.embedding_in_split or self.loss_in_split) and pp > 1:
            total = n + self.embedding_in_split + self.loss_in_split
            if total % (pp * v):
                raise PreflightError(f"{n} layers plus the embedding/loss do not split over PP{pp}"
                                     + (f" x VPP{v}" if v > 1 else ""), code="layout")
            counts = [[total // (pp * v)] * pp for _ in range(v)]
            counts[0][0] -= self.embedding_in_split
            counts[-1][-1] -= self.loss_in_split
            return counts
        stages = self._planned_stage_counts()
        for p, c in enumerate(stages):
            if c % v:
                raise PreflightError(f"stage {p} has {c} layers, not divisible into {v} virtual chunks", code="layout")
        return [[c // v for c in stages] for _ in range(v)]

    def stage_layer_counts(self) -> list[int]:
        """Layers on each pipeline stage, all chunks together."""
        counts = self.chunk_layer_counts()
        return [sum(row[p] for row in counts) for p in range(self.pp)]

    @cached_property
    def _layer_table(self) -> dict[int, tuple[int, int, int]]:
        counts = self.chunk_layer_counts()
        table: dict[int, tuple[int, int, int]] = {}
        g = 0
        for chunk, row in enumerate(counts):  # Megatron numbers layers chunk-major: chunk 0 of every stage first
            for p, c in enumerate(row):
                for local in range(c):
                    table[g] = (p, chunk, local)
                    g += 1
        return table

    def place_layer(self, global_layer: int) -> tuple[int, int, int]:
        """(pp stage, virtual chunk, local index) of a global layer."""
        return self._layer_table[global_layer]

    @cached_property
    def _layer_index(self) -> dict[tuple[int, int, int], int]:
        return {v: k for k, v in self._layer_table.items()}

    def global_layer(self, stage: int, chunk: int, local: int) -> int:
        try:
            return self._layer_index[(stage, chunk, local)]
        except KeyError:
            raise PreflightError(f"local layer {local} of stage {stage} chunk {chunk} does not exist in a "
                                 f"{self.num_layers}-layer PP{self.pp} VPP{self.vpp} layout", code="layout") from None

    def experts_per_rank(self) -> int:
        if not self.num_experts:
            return 0
        if self.num_experts % self.ep:
            raise PreflightError(f"{self.num_experts} experts do not divide over EP{self.ep}", code="layout")
        return self.num_experts // self.ep

    def place_expert(self, global_expert: int) -> tuple[int, int]:
        """(ep rank, local index) of a global expert."""
        n = self.experts_per_rank()
        return global_expert // n, global_expert % n

    def global_expert(self, ep_rank: int, local: int) -> int:
        return ep_rank * self.experts_per_rank() + local

    def is_first_stage(self, stage: int, chunk: int) -> bool:
        return stage == 0 and chunk == 0

    def is_last_stage(self, stage: int, chunk: int) -> bool:
        return stage == self.pp - 1 and chunk == self.chunks - 1

    def shard_dirs(self) -> dict[str, dict[str, int]]:
        """Every shard dir this layout writes -> coordinates (tp, pp, ep, etp) of a rank that writes it."""
        return naming.shard_writers(self.sizes)

    def rank_coordinates(self, rank: int, world: int) -> dict[str, int]:
        return naming.rank_coordinates(rank, world, self.sizes)

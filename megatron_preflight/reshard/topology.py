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

    @property
    def etp_eff(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def chunks(self) -> int:
        return self.vpp or 1

    @property
    def sizes(self) -> naming.ParallelSizes:
        return naming.ParallelSizes(tp=self.tp, pp=self.pp, ep=self.ep, etp=self.etp, cp=self.cp, order=self.order)

    def stage_layer_counts(self) -> list[int]:
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

    @cached_property
    def _layer_table(self) -> dict[int, tuple[int, int, int]]:
        counts = self.stage_layer_counts()
        v = self.chunks
        for p, c in enumerate(counts):
            if c % v:
                raise PreflightError(f"stage {p} has {c} layers, not divisible into {v} virtual chunks", code="layout")
        table: dict[int, tuple[int, int, int]] = {}
        g = 0
        for chunk in range(v):
            for p, c in enumerate(counts):
                for local in range(c // v):
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

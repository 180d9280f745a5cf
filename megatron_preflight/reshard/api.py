"""Resharding API: a legacy checkpoint, read at any TP/PP/EP/ETP/VPP layout, one rank at a time.

``build_rank_state_dict(checkpoint, target, rank)`` is what the Megatron hook calls: each rank builds only its own
state dict, in the form Megatron's ``load_checkpoint`` expects from a legacy ``model_optim_rng.pt``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from megatron_preflight.errors import PreflightError
from megatron_preflight.layout.discover import discover
from megatron_preflight.layout.model import Format, Layout
from megatron_preflight.reshard.executor import SourceFiles, execute
from megatron_preflight.reshard.optimizer import (
    PROVENANCE_KEY,
    OptimizerIndex,
    OptimizerNotReshardable,
    index_optimizer,
    plan_optimizer,
)
from megatron_preflight.reshard.planner import (
    RankPlan,
    index_sources,
    is_tied,
    plan_rank,
    rewrite_args,
    source_topology,
    target_vocab,
)
from megatron_preflight.reshard.topology import Topology

log = logging.getLogger(__name__)

# Top-level entries of a legacy file, and what resharding does with each.
CARRIED = ("iteration", "checkpoint_version", "num_floating_point_operations_so_far", "opt_param_scheduler",
           "rerun_state_machine", "total_iters")
NOT_MAPPABLE = {
    "rng_state": "RNG states are per (TP, PP) rank and cannot be mapped to another layout; load with --no-load-rng",
}


@dataclass
class TargetLayout:
    """The layout to reshard to. Sizes left None keep the source's, except ETP (follows the target TP unless given)
    and VPP (none unless given)."""

    tp: int | None = None
    pp: int | None = None
    ep: int | None = None
    etp: int | None = None
    vpp: int | None = None
    num_layers_per_virtual_pipeline_stage: int | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    padded_vocab_size: int | None = None
    vocab_size: int | None = None
    make_vocab_size_divisible_by: int | None = None
    embedding_in_split: bool = False  # --account-for-embedding-in-pipeline-split at the target
    loss_in_split: bool = False  # --account-for-loss-in-pipeline-split at the target
    # How the target's Megatron-LM orders optimizer param groups: "sorted" (2026-01 on, core >= 0.16: the same on
    # every rank) or "per_rank" (earlier: by the first parameter each rank meets). None: as the source shows it.
    optimizer_group_order: str | None = None


@dataclass
class Resharder:
    """A legacy checkpoint indexed once; plans and state dicts for any target rank."""

    layout: Layout
    target: TargetLayout
    trust: bool = False
    keep_optimizer: bool = True  # reshard the plain optimizer's state with the weights (False: leave it out)
    dropped: dict[str, str] = field(default_factory=dict)
    optimizer_index: OptimizerIndex | None = None
    optimizer_problem: PreflightError | None = None

    def __post_init__(self) -> None:
        lay = self.layout
        if lay.format != Format.TORCH:
            what = lay.format.value if lay.format else "not a Megatron checkpoint"
            raise PreflightError(f"the resharder reads legacy (torch format) checkpoints; this one is {what}",
                                 path=lay.path, fix="torch_dist checkpoints are resharded by Megatron's own dist "
                                 "loader at load time: start the run at the new layout", code="format")
        fatal = [p for p in lay.problems if p.code not in ("no_tracker", "bad_tracker")]
        if fatal:
            p = fatal[0]
            raise PreflightError(f"the checkpoint has {len(fatal)} problem(s); first: {p.message}", path=p.path,
                                 fix=p.fix or "run `megatron-preflight inspect` on it", code="checkpoint")
        self.src = source_topology(lay)
        t = self.target
        tp = t.tp or self.src.tp
        pp = t.pp or self.src.pp
        vpp = t.vpp
        if vpp is None and t.num_layers_per_virtual_pipeline_stage:
            per_stage = (self.src.num_layers + t.embedding_in_split + t.loss_in_split) // pp
            vpp = per_stage // t.num_layers_per_virtual_pipeline_stage
        self.tgt = Topology(
            num_layers=self.src.num_layers, tp=tp, pp=pp, ep=t.ep or self.src.ep,
            etp=t.etp if t.etp is not None else tp, vpp=vpp if vpp and vpp > 1 else None,
            first_stage_layers=t.first_stage_layers, last_stage_layers=t.last_stage_layers,
            num_experts=self.src.num_experts, cp=1, order=self.src.order,
            embedding_in_split=t.embedding_in_split, loss_in_split=t.loss_in_split,
        )
        self.tgt.stage_layer_counts()  # validates
        if self.tgt.num_experts:
            self.tgt.experts_per_rank()
        self.tied = is_tied(lay)
        self.index = index_sources(lay, self.src)
        has_vocab = any(k[3] in ("embedding.word_embeddings.weight", "output_layer.weight") for k in self.index)
        self.padded_vocab = target_vocab(lay, self.tgt, t.padded_vocab_size, t.vocab_size,
                                         t.make_vocab_size_divisible_by) if has_vocab else None
        meta = lay.shards[0].meta or {}
        self.dropped = {k: v for k, v in NOT_MAPPABLE.items() if k in meta}
        if "optimizer" in meta:
            try:
                self.optimizer_index = index_optimizer(lay, self.src)
            except OptimizerNotReshardable as e:
                self.optimizer_problem = e
                self.dropped["optimizer"] = f"not resharded: {e.message}; load with --no-load-optim"
            if self.optimizer_index is not None and t.optimizer_group_order:
                self.optimizer_index.per_rank_order = t.optimizer_group_order == "per_rank"
            if self.optimizer_index is not None and not self.keep_optimizer:
                self.dropped["optimizer"] = "left out on request (--drop-optimizer); load with --no-load-optim"

    # -- planning ------------------------------------------------------------------------------------------------
    def shard_plans(self) -> dict[str, RankPlan]:
        """A plan for every shard dir of the target layout."""
        return {name: self.plan_for_coords(coords, name) for name, coords in self.tgt.shard_dirs().items()}

    def plan_for_coords(self, coords: dict[str, int], name: str = "") -> RankPlan:
        plan = plan_rank(self.index, self.src, self.tgt, coords, tied=self.tied,
                         target_padded_vocab=self.padded_vocab, shard_name=name)
        if self.optimizer_index is not None and self.keep_optimizer:
            plan.optimizer = plan_optimizer(self.optimizer_index, plan, self.src, self.tgt, self.padded_vocab)
        return plan

    def plan_for_rank(self, rank: int, world_size: int | None = None) -> RankPlan:
        from megatron_preflight.layout import naming

        name, coords = naming.shard_for_rank(rank, world_size or self.tgt.sizes.min_world(), self.tgt.sizes)
        return self.plan_for_coords(coords, name)

    # -- building ------------------------------------------------------------------------------------------------
    def header(self, files: SourceFiles | None = None) -> dict[str, Any]:
        """The non-model part of every target file: args (rewritten to the target layout) and carried state."""
        own = files is None
        files = files or SourceFiles(self.layout.iter_dir or "", trust=self.trust)
        try:
            state: dict[str, Any] = {}
            first = self.layout.shards[0]
            meta = first.meta or {}
            if meta.get("args") is not None:
                state["args"] = rewrite_args(meta["args"], self.tgt, self.padded_vocab)
            for key in CARRIED:
                if key in meta:
                    state[key] = files.materialize(first.name, meta[key])
            if self.optimizer_index is not None and self.keep_optimizer:
                state[PROVENANCE_KEY] = {
                    "resharded_from": self.layout.path,
                    "optimizer_group_order": "per_rank" if self.optimizer_index.per_rank_order else "sorted",
                }
            known = set(CARRIED) | set(NOT_MAPPABLE) | {"args", "optimizer", PROVENANCE_KEY}
            for key, value in meta.items():
                if key in known or key == "model" or (key.startswith("model") and key[5:].isdigit()):
                    continue
                state[key] = files.materialize(first.name, value)
                log.warning("carried top-level entry %r from %s unchanged", key, first.name)
            return state
        finally:
            if own:
                files.close()

    def build(self, plan: RankPlan, files: SourceFiles | None = None) -> dict[str, Any]:
        """The full legacy state dict for ``plan``: args (rewritten), carried state, and the model chunk(s)."""
        own = files is None
        files = files or SourceFiles(self.layout.iter_dir or "", trust=self.trust)
        try:
            state = self.header(files)
            state.update(execute(plan, files))
            return state
        finally:
            if own:
                files.close()


def open_resharder(checkpoint: str | Layout, target: TargetLayout, *, iteration: int | str | None = None,
                   trust_checkpoint: bool = False, keep_optimizer: bool = True) -> Resharder:
    layout = checkpoint if isinstance(checkpoint, Layout) else discover(checkpoint, iteration=iteration,
                                                                        trust_checkpoint=trust_checkpoint)
    return Resharder(layout, target, trust=trust_checkpoint, keep_optimizer=keep_optimizer)


def build_rank_state_dict(checkpoint: str | Layout | Resharder, target_layout: TargetLayout, rank: int,
                          world_size: int | None = None, *, iteration: int | str | None = None,
                          trust_checkpoint: bool = False) -> dict[str, Any]:
    """The state dict runtime rank ``rank`` (of ``world_size``) loads, at ``target_layout``: exactly what Megatron's
    ``load_checkpoint`` reads from a legacy file of that layout (``model`` or ``model0..N`` for VPP), with the plain
    optimizer's state resharded alongside. The RNG state is not in it (see :data:`NOT_MAPPABLE`)."""
    r = checkpoint if isinstance(checkpoint, Resharder) else open_resharder(
        checkpoint, target_layout, iteration=iteration, trust_checkpoint=trust_checkpoint)
    return r.build(r.plan_for_rank(rank, world_size))

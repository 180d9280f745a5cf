"""Resharding API: a legacy checkpoint, read at any TP/PP/EP/ETP/VPP layout, one rank at a time.

``build_rank_state_dict(checkpoint, target, rank)`` is what the Megatron hook calls: each rank builds only its own
state dict, in the form Megatron's ``load_checkpoint`` expects from a legacy ``model_optim_rng.pt``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from megatron_preflight import parallel
from megatron_preflight.errors import PreflightError
from megatron_preflight.layout.discover import discover
from megatron_preflight.layout.model import Format, Layout
from megatron_preflight.parallel import LayoutError, ParallelLayout
from megatron_preflight.reshard.consistency import args_problems, raise_first
from megatron_preflight.reshard.dist_optimizer import (
    DistOptimizerIndex,
    bucket_size,
    check_masters,
    index_dist_optimizer,
    plan_dist_optimizer,
)
from megatron_preflight.reshard.dist_source import RegionRef, virtual_layout
from megatron_preflight.reshard.executor import SourceFiles, execute
from megatron_preflight.reshard.optimizer import (
    PROVENANCE_KEY,
    OptimizerIndex,
    OptimizerNotReshardable,
    index_optimizer,
    plan_optimizer,
)
from megatron_preflight.reshard.planner import (
    VOCAB_KEYS,
    RankPlan,
    SourcePiece,
    index_sources,
    is_tied,
    plan_rank,
    rewrite_args,
    source_topology,
    target_vocab,
    validate_plan,
)
from megatron_preflight.reshard.replicas import check_replicas
from megatron_preflight.torch_file import TensorRef

log = logging.getLogger(__name__)

# Top-level entries of a legacy file, and what resharding does with each.
CARRIED = ("iteration", "checkpoint_version", "num_floating_point_operations_so_far", "opt_param_scheduler",
           "rerun_state_machine", "total_iters")
NOT_MAPPABLE = {
    "rng_state": "RNG states are per (TP, PP) rank and cannot be mapped to another layout; load with --no-load-rng",
}


@dataclass
class TargetLayout:
    """The layout to reshard to, as asked for. Sizes left None keep the source's, except ETP (follows the target TP
    unless given) and VPP (none unless given); the stage split (uneven first/last stages, the embedding / loss
    counted in it) is the source's when PP is kept and none of it is given. :meth:`resolve` turns it into the one
    :class:`ParallelLayout`."""

    tp: int | None = None
    pp: int | None = None
    ep: int | None = None
    etp: int | None = None
    vpp: int | None = None
    num_layers_per_virtual_pipeline_stage: int | None = None
    num_virtual_stages_per_pipeline_rank: int | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    padded_vocab_size: int | None = None
    vocab_size: int | None = None
    make_vocab_size_divisible_by: int | None = None
    embedding_in_split: bool | None = None  # --account-for-embedding-in-pipeline-split at the target
    loss_in_split: bool | None = None  # --account-for-loss-in-pipeline-split at the target
    # How the target's Megatron-LM orders optimizer param groups: "sorted" (2026-01 on, core >= 0.16: the same on
    # every rank) or "per_rank" (earlier: by the first parameter each rank meets). None: as the source shows it.
    optimizer_group_order: str | None = None
    # The target run's --use-distributed-optimizer (None: as the source): the optimizer state is converted when it
    # differs.
    distributed_optimizer: bool | None = None
    # The format to write: "torch" (legacy, the default) or "torch_dist" (see dist_target).
    ckpt_format: str | None = None

    @classmethod
    def from_args(cls, args: Any, given: set[str] | None = None) -> TargetLayout:
        """The target a run with Megatron ``args`` (a Namespace, RuntimeArgs or mapping) needs. ``given``: the arg
        names set explicitly (the others keep the source's); None: every size is given. The virtual pipeline flags
        are kept as flags: :meth:`resolve` derives the VPP with the model's layer count, as Megatron does."""

        def get(name: str) -> Any:
            value = args.get(name) if isinstance(args, dict) else getattr(args, name, None)
            return value if given is None or name in given else None

        per_chunk, stages = get("num_layers_per_virtual_pipeline_stage"), get("num_virtual_stages_per_pipeline_rank")
        return cls(
            tp=get("tensor_model_parallel_size"), pp=get("pipeline_model_parallel_size"),
            ep=get("expert_model_parallel_size"), etp=get("expert_tensor_parallel_size"),
            vpp=get("virtual_pipeline_model_parallel_size") if per_chunk is None and stages is None else None,
            num_layers_per_virtual_pipeline_stage=per_chunk, num_virtual_stages_per_pipeline_rank=stages,
            first_stage_layers=get("decoder_first_pipeline_num_layers"),
            last_stage_layers=get("decoder_last_pipeline_num_layers"),
            # a run's flags: an accounting flag not given is off (Megatron's default), not "keep the source's"
            embedding_in_split=bool(get("account_for_embedding_in_pipeline_split")),
            loss_in_split=bool(get("account_for_loss_in_pipeline_split")),
            padded_vocab_size=get("padded_vocab_size") if given is None else None,
            distributed_optimizer=bool(get("use_distributed_optimizer")),
            vocab_size=get("vocab_size"),
            make_vocab_size_divisible_by=get("make_vocab_size_divisible_by"),
            # the output's format only when the run's flags name it (Megatron's default is torch_dist)
            ckpt_format=get("ckpt_format") if given is not None else None,
        )

    def resolve(self, src: ParallelLayout) -> ParallelLayout:
        """The target's parallel layout, built by :func:`parallel.from_args` from these sizes and the source's."""

        def keep(value: int | None, source: int) -> int:
            return source if value is None else value

        split = (self.first_stage_layers, self.last_stage_layers, self.embedding_in_split, self.loss_in_split)
        if keep(self.pp, src.pp) == src.pp and all(v is None for v in split):  # same PP: the same stage split
            split = (src.first_stage_layers, src.last_stage_layers, src.embedding_in_split, src.loss_in_split)
        first, last, emb, loss = split
        return parallel.from_args({
            "tensor_model_parallel_size": keep(self.tp, src.tp),
            "pipeline_model_parallel_size": keep(self.pp, src.pp),
            "expert_model_parallel_size": keep(self.ep, src.ep),
            "expert_tensor_parallel_size": self.etp,
            "virtual_pipeline_model_parallel_size": self.vpp,
            "num_layers_per_virtual_pipeline_stage": self.num_layers_per_virtual_pipeline_stage,
            "num_virtual_stages_per_pipeline_rank": self.num_virtual_stages_per_pipeline_rank,
            "decoder_first_pipeline_num_layers": first,
            "decoder_last_pipeline_num_layers": last,
            "account_for_embedding_in_pipeline_split": bool(emb),
            "account_for_loss_in_pipeline_split": bool(loss),
            "num_layers": src.num_layers,
            "num_experts": src.num_experts,
            "use_tp_pp_dp_mapping": src.order == parallel.TP_PP_DP_ORDER,
        })


@dataclass
class Resharder:
    """A legacy checkpoint indexed once; plans and state dicts for any target rank."""

    layout: Layout
    target: TargetLayout
    trust: bool = False
    keep_optimizer: bool = True  # reshard the plain optimizer's state with the weights (False: leave it out)
    dropped: dict[str, str] = field(default_factory=dict)
    optimizer_index: OptimizerIndex | None = None
    dist_index: DistOptimizerIndex | None = None  # the state in the distributed form, for a distributed target
    source_dist_index: DistOptimizerIndex | None = None  # the source's distrib_optim.pt, as read
    optimizer_problem: PreflightError | None = None
    bucket_size: int | None = None  # the target's DDP bucket size (the source's settings; see dist_optimizer)
    converted: str = ""  # what a --use-distributed-optimizer toggle did to the optimizer state
    source_format: Format | None = None  # the checkpoint's own format (a torch_dist one is read as legacy shards)

    def __post_init__(self) -> None:
        lay = self.layout
        if lay.sampled:
            raise ValueError("the resharder needs every shard's metadata: discover the checkpoint with shards='all'")
        if lay.format is None:
            p = lay.problems[0] if lay.problems else None
            raise PreflightError(f"this is not a Megatron checkpoint (it looks like {lay.looks_like or 'something else'})"
                                 if p is None or p.code in ("not_megatron", "no_shards") else p.message,
                                 path=p.path if p else lay.path,
                                 fix=(p.fix if p and p.fix else "pass the --save dir of a Megatron-LM run (it holds "
                                      "latest_checkpointed_iteration.txt and iter_* dirs)"), code="format")
        if lay.format not in (Format.TORCH, Format.TORCH_DIST):
            raise PreflightError(f"the resharder reads legacy (torch) and torch_dist checkpoints; this one is "
                                 f"{lay.format.value}", path=lay.path,
                                 fix="convert it with the Megatron version that wrote it (--ckpt-convert-format "
                                     "torch_dist)", code="format")
        fatal = [p for p in lay.problems if p.code not in ("no_tracker", "bad_tracker")]
        if fatal:
            p = fatal[0]
            raise PreflightError(f"the checkpoint has {len(fatal)} problem(s); first: {p.message}", path=p.path,
                                 fix=p.fix or "run `megatron-preflight inspect` on it", code="checkpoint")
        dist_optimizer_state = False
        self.source_format = lay.format
        dist_source = lay
        dp_problem: OptimizerNotReshardable | None = None
        if lay.format == Format.TORCH_DIST:  # read as the legacy shards of the layout that saved it
            lay, dist_optimizer_state = virtual_layout(lay, trust=self.trust)
            self.layout = lay
            if dist_optimizer_state and dist_source.dist_optimizer_sharding == "dp_reshardable":
                # the distributed optimizer's flat buckets: read as the legacy distrib_optim.pt they equal
                from megatron_preflight.reshard.dist_source_optimizer import attach_dp_reshardable

                dist_optimizer_state = False
                try:
                    attach_dp_reshardable(dist_source, lay, trust=self.trust)
                except OptimizerNotReshardable as e:
                    dp_problem = e
        self.src = source_topology(lay)
        t = self.target
        try:
            self.tgt = t.resolve(self.src)
        except LayoutError as exc:  # the target the user asked for cannot hold this model: a flag to change
            exc.code = "usage"
            raise
        self._check_target_fits_the_model()
        self.tied = is_tied(lay)
        self.index = index_sources(lay, self.src)
        raise_first(args_problems(self.index, lay))
        vocab = [e for k, e in self.index.items() if k.suffix in VOCAB_KEYS and e.rule.kind == "vocab"]
        self.vocab = target_vocab(lay, self.tgt, t.padded_vocab_size, t.vocab_size, t.make_vocab_size_divisible_by,
                                  vocab[0].global_len() or 0) if vocab else None
        self.padded_vocab = self.vocab.target_padded if self.vocab else None
        meta = lay.shards[0].meta or {}
        self.dropped = {k: v for k, v in NOT_MAPPABLE.items() if k in meta}
        if self.source_format == Format.TORCH_DIST:  # its RNG states are per rank, as in legacy files
            self.dropped["rng_state"] = NOT_MAPPABLE["rng_state"]
        self.target_distributed = bool(lay.distributed_optimizer) if t.distributed_optimizer is None \
            else t.distributed_optimizer
        if dp_problem is not None:
            self.optimizer_problem = dp_problem
            self.dropped["optimizer"] = f"not resharded: {dp_problem.message}; load with --no-load-optim"
        if dist_optimizer_state:
            try:
                self._index_dist_source_optimizer(dist_source, lay)
            except OptimizerNotReshardable as e:
                self.optimizer_index = self.dist_index = None
                self.optimizer_problem = e
                self.dropped["optimizer"] = f"not resharded: {e.message}; load with --no-load-optim"
            if (self.optimizer_index or self.dist_index) is not None and not self.keep_optimizer:
                self.dropped["optimizer"] = "left out on request (--drop-optimizer); load with --no-load-optim"
        if "optimizer" in meta:
            try:
                self._index_optimizer(lay, t)
            except OptimizerNotReshardable as e:
                self.optimizer_index = self.dist_index = self.source_dist_index = None
                self.optimizer_problem = e
                self.dropped["optimizer"] = f"not resharded: {e.message}; load with --no-load-optim"
            if self.optimizer_index is not None and t.optimizer_group_order:
                self.optimizer_index.per_rank_order = t.optimizer_group_order == "per_rank"
            if (self.optimizer_index or self.dist_index) is not None and not self.keep_optimizer:
                self.dropped["optimizer"] = "left out on request (--drop-optimizer); load with --no-load-optim"
            elif self.keep_optimizer and self.target_distributed != bool(lay.distributed_optimizer) and \
                    (self.optimizer_index or self.dist_index) is not None:
                kinds = ("distributed", "plain") if lay.distributed_optimizer else ("plain", "distributed")
                self.converted = f"the optimizer state was converted from the {kinds[0]} to the {kinds[1]} optimizer"

    def _check_target_fits_the_model(self) -> None:
        """The target layout against the model the checkpoint holds (heads, query groups, ffn, experts, layers):
        the same rules as the check, with the first problem named in the user's terms."""
        from megatron_preflight.check.compare import check_runtime_layout
        from megatron_preflight.check.runtime_args import from_namespace

        try:
            self.tgt.validate()
        except parallel.LayoutError as e:
            raise PreflightError(f"the target layout {self.tgt.describe()} does not fit the model: {e.message}",
                                 path=self.layout.iter_dir, fix=e.fix, code="usage") from None
        args = self.layout.saved_args
        if args is None:
            return
        rt = from_namespace(args)
        tgt = self.tgt
        rt.tensor_model_parallel_size, rt.pipeline_model_parallel_size = tgt.tp, tgt.pp
        rt.expert_model_parallel_size, rt.expert_tensor_parallel_size = tgt.ep, tgt.etp_eff
        rt.num_layers_per_virtual_pipeline_stage = rt.num_virtual_stages_per_pipeline_rank = None
        rt.virtual_pipeline_model_parallel_size = tgt.vpp
        rt.decoder_first_pipeline_num_layers, rt.decoder_last_pipeline_num_layers = (tgt.first_stage_layers,
                                                                                   tgt.last_stage_layers)
        rt.account_for_embedding_in_pipeline_split = tgt.embedding_in_split
        rt.account_for_loss_in_pipeline_split = tgt.loss_in_split
        rt.world_size = None
        rt.num_layers = self.src.num_layers
        problems = [f for f in check_runtime_layout(rt) if f.field != "expert_tensor_parallel_size"
                    or "biases" not in f.message]
        if problems:
            f = problems[0]
            raise PreflightError(f"the target layout {tgt.describe()} does not fit the model: {f.message}",
                                 path=self.layout.iter_dir, fix=f.fix, code="usage")

    def _index_dist_source_optimizer(self, source: Layout, lay: Layout) -> None:
        """A torch_dist source's optimizer state (model space), in the form the target needs."""
        from megatron_preflight.reshard.dist_source_optimizer import index_dist_source_optimizer
        from megatron_preflight.reshard.optimizer_convert import distributed_to_plain, plain_to_distributed

        self.optimizer_index = distributed_to_plain(
            index_dist_source_optimizer(source, lay, self.src, trust=self.trust), lay, self.src)
        if self.target_distributed:
            grad_fp32 = bool(getattr(lay.saved_args, "accumulate_allreduce_grads_in_fp32", False))
            self.dist_index = plain_to_distributed(self.optimizer_index, self.index, self._plain_step(), grad_fp32)
            self.optimizer_index = None
        self.bucket_size = bucket_size(lay.saved_args)
        if self.keep_optimizer and self.target_distributed != bool(lay.distributed_optimizer):
            kinds = ("distributed", "plain") if lay.distributed_optimizer else ("plain", "distributed")
            self.converted = f"the optimizer state was converted from the {kinds[0]} to the {kinds[1]} optimizer"

    def _index_optimizer(self, lay: Layout, t: TargetLayout) -> None:
        """Index the source's optimizer state in the form the target needs (plain or distributed), converting it
        when the run toggles --use-distributed-optimizer."""
        from megatron_preflight.reshard.optimizer_convert import distributed_to_plain, plain_to_distributed

        if lay.distributed_optimizer:
            self.dist_index = self.source_dist_index = index_dist_optimizer(lay, self.src, trust=self.trust)
            if not self.target_distributed:
                self.optimizer_index = distributed_to_plain(self.dist_index, lay, self.src)
                self.dist_index = None
        else:
            self.optimizer_index = index_optimizer(lay, self.src)
            if self.target_distributed and self.optimizer_index is not None:
                grad_fp32 = bool(getattr(lay.saved_args, "accumulate_allreduce_grads_in_fp32", False))
                self.dist_index = plain_to_distributed(self.optimizer_index, self.index, self._plain_step(),
                                                       grad_fp32)
                self.optimizer_index = None
        self.bucket_size = bucket_size(lay.saved_args)

    def _plain_step(self) -> float:
        """The optimizer step of a plain optimizer's state (kept per parameter; the distributed one keeps it per
        group): read from the first parameter that has one."""
        assert self.optimizer_index is not None
        for fields in self.optimizer_index.fields.values():
            piece = fields.get("step")
            if isinstance(piece, SourcePiece):
                if isinstance(piece.ref, TensorRef):
                    files = SourceFiles(self.layout.iter_dir or "", trust=self.trust)
                    try:
                        if isinstance(piece.ref, RegionRef):
                            return float(files.tensor(piece.shard, piece.ref).item())
                        value = files.file_of(piece.shard, piece.ref).item(piece.ref)  # a number, without torch
                        if isinstance(value, TensorRef):
                            raise PreflightError(f"the optimizer's step of {piece.shard} is not one number",
                                                 path=self.layout.iter_dir, code="optimizer",
                                                 fix="pass --drop-optimizer / start with --no-load-optim")
                        return float(value)
                    finally:
                        files.close()
                return float(piece.ref)
        return 0.0

    # -- planning ------------------------------------------------------------------------------------------------
    def shard_plans(self) -> dict[str, RankPlan]:
        """A plan for every shard dir of the target layout."""
        return {name: self.plan_for_coords(coords, name) for name, coords in self.tgt.shard_dirs().items()}

    def plan_for_coords(self, coords: dict[str, int], name: str = "") -> RankPlan:
        """The validated plan of the target rank at ``coords`` (model chunks and, when kept, the optimizer state)."""
        plan = plan_rank(self.index, self.src, self.tgt, coords, tied=self.tied, vocab=self.vocab, shard_name=name)
        if self.optimizer_index is not None and self.keep_optimizer:
            plan.optimizer = plan_optimizer(self.optimizer_index, plan, self.src, self.tgt, self.vocab)
        if self.dist_index is not None and self.keep_optimizer and self.target_distributed:
            plan.optimizer, plan.dist_optimizer = plan_dist_optimizer(self.dist_index, plan, self.tgt, self.vocab,
                                                                      tied=self.tied, size=self.bucket_size)
        validate_plan(plan)
        return plan

    def check_masters(self, files: SourceFiles, shards: set[str] | None = None) -> int:
        """A distributed optimizer's fp32 masters sit where the buffer model says (sampled; see dist_optimizer), in
        every source dir or in ``shards``."""
        if self.source_dist_index is None or not self.keep_optimizer:
            return 0
        return check_masters(self.source_dist_index, files, shards=shards)

    def plan_for_rank(self, rank: int, world_size: int | None = None) -> RankPlan:
        from megatron_preflight.layout import naming

        name, coords = naming.shard_for_rank(rank, world_size or self.tgt.min_world(), self.tgt)
        return self.plan_for_coords(coords, name)

    # -- building ------------------------------------------------------------------------------------------------
    @property
    def writes_optimizer(self) -> bool:
        """Whether the target files get optimizer state."""
        return self.keep_optimizer and (self.optimizer_index is not None or self.dist_index is not None)

    def header(self, files: SourceFiles | None = None) -> dict[str, Any]:
        """The non-model part of every target file: args (rewritten to the target layout) and carried state."""
        own = files is None
        files = files or SourceFiles(self.layout.iter_dir or "", trust=self.trust)
        try:
            state: dict[str, Any] = {}
            first = self.layout.shards[0]
            meta = first.meta or {}
            if meta.get("args") is not None:
                state["args"] = rewrite_args(meta["args"], self.tgt, self.padded_vocab,
                                             self.target_distributed if self.keep_optimizer else None)
                if self.source_format == Format.TORCH_DIST and hasattr(state["args"], "ckpt_format"):
                    state["args"].ckpt_format = "torch"  # what this file is now
                if not self.writes_optimizer:
                    state["args"].no_save_optim = True  # saved without optimizer state, as Megatron would say
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
        """The full legacy state dict for ``plan``: args (rewritten), carried state, and the model chunk(s). The
        replicas the plan reads are sampled first (:func:`check_replicas`)."""
        own = files is None
        files = files or SourceFiles(self.layout.iter_dir or "", trust=self.trust)
        try:
            check_replicas(plan, files)
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

"""One checkpoint at one target layout: :func:`open_resharder` resolves the target against the checkpoint's
:class:`~megatron_preflight.reshard.checkpoint_index.CheckpointIndex`, checks it fits the model, decides the optimizer
state (:func:`choose_optimizer`) and returns a frozen :class:`Resharder`, which plans any target rank and builds its
state dict: what Megatron's ``load_checkpoint`` reads from a legacy ``model_optim_rng.pt`` of that layout. The hook
builds its rank's state dict from it in memory; the offline targets write files from its plans.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from megatron_preflight import parallel
from megatron_preflight.errors import PreflightError
from megatron_preflight.layout import naming
from megatron_preflight.layout.model import Format, Layout
from megatron_preflight.parallel import LayoutError, ParallelLayout, hybrid_pattern
from megatron_preflight.reshard.carried import CARRIED, NOT_MAPPABLE, handled
from megatron_preflight.reshard.checkpoint_index import CheckpointIndex, open_index
from megatron_preflight.reshard.optimizer.convert import distributed_to_plain, plain_to_distributed
from megatron_preflight.reshard.optimizer.distributed import (
    DistOptimizerIndex,
    bucket_size,
    check_masters,
    plan_dist_optimizer,
)
from megatron_preflight.reshard.optimizer.family import FUSED, family_of, renamed, to_family
from megatron_preflight.reshard.optimizer.plain import (
    PROVENANCE_KEY,
    OptimizerIndex,
    OptimizerNotReshardable,
    plan_optimizer,
)
from megatron_preflight.reshard.plan.consistency import raise_first
from megatron_preflight.reshard.plan.hybrid import conv_named, gpt_to_hybrid_problem, to_hybrid
from megatron_preflight.reshard.plan.index import VOCAB_KEYS, GlobalIndex, has_legacy_grouped
from megatron_preflight.reshard.plan.planner import by_layer, plan_rank, rewrite_args, target_vocab
from megatron_preflight.reshard.plan.spec import TE, SpecChange, bridge, spec_change
from megatron_preflight.reshard.plan.topology import saved_arg
from megatron_preflight.reshard.plan.types import GlobalKey, RankPlan, VocabPlan
from megatron_preflight.reshard.plan.validate import validate_plan
from megatron_preflight.reshard.sources.byte_ranges import plan_byte_ranges
from megatron_preflight.reshard.sources.files import SourceFiles
from megatron_preflight.reshard.target import TargetLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OptimizerChoice:
    """What a target does with the checkpoint's optimizer state: the form it is written in (plain, or the distributed
    optimizer's buffers), converted or not, or why it is left out."""

    plain: OptimizerIndex | None = None  # written per parameter (model_optim_rng.pt's ``optimizer``)
    distributed: DistOptimizerIndex | None = None  # written as distrib_optim.pt buffers
    source_distributed: DistOptimizerIndex | None = None  # the source's buffers as read (their masters are checked)
    problem: PreflightError | None = None  # why the state cannot be carried
    dropped: str = ""  # why it is not carried ("" when it is, or there is none)
    converted: str = ""  # what a --use-distributed-optimizer toggle did to it

    @property
    def written(self) -> bool:
        return self.plain is not None or self.distributed is not None


def grads_in_fp32(args: Any) -> bool:
    """Whether a run's DDP gradient buffers are fp32 (the key of each distrib_optim.pt buffer names their dtype, and
    Megatron's load looks the buffer up by it): ``accumulate_allreduce_grads_in_fp32`` as saved; args that do not
    record it follow Megatron-LM's rule (bf16 accumulates and all-reduces gradients in fp32 unless
    --grad-reduce-in-bf16)."""
    saved = getattr(args, "accumulate_allreduce_grads_in_fp32", None)
    if saved is not None:
        return bool(saved)
    return bool(getattr(args, "bf16", False)) and not bool(getattr(args, "grad_reduce_in_bf16", False))


def choose_optimizer(index: CheckpointIndex, *, distributed: bool, keep: bool,
                     group_order: str | None = None) -> OptimizerChoice:
    """THE decision on the optimizer state for a target: carried in the form ``distributed`` asks for (converted when
    the checkpoint's form differs), left out on request (``keep`` False), or left out because it cannot be read."""
    source = index.optimizer
    if source.problem is not None:
        if not isinstance(source.problem, OptimizerNotReshardable):
            raise source.problem
        return OptimizerChoice(problem=source.problem,
                               dropped=f"not resharded: {source.problem.message}; load with --no-load-optim")
    if not source.present:
        return OptimizerChoice()
    if not keep:
        return OptimizerChoice(dropped="left out on request (--drop-optimizer); load with --no-load-optim")
    plain, dist = source.plain, source.distributed
    if distributed and dist is None:
        grad_fp32 = grads_in_fp32(index.view.saved_args)
        dist, plain = plain_to_distributed(plain, index.tensors, index.step_of(plain), grad_fp32), None
    elif not distributed and plain is None:
        plain, dist = distributed_to_plain(dist, index.view, index.topology), None
    if plain is not None and group_order:
        plain = dataclasses.replace(plain, per_rank_order=group_order == "per_rank")
    converted = ""
    if distributed != source.saved_distributed:
        kinds = ("distributed", "plain") if source.saved_distributed else ("plain", "distributed")
        converted = f"the optimizer state was converted from the {kinds[0]} to the {kinds[1]} optimizer"
    return OptimizerChoice(plain, dist, source.distributed, converted=converted)


def resolve_target(index: CheckpointIndex, target: TargetLayout) -> ParallelLayout:
    """The target's parallel layout, checked against the model the checkpoint holds (heads, query groups, ffn,
    experts, layers): the first problem named in the user's terms (a usage error: a flag to change)."""
    try:
        tgt = target.resolve(index.topology)
        tgt.validate()
    except LayoutError as e:
        raise PreflightError(f"the target layout does not fit the model: {e.message}", path=index.view.iter_dir,
                             fix=e.fix, code="usage") from None
    args = index.view.saved_args
    problems = parallel.fit_problems(tgt, args, training=False) if args is not None else []
    if problems:
        raise PreflightError(f"the target layout {tgt.describe()} does not fit the model: {problems[0].message}",
                             path=index.view.iter_dir, fix=problems[0].fix, code="usage")
    return tgt


@dataclass(frozen=True)
class Resharder:
    """One checkpoint at one target layout: what is carried, and plans and state dicts for any target rank. Made by
    :func:`open_resharder` from the checkpoint's :class:`CheckpointIndex` (shared by every resharder of the process)."""

    checkpoint: CheckpointIndex
    target: TargetLayout
    tgt: ParallelLayout
    vocab: VocabPlan | None
    keep_optimizer: bool
    target_distributed: bool
    choice: OptimizerChoice
    bucket_size: int | None  # the target's DDP bucket size (the source's settings; see optimizer.distributed)
    dropped: Mapping[str, str]
    tensors: GlobalIndex | None = None  # the global index in the target's spec (None: the checkpoint's own)
    spec: SpecChange | None = None  # the layer spec / expert form change the target asks for
    # a renamed tensor's key (target spec) -> its key in the checkpoint's own spec
    source_keys: Mapping[GlobalKey, GlobalKey] = field(default_factory=dict)
    _plans: dict[tuple, RankPlan] = field(default_factory=dict, repr=False, compare=False)  # the latest plans
    # the index's entries by layer (planner.by_layer), made on the first plan: keyed by the index it was made of
    _layer_groups: dict[int, Any] = field(default_factory=dict, repr=False, compare=False)

    # -- the source (the checkpoint index holds it) ----------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        """The source as legacy shards (a torch_dist checkpoint as those of the layout that saved it)."""
        return self.checkpoint.view

    @property
    def src(self) -> ParallelLayout:
        return self.checkpoint.topology

    @property
    def index(self) -> GlobalIndex:
        """Every global tensor, named as the target's spec names it."""
        return self.tensors if self.tensors is not None else self.checkpoint.tensors

    @property
    def tied(self) -> bool:
        return self.checkpoint.tied

    @property
    def trust(self) -> bool:
        return self.checkpoint.trust

    @property
    def source_format(self) -> Format | None:
        return self.checkpoint.layout.format

    # -- the optimizer state (the choice holds it) -----------------------------------------------------------------
    @property
    def optimizer_index(self) -> OptimizerIndex | None:
        return self.choice.plain

    @property
    def dist_index(self) -> DistOptimizerIndex | None:
        return self.choice.distributed

    @property
    def source_dist_index(self) -> DistOptimizerIndex | None:
        return self.choice.source_distributed

    @property
    def optimizer_problem(self) -> PreflightError | None:
        return self.choice.problem

    @property
    def converted(self) -> str:
        return self.choice.converted

    @property
    def padded_vocab(self) -> int | None:
        return self.vocab.target_padded if self.vocab else None

    def plain_step(self) -> float:
        """The optimizer step of the plain state written (read from the first parameter that has one)."""
        return self.checkpoint.step_of(self.choice.plain)

    # -- planning ------------------------------------------------------------------------------------------------
    def shard_plans(self) -> dict[str, RankPlan]:
        """A plan for every shard dir of the target layout."""
        return {name: self.plan_for_coords(coords, name) for name, coords in naming.shard_writers(self.tgt).items()}

    def plan_for_coords(self, coords: dict[str, int], name: str = "") -> RankPlan:
        """The validated plan of the target rank at ``coords`` (model chunks and, when kept, the optimizer state),
        planned once (the hook's model and distributed-optimizer loads ask for the same rank's plan; only the latest
        few are kept: an offline run plans thousands of shards one after another)."""
        key = (name, tuple(sorted(coords.items())))
        if key not in self._plans:
            while len(self._plans) >= 2:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = self._plan(coords, name)
        return self._plans[key]

    def _plan(self, coords: dict[str, int], name: str) -> RankPlan:
        if self.index is self.checkpoint.tensors:  # (the checkpoint's own: every resharder of it shares them)
            groups = self.checkpoint.layer_groups
        else:
            made = self._layer_groups.get(id(self.index))
            if made is None or made[0] is not self.index:  # (made once per index: the index is final once planned)
                made = self._layer_groups[id(self.index)] = (self.index, by_layer(self.index))
            groups = made[1]
        plan = plan_rank(self.index, self.src, self.tgt, coords, tied=self.tied, mtp=self.checkpoint.mtp,
                         vocab=self.vocab, shard_name=name, groups=groups)
        if self.optimizer_index is not None and self.keep_optimizer:
            plan.optimizer = plan_optimizer(self.optimizer_index, plan, self.src, self.tgt, self.vocab)
        if self.dist_index is not None and self.keep_optimizer and self.target_distributed:
            plan.optimizer, plan.dist_optimizer = plan_dist_optimizer(self.dist_index, plan, self.tgt, self.vocab,
                                                                      tied=self.tied, size=self.bucket_size)
        validate_plan(plan)
        return plan

    def check_masters(self, files: SourceFiles, shards: set[str] | None = None) -> int:
        """A distributed optimizer's fp32 masters sit where the buffer model says (sampled; see optimizer/distributed.py), in
        every source dir or in ``shards``."""
        if self.source_dist_index is None or not self.keep_optimizer:
            return 0
        return check_masters(self.source_dist_index, files, shards=shards)

    def byte_ranges(self, plan: RankPlan) -> dict[str, list[tuple[int, int]]]:
        """Source file -> the (offset, length) ranges a build of ``plan`` reads (sources/byte_ranges.py), the sampled
        masters :meth:`check_masters` reads in the plan's source dirs included."""
        masters = []
        if self.source_dist_index is not None and self.keep_optimizer:
            masters = [ref for shard, weight, _, master in self.source_dist_index.checked if shard in plan.sources
                       for ref in (weight, master)]
        return plan_byte_ranges(plan, self.layout.iter_dir or self.layout.path, trust=self.trust, extra=masters)

    def plan_for_rank(self, rank: int, world_size: int | None = None) -> RankPlan:
        name, coords = naming.shard_for_rank(rank, world_size or self.tgt.min_world(), self.tgt)
        return self.plan_for_coords(coords, name)

    # -- building ------------------------------------------------------------------------------------------------
    @property
    def writes_optimizer(self) -> bool:
        """Whether the target files get optimizer state."""
        return self.choice.written

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
                if self.source_format in (Format.TORCH_DIST, Format.FSDP_DTENSOR) and \
                        hasattr(state["args"], "ckpt_format"):
                    state["args"].ckpt_format = "torch"  # what this file is now
                if not self.writes_optimizer:
                    state["args"].no_save_optim = True  # saved without optimizer state, as Megatron would say
                if self.spec is not None and self.spec.changes:
                    state["args"].transformer_impl = self.spec.target
                    if hasattr(state["args"], "moe_grouped_gemm"):
                        state["args"].moe_grouped_gemm = self.spec.target_grouped
            for key in CARRIED:
                if key in meta:
                    state[key] = files.materialize(first.name, meta[key])
            if self.optimizer_index is not None and self.keep_optimizer:
                state[PROVENANCE_KEY] = {
                    "resharded_from": self.layout.path,
                    "optimizer_group_order": "per_rank" if self.optimizer_index.per_rank_order else "sorted",
                }
            for key, value in meta.items():
                if handled(key):
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
        files = files or SourceFiles(self.layout.iter_dir or "", trust=self.trust, )
        try:
            # building (not for a plan's cost, which a verdict asks)
            from megatron_preflight.reshard.execute.executor import execute
            from megatron_preflight.reshard.execute.replicas import Drifted, check_replicas

            drifted = Drifted()
            check_replicas(plan, files, saved_args=self.layout.saved_args, drifted=drifted)
            if drifted.tensors:
                log.warning("%s", drifted.render())
            state = self.header(files)
            state.update(execute(plan, files))
            return state
        finally:
            if own:
                files.close()


def open_resharder(checkpoint: str | Layout | CheckpointIndex, target: TargetLayout, *,
                   iteration: int | str | None = None, trust_checkpoint: bool = False,
                   keep_optimizer: bool = True) -> Resharder:
    """The resharder of ``checkpoint`` (a path, a discovered Layout, or the process's :class:`CheckpointIndex`, which
    is then reused) at ``target``."""
    index = open_index(checkpoint, iteration=iteration, trust_checkpoint=trust_checkpoint)
    index.require_readable()
    view = index.view
    tgt = resolve_target(index, target)
    raise_first(index.model_problems)
    vocab_entries = [e for e in (index.tensors.get(GlobalKey(None, None, "plain", k)) for k in VOCAB_KEYS)
                     if e is not None and e.rule.kind == "vocab"]
    vocab = target_vocab(view, tgt, target.padded_vocab_size, target.vocab_size, target.make_vocab_size_divisible_by,
                         vocab_entries[0].global_len() or 0) if vocab_entries else None
    meta = view.shards[0].meta or {}
    dropped = {k: v for k, v in NOT_MAPPABLE.items() if k in meta}
    if index.layout.format in (Format.TORCH_DIST, Format.FSDP_DTENSOR):  # its RNG states are per rank, as in legacy
        dropped["rng_state"] = NOT_MAPPABLE["rng_state"]
    distributed = bool(view.distributed_optimizer) if target.distributed_optimizer is None \
        else target.distributed_optimizer
    choice = choose_optimizer(index, distributed=distributed, keep=keep_optimizer,
                              group_order=target.optimizer_group_order)
    moe = any(k.expert is not None for k in index.tensors)
    change = spec_change(view.saved_args, target.transformer_impl, target.moe_grouped_gemm, moe,
                         packed=index.layout.format == Format.TORCH and has_legacy_grouped(index.layout))
    tensors, renamed_keys = None, {}
    if change.changes:
        tensors, renamed_keys = bridge(index.tensors, change, swiglu=parallel.gated_mlp(view.saved_args))
        log.info("tensors renamed for the target: %s", change.describe())
    if tgt.hybrid_pattern is not None and hybrid_pattern(view.saved_args) is None:  # GPT -> HybridModel
        problem = gpt_to_hybrid_problem(view.saved_args, tgt.hybrid_pattern)
        if problem is not None:
            raise PreflightError(f"a HybridModel run with the pattern {tgt.hybrid_pattern!r} cannot load this GPT "
                                 f"checkpoint: {problem}", path=view.iter_dir, code="layout",
                                 fix="run pretrain_hybrid.py with that pattern, or pretrain_gpt.py")
        tensors, layered = to_hybrid(tensors if tensors is not None else index.tensors, view.iter_dir)
        renamed_keys = _then(index.tensors, renamed_keys, layered)
        log.info("a GPT checkpoint loaded as the HybridModel %r", tgt.hybrid_pattern)
    if target.mamba_conv_name is not None:  # the target Megatron's name of a Mamba mixer's conv (0.19 renamed it)
        tensors, conv = conv_named(tensors if tensors is not None else index.tensors, target.mamba_conv_name)
        if conv:
            renamed_keys = _then(index.tensors, renamed_keys, conv)
            log.info("Mamba convs named %s for the target", target.mamba_conv_name)
        elif tensors is index.tensors:
            tensors = None
    family = target.optimizer_family or (FUSED if change.target == TE != change.source else None)
    choice = _adapted(choice, index, renamed_keys, family,
                      decoupled=bool(saved_arg(view.saved_args, "decoupled_weight_decay", True)))
    if choice.dropped:
        dropped["optimizer"] = choice.dropped
    return Resharder(index, target, tgt, vocab, keep_optimizer, distributed, choice, bucket_size(view.saved_args),
                     MappingProxyType(dropped), tensors, change,
                     MappingProxyType({new: old for old, new in renamed_keys.items()}))


def _then(keys: Any, first: dict[GlobalKey, GlobalKey], then: dict[GlobalKey, GlobalKey]) -> dict[GlobalKey, GlobalKey]:
    """Old -> new key of every one of ``keys`` that two renames in turn (``first``, then ``then``) move."""
    out = {}
    for old in keys:
        mid = first.get(old, old)
        new = then.get(mid, mid)
        if new != old:
            out[old] = new
    return out


def _adapted(choice: OptimizerChoice, index: CheckpointIndex, renamed_keys: dict, family: str | None, *,
             decoupled: bool) -> OptimizerChoice:
    """The chosen optimizer state under the target's parameter names and in the target's Adam family."""
    if not choice.written:
        return choice
    plain, dist = choice.plain, choice.distributed
    converted = [choice.converted] if choice.converted else []
    if family is not None:
        step = index.step_of(plain) if plain is not None else 0.0
        before = family_of([s for s in (plain or dist).settings.values()])  # type: ignore[union-attr]
        plain = to_family(plain, family, step, decoupled=decoupled) if plain is not None else None
        dist = to_family(dist, family, step, decoupled=decoupled) if dist is not None else None
        if before != family:
            converted.append(f"the Adam state was converted from {before} to {family} Adam (step {step:g} kept)"
                             if plain is not None else f"the Adam param groups were converted from {before} to "
                             f"{family} Adam")
    plain = renamed(plain, renamed_keys) if plain is not None else None
    dist = renamed(dist, renamed_keys) if dist is not None else None
    return dataclasses.replace(choice, plain=plain, distributed=dist, converted="; ".join(converted))


def build_rank_state_dict(checkpoint: str | Layout | Resharder, target_layout: TargetLayout, rank: int,
                          world_size: int | None = None, *, iteration: int | str | None = None,
                          trust_checkpoint: bool = False) -> dict[str, Any]:
    """The state dict runtime rank ``rank`` (of ``world_size``) loads, at ``target_layout``: exactly what Megatron's
    ``load_checkpoint`` reads from a legacy file of that layout (``model`` or ``model0..N`` for VPP), with the plain
    optimizer's state resharded alongside. The RNG state is not in it (see :data:`NOT_MAPPABLE`)."""
    r = checkpoint if isinstance(checkpoint, Resharder) else open_resharder(
        checkpoint, target_layout, iteration=iteration, trust_checkpoint=trust_checkpoint)
    return r.build(r.plan_for_rank(rank, world_size))

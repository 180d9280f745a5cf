"""One checkpoint, read and indexed once per process: discovery, its consistency, the global tensor index and the
source optimizer state — everything about the checkpoint that does not depend on the layout it is resharded to.

The check builds one and keeps it in its plan; the check's cost line, the hook's loader and every resharder (one per
target: the run's layout, the global TP1 plan of a torch_dist output) take it from there; the hook's other ranks
build theirs from the layout rank 0 sends; offline workers from the layout the main process sends. Each part is
built on first use (a verdict that needs no tensor index builds none) and never again.

:func:`index_builds` counts the global tensor indexes built in this process (tests assert one per process).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from megatron_preflight.errors import PreflightError
from megatron_preflight.layout.discover import discover
from megatron_preflight.layout.model import Format, Layout
from megatron_preflight.parallel import ParallelLayout
from megatron_preflight.reshard.optimizer.family import family_of, saved_family
from megatron_preflight.reshard.optimizer.plain import OptimizerIndex, OptimizerNotReshardable, index_optimizer
from megatron_preflight.reshard.optimizer.status import OptimizerStatus, optimizer_status
from megatron_preflight.reshard.plan import sections
from megatron_preflight.reshard.plan.consistency import args_problems, checkpoint_problems, complete_problems
from megatron_preflight.reshard.plan.index import GlobalIndex, has_mtp, index_sources
from megatron_preflight.reshard.plan.planner import Groups, by_layer
from megatron_preflight.reshard.plan.topology import is_tied, source_topology
from megatron_preflight.reshard.plan.types import SourcePiece
from megatron_preflight.reshard.sources.files import SourceFiles
from megatron_preflight.torch_file import TensorRef

if TYPE_CHECKING:
    from megatron_preflight.reshard.optimizer.distributed import DistOptimizerIndex

_built = [0]  # global tensor indexes built in this process

_SOFT = ("no_tracker", "bad_tracker")

FP8_MIN_BYTES = 16  # a TE extra state without FP8 is empty, pickle.dumps(None) (4 B) or pickle.dumps({}) (5 B)  # problems a resharder (and Megatron with --ckpt-step) can live with


def index_builds() -> int:
    """How many global tensor indexes this process has built."""
    return _built[0]


@dataclass(frozen=True)
class SourceOptimizer:
    """The checkpoint's optimizer state as the resharder reads it, before any target decides its form: the plain
    form (per parameter; a torch_dist model-space state is read as it) or the distributed one (``distrib_optim.pt``
    buffers; a torch_dist ``dp_reshardable`` state is read as them), or why it cannot be read."""

    plain: OptimizerIndex | None = None
    distributed: DistOptimizerIndex | None = None
    problem: PreflightError | None = None  # an OptimizerNotReshardable drops the state; another error is fatal
    saved_distributed: bool = False  # the checkpoint's --use-distributed-optimizer

    @property
    def present(self) -> bool:
        return self.plain is not None or self.distributed is not None


@dataclass(eq=False)
class CheckpointIndex:
    """A discovered checkpoint and, built on first use, its global index (see the module doc)."""

    layout: Layout
    trust: bool = False
    _steps: dict[int, float] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._add_consistency_problems()

    # -- discovery and consistency ----------------------------------------------------------------------------------
    def _add_consistency_problems(self) -> None:
        """A fully read legacy checkpoint's shards agree with each other and with their saved args (metadata only):
        every disagreement becomes a problem of the layout, once (a layout sent by rank 0 carries them already)."""
        lay = self.layout
        if lay.format != Format.TORCH or lay.sampled or lay.consistency_checked:
            return
        lay.consistency_checked = True
        if [p for p in lay.problems if p.code not in _SOFT]:
            return
        try:
            problems = checkpoint_problems(self.tensors, lay)
        except PreflightError as exc:
            problems = [exc]
        for exc in problems:
            lay.add(exc.code, exc.path or lay.iter_dir or lay.path, exc.message, exc.fix or "")

    def require_readable(self) -> None:
        """Raise the one-paragraph reason this checkpoint cannot be resharded (not Megatron's, another format,
        problems, a sampled read)."""
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
        if lay.format not in (Format.TORCH, Format.TORCH_DIST, Format.FSDP_DTENSOR, Format.HF):
            raise PreflightError(f"the resharder reads legacy (torch), torch_dist, fsdp_dtensor checkpoints and Hugging Face models; this one is "
                                 f"{lay.format.value}", path=lay.path,
                                 fix="convert it with the Megatron version that wrote it (--ckpt-convert-format "
                                     "torch_dist)", code="format")
        self.raise_problems()

    def raise_problems(self) -> None:
        """Raise the first problem that keeps the checkpoint from loading at any layout (a missing tracker is not one),
        naming how many there are."""
        lay = self.layout
        fatal = [p for p in lay.problems if p.code not in _SOFT]
        if fatal:
            p = fatal[0]
            raise PreflightError(f"the checkpoint has {len(fatal)} problem(s); first: {p.message}", path=p.path,
                                 fix=p.fix or "run `megatron-preflight inspect` on it",
                                 code=p.code if p.code == "inconsistent_shards" else "checkpoint")

    # -- the source as legacy shards -------------------------------------------------------------------------------
    @cached_property
    def _view(self) -> tuple[Layout, bool, OptimizerNotReshardable | None]:
        """(the legacy shards the source reads as, whether a torch_dist model-space optimizer state is there, why a
        dp_reshardable state cannot be read)."""
        lay = self.layout
        if lay.format not in (Format.TORCH_DIST, Format.FSDP_DTENSOR):
            return lay, False, None
        # a torch_dist checkpoint's view: its readers load only for one
        from megatron_preflight.reshard.sources.torch_dist import virtual_layout
        from megatron_preflight.reshard.sources.torch_dist_optimizer import attach_dp_reshardable

        view, model_space = virtual_layout(lay, trust=self.trust)
        if lay.format == Format.FSDP_DTENSOR and model_space and lay.common_state is not None and \
                "optimizer" not in lay.common_state:
            from megatron_preflight.reshard.sources.fsdp_dtensor import param_groups  # (read for such a source only)

            # read as the distributed optimizer's model-space form: its param groups from the per-parameter settings
            lay.common_state["optimizer"] = {"param_state_sharding_type": "fully_reshardable",
                                             "optimizer": {"param_groups": param_groups(lay.iter_dir or "",
                                                                                        trust=self.trust)}}
        problem = None
        if model_space and lay.dist_optimizer_sharding == "dp_reshardable":
            model_space = False  # the flat buckets: read as the legacy distrib_optim.pt they equal
            try:
                attach_dp_reshardable(lay, view, trust=self.trust)
            except OptimizerNotReshardable as e:
                problem = e
        return view, model_space, problem

    @property
    def view(self) -> Layout:
        """The checkpoint as legacy shards of the layout that saved it (a legacy checkpoint is its own view)."""
        return self._view[0]

    @cached_property
    def topology(self) -> ParallelLayout:
        """The source's parallel layout, completed from its shards."""
        return source_topology(self.view)

    @cached_property
    def tensors(self) -> GlobalIndex:
        """Every global tensor and every source piece of it (built once per process)."""
        _built[0] += 1
        return index_sources(self.view, self.topology, check=False)

    @cached_property
    def layer_groups(self) -> Groups:
        """The index's entries by layer and expert (:func:`~.plan.planner.by_layer`), made once: every resharder of
        the checkpoint index plans its ranks from them."""
        return by_layer(self.tensors)

    @cached_property
    def tied(self) -> bool:
        return is_tied(self.view)

    @cached_property
    def mtp(self) -> bool:
        """Whether the model has multi-token prediction layers (at PP > 1 the last stage holds its own embedding)."""
        return has_mtp(self.tensors)

    # -- the optimizer state ---------------------------------------------------------------------------------------
    @cached_property
    def optimizer(self) -> SourceOptimizer:
        """The source optimizer state, indexed once (see :class:`SourceOptimizer`)."""
        view, model_space, dp_problem = self._view
        saved = bool(view.distributed_optimizer)
        if dp_problem is not None:
            return SourceOptimizer(problem=dp_problem, saved_distributed=saved)
        try:
            found = self._source_optimizer(view, model_space, saved)
        except PreflightError as e:
            return SourceOptimizer(problem=e, saved_distributed=saved)
        for state in (found.plain, found.distributed):
            if state is not None:
                sections.adopt(state.fields, self.tensors)
        return found

    def _source_optimizer(self, view: Layout, model_space: bool, saved: bool) -> SourceOptimizer:
        # the distributed optimizer's and torch_dist's readers load only for such a checkpoint (a verdict stays fast)
        meta = view.shards[0].meta if view.shards else None
        if model_space:
            # (model space: converted to the plain form)
            from megatron_preflight.reshard.optimizer.convert import distributed_to_plain
            from megatron_preflight.reshard.sources.torch_dist_optimizer import index_dist_source_optimizer

            plain = distributed_to_plain(index_dist_source_optimizer(self.layout, view, self.topology,
                                                                     trust=self.trust), view, self.topology)
            return SourceOptimizer(plain=plain, saved_distributed=saved)
        if not isinstance(meta, dict) or "optimizer" not in meta:
            return SourceOptimizer(saved_distributed=saved)
        if view.distributed_optimizer:
            from megatron_preflight.reshard.optimizer.distributed import index_dist_optimizer  # (its own reader)

            return SourceOptimizer(distributed=index_dist_optimizer(view, self.topology, trust=self.trust),
                                   saved_distributed=saved)
        return SourceOptimizer(plain=index_optimizer(view, self.topology), saved_distributed=saved)

    @cached_property
    def fp8_extra_states(self) -> int:
        """How many module extra states hold Transformer Engine FP8 metadata (recipe, scales, amax history: more than
        the few bytes of an empty or pickled-None state), counted once per global module (metadata only)."""
        count = 0
        for entry in self.tensors.values():
            if entry.rule.kind != "extra":
                continue
            ref = entry.first().ref
            shape = getattr(ref, "shape", None)
            if shape is not None and len(shape) == 1 and int(shape[0]) > FP8_MIN_BYTES:
                count += 1
        return count

    @cached_property
    def adam_family(self) -> str | None:
        """The Adam implementation that saved the optimizer state ("torch" or "fused"; see
        :mod:`.optimizer.family`): from the param groups in the first file's header or the common state, else from
        the indexed state; None without a readable state."""
        lay = self.layout
        head = lay.common_state if lay.format in (Format.TORCH_DIST, Format.FSDP_DTENSOR) else (
            lay.shards[0].meta if lay.shards else None)
        found = saved_family(head.get("optimizer")) if isinstance(head, dict) else None
        if found is not None:
            return found
        source = self.optimizer
        state = source.plain or source.distributed
        return family_of([state.settings[s] for s in state.order]) if state is not None else None

    @cached_property
    def optimizer_status(self) -> OptimizerStatus | None:
        """What inspect and check say of the optimizer state (asked once per process)."""
        return optimizer_status(self.layout, index=self)

    def step_of(self, plain: OptimizerIndex | None) -> float:
        """The optimizer step of a plain state (kept per parameter; the distributed one keeps it per group): read from
        the first parameter that has one (memoised per state)."""
        if plain is None:
            return 0.0
        key = id(plain)
        if key not in self._steps:
            per_group = [g["step"] for g in plain.settings.values() if "step" in g]  # a fused Adam's
            self._steps[key] = next((self._number(p) for fields in plain.fields.values()
                                     if isinstance(p := fields.get("step"), SourcePiece)),
                                    float(per_group[0]) if per_group else 0.0)
        return self._steps[key]

    def _number(self, piece: SourcePiece) -> float:
        if not isinstance(piece.ref, TensorRef):
            return float(piece.ref)
        files = SourceFiles(self.view.iter_dir or "", trust=self.trust)
        try:
            value = files.item(piece.shard, piece.ref)  # a number (from a legacy file: without torch)
            if isinstance(value, TensorRef):
                raise PreflightError(f"the optimizer's step of {piece.shard} is not one number",
                                     path=self.view.iter_dir, code="optimizer",
                                     fix="pass --drop-optimizer / start with --no-load-optim")
            return float(value)
        finally:
            files.close()

    @cached_property
    def model_problems(self) -> list[PreflightError]:
        """Why the indexed model cannot be resharded: a split tensor missing a rank's piece, pieces that disagree,
        shards that contradict their saved args (computed once per process: each resharder of it asks)."""
        return complete_problems(self.tensors, self.view) + args_problems(self.tensors, self.view)

    def source_problem(self) -> str | None:
        """Why the resharder could not serve a torch_dist checkpoint with its optimizer state (None: it can):
        the model's keys and the optimizer's form indexed as the resharder will, without tensor bytes."""
        try:
            view = self.view
            problems = complete_problems(self.tensors, view)
            if problems:
                raise problems[0]
            opt = self.optimizer
            if opt.problem is not None:
                raise opt.problem
        except PreflightError as exc:
            return exc.message
        return None


def open_index(checkpoint: str | os.PathLike | Layout | CheckpointIndex, *, iteration: int | str | None = None,
               trust_checkpoint: bool = False, shards: str = "all", reader: Any = None) -> CheckpointIndex:
    """THE way into a checkpoint: discovered (``shards``: see :func:`~megatron_preflight.layout.discover.discover`),
    its consistency checked, indexed on demand. A Layout (e.g. sent by rank 0) or an index is taken as is."""
    if isinstance(checkpoint, CheckpointIndex):
        return checkpoint
    if isinstance(checkpoint, Layout):
        return CheckpointIndex(checkpoint, trust=trust_checkpoint)
    layout = discover(checkpoint, iteration=iteration, trust_checkpoint=trust_checkpoint, shards=shards,
                      reader=reader)
    return CheckpointIndex(layout, trust=trust_checkpoint)

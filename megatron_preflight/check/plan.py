"""The pre-flight plan: findings, the loader to use, and the verdict — as data, for the CLI and the Megatron hook."""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from megatron_preflight import parallel, reshard  # reshard: its modules load on first use (a lazy package)
from megatron_preflight.check import advice
from megatron_preflight.check.batches import batch_findings
from megatron_preflight.check.compare import check_runtime_layout, compare_architecture
from megatron_preflight.check.data import data_findings
from megatron_preflight.check.ddp_buckets import bucket_findings
from megatron_preflight.check.findings import Finding, Severity
from megatron_preflight.check.fsdp import fsdp_findings
from megatron_preflight.check.hf_model import hf_findings
from megatron_preflight.check.memory import memory_findings
from megatron_preflight.check.param_groups import param_group_findings
from megatron_preflight.check.runtime_args import RuntimeArgs, from_mapping, from_namespace
from megatron_preflight.check.save import save_findings
from megatron_preflight.check.schedule import horizon_findings, schedule_findings, scheduler_flag_findings
from megatron_preflight.check.tokenizer import tokenizer_findings
from megatron_preflight.check.verdict import Loader, Verdict
from megatron_preflight.errors import PreflightError
from megatron_preflight.layout import optimizer_entry, optimizer_kinds
from megatron_preflight.layout.model import Format, Layout
from megatron_preflight.reshard.plan import drift

log = logging.getLogger(__name__)

FATAL, RESHARD, INFO = Severity.FATAL, Severity.RESHARD, Severity.INFO
UNKNOWN_KEY = "unknown_key"  # a checkpoint tensor no split rule covers (reshard/plan/rules.py)

# Optimizer sharding types Megatron's DistributedOptimizer can reload across a (TP, PP) change.
FULLY_RESHARDABLE = {"fully_reshardable", "fully_sharded_model_space", "fsdp_dtensor"}
# torch_dist distributed-optimizer forms the resharder reads (reshard/dist_source_optimizer.py)
READABLE_DIST_OPTIMIZER = {"fully_reshardable", "fully_sharded_model_space", "dp_reshardable"}


@dataclass
class Plan:
    verdict: Verdict
    loader: Loader | None
    findings: list[Finding]
    index: reshard.CheckpointIndex  # the checkpoint as read and indexed: the loader and the cost line reuse it
    runtime: RuntimeArgs
    load_optimizer: bool = True
    load_rng: bool = True
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    cost: Any = None  # reshard.cost.Prediction of the in-memory reshard, for a reshard verdict
    memory: list[dict[str, Any]] = field(default_factory=list)  # per rank of the run's layout: predicted bytes

    @property
    def layout(self) -> Layout:
        return self.index.layout

    @property
    def fatal(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == FATAL]

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict.value,
            "loader": self.loader.value if self.loader else None,
            "findings": [f.to_json() for f in self.findings],
            "load_optimizer": self.load_optimizer,
            "load_rng": self.load_rng,
            "seconds": round(self.seconds, 4),
            "notes": self.notes,
            "cost": self.cost.to_json() if self.cost is not None else None,
            "memory": self.memory,
            "layout": self.layout.to_json(),
        }


def _layout_findings(layout: Layout, rt: RuntimeArgs) -> tuple[list[Finding], bool]:
    """Parallel-layout differences (reshard) and whether any model-sharding size differs."""
    out: list[Finding] = []
    saved = layout.saved_args
    moe = bool(getattr(saved, "num_experts", None)) if saved is not None else bool(layout.ep and layout.ep > 1)
    ck_first = getattr(saved, "decoder_first_pipeline_num_layers", None) if saved is not None else None
    ck_last = getattr(saved, "decoder_last_pipeline_num_layers", None) if saved is not None else None
    pairs = [
        ("tensor_model_parallel_size", layout.tp, rt.tp),
        ("pipeline_model_parallel_size", layout.pp, rt.pp),
        ("expert_model_parallel_size", layout.ep, rt.ep),
        ("virtual_pipeline_model_parallel_size", layout.vpp, rt.vpp),
        ("decoder_first_pipeline_num_layers", ck_first, rt.decoder_first_pipeline_num_layers),
        ("decoder_last_pipeline_num_layers", ck_last, rt.decoder_last_pipeline_num_layers),
    ]
    if (layout.pp or 1) > 1 or rt.pp > 1:  # where the embedding / loss count as a layer (moves layers between stages)
        for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
            ck = bool(getattr(saved, name, False)) if saved is not None else False
            pairs.append((name, ck and (layout.pp or 1) > 1, getattr(rt, name) and rt.pp > 1))
    if moe:
        pairs.append(("expert_tensor_parallel_size", layout.etp, rt.etp))
    ck_layout = getattr(saved, "pipeline_model_parallel_layout", None) if saved is not None else None
    if (ck_layout is not None or rt.pipeline_model_parallel_layout is not None) and placement_moved(layout, rt):
        # where each layer sits, not only the sizes: the same PP with another placement moves layers between stages
        # (Megatron's legacy loader then fails after the build: "Number of unpadded elements must be same ...")
        pairs.append(("pipeline_model_parallel_layout", parallel.expand_pipeline_layout(ck_layout),
                      parallel.expand_pipeline_layout(rt.pipeline_model_parallel_layout)))
    changed = False
    for name, ck, run in pairs:
        if ck is None and name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                   "expert_model_parallel_size", "expert_tensor_parallel_size"):
            continue
        if ck != run:
            changed = True
            if layout.format == Format.TORCH:
                shown = [_even(name, v) for v in (ck, run)]
                msg = (f"the parallel layout differs ({name}: checkpoint {shown[0]}, run {shown[1]}); Megatron's own "
                       "legacy loader cannot load it (it fails with an assert, a size mismatch, or exits 0 with "
                       "'could not load the checkpoint')")
                fix = ("megatron-preflight reshards it in memory at load (--preflight auto), or offline: "
                       + advice.offline_fix(layout, rt))
            else:
                msg = (f"the parallel layout differs ({name}: checkpoint {ck}, run {run}); "
                       f"{layout.format.value if layout.format else 'the'} format reshards model weights at load")
                fix = ""
            out.append(Finding(name, ck, run, RESHARD, msg, fix))
    if changed and layout.format == Format.TORCH and rt.pipeline_model_parallel_layout:
        try:
            parallel.flexible_target(rt.pipeline_model_parallel_layout, rt.pp)
        except parallel.LayoutError as e:
            keep = f"run with the checkpoint's placement (--pipeline-model-parallel-layout '{ck_layout}'), or " \
                if ck_layout is not None and (layout.pp or 1) == rt.pp else ""
            out.append(Finding("pipeline_model_parallel_layout", ck_layout, rt.pipeline_model_parallel_layout, FATAL,
                               e.message, f"{keep}{e.fix}"))
    if rt.cp != (layout.cp or 1):
        dopt = " (and a saved distributed optimizer state, whose shard domain is DP x CP: read whole, re-sharded " \
            "over the run's DP x CP; the bucket size rule is checked as ddp_bucket_size)" if (
                layout.distributed_optimizer or layout.dist_optimizer_sharding) else ""
        out.append(Finding("context_parallel_size", layout.cp, rt.cp, INFO,
                           f"context parallelism does not shard weights: they load as saved{dopt}", ""))
    return out, changed


def _state_findings(index: reshard.CheckpointIndex, rt: RuntimeArgs, changed: bool) -> tuple[list[Finding], bool, bool]:
    """Optimizer and RNG state: what can be carried across, and what must be dropped (never silently)."""
    layout = index.layout
    out: list[Finding] = []
    skip_optim = rt.no_load_optim or rt.finetune
    skip_rng = rt.no_load_rng or rt.finetune
    load_optim, load_rng = not skip_optim, not skip_rng
    saved = layout.saved_args
    ck_dopt = bool(layout.distributed_optimizer)
    has_optim = True
    if layout.format == Format.HF:  # weights only: Megatron loads a release checkpoint without optimizer or RNG
        out.append(Finding("optimizer", "none (a Hugging Face model)", "fresh", INFO,
                           "weights only: the optimizer and the RNG start fresh and the run starts at iteration 0",
                           ""))
        return out, False, False
    if layout.format == Format.TORCH and layout.shards and layout.shards[0].meta is not None:
        has_optim = "optimizer" in layout.shards[0].meta
    elif layout.common_state is not None:
        has_optim = "optimizer" in layout.common_state or layout.dist_optimizer_sharding is not None
    if not has_optim and load_optim:
        out.append(Finding("optimizer", "absent", "load", INFO,
                           "the checkpoint has no optimizer state (saved with --no-save-optim); Megatron starts the "
                           "optimizer fresh", "add --no-load-optim to say so explicitly"))
        load_optim = False
    if load_optim:
        kind_findings = _optimizer_kind(index, rt, changed)
        out.extend(kind_findings)
        if any(f.severity == FATAL for f in kind_findings):
            load_optim = False  # (one finding says why; the layout ones below would repeat it)
    if load_optim and layout.format == Format.TORCH_DIST and \
            layout.dist_optimizer_sharding == "fully_sharded_model_space" and rt.loads_flattened_range is not True:
        out.append(_flattened_range(index, rt))
    if load_optim and ck_dopt != rt.use_distributed_optimizer and layout.format == Format.TORCH and \
            _convertible(index):
        out.append(Finding("use_distributed_optimizer", ck_dopt, rt.use_distributed_optimizer, RESHARD,
                           "the optimizer state was saved by the "
                           + ("distributed optimizer; the run uses the plain one" if ck_dopt else
                              "plain optimizer; the run uses the distributed one")
                           + ": it is converted (fp32 masters, exp_avg, exp_avg_sq, step)", ""))
    elif load_optim and ck_dopt != rt.use_distributed_optimizer and layout.format == Format.TORCH:
        out.append(Finding("use_distributed_optimizer", ck_dopt, rt.use_distributed_optimizer, FATAL,
                           "the optimizer state was saved by "
                           + ("the distributed optimizer (distrib_optim.pt)" if ck_dopt else "the plain optimizer")
                           + " and cannot be loaded by the other one",
                           ("add --use-distributed-optimizer" if ck_dopt else "remove --use-distributed-optimizer")
                           + ", or add --no-load-optim to start the optimizer fresh"))
    if changed and load_optim:
        if layout.format == Format.TORCH:
            status = index.optimizer_status
            problem = status.reason if status is not None and not status.reshardable else None
            if any(p.code == UNKNOWN_KEY for p in layout.problems):
                pass  # the weights cannot be resharded either: one finding says why (_unknown_key_findings)
            elif problem is None and status is not None and not status.in_memory:
                out.append(Finding("optimizer", "distributed", "load", FATAL,
                                   "the distributed optimizer's state (distrib_optim.pt) follows a layout change "
                                   "offline, not yet in memory: Megatron would look for distrib_optim.pt of the "
                                   "run's layout",
                                   "reshard offline first (it carries the state): " + advice.offline_fix(layout, rt)
                                   + "; or add --no-load-optim (and keep the weights)"))
            elif problem is None:
                kind = status.kind if status is not None else "plain"
                held = optimizer_kinds.describe_chain(saved, _saved_groups(layout))
                what = ("the distributed optimizer's state (distrib_optim.pt: fp32 masters, exp_avg, exp_avg_sq) is "
                        "resharded with the weights and laid out in the run's DDP buffers" if kind == "distributed"
                        else f"the plain optimizer's state ({held}, and the fp32 master copies of a bf16/fp16 run) is "
                        "resharded with the weights, by the same split rules")
                out.append(Finding("optimizer", kind, "resharded", RESHARD, what, ""))
            else:
                out.append(Finding("optimizer", "saved", "load", FATAL,
                                   f"the layout changes and the optimizer state cannot be carried across ({problem}); "
                                   "it would have to be dropped",
                                   "add --no-load-optim (and keep the weights), or --finetune"))
        elif layout.format == Format.FSDP_DTENSOR:
            pass  # Megatron-FSDP reloads it at any DP/TP/EP; a 3D run loads it through the resharder (check/fsdp.py)
        elif ck_dopt or layout.dist_optimizer_sharding:
            sharding = layout.dist_optimizer_sharding or "dp_reshardable"
            tp_pp_change = (layout.tp, layout.pp) != (rt.tp, rt.pp) or placement_moved(layout, rt)
            ep_change = (layout.ep or 1) != rt.ep or ((layout.etp or layout.tp) != rt.etp and
                                                       bool(getattr(saved, "num_experts", None)))
            if tp_pp_change and sharding not in FULLY_RESHARDABLE:
                out.append(_megatron_refuses(
                    index, rt, sharding, f"TP{rt.tp} PP{rt.pp}",
                    f"Megatron fails here with '(TP, PP) mismatch after resume ... not supported for "
                    f"DistributedOptimizer with sharding type {sharding}'", readable=sharding == "dp_reshardable",
                    other="add --no-load-optim; or re-save at the old layout with "
                          "--dist-ckpt-optim-fully-reshardable and load that"))
            elif ep_change:
                out.append(_megatron_refuses(
                    index, rt, f"EP{layout.ep}", f"EP{rt.ep}",
                    "an expert-parallel change with a torch_dist optimizer state fails in Megatron "
                    "('Could not find parameter group with key ...')",
                    readable=layout.format == Format.TORCH_DIST and sharding in READABLE_DIST_OPTIMIZER,
                    other="add --no-load-optim"))
        elif layout.format in (Format.TORCH_DIST, Format.ZARR):
            ep_change = (layout.ep or 1) != rt.ep
            if ep_change and has_optim:
                out.append(_megatron_refuses(
                    index, rt, f"EP{layout.ep}", f"EP{rt.ep}",
                    "an expert-parallel change with a torch_dist optimizer state fails in Megatron "
                    "('Could not find parameter group with key ...')", readable=layout.format == Format.TORCH_DIST,
                    other="add --no-load-optim"))
    if changed and layout.format == Format.TORCH and not layout.problems and index.fp8_extra_states and \
            ((layout.tp or 1) != rt.tp or (layout.etp or layout.tp or 1) != rt.etp):
        out.append(Finding("fp8_extra_state", index.fp8_extra_states, "re-split", INFO,
                           f"{index.fp8_extra_states} Transformer Engine modules hold FP8 scaling state (scales, amax "
                           "history, per rank); the tensors are re-split, so every rank gets TP rank 0's, as "
                           "Megatron's own torch_dist reshard gives it; TE's delayed scaling replaces it from the "
                           "next steps' amax history", ""))
    drifting = drift.causes(saved) if changed and layout.format == Format.TORCH else []
    if drifting:
        out.append(Finding("replicas", "drift", "TP rank 0's copy", INFO,
                           f"Megatron lets some TP copies of this model differ ({'; '.join(drifting)}); the reshard "
                           "uses TP rank 0's copy of them, as Megatron's own torch_dist save does, and reports the "
                           "drift it measures. Any other copy that disagrees stops it", ""))
    if changed and load_rng:
        out.append(Finding("rng_state", f"TP{layout.tp} PP{layout.pp}", f"TP{rt.tp} PP{rt.pp}", INFO,
                           "RNG states are per (TP, PP) rank and cannot be mapped to another layout: they are not "
                           "loaded (as with --no-load-rng); training continues with fresh RNG streams",
                           "add --no-load-rng to silence this"))
        load_rng = False
    if skip_optim:
        out.append(Finding("optimizer", "saved", "not loaded", INFO,
                           "--no-load-optim/--finetune: the optimizer state is not loaded", ""))
    return out, load_optim, load_rng


def _gtp_findings(layout: Layout, rt: RuntimeArgs, changed: bool) -> list[Finding]:
    """Generalized tensor parallelism: a checkpoint saved with it, or a run that uses it, at another layout."""
    saved = layout.saved_args
    if saved is None or layout.format in (Format.HF, Format.FSDP_DTENSOR):
        return []
    tp, etp = layout.tp or 1, layout.etp or layout.tp or 1
    ck = parallel.gtp_sizes(saved, tp, etp)
    run = parallel.gtp_sizes({"tensor_parallel_num_weight_shards":
                    rt.tensor_parallel_num_weight_shards, "expert_tensor_parallel_num_weight_shards":
                    rt.expert_tensor_parallel_num_weight_shards}, rt.tp, rt.etp)
    if ck == (1, 1) and run == (1, 1):
        return []
    if ck == run and not changed:
        return [Finding("tensor_parallel_num_weight_shards", f"GTP{ck[0]} expert GTP{ck[1]}",
                        f"GTP{run[0]} expert GTP{run[1]}", INFO,
                        "generalized tensor parallelism, as saved: Megatron loads it itself", "")]
    as_saved = f"--tensor-model-parallel-size {tp} --tensor-parallel-num-weight-shards {tp * ck[0]}" + (
        f" --expert-tensor-parallel-size {etp} --expert-tensor-parallel-num-weight-shards {etp * ck[1]}"
        if ck[1] > 1 else "")
    return [Finding("tensor_parallel_num_weight_shards", f"TP{tp} GTP{ck[0]} (expert ETP{etp} GTP{ck[1]})",
                    f"TP{rt.tp} GTP{run[0]} (expert ETP{rt.etp} GTP{run[1]})", FATAL,
                    "generalized tensor parallelism (Megatron-LM main's --tensor-parallel-num-weight-shards) splits "
                    "each weight over TP x GTP; megatron-preflight does not reshard across it yet (its saved offsets "
                    "are composite, tp_rank x GTP + gtp_rank: no GTP checkpoint could be written to prove a reshard, "
                    "GTP needs Transformer Engine >= 2.19)",
                    f"run at the saved split ({as_saved}) and the same other sizes")]


def _saved_groups(layout: Layout) -> list[dict[str, Any]] | None:
    """The saved optimizer's param groups (legacy: rank 0's file; torch_dist: the common state)."""
    if layout.format == Format.TORCH and layout.shards and isinstance(layout.shards[0].meta, dict):
        return optimizer_entry.param_groups(layout.shards[0].meta.get("optimizer"))
    common = layout.common_state
    return optimizer_entry.param_groups(common.get("optimizer")) if isinstance(common, dict) else None


def _optimizer_kind(index: reshard.CheckpointIndex, rt: RuntimeArgs, changed: bool) -> list[Finding]:
    """The saved optimizer's kind against the run's (layout/optimizer_kinds.py), and what a kind decides about the
    load: SGD's torch_dist state, which Megatron cannot load; SOAP's per-shard preconditioners at another TP/ETP."""
    layout = index.layout
    saved_args = layout.saved_args
    if saved_args is None or layout.format == Format.HF:
        return []
    try:
        saved = optimizer_kinds.primary_of(saved_args)
    except PreflightError as e:  # a kind the table does not know: Megatron loads it as saved; only a reshard needs it
        return [Finding("optimizer", getattr(saved_args, "optimizer", None), rt.optimizer, FATAL, e.message,
                        "add --no-load-optim (and keep the weights), or run at the saved layout")] if changed else []
    out: list[Finding] = []
    if "optimizer" in rt.given:
        try:
            run = optimizer_kinds.kind_named(rt.optimizer)
        except PreflightError:
            run = None  # a kind we do not know: Megatron says what it accepts
        if run is not None and run != saved:
            out.append(Finding(
                "optimizer", saved.name, run.name, FATAL,
                f"the checkpoint's optimizer state is {saved.describe()}'s; the run builds {run.name}, whose state "
                "differs: Megatron would load it into the wrong optimizer (or fail after the build)",
                f"run with --optimizer {getattr(saved_args, 'optimizer', saved.name)}, or add --no-load-optim (keep "
                f"the weights, start {run.name}'s state fresh)"))
            return out
    if saved.has_local and changed and layout.format == Format.TORCH and (
            (layout.tp or 1) != rt.tp or (layout.etp or layout.tp or 1) != rt.etp):
        out.append(Finding("optimizer", f"{saved.name} TP{layout.tp} ETP{layout.etp or layout.tp}",
                           f"TP{rt.tp} ETP{rt.etp}", FATAL,
                           f"{saved.exact_note}: they cannot follow a change of TP or ETP (each shard's matrices are "
                           "not pieces of a global one); a PP / DP / EP change at the same TP and ETP carries them",
                           f"keep --tensor-model-parallel-size {layout.tp}"
                           f"{'' if layout.etp in (None, layout.tp) else f' --expert-tensor-parallel-size {layout.etp}'}"
                           ", or add --no-load-optim (keep the weights, start the optimizer fresh)"))
    if not saved.torch_dist_loads and layout.format == Format.TORCH_DIST and not layout.dist_optimizer_sharding \
            and rt.ckpt_format != "torch" and not rt.use_megatron_fsdp:
        problem = index.source_problem()
        fails = ("Megatron's torch_dist load of an SGD optimizer state fails after the model and the optimizer are "
                 "built, at any layout ('TypeError: NoneType object is not callable': SGD has no init_state_fn in its "
                 "sharded_state_dict)")
        convert = advice.offline_fix(layout, rt, "--ckpt-format", "torch", load_flags="--ckpt-format torch")
        if problem is None:
            out.append(Finding("optimizer", "sgd (torch_dist)", "resharded", RESHARD,
                               f"{fails}; the in-memory resharder reads it, so --preflight auto loads the weights and "
                               "the momentum through it", f"run with --preflight auto; or convert it once to the "
                               f"legacy form, which Megatron loads: {convert}"))
        else:
            out.append(Finding("optimizer", "sgd (torch_dist)", "not loadable", FATAL,
                               f"{fails}, and the in-memory resharder cannot serve it either ({problem})",
                               "add --no-load-optim (and keep the weights)"))
    return out


def _even(name: str, value: Any) -> Any:
    """How a size or placement reads in a message (no flexible layout: the even split)."""
    return "none (the even split)" if name == "pipeline_model_parallel_layout" and value is None else value


def placement_moved(layout: Layout, rt: RuntimeArgs) -> bool:
    """The run places layers elsewhere than the checkpoint holds them (a --pipeline-model-parallel-layout on either
    side, or none: Megatron's split rules; compared as :func:`parallel.placement`, so a string that spells the even
    split is no change)."""
    saved = layout.saved_args
    ck_text = getattr(saved, "pipeline_model_parallel_layout", None) if saved is not None else None
    if ck_text is None and rt.pipeline_model_parallel_layout is None:
        return False
    ck, run = (parallel.placement(saved) if saved is not None else None), parallel.placement(rt)
    if ck is None or run is None:  # the split rules cannot place one side: compare the strings
        return parallel.expand_pipeline_layout(ck_text) != \
            parallel.expand_pipeline_layout(rt.pipeline_model_parallel_layout)
    return ck != run


def _flattened_range(index: reshard.CheckpointIndex, rt: RuntimeArgs) -> Finding:
    """A fully_sharded_model_space optimizer state (the default of megatron-core <= 0.14's distributed optimizer):
    megatron-core >= 0.16 refuses it inside load_checkpoint, at any layout. The resharder reads it: in a Megatron that
    cannot, ``--preflight auto`` loads it in memory (a reshard finding); offline, converting it once carries it."""
    layout = index.layout
    convert = ("convert it once to the fully_reshardable form, which it loads at any TP/PP: "
               + advice.offline_fix(layout, rt, "--ckpt-format", "torch_dist", load_flags="--ckpt-format torch_dist"))
    why = ("the distributed optimizer's state is saved in the fully_sharded_model_space form (flattened ranges: the "
           "default of megatron-core <= 0.14)")
    fails = ("load_checkpoint fails after the model and optimizer are built ('ShardedTensor.flattened_range is not "
             "supported', or, for a checkpoint saved without content metadata, 'Missing key in checkpoint state_dict: "
             "optimizer.distributed.dp_group_idx_0...')")
    if rt.loads_flattened_range is False:
        problem = index.source_problem()
        if problem is None:
            return Finding("optimizer", "fully_sharded_model_space", "resharded", RESHARD,
                           f"{why}; this Megatron's megatron-core no longer reads it ({fails}); the in-memory "
                           "resharder reads it, so --preflight auto loads the weights and the optimizer state "
                           "through it", f"run with --preflight auto; or {convert}")
        return Finding("optimizer", "fully_sharded_model_space", "not loadable", FATAL,
                       f"{why}; this Megatron's megatron-core no longer reads it ({fails}), and the in-memory "
                       f"resharder cannot serve it either ({problem})", "add --no-load-optim (and keep the weights)")
    return Finding("optimizer", "fully_sharded_model_space", "load", INFO,
                   f"{why}: a Megatron with megatron-core >= 0.16 (Megatron-LM main) no longer reads it: its "
                   f"{fails}", f"on such a Megatron, run with --preflight auto; or {convert}; or add "
                   "--no-load-optim (and keep the weights)")


_FAMILIES = {"torch": "torch's Adam/AdamW (a step per parameter)",
             "fused": "a fused Adam (TE's or apex's FusedAdam: one step per param group, bias_correction)"}


def _family_findings(index: reshard.CheckpointIndex, rt: RuntimeArgs) -> list[Finding]:
    """The run builds another Adam than the one that saved the state (TE or apex installed on one side only):
    Megatron's loader takes the saved param groups as they are, and the first step fails (KeyError:
    'bias_correction') or Adam's step restarts; the resharder converts the state, step kept."""
    if rt.no_load_optim or rt.finetune or rt.optimizer_family is None:
        return []
    ck = index.adam_family
    if ck is None or ck == rt.optimizer_family:
        return []
    layout = index.layout
    why = (f"the optimizer state was saved by {_FAMILIES[ck]}; the run builds {_FAMILIES[rt.optimizer_family]}. "
           "Megatron's loader takes the saved param groups as they are: the first step fails (KeyError: "
           "'bias_correction') or Adam's step count is lost")
    problem = index.optimizer.problem
    if problem is not None:
        return [Finding("optimizer_family", ck, rt.optimizer_family, FATAL,
                        f"{why}; the resharder cannot convert it ({problem.message})",
                        "add --no-load-optim (and keep the weights)")]
    return [Finding("optimizer_family", ck, rt.optimizer_family, RESHARD,
                    f"{why}; the resharder converts it (exp_avg, exp_avg_sq and masters as they are, the step kept)",
                    "run with --preflight auto (converted in memory); or offline: "
                    + advice.offline_fix(layout, rt, "--optimizer-family", rt.optimizer_family))]


def _convertible(index: reshard.CheckpointIndex) -> bool:
    status = index.optimizer_status
    return status is not None and status.reshardable


def optimizer_toggled(layout: Layout, rt: RuntimeArgs) -> bool:
    """The run toggles --use-distributed-optimizer against a legacy checkpoint whose optimizer state it loads: only
    the resharder can serve that (a conversion), even at the same layout."""
    if layout.format != Format.TORCH or rt.no_load_optim or rt.finetune or not layout.shards:
        return False
    meta = layout.shards[0].meta
    return isinstance(meta, dict) and "optimizer" in meta and \
        bool(layout.distributed_optimizer) != rt.use_distributed_optimizer


def _format_findings(layout: Layout, rt: RuntimeArgs) -> list[Finding]:
    out: list[Finding] = []
    fmt = layout.format
    if fmt is None:
        return out
    if fmt == Format.ZARR:
        out.append(Finding("ckpt_format", "zarr", rt.ckpt_format, FATAL,
                           "zarr checkpoints were removed from megatron-core 0.15+: current Megatron cannot load them",
                           "convert with an older Megatron: --ckpt-convert-format torch_dist --ckpt-convert-save DIR"))
    elif fmt in (Format.TORCH_DIST,) and rt.ckpt_format == "torch" and not rt.auto_detect_ckpt_format:
        out.append(Finding("ckpt_format", fmt.value, "torch", FATAL,
                           "Megatron raises 'Detected load from a distributed checkpoint, but neither --use-dist-ckpt "
                           "nor --auto-detect-ckpt-format is set'",
                           "add --auto-detect-ckpt-format or set --ckpt-format torch_dist (the hook does this for you)"))
    elif fmt == Format.TORCH and rt.ckpt_format != "torch":
        out.append(Finding("ckpt_format", "torch", rt.ckpt_format, INFO,
                           "legacy checkpoint, run saves in another format: Megatron auto-detects it on load "
                           "(and never compares TP/PP then)", ""))
    elif fmt == Format.HF:
        return out + hf_findings(layout, rt) + (
            [Finding("use_megatron_fsdp", "hf", True, FATAL, "a Megatron-FSDP run loads fsdp_dtensor checkpoints "
                     "only, and megatron-preflight serves a Hugging Face model to 3D-parallel runs",
                     "convert it first: " + advice.offline_fix(layout, rt, "--ckpt-format", "fsdp_dtensor"))]
            if rt.use_megatron_fsdp else [])
    elif fmt == Format.TORCH_DCP and rt.ckpt_format != fmt.value:
        out.append(Finding("ckpt_format", fmt.value, rt.ckpt_format, FATAL,
                           f"a {fmt.value} checkpoint is only loaded with --ckpt-format {fmt.value}",
                           f"set --ckpt-format {fmt.value}"))
    return out + fsdp_findings(layout, rt)


def _problem_findings(layout: Layout, rt: RuntimeArgs) -> list[Finding]:
    out = []
    for p in layout.problems:
        if p.code == "no_tracker" and rt.ckpt_step is not None:
            continue
        if p.code == UNKNOWN_KEY:
            continue  # fatal only where the load reshards: see _unknown_key_findings
        if p.code == "bad_tracker" and rt.ckpt_step is not None:
            continue
        out.append(Finding(p.code, None, None, FATAL, f"{p.path}: {p.message.rstrip('.')}",
                           p.fix or "run `megatron-preflight inspect` on the checkpoint"))
    if layout.format is None and not layout.problems:
        out.append(Finding("checkpoint", None, layout.path, FATAL, "this is not a Megatron checkpoint",
                           "pass the --load dir of a Megatron run"))
    return out


def _unknown_key_findings(layout: Layout, loader: Loader | None) -> list[Finding]:
    """A tensor the split-rule table does not know (another model type, a newer Megatron) blocks only a reshard of
    ours: Megatron's own loaders read it at the saved layout, and its dist loader at any."""
    out = []
    for p in layout.problems:
        if p.code != UNKNOWN_KEY:
            continue
        if loader == Loader.RESHARD:
            out.append(Finding(p.code, None, None, FATAL, f"{p.path}: {p.message.rstrip('.')}", p.fix or ""))
        else:
            out.append(Finding(p.code, None, None, INFO, f"{p.path}: {p.message.rstrip('.')}: Megatron's own "
                               f"{'dist ' if loader == Loader.DIST else ''}loader reads it as saved; megatron-preflight "
                               "could not reshard it", ""))
    return out


def plan_from_layout(checkpoint: Layout | reshard.CheckpointIndex, rt: RuntimeArgs, t0: float | None = None) -> Plan:
    """The plan for loading a discovered checkpoint (its index is built here, or reused) with the run's args."""
    t0 = time.perf_counter() if t0 is None else t0
    index = reshard.open_index(checkpoint)
    layout = index.layout
    findings: list[Finding] = []
    memory: list[dict[str, Any]] = []  # the predicted bytes of each rank of the run's layout (check/memory.py)
    findings += _problem_findings(layout, rt)
    findings += check_runtime_layout(rt)
    if layout.format is not None:
        findings += _format_findings(layout, rt)
        findings += compare_architecture(layout, rt)
        lay, changed = _layout_findings(layout, rt)
        lay += _gtp_findings(layout, rt, changed)
        family = _family_findings(index, rt)
        renamed = any(f.severity == RESHARD for f in findings
                      if f.field in ("transformer_impl", "moe_grouped_gemm", "mtp_layer_name", "hybrid_layer_pattern",
                                   "mamba_conv_name"))
        changed = changed or renamed or any(f.severity == RESHARD for f in family) or \
            (optimizer_toggled(layout, rt) and _convertible(index))
        findings += lay + family + bucket_findings(layout, rt, same_layout=not changed)
        findings += schedule_findings(layout, rt) + horizon_findings(layout, rt) + save_findings(layout, rt)
        findings += scheduler_flag_findings(rt) + param_group_findings(layout, rt)
        findings += batch_findings(layout, rt) + data_findings(rt) + tokenizer_findings(rt)
        if not any(f.severity == FATAL for f in findings):  # a run that will not start needs no memory figure
            mem, ranks = memory_findings(index, rt)
            findings += mem
            memory = [m.to_json() for m in ranks]
        state, load_optim, load_rng = _state_findings(index, rt, changed)
        findings += state
    else:
        changed, load_optim, load_rng = False, False, False
    if layout.format == Format.HF:
        loader = Loader.RESHARD  # Megatron cannot read it: each rank's weights built from the safetensors
    elif rt.use_megatron_fsdp and layout.format in (Format.TORCH, Format.TORCH_DIST):
        loader = Loader.RESHARD  # served to Megatron-FSDP's load as its fsdp_dtensor form (hook/fsdp_load.py)
    elif layout.format == Format.TORCH:
        loader = Loader.RESHARD if changed else (Loader.EP_3D if (layout.ep or 1) > 1 else Loader.NON_EP)
    elif layout.format == Format.TORCH_DIST and any(f.field in ("optimizer", "optimizer_family", "transformer_impl")
                                                    and f.severity == RESHARD for f in findings):
        loader = Loader.RESHARD  # Megatron's dist loader would refuse it (see _megatron_refuses)
    elif layout.format == Format.FSDP_DTENSOR and (not rt.use_megatron_fsdp or any(
            f.field in ("mtp_layer_name", "padded_vocab_size") and f.severity == RESHARD for f in findings)):
        loader = Loader.RESHARD  # a 3D-parallel run; or MTP names or vocab padding Megatron-FSDP would not load
    elif layout.format is not None:
        loader = Loader.DIST
    else:
        loader = None
    findings += _unknown_key_findings(layout, loader)
    if any(f.severity == FATAL for f in findings):
        verdict = Verdict.FAIL
    elif loader == Loader.RESHARD:
        verdict = Verdict.RESHARD
    else:
        verdict = Verdict.LOAD
    order = {FATAL: 0, RESHARD: 1, INFO: 2}
    findings.sort(key=lambda f: order[f.severity])
    plan = Plan(verdict, loader, findings, index, rt, load_optimizer=load_optim, load_rng=load_rng, memory=memory)
    if verdict == Verdict.RESHARD and rt.use_megatron_fsdp:
        plan.notes.append("reshard cost: each rank reads the whole checkpoint once (Megatron-FSDP shards every "
                          "parameter over the data-parallel ranks); the offline conversion reads it once in all")
    elif verdict == Verdict.RESHARD:
        _predict_cost(plan)
    plan.seconds = time.perf_counter() - t0
    return plan


def _predict_cost(plan: Plan) -> None:
    """What the in-memory reshard will cost each rank (metadata only: the resharder's plans, no tensor bytes)."""
    if plan.layout.sampled:
        plan.notes.append("reshard cost not predicted: the shards were sampled (--all-shards predicts it)")
        return
    try:
        r = reshard.open_resharder(plan.index, reshard.TargetLayout.from_args(plan.runtime, named=plan.runtime.given),
                           keep_optimizer=plan.load_optimizer)
        plan.cost = reshard.predict_in_memory(r, sample=True)
    except PreflightError as exc:
        plan.notes.append(f"reshard cost not predicted: {exc.message}")
    except Exception as exc:  # noqa: BLE001 - the prediction is advice: it never changes or blocks a verdict
        plan.notes.append(f"reshard cost not predicted (internal error {type(exc).__name__}: {exc})")


def make_plan(checkpoint: str, args: RuntimeArgs | argparse.Namespace | dict, *,
              iteration: int | str | None = None, trust_checkpoint: bool = False, shards: str = "all") -> Plan:
    """The library API: the plan for loading ``checkpoint`` with ``args`` (a RuntimeArgs, Namespace or dict).
    ``shards``: which legacy shard files are parsed (see :func:`megatron_preflight.layout.discover.discover`)."""
    t0 = time.perf_counter()
    if isinstance(args, RuntimeArgs):
        rt = args
    elif isinstance(args, dict):
        rt = from_mapping(args)
    else:
        rt = from_namespace(args)
    if iteration is None and rt.ckpt_step is not None:
        iteration = rt.ckpt_step
    index = reshard.open_index(checkpoint, iteration=iteration, trust_checkpoint=trust_checkpoint, shards=shards)
    return plan_from_layout(index, rt, t0)


def _megatron_refuses(index: reshard.CheckpointIndex, rt: RuntimeArgs, ckpt: Any, run: Any, why: str, *,
                      readable: bool, other: str) -> Finding:
    """A torch_dist optimizer state Megatron's own loader refuses at the run's layout: when the resharder reads its
    form, ``--preflight auto`` loads it in memory instead (a reshard finding, and the reshard loader); else fatal."""
    problem = None
    if readable:
        problem = index.source_problem()
    if readable and problem is None:
        return Finding("optimizer", ckpt, run, RESHARD,
                       f"{why}; the in-memory resharder reads this form, so --preflight auto loads the weights and the "
                       "optimizer state through it instead of Megatron's dist loader",
                       f"run with --preflight auto; or {_dist_to_legacy_fix(index.layout, rt)}")
    if problem is not None:
        why += f"; the in-memory resharder cannot serve it either ({problem})"
    return Finding("optimizer", ckpt, run, FATAL, why, other)


def _dist_to_legacy_fix(layout: Layout, rt: RuntimeArgs) -> str:
    """Its optimizer state is saved in model space, which the resharder reads: converting offline carries it."""
    return ("convert offline to a legacy checkpoint at the run's layout, optimizer state included: "
            + advice.offline_fix(layout, rt, "--ckpt-format", "torch", load_flags="--ckpt-format torch")
            + "; or add --no-load-optim")

"""``megatron-preflight reshard SRC DST --tensor-model-parallel-size N ... [--verify] [--workers W]``
(or ``... SRC DST -- <the new run's pretrain_gpt.py flags>``). Under torchrun, every rank writes its share."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from megatron_preflight import parallel
from megatron_preflight.errors import PreflightError

if TYPE_CHECKING:
    from megatron_preflight.reshard import TargetLayout


def _int(v: str | None, flag: str = "a size") -> int | None:
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise PreflightError(f"{flag} {v!r} is not an integer", fix=f"pass a whole number to {flag}",
                             code="usage") from None


def target_from(ns: argparse.Namespace) -> TargetLayout:
    """The target the command line asks for: the new run's flags after ``--`` (they mean what they mean to Megatron:
    a size they leave out is Megatron's default, as ``check`` reads them), or the size flags (a size not given keeps
    the source's)."""
    # loaded when reshard runs
    from megatron_preflight.check.runtime_args import from_cli
    from megatron_preflight.reshard import TargetLayout

    if ns.megatron_args:
        # under torchrun, WORLD_SIZE is this command's own ranks, not the new run's
        env = {} if "LOCAL_RANK" in os.environ else None
        rt = from_cli(ns.megatron_args, env)
        if rt.world_size:
            grid = parallel.ParallelLayout(tp=rt.tp, pp=rt.pp, ep=rt.ep, etp=rt.etp, cp=rt.cp)
            problem = grid.world_problem(rt.world_size)
            if problem is not None:
                raise PreflightError(f"the run's flags ask for a layout its {rt.world_size} ranks cannot hold: "
                                     f"{problem.message}", fix=problem.fix, code="usage")
        return TargetLayout.from_args(rt, named=rt.given)
    size = {name: _int(getattr(ns, name), "--" + name.replace("_", "-")) for name in _SIZE_FLAGS}
    return TargetLayout(
        tp=size["tensor_model_parallel_size"], pp=size["pipeline_model_parallel_size"],
        ep=size["expert_model_parallel_size"], etp=size["expert_tensor_parallel_size"],
        num_layers_per_virtual_pipeline_stage=size["num_layers_per_virtual_pipeline_stage"],
        first_stage_layers=size["decoder_first_pipeline_num_layers"],
        last_stage_layers=size["decoder_last_pipeline_num_layers"],
        vocab_size=size["vocab_size"], padded_vocab_size=size["padded_vocab_size"],
    )


_SIZE_FLAGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
               "expert_tensor_parallel_size", "num_layers_per_virtual_pipeline_stage",
               "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "vocab_size",
               "padded_vocab_size")


def progress_bar(done: int, total: int, name: str) -> None:
    """A one-line progress bar on stderr (the CLI's; the engine reports through a callback)."""
    width = 30
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {name:<24}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _run(ns: argparse.Namespace) -> int:
    from megatron_preflight.reshard import write_resharded  # the writers import torch: only when resharding

    target = target_from(ns)
    if ns.optimizer_group_order:
        target = dataclasses.replace(target, optimizer_group_order=ns.optimizer_group_order.replace("-", "_"))
    if ns.optimizer:
        target = dataclasses.replace(target, distributed_optimizer=ns.optimizer == "distributed")
    remote_dst = "dst" in getattr(ns, "remote_args", {})
    if remote_dst and ns.ckpt_format in (None, "torch"):
        if ns.ckpt_format == "torch":
            raise PreflightError("a legacy checkpoint (--ckpt-format torch) on object storage is one Megatron-LM "
                                 "cannot load (it reads only torch_dist through msc://)", path=ns.remote_args["dst"],
                                 fix="write --ckpt-format torch_dist there, or the legacy form to a local dir",
                                 code="usage")
        ns.ckpt_format = "torch_dist"  # what Megatron-LM loads from msc://
    if ns.ckpt_format:
        target = dataclasses.replace(target, ckpt_format=ns.ckpt_format)
    if (ns.hf_architecture or ns.dtype) and target.ckpt_format != "hf":
        raise PreflightError("--hf-architecture and --dtype choose how a Hugging Face model is written",
                             fix="add --ckpt-format hf (or leave them out)", code="usage")
    if target.ckpt_format == "hf":
        if ns.fingerprint:
            raise PreflightError("--fingerprint stores Megatron fingerprints: an HF model has none", code="usage",
                                 fix="leave --fingerprint out (`megatron-preflight diff HF_DIR CKPT` proves the "
                                     "export)")
        target = dataclasses.replace(target, hf_architecture=ns.hf_architecture, dtype=ns.dtype)
    if ns.optimizer_family:
        target = dataclasses.replace(target, optimizer_family=ns.optimizer_family)
    if ns.transformer_impl:
        target = dataclasses.replace(target, transformer_impl=ns.transformer_impl)
    if ns.dry_run:
        return _dry_run(ns, target)
    tapping = None
    if ns.fingerprint:
        from megatron_preflight.prove import fingerprint  # hashes with numpy and torch: only when asked

        tapping = fingerprint.Fingerprinting()
    summary = write_resharded(ns.src, ns.dst, target, workers=ns.workers, verify=ns.verify,
                              iteration=ns.iteration, trust_checkpoint=ns.trust_checkpoint,
                              progress=None if ns.no_progress else progress_bar, drop_optimizer=ns.drop_optimizer,
                              distributed=True, keep_stale=ns.keep_stale_temp, tapping=tapping,
                              precheck=_content_check(ns) if ns.verify else None)
    if int(os.environ.get("RANK", "0") or 0) == 0:
        print(summary.render())
        if tapping is not None and tapping.stats:
            print(f"fingerprints: {tapping.stats['streamed']} tensor(s) hashed as written, "
                  f"{tapping.stats['read']} read back")
    return 0


def _content_check(ns: argparse.Namespace) -> Callable[[tuple[int, int]], None]:
    """``--verify``'s first step: the source's content against the fingerprints stored beside it (saved by the job
    or by ``megatron-preflight fingerprint``), before anything is written."""

    def check(part: tuple[int, int]) -> None:
        from megatron_preflight.prove.content import check_content  # reads every tensor: only with --verify

        report = check_content(ns.src, iteration=ns.iteration, trust=ns.trust_checkpoint, part=part)
        if not report.ok:
            raise report.error()
        if report.fingerprints is not None and part[0] == 0:
            print(f"source content: equal to its fingerprints ({report.fingerprints})", file=sys.stderr)

    return check


def _dry_run(ns: argparse.Namespace, target: TargetLayout) -> int:
    from megatron_preflight.reshard import predict_offline, predict_torch_dist, process_age  # (loaded when run)

    """Plan everything, move nothing: print the predicted cost (bytes, files, memory, time)."""
    # the resharder's modules load when it runs (the CLI's parser loads none)
    from megatron_preflight.reshard import check_destination, open_checked, starts_without_torch

    check_destination(ns.src, ns.dst)
    if not starts_without_torch(ns.src, target, tapped=bool(getattr(ns, "fingerprint", False))):
        import torch  # noqa: F401 - as the run it predicts loads it first: its memory counted in the prediction
    bandwidth = float(ns.bandwidth) * 2**20 if ns.bandwidth else None
    if target.ckpt_format in ("torch_dist", "fsdp_dtensor"):  # (the same global plans, the same bytes read)
        # the torch_dist writer's module imports torch, as the run it predicts does (its memory counted alike)
        from megatron_preflight.reshard import global_resharders

        r, g, _ = global_resharders(ns.src, target, iteration=ns.iteration, trust=ns.trust_checkpoint,
                                    keep_optimizer=not ns.drop_optimizer)
        prediction = predict_torch_dist(r, g, bandwidth=bandwidth, startup_seconds=process_age())
    else:
        r = open_checked(ns.src, target, iteration=ns.iteration, trust_checkpoint=ns.trust_checkpoint,
                         drop_optimizer=ns.drop_optimizer)
        prediction = predict_offline(r, workers=ns.workers, verify=ns.verify, bandwidth=bandwidth,
                                          startup_seconds=process_age())
    print(json.dumps(prediction.to_json(), indent=1) if ns.json else prediction.render())
    return 0


def add_parser(sub: argparse._SubParsersAction, *, arguments: bool = True) -> None:
    p = sub.add_parser("reshard", help="write a checkpoint at another TP/PP/EP/ETP/VPP layout (legacy, torch_dist, fsdp_dtensor or a Hugging Face model), with its optimizer state",
                       description="Sizes not given keep the source's; ETP follows the target TP unless given; no "
                                   "virtual pipeline unless given. Or give the new run's pretrain_gpt.py flags after "
                                   "--: they mean what they mean to Megatron (a size they leave out is Megatron's "
                                   "default: TP = PP = EP = 1, ETP = TP, no virtual pipeline, even stages), exactly "
                                   "the layout `check` compares; the run's world size (--world-size, --nproc-per-node "
                                   "or WORLD_SIZE) must hold it.")
    p.set_defaults(func=_run)
    if not arguments:  # another subcommand runs: the top-level help lists this one by name and help
        return
    p.add_argument("src", help="source checkpoint root (never written to)")
    p.add_argument("dst", help="new checkpoint root (must not exist, or be empty)")
    p.add_argument("--tensor-model-parallel-size", "--tp")
    p.add_argument("--pipeline-model-parallel-size", "--pp")
    p.add_argument("--expert-model-parallel-size", "--ep")
    p.add_argument("--expert-tensor-parallel-size", "--etp")
    p.add_argument("--num-layers-per-virtual-pipeline-stage")
    p.add_argument("--decoder-first-pipeline-num-layers")
    p.add_argument("--decoder-last-pipeline-num-layers")
    p.add_argument("--vocab-size", help="true vocab size (needed when the checkpoint does not record it and the "
                                        "padding changes)")
    p.add_argument("--padded-vocab-size")
    p.add_argument("--iteration")
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1), help="parallel processes")
    p.add_argument("--hf-architecture", metavar="NAME",
                   help="with --ckpt-format hf: the architecture to write (e.g. MistralForCausalLM; default: the first "
                        "that expresses the model)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"),
                   help="with --ckpt-format hf: the weights' dtype (default: the run's)")
    p.add_argument("--ckpt-format", choices=("torch", "torch_dist", "fsdp_dtensor", "hf"),
                   help="the format to write (default: torch, legacy; torch_dist to an msc:// destination; "
                        "torch_dist: Megatron's default, optimizer state in model space; fsdp_dtensor: "
                        "Megatron-FSDP's, for --use-megatron-fsdp runs; hf: a Hugging Face model, weights only, "
                        "docs/hf.md)")
    p.add_argument("--verify", action="store_true",
                   help="first compare the source with the fingerprints stored beside it (if any: nothing is written "
                        "when they differ), then check every written tensor against its source slices")
    p.add_argument("--drop-optimizer", action="store_true",
                   help="leave the optimizer state out (then start the new run with --no-load-optim); needed only "
                        "when the state cannot be resharded")
    p.add_argument("--optimizer-group-order", choices=("sorted", "per-rank"),
                   help="how the Megatron-LM that loads DST orders optimizer param groups: sorted (2026-01 on, "
                        "megatron-core >= 0.16) or per-rank (earlier); default: as the source checkpoint shows it")
    p.add_argument("--optimizer", choices=("plain", "distributed"),
                   help="write the optimizer state for this optimizer (the new run with or without "
                        "--use-distributed-optimizer); default: the source's, or what the flags after -- say")
    p.add_argument("--optimizer-family", choices=("torch", "fused"),
                   help="write the Adam state for this Adam: torch (AdamW, where neither Transformer Engine nor apex "
                        "is installed) or fused (TE's or apex's FusedAdam); default: the source's, or fused when "
                        "the flags after -- ask for the Transformer Engine spec of a local-spec checkpoint")
    p.add_argument("--transformer-impl", choices=("local", "transformer_engine"),
                   help="write the tensors under this layer spec's names; default: the source's, or what the flags "
                        "after -- say")
    p.add_argument("--fingerprint", action="store_true",
                   help="store the output's fingerprints beside it (what --preflight verify compares a loaded run "
                        "with; read back from the output once)")
    p.add_argument("--keep-stale-temp", action="store_true",
                   help="leave the partial output of earlier runs that died (.DST.tmp-PID) in place; by default it is "
                        "removed, and the summary names it")
    p.add_argument("--dry-run", action="store_true",
                   help="write nothing: plan every shard and print what the reshard will cost (bytes read and "
                        "written, files opened, peak memory, time), in total and per worker")
    p.add_argument("--json", action="store_true", help="with --dry-run: print the prediction as JSON")
    p.add_argument("--bandwidth", type=float, metavar="MIB_S",
                   help="with --dry-run: the filesystems' read and write speed in MiB/s for the time estimate "
                        "(default: measured by a quick read of the source and an fsync'd write to the OS temp dir)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--trust-checkpoint", action="store_true")

"""Megatron-FSDP and its ``fsdp_dtensor`` checkpoints: which run loads which checkpoint, said before the build.

What Megatron-LM does (measured with real pretrain_gpt.py on the CPU runner; Megatron-LM main): a run without
``--use-megatron-fsdp`` calls an fsdp_dtensor checkpoint ``torch_dcp`` and fails in the DCP load after the model and
optimizer are built (``CheckpointException``: ``'NoneType' object has no attribute 'items'``); a Megatron-FSDP run
asserts ``--ckpt-format fsdp_dtensor`` in argument validation and, given a torch_dist or legacy checkpoint, fails
after the build (``KeyError: 'model'``); Megatron-FSDP reloads its own checkpoints at another DP/TP/EP. The resharder
reads fsdp_dtensor (:mod:`megatron_preflight.reshard.sources.fsdp_dtensor`), so a 3D-parallel run loads one through
it, in memory or after an offline conversion; and writes it (:mod:`megatron_preflight.reshard.targets.fsdp_dtensor`),
so a Megatron-FSDP run resumes a torch_dist or legacy checkpoint in memory (the hook serves its fsdp_dtensor form to
Megatron-FSDP's own load: :mod:`megatron_preflight.hook.fsdp_load`) or after an offline conversion.
"""

from __future__ import annotations

from megatron_preflight.check import advice
from megatron_preflight.check.findings import Finding, Severity
from megatron_preflight.check.runtime_args import RuntimeArgs
from megatron_preflight.layout.dist import FSDP_MODEL, strip_modules
from megatron_preflight.layout.model import Format, Layout
from megatron_preflight.reshard.plan.rules import mtp_layer_name

FATAL, RESHARD = Severity.FATAL, Severity.RESHARD
FSDP_FLAGS = "--use-megatron-fsdp --ckpt-format fsdp_dtensor"


def _precision(args: object) -> str:
    if getattr(args, "bf16", False):
        return "bf16"
    return "fp16" if getattr(args, "fp16", False) else "fp32"


def resume_under_fsdp(layout: Layout) -> str:
    """The flags that resume a checkpoint under Megatron-FSDP as it was saved."""
    strategy = getattr(layout.saved_args, "data_parallel_sharding_strategy", None)
    flags = FSDP_FLAGS + (f" --data-parallel-sharding-strategy {strategy}" if strategy else "")
    return flags


def fsdp_findings(layout: Layout, rt: RuntimeArgs) -> list[Finding]:
    """The findings of a Megatron-FSDP run or an fsdp_dtensor checkpoint (empty for neither)."""
    fsdp_ckpt = layout.format == Format.FSDP_DTENSOR
    out: list[Finding] = []
    if rt.ckpt_format == "fsdp_dtensor" and not rt.use_megatron_fsdp:
        return [Finding("ckpt_format", layout.format.value if layout.format else None, "fsdp_dtensor", FATAL,
                        "--ckpt-format fsdp_dtensor without --use-megatron-fsdp: Megatron asserts '--ckpt-format "
                        "fsdp_dtensor is only tested with Megatron FSDP' in argument validation",
                        "add --use-megatron-fsdp, or save the 3D-parallel way: --ckpt-format torch_dist")]
    if fsdp_ckpt and not rt.use_megatron_fsdp:
        fmt = rt.ckpt_format if rt.ckpt_format in ("torch", "torch_dist") else "torch_dist"
        out.append(Finding(
            "ckpt_format", "fsdp_dtensor", rt.ckpt_format, RESHARD,
            "a Megatron-FSDP (fsdp_dtensor) checkpoint and a 3D-parallel run: Megatron calls it torch_dcp and fails "
            "in the load after building the model ('CheckpointException ... NoneType object has no attribute "
            "items'); the resharder reads it, so --preflight auto loads the weights and the optimizer state through "
            "it, at the run's layout",
            "run with --preflight auto; or convert it offline: "
            + advice.offline_fix(layout, rt, "--ckpt-format", fmt, load_flags=f"--ckpt-format {fmt}")
            + f"; or resume under Megatron-FSDP: {resume_under_fsdp(layout)}"))
        return out
    if not rt.use_megatron_fsdp:
        return out
    if rt.ckpt_format != "fsdp_dtensor":
        out.append(Finding("ckpt_format", layout.format.value if layout.format else None, rt.ckpt_format, FATAL,
                           "Megatron-FSDP saves and loads fsdp_dtensor only: Megatron asserts 'Megatron-FSDP "
                           "requires the `fsdp_dtensor` checkpointing format'", "set --ckpt-format fsdp_dtensor"))
    if layout.format in (Format.TORCH, Format.TORCH_DIST):
        out.append(Finding(
            "use_megatron_fsdp", layout.format.value, "fsdp_dtensor", RESHARD,
            f"a {layout.format.value} checkpoint and a Megatron-FSDP run: Megatron-FSDP reads fsdp_dtensor only and "
            "fails after building the model (KeyError: 'model'); --preflight auto serves the checkpoint to "
            "Megatron-FSDP's own load as its fsdp_dtensor form, weights and optimizer state (each rank reads the "
            "whole checkpoint once; RNG states are not carried)",
            "run with --preflight auto and --no-load-rng; or convert it offline to fsdp_dtensor (read once): "
            + advice.offline_fix(layout, rt, "--ckpt-format", "fsdp_dtensor") + " (and --no-load-rng); or resume on "
            "the 3D-parallel path: drop --use-megatron-fsdp and --ckpt-format fsdp_dtensor (add "
            "--use-distributed-optimizer for a sharded optimizer state), with --ckpt-format " + layout.format.value))
    if rt.pp > 1:
        out.append(Finding(
            "pipeline_model_parallel_size", None, rt.pp, FATAL,
            f"Megatron-FSDP with pipeline parallelism (PP{rt.pp}): Megatron-LM main fails when it wraps the model, "
            "after NCCL init ('einops ... Error while processing rearrange-reduction pattern \"(dp_cp ep tp) -> ep "
            "dp_cp tp\"': its device mesh has no pipeline dimension; measured)",
            "run Megatron-FSDP at --pipeline-model-parallel-size 1 (it shards the model over the data-parallel ranks "
            "instead), or train with pipeline parallelism on the 3D-parallel path (drop --use-megatron-fsdp and "
            "--ckpt-format fsdp_dtensor)"))
    if rt.swiglu and _precision(rt) == "fp32" and rt.save:
        out.append(Finding(
            "save", None, "fp32 + --swiglu + --save", FATAL,
            "an fp32 Megatron-FSDP run with --swiglu trains, then fails at its first save (Megatron-LM's fsdp_dtensor "
            "save splits SwiGLU's fc1 through the Float16Module wrapper: 'AttributeError: GPTModel has no attribute "
            "`module`'; measured with Megatron-LM main): the steps since the load are lost",
            "run with --bf16 (the wrapper is there), or resume on the 3D-parallel path: drop --use-megatron-fsdp and "
            "--ckpt-format fsdp_dtensor"))
    if fsdp_ckpt:
        out.extend(_mtp_naming(layout, rt))
    if (rt.no_load_optim or rt.finetune) and _precision(rt) != "fp32" and layout.format is not None:
        out.append(Finding(
            "no_load_optim", "saved", "not loaded", FATAL,
            f"a {_precision(rt)} Megatron-FSDP run that does not load the optimizer state fails after the build "
            "('Megatron-FSDP does not implement a model-to-main parameter update': its fp32 main weights come only "
            "from the optimizer state)",
            "load the optimizer state (drop --no-load-optim / --finetune) at the saved precision; or resume on the "
            "3D-parallel path, which megatron-preflight loads it into: drop --use-megatron-fsdp and --ckpt-format "
            "fsdp_dtensor and run with --preflight auto"))
    elif fsdp_ckpt and layout.dist_optimizer_sharding and _precision(layout.saved_args) != _precision(rt):
        saved = _precision(layout.saved_args)
        out.append(Finding(
            "precision", saved, _precision(rt), FATAL,
            f"the checkpoint was saved by a {saved} Megatron-FSDP run, the run is {_precision(rt)}: the optimizer "
            "state's keys name the model's wrappers (a Float16Module for bf16/fp16), so the load fails after the "
            "build ('Missing key in checkpoint state_dict: optimizer.state.module.module...')",
            f"run with the saved precision ({'--' + saved if saved != 'fp32' else 'neither --bf16 nor --fp16'}); "
            "or resume on the 3D-parallel path, which megatron-preflight loads it into: drop "
            "--use-megatron-fsdp and --ckpt-format fsdp_dtensor and run with --preflight auto"
            + ("" if saved != "fp32" else "; or add --no-load-optim (and keep the weights)")))
    return out


def _mtp_naming(layout: Layout, rt: RuntimeArgs) -> list[Finding]:
    """An fsdp_dtensor checkpoint whose MTP layers' tensors are named as another Megatron release names them
    (``transformer_layer`` / ``mtp_model_layer``: see reshard.sources.fsdp_dtensor): Megatron-FSDP's load misses
    them; the in-memory resharder serves them under both names."""
    running = rt.fsdp_mtp_layer_name
    names = {mtp_layer_name(strip_modules(k[len(FSDP_MODEL):])) for k in layout.dist_tensors
             if k.startswith(FSDP_MODEL)} - {None}
    if running is None or not names or running in names:  # (what the resharder writes has both)
        return []
    saved = min(names)
    return [Finding(
        "mtp_layer_name", saved, running, RESHARD,
        f"the checkpoint names its MTP layers' transformer layer `{saved}` and this Megatron-FSDP asks for "
        f"`{running}` (megatron-core 0.17-0.19 save the module's name `mtp_model_layer`, 0.20 `transformer_layer`): "
        "its load fails after the build ('Missing key in checkpoint state_dict: model.module.mtp.layers.0."
        f"{running}...'; measured with core_r0.19.0); --preflight auto serves them under both names",
        "run with --preflight auto and --no-load-rng; or rewrite it offline (both names, the same bytes): "
        + advice.offline_fix(layout, rt, "--ckpt-format", "fsdp_dtensor") + " (and --no-load-rng)")]

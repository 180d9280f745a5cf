"""The offline reshard a finding advises, as one literal command: the source, ``NEW_DIR`` (the only placeholder), the
options, and after ``--`` the run's layout flags, every size written out.

The flags after ``--`` mean what they mean to Megatron (a size not given is Megatron's default), so the command names
every size the run has, its defaults included: followed word for word, it writes the layout the run loads.
:func:`size_flags` is the one place that renders a run's layout as flags (the layout planner's too), and
:func:`layout_flags` a run's target; ``reshard`` reads them back through
:func:`megatron_preflight.check.runtime_args.from_cli` and :meth:`TargetLayout.from_args` (a test proves the round
trip for every fixture and run).
"""

from __future__ import annotations

import shlex

from megatron_preflight.check.runtime_args import RuntimeArgs
from megatron_preflight.layout.model import Layout
from megatron_preflight.parallel import VOCAB_DIVISOR

PLACEHOLDER = "NEW_DIR"


def size_flags(rt: RuntimeArgs) -> list[str]:
    """The flags of the run's parallel layout, as Megatron reads them: sizes (TP and PP always, EP for an MoE model,
    ETP when set), the virtual pipeline, the stage split (a flexible layout, uneven first / last stages, the embedding /
    loss counted in it) and a HybridModel's pattern (its ``|`` cuts are its pipeline)."""
    flags = ["--tensor-model-parallel-size", str(rt.tp), "--pipeline-model-parallel-size", str(rt.pp)]
    if rt.num_experts or rt.ep > 1:
        flags += ["--expert-model-parallel-size", str(rt.ep)]
    if rt.expert_tensor_parallel_size is not None:  # else it follows TP
        flags += ["--expert-tensor-parallel-size", str(rt.expert_tensor_parallel_size)]
    if rt.cp > 1 or "context_parallel_size" in rt.given:  # (CP1 said when the run said CP: the flags replace its)
        flags += ["--context-parallel-size", str(rt.cp)]
    if rt.num_layers_per_virtual_pipeline_stage is not None:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(rt.num_layers_per_virtual_pipeline_stage)]
    elif rt.num_virtual_stages_per_pipeline_rank is not None:
        flags += ["--num-virtual-stages-per-pipeline-rank", str(rt.num_virtual_stages_per_pipeline_rank)]
    elif rt.vpp is not None and not rt.hybrid_layer_pattern and rt.pipeline_model_parallel_layout is None:
        flags += ["--virtual-pipeline-model-parallel-size", str(rt.vpp)]
    if rt.pipeline_model_parallel_layout is not None:
        flags += ["--pipeline-model-parallel-layout", rt.pipeline_model_parallel_layout]
    for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        value = getattr(rt, name)
        if value is not None:
            flags += [_flag(name), str(value)]
    for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        if getattr(rt, name):
            flags.append(_flag(name))
    if rt.hybrid_layer_pattern:
        flags += ["--hybrid-layer-pattern", rt.hybrid_layer_pattern]
    return flags


def layout_flags(rt: RuntimeArgs) -> list[str]:
    """The flags that give ``reshard`` the run's target: its layout (:func:`size_flags`), the vocab padding, the layer
    spec and expert form, the optimizer form, and the world size."""
    flags = size_flags(rt)
    if rt.vocab_size is not None:
        flags += ["--vocab-size", str(rt.vocab_size)]
    if rt.make_vocab_size_divisible_by != VOCAB_DIVISOR:
        flags += ["--make-vocab-size-divisible-by", str(rt.make_vocab_size_divisible_by)]
    for name in ("use_distributed_optimizer", "moe_grouped_gemm"):
        if getattr(rt, name):
            flags.append(_flag(name))
    flags += ["--transformer-impl", rt.transformer_impl]
    if "ckpt_format" in rt.given:
        flags += ["--ckpt-format", rt.ckpt_format]
    if rt.mamba_conv_name is not None:  # the release that loads it (check --megatron-version): not a Megatron flag
        flags += ["--mamba-conv-name", rt.mamba_conv_name]
    if rt.world_size is not None:
        flags += ["--world-size", str(rt.world_size)]
    return flags


def reshard_command(layout: Layout, rt: RuntimeArgs, *options: str) -> str:
    """``megatron-preflight reshard SRC NEW_DIR [options] -- <the run's layout flags>``, shell-quoted."""
    src = layout.root or layout.path
    if (rt.no_load_optim or rt.finetune) and "--drop-optimizer" not in options:
        options = (*options, "--drop-optimizer")  # the run loads none: writing it costs time, and may be refused
    return shlex.join(["megatron-preflight", "reshard", src, PLACEHOLDER, *options, "--", *layout_flags(rt)])


def offline_fix(layout: Layout, rt: RuntimeArgs, *options: str, load_flags: str = "") -> str:
    """The advice sentence around :func:`reshard_command`: run it, then load the new directory."""
    load = f"{load_flags} --load {PLACEHOLDER}".strip()
    return f"{reshard_command(layout, rt, *options)}, then {load}"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")

"""A layout as the run's flags: the run's own flags with every layout flag taken out and the layout's put in."""

from __future__ import annotations

from megatron_preflight.parallel import ParallelLayout

# the Megatron args a layout sets (the planner never takes them from the checkpoint's saved args)
LAYOUT_FIELDS = frozenset({
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "context_parallel_size", "virtual_pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
    "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "pipeline_model_parallel_layout",
    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split", "world_size",
    "data_parallel_size", "padded_vocab_size", "rank", "local_rank",
})
# flags that take a value / that do not (the layout flags a run may carry)
_VALUED = {"--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--expert-model-parallel-size",
           "--expert-tensor-parallel-size", "--context-parallel-size", "--virtual-pipeline-model-parallel-size",
           "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
           "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
           "--pipeline-model-parallel-layout"}
_SWITCHES = {"--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"}


def without_layout(argv: list[str], *, hybrid: bool) -> list[str]:
    """``argv`` without its layout flags (and a HybridModel's pattern, which carries the pipeline cuts)."""
    valued = _VALUED | ({"--hybrid-layer-pattern", "--hybrid-override-pattern"} if hybrid else set())
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in valued:
            skip = "=" not in arg
            continue
        if name in _SWITCHES:
            continue
        out.append(arg)
    return out


def flags_of(lay: ParallelLayout, *, moe: bool, per_virtual: int | None) -> list[str]:
    """The flags that give Megatron ``lay``."""
    flags = ["--tensor-model-parallel-size", str(lay.tp), "--pipeline-model-parallel-size", str(lay.pp)]
    if lay.cp > 1:
        flags += ["--context-parallel-size", str(lay.cp)]
    if moe:
        flags += ["--expert-model-parallel-size", str(lay.ep), "--expert-tensor-parallel-size", str(lay.etp_eff)]
    if lay.vpp and lay.hybrid_pattern is None:
        if per_virtual:
            flags += ["--num-layers-per-virtual-pipeline-stage", str(per_virtual)]
        else:
            flags += ["--num-virtual-stages-per-pipeline-rank", str(lay.vpp)]
    if lay.first_stage_layers is not None:
        flags += ["--decoder-first-pipeline-num-layers", str(lay.first_stage_layers)]
    if lay.last_stage_layers is not None:
        flags += ["--decoder-last-pipeline-num-layers", str(lay.last_stage_layers)]
    if lay.embedding_in_split:
        flags.append("--account-for-embedding-in-pipeline-split")
    if lay.loss_in_split:
        flags.append("--account-for-loss-in-pipeline-split")
    if lay.hybrid_pattern is not None:
        flags += ["--hybrid-layer-pattern", lay.hybrid_pattern]
    return flags


def layout_argv(argv: list[str], lay: ParallelLayout, *, moe: bool) -> list[str]:
    """The run's flags at ``lay``: its own flags, layout flags replaced; MoE at TP > 1 gets ``--sequence-parallel``
    (Megatron requires it with expert and tensor parallelism)."""
    per_virtual = lay.vpp_args()["num_layers_per_virtual_pipeline_stage"] if lay.vpp else None
    out = without_layout(argv, hybrid=lay.hybrid_pattern is not None) + flags_of(lay, moe=moe, per_virtual=per_virtual)
    if moe and lay.tp > 1 and "--sequence-parallel" not in out:
        out.append("--sequence-parallel")
    return out

"""A layout as the run's flags: the run's own flags with every layout flag taken out and the layout's put in
(rendered by check/advice.py, the one place that writes a layout as flags)."""

from __future__ import annotations

from megatron_preflight.check import advice
from megatron_preflight.check.runtime_args import RuntimeArgs

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


def layout_argv(argv: list[str], at_layout: RuntimeArgs, *, moe: bool) -> list[str]:
    """The run's flags at a layout (``at_layout``: the run's args with the layout's sizes, see
    :func:`megatron_preflight.fit.choose.with_sizes`): its own flags, layout flags replaced by
    :func:`megatron_preflight.check.advice.size_flags`; MoE at TP > 1 gets ``--sequence-parallel`` (Megatron requires
    it with expert and tensor parallelism)."""
    out = without_layout(argv, hybrid=bool(at_layout.hybrid_layer_pattern)) + advice.size_flags(at_layout)
    if moe and at_layout.tp > 1 and "--sequence-parallel" not in out:
        out.append("--sequence-parallel")
    return out

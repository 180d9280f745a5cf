"""The layout to reshard to, as asked for: a partial override of the source's layout, and the output's options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_preflight import parallel
from megatron_preflight.errors import PreflightError
from megatron_preflight.parallel import ParallelLayout


@dataclass(frozen=True)
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
    # The format to write: "torch" (legacy, the default), "torch_dist" (see reshard/targets/torch_dist.py),
    # "fsdp_dtensor", or "hf" (a Hugging Face model: reshard/targets/hf.py)
    ckpt_format: str | None = None
    # an HF export: the architecture to write (None: the first of the table that expresses the model) and the
    # weights' dtype ("bf16", "fp16", "fp32"; None: the run's)
    hf_architecture: str | None = None
    dtype: str | None = None
    # The target run's layer spec (--transformer-impl: "local" or "transformer_engine") and expert form
    # (--moe-grouped-gemm); None: the checkpoint's. A change renames tensors (see reshard/plan/spec.py).
    transformer_impl: str | None = None
    moe_grouped_gemm: bool | None = None
    # The target run's Adam: "torch" (AdamW) or "fused" (TE's or apex's FusedAdam); None: the checkpoint's, or fused
    # for a Transformer Engine spec that the checkpoint did not have (Megatron builds TE's FusedAdam where TE is).
    optimizer_family: str | None = None
    # HybridModel's layer pattern at the target (None: the source's, re-cut into the target's pipeline segments)
    hybrid_layer_pattern: str | None = None
    # what the target Megatron names a Mamba mixer's conv (``conv1d_weight`` from megatron-core 0.19, ``conv1d.weight``
    # before; None: the source's naming)
    mamba_conv_name: str | None = None
    # --pipeline-model-parallel-layout at the target (one segment per pipeline stage): where each stage's decoder
    # layers sit, the embedding on the first stage and the loss on the last; None: Megatron's split rules
    pipeline_model_parallel_layout: str | None = None

    def __post_init__(self) -> None:
        parallel.validate_sizes(self.megatron_sizes())  # a size that enters here is checked here, once
        for name, allowed in (("transformer_impl", ("local", "transformer_engine")),
                              ("optimizer_family", ("torch", "fused"))):
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise PreflightError(f"--{name.replace('_', '-')} {value!r} is not one of {', '.join(allowed)}",
                                     fix=f"pass one of: {', '.join(allowed)}", code="usage")

    def megatron_sizes(self) -> dict[str, int | None]:
        """The sizes given, by their Megatron arg names (None: keep the source's)."""
        return {"tensor_model_parallel_size": self.tp, "pipeline_model_parallel_size": self.pp,
                "expert_model_parallel_size": self.ep, "expert_tensor_parallel_size": self.etp,
                "virtual_pipeline_model_parallel_size": self.vpp,
                "num_layers_per_virtual_pipeline_stage": self.num_layers_per_virtual_pipeline_stage,
                "num_virtual_stages_per_pipeline_rank": self.num_virtual_stages_per_pipeline_rank}

    @classmethod
    def from_args(cls, args: Any, named: set[str] | None = None) -> TargetLayout:
        """The target a run with Megatron ``args`` (a Namespace, RuntimeArgs or mapping) needs: every size as the run
        has it, a size its flags leave out being Megatron's default (TP = PP = EP = 1, ETP = TP, no virtual pipeline,
        even stages), exactly the layout ``check`` compares. ``named``: for a run given as flags, the flags it names
        (then the output's format is the run's only when its flags name it, and the padded vocab follows the target
        TP); None: live args. The virtual pipeline flags are kept as flags: :meth:`resolve` derives the VPP with the
        model's layer count, as Megatron does."""

        def get(name: str) -> Any:
            return args.get(name) if isinstance(args, dict) else getattr(args, name, None)

        per_chunk, stages = get("num_layers_per_virtual_pipeline_stage"), get("num_virtual_stages_per_pipeline_rank")
        pattern = get("hybrid_layer_pattern") or get("hybrid_override_pattern")
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
            padded_vocab_size=get("padded_vocab_size") if named is None else None,
            distributed_optimizer=bool(get("use_distributed_optimizer")),
            vocab_size=get("vocab_size"),
            make_vocab_size_divisible_by=get("make_vocab_size_divisible_by"),
            # the output's format only when the run's flags name it (Megatron's default is torch_dist)
            ckpt_format=get("ckpt_format") if named is not None and "ckpt_format" in named else None,
            # a HybridModel is built from Transformer Engine modules (Megatron's default spec)
            transformer_impl=get("transformer_impl") or ("transformer_engine" if pattern else None),
            moe_grouped_gemm=None if get("moe_grouped_gemm") is None else bool(get("moe_grouped_gemm")),
            optimizer_family=get("optimizer_family"),
            hybrid_layer_pattern=pattern,
            mamba_conv_name=get("mamba_conv_name"),
            pipeline_model_parallel_layout=get("pipeline_model_parallel_layout"),
        )

    def resolve(self, src: ParallelLayout) -> ParallelLayout:
        """The target's parallel layout: the source's (:meth:`ParallelLayout.to_args`) with these sizes over it, built
        by the one builder, :func:`parallel.from_args`. ETP follows the target TP and there is no virtual pipeline
        unless given; the stage split is the source's when PP is kept and none of it is given."""
        args = src.to_args()
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"):
            value = self.megatron_sizes()[name]
            if value is not None:
                args[name] = value
        args.update({name: self.megatron_sizes()[name] for name in (
            "expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size",
            "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank")})
        split = (self.first_stage_layers, self.last_stage_layers, self.embedding_in_split, self.loss_in_split)
        if args["pipeline_model_parallel_size"] != src.pp or any(v is not None for v in split):
            args.update(decoder_first_pipeline_num_layers=self.first_stage_layers,
                        decoder_last_pipeline_num_layers=self.last_stage_layers,
                        account_for_embedding_in_pipeline_split=bool(self.embedding_in_split),
                        account_for_loss_in_pipeline_split=bool(self.loss_in_split))
        args.update(context_parallel_size=1, pipeline_model_parallel_layout=None)  # (CP does not shard weights)
        if self.pipeline_model_parallel_layout is not None:
            flexible = parallel.flexible_target(self.pipeline_model_parallel_layout, args["pipeline_model_parallel_size"])
            args.update(pipeline_model_parallel_layout=flexible, decoder_first_pipeline_num_layers=None,
                        decoder_last_pipeline_num_layers=None, account_for_embedding_in_pipeline_split=False,
                        account_for_loss_in_pipeline_split=False, num_layers_per_virtual_pipeline_stage=None,
                        num_virtual_stages_per_pipeline_rank=None, virtual_pipeline_model_parallel_size=None)
        if src.hybrid_pattern is None and self.hybrid_layer_pattern is not None:  # a GPT checkpoint into a hybrid run
            args.update(hybrid_layer_pattern=self.hybrid_layer_pattern, decoder_first_pipeline_num_layers=None,
                        decoder_last_pipeline_num_layers=None, account_for_embedding_in_pipeline_split=False,
                        account_for_loss_in_pipeline_split=False)
        elif src.hybrid_pattern is not None:
            # a virtual pipeline only when asked for, or kept with the source's pipeline
            vpp = self.vpp or (src.vpp if args["pipeline_model_parallel_size"] == src.pp else None)
            args["hybrid_layer_pattern"] = parallel.repipe(src.hybrid_pattern, self.hybrid_layer_pattern,
                                                           args["pipeline_model_parallel_size"], vpp,
                                                           keep=args["pipeline_model_parallel_size"] == src.pp
                                                           and vpp == src.vpp)
        return parallel.from_args(args)

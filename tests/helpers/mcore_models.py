"""Real megatron-core GPT models on CPU: build at a layout, save Megatron-format checkpoints, run forwards.

Runs inside the worker processes of :mod:`tests.helpers.pool` (one gloo world; the layout's TP·PP·EP must divide it,
data parallelism takes the rest, as in Megatron). Test-only.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ModelSpec:
    num_layers: int = 4
    hidden: int = 32
    heads: int = 4
    ffn: int = 64
    query_groups: int | None = None  # GQA when set
    swiglu: bool = False
    num_experts: int | None = None
    topk: int = 2
    vocab: int = 100
    divisible_by: int = 16
    seq: int = 16
    tie: bool = True
    position: str = "learned_absolute"
    bias: bool = True
    qk_layernorm: bool = False
    dtype: str = "float32"
    grouped_gemm: bool = False  # the local spec's legacy GroupedMLP (experts.weight1/weight2; needs bias=False)

    def padded_vocab(self, tp: int) -> int:
        m = self.divisible_by * tp
        return ((self.vocab + m - 1) // m) * m


@dataclass
class Layout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int | None = None
    extra: dict = field(default_factory=dict)


def _init_parallel(layout: Layout) -> None:
    """Megatron's parallel groups for ``layout``, after destroying every group made before in this task (a task that
    builds models at two layouts would otherwise keep both layouts' gloo groups, and their threads, alive)."""
    from megatron.core import parallel_state as ps

    from tests.helpers.pool import release_groups

    release_groups()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp if layout.etp is not None else layout.tp,
    )


def _config(spec: ModelSpec, layout: Layout):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden,
        num_attention_heads=spec.heads,
        ffn_hidden_size=spec.ffn,
        use_cpu_initialization=True,
        pipeline_dtype=getattr(torch, spec.dtype),
        params_dtype=getattr(torch, spec.dtype),
        bf16=spec.dtype == "bfloat16",
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp if layout.etp is not None else layout.tp,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=spec.bias,
        gated_linear_unit=spec.swiglu,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        qk_layernorm=spec.qk_layernorm,
    )
    if spec.swiglu:
        kw["activation_func"] = F.silu
    if spec.query_groups:
        kw["num_query_groups"] = spec.query_groups
    if spec.num_experts:
        kw.update(num_moe_experts=spec.num_experts, moe_router_topk=spec.topk, moe_token_dispatcher_type="allgather",
                  moe_ffn_hidden_size=spec.ffn, moe_aux_loss_coeff=0.0)
    return TransformerConfig(**kw)


def build(spec: ModelSpec, layout: Layout, seed: int = 1234) -> list[torch.nn.Module]:
    """Model chunks of this rank at ``layout`` (one per virtual stage)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from tests.helpers import cpu_compat

    _init_parallel(layout)
    cpu_compat.seed(seed)
    cfg = _config(spec, layout)
    if spec.grouped_gemm:
        cpu_compat.grouped_gemm_stand_in()
    layer_spec = get_gpt_layer_local_spec(num_experts=spec.num_experts, qk_layernorm=spec.qk_layernorm,
                                          moe_grouped_gemm=spec.grouped_gemm)
    chunks = []
    for vp in range(layout.vpp or 1):
        vp_stage = vp if layout.vpp else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        model = GPTModel(cfg, layer_spec, vocab_size=spec.padded_vocab(layout.tp), max_sequence_length=spec.seq,
                         pre_process=pre, post_process=post, share_embeddings_and_output_weights=spec.tie,
                         position_embedding_type=spec.position, vp_stage=vp_stage)
        model.eval()
        chunks.append(model)
    return chunks


def megatron_args(spec: ModelSpec, layout: Layout, *, ckpt_format: str = "torch", dist_opt: bool = False):
    """The subset of Megatron-LM's ``args`` a checkpoint carries that describes the model and layout."""
    world = torch.distributed.get_world_size()
    etp = layout.etp if layout.etp is not None else layout.tp
    return argparse.Namespace(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=etp,
        virtual_pipeline_model_parallel_size=layout.vpp, context_parallel_size=1,
        num_layers_per_virtual_pipeline_stage=(spec.num_layers // (layout.pp * layout.vpp)) if layout.vpp else None,
        num_layers=spec.num_layers, hidden_size=spec.hidden, ffn_hidden_size=spec.ffn,
        num_attention_heads=spec.heads, group_query_attention=bool(spec.query_groups),
        num_query_groups=spec.query_groups or spec.heads, kv_channels=spec.hidden // spec.heads,
        num_experts=spec.num_experts, moe_router_topk=spec.topk, moe_ffn_hidden_size=spec.ffn if spec.num_experts else None,
        moe_grouped_gemm=spec.grouped_gemm, padded_vocab_size=spec.padded_vocab(layout.tp), vocab_size=spec.vocab,
        make_vocab_size_divisible_by=spec.divisible_by, max_position_embeddings=spec.seq, seq_length=spec.seq,
        position_embedding_type=spec.position, normalization="LayerNorm", swiglu=spec.swiglu,
        add_bias_linear=spec.bias, add_qkv_bias=spec.bias, qk_layernorm=spec.qk_layernorm,
        untie_embeddings_and_output_weights=not spec.tie, use_distributed_optimizer=dist_opt, ckpt_format=ckpt_format,
        params_dtype=getattr(torch, spec.dtype), fp16=False, bf16=spec.dtype == "bfloat16", world_size=world,
        data_parallel_size=world // (layout.tp * layout.pp), transformer_impl="local",
        decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None, tokenizer_type="NullTokenizer",
        iteration=None, consumed_train_samples=0,
    )


def _model_entries(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    if len(chunks) == 1:
        return {"model": chunks[0].state_dict_for_save_checkpoint()}
    return {f"model{i}": c.state_dict_for_save_checkpoint() for i, c in enumerate(chunks)}


def trainer(chunks, lr: float = 1e-2, distributed: bool = False, min_lr: float | None = None):
    """Megatron's training wrapping of ``chunks`` (Float16Module for bf16, DDP) and megatron-core's optimizer (Adam
    over torch AdamW, as without apex / TE: the plain one, Float16OptimizerWithFloat16Params for bf16; or the
    DistributedOptimizer)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from tests.helpers import cpu_compat

    cpu_compat.optimizer_on_cpu()
    cfg = chunks[0].config
    # gradients in fp32 for bf16, as Megatron-LM sets it (accumulate_allreduce_grads_in_fp32)
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=distributed, overlap_grad_reduce=False,
                                            grad_reduce_in_fp32=bool(cfg.bf16))
    models = [DistributedDataParallel(c.config, ddp_cfg, Float16Module(c.config, c) if cfg.bf16 else c)
              for c in chunks]
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, min_lr=min_lr, weight_decay=0.1, bf16=cfg.bf16,
                                                 use_distributed_optimizer=distributed), models)
    return models, opt


def train_step(models, opt, spec: ModelSpec, seed: int) -> None:
    """One step on a fixed batch (the same on every rank; PP = 1)."""
    ids = tokens(spec, seed=seed)
    pos = torch.arange(spec.seq).unsqueeze(0).expand_as(ids)
    mask = torch.triu(torch.ones(spec.seq, spec.seq, dtype=torch.bool), 1)[None, None]
    for m in models:
        m.zero_grad_buffer()
        m.train()
    opt.zero_grad()
    models[0](ids, pos, mask, labels=ids).float().mean().backward()
    for m in models:
        m.finish_grad_sync()
    ok, _, _ = opt.step()
    assert ok


def save_legacy(chunks, spec: ModelSpec, layout: Layout, root: str, iteration: int, *, dist_opt: bool = False,
                optimizer: Any = None) -> None:
    """Megatron's legacy save: writers are ranks with DP rank 0 or expert-DP rank 0; dir named by tp/pp/ep rank."""
    from megatron.core import parallel_state as ps

    writes = ps.get_data_parallel_rank() == 0 or ps.get_expert_data_parallel_rank() == 0
    # Megatron's dir name, written out here (not taken from the code under test): mp_rank_TT[_PPP][_EEE]
    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if layout.pp > 1:
        name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
    if layout.ep > 1:
        name += f"_{ps.get_expert_model_parallel_rank():03d}"
    d = os.path.join(root, f"iter_{iteration:07d}", name)
    if optimizer is not None and dist_opt:  # every rank takes part (a gather); DP rank 0 of each part writes
        os.makedirs(d, exist_ok=True)
        optimizer.save_parameter_state(os.path.join(d, "distrib_optim.pt"))
    if writes:
        os.makedirs(d, exist_ok=True)
        state = {"args": megatron_args(spec, layout, dist_opt=dist_opt), "checkpoint_version": 3.0,
                 "iteration": iteration, **_model_entries(chunks),
                 "rng_state": [{"random_rng_state": None, "torch_rng_state": torch.get_rng_state()}],
                 "num_floating_point_operations_so_far": 0}
        if optimizer is not None:  # the plain optimizer's state dict, as Megatron's save_checkpoint stores it
            state["optimizer"] = optimizer.state_dict()
        if dist_opt and optimizer is None:
            # FAKE (named as such): Megatron's DistributedOptimizer cannot be built on CPU here; write the documented
            # distrib_optim.pt structure so layout discovery sees a distributed-optimizer checkpoint.
            state["optimizer"] = {"optimizer": {"param_groups": []}}
            torch.save({"buckets_coalesced": True, 0: {(torch.float32, torch.float32): {
                "param": torch.zeros(8), "exp_avg": torch.zeros(8), "exp_avg_sq": torch.zeros(8),
                "numel_unpadded": 8}}}, os.path.join(d, "distrib_optim.pt"))
        torch.save(state, os.path.join(d, "model_optim_rng.pt"))
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write(str(iteration))
    torch.distributed.barrier()


def save_dist(chunks, spec: ModelSpec, layout: Layout, root: str, iteration: int) -> None:
    """Megatron-core's torch_dist save of the model (args as common state)."""
    from megatron.core import dist_checkpointing

    d = os.path.join(root, f"iter_{iteration:07d}")
    if torch.distributed.get_rank() == 0:
        os.makedirs(d, exist_ok=True)
    torch.distributed.barrier()
    state: dict[str, Any] = {"args": megatron_args(spec, layout, ckpt_format="torch_dist"), "checkpoint_version": 3.0,
                             "iteration": iteration}
    if len(chunks) == 1:
        state["model"] = chunks[0].sharded_state_dict()
    else:
        for i, c in enumerate(chunks):
            state[f"model{i}"] = c.sharded_state_dict()
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    # As Megatron-LM does by default (--ckpt-fully-parallel-save): spread the writes over DP ranks, so every rank
    # takes part in the same collectives.
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"),
                                                ps.get_data_parallel_group(with_context_parallel=True))
    dist_checkpointing.save(state, d, strategy)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write(str(iteration))
    torch.distributed.barrier()


def load_dist(chunks, layout: Layout, root: str, iteration: int) -> None:
    """Megatron-core's own load-time resharding of a torch_dist checkpoint into ``chunks``."""
    from megatron.core import dist_checkpointing

    d = os.path.join(root, f"iter_{iteration:07d}")
    if len(chunks) == 1:
        sd = dist_checkpointing.load({"model": chunks[0].sharded_state_dict()}, d)
        chunks[0].load_state_dict(sd["model"])
    else:
        sd = dist_checkpointing.load({f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}, d)
        for i, c in enumerate(chunks):
            c.load_state_dict(sd[f"model{i}"])


def tokens(spec: ModelSpec, batch: int = 2, seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.vocab, (batch, spec.seq), generator=g)


def forward(chunks, spec: ModelSpec, layout: Layout) -> torch.Tensor | None:
    """Full-vocab logits (first ``vocab`` columns) for the test tokens; PP = 1 only. None on non-zero ranks."""
    assert layout.pp == 1 and not layout.vpp, "forward() runs PP=1 models; compare PP>1 by state dicts"
    ids = tokens(spec)
    pos = torch.arange(spec.seq).unsqueeze(0).expand_as(ids)
    mask = torch.triu(torch.ones(spec.seq, spec.seq, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        out = chunks[0](ids, pos, mask, runtime_gather_output=True)
    return out[..., : spec.vocab].clone() if torch.distributed.get_rank() == 0 else None


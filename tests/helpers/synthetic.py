"""Synthetic legacy Megatron checkpoints of production layouts (1,024 or 8,192 shard dirs): scale tests and benchmarks.

Every shard file is a real ``torch.save`` of Megatron-Core's local-spec GPT MoE state dict at its (tp, pp, ep)
rank: the key names, shapes and splits of a real save, and the full top-level state of a real one (args with their
~850 fields, RNG state, scheduler) taken from a fixture Megatron-LM wrote. Sizes are scaled down (hidden 64) so a
few GB of disk hold 8,192 shards; with ``hollow=True`` every tensor is a stride-0 view of one element, so the file
holds the metadata of the real shapes (``hidden`` may then be 4096) and almost no tensor bytes.

Files that would be byte-identical (the same stage's shards across TP and EP ranks carry the same local keys and
shapes, and synthetic values) are hard links of one file: the reader still opens and parses every one.
"""

from __future__ import annotations

import argparse
import copy
import os
from dataclasses import dataclass
from typing import Any

import torch

from megatron_preflight import pickling
from megatron_preflight.layout import naming
from megatron_preflight.parallel import ParallelLayout
from megatron_preflight.torch_file import TensorRef, read_torch_file
from megatron_preflight.tree import map_leaves

TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "megatron-lm",
                        "moe_shared_tp2pp2ep2_torch", "iter_0000002", "mp_rank_00_000_000", "model_optim_rng.pt")


@dataclass
class Model:
    tp: int
    pp: int
    ep: int
    layers_per_stage: int = 2
    experts: int = 0  # 0: one per EP rank
    hidden: int = 64
    heads: int = 8
    ffn: int = 256
    moe_ffn: int = 128
    vocab: int = 1024
    seq: int = 64

    @property
    def num_layers(self) -> int:
        return self.pp * self.layers_per_stage

    @property
    def num_experts(self) -> int:
        return self.experts or self.ep

    @property
    def padded_vocab(self) -> int:
        multiple = 128 * self.tp
        return -(-self.vocab // multiple) * multiple


def _template() -> dict[str, Any]:
    meta = read_torch_file(TEMPLATE)
    return map_leaves(meta, lambda v, _p: torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, TensorRef) else v)


def _args(m: Model, template_args: argparse.Namespace) -> argparse.Namespace:
    args = copy.copy(template_args)
    kv = m.hidden // m.heads
    world = m.tp * m.pp * m.ep
    values = dict(tensor_model_parallel_size=m.tp, pipeline_model_parallel_size=m.pp, expert_model_parallel_size=m.ep,
                  expert_tensor_parallel_size=m.tp, num_layers=m.num_layers, hidden_size=m.hidden,
                  ffn_hidden_size=m.ffn, num_attention_heads=m.heads, num_query_groups=m.heads, kv_channels=kv,
                  num_experts=m.num_experts, moe_ffn_hidden_size=m.moe_ffn, moe_shared_expert_intermediate_size=None,
                  moe_layer_freq=1, padded_vocab_size=m.padded_vocab, vocab_size=m.vocab, max_position_embeddings=m.seq,
                  seq_length=m.seq, world_size=world, data_parallel_size=1, use_distributed_optimizer=False,
                  no_save_optim=True, virtual_pipeline_model_parallel_size=None,
                  num_layers_per_virtual_pipeline_stage=None, decoder_first_pipeline_num_layers=None,
                  decoder_last_pipeline_num_layers=None, untie_embeddings_and_output_weights=True,
                  moe_router_enable_expert_bias=False, swiglu=False, group_query_attention=False,
                  add_bias_linear=False, normalization="LayerNorm", position_embedding_type="learned_absolute")
    for k, v in values.items():
        setattr(args, k, v)
    return args


def stage_state(m: Model, pp: int, hollow: bool) -> dict[str, torch.Tensor]:
    """The model state dict of one (tp, ep) shard of stage ``pp`` (local layer and expert numbers, as saved)."""
    def t(*shape: int) -> torch.Tensor:
        return torch.zeros(1).expand(*shape) if hollow else torch.randn(*shape)

    h, tp = m.hidden, m.tp
    sd: dict[str, torch.Tensor] = {}
    if pp == 0:
        sd["embedding.word_embeddings.weight"] = t(m.padded_vocab // tp, h)
        sd["embedding.position_embeddings.weight"] = t(m.seq, h)
    for i in range(m.layers_per_stage):
        p = f"decoder.layers.{i}."
        sd[p + "input_layernorm.weight"], sd[p + "input_layernorm.bias"] = t(h), t(h)
        sd[p + "self_attention.linear_qkv.weight"] = t(3 * h // tp, h)
        sd[p + "self_attention.linear_proj.weight"] = t(h, h // tp)
        sd[p + "pre_mlp_layernorm.weight"], sd[p + "pre_mlp_layernorm.bias"] = t(h), t(h)
        sd[p + "mlp.router.weight"] = t(m.num_experts, h)
        for j in range(m.num_experts // m.ep):
            e = f"{p}mlp.experts.local_experts.{j}."
            sd[e + "linear_fc1.weight"] = t(m.moe_ffn // tp, h)
            sd[e + "linear_fc2.weight"] = t(h, m.moe_ffn // tp)
    if pp == m.pp - 1:
        sd["decoder.final_layernorm.weight"], sd["decoder.final_layernorm.bias"] = t(h), t(h)
        sd["output_layer.weight"] = t(m.padded_vocab // tp, h)
    return sd


def write_legacy(root: str, m: Model, *, hollow: bool = True, iteration: int = 100) -> int:
    """Write the checkpoint under ``root`` (tracker included); returns the number of shard dirs."""
    template = _template()
    args = _args(m, template["args"])
    it_dir = os.path.join(root, naming.iteration_dir_name(iteration))
    os.makedirs(it_dir, exist_ok=True)
    sizes = ParallelLayout(tp=m.tp, pp=m.pp, ep=m.ep, etp=m.tp)
    names = naming.expected_shards(sizes)
    first: dict[int, str] = {}
    for name, (_tp, pp, _ep) in sorted(names.items()):
        d = os.path.join(it_dir, name)
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, naming.MODEL_FILENAME)
        if pp in first:
            os.link(first[pp], path)
            continue
        state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": stage_state(m, pp, hollow),
                 "opt_param_scheduler": template.get("opt_param_scheduler"), "rng_state": template["rng_state"],
                 "num_floating_point_operations_so_far": 0}
        torch.save(state, path, pickle_module=pickling)
        first[pp] = path
    with open(os.path.join(root, naming.TRACKER_FILENAME), "w") as fh:
        fh.write(str(iteration))
    return len(names)

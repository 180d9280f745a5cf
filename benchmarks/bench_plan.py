"""Planning speed: how long indexing a source and planning target ranks takes, with no tensor bytes read.

Builds (in a temp dir) a tiny-width MoE checkpoint with many keys: 16 layers, 64 experts, TP1·EP2, with the plain
optimizer's Adam state, using Megatron-Core's local-spec key names. Then, for a few large target layouts (up to
TP8·PP16·EP64), it prints: the time to index the source (weights + optimizer), the number of target shard dirs, the
time to plan one rank, and the time to plan every shard dir.

Usage: python benchmarks/bench_plan.py
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.bench_reshard import adam_state  # noqa: E402
from megatron_preflight.reshard.resharder import open_resharder
from megatron_preflight.reshard.target import TargetLayout  # noqa: E402

H, FFN, LAYERS, EXPERTS, EP = 64, 128, 16, 64, 2


def make_checkpoint(root: str) -> None:
    for e in range(EP):
        model: dict[str, torch.Tensor] = {"embedding.word_embeddings.weight": torch.zeros(1024, H)}
        for i in range(LAYERS):
            p = f"decoder.layers.{i}."
            model.update({p + "input_layernorm.weight": torch.ones(H), p + "self_attention.linear_qkv.weight":
                          torch.zeros(3 * H, H), p + "self_attention.linear_proj.weight": torch.zeros(H, H),
                          p + "pre_mlp_layernorm.weight": torch.ones(H), p + "mlp.router.weight":
                          torch.zeros(EXPERTS, H)})
            for j in range(EXPERTS // EP):
                model[f"{p}mlp.experts.local_experts.{j}.linear_fc1.weight"] = torch.zeros(FFN, H)
                model[f"{p}mlp.experts.local_experts.{j}.linear_fc2.weight"] = torch.zeros(H, FFN)
        model["decoder.final_layernorm.weight"] = torch.ones(H)
        dense = {k: v for k, v in model.items() if ".local_experts." not in k}
        experts = {k: v for k, v in model.items() if ".local_experts." in k}
        optim = [adam_state(dense), adam_state(experts)]
        for g in optim[1]["param_groups"]:
            g["is_expert_parallel"] = True
        args = argparse.Namespace(
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=EP,
            expert_tensor_parallel_size=1, num_layers=LAYERS, hidden_size=H, ffn_hidden_size=FFN,
            num_attention_heads=8, num_query_groups=8, num_experts=EXPERTS, padded_vocab_size=1024, vocab_size=1000,
            make_vocab_size_divisible_by=128, swiglu=False, add_bias_linear=False,
            untie_embeddings_and_output_weights=False, use_distributed_optimizer=False, ckpt_format="torch",
            world_size=EP, data_parallel_size=EP)
        d = os.path.join(root, "iter_0000001", f"mp_rank_00_{e:03d}")
        os.makedirs(d)
        torch.save({"args": args, "iteration": 1, "checkpoint_version": 3.0, "model": model, "optimizer": optim},
                   os.path.join(d, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("1")


def main() -> None:
    with tempfile.TemporaryDirectory() as work:
        src = os.path.join(work, "moe")
        make_checkpoint(src)
        print(f"{'target':<22}{'index s':>9}{'dirs':>8}{'one rank s':>12}{'all dirs s':>12}{'tensors/rank':>14}")
        for label, target in [("TP1 PP1 EP1", TargetLayout(tp=1, ep=1)),
                              ("TP8 PP4 EP8 ETP1", TargetLayout(tp=8, pp=4, ep=8, etp=1)),
                              ("TP8 PP16 EP64 ETP1", TargetLayout(tp=8, pp=16, ep=64, etp=1))]:
            t0 = time.perf_counter()
            r = open_resharder(src, target)
            t1 = time.perf_counter()
            one = r.plan_for_rank(0)
            t2 = time.perf_counter()
            plans = r.shard_plans()
            t3 = time.perf_counter()
            print(f"{label:<22}{t1 - t0:>9.3f}{len(plans):>8}{t2 - t1:>12.4f}{t3 - t2:>12.2f}{len(one.tensors):>14}")
        print("index: discover + index the weights and Adam state of the source (metadata only); one rank: the plan "
              "of rank 0 (weights + optimizer); all dirs: plans of every target shard dir (what offline reshard "
              "makes).")


if __name__ == "__main__":
    main()

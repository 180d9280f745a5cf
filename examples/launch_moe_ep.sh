#!/bin/bash
# Resume an MoE GPT job at a new expert-parallel layout with megatron-preflight (run from a Megatron-LM checkout).
set -euo pipefail
CKPT=${CKPT:-/checkpoints/moe-8x2b}
torchrun --nproc-per-node 8 -m megatron_preflight.run pretrain_gpt.py \
  --tensor-model-parallel-size 2 --expert-model-parallel-size 4 --expert-tensor-parallel-size 1 --sequence-parallel \
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --num-experts 8 --moe-router-topk 2 \
  --swiglu --ffn-hidden-size 5632 --disable-bias-linear --position-embedding-type rope --normalization RMSNorm \
  --seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 256 --bf16 \
  --lr 3e-4 --train-iters 100000 --load "$CKPT" --save "$CKPT" --ckpt-format torch \
  --preflight auto --no-load-optim \
  "$@"
# --no-load-optim: a legacy optimizer state is tied to the saved layout; the pre-flight check refuses to drop it
# silently and tells you to add this flag when the layout changes.

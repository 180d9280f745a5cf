#!/bin/bash
# Resume a dense GPT job at a new TP/PP layout with megatron-preflight (run from a Megatron-LM checkout).
# The checkpoint in $CKPT may have been saved at any TP/PP: --preflight auto checks the run against it before the
# model is built, and loads a legacy checkpoint saved at another layout through the in-memory resharder.
set -euo pipefail
CKPT=${CKPT:-/checkpoints/gpt-8b}
torchrun --nproc-per-node 8 --nnodes ${NNODES:-1} -m megatron_preflight.run pretrain_gpt.py \
  --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 \
  --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8 \
  --swiglu --ffn-hidden-size 14336 --position-embedding-type rope --normalization RMSNorm --disable-bias-linear \
  --untie-embeddings-and-output-weights --seq-length 4096 --max-position-embeddings 4096 \
  --micro-batch-size 1 --global-batch-size 256 --lr 3e-4 --train-iters 100000 --bf16 \
  --load "$CKPT" --save "$CKPT" --ckpt-format torch \
  --preflight auto --preflight-report preflight_plan.json \
  "$@"
# Check only, on a login node, before queueing the job (same flags after --):
#   megatron-preflight check "$CKPT" -- --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 ...

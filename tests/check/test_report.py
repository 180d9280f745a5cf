"""The reports as a user reads them: no value cut mid-word, a Hugging Face model's report without Megatron-only
fields, check and plan agreeing that an HF model's memory is predicted, the node size said when assumed, activations
'-' when they cannot be estimated."""

from __future__ import annotations

import os

import pytest

from megatron_preflight.cli.main import main

HF_LLAMA = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf", "llama")
LLAMA_FLAGS = ("--num-layers 2 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 --group-query-attention "
               "--num-query-groups 2 --kv-channels 8 --max-position-embeddings 64 --position-embedding-type rope "
               "--rotary-base 500000 --normalization RMSNorm --norm-epsilon 1e-05 --swiglu --disable-bias-linear "
               "--untie-embeddings-and-output-weights --make-vocab-size-divisible-by 16 --tokenizer-type "
               "NullTokenizer --vocab-size 127 --seq-length 64").split()


def test_check_prints_every_value_whole(capsys):
    assert main(["check", HF_LLAMA, "--", *LLAMA_FLAGS, "--tensor-model-parallel-size", "2", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "none (a Hugging Face model)" in out  # whole, on its own line, never "none (a Hugging Face mod"
    assert "checkpoint: none (a Hugging Face model)" in out
    assert "memory not predicted" not in out and "the largest rank" in out  # predicted, as plan predicts it


def test_an_hf_report_holds_no_megatron_only_field(capsys):
    assert main(["inspect", HF_LLAMA]) == 0
    out = capsys.readouterr().out
    for field in ("dist. optim", "tracker:", "mp_rank_00", "shard names"):
        assert field not in out, field
    assert "model.safetensors" in out and "a model's weights" in out


@pytest.mark.parametrize("world, node", [(2, "a node of 2 GPUs (assumed"), (16, "a node of 8 GPUs (assumed")])
def test_plan_says_the_node_size_it_assumes_and_what_it_cannot_estimate(capsys, world, node):
    main(["plan", HF_LLAMA, "--world-size", str(world), "--top", "2"])
    out = capsys.readouterr().out
    assert node in out, out
    assert "activations '-': not estimated" in out  # no --seq-length: '-' in the column, not 0 B
    main(["plan", HF_LLAMA, "--world-size", str(world), "--gpus-per-node", "4", "--top", "2"])
    out = capsys.readouterr().out
    assert "a node of 4 GPUs;" in out and "assumed" not in out

"""The tiny GPT every test and fixture uses, defined once: the model flags of the real fixtures
(tests/fixtures/megatron-lm/MANIFEST.md) as pretrain_gpt.py flags and as a Megatron args mapping."""

from __future__ import annotations

MODEL_FLAGS = ("--num-layers 4 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 --seq-length 32 "
               "--max-position-embeddings 32 --vocab-size 100 --tokenizer-type NullTokenizer").split()
# what the fixtures were trained with on CPU (no Transformer Engine)
FLAGS = MODEL_FLAGS + ["--transformer-impl", "local"]


def _as_args(flags: list[str]) -> dict:
    out: dict = {}
    it = iter(flags)
    for flag in it:
        value = next(it)
        out[flag[2:].replace("-", "_")] = int(value) if value.isdigit() else value
    return out


# The same model as Megatron's parsed args (a Namespace's attributes), at TP1·PP1·EP1.
ARGS = dict(_as_args(FLAGS), tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
            expert_model_parallel_size=1)
ARGS.pop("tokenizer_type")

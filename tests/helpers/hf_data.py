"""An indexed dataset whose every sample is one fixed token sequence, so that Megatron's iteration-1 ``lm loss`` is the
model's mean cross entropy of ``tokens[1:] + tokens[:1]`` given ``tokens`` — a loss ``transformers`` computes too
(test-only; run with a Python that has megatron.core: ``python -m tests.helpers.hf_data PREFIX SEQ VOCAB``).

Every document is the same ``SEQ`` tokens and Megatron cuts samples of ``SEQ + 1`` tokens at multiples of ``SEQ``,
so each sample is ``tokens + tokens[0]`` whatever the shuffle."""

from __future__ import annotations

import sys

import numpy as np


def tokens(seq: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(11).integers(0, vocab, seq).astype(np.int32)


def write(prefix: str, seq: int, vocab: int, docs: int = 256) -> None:
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    toks = torch.from_numpy(tokens(seq, vocab))
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for _ in range(docs):
        builder.add_document(toks, [seq])
    builder.finalize(prefix + ".idx")


def hf_loss(path: str, seq: int, vocab: int) -> float:
    """``transformers``' own mean cross entropy on the dataset's sample (fp32)."""
    import torch
    import transformers as T

    toks = torch.from_numpy(tokens(seq, vocab).astype(np.int64))
    model = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(toks[None]).logits[0].float()
    return torch.nn.functional.cross_entropy(logits, torch.cat([toks[1:], toks[:1]])).item()


if __name__ == "__main__":
    write(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))

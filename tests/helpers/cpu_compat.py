"""In-process workarounds so megatron-core 0.16.1 runs real GPT models on CPU under gloo.

Each patch is small and named after the symptom it removes (see shared notes "megatron-core-on-cpu", W-A .. W-K).
Test-only: nothing here is part of megatron-preflight.
"""

from __future__ import annotations

import os

_APPLIED = False


def apply() -> None:
    global _APPLIED
    if _APPLIED:
        return
    _APPLIED = True
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    # W-C: megatron moves tensors to torch.cuda.current_device(); make that the CPU.
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    # W-K: tied embeddings with PP>1 call weight.cuda() before the embedding all-reduce.
    if not torch.cuda.is_available():
        torch.Tensor.cuda = lambda self, *a, **k: self

    # W-A: the attention scratch buffer is allocated on "cuda".
    from megatron.core import utils as mutils

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        required = 1
        for s in tensor_shape:
            required *= s
        key = (name, dtype)
        buf = self.buffer.get(key)
        if buf is None or buf.numel() < required:
            self.buffer[key] = torch.empty(required, dtype=dtype, requires_grad=False)
        return self.buffer[key][0:required].view(*tensor_shape)

    mutils.GlobalMemoryBuffer.get_tensor = get_tensor

    # W-F: moe_utils tests te_general_gemm although it only defines it when TE imports.
    from megatron.core.transformer.moe import moe_utils

    for name in ("te_general_gemm",):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)

    # W-E: pipeline schedules allocate a counter on "cuda".
    from megatron.core.pipeline_parallel import schedules

    class _TorchProxy:
        def __getattr__(self, item):
            return getattr(torch, item)

        @staticmethod
        def zeros(*args, **kwargs):
            kwargs.pop("device", None)
            return torch.zeros(*args, **kwargs)

    schedules.torch = _TorchProxy()


def grouped_gemm_stand_in() -> None:
    """W-I, a STAND-IN for the CUDA-only ``grouped_gemm`` package (not installable here): megatron-core's legacy
    GroupedMLP asserts the package at build; its ``gmm`` is a per-expert matmul loop. Building and saving the model
    (what the tests need) do not call it."""
    import types

    import torch
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    if gg.grouped_gemm is not None:
        return

    def gmm(a, b, batch_sizes, trans_b=False):
        out, start = [], 0
        for e, n in enumerate(batch_sizes.tolist()):
            w = b[e].t() if trans_b else b[e]
            out.append(a[start:start + n] @ w)
            start += n
        return torch.cat(out) if out else a.new_zeros(0, b.shape[-1 if not trans_b else -2])

    gg.ops = types.SimpleNamespace(gmm=gmm)
    gg.grouped_gemm = types.SimpleNamespace(ops=gg.ops)


def seed(value: int) -> None:
    """W-B: CPU-safe seeding of megatron's model-parallel RNG tracker."""
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    torch.manual_seed(value)
    mrandom.model_parallel_cuda_manual_seed(value, inference_rng_tracker=True, force_reset_rng=True)

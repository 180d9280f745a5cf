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

    # W-L: the sliding window's mask (megatron.core.transformer.utils) is made on "cuda"; Megatron's own code runs,
    # its tensors made on the CPU.
    from megatron.core.transformer import utils as tutils

    class _OnesProxy(_TorchProxy):
        @staticmethod
        def ones(*args, **kwargs):
            kwargs.pop("device", None)
            return torch.ones(*args, **kwargs)

    tutils.torch = _OnesProxy()


_OPTIMIZER = False


def optimizer_on_cpu() -> None:
    """W-L .. W-P: megatron-core's optimizers (Float16OptimizerWithFloat16Params, FP32Optimizer, grad-norm) on CPU.
    W-L: they make small tensors with ``device="cuda"`` (the loss scale, the grad-norm buffers): the factories put
    them on the CPU. W-M: Float16Optimizer sorts parameters by ``param.type()`` ('torch.cuda.BFloat16Tensor'): a CPU
    tensor's type reads as its CUDA name. The optimizer's math (torch AdamW, fp32 masters) is unchanged."""
    global _OPTIMIZER
    if _OPTIMIZER:
        return
    _OPTIMIZER = True
    import torch

    def on_cpu(factory):
        def make(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)
        return make

    for name in ("tensor", "zeros", "ones", "empty", "full"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    plain_type = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        if args or kwargs:
            return plain_type(self, *args, **kwargs)
        name = plain_type(self)
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type

    # W-N: without apex / TE, torch's Adam keeps ``step`` in each parameter's state (apex / TE keep it in the param
    # groups); DistributedOptimizer's load of distrib_optim.pt copies every state tensor from the file, which has
    # no ``step`` (load_state_dict already set it from the param groups): KeyError 'step'. Leave a state tensor the
    # file does not hold as it is, and copy under no_grad (the fp32 mains are views of leaves that require grad).
    from megatron.core.optimizer import distrib_optimizer as dopt

    set_states = dopt.DistributedOptimizer._set_main_param_and_optimizer_states

    @torch.no_grad()
    def keep_missing(self, model_param, tensors):
        index, order = self.model_param_group_index_map[model_param]
        main = self.optimizer.param_groups[index]["params"][order]
        kept = {k: v for k, v in self.optimizer.state.get(main, {}).items()
                if isinstance(v, torch.Tensor) and k not in tensors}
        return set_states(self, model_param, {**tensors, **kept})

    dopt.DistributedOptimizer._set_main_param_and_optimizer_states = keep_missing

    # W-O: on that path DistributedOptimizer.load_state_dict gives every parameter's state the *same* ``step``
    # tensor, which torch's Adam then increments in place once per parameter: the resumed run's bias correction
    # runs ahead (a same-layout round trip of megatron-core's own checkpoint takes a different next step). Each
    # state gets its own copy, as the saved run had.
    load_state = dopt.DistributedOptimizer.load_state_dict

    def untied_steps(self, state_dict):
        out = load_state(self, state_dict)
        for st in self.optimizer.state.values():
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].clone()
        return out

    dopt.DistributedOptimizer.load_state_dict = untied_steps

    # W-P: on that path DistributedOptimizer.state_dict() asserts one Adam step among the inner state's entries;
    # before a first step or a load (a torch_dist load asks for the state-dict template first) there are none. Then
    # build the template as under apex / TE, with step 0 in the param groups (the load brings the real one).
    plain_state_dict = dopt.DistributedOptimizer.state_dict

    def template_when_empty(self):
        if getattr(dopt, "HAVE_APEX_OR_TE", True) or len(self.optimizer.state):
            return plain_state_dict(self)
        dopt.HAVE_APEX_OR_TE = True
        try:
            sd = plain_state_dict(self)
        finally:
            dopt.HAVE_APEX_OR_TE = False
        for group in sd["optimizer"]["param_groups"]:
            group.setdefault("step", 0)
        return sd

    dopt.DistributedOptimizer.state_dict = template_when_empty


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
    try:
        mrandom.model_parallel_cuda_manual_seed(value, inference_rng_tracker=True, force_reset_rng=True)
    except TypeError:  # megatron-core 0.13 (the fixtures of tests/fixtures/megatron-core-0.13): no force_reset_rng,
        # and its tracker reads and sets CUDA generator states: the CPU generator's stand in
        torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
        torch.cuda.manual_seed = torch.manual_seed
        mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
        mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
        mrandom.get_cuda_rng_tracker().reset()
        mrandom.model_parallel_cuda_manual_seed(value, inference_rng_tracker=True)

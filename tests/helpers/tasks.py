"""Tasks run on every rank of the test pool (module-level functions, called with plain-data kwargs)."""

from __future__ import annotations

from typing import Any

import torch

from tests.helpers.mcore_models import Layout, ModelSpec, build, forward, load_dist, save_dist, save_legacy


def write_checkpoint(spec: dict, layout: dict, root: str, iteration: int = 10, fmt: str = "torch",
                     dist_opt: bool = False, seed: int = 1234) -> Any:
    """Build a model at ``layout`` and save it (legacy or torch_dist). Returns rank 0's logits when PP = 1."""
    s, lay = ModelSpec(**spec), Layout(**layout)
    chunks = build(s, lay, seed=seed)
    if fmt == "torch":
        save_legacy(chunks, s, lay, root, iteration, dist_opt=dist_opt)
    else:
        save_dist(chunks, s, lay, root, iteration)
    return forward(chunks, s, lay) if lay.pp == 1 and not lay.vpp else None


def write_both(spec: dict, layout: dict, legacy_root: str, dist_root: str, iteration: int = 10, seed: int = 1234):
    """Save one model in both formats (twins: same tensors)."""
    s, lay = ModelSpec(**spec), Layout(**layout)
    chunks = build(s, lay, seed=seed)
    save_legacy(chunks, s, lay, legacy_root, iteration)
    save_dist(chunks, s, lay, dist_root, iteration)
    # GroupedMLP's forward needs bf16 and the grouped_gemm stand-in: its checkpoints are compared by tensors
    return forward(chunks, s, lay) if lay.pp == 1 and not lay.vpp and not s.grouped_gemm else None


def reshard_and_compare(spec: dict, layout: dict, legacy_root: str, dist_root: str, iteration: int = 10,
                        reference: bool = True) -> Any:
    """At ``layout``: load our in-memory reshard of the legacy checkpoint into a model (strict), and compare every
    tensor with what megatron-core's own torch_dist resharding loads. Returns (max abs diff of tensors, logits).
    ``spec`` is the target model's (it may differ from the source's expert module: GroupedMLP -> sequential)."""
    from megatron.core import parallel_state as ps

    from megatron_preflight.reshard.resharder import build_rank_state_dict
    from megatron_preflight.reshard.target import TargetLayout

    s, lay = ModelSpec(**spec), Layout(**layout)
    ours = build(s, lay, seed=99)
    ref = build(s, lay, seed=77) if reference else None
    if ref is not None:
        load_dist(ref, lay, dist_root, iteration)
    target = TargetLayout(tp=lay.tp, pp=lay.pp, ep=lay.ep, etp=lay.etp, vpp=lay.vpp)
    rank = torch.distributed.get_rank()
    sd = build_rank_state_dict(legacy_root, target, rank=rank, world_size=torch.distributed.get_world_size())
    keys = ["model"] if len(ours) == 1 else [f"model{i}" for i in range(len(ours))]
    from megatron_preflight.reshard.optimizer.plain import is_param

    worst = 0.0
    order_ok = True
    for i, (key, chunk) in enumerate(zip(keys, ours, strict=True)):
        # The optimizer numbers parameters in named_parameters() order: our key order must be the model's.
        ours_order = [k for k, v in sd[key].items() if is_param(k, v)]
        order_ok &= ours_order == [n for n, _ in chunk.named_parameters()]
        chunk.load_state_dict(sd[key], strict=True)
        if ref is None:
            continue
        theirs = ref[i].state_dict()
        for name, value in chunk.state_dict().items():
            if isinstance(value, torch.Tensor):
                worst = max(worst, (value.float() - theirs[name].float()).abs().max().item() if value.numel() else 0.0)
    logits = forward(ours, s, lay) if lay.pp == 1 and not lay.vpp else None
    ref_logits = forward(ref, s, lay) if ref is not None and lay.pp == 1 and not lay.vpp else None
    del ps
    return {"max_tensor_diff": worst, "logits": logits, "ref_logits": ref_logits, "param_order_ok": order_ok}



def count_groups_after_release() -> int:
    """Make megatron-core's groups, release them as the pool does after a task, and count what is left."""
    import torch.distributed as dist

    from tests.helpers.mcore_models import _init_parallel
    from tests.helpers.pool import release_groups

    _init_parallel(Layout(tp=2))
    assert len(dist.distributed_c10d._world.pg_map) > 5
    release_groups()
    return len(dist.distributed_c10d._world.pg_map)

"""Tasks run on every rank of the test pool (module-level functions, called with plain-data kwargs)."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.helpers.mcore_models import (
    Layout,
    ModelSpec,
    build,
    forward,
    load_dist,
    save_dist,
    save_legacy,
    train_step,
    trainer,
)


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


def threads_across_layouts() -> list[int]:
    """This worker's thread count after each of several layouts set up in one task (a task that writes at one layout
    and loads at another): each set-up must release the groups of the one before."""
    from tests.helpers.mcore_models import _init_parallel

    counts = []
    for layout in (Layout(tp=2), Layout(pp=2), Layout(tp=2), Layout(ep=2), Layout(tp=2)):
        _init_parallel(layout)
        counts.append(len(os.listdir("/proc/self/task")))
    return counts


def _live_state(chunks, opt) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's value and optimizer state as the live model and megatron-core's optimizer hold them:
    {name: {"param", "master", "exp_avg", "exp_avg_sq"}} (copies; the distributed optimizer's shards of each are
    summed over its data-parallel group into the whole tensor)."""
    parts = list(getattr(opt, "chained_optimizers", [opt]))
    if hasattr(parts[0], "model_param_gbuf_map"):
        return _live_distributed_state(chunks, parts)
    inner = [o.optimizer for o in parts]
    out = {}
    for i, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            master = getattr(p, "main_param", p)
            state = next((o.state[master] for o in inner if master in o.state), None)  # None: before a first step
            zero = torch.zeros_like(master)
            out[f"{i}:{name}"] = {"param": p.detach().clone(), "master": master.detach().clone(),
                                  "exp_avg": (zero if state is None else state["exp_avg"]).clone(),
                                  "exp_avg_sq": (zero if state is None else state["exp_avg_sq"]).clone()}
    return out


def _live_distributed_state(chunks, parts) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for i, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            # the part that holds the parameter (dense, or expert-parallel: megatron-core marks those allreduce=False);
            # a rank whose buffer shard misses the parameter holds none of its state
            group = (parts[-1] if not getattr(p, "allreduce", True) else parts[0]).data_parallel_group
            part = next((o for o in parts if p in o.model_param_gbuf_map), None)
            fields = {"param": p.detach().clone()}
            states = {k: None for k in ("param", "exp_avg", "exp_avg_sq")}
            if part is not None and part.optimizer.state:  # no state before a first step
                states = part._get_main_param_and_optimizer_states(p)
                rng = part._get_model_param_range_map(p)["param"]
            for field, mine in (("master", states["param"]), ("exp_avg", states["exp_avg"]),
                                ("exp_avg_sq", states["exp_avg_sq"])):
                whole = torch.zeros(p.numel(), dtype=torch.float32)
                if mine is not None:
                    whole[rng.start:rng.end] = mine.detach().reshape(-1)
                torch.distributed.all_reduce(whole, group=group)  # disjoint ranges: the whole
                fields[field] = whole.view(p.shape)
            out[f"{i}:{name}"] = fields
    return out


def _as_sequential(live: dict, spec: ModelSpec, layout: Layout) -> dict:
    """The live GroupedMLP state named as sequential experts by global expert number, each tensor read as
    GroupedMLP's forward reads its experts: ``weight1.view(E, hidden, -1)[j]`` is expert j's fc1 input-major
    (its linear weight is the transpose), ``weight2.view(E, -1, hidden)[j]`` its fc2."""
    from megatron.core import parallel_state as ps

    local = spec.num_experts // layout.ep
    first = ps.get_expert_model_parallel_rank() * local
    out = {}
    for key, fields in live.items():
        chunk, name = key.split(":", 1)
        if not name.endswith(("experts.weight1", "experts.weight2")):
            out[key] = fields
            continue
        fc1 = name.endswith("weight1")
        head = name.rsplit("experts.", 1)[0] + "experts.local_experts."
        for j in range(local):
            view = {k: (v.view(local, spec.hidden, -1)[j] if fc1 else v.view(local, -1, spec.hidden)[j]).t()
                    for k, v in fields.items()}
            out[f"{chunk}:{head}{first + j}.linear_fc{1 if fc1 else 2}.weight"] = view
    return out


def _globally_named(live: dict, spec: ModelSpec, layout: Layout) -> dict:
    """Sequential experts renamed from local to global expert numbers."""
    from megatron.core import parallel_state as ps

    if not spec.num_experts:
        return live
    local = spec.num_experts // layout.ep
    first = ps.get_expert_model_parallel_rank() * local
    out = {}
    for key, fields in live.items():
        if ".local_experts." in key:
            head, rest = key.split(".local_experts.", 1)
            j, tail = rest.split(".", 1)
            key = f"{head}.local_experts.{first + int(j)}.{tail}"
        out[key] = fields
    return out


def train_grouped_and_save(spec: dict, layout: dict, root: str, iteration: int = 2, distributed: bool = False) -> dict:
    """A GroupedMLP model (bf16) trained ``iteration`` steps by megatron-core's optimizer, saved in the legacy format
    with the optimizer state; then one more step. Returns its live state before and after that step, named as
    sequential experts by global number."""
    s, lay = ModelSpec(**spec), Layout(**layout)
    chunks = build(s, lay, seed=1234)
    models, opt = trainer(chunks, distributed=distributed)
    for i in range(iteration):
        train_step(models, opt, s, seed=100 + i)
    save_legacy(chunks, s, lay, root, iteration, optimizer=opt, dist_opt=distributed)
    before = _as_sequential(_live_state(chunks, opt), s, lay)
    train_step(models, opt, s, seed=100 + iteration)
    after = _as_sequential(_live_state(chunks, opt), s, lay)
    return {"before": before, "after": after}


def resume_and_step(spec: dict, layout: dict, state: dict | None = None, source: str | None = None,
                    iteration: int = 2, with_optimizer: bool = True, distributed: bool = False) -> dict:
    """A model at ``layout`` loads a state dict — the rank's file of a checkpoint we wrote (``state``: the path per
    rank dir is found from the layout), or our in-memory reshard of ``source`` — into the model and megatron-core's
    optimizer (as Megatron's load_checkpoint does), then takes the next step on the same batch. Returns the live
    state after the load and after the step."""
    from megatron_preflight.reshard.resharder import build_rank_state_dict
    from megatron_preflight.reshard.target import TargetLayout

    s, lay = ModelSpec(**spec), Layout(**layout)
    chunks = build(s, lay, seed=99)
    models, opt = trainer(chunks, distributed=distributed)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if source is not None:
        sd = build_rank_state_dict(source, TargetLayout(tp=lay.tp, pp=lay.pp, ep=lay.ep, etp=lay.etp), rank=rank,
                                   world_size=world)
    else:
        sd = torch.load(state[str(rank)], weights_only=False)
    chunks[0].load_state_dict(sd["model"], strict=True)
    if with_optimizer:
        opt.load_state_dict(sd["optimizer"])
        if distributed:  # Megatron's load_checkpoint: the buffers' state from distrib_optim.pt beside the file
            opt.load_parameter_state(os.path.join(os.path.dirname(state[str(rank)]), "distrib_optim.pt"))
    else:
        opt.reload_model_params()  # Megatron's --no-load-optim: fresh Adam state, masters from the loaded weights
    named = _as_sequential if s.grouped_gemm else _globally_named
    loaded = named(_live_state(chunks, opt), s, lay)
    train_step(models, opt, s, seed=100 + iteration)
    return {"before": loaded, "after": named(_live_state(chunks, opt), s, lay)}

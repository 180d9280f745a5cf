"""The in-memory resharding loader: stands in for Megatron's ``_load_base_checkpoint`` on legacy checkpoints whose
layout differs from the run's, handing Megatron each rank's state dict exactly as if read from a file of the run's
layout, the plain optimizer's state included. The rest of Megatron's load (iteration, scheduler, strict key check,
optimizer.load_state_dict, --no-load-optim/--no-load-rng, --finetune) behaves as usual."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

from megatron_preflight import reshard  # its modules load on first use (a lazy package)
from megatron_preflight.check import releases
from megatron_preflight.errors import PreflightError
from megatron_preflight.hook import consensus, remote_load, shared_read
from megatron_preflight.hook.state import STATE
from megatron_preflight.layout import naming, optimizer_kinds, transport
from megatron_preflight.reshard.plan.rules import canonical_name, spellings

log = logging.getLogger("megatron_preflight")

def target_from_args(args: Any) -> reshard.TargetLayout:
    """The layout of the running job: the one rank 0 decided on (broadcast with the decision), else built from
    Megatron's validated ``args`` through the one layout builder."""
    decision = STATE.decision
    if decision is not None and decision.target is not None:
        return decision.target
    target = reshard.TargetLayout.from_args(args)
    version = releases.installed_version() if target.hybrid_layer_pattern else None
    if version is not None:  # what this Megatron names a Mamba conv (check/releases.py)
        target = dataclasses.replace(target, mamba_conv_name=releases.facts(version).mamba_conv_name)
    return target


def keep_optimizer(args: Any) -> bool:
    """Whether the optimizer state is loaded: the decision's answer (--no-load-optim, --finetune, a checkpoint
    without one), else the args'."""
    decision = STATE.decision
    if decision is not None and decision.loader is not None:
        return bool(decision.load_optimizer)
    return not (getattr(args, "no_load_optim", False) or getattr(args, "finetune", False))


def resharder_for(load_dir: str, args: Any) -> reshard.Resharder:
    """The resharder of ``load_dir`` at the run's layout (an ``msc://`` one: of its node's staged mirror,
    hook/remote_load.py). Collective on first use."""
    iteration = getattr(args, "ckpt_step", None)
    keep = keep_optimizer(args)
    target = target_from_args(args)
    load_dir = remote_load.local_dir(load_dir)
    key = (os.path.abspath(load_dir), iteration, keep, tuple(sorted(vars(target).items())))
    if key not in STATE.resharders:
        trust = bool(getattr(args, "preflight_trust_checkpoint", False))
        STATE.resharders[key] = reshard.open_resharder(shared_index(load_dir, iteration, trust, keep), target,
                                               keep_optimizer=keep)
    return STATE.resharders[key]


def shared_index(load_dir: str, iteration: Any, trust: bool, with_dist: bool) -> reshard.CheckpointIndex:
    """This process's index of the checkpoint (every shard's metadata), assembled by rank 0 and sent to every rank.
    Rank 0 keeps the index its check built (reading the shards it had not parsed when that verdict was sampled: it
    reads them alone, or, for thousands of shard files, every rank parses its share and rank 0 gathers them, see
    :mod:`shared_read`); the others index the layout rank 0 sends. Called by every rank at the same point
    (collective); built once per process."""
    where = os.path.abspath(load_dir)
    if where in STATE.shared:
        return STATE.indexes[where]
    started = time.perf_counter()
    gathered = shared_read.gather(load_dir, iteration, trust, with_dist)
    box: list[reshard.CheckpointIndex] = []

    def read() -> tuple[str, Any]:
        index = STATE.indexes.get(where)  # what the check on this rank just read
        if index is None or index.layout.sampled:
            index = reshard.open_index(load_dir, iteration=iteration, trust_checkpoint=trust, reader=gathered)
        layout = index.layout
        if layout.distributed_optimizer and with_dist:
            if gathered is not None:
                gathered.attach_dist(layout.shards)
            for shard in layout.shards:  # the distributed optimizer's metadata too: read here, once
                try:
                    reshard.read_dist_meta(shard, trust)
                except reshard.OptimizerNotReshardable:
                    pass  # reported by the resharder, with its fix
        box.append(index)
        return "ok", transport.dumps(layout)

    def failed(exc: BaseException) -> tuple[str, Any]:
        if isinstance(exc, PreflightError):
            return "error", (exc.message, exc.path, exc.fix, exc.code)
        return "error", (f"reading the checkpoint failed: {exc!r}", load_dir, "", "internal")

    kind, payload = consensus.decide_on_rank0(read, failed)
    if kind == "error":
        message, path, fix, code = payload
        raise PreflightError(message, path=path, fix=fix, code=code)
    index = box[0] if box else reshard.CheckpointIndex(transport.loads(payload), trust=trust)
    STATE.indexes[where] = index
    STATE.shared.add(where)
    STATE.seconds["index"] = STATE.seconds.get("index", 0.0) + time.perf_counter() - started
    return index


def runtime_coordinates(world_rank: int, world: int, resharder: reshard.Resharder) -> dict[str, int]:
    """This rank's (tp, pp, ep, etp) ranks: from Megatron's parallel state when it is up, else Megatron's rank
    layout computed from the sizes."""
    try:
        from megatron.core import parallel_state as ps  # Megatron-LM is optional: present only inside a Megatron job

        if ps.model_parallel_is_initialized():
            return {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
                    "ep": ps.get_expert_model_parallel_rank(), "etp": ps.get_expert_tensor_parallel_rank()}
    except Exception:  # pragma: no cover - megatron.core missing or older
        pass
    return naming.rank_coordinates(world_rank, world, resharder.tgt)


def live_groups(optimizer: Any) -> list[list[tuple[tuple, int]]] | None:
    """The running optimizer's param groups, per part: (settings key, parameter count), in its order."""
    if optimizer is None:
        return None
    out = []
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        groups = getattr(getattr(part, "optimizer", None), "param_groups", None)
        if groups is None:
            return None
        out.append([(tuple(g.get(k) for k in reshard.GROUP_KEY), len(g["params"])) for g in groups])
    return out


def unwrapped(chunk: Any) -> Any:
    """The model inside Megatron's wrappers (DDP, Float16Module: each keeps it as ``.module``)."""
    while hasattr(chunk, "module") and hasattr(chunk.module, "state_dict"):
        chunk = chunk.module
    return chunk


def refuse_grouped_mlp(model: Any, load_dir: str) -> None:
    """An older Megatron's local spec with --moe-grouped-gemm builds the legacy GroupedMLP, which the resharder does
    not write (it writes sequential experts): say so before Megatron's strict load fails on the keys."""
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        if any(n.endswith("mlp.experts.weight1") for n, _ in unwrapped(chunk).named_parameters()):
            raise PreflightError(
                "this run builds the legacy GroupedMLP (--moe-grouped-gemm with --transformer-impl local on an older "
                "Megatron), whose packed experts.weight1/weight2 the resharder does not write", path=load_dir,
                fix="run without --moe-grouped-gemm (sequential experts: the same weights), or with "
                    "--transformer-impl transformer_engine --moe-grouped-gemm", code="usage")


def match_extra_state(state: dict[str, Any], model: Any) -> int:
    """Give each model chunk's state exactly the ``_extra_state`` entries the running modules have (Megatron loads
    strictly): which modules keep one depends on the installed Transformer Engine and its version (a TE final norm
    even under the local spec), not only on the spec. Missing ones are made ``None`` (every module's
    ``set_extra_state`` accepts it: nothing to restore), ones the run's modules lack are dropped. Returns how many
    entries changed."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    changed = 0
    for i, chunk in enumerate(chunks):
        sd = state.get("model" if len(chunks) == 1 else f"model{i}")
        if not isinstance(sd, dict):
            continue
        live = [k for k in unwrapped(chunk).state_dict(keep_vars=True) if k.endswith("_extra_state")]
        live_set = set(live)
        for key in [k for k in sd if k.endswith("_extra_state") and k not in live_set]:
            del sd[key]
            changed += 1
        for key in live:
            if key not in sd:
                sd[key] = None
                changed += 1
    return changed


def refuse_unmatched(state: dict[str, Any], model: Any, load_dir: str) -> None:
    """Every parameter of the running modules is in the built state dict: Megatron's legacy loader, failing a strict
    load, loads again non-strictly and leaves what it did not find at its initial values, silently. A parameter the
    resharder did not build under the running module's name stops the run here, named."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    for i, chunk in enumerate(chunks):
        sd = state.get("model" if len(chunks) == 1 else f"model{i}")
        if not isinstance(sd, dict):
            continue
        missing = [name for name, _ in unwrapped(chunk).named_parameters() if name not in sd]
        if missing:
            raise PreflightError(
                f"the state built for this rank lacks {len(missing)} of the running model's parameters, first "
                f"{missing[0]!r} (the built state names {len(sd)} entries): Megatron would load the rest and leave "
                "these at their initial values", path=load_dir,
                fix="check that the run's model flags are the checkpoint's (megatron-preflight check LOAD_DIR -- "
                    "<the run's flags>); if they are, report it with both names", code="layout")


def match_mtp_names(state: dict[str, Any], model: Any) -> int:
    """Put each key a Megatron release names otherwise under the running modules' name (Megatron loads strictly, and
    on a strict failure its legacy loader loads again non-strictly, leaving those modules at init): an MTP layer's
    transformer layer (``mtp_model_layer``, or the older ``transformer_layer``), a Mamba mixer's conv
    (``conv1d_weight``, or the older ``conv1d.weight``), whichever the checkpoint wrote. Returns how many keys
    moved."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    moved = 0
    for i, chunk in enumerate(chunks):
        sd = state.get("model" if len(chunks) == 1 else f"model{i}")
        if not isinstance(sd, dict) or not any(k.startswith("mtp.") or ".mixer.conv1d" in k for k in sd):
            continue
        live = set(unwrapped(chunk).state_dict(keep_vars=True))
        for key in [k for k in sd if k not in live and (k.startswith("mtp.") or ".mixer.conv1d" in k)]:
            other = next((name for name in spellings(key)[1:] if name in live), None)
            if other is not None:
                sd[other] = sd.pop(key)
                moved += 1
    return moved


def resharded_state_dict(load_dir: str, args: Any, *, rank0: bool = False, optimizer: Any = None,
                         model: Any = None) -> tuple[dict[str, Any], str, bool]:
    """(state_dict, a checkpoint name for Megatron's messages, release) for this rank. With the run's ``optimizer``,
    the resharded optimizer state's param groups are put in that optimizer's order (which older Megatron-LM
    versions choose per rank); with its ``model``, the extra-state entries are the running modules'
    (:func:`match_extra_state`)."""
    r = resharder_for(load_dir, args)
    release = r.layout.iteration == naming.RELEASE
    name = remote_load.shown(os.path.join(r.layout.iter_dir or load_dir,
                                          f"<resharded to TP{r.tgt.tp} PP{r.tgt.pp} EP{r.tgt.ep}>"))
    if model is not None:
        refuse_grouped_mlp(model, load_dir)
    if rank0:
        # The format pre-read / args read: Megatron needs args, iteration and the version, not the weights.
        return r.header(), name, release
    started = time.perf_counter()
    coords = runtime_coordinates(consensus.rank(), consensus.world_size(), r)
    plan = r.plan_for_coords(coords, naming.shard_dir_name(coords["tp"], coords["pp"], coords["ep"],
                                                           pp_size=r.tgt.pp, ep_size=r.tgt.ep))
    remote_load.prefetch(r, plan)
    state = r.build(plan)
    STATE.seconds["build"] = STATE.seconds.get("build", 0.0) + time.perf_counter() - started
    groups = None if r.target_distributed else live_groups(optimizer)  # the distributed one maps groups by key
    if "optimizer" in state and groups is not None:
        state["optimizer"] = reshard.align_groups(state["optimizer"], groups)
    if model is not None and match_mtp_names(state, model):
        log.info("MTP layers' keys named as the running modules name them")
    if model is not None:
        moved = match_extra_state(state, model)
        if moved:
            log.info("%d _extra_state entries matched to the running modules (%s)", moved,
                     r.spec.describe() if r.spec is not None and r.spec.changes else "same layer spec")
        refuse_unmatched(state, model, load_dir)
    log.info("built rank state dict from %s (%d tensors, %.1f MiB)", ", ".join(plan.sources), len(plan.tensors),
             plan.nbytes / 2**20)
    return state, name, release


def serve_parameter_state(optimizer: Any, args: Any, model: Any = None) -> Any:
    """When the run uses the distributed optimizer and the checkpoint's distrib_optim.pt is resharded: make
    ``optimizer.load_parameter_state(path)`` take this rank's state from memory instead of the file (built only on
    the ranks that are data-parallel rank 0 of an optimizer part, as Megatron reads the file; it then scatters it).
    Returns the function that undoes it."""
    if optimizer is None or not getattr(args, "use_distributed_optimizer", False) or not keep_optimizer(args) or \
            not hasattr(optimizer, "load_parameter_state"):
        return lambda: None
    load_dir = getattr(args, "load", None)
    original = optimizer.load_parameter_state

    def load_parameter_state(filename: str, *, update_legacy_format: bool = False) -> None:
        r = resharder_for(load_dir, args)
        if r.dist_index is None or not r.target_distributed:
            return original(filename, update_legacy_format=update_legacy_format)
        parts = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
        parts = [p for p in parts if hasattr(p, "load_parameter_state_from_dp_zero")]
        states = None
        if any(p.data_parallel_group.rank() == 0 for p in parts):
            states = this_rank_parameter_state(r, parts, model)
            states = states if isinstance(states, list) else [states]
            if len(states) != len(parts):
                raise PreflightError(f"the run's distributed optimizer has {len(parts)} part(s), the resharded state "
                                     f"{len(states)}", fix="start the run with --no-load-optim", code="optimizer")
            for part, state in zip(parts, states, strict=True):
                check_live_buffers(part, state)
        for i, part in enumerate(parts):
            part.load_parameter_state_from_dp_zero(states[i] if states and part.data_parallel_group.rank() == 0
                                                   else None)
        log.info("distributed optimizer state loaded from the in-memory reshard")

    optimizer.load_parameter_state = load_parameter_state

    def restore() -> None:
        optimizer.load_parameter_state = original

    return restore


def this_rank_parameter_state(r: reshard.Resharder, parts: list[Any] | None = None, model: Any = None) -> Any:
    """This rank's distrib_optim.pt content at the run's layout, built in memory (world tensors of its dir). With the
    running optimizer's ``parts`` and ``model`` chunks, each parameter is placed where the running optimizer keeps it
    (its own buffer layout: nothing modelled on the target side)."""
    coords = runtime_coordinates(consensus.rank(), consensus.world_size(), r)
    plan = r.plan_for_coords(coords, naming.shard_dir_name(coords["tp"], coords["pp"], coords["ep"],
                                                           pp_size=r.tgt.pp, ep_size=r.tgt.ep))
    if parts is not None and model is not None:
        states = plan.dist_optimizer if isinstance(plan.dist_optimizer, list) else [plan.dist_optimizer]
        names = param_names(model)
        for part, state in zip(parts, states, strict=False):
            for gbuf, buffer in enumerate(getattr(part, "buffers", None) or []):
                offsets = live_offsets(buffer, names)
                if offsets is None or not isinstance(state, dict) or not isinstance(state.get(gbuf), dict):
                    continue
                (_, world), = state[gbuf].items()
                moved = 0
                for key in optimizer_kinds.DISTRIBUTED_STATE:
                    if key in world:  # an optimizer without a second moment (Lion) keeps exp_avg only
                        moved = reshard.relocate(world[key], offsets)
                if moved:
                    log.warning("gradient buffer %d: %d parameters placed where the running optimizer keeps them, "
                                "not where the checkpoint's rules put them", gbuf, moved)
    remote_load.prefetch(r, plan)
    files = reshard.SourceFiles(r.layout.iter_dir or "", trust=r.trust, )
    try:
        r.check_masters(files, shards=set(plan.sources))  # the masters of the dirs this rank reads
        return reshard.build_tree(plan.dist_optimizer, files)
    finally:
        files.close()


def param_names(model: Any) -> dict[int, str]:
    """id(parameter) -> "chunk:key" over the run's model chunks (wrapper prefixes such as DDP's "module." removed; keys
    by their global name, :func:`~megatron_preflight.reshard.plan.rules.canonical_name`)."""
    out = {}
    for chunk, module in enumerate(model if isinstance(model, (list, tuple)) else [model]):
        for name, param in module.named_parameters():
            while name.startswith("module."):
                name = name[len("module."):]
            out[id(param)] = f"{chunk}:{canonical_name(name)}"  # an MTP layer by its one global name
    return out


def live_offsets(buffer: Any, names: dict[int, str]) -> dict[str, int] | None:
    """Where the running optimizer keeps each parameter of one gradient buffer in the world tensors it reads (its
    buckets without their end padding, concatenated): from the buffer's own index map. None when this Megatron
    version's buffer does not expose it."""
    try:
        index_map, bucket_indices = buffer.param_index_map, buffer.bucket_indices
        unpadded = [b.numel_unpadded for b in buffer.buckets]
    except AttributeError:
        return None
    starts = [sum(unpadded[:i]) for i in range(len(unpadded))]
    out = {}
    for param, (start, _end, bucket) in index_map.items():
        name = names.get(id(param))
        if name is None:
            return None
        out[name] = starts[bucket] + start - bucket_indices[bucket][0]
    return out


def check_live_buffers(part: Any, state: dict[str, Any]) -> None:
    """Ask the running optimizer where the parameters live: each of its gradient buffers must hold exactly as many
    unpadded elements as the resharded buffer (Megatron compares the same, with an assert, bucket by bucket)."""
    buffers = getattr(part, "buffers", None)
    if buffers is None:
        return
    for gbuf, buffer in enumerate(buffers):
        ours = state.get(gbuf)
        live = getattr(buffer, "numel_unpadded", None)
        if not isinstance(ours, dict) or live is None:
            continue
        (_, world), = ours.items()
        if world["numel_unpadded"] != live:
            raise PreflightError(
                f"gradient buffer {gbuf} of the running distributed optimizer holds {live} elements, the resharded "
                f"state {world['numel_unpadded']}: the run's DDP settings (--overlap-grad-reduce, --ddp-bucket-size) "
                "lay the buffers out differently from the checkpoint's", code="optimizer",
                fix="start the run with the checkpoint's DDP bucket settings, or with --no-load-optim")

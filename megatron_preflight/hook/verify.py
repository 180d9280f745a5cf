"""``--preflight verify``: after the load (Megatron's own loader or ours, legacy or torch_dist), prove that the model
every rank now holds is the checkpoint's, against the fingerprints stored beside it (``megatron-preflight
fingerprint``; see prove/fingerprint.py), before iteration 1.

Every rank hashes the parameters it holds, each as boxes of its global tensor (where its slice sits: the split rule,
the run's layout, its TP/EP/ETP/PP coordinates; vocab padding rows left out). Rank 0 gathers the partial digests,
counts each box once (a replica is the same box; replicas that disagree are named), sums them per tensor and compares
with the stored digest. For a tensor that differs, every rank holding part of it rebuilds that part from the
checkpoint (only those tensors are read) and says whether its own slice is the one that differs, so the message names
the parameter, the rank(s) and the likely cause. Parameters the checkpoint has no data for (left at their
initialisation) and checkpoint tensors no rank holds are named too. Any finding stops every rank with exit 1.
With the optimizer state loaded, its fp32 masters and Adam moments are verified the same way: the distributed
optimizer's shard of each parameter (a range of the flattened local parameter) hashed at its elements' global
indices, the plain optimizer's whole local state; a differing one is re-read in the plain form on the ranks that
hold it, to name them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
from typing import Any

from megatron_preflight import reshard  # its modules load on first use (a lazy package)
from megatron_preflight.errors import PreflightError
from megatron_preflight.hook import consensus, legacy_load, remote_load, runtime, verify_rng
from megatron_preflight.layout import naming
from megatron_preflight.prove import fingerprint, placement
from megatron_preflight.reshard.plan.rules import canonical_name, spellings

log = logging.getLogger("megatron_preflight")


def _live(model: Any) -> list[dict[str, Any]]:
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    return [legacy_load.unwrapped(c).state_dict(keep_vars=True) for c in chunks]


def _chunk_index(name: str) -> int:
    return 0 if name == "model" else int(name[len("model"):])


def _by_global_name(plan: Any) -> dict[tuple[int, str], Any]:
    """The plan's tensors by (chunk, global name): the running modules may name an MTP layer otherwise than the
    checkpoint did (:func:`~megatron_preflight.reshard.plan.rules.canonical_name`)."""
    return {(_chunk_index(tp.chunk), canonical_name(tp.key)): tp for tp in plan.tensors
            if tp.gkey is not None and tp.shape}


def _live_key(live: dict[str, Any], key: str) -> str:
    """A planned key as the running module names it (an MTP layer's transformer layer may be named otherwise than
    in the checkpoint: renamed at load); ``key`` itself when the chunk has no such entry."""
    return next((k for k in spellings(key) if k in live), key)


@dataclasses.dataclass(frozen=True)
class Share:
    """Which of the items every rank of a replica group holds alike (the model's boxes, a plain optimizer's state)
    this rank hashes: item k goes to member ``k % size``, or, with ``spare_first`` (a legacy save: the group's first
    rank writes the files), to the other members only, so the hashing overlaps that write."""

    member: int
    size: int
    spare_first: bool = False

    def mine(self, k: int) -> bool:
        if self.size <= 1:
            return True
        if self.spare_first:
            return 1 + k % (self.size - 1) == self.member
        return k % self.size == self.member


def local_partials(r: reshard.Resharder, model: Any, coords: dict[str, int], name: str,
                   share: Share | None = None) -> dict[str, Any]:
    """This rank's partial digests: {global name: [(offsets, digest, numel)]}, and the live parameters the checkpoint
    has no data for. With ``share``, only this rank's share of the boxes (the group's other ranks hash the rest)."""
    plan = r.plan_for_coords(coords, name)
    live = _live(model)
    parts: dict[str, list[tuple[tuple, str, int]]] = {}
    planned: set[tuple[int, str]] = set()
    k = -1
    for tp in plan.tensors:
        if tp.gkey is None or tp.shape is None or tp.key.endswith("_extra_state"):
            continue
        chunk = _chunk_index(tp.chunk)
        key = _live_key(live[chunk], tp.key) if chunk < len(live) else tp.key
        planned.add((chunk, key))
        value = live[chunk].get(key) if chunk < len(live) else None
        if value is None:
            continue
        t = value.detach()
        for local, gshape, offsets in placement.boxes(r, tp, coords):
            k += 1
            if share is not None and not share.mine(k):
                continue
            box = t[local]  # hashed where it lives (a GPU tensor on the GPU: no copy to the host)
            parts.setdefault(placement.checkpoint_name(r, tp), []).append(
                (offsets, f"{fingerprint.digest_box(box, gshape, offsets):016x}", box.numel()))
    unplanned = [f"{'model' if len(live) == 1 else f'model{c}'}:{k}" for c, sd in enumerate(live) for k, v in sd.items()
                 if not k.endswith("_extra_state") and getattr(v, "requires_grad", False) and (c, k) not in planned]
    return {"parts": parts, "unplanned": unplanned}


_HALF = ("torch.float16", "torch.bfloat16")


def live_optimizer_states(optimizer: Any, model: Any) -> list[tuple[str, str, Any, int, int, bool]]:
    """(chunk:key, field, flat values, start, end, master) for each state tensor the running optimizer holds: the
    distributed optimizer's shard of each parameter (the range ``start:end`` of the flattened local parameter) or the
    plain optimizer's whole local state; ``master``: the field is the fp32 master of a half-precision parameter."""
    if optimizer is None:
        return []
    names = legacy_load.param_names(model)
    out = []
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if hasattr(part, "_get_main_param_and_optimizer_states") and hasattr(part, "_get_model_param_range_map"):
            for param in list(getattr(part, "model_param_gbuf_map", {})):
                name = names.get(id(param))
                if name is None:
                    continue
                span = part._get_model_param_range_map(param)["param"]
                half = str(param.dtype) in _HALF
                for field, t in part._get_main_param_and_optimizer_states(param).items():
                    if field == "param" and not half:
                        continue  # an fp32 parameter is its own master: verified with the model
                    out.append((name, "@master" if field == "param" else field, t.detach().reshape(-1),
                                span.start, span.end, field == "param"))
            continue
        inner = getattr(part, "optimizer", None)
        if inner is None:
            continue
        pairs = []
        if hasattr(part, "float16_groups"):
            for g16, g32 in zip(part.float16_groups, part.fp32_from_float16_groups, strict=False):
                pairs += list(zip(g16, g32, strict=False))
            for g in getattr(part, "fp32_from_fp32_groups", []):
                pairs += [(p, p) for p in g]
        else:
            pairs = [(p, p) for g in inner.param_groups for p in g["params"]]
        for param, main in pairs:
            name = names.get(id(param))
            if name is None:
                continue
            fields = [("@master", main)] if main is not param else []
            fields += [(k, v) for k, v in inner.state.get(main, {}).items() if k != "step" and hasattr(v, "dim")
                       and v.dim() > 0]
            for field, t in fields:
                flat = t.detach().reshape(-1)
                out.append((name, field, flat, 0, flat.numel(), field == "@master"))
    return out


def optimizer_partials(r: reshard.Resharder, model: Any, optimizer: Any, coords: dict[str, int],
                       name: str, share: Share | None = None) -> dict[str, list[tuple[tuple, str, int]]]:
    """This rank's partial digests of the optimizer state, {global name#field: [(box id, digest, numel)]}: each
    state range hashed at the global indices of its parameter's elements. With ``share``, a plain optimizer's state
    (the same on every rank of the group) only in this rank's share; a distributed optimizer's shard (this rank's
    own) always."""
    plan = r.plan_for_coords(coords, name)
    by_key = _by_global_name(plan)
    parts: dict[str, list[tuple[tuple, str, int]]] = {}
    if any(hasattr(part, "_get_main_param_and_optimizer_states")
           for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]):
        share = None  # a distributed optimizer's state is this rank's own (a whole parameter's too): no replicas
    k = -1
    for param_name, field, values, start, end, _master in live_optimizer_states(optimizer, model):
        chunk, _, key = param_name.partition(":")
        tp = by_key.get((int(chunk), canonical_name(key)))
        if tp is None or values.numel() != end - start:
            continue
        if start == 0 and end == math.prod(tp.shape):  # the whole local state (plain optimizer): hashed by box
            whole = values.reshape(tuple(tp.shape))
            for local, gshape, offsets in placement.boxes(r, tp, coords):
                k += 1
                if share is not None and not share.mine(k):
                    continue
                box = whole[local]
                parts.setdefault(f"{placement.checkpoint_name(r, tp)}#{field}", []).append(
                    (offsets, f"{fingerprint.digest_box(box, gshape, offsets):016x}", box.numel()))
            continue
        index = placement.global_indices(tuple(tp.shape), placement.boxes(r, tp, coords), start, end)
        digest, count = fingerprint.digest_indexed(values, index)
        kept = index[index >= 0]
        box = (int(kept.min()), int(kept.max()), count) if count else (start, end, 0)
        parts.setdefault(f"{placement.checkpoint_name(r, tp)}#{field}", []).append((box, f"{digest:016x}", count))
    return parts


def _differs_here(r: reshard.Resharder, coords: dict[str, int], name: str, model: Any, wanted: set[str]) -> list[str]:
    """Of the tensors in ``wanted``, those whose slice on this rank differs from the checkpoint's (rebuilt here)."""
    plan = r.plan_for_coords(coords, name)
    live = _live(model)
    out = []
    files = reshard.SourceFiles(r.layout.iter_dir or "", trust=r.trust)
    try:
        for tp in plan.tensors:
            if tp.gkey is None or tp.shape is None or placement.checkpoint_name(r, tp) not in wanted:
                continue
            chunk_live = live[_chunk_index(tp.chunk)]
            value = chunk_live.get(_live_key(chunk_live, tp.key))
            expected = placement.expected(tp, files)
            for local, gshape, offsets in placement.boxes(r, tp, coords):
                if value is None or fingerprint.digest_box(value.detach().cpu()[local], gshape, offsets) != \
                        fingerprint.digest_box(expected[local], gshape, offsets):
                    out.append(placement.checkpoint_name(r, tp))
                    break
    finally:
        files.close()
    return out


def _optimizer_differs_here(index: Any, target: Any, coords: dict[str, int], name: str, model: Any, optimizer: Any,
                            wanted: set[str]) -> list[str]:
    """Of the optimizer tensors in ``wanted`` (``name#field``), those whose range on this rank differs from the
    checkpoint's state for it, rebuilt here (in the plain form, the rank's local piece, then its range)."""
    r = reshard.open_resharder(index, dataclasses.replace(target, distributed_optimizer=False), keep_optimizer=True)
    plan = r.plan_for_coords(coords, name)
    by_key = _by_global_name(plan)
    state_plans = {leaf.key: leaf for _, leaf in reshard.iter_plans(plan.optimizer)} if plan.optimizer else {}
    out = []
    files = reshard.SourceFiles(r.layout.iter_dir or "", trust=r.trust)
    try:
        for param_name, field, values, start, end, _master in live_optimizer_states(optimizer, model):
            chunk, _, key = param_name.partition(":")
            tp = by_key.get((int(chunk), canonical_name(key)))
            if tp is None:
                continue
            full = f"{placement.checkpoint_name(r, tp)}#{field}"
            source = state_plans.get(f"{tp.key}#{field}")
            if full not in wanted or source is None or full in out:
                continue
            expected = placement.expected(source, files).reshape(-1)[start:end]
            here = values.detach().cpu().reshape(-1)
            # another size: the live state is not this parameter's range of the checkpoint's (a difference to name)
            if expected.numel() != here.numel() or not bool((expected == here).all()):
                out.append(full)
    finally:
        files.close()
    return out


def judge(stored: dict[str, Any], gathered: list[dict[str, Any]],
          with_optimizer: bool = False) -> tuple[list[str], set[str]]:
    """Rank 0's verdict from every rank's partials: the problems found and the tensors whose digest differs."""
    problems: list[str] = []
    boxes: dict[str, dict[tuple, tuple[str, int, list[int]]]] = {}
    for rank, doc in enumerate(gathered):
        for name, parts in doc["parts"].items():
            for offsets, dig, numel in parts:
                seen = boxes.setdefault(name, {}).get(tuple(offsets))
                if seen is None:
                    boxes[name][tuple(offsets)] = (dig, numel, [rank])
                elif seen[0] != dig:
                    problems.append(f"{name}: ranks {seen[2]} and {rank} hold different values for the same slice "
                                    f"(offsets {list(offsets)}): replicas diverged or one rank loaded another slice")
                else:
                    seen[2].append(rank)
        for item in doc.get("rng", []):
            problems.append(f"rank {rank}: {item}")
        for item in doc["unplanned"]:
            problems.append(f"{item} (rank {rank}): the checkpoint has no data for this parameter: it keeps its "
                            "random initialisation (a non-strict load, or a checkpoint missing it)")
    differ: set[str] = set()
    for name, want in stored["tensors"].items():
        if "#" in name and (not with_optimizer or name.endswith("#step")):
            continue  # the optimizer state, when it was not loaded
        held = boxes.get(name)
        if not held:
            problems.append(f"{name}: in the checkpoint, but no rank holds it (not loaded)")
            continue
        numel = sum(n for _, n, _ in held.values())
        total = 1
        for s in want["shape"]:
            total *= s
        got = f"{fingerprint.combine([int(d, 16) for d, _, _ in held.values()]):016x}"
        if numel != total or got != want["digest"]:
            differ.add(name)
    for name in boxes:
        if name not in stored["tensors"]:
            problems.append(f"{name}: held by the run but not in the checkpoint's fingerprints (fingerprints of "
                            "another checkpoint?)")
    return problems, differ


def verify_after_load(model: Any, args: Any, optimizer: Any = None) -> None:
    """Run by every rank right after the load. Returns when the run holds the checkpoint; otherwise stops every rank."""
    started = time.perf_counter()
    load_dir = getattr(args, "load", None)
    if not load_dir:
        return
    if getattr(args, "use_megatron_fsdp", False):  # its parameters are DTensor shards over the data-parallel ranks
        _say("verify: not available in a Megatron-FSDP run (its parameters are sharded over the data-parallel ranks, "
             "not by the 3D layout the fingerprints are compared at); the load was Megatron-FSDP's own, from the "
             "checkpoint's fsdp_dtensor form")
        return
    trust = bool(getattr(args, "preflight_trust_checkpoint", False))
    load_dir = remote_load.local_dir(load_dir)  # (an msc:// checkpoint: its node's staged mirror; collective)
    index = legacy_load.shared_index(load_dir, getattr(args, "ckpt_step", None), trust, False)
    root = index.layout.root or load_dir
    target = legacy_load.target_from_args(args)
    r = reshard.open_resharder(index, target, keep_optimizer=False)
    coords = legacy_load.runtime_coordinates(consensus.rank(), consensus.world_size(), r)
    name = naming.shard_dir_name(coords["tp"], coords["pp"], coords["ep"], pp_size=r.tgt.pp, ep_size=r.tgt.ep)
    try:
        rng = verify_rng.rng_problems(index, args, coords, name, _dp_rank())
    except PreflightError as exc:
        rng = [f"the RNG state of this rank's checkpoint entry cannot be read: {exc.message}"]
    stored = consensus.decide_on_rank0(lambda: fingerprint.load(root, index.layout.iteration),
                                       lambda exc: {"error": str(exc)})
    if stored is None:
        rng_all = consensus.gather_to_rank0(rng)
        problems = consensus.decide_on_rank0(lambda: [f"rank {i}: {p}" for i, ps in enumerate(rng_all or [])
                                                      for p in ps], lambda exc: [f"internal: {exc}"])
        if problems:
            _stop("verify: the loaded run is not the checkpoint's:\n  " + "\n  ".join(problems[:50]))
        _say(f"verify: no fingerprints stored for {root} (iteration {index.layout.iteration}): nothing to compare "
             f"the loaded model with; run `megatron-preflight fingerprint {root} --iteration "
             f"{index.layout.iteration}` to enable it"
             + ("; the restored RNG states are each rank's checkpoint entry" if verify_rng.restores_rng(args, index)
                else ""))
        return
    if "error" in stored:
        _stop(f"verify: {stored['error']}")
    mine = local_partials(r, model, coords, name)
    mine["rng"] = rng
    with_optimizer = optimizer is not None and not getattr(args, "no_load_optim", False) and \
        not getattr(args, "finetune", False) and any("#" in k for k in stored["tensors"])
    if with_optimizer:
        mine["parts"].update(optimizer_partials(r, model, optimizer, coords, name))
    gathered = consensus.gather_to_rank0(mine)
    verdict = consensus.decide_on_rank0(lambda: judge(stored, gathered or [], with_optimizer),
                                        lambda exc: ([f"internal: {exc}"], set()))
    problems, differ = verdict
    if differ:  # which ranks hold the differing slices: each rebuilds its part of those tensors from the checkpoint
        unreadable: list[str] = []
        try:
            here = _differs_here(r, coords, name, model, {d for d in differ if "#" not in d})
            if any("#" in d for d in differ):
                here += _optimizer_differs_here(index, target, coords, name, model, optimizer,
                                                {d for d in differ if "#" in d})
        except PreflightError as exc:  # the bytes this rank loaded cannot be read again (a record's CRC fails)
            here, unreadable = [], [exc.render()]
        gathered_here = consensus.gather_to_rank0({"names": here, "unreadable": unreadable})
        where = [d["names"] for d in gathered_here] if gathered_here is not None else None
        if where is not None:
            for i, d in enumerate(gathered_here or []):
                problems[:0] = [f"rank {i} cannot read its part of the checkpoint again: {m}" for m in d["unreadable"]]
            changed = {t for t in differ if not any(t in names for names in where)}
            shards = _changed_shards(root, index.layout.iteration, trust, changed) if changed else {}
            for tensor in sorted(differ):
                ranks = [i for i, names in enumerate(where) if tensor in names]
                cause = ("its slice on these ranks is not the checkpoint's (a wrong slice loaded, or the values "
                         "changed after the load)" if ranks else
                         "every rank's slice equals a fresh read of the checkpoint: the checkpoint no longer matches "
                         "its fingerprints (changed after they were taken: a bad copy, bit rot, or a converter)")
                problems.append(f"{tensor}: the loaded values differ from the checkpoint's fingerprint; "
                                f"ranks {ranks}: {cause}" if ranks else f"{tensor}: {cause}{shards.get(tensor, '')}")
    diverged = {p.split(": ", 1)[0] for p in problems if "hold different values for the same slice" in p}
    if diverged:  # the ranks loaded different copies: does the checkpoint itself still hold what was saved?
        said = consensus.decide_on_rank0(lambda: _files_changed(root, index.layout.iteration, trust, diverged),
                                         lambda exc: "")
        if said:
            problems.insert(0, said)  # first: the cause of the many lines after it
    problems = consensus.decide_on_rank0(lambda: problems, lambda exc: [f"internal: {exc}"])
    if problems:
        _stop("verify: the loaded model is not the checkpoint's:\n  " + "\n  ".join(problems[:50])
              + (f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""))
    what = "model and optimizer state equal" if with_optimizer else "model equals"
    count = sum(1 for k in stored["tensors"] if with_optimizer or "#" not in k)
    rng_said = "; the restored RNG states are each rank's entry" if verify_rng.restores_rng(args, index) else ""
    _say(f"verify: the loaded {what} the checkpoint's fingerprints ({count} tensors{rng_said}; "
         f"{time.perf_counter() - started:.2f} s on rank 0)")


def _changed_shards(root: str, iteration: Any, trust: bool, names: set[str]) -> dict[str, str]:
    """Rank 0: for tensors the checkpoint no longer holds as fingerprinted, where they differ and why (the content
    check of prove/content.py, on those tensors only)."""
    from megatron_preflight.prove.content import check_content  # reads the named tensors once more

    try:
        report = check_content(root, iteration=iteration, trust=trust, names=names)
    except PreflightError as exc:
        return {n: f" (not located: {exc.message})" for n in names}
    out = {}
    for f in report.findings:
        where = f" in {', '.join(f.shards)}" if f.shards and f.located else ""
        out[f.tensor] = f"; {f.problem}{where}; likely cause: {report.cause}"
    return out


def _files_changed(root: str, iteration: Any, trust: bool, names: set[str]) -> str:
    """Rank 0: whether the files hold other values than the fingerprints for ``names`` (copies the ranks loaded
    differently), said with the file and the likely cause ("" when they hold the saved values)."""
    from megatron_preflight.prove.content import check_content  # reads the named tensors once more

    report = check_content(root, iteration=iteration, trust=trust, names=names)
    if report.ok or report.fingerprints is None:
        return ""
    return (f"the checkpoint's files no longer hold what was saved ({report.cause}); first: "
            f"{report.findings[0].render()}")


def _dp_rank() -> int:
    try:
        from megatron.core import parallel_state as ps  # inside a Megatron job

        return ps.get_data_parallel_rank() if ps.model_parallel_is_initialized() else 0
    except ImportError:
        return 0


def _say(msg: str) -> None:
    if consensus.rank() == 0:
        print(f"[megatron-preflight] {msg}", flush=True)


def _stop(message: str) -> None:
    """Every rank reaches here with the same problems: rank 0 prints them, every rank exits 1 before iteration 1."""
    if consensus.rank() == 0:
        print(f"[megatron-preflight] {message}", file=sys.stderr, flush=True)
        print("[megatron-preflight] the job must not train: stopping every rank (exit 1)", file=sys.stderr,
              flush=True)
    runtime.exit_job(runtime.EXIT_FAIL)

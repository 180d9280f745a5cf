"""``--preflight verify``'s RNG check: each rank's restored RNG state is the checkpoint's entry for that rank.

Megatron restores the RNG at the end of ``load_checkpoint`` (unless ``--no-load-rng`` / ``--finetune``, or a release
checkpoint): Python's ``random``, torch's CPU generator, the CUDA generator and the model-parallel RNG tracker
(``model-parallel-rng``, ``expert-parallel-rng``, ...: the dropout streams each TP / EP rank draws from), from the entry
of its own shard — the legacy file of its (TP, PP, EP) dir, or torch_dist's sharded object ``rng_state`` at (PP, TP)
— and, with ``--data-parallel-random-init``, its data-parallel rank's element of that list. A loader that restores
another rank's entry (or none) trains on silently with the wrong dropout streams; here every rank reads its own entry
straight from the checkpoint (its file's pickle, through the allow-list; nothing else is read) and compares digests
of the states it now holds. The CUDA generator is compared only where CUDA is real.
"""

from __future__ import annotations

import os
import random
import zlib
from typing import Any

from megatron_preflight.layout import naming
from megatron_preflight.layout.dist import metadata_facts, read_object
from megatron_preflight.layout.model import Format
from megatron_preflight.reshard.sources.torch_dist import object_fqn
from megatron_preflight.torch_file import TensorRef, TorchFile
from megatron_preflight.tree import map_leaves


def restores_rng(args: Any, index: Any) -> bool:
    """Whether Megatron restored the RNG from this checkpoint in this run: not with --no-load-rng / --finetune or
    from a release checkpoint; and from a torch_dist checkpoint only at its own (TP, PP) and when it saved the RNG
    (Megatron: "(TP, PP) mismatch after resume ...: RNG state will be ignored")."""
    if getattr(args, "no_load_rng", False) or getattr(args, "finetune", False) or \
            index.layout.iteration == naming.RELEASE:
        return False
    layout = index.layout
    if layout.format == Format.TORCH_DIST:
        par = layout.parallel
        saved = (par.tp, par.pp) if par is not None else None
        run = (getattr(args, "tensor_model_parallel_size", 1), getattr(args, "pipeline_model_parallel_size", 1))
        if saved != run or getattr(layout.saved_args, "no_save_rng", False):
            return False
    return True


def saved_entry(index: Any, coords: dict[str, int], shard_name: str, dp_rank: int, trust: bool,
                random_init: bool) -> dict[str, Any] | None:
    """This rank's RNG entry in the checkpoint (tensors read), None when the checkpoint has none."""
    layout = index.layout
    if layout.format == Format.TORCH:
        path = os.path.join(layout.iter_dir or "", shard_name, naming.MODEL_FILENAME)
        with TorchFile(path, trust=trust) as f:
            meta = f.load_metadata()
            value = meta.get("rng_state") if isinstance(meta, dict) else None
            value = map_leaves(value, lambda v, _p: f.tensor(v).clone() if isinstance(v, TensorRef) else v)
    elif layout.format == Format.TORCH_DIST:
        par = layout.parallel
        fqn = object_fqn("rng_state", (coords["pp"], coords["tp"]), (par.pp if par else 1, par.tp if par else 1))
        # (where the item lies: the facts every rank's check read, or their index — not the whole table decoded)
        info = metadata_facts(layout.iter_dir or "", trust=trust).objects.get(fqn)
        value = read_object(layout.iter_dir or "", fqn, info, trust=trust, tensors=True) if info else None
    else:
        return None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        return None
    entry = value[dp_rank] if random_init and dp_rank < len(value) else value[0]
    return entry if isinstance(entry, dict) else None


def _digest(value: Any) -> int | None:
    import torch  # deferred: the verify path runs inside the job, where torch is loaded

    if isinstance(value, torch.Generator):
        value = value.get_state()
    if isinstance(value, torch.Tensor):
        return zlib.crc32(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return None


def live_states() -> dict[str, Any]:
    """The RNG states this process holds now (the keys of Megatron's saved entry)."""
    import torch  # deferred: as above
    from megatron.core import tensor_parallel  # Megatron is there: this runs inside the job

    out: dict[str, Any] = {"random_rng_state": random.getstate(), "torch_rng_state": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda_rng_state"] = torch.cuda.get_rng_state()
    for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items():
        out[f"rng_tracker_states/{name}"] = state
    return out


def compare(entry: dict[str, Any], live: dict[str, Any]) -> list[str]:
    """The names of the RNG states that are not the entry's."""
    want: dict[str, Any] = {k: entry[k] for k in ("random_rng_state", "torch_rng_state", "cuda_rng_state")
                            if k in entry}
    for name, state in (entry.get("rng_tracker_states") or {}).items():
        want[f"rng_tracker_states/{name}"] = state
    differ = []
    for name, expected in want.items():
        if name not in live:
            continue  # not comparable here (the CUDA generator without CUDA)
        got = live[name]
        if name == "random_rng_state":
            same = isinstance(expected, tuple) and tuple(map(_plain, expected)) == tuple(map(_plain, got))
            if not isinstance(expected, tuple):
                continue  # not read as plain data: not compared
        else:
            a, b = _digest(expected), _digest(got)
            if a is None or b is None:
                continue
            same = a == b
        if not same:
            differ.append(name)
    return differ


def _plain(v: Any) -> Any:
    return tuple(v) if isinstance(v, (list, tuple)) else v


def rng_problems(index: Any, args: Any, coords: dict[str, int], shard_name: str, dp_rank: int) -> list[str]:
    """This rank's RNG problems (empty: its restored states are its checkpoint entry's)."""
    if not restores_rng(args, index):
        return []
    trust = bool(getattr(args, "preflight_trust_checkpoint", False))
    entry = saved_entry(index, coords, shard_name, dp_rank, trust, bool(getattr(args, "data_parallel_random_init",
                                                                                False)))
    if entry is None:
        return []
    differ = compare(entry, live_states())
    if not differ:
        return []
    where = f"TP{coords['tp']} PP{coords['pp']} EP{coords['ep']} DP{dp_rank}"
    return [f"the RNG state {', '.join(differ)} is not the checkpoint's entry for this rank ({where}, {shard_name}): "
            "restored for another rank, or not restored (its dropout streams differ from the saved run's)"]

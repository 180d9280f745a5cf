"""Fingerprints at save (issue 33): after Megatron's ``save_checkpoint`` has finished a checkpoint, every rank hashes
the model (and optimizer state) it holds — what Megatron just wrote — as boxes of the global tensors, with the digest
``--preflight verify`` and ``megatron-preflight fingerprint`` use; rank 0 merges them and writes
``megatron_preflight_fingerprints/iter_N.json`` atomically. No tensor is read back: the checkpoint's metadata is read
(to place each local tensor in its global tensor), the values are the live ones.

Covered: synchronous saves in the legacy and torch_dist formats, plain and distributed optimizer; asynchronous saves
(``--async-save``) once Megatron has finalized them (:func:`fingerprint_after_finalize`, run as the request's last
finalize function, after the tracker names the iteration: a fingerprint never describes a checkpoint that was not
completed). The live tensors have moved on by then, so an asynchronous save's fingerprints are read back from the
files it wrote, each rank hashing a share of the tensors. Not covered (said in the log): non-persistent (local)
checkpoints; for those, ``megatron-preflight fingerprint`` after the save gives the same file from the bytes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from megatron_preflight import dtypes, reshard
from megatron_preflight.errors import PreflightError
from megatron_preflight.hook import consensus, legacy_load, verify
from megatron_preflight.layout import dist, naming, transport
from megatron_preflight.layout.storage import is_url
from megatron_preflight.prove import common_state, fingerprint
from megatron_preflight.prove.global_view import global_plan, global_resharder, named_tensors

log = logging.getLogger("megatron_preflight")


def skipped(args: Any, kwargs: dict[str, Any]) -> str | None:
    """Why this save is not fingerprinted (None: it is; "disabled": the plugin is off, and silent)."""
    if getattr(args, "preflight", "off") == "off":
        return "disabled"
    if getattr(args, "preflight_fingerprint_on_save", "on") == "off":
        return "off"
    if kwargs.get("non_persistent_ckpt"):
        return "a non-persistent checkpoint is not fingerprinted"
    save = getattr(args, "save", None)
    if is_url(save):  # (the fingerprints would go beside the checkpoint, on the store: the command uploads them)
        return (f"a save to object storage is not fingerprinted in the job; run `megatron-preflight fingerprint "
                f"{save}` once it is written (it stores them beside the checkpoint there)")
    if getattr(args, "use_megatron_fsdp", False):  # (its parameters are DTensor shards over the data-parallel ranks)
        return ("a Megatron-FSDP save is not fingerprinted in the job; run `megatron-preflight fingerprint "
                f"{getattr(args, 'save', None) or 'SAVE_DIR'}` once it is written")
    return None


def _document(index: Any, gathered: list[dict[str, Any]], with_optimizer: bool) -> dict[str, Any]:
    """Rank 0: the fingerprint file of the checkpoint from every rank's partials (each box counted once; replicas
    that disagree, or a tensor not covered whole, are an error: nothing is written)."""
    boxes: dict[str, dict[tuple, tuple[str, int]]] = {}
    for doc in gathered:
        for name, parts in doc["parts"].items():
            for offsets, dig, numel in parts:
                seen = boxes.setdefault(name, {}).setdefault(tuple(offsets), (dig, numel))
                if seen[0] != dig:
                    raise PreflightError(f"fingerprint at save: the ranks hold different values for the same slice "
                                         f"of {name} (offsets {list(offsets)}): its replicas diverged",
                                         path=index.layout.iter_dir, code="fingerprint",
                                         fix="the checkpoint is saved; investigate the run (replicas should agree)")
    g = global_resharder(index, with_optimizer, None)
    real = g.vocab.real if g.vocab is not None else None
    tensors: dict[str, Any] = {}
    split: dict[str, list[list[Any]]] = {}
    for name, tp in named_tensors(global_plan(g), g.writes_optimizer).items():
        if name.endswith("_extra_state") or name.endswith("#step") or getattr(tp, "shape", None) is None:
            continue
        shape = list(tp.shape)
        if tp.pad_from is not None and real is not None:
            shape[0] = real
        held = boxes.get(name)
        total = 1
        for s in shape:
            total *= s
        if not held or sum(n for _, n in held.values()) != total:
            raise PreflightError(f"fingerprint at save: the ranks do not hold all of {name}", code="fingerprint",
                                 path=index.layout.iter_dir,
                                 fix="run `megatron-preflight fingerprint` on the checkpoint instead")
        tensors[name] = {"digest": f"{fingerprint.combine([int(d, 16) for d, _ in held.values()]):016x}",
                         "shape": shape, "dtype": str(dtypes.to_torch(tp.dtype)).removeprefix("torch.")}
        if len(held) > 1:  # each saved slice's digest: a later check names the shard
            split[name] = [[list(o), d, n] for o, (d, n) in sorted(held.items())]
    return fingerprint.document(g, index.layout.iteration, index.layout.root, tensors, split,
                                common=common_state.document(index, g.choice.plain) if g.writes_optimizer else None)


def _saved_index(save_dir: str, iteration: int) -> Any:
    """The index of the checkpoint just saved: rank 0 reads its metadata and sends the layout (collective)."""
    box: list[Any] = []

    def read() -> tuple[str, Any]:
        _facts_for_the_next_start(save_dir, iteration)
        index = reshard.open_index(save_dir, iteration=iteration, trust_checkpoint=True)
        box.append(index)
        return "ok", transport.dumps(index.layout)

    kind, payload = consensus.decide_on_rank0(read, lambda exc: ("error", getattr(exc, "message", str(exc))))
    if kind == "error":
        raise PreflightError(f"the checkpoint just saved cannot be indexed: {payload}", path=save_dir,
                             code="fingerprint", fix="run `megatron-preflight fingerprint` on it")
    return box[0] if box else reshard.CheckpointIndex(transport.loads(payload), trust=True)


def _facts_for_the_next_start(save_dir: str, iteration: int) -> None:
    """A torch_dist save's ``.metadata`` read as the next job start reads it (through the allow-list): its facts are
    then indexed for that start (layout/dcp_cache), and the trusted read that follows takes them from memory. Best
    effort: a file the allow-list refuses is read trusted below, as before, and not indexed."""
    iter_dir = os.path.join(save_dir, naming.iteration_dir_name(iteration))
    if not os.path.isfile(os.path.join(iter_dir, dist.DCP_METADATA)):
        return
    try:
        dist.metadata_facts(iter_dir)
    except PreflightError as exc:
        log.debug("the saved .metadata is not indexed for the next job start: %s", exc.message)


def fingerprint_after_finalize(args: Any, iteration: int, with_optimizer: bool) -> None:
    """Run by every rank as the last finalize function of an asynchronous save of ``iteration`` (collective): the
    checkpoint is complete and its tracker written; each rank reads and hashes every world-th tensor of it, rank 0
    merges and writes the file."""
    started = time.perf_counter()
    save_dir = args.save
    rank, world = consensus.rank(), consensus.world_size()
    mine: dict[str, Any] = {}
    try:
        index = _saved_index(save_dir, iteration)
        g = global_resharder(index, with_optimizer, None)
        planned = fingerprint.planned(g)
        files = reshard.SourceFiles(g.layout.iter_dir or "", trust=True)  # each record's CRC checked as it is read
        try:
            for name in sorted(planned)[rank::world]:
                printed = fingerprint.fingerprint_of(g, name, planned[name], files)
                if printed is not None:
                    mine[name] = (printed.entry, [[list(o), f"{d:016x}", n] for o, d, n, _ in printed.boxes])
        finally:
            files.close()
        problem = None
    except PreflightError as exc:
        index, problem = None, exc.message
    gathered = consensus.gather_to_rank0({"entries": mine, "problem": problem})

    def write() -> str:
        problems = [d["problem"] for d in gathered or [] if d.get("problem")]
        if problems or index is None:
            return f"not written: {problems[0] if problems else 'the checkpoint could not be indexed'}"
        tensors, boxes = {}, {}
        for doc in gathered or []:
            for name, (entry, parts) in doc["entries"].items():
                tensors[name] = entry
                if len(parts) > 1:
                    boxes[name] = parts
        doc = fingerprint.document(g, iteration, index.layout.root or save_dir, tensors, boxes,
                                   common=common_state.document(index, g.choice.plain) if g.writes_optimizer
                                   else None)
        path = fingerprint.store(index.layout.root or save_dir, iteration, doc)
        return f"{len(tensors)} tensors, {path}"

    said = consensus.decide_on_rank0(write, lambda exc: f"not written: {exc}")
    verify._say(f"fingerprints of the asynchronous save (iteration {iteration}, read back once finalized): {said} "
                f"({time.perf_counter() - started:.2f} s)")


@dataclass
class _Placed:
    """What the first save of a run learnt, for the next ones (same model, same layout: the same plan): the plan that
    places this rank's tensors in the global ones, and this rank's share of the items its replica group holds."""

    r: Any
    coords: dict[str, int]
    name: str
    share: verify.Share


_placed: dict[tuple, _Placed] = {}  # by (save dir, with optimizer, format)


def _key(args: Any, with_optimizer: bool) -> tuple:
    return (args.save, with_optimizer, getattr(args, "ckpt_format", None))


def _share(coords: dict[str, int] | None, legacy: bool) -> verify.Share:
    """This rank's place among the ranks that hold the same slices (the same TP/PP/EP/ETP coordinates: data- and
    context-parallel replicas; a rank that could not place its tensors is in no group). Collective."""
    mine = sorted(coords.items()) if coords is not None else None
    everyone = consensus.all_gather(mine)
    group = [i for i, c in enumerate(everyone) if c is not None and c == mine]
    me = consensus.rank()
    return verify.Share(group.index(me), len(group), spare_first=legacy) if me in group else verify.Share(0, 1)


def _hash(p: _Placed, model: Any, optimizer: Any, with_optimizer: bool) -> dict[str, Any]:
    mine: dict[str, Any] = verify.local_partials(p.r, model, p.coords, p.name, p.share)
    if with_optimizer:
        mine["parts"].update(verify.optimizer_partials(p.r, model, optimizer, p.coords, p.name, p.share))
    return mine


class DuringSave:
    """This rank's share hashed in a background thread while Megatron writes the checkpoint (the tensors do not
    change until the save returns; numpy's hashing releases the GIL), from the plan an earlier save of the run made."""

    def __init__(self, placed: _Placed, model: Any, optimizer: Any, with_optimizer: bool) -> None:
        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0

        def run() -> None:
            started = time.perf_counter()
            try:
                self.result = _hash(placed, model, optimizer, with_optimizer)
            except BaseException as exc:  # noqa: BLE001 - reported by the save's merge, on every rank
                self.error = exc
            self.seconds = time.perf_counter() - started

        self.thread = threading.Thread(target=run, name="preflight-fingerprint", daemon=True)
        self.thread.start()

    def join(self) -> dict[str, Any]:
        self.thread.join()
        if self.error is not None:
            if isinstance(self.error, PreflightError):
                raise self.error
            raise PreflightError(f"fingerprint at save: hashing failed ({type(self.error).__name__}: {self.error})",
                                 code="fingerprint", fix="run `megatron-preflight fingerprint` on the checkpoint")
        assert self.result is not None
        return self.result


def start_during_save(model: Any, optimizer: Any, args: Any) -> DuringSave | None:
    """Before Megatron's save: when an earlier save of this run placed the same tensors, start hashing this rank's
    share now, beside the save (None: hashed after it, as the first save of a run is)."""
    with_optimizer = optimizer is not None and not getattr(args, "no_save_optim", False)
    placed = _placed.get(_key(args, with_optimizer))
    return DuringSave(placed, model, optimizer, with_optimizer) if placed is not None else None


def fingerprint_after_save(model: Any, optimizer: Any, args: Any, iteration: int, saved_seconds: float | None = None,
                           during: DuringSave | None = None) -> None:
    """Run by every rank after Megatron's save of ``iteration`` to ``args.save`` returned (collective);
    ``saved_seconds``: how long that save took (said beside the fingerprints' own time and its parts); ``during``:
    the hashing started beside the save (:func:`start_during_save`), else this rank hashes now. Each rank hashes
    its share of what its replica group holds alike."""
    started = time.perf_counter()
    save_dir = args.save
    with_optimizer = optimizer is not None and not getattr(args, "no_save_optim", False)
    parts: dict[str, float] = {}
    mine: dict[str, Any] = {"parts": {}}
    index, problem, hashed, placed = None, None, "", None
    try:  # the checkpoint's metadata only (rank 0 reads it: the tensors' global places)
        index = _saved_index(save_dir, iteration)
        parts["index"] = time.perf_counter() - started
        if during is not None:
            mine = during.join()
            parts["wait for the hashing"] = time.perf_counter() - started - parts["index"]
            hashed = f"; hashed beside the save in {during.seconds:.2f} s"
        else:
            r = reshard.open_resharder(index, legacy_load.target_from_args(args), keep_optimizer=False)
            coords = legacy_load.runtime_coordinates(consensus.rank(), consensus.world_size(), r)
            name = naming.shard_dir_name(coords["tp"], coords["pp"], coords["ep"], pp_size=r.tgt.pp,
                                         ep_size=r.tgt.ep)
            placed = _Placed(r, coords, name, verify.Share(0, 1))
    except PreflightError as exc:
        problem = exc.message
    if during is None:  # every rank enters the collective, placed or not
        share = _share(placed.coords if placed else None, getattr(args, "ckpt_format", "torch") == "torch")
        if placed is not None and problem is None:
            placed.share = share
            try:
                mine = _hash(placed, model, optimizer, with_optimizer)
                _placed[_key(args, with_optimizer)] = placed
            except PreflightError as exc:
                problem = exc.message
            parts["hash"] = time.perf_counter() - started - parts["index"]
    gathered = consensus.gather_to_rank0({**mine, "problem": problem})

    def write() -> str:
        problems = [d["problem"] for d in gathered or [] if d.get("problem")]
        if problems or index is None:
            return f"not written: {problems[0] if problems else 'the checkpoint could not be indexed'}"
        doc = _document(index, gathered or [], with_optimizer)
        path = fingerprint.store(index.layout.root or save_dir, iteration, doc)
        return f"{len(doc['tensors'])} tensors, {path}"

    said = consensus.decide_on_rank0(write, lambda exc: f"not written: {exc}")
    if said.startswith("not written"):
        _placed.pop(_key(args, with_optimizer), None)  # the next save places its tensors again
    total = time.perf_counter() - started
    where = ", ".join(f"{k} {v:.2f}" for k, v in {**parts, "merge+write": total - sum(parts.values())}.items())
    save = f"; the save itself {saved_seconds:.2f} s" if saved_seconds is not None else ""
    verify._say(f"fingerprints at save (iteration {iteration}): {said} ({total:.2f} s on rank 0 after the save: "
                f"{where}{hashed}{save})")

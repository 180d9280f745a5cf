"""Discover a checkpoint's layout from a ``--load`` root or an iteration dir, from metadata only."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from megatron_preflight import parallel
from megatron_preflight.errors import PreflightError, require_regular_file
from megatron_preflight.layout import completeness, naming, storage
from megatron_preflight.layout.dist import DCP_METADATA, METADATA_JSON, inspect_dist
from megatron_preflight.layout.foreign import looks_like
from megatron_preflight.layout.hf.names import is_hf_dir
from megatron_preflight.layout.model import Format, Layout, Shard
from megatron_preflight.torch_file import read_torch_file, zip_trailer_problem

log = logging.getLogger(__name__)

# Args that must agree across all shards of one checkpoint.
CONSISTENT_ARGS = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size", "num_layers", "hidden_size",
    "ffn_hidden_size", "num_attention_heads", "num_query_groups", "num_experts", "padded_vocab_size",
    "use_distributed_optimizer", "swiglu", "untie_embeddings_and_output_weights",
)


def _is_iteration_dir(path: str) -> bool:
    try:
        entries = os.listdir(path)
    except OSError:
        return False
    return any(naming.parse_shard_dir_name(e) for e in entries) or METADATA_JSON in entries or DCP_METADATA in entries


def _list_iterations(root: str) -> list[int | str]:
    its: list[int | str] = []
    for e in os.listdir(root):
        it = naming.parse_iteration_dir(e)
        if it is not None and os.path.isdir(os.path.join(root, e)):
            its.append(it)
    return sorted(its, key=lambda i: (-1 if i == naming.RELEASE else i))


# ``shards="auto"`` parses every shard file of a legacy checkpoint up to this many, and a sample above it.
SAMPLE_ABOVE = 32


ShardReader = Callable[[list[Shard], bool], list[tuple[Shard, Exception | None]]]


# Shard files are parsed in a thread pool above this many. The threads overlap the files' reads (a network
# filesystem's latency); the unpickling holds the GIL. Starting the pool costs more than a few warm reads (~5 ms).
POOL_ABOVE = 4


def read_shards(shards: list[Shard], trust: bool) -> list[tuple[Shard, Exception | None]]:
    """Parse each shard's model file (metadata only), a few at a time; the default :data:`ShardReader`."""
    def one(s: Shard) -> tuple[Shard, Exception | None]:
        return (s, None) if s.meta is not None else read_shard(s, trust)

    if sum(s.meta is None for s in shards) <= POOL_ABOVE:
        return [one(s) for s in shards]
    from concurrent.futures import ThreadPoolExecutor  # deferred: a torch_dist verdict reads no shard files

    with ThreadPoolExecutor(max_workers=min(8, len(shards))) as pool:
        return list(pool.map(one, shards))


def discover(path: str | os.PathLike, *, iteration: int | str | None = None, trust_checkpoint: bool = False,
             shards: str = "all", reader: ShardReader | None = None) -> Layout:
    """Describe the checkpoint at ``path``. Raises :class:`PreflightError` only when ``path`` is not a directory.

    ``shards`` says which legacy shard files are parsed: ``all`` (what the resharder needs), ``sample`` (rank 0's,
    the first of every pipeline stage and the last: the verdict of a 8,192-shard checkpoint in a fraction of a
    second; every shard dir is still listed, and its files sized and their zip trailers checked), or ``auto``
    (all up to :data:`SAMPLE_ABOVE` files, a sample above). ``reader`` parses the shard files (default
    :func:`read_shards`; the hook passes one that takes what every rank parsed of its share)."""
    if shards not in ("all", "sample", "auto"):
        raise ValueError(f"shards={shards!r}: expected all, sample or auto")
    storage.refuse_url(path)  # (never a relative path named msc:)
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise PreflightError("no such file or directory", path=path, fix="pass the --load dir of the run",
                             code="usage")
    if not os.path.isdir(path):
        raise PreflightError("this is a file, not a checkpoint directory", path=path,
                             fix="pass the dir given to --load (the one holding latest_checkpointed_iteration.txt)",
                             code="usage")
    if isinstance(iteration, str) and iteration != naming.RELEASE and not iteration.strip().lstrip("-").isdigit():
        raise PreflightError(f"--iteration {iteration!r} is neither a number nor 'release'", path=path,
                             fix="pass an iteration number (see `megatron-preflight inspect` for those available) or "
                                 "release", code="usage")
    if is_hf_dir(path) and not os.path.exists(os.path.join(path, naming.TRACKER_FILENAME)):
        # deferred: a Hugging Face model's reader (its config and family tables, ~8 ms to import) loads for one only
        from megatron_preflight.layout.hf.discover import discover_hf

        return discover_hf(path)
    layout = Layout(path=path)
    iter_dir = _resolve_iteration(layout, path, iteration)
    if iter_dir is None:
        if not layout.problems:
            layout.add("not_megatron", path,
                       f"this is not a Megatron checkpoint; it looks like {layout.looks_like}",
                       "pass the dir given to --save/--load (it holds latest_checkpointed_iteration.txt and iter_* dirs)")
        return layout
    layout.iter_dir = iter_dir
    entries = set(os.listdir(iter_dir))
    shard_names = sorted(e for e in entries if naming.parse_shard_dir_name(e) is not None)
    is_dist = METADATA_JSON in entries or DCP_METADATA in entries
    if shard_names and is_dist:
        layout.add("mixed_formats", iter_dir,
                   f"the dir holds both legacy shard dirs ({shard_names[0]}, ...) and distributed-checkpoint files; "
                   "Megatron picks torch_dist when metadata.json exists and ignores the mp_rank_* dirs",
                   "move one of the two checkpoints to its own --save dir")
    if is_dist:
        inspect_dist(layout, iter_dir, trust=trust_checkpoint)
        _sizes_from_args(layout)
    elif shard_names:
        layout.format = Format.TORCH
        _inspect_legacy(layout, iter_dir, shard_names, trust_checkpoint, shards, reader or read_shards)
    else:
        layout.looks_like = looks_like(iter_dir)
        layout.add("no_shards", iter_dir,
                   f"the iteration dir has no mp_rank_* shard dirs and no distributed-checkpoint files (it is {layout.looks_like})",
                   "the save was interrupted: load an earlier iteration with --ckpt-step N")
    if layout.format == Format.TORCH:  # the shard dirs were sized already: add what sits beside them
        listed = set(shard_names)
        layout.total_bytes += sum(_dir_bytes(os.path.join(iter_dir, e)) if os.path.isdir(os.path.join(iter_dir, e))
                                  else _size(os.path.join(iter_dir, e)) for e in entries if e not in listed)
    else:
        layout.total_bytes = _dir_bytes(iter_dir)
    return layout


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _dir_bytes(path: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:
                pass
    return total


def _resolve_iteration(layout: Layout, path: str, iteration: int | str | None) -> str | None:
    """Find the iteration dir; records problems. None when there is nothing Megatron-shaped to inspect."""
    tracker = os.path.join(path, naming.TRACKER_FILENAME)
    own_iteration = naming.parse_iteration_dir(os.path.basename(path))
    if not os.path.exists(tracker) and own_iteration is not None or (
        not os.path.exists(tracker) and not _list_iterations(path) and _is_iteration_dir(path)
    ):
        # An iteration dir was given directly.
        layout.root = os.path.dirname(path)
        layout.iteration = own_iteration
        if iteration is not None and own_iteration is not None and str(iteration) != str(own_iteration):
            layout.add("usage", path, f"--iteration {iteration} asked for, but this is the dir of iteration {own_iteration}",
                       "pass the checkpoint root instead")
        return path
    layout.root = path
    layout.available_iterations = _list_iterations(path)
    if os.path.exists(tracker):
        text = None
        try:
            require_regular_file(tracker)
            with open(tracker, "rb") as fh:
                raw = fh.read(4096)  # a tracker holds a number; never read a huge file whole
            text = raw.decode("utf-8", errors="replace")
        except PreflightError as exc:
            layout.add(exc.code, tracker, f"the tracker: {exc.message}", exc.fix or "")
        except OSError as exc:
            layout.add("unreadable_file", tracker, f"cannot read the tracker ({exc.strerror})", "fix its permissions")
        if text is not None:
            parsed = naming.parse_tracker(text)
            if parsed is None:
                layout.add("bad_tracker", tracker,
                           f"the tracker holds {text.strip()[:40]!r}, not an iteration number or 'release'; "
                           "Megatron prints 'Invalid metadata file' and exits with status 0",
                           f"write the iteration to load into it (available: {_fmt_its(layout.available_iterations)})")
            layout.tracker_iteration = parsed
    elif layout.available_iterations:
        layout.add("no_tracker", tracker,
                   "there is no tracker file; Megatron will not load anything and silently starts from random weights",
                   f"write the iteration into {naming.TRACKER_FILENAME} (e.g. "
                   f"`echo {layout.available_iterations[-1]} > {tracker}`) or pass --ckpt-step")
    else:
        layout.looks_like = looks_like(path)
        return None
    wanted = iteration if iteration is not None else layout.tracker_iteration
    if wanted is None:
        wanted = layout.available_iterations[-1] if layout.available_iterations else None
    if wanted is None:
        layout.add("no_iterations", path, "the tracker exists but there is no iter_* or release dir",
                   "point --load at the complete checkpoint")
        return None
    if isinstance(wanted, str) and wanted != naming.RELEASE:
        try:
            wanted = int(wanted)
        except ValueError:
            layout.add("usage", path, f"--iteration {wanted!r} is neither a number nor 'release'", "pass a number")
            return None
    layout.iteration = wanted
    iter_dir = os.path.join(path, naming.iteration_dir_name(wanted))
    if not os.path.isdir(iter_dir):
        who = "the tracker points" if iteration is None else "you asked for"
        layout.add("missing_iteration", iter_dir,
                   f"{who} iteration {wanted}, but its dir does not exist (Megatron fails with a raw FileNotFoundError "
                   "or starts from scratch)",
                   f"pick an existing iteration ({_fmt_its(layout.available_iterations)}) with --ckpt-step / "
                   "--iteration, or fix the tracker")
        return None
    return iter_dir


def _fmt_its(its: list[int | str]) -> str:
    return ", ".join(str(i) for i in its) if its else "none"


def _arg(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default) if args is not None else default


def _sizes_from_args(layout: Layout) -> bool:
    """Sizes from the saved args (False when there are none, or they describe no valid layout)."""
    args = layout.saved_args
    if args is None:
        return False
    try:
        par = parallel.from_args(args)
    except PreflightError as e:
        layout.add("bad_args", layout.iter_dir or layout.path,
                   f"the saved args describe an impossible parallel layout ({e.message})",
                   "the checkpoint's args were damaged or edited: restore the iteration dir from a good copy")
        return False
    _set_parallel(layout, par)
    layout.distributed_optimizer = bool(_arg(args, "use_distributed_optimizer", False))
    layout.sizes_from = "args"
    return True


def _set_parallel(layout: Layout, par: parallel.ParallelLayout) -> None:
    layout.parallel = par
    layout.tp, layout.pp, layout.ep, layout.etp, layout.vpp, layout.cp = (
        par.tp, par.pp, par.ep, par.etp_eff, par.vpp, par.cp)


def read_shard(shard: Shard, trust: bool) -> tuple[Shard, Exception | None]:
    """Parse one shard's model file into ``shard.meta``; the error instead of raising."""
    path = os.path.join(shard.path, naming.MODEL_FILENAME)
    try:
        shard.meta = read_torch_file(path, trust=trust)
        if not isinstance(shard.meta, dict):
            raise PreflightError(f"expected a dict at top level, found {type(shard.meta).__name__}", path=path,
                                 code="corrupt_file")
        return shard, None
    except PreflightError as exc:
        return shard, exc


def _model_keys(meta: dict[str, Any] | None) -> list[str]:
    if not meta:
        return []
    keys: list[str] = []
    for k, v in meta.items():
        if (k == "model" or (k.startswith("model") and k[5:].isdigit())) and isinstance(v, dict):
            keys.extend(v.keys())
    return keys


def has_expert_keys(keys: list[str]) -> bool:
    return any(".mlp.experts." in k or ".mlp.router." in k for k in keys)


def _sample(shards: list[Shard], trust: bool) -> list[Shard]:
    """The shards a sampled verdict parses: the first (rank 0's: the args Megatron reads), the first of every
    pipeline stage (stages differ: embedding, head, their layers) and the last. The first is parsed here, to learn
    which names belong to which stage (a 2-D name's second index is PP or EP); all of them when it has no usable
    args."""
    first, err = read_shard(shards[0], trust)
    args = first.meta.get("args") if err is None and isinstance(first.meta, dict) else None
    try:
        par = parallel.from_args(args) if _is_namespace(args) else None
    except PreflightError:
        par = None
    if par is None:
        return shards
    by_name = {s.name: s for s in shards}
    picks = [shards[0]]
    for pp in range(par.pp):
        name = naming.shard_dir_name(0, pp, 0, pp_size=par.pp, ep_size=par.ep)
        if name in by_name and all(by_name[name] is not p for p in picks):
            picks.append(by_name[name])
    if all(shards[-1] is not p for p in picks):
        picks.append(shards[-1])
    return picks


# Threads that list, size and trailer-check thousands of shard dirs: 1 on a local disk (measured: more threads only
# add GIL hand-offs there); a parallel filesystem, whose metadata round trips take milliseconds, gains from 16
# (MEGATRON_PREFLIGHT_IO_THREADS=16).
IO_THREADS = max(1, int(os.environ.get("MEGATRON_PREFLIGHT_IO_THREADS", "1") or 1))


def _each(fn: Any, items: list[Any]) -> list[Any]:
    """``[fn(x) for x in items]``, in :data:`IO_THREADS` threads that each take a run of items (one future per item
    would cost more in hand-offs than a local filesystem's syscalls)."""
    if len(items) <= 64 or IO_THREADS == 1:
        return [fn(x) for x in items]
    from concurrent.futures import ThreadPoolExecutor  # deferred: most checkpoints have few files

    runs = [items[i:i + 256] for i in range(0, len(items), 256)]
    with ThreadPoolExecutor(max_workers=min(IO_THREADS, len(runs))) as pool:
        return [y for run in pool.map(lambda r: [fn(x) for x in r], runs) for y in run]


def _list_shard(iter_dir: str, name: str) -> tuple[Shard, PreflightError | None, int]:
    """A shard dir's entries and their sizes, whether its model file is a regular file, and the bytes of every file
    under it (a few syscalls)."""
    spath = os.path.join(iter_dir, name)
    shard = Shard(name=name, tp_rank=None, pp_rank=None, ep_rank=None, path=spath)
    try:
        entries = sorted(os.scandir(spath), key=lambda e: e.name)
    except OSError:
        entries = []
    total = 0
    for e in entries:
        try:
            shard.files[e.name] = e.stat().st_size
            total += _dir_bytes(e.path) if e.is_dir() else shard.files[e.name]
        except OSError:
            shard.files[e.name] = 0
    error = None
    if naming.MODEL_FILENAME in shard.files:
        try:
            require_regular_file(os.path.join(spath, naming.MODEL_FILENAME))
        except PreflightError as exc:
            error = exc
    return shard, error, total


def _inspect_legacy(layout: Layout, iter_dir: str, shard_names: list[str], trust: bool, mode: str,
                    reader: ShardReader) -> None:
    listed = _each(lambda n: _list_shard(iter_dir, n), shard_names)
    readable = []
    layout.total_bytes = sum(n for _, _, n in listed)
    for shard, exc, _ in listed:
        layout.shards.append(shard)
        if exc is not None:
            layout.add(exc.code, exc.path or shard.path, exc.message, exc.fix or "")
        elif naming.MODEL_FILENAME in shard.files:
            readable.append(shard)
    readable_ids = {id(s) for s in readable}  # identity: comparing Shard dataclasses field by field is quadratic
    for s in layout.shards:
        if id(s) not in readable_ids and naming.MODEL_FILENAME in s.files:
            continue
        if naming.MODEL_FILENAME not in s.files:
            layout.add("missing_file", os.path.join(s.path, naming.MODEL_FILENAME),
                       "the shard dir has no model_optim_rng.pt (an interrupted save?)",
                       "restore it from a complete copy, or load an earlier iteration with --ckpt-step")
        elif s.files[naming.MODEL_FILENAME] == 0:
            layout.add("empty_file", os.path.join(s.path, naming.MODEL_FILENAME),
                       "the file is empty (0 bytes); the save was interrupted",
                       "restore it from a complete copy, or load an earlier iteration with --ckpt-step")
    to_read = [s for s in readable if s.files[naming.MODEL_FILENAME] > 0]
    if to_read and (mode == "sample" or (mode == "auto" and len(to_read) > SAMPLE_ABOVE)):
        picked = _sample(to_read, trust)
        if len(picked) < len(to_read):
            layout.sampled = True
            picked_ids = {id(s) for s in picked}
            rest = [os.path.join(s.path, naming.MODEL_FILENAME) for s in to_read if id(s) not in picked_ids]
            for path, problem in zip(rest, _each(zip_trailer_problem, rest), strict=True):
                if problem:
                    layout.add("corrupt_file", path, problem,
                               "restore it from a complete copy, or load an earlier iteration with --ckpt-step")
            layout.notes.append(
                f"sampled: {len(picked)} of {len(to_read)} shard files parsed (rank 0's, the first of each pipeline "
                "stage, the last); every shard dir was listed and its files sized and their zip trailers checked. "
                "--all-shards parses every one (shapes and args agreeing across all shards)")
        to_read = picked
    results = reader(to_read, trust)
    good: list[Shard] = []
    for shard, err in results:
        if err is None:
            good.append(shard)
        else:
            code = getattr(err, "code", "corrupt_file")
            layout.add(code, getattr(err, "path", None) or shard.path, getattr(err, "message", str(err)),
                       getattr(err, "fix", "") or "")
    # Saved args: the lowest shard that has them (rank 0's file is what Megatron reads for args).
    ref = next((s for s in good if isinstance(s.meta, dict) and s.meta.get("args") is not None), None)
    if ref is not None and not _is_namespace(ref.meta["args"]):
        layout.add("bad_args", os.path.join(ref.path, naming.MODEL_FILENAME),
                   f"the saved args are a {type(ref.meta['args']).__name__}, not Megatron's argparse Namespace: "
                   "Megatron cannot read this checkpoint's args (it reads them as attributes)",
                   "the file was written by another tool or edited: restore it from a save of Megatron-LM")
        _sizes_from_names(layout, good, "the saved args are unreadable")
    elif ref is not None:
        layout.saved_args = ref.meta["args"]
        layout.checkpoint_version = ref.meta.get("checkpoint_version")
        if not _sizes_from_args(layout):
            _sizes_from_names(layout, good, "the saved args describe no valid layout")
        _check_args_agree(layout, ref, good)
    else:
        _sizes_from_names(layout, good)
    for s in good:
        it = s.meta.get("iteration", s.meta.get("total_iters")) if s.meta else None
        if isinstance(it, int) and isinstance(layout.iteration, int) and it != layout.iteration:
            layout.add("iteration_mismatch", os.path.join(s.path, naming.MODEL_FILENAME),
                       f"the file says iteration {it} but sits in the dir for iteration {layout.iteration}",
                       "this shard was copied from another iteration: restore the right one")
    for s in good:
        broken = completeness.unpaired(_model_keys(s.meta))
        if broken:
            layout.add("missing_tensor", os.path.join(s.path, naming.MODEL_FILENAME),
                       f"a tensor is missing from the file: {completeness.describe(broken)}; Megatron's load fails "
                       "on the missing key after building the model", "restore the file from a complete copy, or "
                       "load an earlier iteration with --ckpt-step")
    _check_shard_set(layout)
    _check_distrib_optim(layout)


def _is_namespace(args: Any) -> bool:
    """Megatron's args are an argparse Namespace (or an inert stand-in with attributes), never a mapping."""
    return hasattr(args, "__dict__") and not isinstance(args, (dict, list, tuple, str, bytes))


def _sizes_from_names(layout: Layout, good: list[Shard], why: str = "no saved args in the shard files") -> None:
    """No usable saved args: infer TP/PP/EP from dir names, and PP vs EP from the keys."""
    layout.sizes_from = "names+keys"
    layout.notes.append(f"{why}: sizes inferred from the dir names and the model keys")
    idx = [naming.parse_shard_dir_name(s.name) or () for s in layout.shards]
    lens = {len(i) for i in idx}
    n = max(lens) if lens else 1
    tp = max((i[0] for i in idx if i), default=0) + 1
    pp = ep = 1
    if n == 3:
        pp = max(i[1] for i in idx if len(i) == 3) + 1
        ep = max(i[2] for i in idx if len(i) == 3) + 1
    elif n == 2:
        second = max(i[1] for i in idx if len(i) == 2) + 1
        keys = [k for s in good for k in _model_keys(s.meta)]
        if has_expert_keys(keys):
            ep = second
        else:
            pp = second
    vpp = None
    if good:
        chunks = [k for k in good[0].meta if k.startswith("model") and k[5:].isdigit()]
        if len(chunks) > 1:
            vpp = len(chunks)
    _set_parallel(layout, parallel.ParallelLayout(tp=tp, pp=pp, ep=ep, vpp=vpp))


def _check_args_agree(layout: Layout, ref: Shard, good: list[Shard]) -> None:
    ref_args = ref.meta["args"]
    for s in good:
        if s is ref:
            continue
        args = s.meta.get("args")
        if args is None:
            continue
        diffs = [f"{f}={_arg(args, f)!r} (vs {_arg(ref_args, f)!r} in {ref.name})" for f in CONSISTENT_ARGS
                 if _arg(args, f) != _arg(ref_args, f)]
        if diffs:
            layout.add("args_disagree", os.path.join(s.path, naming.MODEL_FILENAME),
                       "this shard's saved args disagree with the others: " + ", ".join(diffs)
                       + "; shards from different runs were mixed",
                       "restore the iteration dir from one consistent save")


def _check_shard_set(layout: Layout) -> None:
    sizes = layout.parallel or parallel.ParallelLayout()
    layout.dims = naming.dims_class(pp_size=sizes.pp, ep_size=sizes.ep)
    layout.name_pattern = naming.name_pattern(pp_size=sizes.pp, ep_size=sizes.ep)
    expected = naming.expected_shards(sizes)
    present = {s.name for s in layout.shards}
    for s in layout.shards:
        coords = expected.get(s.name)
        if coords is None:
            idx = naming.parse_shard_dir_name(s.name) or ()
            coords = naming.assign_shard_indices(idx, pp_size=sizes.pp, ep_size=sizes.ep)
        if coords is not None:
            s.tp_rank, s.pp_rank, s.ep_rank = coords
    layout.missing_shards = [n for n in expected if n not in present]
    layout.stray_shards = [n for n in sorted(present) if n not in expected]
    for name in layout.missing_shards:
        hint = ""
        if (sizes.tp > sizes.ep * sizes.etp_eff) and sizes.ep * sizes.etp_eff >= 1 and layout.ep is not None:
            hint = (" (megatron-core <= 0.16 legacy saves silently skip TP ranks when TP > EP x ETP; "
                    "this checkpoint cannot be loaded at its own layout)")
        layout.add("missing_shard", os.path.join(layout.iter_dir or "", name),
                   f"shard dir {name} is missing: a {layout.dims} TP{sizes.tp}/PP{sizes.pp}/EP{sizes.ep}"
                   f"/ETP{sizes.etp_eff} save writes {len(expected)} dirs{hint}; Megatron would print "
                   "'could not load the checkpoint' and exit with status 0",
                   "restore the missing shard from a complete copy, or load an earlier iteration with --ckpt-step")
    for name in layout.stray_shards:
        layout.add("stray_shard", os.path.join(layout.iter_dir or "", name),
                   f"unexpected shard dir for a {layout.dims} TP{sizes.tp}/PP{sizes.pp}/EP{sizes.ep} checkpoint "
                   f"(expected names like {layout.name_pattern}); it belongs to another save",
                   "move it out of the iteration dir")


def _check_distrib_optim(layout: Layout) -> None:
    with_file = [s for s in layout.shards if naming.DISTRIB_OPTIM_FILENAME in s.files]
    if layout.distributed_optimizer is None:
        layout.distributed_optimizer = bool(with_file)
    if not layout.distributed_optimizer:
        return
    saved_optim = not bool(_arg(layout.saved_args, "no_save_optim", False))
    if not saved_optim:
        return
    for s in layout.shards:
        if s.name in layout.stray_shards:
            continue
        size = s.files.get(naming.DISTRIB_OPTIM_FILENAME)
        path = os.path.join(s.path, naming.DISTRIB_OPTIM_FILENAME)
        if size is None:
            layout.add("missing_file", path,
                       "the run used the distributed optimizer but this shard has no distrib_optim.pt",
                       "restore it, or start with --no-load-optim to drop the optimizer state")
        elif size == 0:
            layout.add("empty_file", path, "distrib_optim.pt is empty (0 bytes); the save was interrupted",
                       "restore it, or start with --no-load-optim to drop the optimizer state")

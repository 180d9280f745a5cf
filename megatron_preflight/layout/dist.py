"""Metadata of distributed checkpoint formats (torch_dist, zarr, torch_dcp / fsdp_dtensor), read safely.

torch_dist: ``metadata.json`` (``sharded_backend``), ``.metadata`` (PyTorch DCP metadata, a pickle of dataclasses),
``__<rank>_<n>.distcp`` data files, and the non-tensor state either in ``common.pt`` (megatron-core ≤ 0.16) or as the
bytes item ``common_state/shard_0_1`` inside a ``.distcp`` file (Megatron-LM main). Only metadata and that small item
are read.
"""

from __future__ import annotations

import json
import os
import types
import warnings
from collections.abc import Callable
from typing import Any

from megatron_preflight import dtypes
from megatron_preflight.errors import PreflightError, require_regular_file
from megatron_preflight.layout import completeness, dcp_cache, optimizer_entry
from megatron_preflight.layout.dcp_index import DcpFacts, bounded_facts
from megatron_preflight.layout.model import Format, Layout
from megatron_preflight.placeholders import Placeholder
from megatron_preflight.safe_pickle import safe_loads
from megatron_preflight.torch_file import TensorRef, TorchFile, read_torch_file
from megatron_preflight.tree import map_leaves

METADATA_JSON = "metadata.json"
DCP_METADATA = ".metadata"
COMMON_PT = "common.pt"


# keyed by the file's version, the trust mode and whether torch is loaded (its dtypes are torch's then, named before)
_METADATA_CACHE: dict[tuple[str, int, int, bool, bool], tuple[Any, DcpFacts]] = {}
_FACTS_CACHE: dict[tuple[str, int, int, bool], DcpFacts] = {}  # (the facts hold names only: torch or not)


def read_dcp_metadata(iter_dir: str, *, trust: bool = False) -> Any:
    """The DCP ``.metadata`` of a torch_dist iteration dir, unpickled once per file version (the resharder and its
    reader ask for it; treat the result as read-only). A verdict reads :func:`metadata_facts` instead."""
    return _read_cached(iter_dir, trust)[0]


def metadata_facts(iter_dir: str, *, trust: bool = False) -> DcpFacts:
    """What a verdict reads from the ``.metadata`` (:mod:`~megatron_preflight.layout.dcp_index`): gathered when it
    was read, or from its index once read (:mod:`~megatron_preflight.layout.dcp_cache`); treat as read-only. A
    trusted reader also takes a safe read's facts (trust changes only what the allow-list refuses, and that read
    refused nothing: the same objects); a safe reader never takes a trusted read's."""
    path = os.path.join(iter_dir, DCP_METADATA)
    require_regular_file(path)
    key = _version(path, trust)
    modes = (False, True) if trust else (False,)
    if key is not None:
        for mode in modes:
            facts = _FACTS_CACHE.get((*key[:3], mode))
            if facts is not None:
                return facts
        if key in _METADATA_CACHE:
            return _METADATA_CACHE[key][1]
    data = _read_bytes(path)
    for mode in modes:
        facts = dcp_cache.load(dcp_cache.key_of(data, mode))
        if facts is not None:
            break
    else:
        facts = _read_cached(iter_dir, trust, data)[1]
        dcp_cache.store(dcp_cache.key_of(data, trust), facts)
    if key is not None:
        _remember(_FACTS_CACHE, key[:4], facts)
    return facts


def _version(path: str, trust: bool) -> tuple[str, int, int, bool, bool] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return os.path.realpath(path), st.st_size, st.st_mtime_ns, trust, dtypes.torch_loaded()


def _remember(cache: dict, key: Any, value: Any) -> None:
    if len(cache) >= 8:
        cache.pop(next(iter(cache)))
    cache[key] = value


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def _read_cached(iter_dir: str, trust: bool, data: bytes | None = None) -> tuple[Any, DcpFacts]:
    path = os.path.join(iter_dir, DCP_METADATA)
    require_regular_file(path)
    key = _version(path, trust)
    if key is not None:
        for mode in (False, True) if trust else (False,):  # (a safe read serves a trusted reader: see metadata_facts)
            cached = _METADATA_CACHE.get((*key[:3], mode, key[4]))
            if cached is not None:
                return cached
    read = _read_dcp_metadata(path, trust, _read_bytes(path) if data is None else data)
    if key is not None:
        _remember(_METADATA_CACHE, key, read)
    return read


def _read_dcp_metadata(path: str, trust: bool, data: bytes) -> tuple[Any, DcpFacts]:
    gathered: list[DcpFacts] = []

    def bound(obj: Any, stream_bytes: int, source: str) -> None:  # the shape check, gathering the facts on the way
        gathered.append(bounded_facts(obj, stream_bytes, source))

    try:
        md = safe_loads(data, source=path, trust=trust, check=bound)
    except PreflightError:
        raise
    except Exception as exc:
        raise PreflightError(f"the DCP metadata is truncated or corrupt ({type(exc).__name__}: {exc})", path=path,
                             fix="restore the iteration dir from a complete copy", code="corrupt_file") from None
    if isinstance(md, Placeholder) and isinstance(md._state, dict):
        # megatron-core's own Metadata subclass (MCoreMetadata, written by Megatron-LM of 2025): its fields, read
        # as plain attributes (state_dict_metadata, storage_data, mcore_data, ...).
        md = types.SimpleNamespace(**md._state)
    if not hasattr(md, "state_dict_metadata"):
        raise PreflightError(f"the DCP metadata holds a {type(md).__name__}, not checkpoint metadata", path=path,
                             fix="this is not a torch_dist checkpoint Megatron wrote; check the --load dir",
                             code="corrupt_file")
    return md, gathered[0]


def object_index(md: Any) -> dict[str, Any]:
    """fqn -> storage info of every bytes item (a sharded object: extra state, param groups, common state)."""
    return {index.fqn: info for index, info in md.storage_data.items() if getattr(index, "offset", None) is None}


def read_object(iter_dir: str, fqn: str, info: Any, *, trust: bool = False, tensors: bool = False) -> Any:
    """A sharded object's value: its ``torch.save`` blob read in place (a window of its ``.distcp`` file, no temp
    copy) through the allow-list, unwrapped from the one-element list Megatron saves it in. Tensors inside stay
    references into the blob (metadata only), or, with ``tensors``, are read into torch tensors (a Transformer Engine
    module's ``_extra_state`` is one: a small uint8 tensor the resharder carries)."""
    path = os.path.join(iter_dir, info.relative_path)
    require_regular_file(path)
    return _load_object(TorchFile(path, trust=trust, window=(int(info.offset), int(info.length))), path, fqn, tensors)


def _load_object(f: TorchFile, path: str, fqn: str, tensors: bool) -> Any:
    with f:
        try:
            value = f.load_metadata()
            if tensors:
                value = map_leaves(value, lambda v, _p: f.tensor(v).clone() if isinstance(v, TensorRef) else v)
        except PreflightError as exc:
            exc.path = f"{path}[{fqn}]"
            raise
    return value[0] if isinstance(value, list) and len(value) == 1 else value


MAX_DISTINCT_OBJECTS = 4096  # blobs an ObjectReader keeps parsed
_MISSING = object()


class ObjectReader:
    """Many sharded objects of one iteration dir, as :func:`read_object` reads them: each data file opened once, each
    distinct blob parsed once (the extra states of a model's thousands of modules are mostly the same bytes; a
    DeepSeek-V3 checkpoint has ~30k). Tensors in a value are copied for each caller."""

    def __init__(self, iter_dir: str, *, trust: bool = False) -> None:
        self.iter_dir, self.trust = iter_dir, trust
        self._fds: dict[str, tuple[str, int]] = {}  # relative path -> (path, fd)
        self._parsed: dict[tuple[bytes, bool, Any], Any] = {}

    def read(self, fqn: str, info: Any, *, tensors: bool = False,
             describe: Callable[[Any], Any] | None = None) -> Any:
        """The value of the item ``fqn`` (stored at ``info``); ``describe``: applied to a parsed value once per
        distinct blob (its result shared: it must not be mutated)."""
        opened = self._fds.get(info.relative_path)
        if opened is None:
            path = os.path.join(self.iter_dir, info.relative_path)
            require_regular_file(path)
            opened = self._fds[info.relative_path] = (path, os.open(path, os.O_RDONLY))
        path, fd = opened
        start, length = int(info.offset), int(info.length)
        raw = os.pread(fd, length, start) if start >= 0 and length > 0 else b""
        if len(raw) != length or length <= 0:  # truncated or malformed: the plain reader says what is wrong
            value = read_object(self.iter_dir, fqn, info, trust=self.trust, tensors=tensors)
            return describe(value) if describe is not None else value
        key = (raw, tensors, describe)
        value = self._parsed.get(key, _MISSING)
        if value is _MISSING:
            with warnings.catch_warnings():  # (torch.frombuffer on read-only bytes: copied at once)
                warnings.simplefilter("ignore", UserWarning)
                value = _load_object(TorchFile(path, trust=self.trust, window=(0, length), mapping=raw),  # type: ignore[arg-type]
                                     path, fqn, tensors)
            if describe is not None:
                value = describe(value)
            if len(self._parsed) < MAX_DISTINCT_OBJECTS:  # (FP8 extra states differ: a bounded cache)
                self._parsed[key] = value
        return map_leaves(value, lambda v, _p: v.clone() if _is_tensor(v) else v) if tensors else value

    def close_files(self) -> None:
        """Close the data files (reopened when read again); what was parsed is kept."""
        for _path, fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def close(self) -> None:
        self.close_files()
        self._parsed.clear()


def _is_tensor(v: Any) -> bool:
    return type(v).__name__ == "Tensor" and hasattr(v, "clone")


def _common_from_metadata(iter_dir: str, facts: DcpFacts, trust: bool) -> Any:
    for fqn, info in facts.objects.items():
        if fqn.startswith("common_state"):
            return read_object(iter_dir, fqn, info, trust=trust)
    return None


# the non-tensor items of an fsdp_dtensor save (Megatron-FSDP's DCP): read as a common state like torch_dist's
FSDP_TOP_ITEMS = ("args", "iteration", "checkpoint_version", "num_floating_point_operations_so_far")
FSDP_SCHEDULER = "opt_param_scheduler."
FSDP_MODEL = "model."
FSDP_OPTIMIZER_STATE = "optimizer.state."
FSDP_WRAPPER = "module."  # Megatron-FSDP's wrappers, before a parameter's own name (model.module.<name>)


def is_fsdp_dir(iter_dir: str, md: Any) -> bool:
    """Whether a DCP iteration dir is a Megatron-FSDP save (model tensors under ``model.``, no metadata.json)."""
    if os.path.exists(os.path.join(iter_dir, METADATA_JSON)):
        return False
    # (torch_dist's state keys are optimizer.state.<field>.<name>: a dir being written has no metadata.json yet)
    return any(k.startswith((FSDP_MODEL, FSDP_OPTIMIZER_STATE + FSDP_WRAPPER)) for k in md.state_dict_metadata)


def strip_modules(name: str) -> str:
    """A Megatron-FSDP parameter name without its wrappers' ``module.`` prefixes."""
    while name.startswith(FSDP_WRAPPER):
        name = name[len(FSDP_WRAPPER):]
    return name


def _fsdp_common(iter_dir: str, facts: DcpFacts, trust: bool) -> dict[str, Any] | None:
    """The common state of an fsdp_dtensor save, from its top-level bytes items (``args``, ``iteration``, the
    scheduler's ``opt_param_scheduler.<field>`` items); None when it has no ``args`` item (not Megatron's)."""
    objects = facts.objects
    if "args" not in objects:
        return None
    reader = ObjectReader(iter_dir, trust=trust)
    try:
        common: dict[str, Any] = {}
        for fqn, info in objects.items():
            if fqn in FSDP_TOP_ITEMS:
                common[fqn] = reader.read(fqn, info)
            elif fqn.startswith(FSDP_SCHEDULER):
                common.setdefault("opt_param_scheduler", {})[fqn[len(FSDP_SCHEDULER):]] = reader.read(fqn, info)
    finally:
        reader.close()
    return common


def inspect_dist(layout: Layout, iter_dir: str, *, trust: bool = False) -> None:
    """Fill ``layout`` for a torch_dist / zarr / DCP iteration dir."""
    entries = set(os.listdir(iter_dir))
    cfg: dict[str, Any] = {}
    if METADATA_JSON in entries:
        path = os.path.join(iter_dir, METADATA_JSON)
        try:
            require_regular_file(path)
            with open(path) as fh:
                cfg = json.load(fh)
        except PreflightError as exc:
            layout.add(exc.code, path, exc.message, exc.fix or "")
            cfg = {}
        except (OSError, ValueError) as exc:
            layout.add("corrupt_file", path, f"metadata.json is not valid JSON ({exc})",
                       "restore it; for torch_dist it holds {\"sharded_backend\": \"torch_dist\", \"sharded_backend_version\": 1}")
            cfg = {}
    backend = cfg.get("sharded_backend")
    if backend == "zarr":
        layout.format = Format.ZARR
        layout.notes.append("zarr checkpoints were removed from megatron-core (0.15+); current Megatron cannot load "
                            "them: convert with an older Megatron (--ckpt-convert-format torch_dist)")
    elif backend == "torch_dist" or (METADATA_JSON in entries and DCP_METADATA in entries):
        layout.format = Format.TORCH_DIST
    elif DCP_METADATA in entries:
        layout.format = Format.TORCH_DCP
    elif backend:
        layout.format = Format.TORCH_DIST
        layout.add("unknown_backend", os.path.join(iter_dir, METADATA_JSON),
                   f"unknown sharded_backend {backend!r}", "use a Megatron version that wrote this checkpoint")
    common: Any = None
    facts: DcpFacts | None = None
    if layout.format in (Format.TORCH_DIST, Format.TORCH_DCP):
        if DCP_METADATA not in entries:
            layout.add("missing_file", os.path.join(iter_dir, DCP_METADATA),
                       "the DCP metadata file is missing, so the tensors cannot be located",
                       "restore the iteration dir from a complete copy")
        else:
            try:
                facts = metadata_facts(iter_dir, trust=trust)
            except PreflightError as exc:
                layout.add(exc.code, exc.path or iter_dir, exc.message, exc.fix or "")
    if facts is not None:
        _check_data_files(layout, iter_dir, facts)
        _check_chunks(layout, os.path.join(iter_dir, DCP_METADATA), facts)
        layout.dist_tensors.update(facts.tensors)
        if any(k.startswith("model.") for k in layout.dist_tensors) and layout.format == Format.TORCH_DCP:
            layout.format = Format.FSDP_DTENSOR
        broken = completeness.unpaired(layout.dist_tensors)
        if broken:
            layout.add("missing_tensor", os.path.join(iter_dir, DCP_METADATA),
                       f"a tensor is missing from the checkpoint: {completeness.describe(broken)}; Megatron's load "
                       "fails on the missing key after building the model (with --dist-ckpt-strictness log_all it "
                       "trains on with that tensor at its random initialisation)",
                       "restore the iteration dir from a complete copy, or load an earlier one with --ckpt-step")
    if COMMON_PT in entries:
        try:
            common = read_torch_file(os.path.join(iter_dir, COMMON_PT), trust=trust)
        except PreflightError as exc:
            layout.add(exc.code, exc.path or iter_dir, exc.message, exc.fix or "")
    elif facts is not None:
        try:
            common = _common_from_metadata(iter_dir, facts, trust)
            if common is None and layout.format in (Format.FSDP_DTENSOR, Format.TORCH_DCP):
                common = _fsdp_common(iter_dir, facts, trust)
        except PreflightError as exc:
            layout.add(exc.code, exc.path or iter_dir, exc.message, exc.fix or "")
    if isinstance(common, list) and common and isinstance(common[0], dict):
        common = common[0]
    if isinstance(common, dict):
        layout.common_state = common
        layout.saved_args = common.get("args")
        layout.checkpoint_version = common.get("checkpoint_version")
        content = common.get("content_metadata") or {}
        if isinstance(content, dict):
            layout.dist_optimizer_sharding = content.get("distrib_optim_sharding_type")
        if layout.dist_optimizer_sharding is None:  # saved before content_metadata (megatron-core <= ~0.13)
            kinds = optimizer_entry.sharding_kinds(common.get("optimizer"))
            layout.dist_optimizer_sharding = kinds.pop() if len(kinds) == 1 else None
        it = common.get("iteration")
        if isinstance(it, int) and isinstance(layout.iteration, int) and it != layout.iteration:
            layout.add("iteration_mismatch", iter_dir,
                       f"the checkpoint says iteration {it} but sits in the dir for iteration {layout.iteration}",
                       "check the tracker and dir names")
    elif layout.format == Format.TORCH_DIST and facts is not None and not layout.problems:
        # Megatron's load reads the common state (args, iteration, ...) from common.pt or the .distcp files
        layout.add("missing_file", os.path.join(iter_dir, COMMON_PT),
                   "the common state (args, iteration, RNG, ...) is missing: no common.pt and no common_state item "
                   "in the .distcp files; Megatron's load fails on it", "restore common.pt from a complete copy of "
                   "this iteration, or load an earlier one with --ckpt-step")
    elif layout.format == Format.ZARR and not layout.problems:
        layout.notes.append("no common state (args) found: parallel sizes unknown")
    if layout.format == Format.TORCH_DCP and isinstance(common, dict) and \
            getattr(common.get("args"), "ckpt_format", None) == "fsdp_dtensor":
        layout.format = Format.FSDP_DTENSOR  # (a Megatron-FSDP save without model weights: optimizer state only)
    if layout.format == Format.FSDP_DTENSOR:
        layout.dist_optimizer_sharding = "fsdp_dtensor" if any(
            k.startswith(FSDP_OPTIMIZER_STATE) for k in layout.dist_tensors) else None
    elif layout.format == Format.TORCH_DCP and isinstance(common, dict) and "args" in common:
        # a Megatron torch_dist save (its common state holds Megatron's args) whose metadata.json is gone
        layout.format = Format.TORCH_DIST
        layout.add("missing_file", os.path.join(iter_dir, METADATA_JSON),
                   "metadata.json is missing: Megatron does not recognize the dir as a distributed checkpoint "
                   "(it looks for legacy mp_rank_* files and finds none)",
                   'write it back: {"sharded_backend": "torch_dist", "sharded_backend_version": 1}')


def _check_data_files(layout: Layout, iter_dir: str, facts: DcpFacts) -> None:
    for rel, end in sorted(facts.file_ends.items()):
        path = os.path.join(iter_dir, rel)
        try:
            size = os.path.getsize(path)
        except OSError:
            layout.add("missing_shard", path, "a data file listed in .metadata is missing",
                       "restore it from a complete copy of this iteration, or load an earlier one with --ckpt-step")
            layout.missing_shards.append(rel)
            continue
        if size < end:
            layout.add("corrupt_file", path, f"the data file is truncated ({size} bytes, .metadata needs {end})",
                       "restore it from a complete copy, or load an earlier iteration with --ckpt-step")


def _check_chunks(layout: Layout, path: str, facts: DcpFacts) -> None:
    """Every tensor in ``.metadata`` is covered by its chunks, and every entry reads as torch writes it."""
    fix = "restore the iteration dir from a complete copy, or load an earlier one with --ckpt-step"
    for fqn, why in facts.chunk_problems:
        layout.add("corrupt_file", path, f"tensor {fqn}: {why}", fix)
    if facts.unreadable:
        more = f" and {len(facts.unreadable) - 3} more" if len(facts.unreadable) > 3 else ""
        layout.add("corrupt_file", path, f"entries of the storage index are not of the form torch writes: "
                   f"{', '.join(facts.unreadable[:3])}{more}", fix)

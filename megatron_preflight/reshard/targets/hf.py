"""``--ckpt-format hf``: any checkpoint the resharder reads written as a Hugging Face model — ``config.json`` (and
``generation_config.json``) from the saved args, the weights as sharded ``model-XXXXX-of-YYYYY.safetensors`` with
``model.safetensors.index.json`` (written last: the mark of a complete model, as the tracker is of a Megatron one),
the tokenizer's files beside them when the checkpoint names or holds them.

The HF tensors are the family table's row blocks (:mod:`megatron_preflight.layout.hf.families`) read backwards: each
is rows of the Megatron model's *global* tensors (the TP1 · PP1 · EP1 plan, at the family's layer spec and without
the vocab's padding rows), built a few rows at a time (:func:`~..execute.executor.build_rows`) and streamed to its
file: memory is a chunk of rows, never the model. Weights only: an HF model has no optimizer state.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import struct
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatron_preflight import dtypes
from megatron_preflight.errors import PreflightError
from megatron_preflight.layout import naming
from megatron_preflight.layout.hf import families
from megatron_preflight.layout.hf.files import present, tokenizer_code, tokenizer_module
from megatron_preflight.layout.hf.names import INDEX, TOKENIZER_FILES
from megatron_preflight.layout.hf.safetensors import NAMES
from megatron_preflight.layout.hf.stacked import Stacked, stored_of
from megatron_preflight.reshard.execute.executor import build_rows
from megatron_preflight.reshard.plan.rules import canonical_name
from megatron_preflight.reshard.resharder import Resharder, open_resharder
from megatron_preflight.reshard.sources.files import SourceFiles
from megatron_preflight.reshard.target import TargetLayout
from megatron_preflight.reshard.targets.durable import write_text
from megatron_preflight.reshard.targets.output_file import open_output
from megatron_preflight.reshard.targets.unit import ShardResult, Tapping

if TYPE_CHECKING:
    from megatron_preflight.reshard.plan.types import TensorPlan

log = logging.getLogger(__name__)

SHARD_BYTES = 4 * 2**30  # an output file's tensor bytes at most (a tensor larger than this has a file of its own)
CHUNK_BYTES = 64 * 2**20  # rows built and written at a time
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
TOKENIZER_EXTRA = ("special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "generation_config.json",
                   "tiktoken.model")  # (tiktoken's vocabulary: Kimi K2's tokenizer)


@dataclass
class HfTensor:
    """One HF tensor: its shape and the Megatron rows it is made of, ``(key, megatron row, rows, hf row)``; or a
    stacked one (``how``): each expert's per-expert tensors (``experts``: their names, in part order), joined as the
    family declares (:mod:`megatron_preflight.layout.hf.stacked`)."""

    name: str
    shape: tuple[int, ...]
    sources: list[tuple[str, int, int, int]] = field(default_factory=list)
    how: Stacked | None = None
    experts: list[list[str]] = field(default_factory=list)


@dataclass
class Export:
    """Everything an HF export writes, planned from metadata before any byte moves."""

    g: Resharder  # the global (TP1 PP1 EP1) resharder at the family's layer spec, the vocab unpadded
    plans: dict[str, TensorPlan]  # Megatron global key -> its plan
    family: families.Family
    config: dict[str, Any]
    dtype: str  # torch's name
    tensors: dict[str, HfTensor]
    files: dict[str, list[str]]  # output file -> the HF tensors it holds, in order
    adds: dict[str, float] = field(default_factory=dict)  # Megatron key -> the constant its import added (undone)
    parts: dict[str, HfTensor] = field(default_factory=dict)  # every per-expert tensor, stacked ones' included

    def nbytes(self, name: str) -> int:
        return math.prod(self.tensors[name].shape) * dtypes.dtype(self.dtype).itemsize


# id(resharder) -> (a weak reference to it, its export): the reference proves the id is still that resharder's (an id
# is reused once its object is collected: a later resharder of another checkpoint must not get this one's export)
_EXPORTS: dict[int, tuple[weakref.ref, Export]] = {}


def export_of(r: Resharder) -> Export:
    """The export of ``r``'s checkpoint (planned once per resharder)."""
    hit = _EXPORTS.get(id(r))
    if hit is not None and hit[0]() is r:
        return hit[1]
    for key in [k for k, (ref, _) in _EXPORTS.items() if ref() is None]:
        del _EXPORTS[key]
    export = _plan(r)
    _EXPORTS[id(r)] = (weakref.ref(r), export)
    return export


def _plan(r: Resharder) -> Export:
    args = r.layout.saved_args
    where = r.layout.iter_dir or r.layout.path
    if args is None:
        raise PreflightError("the checkpoint carries no saved args to describe its model as a Hugging Face one",
                             path=where, fix="export a checkpoint saved by Megatron-LM", code="format")
    family, arch = families.family_for_args(args, r.target.hf_architecture, where)
    cfg = families.config_from_args(family, args, where, arch)
    g = open_resharder(r.checkpoint, TargetLayout(tp=1, pp=1, ep=1, etp=1, padded_vocab_size=cfg.vocab_size,
                                             vocab_size=cfg.vocab_size, make_vocab_size_divisible_by=1,
                                             transformer_impl=family.transformer_impl,
                                             moe_grouped_gemm=False, distributed_optimizer=False),
                       keep_optimizer=False)
    plan = g.plan_for_coords({"tp": 0, "pp": 0, "ep": 0, "etp": 0}, naming.shard_dir_name(0, 0, 0, pp_size=1,
                                                                                            ep_size=1))
    plans = {canonical_name(tp.key): tp for tp in plan.tensors if tp.shape is not None}
    rows = {k: (tp.shape[0] if tp.shape else 1) for k, tp in plans.items()}
    tensors: dict[str, HfTensor] = {}
    mapped: set[str] = set()
    copies = families.mtp_copies(cfg, rows)
    adds: dict[str, float] = {}
    for m in families.mappings(family, cfg, {}, megatron_rows=rows) + copies:
        if not m.blocks:
            continue
        if m.add:
            adds[m.key] = m.add
        if m.key not in plans:
            raise PreflightError(f"{arch} has {m.blocks[0].hf}, which this checkpoint lacks ({m.key})", path=where,
                                 fix="check the saved args describe the model (or pass another --hf-architecture)",
                                 code="hf_unsupported")
        mapped.add(m.key)
        tp = plans[m.key]
        if sum(b.rows for b in m.blocks) != rows[m.key]:
            raise PreflightError(f"{m.key} has {rows[m.key]} rows; {arch} with the saved args' sizes makes it "
                                 f"{sum(b.rows for b in m.blocks)}", path=where, code="hf_unsupported",
                                 fix="check the saved args describe the model")
        for b in m.blocks:
            t = tensors.setdefault(b.hf, HfTensor(b.hf, ()))
            t.sources.append((m.key, b.dst0, b.rows, b.src0))
            t.shape = (max(t.shape[0] if t.shape else 0, b.src0 + b.rows), *tp.shape[1:]) if tp.shape else ()
    left = sorted(k for k, tp in plans.items() if k not in mapped and not k.endswith("_extra_state"))
    if left:
        raise PreflightError(f"{len(left)} tensor(s) of the checkpoint have no place in {arch}, first {left[0]} "
                             "(never dropped silently)", path=where, code="hf_unsupported",
                             fix="export with another --hf-architecture, or keep it as a Megatron checkpoint")
    for t in tensors.values():
        t.sources.sort(key=lambda s: s[3])
        at = 0
        for _key, _r0, n, hf0 in t.sources:
            if hf0 != at:
                raise PreflightError(f"{t.name}: rows {at}..{hf0} have no source", path=where, code="internal")
            at += n
    parts = tensors
    written = tuple(s for s in family.stacked if s.written)
    if written:
        tensors = _stack(tensors, written)
    dtype = DTYPES.get(r.target.dtype or "", None) or cfg.dtype or "float32"
    config = families.config_json(family, cfg)
    config["torch_dtype"] = dtype
    return Export(g, plans, family, config, dtype, tensors, _files(tensors, dtype), adds, parts)


def _stack(tensors: dict[str, HfTensor], declared: tuple[Stacked, ...]) -> dict[str, HfTensor]:
    """The per-expert tensors of stacked ones joined into them (in the place of the first), the others as they are
    (the per-expert ones stay in the export's ``parts``: each stacked tensor is built from them)."""
    out: dict[str, HfTensor] = {}
    for name, t in tensors.items():
        found = stored_of(declared, name)
        if found is None:
            out[name] = t
            continue
        how, layer, expert, _part = found
        stored = out.setdefault(layer + how.stored, HfTensor(layer + how.stored, (), how=how))
        while len(stored.experts) <= expert:
            stored.experts.append(how.part_names(layer, len(stored.experts)))
        part = tensors[name].shape
        rows = part[0] * len(how.parts)
        if len(part) == 1:
            stored.shape = (len(stored.experts), rows)
        else:
            stored.shape = (len(stored.experts), *((part[1], rows) if how.transposed else (rows, part[1])))
    return out


def _files(tensors: dict[str, HfTensor], dtype: str) -> dict[str, list[str]]:
    """HF tensors dealt to output files of at most :data:`SHARD_BYTES` in order (one file: ``model.safetensors``)."""
    item = dtypes.dtype(dtype).itemsize
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = math.prod(t.shape) * item
        if groups[-1] and size + n > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    if len(groups) == 1:
        return {"model.safetensors": groups[0]}
    return {f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors": g for i, g in enumerate(groups)}


def _header(e: Export, names: list[str]) -> bytes:
    head: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name in names:
        n = e.nbytes(name)
        head[name] = {"dtype": NAMES[e.dtype], "shape": list(e.tensors[name].shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned (as the safetensors package writes it)
    return struct.pack("<Q", len(raw)) + raw


def _chunks(e: Export, t: HfTensor) -> Any:
    """(plan, first row, rows) pieces of ``t`` in its row order, each at most :data:`CHUNK_BYTES`."""
    for key, r0, n, _hf0 in t.sources:
        tp = e.plans[key]
        row = max(1, math.prod(tp.shape[1:]) * dtypes.dtype(e.dtype).itemsize) if tp.shape else 1
        step = max(1, CHUNK_BYTES // row)
        for a in range(r0, r0 + n, step):
            yield tp, a, min(a + step, r0 + n)


def _tensor_bytes(e: Export, name: str, files: SourceFiles) -> Any:
    """The bytes of HF tensor ``name`` in order, a chunk at a time (a stacked tensor: an expert at a time)."""
    t = e.tensors[name]
    if t.how is None:
        for tp, a, b in _chunks(e, t):
            yield _rows_bytes(e, tp, a, b, files)
        return
    import torch  # deferred: torch only where tensors are made

    for names in t.experts:
        pieces = [_whole(e, e.parts[n], files) for n in names]
        joined = torch.stack(pieces, dim=1).flatten(0, 1) if t.how.interleaved else torch.cat(pieces)
        if t.how.transposed and joined.dim() == 2:
            joined = joined.t()
        yield joined.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _whole(e: Export, t: HfTensor, files: SourceFiles) -> Any:
    """HF tensor ``t`` (a per-expert one: small) built whole, in the export's dtype."""
    import torch  # deferred: torch only where tensors are made

    data = b"".join(_rows_bytes(e, tp, a, b, files) for tp, a, b in _chunks(e, t))
    return torch.frombuffer(bytearray(data), dtype=dtypes.to_torch(dtypes.dtype(e.dtype))).reshape(t.shape)


def _rows_bytes(e: Export, tp: TensorPlan, a: int, b: int, files: SourceFiles) -> bytes:
    import torch  # deferred: torch only where tensors are made

    # release: each source's mapped pages dropped once copied (the process holds a chunk, not the files it read)
    t = build_rows(tp, files, 0, 1, release=True) if not tp.shape else build_rows(tp, files, a, b, release=True)
    add = e.adds.get(canonical_name(tp.key))
    if add:  # (the value the import added, taken off in the tensor's own precision first)
        t = t - add
    t = t.to(dtypes.dtype(e.dtype)).contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


class HfTarget:
    """``--ckpt-format hf``: one unit per output safetensors file."""

    def units(self, r: Resharder) -> list[str]:
        return list(export_of(r).files)

    def weights(self, r: Resharder) -> dict[str, int]:
        e = export_of(r)
        return {f: sum(e.nbytes(n) for n in names) for f, names in e.files.items()}

    def least_bytes(self, r: Resharder) -> int | None:
        return sum(self.weights(r).values())

    def out_dir(self, tmp: str, iteration: Any) -> str:
        return tmp  # the files at the root, as the hub holds them

    def write(self, r: Resharder, unit: str, out: str, verify: bool, tapping: Tapping | None = None) -> ShardResult:
        if tapping is not None:
            raise PreflightError("--fingerprint stores Megatron fingerprints: an HF model has none", code="usage",
                                 fix="leave --fingerprint out (`megatron-preflight diff HF_DIR CKPT` proves the export)")
        e = export_of(r)
        files = SourceFiles(e.g.layout.iter_dir or "", trust=r.trust)
        path = os.path.join(out, unit)
        read = written = checked = 0
        try:
            with open_output(path) as fh:
                head = _header(e, e.files[unit])
                fh.write(head)
                written += len(head)
                for name in e.files[unit]:
                    for data in _tensor_bytes(e, name, files):
                        fh.write(data)
                        written += len(data)
                        read += len(data)
                fh.commit()
            files.finish()
            if verify:
                checked = _verify(e, unit, path, len(head), files)
        finally:
            files.close()
        return ShardResult(read, written, checked, 0)

    def seal(self, r: Resharder, out: str, iteration: Any) -> list[str]:
        """config.json, generation_config.json and the tokenizer's files, then the index (last). Returns notes."""
        e = export_of(r)
        write_text(os.path.join(out, "config.json"), json.dumps(e.config, indent=2) + "\n")
        write_text(os.path.join(out, "generation_config.json"), json.dumps({"_from_model_config": True}) + "\n")
        notes = [f"an HF model holds weights only: the optimizer state was not written ({e.config['architectures'][0]}, "
                 f"{e.dtype})"]
        notes += _tokenizer(r, out)
        total = sum(e.nbytes(n) for n in e.tensors)
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: f for f, names in e.files.items() for n in names}}
        write_text(os.path.join(out, INDEX), json.dumps(index, indent=2) + "\n")  # the index last
        return notes


def _verify(e: Export, unit: str, path: str, start: int, files: SourceFiles) -> int:
    """Read the file back and compare every tensor with its rows built again from the source: how many."""
    checked = 0
    with open(path, "rb") as fh:
        fh.seek(start)
        for name in e.files[unit]:
            for want in _tensor_bytes(e, name, files):
                if fh.read(len(want)) != want:
                    raise PreflightError(f"{name} differs from its source rows after writing", path=path,
                                         code="verify", fix="check the destination's storage and write again")
            checked += 1
    return checked


def _tokenizer(r: Resharder, out: str) -> list[str]:
    """Copy the tokenizer's files: those Megatron-LM saved in the iteration dir (``--save-tokenizer-assets``), else a
    Hugging Face tokenizer's the run named (``--tokenizer-model DIR``). Returns what was done, or what to add."""
    args = r.layout.saved_args
    found: list[str] = []
    for where in (os.path.join(r.layout.iter_dir or "", "tokenizer"), getattr(args, "tokenizer_model", None) or ""):
        if where and os.path.isdir(where):
            code = tokenizer_code(where)  # (the model's own tokenizer code: its module travels with it)
            module = tokenizer_module(code) if code else None
            # (each a regular file inside the dir: a link out of it is refused, never copied)
            for name in present(where, TOKENIZER_FILES + TOKENIZER_EXTRA + ((module,) if module else ())):
                src = os.path.join(where, name)
                if name != "generation_config.json" and not os.path.exists(os.path.join(out, name)):
                    shutil.copyfile(src, os.path.join(out, name))
                    found.append(name)
            if found:
                return [f"tokenizer: {', '.join(found)} copied from {where}"]
    kind = getattr(args, "tokenizer_type", None) or "unknown"
    return [f"tokenizer: none found (the run's --tokenizer-type {kind}); add the tokenizer's files (tokenizer.json, "
            "tokenizer_config.json, special_tokens_map.json) before loading the model with a tokenizer"]

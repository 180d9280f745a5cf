"""A Hugging Face model directory as a checkpoint: one :class:`~megatron_preflight.layout.model.Layout` of format
``hf``, read as the legacy shard of a TP1 · PP1 · EP1 Megatron checkpoint (``mp_rank_00``) whose saved args are the
Megatron model ``config.json`` describes and whose tensors are :class:`~.safetensors.SafeRef` row blocks of the
safetensors files (names and blocks from :mod:`.families`). Its iteration is ``release``: weights only, nothing to
resume (Megatron loads a release checkpoint at iteration 0 without optimizer or RNG state).

Every later stage (index, planner, executor, writers, the hook's loader) then reads it as any legacy checkpoint."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import operator
import os
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

from megatron_preflight import dtypes, parallel
from megatron_preflight.errors import PreflightError
from megatron_preflight.layout import naming
from megatron_preflight.layout.hf import families, files, quant, stacked
from megatron_preflight.layout.hf.config import architecture_of, load_raw
from megatron_preflight.layout.hf.names import TOKENIZER_FILES
from megatron_preflight.layout.hf.safetensors import Run, SafeRef, SafeTensor, safe_ref, tensor_table
from megatron_preflight.layout.model import Format, Layout, Shard

CHECKPOINT_VERSION = 3.0
_new = tuple.__new__  # (a QRun made without the named tuple's own __new__, a Python call: a DeepSeek-V3 makes 46k)
_DTYPE, _SHAPE = operator.attrgetter("dtype"), operator.attrgetter("shape")


def discover_hf(path: str) -> Layout:
    """The layout of the HF model dir ``path`` (metadata only: config.json and the safetensors headers)."""
    layout = Layout(path=path, root=path, iter_dir=path, format=Format.HF, iteration=naming.RELEASE,
                    tp=1, pp=1, ep=1, etp=1, cp=1, dims="1D", name_pattern="hf")
    raw, config_path = load_raw(path)
    arch = architecture_of(raw)
    layout.looks_like = f"a Hugging Face model ({arch})"
    wrapper = families.wrapper_for(arch)
    try:
        family = families.family_for(arch, config_path)
        cfg = families.read_config(family, wrapper.text_config(raw, config_path) if wrapper else raw, config_path)
        # (a multimodal model's quantization_config: at its top level, or in its language model's config alone)
        scheme = quant.read_scheme(raw if wrapper is None or "quantization_config" in raw else
                                   raw.get(wrapper.config_key) or {}, path, config_path)
    except PreflightError as e:
        layout.add(e.code or "hf_unsupported", e.path or config_path, e.message, e.fix or "")
        return layout
    table = tensor_table(path)
    # (a multimodal model's language model; or the text model itself as transformers 5 saves one it read from the
    # multimodal model's files: under the same prefix)
    stored_in = wrapper or next((w for w in family.wrappers if any(n.startswith(w.prefix) for n in table.tensors)),
                                None)
    found, others = _unwrap(stored_in, table.tensors, layout) if stored_in else (table.tensors, {})
    if cfg.dtype is None:  # (GPT-OSS's config.json on the hub names none)
        stored = stored_dtype(found)
        if stored is not None:
            cfg = dataclasses.replace(cfg, dtype=stored)
            layout.notes.append(f"config.json names no dtype (torch_dtype): the model's weights are stored in {stored}, "
                                f"so it is read as a {stored} model" + (" (--bf16)" if stored == "bfloat16" else
                                                                         " (--fp16)" if stored == "float16" else ""))
    layout.total_bytes = sum(table.files.values()) + os.path.getsize(config_path)
    for code, where, message, fix in table.problems:
        layout.add(code, where, message, fix)
    for reason in families.refusals(family, cfg):
        layout.add("hf_unsupported", config_path, f"{arch}: Megatron's GPT model cannot express {reason}",
                   "convert it with a tool that maps this model (e.g. Megatron-Bridge), or train it elsewhere")
    code = files.tokenizer_code(path)  # (the model's own tokenizer code: read once, for the args and the note)
    args = saved_args(family, cfg, path, code)
    depth = families.mtp_depth(cfg, found)
    if depth:
        args.mtp_num_layers = depth
    elif cfg.mtp_layers:
        layout.notes.append(f"config.json names {cfg.mtp_layers} multi-token prediction layer(s) whose weights are not "
                            "in these files (transformers drops them on save): the model loads without them")
    layout.saved_args = args
    if getattr(args, "trust_remote_code", False):
        layout.notes.append(f"the tokenizer is the model's own code (tokenizer_config.json's auto_map names {code}): "
                            "Megatron's HuggingFaceTokenizer loads it only with --trust-remote-code, which runs that "
                            "file from the model dir (flags prints it; read the file first)")
    layout.notes.append(f"Hugging Face {arch} ({family.name} family): read as a TP1 PP1 EP1 Megatron checkpoint, "
                        "weights only (iteration 0, no optimizer or RNG state)")
    if wrapper:
        layout.notes.append(_wrapper_note(wrapper, cfg, others))
    elif stored_in:
        layout.notes.append(f"its tensors are stored under {stored_in.prefix!r} (as transformers 5 saves a {arch} it "
                            f"read from {stored_in.architecture}'s files): read as {arch}'s own"
                            + (f"; {len(others)} tensors of a {stored_in.what} are not loaded" if others else ""))
    if cfg.sliding_window and cfg.max_position_embeddings and cfg.sliding_window < cfg.max_position_embeddings \
            and not getattr(args, "window_size", None):
        layout.notes.append(f"the model attends over a sliding window of {cfg.sliding_window} tokens: Megatron's "
                            "GPT model attends over the whole sequence (the same for sequences up to the window)")
    tensors, covers, errors = stacked.expand(found, family.stacked, quant.dequantized_dtype(cfg.dtype),
                                             isinstance(scheme, quant.Mxfp4), path)
    if isinstance(scheme, quant.ScaledFp8):
        tensors, more = quant.expand_packed(tensors, scheme, path)
        errors += more
    model, missing, needed, more = _model(family, cfg, tensors, path, scheme)
    errors += more
    if isinstance(scheme, quant.Mxfp4):
        mx = sum(1 for stored in covers.values() if stored[0].endswith(stacked.BLOCKS))
        layout.notes.append(f"{mx} stacked expert weights are {scheme.describe()}: dequantized to "
                            f"{quant.dequantized_dtype(cfg.dtype)} as they are read (each rank its own rows, with "
                            "their scales; nothing written in between); the other tensors are read as stored. An "
                            "export back writes them in the run's dtype (not re-quantized)" if mx else
                            "config.json names MXFP4 quantization but no weight is stored as MXFP4 blocks: the "
                            "weights are read as stored")
    elif scheme is not None:
        # (each FP8 weight's scale is needed: _model; counted at C speed, a DeepSeek-V3 needs 92k tensors)
        fp8 = sum(map(str.endswith, needed, itertools.repeat("weight" + scheme.suffix)))
        if fp8:
            layout.notes.append(f"{fp8} weights are {scheme.describe()}: dequantized to "
                                f"{quant.dequantized_dtype(cfg.dtype)} as they are read (each "
                                "rank its own rows, with the scales that cover them; nothing written in between); the "
                                "other tensors are read as stored. An export back writes them in the run's dtype (not "
                                "re-quantized)")
        else:
            layout.notes.append(f"config.json names {scheme.method} quantization but no weight is stored quantized (a "
                                "dequantized copy that kept its quantization_config): the weights are read as stored")
    for e in errors:
        layout.add(e.code or "hf_shape", e.path or path, e.message, e.fix or "")
    stored_as = stored_in.stored if stored_in else str
    for name in missing:
        layout.add("missing_tensor", path, f"the model has no tensor {stored_as(name)!r}, which {arch} with this "
                   "config.json has", "download the model again (or check that config.json belongs to these weights)")
    # (the tensors no mapping reads, found at C speed: a DeepSeek-V3 in FP8 has 92k tensors, all but a few needed)
    unread = tensors.keys() - needed
    unloaded = sorted(k for k in unread if k.startswith(family.unloaded)) if family.unloaded else []
    if unloaded:
        layout.notes.append(f"{len(unloaded)} tensor(s) under {', '.join(family.unloaded)} (the multi-token prediction "
                            f"weights of {arch}'s files) are not loaded: the model trains without them")
    calibration = sorted(k for k in unread if scheme.ignores(k)) if isinstance(scheme, quant.ScaledFp8) else []
    not_weights = set(calibration)
    if calibration:
        layout.notes.append(f"{len(calibration)} activation / KV-cache scale(s) of the {scheme.method} quantization "
                            f"(first {stored_as(calibration[0])!r}) calibrate inference, not the weights: not loaded "
                            "(a training run computes its activations in the run's dtype)")
    stray = sorted(k for k in unread if not families.ignored(k, cfg)
                   and not (family.unloaded and k.startswith(family.unloaded))
                   and k not in not_weights)
    if stray and not missing:
        layout.add("unmapped_tensor", path, f"{len(stray)} tensor(s) that {arch} with this config.json does not "
                   f"have, first {stored_as(stray[0])!r} (never dropped silently)",
                   "check that config.json belongs to these weights")
    shard = Shard("mp_rank_00", 0, None, None, files=dict(table.files), path=path,
                  meta={"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0, "model": model})
    layout.shards = [shard]
    layout.parallel = parallel.from_args(args)
    layout.distributed_optimizer = False
    return layout


def _unwrap(wrapper: families.Wrapper, tensors: dict[str, Any], layout: Layout) \
        -> tuple[dict[str, Any], dict[str, Any]]:
    """(the language model's tensors under the text model's names, the other parts' tensors) of a multimodal
    model's files (:class:`~.families.Wrapper`); a tensor stored under both names is a problem, never overwritten."""
    text: dict[str, Any] = {}
    others: dict[str, Any] = {}
    for name, t in tensors.items():
        if name.startswith(wrapper.others):
            others[name] = t
            continue
        own = wrapper.own(name)
        if own in text:
            layout.add("unmapped_tensor", layout.path, f"the files hold {name!r} and {own!r}: both are the "
                       f"language model's {own!r} ({wrapper.architecture} keeps its language model under "
                       f"{wrapper.prefix!r})", "remove the tensor that does not belong to this model")
            continue
        text[own] = t
    return text, others


def _wrapper_note(wrapper: families.Wrapper, cfg: Any, others: dict[str, Any]) -> str:
    rope = cfg.raw.get("rope_parameters") or cfg.raw.get("rope_scaling") or {}
    mrope = rope.get("mrope_section") if isinstance(rope, dict) else None
    size = sum(t.nbytes for t in others.values())
    return (f"{wrapper.architecture} is a multimodal model: its language model ({wrapper.text}, the tensors under "
            f"{wrapper.prefix!r} and the head) is what is read; its {wrapper.what} ({len(others)} tensors under "
            f"{', '.join(repr(p) for p in wrapper.others)}, {size / 2**20:,.1f} MiB) is no part of a Megatron GPT or "
            f"hybrid run and is not loaded"
            + (f"; its M-RoPE (mrope_section {mrope}) gives every section a text token's position, which is RoPE as "
               "Megatron applies it" if mrope else "")
            + f". An export writes the language model as {wrapper.text}"
            + (", which transformers also reads from this dir" if wrapper.text_reads else
               f" (transformers' own {wrapper.text} loads it; {wrapper.architecture}'s code keeps it under "
               f"{wrapper.prefix!r})"))


_FLOATS = ("bfloat16", "float16", "float32")


def stored_dtype(tensors: dict[str, Any]) -> str | None:
    """The floating dtype that holds most of the model's float bytes (quantization scales aside): the dtype a
    config.json without ``torch_dtype`` leaves to its files. None where no weight is stored as a float."""
    held: dict[str, int] = {}
    for name, t in tensors.items():
        if t.dtype in _FLOATS and not name.endswith((quant.SCALE_SUFFIX, quant.WEIGHT_SCALE)):
            held[t.dtype] = held.get(t.dtype, 0) + t.nbytes
    return max(held, key=lambda d: held[d]) if held else None


def saved_args(family: families.Family, cfg: Any, path: str, tokenizer_code: str | None = None) -> argparse.Namespace:
    """The args a Megatron run that saved this model at TP1 would have saved (``tokenizer_code``: the class of the
    model's own tokenizer code, which the run must trust)."""
    values = families.megatron_args(family, cfg)
    values.update(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
                  expert_tensor_parallel_size=1, context_parallel_size=1,
                  transformer_impl=family.transformer_impl,
                  moe_grouped_gemm=False, use_distributed_optimizer=False, ckpt_format="torch", iteration=0,
                  layernorm_epsilon=values["norm_epsilon"], consumed_train_samples=0,
                  params_dtype=dtypes.dtype(cfg.dtype if cfg.dtype in ("bfloat16", "float16") else "float32"),
                  hf_architecture=cfg.architecture)
    if files.present(path, TOKENIZER_FILES):
        values.update(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=path)
        if tokenizer_code:  # (Kimi K2's: transformers runs it only with trust_remote_code)
            values["trust_remote_code"] = True
    return argparse.Namespace(**values)


def _model(family: families.Family, cfg: Any, tensors: dict[str, Any], path: str,
           scheme: quant.ScaledFp8 | quant.Mxfp4 | None = None) \
        -> tuple[OrderedDict[str, Any], list[str], set[str], list[PreflightError]]:
    """(the Megatron state dict of SafeRefs, in Megatron's order; the HF tensors it needs that are missing; every
    HF tensor it reads; the tensors that do not fit their Megatron tensor). One pass over the mappings (a DeepSeek-V3
    in FP8: 31k Megatron tensors of 46k weights and their 46k scales)."""
    model: OrderedDict[str, Any] = OrderedDict()
    missing: dict[str, None] = {}
    taken: dict[str, int] = {}  # every HF tensor read -> the rows the mappings take of it
    errors: list[PreflightError] = []
    refs = _Refs(tensors, path, scheme, cfg)
    rows = _Rows(tensors)

    def one(m: families.Mapping) -> None:
        if not m.blocks:
            model[m.key] = None  # an extra state: no FP8 metadata
            return
        gone = False
        for b in m.blocks:
            taken[b.hf] = taken.get(b.hf, 0) + b.rows
            if b.hf not in tensors:
                missing[b.hf] = None
                gone = True
        if gone:
            return
        try:
            ref = refs.ref(m)
            model[m.key] = dataclasses.replace(ref, add=m.add) if m.add else ref
        except PreflightError as e:
            errors.append(e)

    for m in families.mappings(family, cfg, rows, grouped=True):
        if type(m) is families.Experts:
            built = refs.experts(m)
            if built is None:  # (not the regular case: expert by expert, naming what is wrong)
                for e in m.mappings(families.Rows(rows, None)):
                    one(e)
            else:
                model.update(built[0])
                taken.update(built[1])
            continue
        one(m)
    needed = set(taken)
    if isinstance(scheme, quant.ScaledFp8):  # the scales are the weights' too
        scaled = [n for n in taken if n in tensors and tensors[n].dtype in quant.QUANTIZED]
        needed.update([n + scheme.suffix for n in scaled])
        if scheme.packed:
            needed.update([n + quant.SHAPE for n in scaled])
    else:  # (a block-FP8 model's weights are read with their scales: _Refs)
        for name in sorted(n for n in taken if n in tensors and tensors[n].dtype.startswith("float8")):
            t = tensors[name]
            errors.append(PreflightError(
                f"tensor {name!r} is {t.dtype} and config.json names no FP8 quantization_config: without the "
                "scales its values are not the model's weights", path=os.path.join(path, t.file), code="hf_quantized",
                fix="use the model's config.json with its quantization_config (or a bf16 / fp32 copy of the model)"))
    for name, n in taken.items():
        t = tensors.get(name)
        if t is not None and n != (t.shape[0] if t.shape else 1):
            errors.append(PreflightError(f"tensor {name!r} has {t.shape[0] if t.shape else 1} rows "
                                         f"({list(t.shape)}); config.json's "
                                         f"sizes make it {n}", path=os.path.join(path, t.file), code="hf_shape",
                                         fix="check that config.json belongs to these weights"))
    return model, list(missing), needed, errors


class _Rows(Mapping[str, int]):
    """Each HF tensor's dim-0 size (a scalar's: 1), read from the table as the mappings ask for it."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        self.tensors = tensors

    def __getitem__(self, name: str) -> int:
        shape = self.tensors[name].shape
        return shape[0] if shape else 1

    def get(self, name: str, default: Any = None) -> Any:  # (the mixin's goes through a raised KeyError)
        t = self.tensors.get(name)
        return default if t is None else t.shape[0] if t.shape else 1

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


class _Refs:
    """Builds the SafeRef of each mapping from the tensor table; remembers the block-scale forms already checked
    (the experts of a layer share one)."""

    def __init__(self, tensors: dict[str, Any], path: str, scheme: quant.ScaledFp8 | quant.Mxfp4 | None,
                 cfg: Any) -> None:
        self.tensors, self.path, self.cfg = tensors, path, cfg
        self.fp8 = scheme if isinstance(scheme, quant.ScaledFp8) else None
        self.dtype = quant.dequantized_dtype(cfg.dtype if cfg is not None else None)
        # (weight shape, scale dtype, scale shape) -> (its block, scales per row of blocks)
        self.forms: dict[tuple | None, tuple[tuple[int, int], int]] = {}

    def ref(self, m: families.Mapping) -> SafeRef:
        tensors = self.tensors
        first = tensors[m.blocks[0].hf]
        if isinstance(first, stacked.Part):
            return _stacked(m, tensors, self.path)
        if self.fp8 is not None and first.dtype in quant.QUANTIZED:
            return self._dequantized(m, first)
        if len(m.blocks) == 1 and m.blocks[0].src0 == 0 and m.blocks[0].rows == (first.shape[0] if first.shape else 1):
            return safe_ref(m.key, first.dtype, first.shape,
                            (Run(first.file, first.start, first.end - first.start, 0),))  # a copy
        dtype, tail = first.dtype, first.shape[1:]
        runs = []
        at = rows = 0
        for hf, src0, n, _ in m.blocks:
            t = tensors[hf]
            shape = t.shape
            held = shape[0] if shape else 1
            if t.dtype != dtype or shape[1:] != tail or src0 + n > held:
                raise _misfit(m, hf, t, first, self.path)
            row = (t.end - t.start) // held
            runs.append(Run(t.file, t.start + src0 * row, n * row, at))
            at += n * row
            rows += n
        return safe_ref(m.key, dtype, (rows, *tail) if first.shape else (), tuple(runs))

    def experts(self, g: families.Experts) -> tuple[list[tuple[str, Any]], list[tuple[str, int]]] | None:
        """A MoE layer's routed experts built a layer at a time, in the regular case (a DeepSeek-V3 has 58 layers of
        256): every expert's three projections there, each projection of one form across the experts (stored
        tensors of one dtype and shape; a quantized one's scales of one form), no bias. Then (each expert tensor's
        (key, ref) in Megatron's order; each HF tensor read and its rows), the refs those of :meth:`ref`; else
        None, for :meth:`ref` to build them expert by expert and name what is wrong."""
        if g.bias or not g.count:
            return None
        tensors = self.tensors
        names = g.names()
        held = [list(map(tensors.get, col)) for col in names]
        if any(set(map(type, col)) != {SafeTensor} for col in held):  # (a missing one is None)
            return None
        forms = [set(zip(map(_DTYPE, col), map(_SHAPE, col), strict=True)) for col in held]
        if any(len(f) != 1 for f in forms):
            return None
        (dtype, shape), (up_dtype, up_shape), (down_dtype, down_shape) = (f.pop() for f in forms)
        if len(shape) != 2 or not shape[0] or (up_dtype, up_shape[1:]) != (dtype, shape[1:]) \
                or len(down_shape) != 2 or not down_shape[0] or down_dtype != dtype or not up_shape[0]:
            return None
        fc1, fc2 = g.keys("linear_fc1"), g.keys("linear_fc2")
        if dtype in quant.QUANTIZED:
            built = self._quantized_experts(names, held, fc1, fc2)
            if built is None:
                return None
            ones, twos = built
        else:
            gates, ups, downs = held
            ones = [safe_ref(k, dtype, (shape[0] + up_shape[0], shape[1]),
                             (Run(a.file, a.start, a.end - a.start, 0), Run(b.file, b.start, b.end - b.start,
                                                                            a.end - a.start)))
                    for k, a, b in zip(fc1, gates, ups, strict=True)]
            twos = [safe_ref(k, dtype, down_shape, (Run(d.file, d.start, d.end - d.start, 0),))
                    for k, d in zip(fc2, downs, strict=True)]
        extra1 = [(k, None) for k in g.extra_keys("linear_fc1")] if g.extras else []
        extra2 = [(k, None) for k in g.extra_keys("linear_fc2")] if g.extras else []
        if g.grouped_linears:  # (every expert's fc1, its extra state, then fc2)
            model = [*zip(fc1, ones, strict=True), *extra1, *zip(fc2, twos, strict=True), *extra2]
        else:  # (expert by expert)
            model = []
            for j, (k1, r1, k2, r2) in enumerate(zip(fc1, ones, fc2, twos, strict=True)):
                model += [(k1, r1), *extra1[j:j + 1], (k2, r2), *extra2[j:j + 1]]
        taken = [(name, rows) for col, rows in zip(names, (shape[0], up_shape[0], down_shape[0]), strict=True)
                 for name in col]
        return model, taken

    def _quantized_experts(self, names: tuple[list[str], ...], held: list[list[Any]], fc1: list[str],
                           fc2: list[str]) -> tuple[list[SafeRef], list[SafeRef]] | None:
        """:meth:`experts`' refs of quantized projections (FP8: each with its scales, one form a projection); None
        where the scheme is not one that reads them this way."""
        scheme = self.fp8
        if scheme is None or scheme.packed:
            return None
        suffix = scheme.suffix
        runs = []
        dst = (0, held[0][0].shape[0], 0)  # (up's rows follow gate's in fc1)
        for col, ts, at in zip(names, held, dst, strict=True):
            scale_names = [name + suffix for name in col]
            scales = list(map(self.tensors.get, scale_names))
            if set(map(type, scales)) != {SafeTensor}:
                return None
            forms = set(zip(map(_DTYPE, scales), map(_SHAPE, scales), strict=True))
            if len(forms) != 1:
                return None
            (scale_dtype, scale_shape) = forms.pop()
            shape, values = ts[0].shape, ts[0].dtype
            form = self.forms.get((shape, scale_dtype, scale_shape))
            if form is None:
                block = quant.scale_block(col[0], shape, scales[0], scheme, self.path)
                if isinstance(block, PreflightError):
                    return None
                form = self.forms[(shape, scale_dtype, scale_shape)] = (block, -(-shape[1] // block[1]))
            runs.append([_new(quant.QRun, (name, t.file, t.start, shape[1], 0, shape[0], at, s.file, s.start,
                                           scale_dtype, form[1], form[0], scale_name, values, ()))
                         for name, t, s, scale_name in zip(col, ts, scales, scale_names, strict=True)])
        gates, ups, downs = runs
        rows, cols = held[0][0].shape
        up_rows = held[1][0].shape[0]
        ones = [safe_ref(k, self.dtype, (rows + up_rows, cols), (), (a, b))
                for k, a, b in zip(fc1, gates, ups, strict=True)]
        twos = [safe_ref(k, self.dtype, held[2][0].shape, (), (d,)) for k, d in zip(fc2, downs, strict=True)]
        return ones, twos

    def _dequantized(self, m: families.Mapping, first: Any) -> SafeRef:
        """The Megatron tensor ``m`` from the rows of FP8 weights, each with its block scales, in the model's
        dtype."""
        scheme = self.fp8
        assert scheme is not None
        tensors, forms, suffix, kind = self.tensors, self.forms, scheme.suffix, first.dtype
        tail = first.shape[1:]
        runs = []
        at = 0
        for hf, src0, rows, _ in m.blocks:
            t = tensors[hf]
            shape = t.shape
            if t.dtype != kind or shape[1:] != tail or src0 + rows > shape[0]:
                raise _misfit(m, hf, t, first, self.path)
            scale_name = hf + suffix
            scale = tensors.get(scale_name)
            # (the experts of a layer share one form: its block, checked once, and the scales per row of blocks)
            form = forms.get((shape, scale.dtype, scale.shape) if scale is not None else None)
            if form is None:
                block = quant.scale_block(hf, shape, scale, scheme, self.path)
                if isinstance(block, PreflightError):
                    raise block
                form = forms[(shape, scale.dtype, scale.shape)] = (block, -(-shape[1] // block[1]))
            check = ()
            if kind != quant.FP8:  # (pack-quantized: its stored [R, C], checked when the rows are read)
                stored = tensors[hf + quant.SHAPE]
                check = (stored.file, stored.start, stored.dtype, shape)
            runs.append(_new(quant.QRun, (hf, t.file, t.start, shape[1], src0, rows, at, scale.file, scale.start,
                                          scale.dtype, form[1], form[0], scale_name, kind, check)))
            at += rows
        return safe_ref(m.key, self.dtype, (at, *tail), (), tuple(runs))


def _stacked(m: families.Mapping, tensors: dict[str, Any], path: str) -> SafeRef:
    """The Megatron tensor ``m`` from rows of per-expert tensors of stacked ones (:mod:`.stacked`)."""
    first = tensors[m.blocks[0].hf]
    runs = []
    at = 0
    for b in m.blocks:
        t = tensors[b.hf]
        if not isinstance(t, stacked.Part) or t.shape[1:] != first.shape[1:] or b.src0 + b.rows > t.shape[0]:
            raise _misfit(m, b.hf, t, first, path)
        runs.append(stacked.run(t, b.src0, b.rows, at))
        at += b.rows
    return safe_ref(m.key, first.dtype, (at, *first.shape[1:]), (), tuple(runs))


def _misfit(m: families.Mapping, name: str, t: Any, first: Any, path: str) -> PreflightError:
    """HF tensor ``name`` (``t``) cannot be rows of Megatron tensor ``m`` beside its first block's tensor."""
    return PreflightError(f"tensor {name!r} ({t.dtype}, {list(t.shape)}) does not fit {m.key} beside "
                          f"{m.blocks[0].hf!r} ({first.dtype}, {list(first.shape)})", path=os.path.join(path, t.file),
                          code="hf_shape", fix="check that config.json belongs to these weights")

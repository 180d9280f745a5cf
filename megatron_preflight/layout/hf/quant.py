"""Quantized weights as the hub publishes them, read as the model's float weights.

FP8 e4m3 weights with scales: each quantized linear weight ``X.weight`` is ``float8_e4m3fn`` of shape ``[R, C]``
beside a scale tensor whose every element multiplies one block of it: ``value[i, j] = float(X.weight[i, j]) *
scale[i // bR, j // bC]``, cast to the model's dtype (what the quantization leaves alone — norms, the router,
embeddings, the output layer — is stored in that dtype and read as is). Three publishers' forms:

- ``quant_method: fp8`` (DeepSeek-V3 / V3.1 / R1, Kimi K2, the Qwen3 ``-FP8`` models): ``X.weight_scale_inv``,
  float32 ``[ceil(R / bR), ceil(C / bC)]`` for ``weight_block_size: [bR, bC]``, the edge blocks partial (DeepSeek's
  ``weight_dequant``: the name says inverse, the value multiplies).
- ``quant_method: compressed-tensors``, ``format: float-quantized`` (llm-compressor's FP8: GLM-4.5 / 4.6 ``-FP8``, the
  ``FP8-Dynamic`` / ``FP8_BLOCK`` releases): ``X.weight_scale`` per the weights' ``strategy`` of each config group —
  ``tensor`` (one scale), ``channel`` (``[R, 1]``: one per output row), ``group`` (``[R, ceil(C / group_size)]``),
  ``block`` (``block_structure: [bR, bC]``). Activation and KV-cache scales (``input_scale``, ``k_scale``, ...) only
  calibrate inference: not weights, not loaded.
- ``quant_method: modelopt``, ``quant_algo: FP8`` (NVIDIA ModelOpt; per tensor) or ``FP8_PER_CHANNEL_PER_TOKEN``:
  ``X.weight_scale``, as compressed-tensors' ``tensor`` / ``channel``.

Integers the same way: compressed-tensors ``pack-quantized`` (Kimi K2 Thinking / K2.5's INT4 experts, the ``W4A16`` /
``W8A16`` releases): ``X.weight_packed``, int32 ``[R, ceil(C * bits / 32)]`` holding ``32 / bits`` symmetric values a
word, the first in the lowest bits, each stored plus ``2^(bits - 1)`` (as little-endian bytes: INT4 two values a byte,
the low nibble first; INT8 one), beside ``X.weight_scale`` and ``X.weight_shape`` (``[R, C]``, int); the value is
``(stored - 2^(bits - 1)) * scale``. Each such weight is read as a virtual ``X.weight`` of ``[R, 32 / bits *
packed columns]`` (:func:`expand_packed`); its stored ``weight_shape`` is checked when its rows are read.

Each weight's block is read from its scale's shape among the forms its config allows (one scale element per block).

MXFP4 (``quant_method: mxfp4``; GPT-OSS): its experts' stacked weights as e2m1 blocks with e8m0 scales
(:mod:`.stacked`), everything else stored in the model's dtype.

A rank dequantizes only the rows it holds, reading only the scale rows that cover them
(:class:`~megatron_preflight.reshard.sources.hf.HfReader`). Any other ``quantization_config`` is refused, naming it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

from megatron_preflight.errors import PreflightError
from megatron_preflight.layout.hf import files
from megatron_preflight.layout.hf.safetensors import SafeTensor

SCALE_SUFFIX = "_scale_inv"  # quant_method fp8's (DeepSeek's) weight scale: X.weight_scale_inv
WEIGHT_SCALE = "_scale"  # compressed-tensors' and ModelOpt's: X.weight_scale
FP8 = "float8_e4m3fn"
INT4, INT8 = "int4 (packed)", "int8 (packed)"  # the values of a pack-quantized weight (a virtual table entry's dtype)
QUANTIZED = (FP8, INT4, INT8)  # the dtypes of the table's entries that are read with their scales
BITS = {FP8: 8, INT8: 8, INT4: 4}
PACKED, SHAPE = "_packed", "_shape"  # X.weight_packed, X.weight_shape beside X.weight_scale
SCALE_DTYPES = ("float32", "bfloat16", "float16")
# scales of activations and of the KV cache (compressed-tensors, ModelOpt): they calibrate inference, a training run
# has none of them
ACTIVATION_SCALES = (".input_scale", ".output_scale", ".k_scale", ".v_scale", ".q_scale", ".input_zero_point",
                     ".output_zero_point")


@dataclass(frozen=True)
class Form:
    """A scale layout: one scale per ``rows`` x ``cols`` elements of a weight (None: the whole dim)."""

    rows: int | None
    cols: int | None
    name: str  # as its config names it ("128x128 block", "per-channel", ...)

    def block(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """(rows, columns) of ``shape`` one scale covers, each at most the dim (one block: the whole weight)."""
        return min(self.rows or shape[0], shape[0]) or 1, min(self.cols or shape[1], shape[1]) or 1

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        br, bc = self.block(shape)
        return math.ceil(shape[0] / br), math.ceil(shape[1] / bc)


TENSOR = Form(None, None, "per-tensor")
CHANNEL = Form(1, None, "per-channel")


@dataclass(frozen=True)
class ScaledFp8:
    """Quantized weights, each beside its scale ``name + suffix`` laid out in one of ``forms``: FP8 e4m3, or
    pack-quantized integers (``packed``)."""

    forms: tuple[Form, ...]
    suffix: str = SCALE_SUFFIX
    method: str = "fp8"  # quantization_config's quant_method (and format), for messages
    calibration: tuple[str, ...] = ()  # name endings of the scheme's activation / KV-cache scales
    packed: str | None = None  # INT4 / INT8: the weights are pack-quantized integers (compressed-tensors)

    def describe(self) -> str:
        forms = " or ".join(f.name for f in self.forms)
        return f"{self.packed or FP8} with {forms} scales (weight{self.suffix}" \
            + ("" if self.method == "fp8" else f"; {self.method}") + ")"

    def ignores(self, name: str) -> bool:
        """Whether ``name`` is an activation / KV-cache scale of this scheme (not a weight: not loaded)."""
        return bool(self.calibration) and name.endswith(self.calibration)


@dataclass(frozen=True)
class Mxfp4:
    """MXFP4 experts: two e2m1 values a byte, one e8m0 exponent per 32 values (:mod:`.stacked` reads them)."""

    @staticmethod
    def describe() -> str:
        return "MXFP4 (e2m1 values in *_blocks, an e8m0 exponent per 32 in *_scales)"


_FIX = ("use a bf16 / fp32 copy of the model (e.g. the publisher's unquantized one); megatron-preflight "
        "dequantizes FP8 e4m3 and symmetric INT4 / INT8 weights with tensor, channel, group or block scales and MXFP4 "
        "experts as it reads them")


MODELOPT_CONFIG = "hf_quant_config.json"  # ModelOpt's own record of the quantization, beside config.json


def read_scheme(raw: dict[str, Any], model_dir: str, path: str) -> ScaledFp8 | Mxfp4 | None:
    """:func:`scheme_of` ``config.json`` (``raw``, at ``path``); where it names no quantization, ModelOpt's
    ``hf_quant_config.json`` beside it (a regular file inside the dir), as ModelOpt exports write it."""
    if raw.get("quantization_config") is None and files.present(model_dir, (MODELOPT_CONFIG,)):
        where = os.path.join(model_dir, MODELOPT_CONFIG)
        own = files.load_json(files.member(model_dir, MODELOPT_CONFIG, model_dir), f"download {MODELOPT_CONFIG} again")
        if not isinstance(own, dict):
            raise _refused(f"{MODELOPT_CONFIG} is {own!r:.80}: not an object", where)
        return _modelopt(own, where)
    return scheme_of(raw, path)


def scheme_of(raw: dict[str, Any], path: str) -> ScaledFp8 | Mxfp4 | None:
    """The quantization ``config.json`` names (None: none); a scheme megatron-preflight does not read is an error
    naming the field and its value."""
    quant = raw.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise _refused(f"config.json's quantization_config is {quant!r:.80}: not an object", path)
    method = quant.get("quant_method")
    if method == "mxfp4":
        return Mxfp4()
    if method == "compressed-tensors":
        return _compressed_tensors(quant, path)
    if method == "modelopt":
        return _modelopt(quant, path)
    if method != "fp8":
        raise _refused(f"config.json's quantization_config holds quant_method {method!r}, which megatron-preflight "
                       "does not dequantize (it reads FP8 e4m3 — quant_method fp8, compressed-tensors "
                       "float-quantized, modelopt FP8 — and MXFP4)", path)
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refused(f"config.json's quantization_config.fmt is {fmt!r}: FP8 e4m3 is read", path)
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(_positive(b) for b in block)):
        raise _refused(f"config.json's quantization_config.weight_block_size is {block!r:.80}: two positive integers "
                       "are needed (per-tensor or per-channel FP8 scales are not read under quant_method fp8)", path)
    return ScaledFp8((Form(block[0], block[1], f"{block[0]}x{block[1]} block"),))


def _compressed_tensors(quant: dict[str, Any], path: str) -> ScaledFp8:
    """llm-compressor's ``compressed-tensors`` config: every config group float-quantized FP8 weights (symmetric, 8
    bits), each group's strategy one scale form; sparsity or transforms (whose stored weights are not the model's
    values times a scale) refused."""
    where = "config.json's quantization_config"
    for key in ("sparsity_config", "transform_config"):
        extra = quant.get(key)
        if extra and not (key == "sparsity_config" and isinstance(extra, dict)
                          and extra.get("format") in (None, "dense")):
            raise _refused(f"{where}.{key} is {extra!r:.120}: weights stored compressed by sparsity or rotated by "
                           "transforms are not read", path)
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refused(f"{where} (compressed-tensors) has no config_groups: which weights are quantized, and how, is "
                       "not known", path)
    forms: list[Form] = []
    values: set[str] = set()
    for gname, group in groups.items():
        at = f"{where}.config_groups.{gname}"
        if not isinstance(group, dict):
            raise _refused(f"{at} is {group!r:.80}: not an object", path)
        fmt = group.get("format") or quant.get("format")
        if fmt not in ("float-quantized", "pack-quantized"):
            raise _refused(f"{at} is stored in format {fmt!r}: compressed-tensors' float-quantized (FP8 e4m3) and "
                           "pack-quantized (INT4 / INT8) are read", path)
        w = group.get("weights")
        if not isinstance(w, dict):
            raise _refused(f"{at}.weights is {w!r:.80}: the weights' quantization is not named", path)
        kind = {("float-quantized", "float", 8): FP8, ("pack-quantized", "int", 4): INT4,
                ("pack-quantized", "int", 8): INT8}.get((fmt, w.get("type", "float"), w.get("num_bits")))
        if kind is None or w.get("symmetric", True) is not True or w.get("dynamic", False) not in (False, None):
            raise _refused(f"{at}.weights is {_brief(w)} ({fmt}): symmetric 8-bit float weights (float-quantized) "
                           "or symmetric 4- / 8-bit integers (pack-quantized) are read", path)
        values.add(kind)
        strategy = w.get("strategy")
        if strategy == "tensor":
            forms.append(TENSOR)
        elif strategy == "channel":
            forms.append(CHANNEL)
        elif strategy == "group" and _positive(w.get("group_size")):
            forms.append(Form(1, w["group_size"], f"per-group ({w['group_size']})"))
        elif strategy == "block" and isinstance(w.get("block_structure"), list) \
                and len(w["block_structure"]) == 2 and all(_positive(b) for b in w["block_structure"]):
            br, bc = w["block_structure"]
            forms.append(Form(br, bc, f"{br}x{bc} block"))
        else:
            raise _refused(f"{at}.weights has strategy {strategy!r} ({_brief(w)}): tensor, channel, group (with "
                           "group_size) or block (with block_structure) is read", path)
    if len(values) > 1:
        raise _refused(f"{where}'s config groups store weights as {' and '.join(sorted(values))}: one model in two "
                       "value forms is not read", path)
    kind = values.pop()
    fmt = "float-quantized" if kind == FP8 else "pack-quantized"
    return ScaledFp8(tuple(dict.fromkeys(forms)), WEIGHT_SCALE, f"compressed-tensors {fmt}", ACTIVATION_SCALES,
                     None if kind == FP8 else kind)


_MODELOPT = {"FP8": TENSOR, "FP8_PER_CHANNEL_PER_TOKEN": CHANNEL}


def _modelopt(quant: dict[str, Any], path: str) -> ScaledFp8:
    """NVIDIA ModelOpt's config (``quant_algo`` at the top, or under ``quantization`` as in hf_quant_config.json)."""
    algo = quant.get("quant_algo", (quant.get("quantization") or {}).get("quant_algo")
                     if isinstance(quant.get("quantization"), dict) else None)
    form = _MODELOPT.get(algo) if isinstance(algo, str) else None
    if form is None:
        where = os.path.basename(path) if path.endswith(MODELOPT_CONFIG) else "config.json's quantization_config"
        raise _refused(f"{where} (modelopt) holds quant_algo {algo!r}, which megatron-preflight does not dequantize "
                       f"(it reads {' and '.join(_MODELOPT)})", path)
    return ScaledFp8((form,), WEIGHT_SCALE, f"modelopt {algo}", ACTIVATION_SCALES)


def _positive(b: Any) -> bool:
    return type(b) is int and 0 < b <= 2**16


def _brief(d: dict[str, Any]) -> str:
    keys = ("type", "num_bits", "symmetric", "dynamic", "strategy", "group_size", "block_structure")
    return "{" + ", ".join(f"{k}: {d[k]!r}" for k in keys if k in d) + "}"


def _refused(message: str, path: str) -> PreflightError:
    return PreflightError(message, path=path, fix=_FIX, code="hf_quantized")


def dequantized_dtype(model_dtype: str | None) -> str:
    """The dtype FP8 weights are dequantized to: the model's (config.json's ``torch_dtype``), bf16 where it names none
    the weights can take (the hub's FP8 models are trained in bf16)."""
    return model_dtype if model_dtype in ("bfloat16", "float16", "float32") else "bfloat16"


class QRun(NamedTuple):
    """Rows ``src_row0 ..`` (``rows`` of them) of a quantized tensor (FP8, or packed integers), dequantized into rows
    ``dst_row0 ..`` of the tensor a :class:`~megatron_preflight.layout.hf.safetensors.SafeRef` describes."""

    name: str  # the quantized tensor, for messages
    file: str
    start: int  # absolute byte offset of the quantized tensor's first byte
    cols: int
    src_row0: int
    rows: int
    dst_row0: int
    scale_file: str
    scale_start: int
    scale_dtype: str
    scale_cols: int  # scales per row of blocks (the stored scale's elements: rows of blocks x this)
    block: tuple[int, int]  # (rows, columns) of the weight one scale covers
    scale_name: str  # the scale tensor, for messages
    values: str = FP8  # how the values are stored: FP8, INT4 or INT8 (packed)
    # a pack-quantized weight's stored X.weight_shape, checked when it is read: (file, start, dtype, its [R, C])
    shape_check: tuple[Any, ...] = ()

    @property
    def row_bytes(self) -> int:
        return self.cols * BITS[self.values] // 8


def scale_block(name: str, shape: tuple[int, ...], scale: Any, scheme: ScaledFp8, model_dir: str) \
        -> tuple[int, int] | PreflightError:
    """The block of the quantized weight ``name`` of ``shape`` that one element of its scale ``scale`` (a SafeTensor, or
    None) covers: the form of ``scheme`` whose scale shape the stored one is (a trailing dim of 1 may be left out, as a
    per-tensor scale of shape ``[]`` or ``[1]``); or why none is."""
    scale_name = name + scheme.suffix
    fix = "download the model again (the weights and their scales come from the same files)"
    kind = scheme.packed or FP8
    if len(shape) != 2:
        return PreflightError(f"tensor {name!r} is {kind} of shape {list(shape)}: scales are read for matrices only",
                              path=model_dir, fix=fix, code="hf_quantized")
    if scale is None:
        return PreflightError(f"tensor {name!r} is {kind} but the model has no {scale_name!r}: without its scales "
                              "its values are not the model's weights", path=model_dir, fix=fix, code="hf_quantized")
    stored = tuple(scale.shape)
    fits = {f.block(shape) for f in scheme.forms if _same_layout(stored, f.scale_shape(shape))}
    if scale.dtype in SCALE_DTYPES and len(fits) == 1:
        return fits.pop()
    wants = " or ".join(f"{list(f.scale_shape(shape))} ({f.name})" for f in scheme.forms)
    if len(fits) > 1:
        return PreflightError(f"tensor {scale_name!r} of shape {list(stored)} fits more than one scale form of the "
                              f"{list(shape)} weight ({wants}): which blocks it scales is not known",
                              path=os.path.join(model_dir, scale.file), fix=fix, code="hf_quantized")
    return PreflightError(f"tensor {scale_name!r} is {scale.dtype} of shape {list(stored)}; the {list(shape)} weight "
                          f"needs {' / '.join(SCALE_DTYPES)} of shape {wants}", path=os.path.join(model_dir, scale.file),
                          fix=fix, code="hf_quantized")


def _same_layout(stored: tuple[int, ...], want: tuple[int, int]) -> bool:
    """Whether a stored scale of shape ``stored`` holds a ``want`` matrix's elements in its order."""
    return stored == want or (want[1] == 1 and stored == want[:1]) or (want == (1, 1) and stored == ())


def expand_packed(tensors: dict[str, Any], scheme: ScaledFp8, model_dir: str) \
        -> tuple[dict[str, Any], list[PreflightError]]:
    """The tensor table with each pack-quantized weight ``X.weight_packed`` replaced by a virtual ``X.weight`` of
    ``scheme.packed`` values, ``[R, 32 / bits * packed columns]``, its bytes the packed tensor's (``X.weight_shape``
    stays in the table); (the table, the packed weights that do not fit)."""
    if scheme.packed is None:
        return tensors, []
    per_word = 32 // BITS[scheme.packed]
    out = dict(tensors)
    errors: list[PreflightError] = []
    fix = "download the model again (a packed weight, its scale and its shape come from the same files)"
    for name, t in tensors.items():
        if not name.endswith("weight" + PACKED):
            continue
        weight = name[:-len(PACKED)]
        shape = tensors.get(weight + SHAPE)
        problem = None
        if t.dtype != "int32" or len(t.shape) != 2:
            problem = f"tensor {name!r} is {t.dtype} of shape {list(t.shape)}: pack-quantized weights are int32 matrices"
        elif shape is None or shape.dtype not in ("int64", "int32") or tuple(shape.shape) != (2,):
            problem = (f"the pack-quantized weight {name!r} has no {weight + SHAPE!r} of two integers (its "
                       "[rows, columns])")
        elif weight in tensors:
            problem = f"the files hold {weight!r} and its pack-quantized form {name!r}: which one is the model's is not known"
        if problem is not None:
            errors.append(PreflightError(problem, path=os.path.join(model_dir, t.file), fix=fix, code="hf_quantized"))
            continue
        del out[name]  # (its X.weight_shape stays: the weight's ref checks it when its rows are read)
        out[weight] = SafeTensor(weight, t.file, scheme.packed, (t.shape[0], t.shape[1] * per_word), t.start, t.end)
    return out, errors

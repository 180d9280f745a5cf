"""Quantized weights as the hub publishes them, read as the model's float weights.

FP8 with block scales (``quantization_config``: ``quant_method: fp8``, ``fmt: e4m3``, ``weight_block_size: [bR, bC]``;
DeepSeek-V3 / V3.1 / R1, Kimi K2, the Qwen3 ``-FP8`` models): each quantized linear weight ``X.weight`` is
``float8_e4m3fn`` of shape ``[R, C]`` beside ``X.weight_scale_inv``, float32 of shape ``[ceil(R / bR), ceil(C / bC)]``
(the edge blocks partial); the weight's value is ``float(X.weight[i, j]) * X.weight_scale_inv[i // bR, j // bC]``
(DeepSeek's ``weight_dequant``: the name says inverse, the value multiplies), cast to the model's dtype. What the
quantization leaves alone (norms, the router, embeddings, the output layer) is stored in that dtype and read as is.

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

SCALE_SUFFIX = "_scale_inv"
FP8 = "float8_e4m3fn"
SCALE_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class BlockFp8:
    """FP8 e4m3 weights with one scale per ``block`` (rows, columns) of elements."""

    block: tuple[int, int]

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        return math.ceil(shape[0] / self.block[0]), math.ceil(shape[1] / self.block[1])

    def describe(self) -> str:
        return f"{FP8} with {self.block[0]}x{self.block[1]} block scales (weight{SCALE_SUFFIX})"


@dataclass(frozen=True)
class Mxfp4:
    """MXFP4 experts: two e2m1 values a byte, one e8m0 exponent per 32 values (:mod:`.stacked` reads them)."""

    @staticmethod
    def describe() -> str:
        return "MXFP4 (e2m1 values in *_blocks, an e8m0 exponent per 32 in *_scales)"


def scheme_of(raw: dict[str, Any], path: str) -> BlockFp8 | Mxfp4 | None:
    """The quantization ``config.json`` names (None: none); a scheme megatron-preflight does not read is an error
    naming the field and its value."""
    quant = raw.get("quantization_config")
    if quant is None:
        return None
    fix = ("use a bf16 / fp32 copy of the model (e.g. the publisher's unquantized one); megatron-preflight "
           "dequantizes FP8 e4m3 weights with block scales as it reads them")
    if not isinstance(quant, dict):
        raise PreflightError(f"config.json's quantization_config is {quant!r:.80}: not an object", path=path,
                             fix=fix, code="hf_quantized")
    method = quant.get("quant_method")
    if method == "mxfp4":
        return Mxfp4()
    if method != "fp8":
        raise PreflightError(f"config.json's quantization_config holds quant_method {method!r}, which "
                             "megatron-preflight does not dequantize (it reads FP8 e4m3 with block scales and MXFP4)",
                             path=path, fix=fix, code="hf_quantized")
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise PreflightError(f"config.json's quantization_config.fmt is {fmt!r}: FP8 e4m3 is read", path=path,
                             fix=fix, code="hf_quantized")
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and 0 < b <= 2**16 for b in block)):
        raise PreflightError(f"config.json's quantization_config.weight_block_size is {block!r:.80}: two positive "
                             "integers are needed (per-tensor or per-channel FP8 scales are not read)", path=path,
                             fix=fix, code="hf_quantized")
    return BlockFp8((block[0], block[1]))


def dequantized_dtype(model_dtype: str | None) -> str:
    """The dtype FP8 weights are dequantized to: the model's (config.json's ``torch_dtype``), bf16 where it names none
    the weights can take (the hub's FP8 models are trained in bf16)."""
    return model_dtype if model_dtype in ("bfloat16", "float16", "float32") else "bfloat16"


class QRun(NamedTuple):
    """Rows ``src_row0 ..`` (``rows`` of them) of an FP8 tensor, dequantized into rows ``dst_row0 ..`` of the tensor a
    :class:`~megatron_preflight.layout.hf.safetensors.SafeRef` describes."""

    name: str  # the FP8 tensor (its scale: name + SCALE_SUFFIX), for messages
    file: str
    start: int  # absolute byte offset of the FP8 tensor's first element
    cols: int
    src_row0: int
    rows: int
    dst_row0: int
    scale_file: str
    scale_start: int
    scale_dtype: str
    scale_cols: int
    block: tuple[int, int]


def check_scale(name: str, shape: tuple[int, ...], scale: Any, scheme: BlockFp8, model_dir: str) -> PreflightError | None:
    """Why the scale tensor ``scale`` (a SafeTensor, or None) cannot serve the FP8 weight ``name`` of ``shape``."""
    scale_name = name + SCALE_SUFFIX
    fix = "download the model again (the weights and their scales come from the same files)"
    if len(shape) != 2:
        return PreflightError(f"tensor {name!r} is {FP8} of shape {list(shape)}: block scales are read for matrices "
                              "only", path=model_dir, fix=fix, code="hf_quantized")
    if scale is None:
        return PreflightError(f"tensor {name!r} is {FP8} but the model has no {scale_name!r}: without its scales "
                              "its values are not the model's weights", path=model_dir, fix=fix, code="hf_quantized")
    want = scheme.scale_shape(shape)
    if scale.dtype not in SCALE_DTYPES or tuple(scale.shape) != want:
        return PreflightError(f"tensor {scale_name!r} is {scale.dtype} of shape {list(scale.shape)}; the "
                              f"{list(shape)} weight with {scheme.block[0]}x{scheme.block[1]} blocks needs "
                              f"float32 of shape {list(want)}", path=os.path.join(model_dir, scale.file), fix=fix,
                              code="hf_quantized")
    return None

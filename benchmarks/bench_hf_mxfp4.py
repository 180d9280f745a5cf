"""MXFP4 dequantization as a rank reads it: one GPT-OSS-wide expert (``gate_up_proj`` blocks of 2 x 2880 rows of 2880
values, e8m0 scales) in a safetensors file, its gate part's 2880 x 2880 values read through ``HfReader.rows`` (the
interleaved rows, dequantized into the model's dtype). Prints a table: values per second, best of ``--repeat``, page
cache warm.

    python benchmarks/bench_hf_mxfp4.py
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from safetensors.torch import save_file

from megatron_preflight.layout.hf import stacked
from megatron_preflight.layout.hf.safetensors import safe_ref, tensor_table
from megatron_preflight.reshard.sources.hf import HfReader

EXPERTS, OUT, IN = 2, 2 * 2880, 2880  # (GPT-OSS-20b / 120b: hidden 2880, expert ffn 2880)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_hf_mxfp4_") as d:
        g = torch.Generator().manual_seed(0)
        save_file({"L.mlp.experts.gate_up_proj_blocks": torch.randint(0, 256, (EXPERTS, OUT, IN // 32, 16),
                                                                      dtype=torch.uint8, generator=g),
                   "L.mlp.experts.gate_up_proj_scales": torch.randint(100, 150, (EXPERTS, OUT, IN // 32),
                                                                      dtype=torch.uint8, generator=g)},
                  os.path.join(d, "model.safetensors"))
        table = tensor_table(d).tensors
        how = stacked.Stacked("mlp.experts.gate_up_proj", ("gate_proj.weight", "up_proj.weight"), interleaved=True,
                              transposed=True)
        print(f"MXFP4 expert part {OUT // 2} x {IN} ({OUT // 2 * IN / 1e6:.1f} M values), one thread, best of "
              f"{ns.repeat}")
        print(f"{'dtype':<10} {'s':>7} {'M values/s':>11}")
        for dtype in ("bfloat16", "float32"):
            parts: dict = {}
            stacked._mx_parts(parts, table["L.mlp.experts.gate_up_proj_blocks"],
                              table["L.mlp.experts.gate_up_proj_scales"], how, "L.", dtype, d)
            part = parts["L.mlp.experts.0.gate_proj.weight"]
            ref = safe_ref("k", dtype, part.shape, (), (stacked.run(part, 0, part.shape[0], 0),))
            reader = HfReader(d)
            reader.rows("", ref, 0, 8)  # (the file opened, the table made)
            best = float("inf")
            for _ in range(ns.repeat):
                t0 = time.perf_counter()
                reader.rows("", ref, 0, part.shape[0])
                best = min(best, time.perf_counter() - t0)
            reader.close()
            print(f"{dtype:<10} {best:>7.3f} {part.shape[0] * part.shape[1] / best / 1e6:>11.0f}")


if __name__ == "__main__":
    main()

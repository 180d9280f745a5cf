"""Each quantized form the hub publishes, read and dequantized as a rank does it: the same dense model (Llama shape at
hidden 4096, FFN 14336, 2 layers, a small vocab: 0.44 G weights in its linears) stored bf16 (the baseline: a plain
copy), FP8 with 128x128 block scales (DeepSeek's ``weight_scale_inv``), FP8 per channel (llm-compressor's
``float-quantized``), INT4 per group of 32 (llm-compressor's ``pack-quantized``: Kimi K2.5's experts' form) and INT8
per channel; each converted offline to a TP2 legacy checkpoint (``megatron-preflight reshard DIR OUT --tp 2``: every
weight read, dequantized to bf16 and written once). The values are random (the speed does not depend on them).

Columns: wall seconds (fresh process, imports included), MiB read / written as the command reports them, peak RSS;
median of N, warm page cache.

Usage: python benchmarks/bench_hf_quant_forms.py [--work DIR] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from hf_dirs import timed  # noqa: E402

H, F, HEADS, GROUPS, LAYERS, VOCAB = 4096, 14336, 32, 8, 2, 1024
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": F,
          "num_attention_heads": HEADS, "num_key_value_heads": GROUPS, "num_hidden_layers": LAYERS, "vocab_size": VOCAB,
          "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
          "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
CT = {"quant_method": "compressed-tensors", "quantization_status": "compressed"}


def _linears() -> list[tuple[str, tuple[int, int]]]:
    kv = H // HEADS * GROUPS
    out = []
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (H, H)), (p + "self_attn.k_proj.weight", (kv, H)),
                (p + "self_attn.v_proj.weight", (kv, H)), (p + "self_attn.o_proj.weight", (H, H)),
                (p + "mlp.gate_proj.weight", (F, H)), (p + "mlp.up_proj.weight", (F, H)),
                (p + "mlp.down_proj.weight", (H, F))]
    return out


def _config(form: str) -> dict | None:
    group = {"targets": ["Linear"], "input_activations": None}
    if form == "fp8_block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    if form == "fp8_channel":
        return dict(CT, format="float-quantized", config_groups={"g": dict(group, weights={
            "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"})})
    if form in ("int4_group32", "int8_channel"):
        bits = 4 if form == "int4_group32" else 8
        weights = {"num_bits": bits, "type": "int", "symmetric": True,
                   "strategy": "group" if bits == 4 else "channel", "group_size": 32 if bits == 4 else None}
        return dict(CT, format="pack-quantized", config_groups={"g": dict(group, weights=weights)})
    return None


def write(path: str, form: str) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    out = {"model.embed_tokens.weight": torch.randn(VOCAB, H, generator=g).bfloat16(),
           "lm_head.weight": torch.randn(VOCAB, H, generator=g).bfloat16(),
           "model.norm.weight": torch.ones(H).bfloat16()}
    for i in range(LAYERS):
        for n in ("input_layernorm", "post_attention_layernorm"):
            out[f"model.layers.{i}.{n}.weight"] = torch.ones(H).bfloat16()
    for name, (r, c) in _linears():
        if form == "bf16":
            out[name] = (torch.randn(r, c, generator=g) * 0.02).bfloat16()
        elif form.startswith("fp8"):  # (finite e4m3 codes: the sign and 6 low bits random, below the NaN code)
            out[name] = (torch.randint(0, 128, (r, c), generator=g, dtype=torch.uint8) & 0xBF).view(torch.float8_e4m3fn)
            shape = (-(-r // 128), -(-c // 128)) if form == "fp8_block" else (r, 1)
            scale = torch.rand(shape, generator=g) * 1e-3
            out[name + ("_scale_inv" if form == "fp8_block" else "_scale")] = \
                scale if form == "fp8_block" else scale.bfloat16()
        else:
            bits = 4 if form == "int4_group32" else 8
            module = name.removesuffix("weight")
            out[module + "weight_packed"] = torch.randint(0, 256, (r, c * bits // 8), generator=g,
                                                          dtype=torch.uint8).view(torch.int32)
            out[module + "weight_scale"] = (torch.rand(r, c // 32 if bits == 4 else 1, generator=g) * 1e-3).bfloat16()
            out[module + "weight_shape"] = torch.tensor([r, c], dtype=torch.int64)
    os.makedirs(path, exist_ok=True)
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(CONFIG)
    if _config(form) is not None:
        cfg["quantization_config"] = _config(form)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work")
    ap.add_argument("--repeat", type=int, default=3)
    ns = ap.parse_args()
    work = ns.work or tempfile.mkdtemp(prefix="bench_hf_quant_forms_")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    print(f"Llama-shaped, hidden {H}, FFN {F}, {LAYERS} layers: offline reshard to TP2 legacy, bf16 out; "
          f"median of {ns.repeat}, warm page cache")
    print(f"{'stored as':<34} {'file MiB':>9} {'wall s':>7} {'read MiB':>9} {'wrote MiB':>10} {'peak RSS MiB':>13}")
    labels = {"bf16": "bf16 (plain copy)", "fp8_block": "FP8, 128x128 blocks (fp8)",
              "fp8_channel": "FP8 per channel (compressed-tensors)", "int4_group32": "INT4 per 32 (pack-quantized)",
              "int8_channel": "INT8 per channel (pack-quantized)"}
    try:
        for form, label in labels.items():
            src = os.path.join(work, form)
            if not os.path.exists(os.path.join(src, "config.json")):
                write(src, form)
            size = os.path.getsize(os.path.join(src, "model.safetensors")) / 2**20
            runs = []
            for _ in range(ns.repeat):
                out = os.path.join(work, "out")
                shutil.rmtree(out, ignore_errors=True)
                wall, rss, rc, text = timed([sys.executable, "-m", "megatron_preflight", "reshard", src, out,
                                             "--tp", "2", "--no-progress"], env=env)
                if rc != 0:
                    raise SystemExit(f"{label}: reshard failed\n{text[-2000:]}")
                m = re.search(r"read ([\d.,]+) MiB, wrote ([\d.,]+) MiB", text)
                runs.append((wall, float(m.group(1).replace(",", "")), float(m.group(2).replace(",", "")), rss))
                shutil.rmtree(out, ignore_errors=True)
            med = statistics.median
            print(f"{label:<34} {size:>9,.0f} {med(r[0] for r in runs):>7.2f} {med(r[1] for r in runs):>9,.0f} "
                  f"{med(r[2] for r in runs):>10,.0f} {max(r[3] for r in runs):>13,.0f}")
    finally:
        if not ns.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""A model as the hub publishes it in FP8 (DeepSeek-V3's scheme: every decoder linear weight float8_e4m3fn beside a
float32 ``weight_scale_inv`` per 128x128 block; embeddings, norms, router and head bf16): a ~1 GB Mixtral-shaped
model read into Megatron at TP2·EP2, dequantized as it streams (job start per rank; offline ``reshard``), beside the
way users do it today: a ``fp8_cast_bf16.py``-style dequantize of the whole model into a bf16 copy (the model loaded
per file with safetensors, each weight times its block scales, written back; config.json without its
quantization_config), then the import of that copy.

Columns: wall seconds (fresh processes, imports included), peak RSS (VmHWM), MiB of files read (reading FP8: the
resharder's own byte ranges, the FP8 rows and the scale rows covering them; the cast: every byte) and written (held,
at job start: the rank's dequantized tensors). Median of N, warm page cache.

Usage: python benchmarks/bench_hf_fp8.py [--work DIR] [--repeat 3] [--layers 9]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from bench_hf_import import FLAGS, SHAPE, job_start, model_flags  # noqa: E402
from hf_dirs import timed as run_timed  # noqa: E402

BLOCK = 128
ITEM = {"BF16": 2, "F8_E4M3": 1, "F32": 4}


def _tensors(layers: int) -> list[tuple[str, tuple[int, ...], str]]:
    h, g, f, e, v = (SHAPE[k] for k in ("hidden", "groups", "ffn", "experts", "vocab"))
    hd = h // SHAPE["heads"]
    out: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (v, h), "BF16")]

    def fp8(name: str, shape: tuple[int, int]) -> None:
        out.append((name, shape, "F8_E4M3"))
        out.append((name + "_scale_inv", (math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK)), "F32"))

    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,), "BF16"), (p + "post_attention_layernorm.weight", (h,), "BF16")]
        for name, shape in (("q_proj", (h, h)), ("k_proj", (g * hd, h)), ("v_proj", (g * hd, h)),
                            ("o_proj", (h, h))):
            fp8(f"{p}self_attn.{name}.weight", shape)
        out.append((p + "block_sparse_moe.gate.weight", (e, h), "BF16"))
        for j in range(e):
            x = f"{p}block_sparse_moe.experts.{j}."
            fp8(x + "w1.weight", (f, h))
            fp8(x + "w3.weight", (f, h))
            fp8(x + "w2.weight", (h, f))
    return out + [("model.norm.weight", (h,), "BF16"), ("lm_head.weight", (v, h), "BF16")]


def _random(code: str, n: int) -> bytes:
    """``n`` bytes of finite values: bf16 with its exponent bits cleared, FP8 without its NaN code, scales ~1e-2."""
    raw = bytearray(os.urandom(n))
    if code == "BF16":
        raw[1::2] = bytes(b & 0x3F for b in raw[1::2])
    elif code == "F8_E4M3":
        raw = bytearray(raw.translate(bytes((b & 0xF7) for b in range(256))))  # (0x7F / 0xFF are NaN)
    else:
        raw = bytearray(struct.pack(f"<{n // 4}f", *[0.01] * (n // 4)))
    return bytes(raw)


def write_fp8(path: str, layers: int, files: int = 4) -> int:
    """The FP8 model dir (``files`` shards, an index, config.json with the quantization_config). Returns its bytes."""
    os.makedirs(path, exist_ok=True)
    tensors = _tensors(layers)
    per = math.ceil(len(tensors) / files)
    weight_map, total = {}, 0
    for k in range(files):
        part = tensors[k * per:(k + 1) * per]
        name = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        header, at = {}, 0
        for t, shape, code in part:
            n = ITEM[code] * math.prod(shape)
            header[t] = {"dtype": code, "shape": list(shape), "data_offsets": [at, at + n]}
            weight_map[t] = name
            at += n
        raw = json.dumps(header).encode()
        with open(os.path.join(path, name), "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)) + raw)
            for _t, shape, code in part:
                fh.write(_random(code, ITEM[code] * math.prod(shape)))
        total += at
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh)
    h, g, f, e, v = (SHAPE[k] for k in ("hidden", "groups", "ffn", "experts", "vocab"))
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": v, "hidden_size": h,
              "intermediate_size": f, "num_hidden_layers": layers, "num_attention_heads": SHAPE["heads"],
              "num_key_value_heads": g, "num_local_experts": e, "num_experts_per_tok": 2, "hidden_act": "silu",
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "sliding_window": None,
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [BLOCK, BLOCK]}}
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh)
    return total


# fp8_cast_bf16.py's way (DeepSeek-V3's inference/fp8_cast_bf16.py, rewritten here: its logic, not its code): per
# file, every FP8 weight times its block scales in bf16, the scales dropped, the index rewritten
CAST = """
import json, os, sys, torch
from safetensors.torch import load_file, save_file
src, dst, block = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.makedirs(dst, exist_ok=True)
index = json.load(open(os.path.join(src, "model.safetensors.index.json")))
weight_map, loaded = {}, {}
def scale_of(key):  # (a weight's scales may sit in another file: loaded from it, the last two files kept)
    name = index["weight_map"][key]
    if name not in loaded:
        if len(loaded) >= 2:
            loaded.pop(next(iter(loaded)))
        loaded[name] = load_file(os.path.join(src, name))
    return loaded[name][key]
for name in sorted(set(index["weight_map"].values())):
    state = load_file(os.path.join(src, name))
    loaded[name] = state
    out = {}
    for key, t in state.items():
        if key.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = scale_of(key + "_scale_inv")
            s = s.repeat_interleave(block, 0)[: t.shape[0]].repeat_interleave(block, 1)[:, : t.shape[1]]
            t = (t.to(torch.float32) * s).to(torch.bfloat16)
        out[key] = t
        weight_map[key] = name
    save_file(out, os.path.join(dst, name), metadata={"format": "pt"})
    del state, out
    loaded.pop(name, None)
config = json.load(open(os.path.join(src, "config.json")))
config.pop("quantization_config", None)
json.dump(config, open(os.path.join(dst, "config.json"), "w"))
json.dump({"metadata": {}, "weight_map": weight_map}, open(os.path.join(dst, "model.safetensors.index.json"), "w"))
"""


def _merged(ranges: list[tuple[int, int]]) -> int:
    total, end = 0, -1
    for start, n in sorted(ranges):
        lo = max(start, end)
        if start + n > lo:
            total += start + n - lo
        end = max(end, start + n)
    return total


def reads(path: str, world: int = 4) -> tuple[int, int]:
    """(the most file bytes one rank of the TP2 EP2 job reads, the bytes all ranks read together): the FP8 rows and
    the scale rows that cover them, from the resharder's own list of byte ranges."""
    from megatron_preflight.reshard import TargetLayout, open_resharder

    r = open_resharder(path, TargetLayout(tp=2, ep=2, etp=1, padded_vocab_size=SHAPE["vocab"]))
    per, union = [], {}
    for rank in range(world):
        ranges = r.byte_ranges(r.plan_for_rank(rank, world))
        per.append(sum(_merged(v) for v in ranges.values()))
        for f, v in ranges.items():
            union.setdefault(f, []).extend(v)
    return max(per), sum(_merged(v) for v in union.values())


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def reshard(src: str, dst: str, flags: list[str], env: dict) -> tuple[float, float, float, float]:
    shutil.rmtree(dst, ignore_errors=True)
    wall, rss, rc, text = run_timed([sys.executable, "-m", "megatron_preflight", "reshard", src, dst, "--no-progress",
                                     "--ckpt-format", "torch_dist", "--", *flags], env=env)
    if rc != 0:
        raise SystemExit(text[-3000:])
    m = re.search(r"read ([0-9.]+) MiB, wrote ([0-9.]+) MiB", text)
    shutil.rmtree(dst, ignore_errors=True)
    return wall, rss, float(m.group(1)), float(m.group(2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layers", type=int, default=9)
    ns = ap.parse_args()
    work = ns.work or tempfile.mkdtemp(prefix="bench_hf_fp8_")
    model = os.path.join(work, "mixtral_fp8")
    size = write_fp8(model, ns.layers) if not os.path.isdir(model) else _size(model)
    subprocess.run(["cat", *[os.path.join(model, f) for f in os.listdir(model)]], stdout=subprocess.DEVNULL)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    flags = model_flags(model) + FLAGS
    rows = []
    rank_read, all_read = reads(model)
    runs = [reshard(model, os.path.join(work, "out"), flags, env) for _ in range(ns.repeat)]
    rows.append(("offline reshard FP8 -> torch_dist", statistics.median(r[0] for r in runs),
                 max(r[1] for r in runs), all_read / 2**20, runs[0][3]))
    starts = [job_start(model) for _ in range(ns.repeat)]
    rows.append(("job start from FP8, per rank (4 ranks)", statistics.median(s[0] for s in starts),
                 max(s[1] for s in starts), rank_read / 2**20, starts[0][3] / 2**20))
    casts, imports = [], []
    for _ in range(ns.repeat):
        bf16 = os.path.join(work, "mixtral_bf16")
        shutil.rmtree(bf16, ignore_errors=True)
        wall, rss, rc, text = run_timed([sys.executable, "-c", CAST, model, bf16, str(BLOCK)], env=env)
        if rc != 0:
            raise SystemExit(text[-3000:])
        wall += run_timed(["sync"])[0]
        casts.append((wall, rss, size / 2**20, _size(bf16) / 2**20))
        imports.append(reshard(bf16, os.path.join(work, "out"), flags, env))
    cast = (statistics.median(c[0] for c in casts), max(c[1] for c in casts), casts[0][2], casts[0][3])
    imp = (statistics.median(i[0] for i in imports), max(i[1] for i in imports), imports[0][2], imports[0][3])
    rows.append(("  fp8_cast_bf16-style dequantize", *cast))
    rows.append(("  then reshard bf16 -> torch_dist", *imp))
    rows.append(("dequantize-then-import, together", cast[0] + imp[0], max(cast[1], imp[1]), cast[2] + imp[2],
                 cast[3] + imp[3]))
    print(f"an FP8 Mixtral-shaped model ({size / 2**30:.2f} GiB as published, {ns.layers} layers, 128x128 block "
          f"scales) into Megatron at TP2 EP2; median of {ns.repeat} fresh processes, warm page cache")
    print(f"{'path':<42} {'wall s':>7} {'peak RSS MiB':>13} {'read MiB':>9} {'written/held MiB':>17}")
    for label, wall, rss, read, wrote in rows:
        print(f"{label:<42} {wall:>7.2f} {rss:>13.0f} {read:>9.0f} {wrote:>17.0f}")
    if not ns.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

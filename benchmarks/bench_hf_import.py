"""Importing a Hugging Face model: a ~1 GB Mixtral-shaped model (bf16, 2 safetensors shards + index) read into
Megatron at TP2·EP2, offline (``reshard --ckpt-format torch|torch_dist``, one fresh process) and at job start (each
rank's state dict built in memory, one fresh process per rank, as ``--preflight auto`` does), beside Megatron-LM's
own ``tools/checkpoint/convert.py --loader mixtral_hf`` on the same model when a Megatron-LM tree is given.

Columns: wall seconds (fresh process: imports included), peak RSS (VmHWM), bytes read (the files' bytes: offline
the CLI's count; per rank the bytes its plan reads) and written, and the model's size for scale. The page cache is
warm for every row (the model is read once before).

Usage: python benchmarks/bench_hf_import.py [--work DIR] [--repeat 3]
       [--megatron-lm DIR --megatron-python PY --transformers4 DIR --megatron-pythonpath DIR]   (the convert.py row:
       a Megatron-LM tree, the Python that runs it, a dir holding transformers 4.x and accelerate: its loader asserts
       transformers >= 4.36 by the minor number alone, so 5.x fails it; on CPU the CPU runner's shim)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from hf_dirs import timed as run_timed  # noqa: E402
from hf_dirs import write_shards  # noqa: E402

# Mixtral's shape, scaled to ~1 GB: 5 layers, hidden 1024, 16 heads over 4 groups, 8 experts of 3584, vocab 32000
SHAPE = dict(hidden=1024, heads=16, groups=4, ffn=3584, experts=8, layers=5, vocab=32000)
FLAGS = ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
         "--sequence-parallel", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(SHAPE["vocab"] - 1)]


def write_model(path: str) -> int:
    """A Mixtral-shaped HF dir with random bf16 bytes (written directly: no model is built). Returns its bytes."""
    os.makedirs(path, exist_ok=True)
    h, g, f, e, n, v = (SHAPE[k] for k in ("hidden", "groups", "ffn", "experts", "layers", "vocab"))
    hd = h // SHAPE["heads"]
    tensors: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for i in range(n):
        p = f"model.layers.{i}."
        tensors += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                    (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (g * hd, h)),
                    (p + "self_attn.v_proj.weight", (g * hd, h)), (p + "self_attn.o_proj.weight", (h, h)),
                    (p + "block_sparse_moe.gate.weight", (e, h))]
        for j in range(e):
            x = f"{p}block_sparse_moe.experts.{j}."
            tensors += [(x + "w1.weight", (f, h)), (x + "w3.weight", (f, h)), (x + "w2.weight", (h, f))]
    tensors += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    half = len(tensors) // 2
    total = write_shards(path, [tensors[:half], tensors[half:]], hollow=False)
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": v, "hidden_size": h,
              "intermediate_size": f, "num_hidden_layers": n, "num_attention_heads": SHAPE["heads"],
              "num_key_value_heads": g, "num_local_experts": e, "num_experts_per_tok": 2, "hidden_act": "silu",
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "sliding_window": None}
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh)
    return total


def timed(cmd: list[str], env: dict | None = None, cwd: str | None = None, may_fail: bool = False) \
        -> tuple[float, float, str]:
    """(wall s, peak RSS MiB, output) of ``cmd`` (``may_fail``: a failure is returned, its last error line as the
    output)."""
    wall, rss, rc, text = run_timed(cmd, env=env, cwd=cwd)
    if rc != 0 and not may_fail:
        raise SystemExit(f"{cmd[:4]} failed:\n{text[-4000:]}")
    if rc != 0:
        errors = [line for line in text.splitlines() if re.match(r"\w*Error: ", line.strip())]
        return wall, rss, "FAILED: " + (errors[-1].strip() if errors else f"exit {rc}")
    return wall, rss, text


def model_flags(path: str) -> list[str]:
    from megatron_preflight.check.hf_model import model_flags as flags
    from megatron_preflight.reshard import open_index

    return [w.strip("'") for f in flags(open_index(path).layout.saved_args) for w in f.split(" ", 1)]


RANK = """
import json, sys, time
t0 = time.perf_counter()
from megatron_preflight.reshard import TargetLayout
from megatron_preflight.reshard.resharder import build_rank_state_dict
path, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
target = TargetLayout(tp=2, ep=2, etp=1, padded_vocab_size=32000)
sd = build_rank_state_dict(path, target, rank=rank, world_size=world)
held = sum(t.numel() * t.element_size() for t in sd["model"].values() if hasattr(t, "numel"))
with open("/proc/self/status") as f:
    rss = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
print(json.dumps({"wall": time.perf_counter() - t0, "rss": rss, "held": held}))
"""


def job_start(path: str, world: int = 4) -> tuple[float, float, int, int]:
    """(slowest rank's wall s, largest peak RSS MiB, most bytes a rank reads, most bytes a rank holds)."""
    from megatron_preflight.reshard import TargetLayout, open_resharder, predict_in_memory

    pred = predict_in_memory(open_resharder(path, TargetLayout(tp=2, ep=2, etp=1, padded_vocab_size=32000)),
                             sample=False)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    runs = []
    for rank in range(world):
        r = subprocess.run([sys.executable, "-c", RANK, path, str(rank), str(world)], capture_output=True, text=True,
                           env=env, timeout=1200)
        if r.returncode != 0:
            raise SystemExit(r.stderr[-3000:])
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    return (max(x["wall"] for x in runs), max(x["rss"] for x in runs), max(r.bytes_read for r in pred.ranks),
            max(x["held"] for x in runs))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--megatron-lm")
    ap.add_argument("--megatron-python")
    ap.add_argument("--transformers4")
    ap.add_argument("--megatron-pythonpath", help="more PYTHONPATH for convert.py (e.g. the CPU runner's shim)")
    ns = ap.parse_args()
    work = ns.work or tempfile.mkdtemp(prefix="bench_hf_")
    model = os.path.join(work, "mixtral_1g")
    size = write_model(model) if not os.path.isdir(model) else sum(
        os.path.getsize(os.path.join(model, f)) for f in os.listdir(model))
    subprocess.run(["cat", *[os.path.join(model, f) for f in os.listdir(model)]], stdout=subprocess.DEVNULL)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    flags = model_flags(model) + FLAGS
    rows, notes = [], []
    for fmt in ("torch", "torch_dist"):
        out = []
        for k in range(ns.repeat):
            dst = os.path.join(work, f"out_{fmt}_{k}")
            shutil.rmtree(dst, ignore_errors=True)
            wall, rss, text = timed([sys.executable, "-m", "megatron_preflight", "reshard", model, dst, "--no-progress",
                                     "--ckpt-format", fmt, "--", *flags], env=env)
            m = re.search(r"read ([0-9.]+) MiB, wrote ([0-9.]+) MiB", text)
            out.append((wall, rss, float(m.group(1)), float(m.group(2))))
            shutil.rmtree(dst, ignore_errors=True)
        rows.append((f"offline reshard -> {fmt} TP2 EP2", statistics.median(o[0] for o in out),
                     max(o[1] for o in out), out[0][2], out[0][3]))
    starts = [job_start(model) for _ in range(ns.repeat)]
    rows.append(("job start, per rank (4 ranks)", statistics.median(s[0] for s in starts), max(s[1] for s in starts),
                 starts[0][2] / 2**20, starts[0][3] / 2**20))
    if ns.megatron_lm:
        dst = os.path.join(work, "out_convert")
        shutil.rmtree(dst, ignore_errors=True)
        menv = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ns.megatron_pythonpath, ns.transformers4,
                                                                        ns.megatron_lm) if p),
                    CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
        tok = os.path.join(work, "tokenizer.model")
        open(tok, "wb").close()  # the loader requires the flag; build_tokenizer=False never opens it
        wall, rss, text = timed([ns.megatron_python or sys.executable, "tools/checkpoint/convert.py", "--model-type",
                                 "GPT", "--loader", "mixtral_hf", "--saver", "core", "--load-dir", model, "--save-dir",
                                 dst, "--tokenizer-model", tok, "--target-tensor-parallel-size", "2",
                                 "--target-expert-parallel-size", "2", "--saver-transformer-impl", "local"],
                                env=menv, cwd=ns.megatron_lm, may_fail=True)
        written = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dst) for f in fs) / 2**20 \
            if os.path.isdir(dst) else float("nan")
        rows.append(("Megatron-LM convert.py mixtral_hf", wall, rss, size / 2**20, written))
        if text.startswith("FAILED"):
            notes.append(f"convert.py {text} (its wall and peak RSS are up to the failure; it had read the whole "
                         "model with from_pretrained)")
    print(f"import of a Mixtral-shaped HF model ({size / 2**30:.2f} GiB bf16, 2 shards) at TP2 EP2; median of "
          f"{ns.repeat} fresh processes, warm page cache")
    print(f"{'path':<40} {'wall s':>7} {'peak RSS MiB':>13} {'read MiB':>9} {'written/held MiB':>17}")
    for label, wall, rss, read, wrote in rows:
        print(f"{label:<40} {wall:>7.2f} {rss:>13.0f} {read:>9.0f} {wrote:>17.0f}")
    for note in notes:
        print("note: " + note)
    if not ns.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Handing a trained model on: ``reshard CKPT OUT --ckpt-format hf`` of a ~1.3 GB Megatron-LM checkpoint with Adam
state (legacy, TP2: weights 0.42 GiB fp32, the rest the optimizer's), beside a plain durable copy of the same
checkpoint (``cp -r && sync``) and of the weights' bytes alone, in the same minutes, warm page cache, median of N.

Columns: wall seconds (fresh process, imports included), peak RSS (VmHWM of the process tree's largest), bytes read
and written. The export reads the weights only (the optimizer state is not part of an HF model).

The checkpoint: written by Megatron-LM's pretrain_gpt.py (1 iteration, TP2), e.g. with the CPU runner of
../shared/tools/megatron-lm-cpu:
  torchrun --nproc-per-node 2 pretrain_gpt.py --num-layers 4 --hidden-size 1024 --ffn-hidden-size 2816
    --num-attention-heads 16 --group-query-attention --num-query-groups 4 --swiglu --normalization RMSNorm
    --position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights
    --max-position-embeddings 64 --seq-length 32 --micro-batch-size 1 --global-batch-size 2 --train-iters 1
    --lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 31999 --make-vocab-size-divisible-by 64
    --save-interval 1 --tensor-model-parallel-size 2 --ckpt-format torch --save DIR $CPUFLAGS

Usage: python benchmarks/bench_hf_export.py CKPT [--repeat 3] [--work DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from hf_dirs import timed as run_timed  # noqa: E402


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, float, str]:
    wall, rss, rc, text = run_timed(cmd, env=env)
    if rc != 0:
        raise SystemExit(f"{cmd[:3]} failed:\n{text[-4000:]}")
    return wall, rss, text


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--work")
    ns = ap.parse_args()
    work = ns.work or tempfile.mkdtemp(prefix="bench_hf_export_")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    subprocess.run(["sh", "-c", f"find {ns.checkpoint} -type f -exec cat {{}} + > /dev/null"])  # warm the cache
    size = tree_bytes(ns.checkpoint)
    rows: dict[str, list[tuple[float, float, float, float]]] = {"export": [], "copy": [], "copy_weights": []}
    for k in range(ns.repeat):
        out = os.path.join(work, f"hf_{k}")
        wall, rss, text = timed([sys.executable, "-m", "megatron_preflight", "reshard", ns.checkpoint, out,
                                 "--ckpt-format", "hf", "--no-progress"], env=env)
        m = re.search(r"read ([0-9.]+) MiB, wrote ([0-9.]+) MiB", text)
        rows["export"].append((wall, rss, float(m.group(1)), float(m.group(2))))
        weights = os.path.join(out, "model.safetensors")
        dst = os.path.join(work, f"copy_{k}")
        wall, rss, _ = timed(["sh", "-c", f"cp -r {ns.checkpoint} {dst} && sync"])
        rows["copy"].append((wall, rss, size / 2**20, size / 2**20))
        wdst = os.path.join(work, f"copyw_{k}.safetensors")
        nbytes = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".safetensors"))
        wall, rss, _ = timed(["sh", "-c", f"cp {weights if os.path.exists(weights) else out} {wdst} && sync"])
        rows["copy_weights"].append((wall, rss, nbytes / 2**20, nbytes / 2**20))
        for p in (out, dst, wdst):
            shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.remove(p)
    labels = {"export": "reshard --ckpt-format hf (weights)", "copy": "cp -r CKPT && sync (everything)",
              "copy_weights": "cp of the exported weights' bytes && sync"}
    print(f"export of {ns.checkpoint} ({size / 2**30:.2f} GiB with Adam state) to a Hugging Face model; median of "
          f"{ns.repeat}, warm page cache")
    print(f"{'path':<44} {'wall s':>7} {'peak RSS MiB':>13} {'read MiB':>9} {'written MiB':>12}")
    for key, runs in rows.items():
        print(f"{labels[key]:<44} {statistics.median(r[0] for r in runs):>7.2f} {max(r[1] for r in runs):>13.0f} "
              f"{runs[0][2]:>9.0f} {runs[0][3]:>12.0f}")
    if not ns.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""What fingerprints at save cost a job: real Megatron-LM ``pretrain_gpt.py`` (CPU runner, world 2) saving a
real-size model with its Adam state every iteration, with ``--preflight check`` and fingerprints on, in one run;
each save's time and the fingerprints' time (and where it goes: reading the saved checkpoint's metadata, hashing the
rank's model and optimizer state, gathering and writing) from the plugin's own line on rank 0. Prints, per save and
as medians, the save's wall time, the fingerprints' and their ratio (the goal: at most 5 % added to a save).

    source /work/mlm/realenv.sh   # or: the CPU runner's env.sh of ../shared/tools/megatron-lm-cpu
    python benchmarks/bench_save.py --megatron $MEGATRON_LM_ROOT --python $MEGATRON_LM_PYTHON \\
        --pythonpath $MEGATRON_LM_PYTHONPATH --extra "$MEGATRON_LM_EXTRA_ARGS" [--ckpt-format torch_dist]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import tempfile

LINE = re.compile(r"fingerprints at save \(iteration (\d+)\): (\d+) tensors, .*? \(([\d.]+) s on rank 0: index "
                  r"([\d.]+), hash ([\d.]+), merge\+write ([\d.]+); the save itself ([\d.]+) s\)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--megatron", required=True)
    ap.add_argument("--python", required=True)
    ap.add_argument("--pythonpath", default="")
    ap.add_argument("--extra", default="")
    ap.add_argument("--ckpt-format", default="torch", choices=("torch", "torch_dist"))
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--port", type=int, default=29950)
    ns = ap.parse_args()
    h = ns.hidden
    model = (f"--num-layers {ns.layers} --hidden-size {h} --ffn-hidden-size {4 * h} --num-attention-heads 16 "
             "--seq-length 64 --max-position-embeddings 64 --vocab-size 32000 --tokenizer-type NullTokenizer "
             "--micro-batch-size 1 --global-batch-size 2 --lr 1e-4 --min-lr 1e-5 --lr-decay-style constant "
             "--mock-data --seed 1234 --log-interval 1 --eval-iters 0 --eval-interval 1000 "
             f"--train-iters {ns.saves} --save-interval 1").split()
    work = tempfile.mkdtemp(prefix="bench_save_")
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ns.pythonpath, ns.megatron, env.get("PYTHONPATH", "")) if p)
    env["PATH"] = os.path.dirname(ns.python) + os.pathsep + env.get("PATH", "")  # its python builds Megatron's helpers
    try:
        cmd = [ns.python, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(ns.port),
               "-m", "megatron_preflight.run", "pretrain_gpt.py", *model, *ns.extra.split(),
               "--ckpt-format", ns.ckpt_format, "--save", os.path.join(work, "ckpt"), "--preflight", "check",
               "--preflight-allow-missing-checkpoint"]
        r = subprocess.run(cmd, cwd=ns.megatron, env=env, capture_output=True, text=True, timeout=3600)
        rows = [tuple(float(x) for x in m.groups()) for m in LINE.finditer(r.stdout + r.stderr)]
        if r.returncode != 0 or not rows:
            raise SystemExit(f"the run failed or printed no fingerprint line:\n{(r.stdout + r.stderr)[-4000:]}")
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(work, "ckpt"))
                   for f in fs if f.endswith((".pt", ".distcp"))) / max(len(rows), 1)
        print(f"{ns.ckpt_format}, world 2 (TP1 DP2), {ns.layers} layers x hidden {h}, Adam state; "
              f"~{size / 2**30:.2f} GiB per checkpoint")
        print(f"{'iteration':>9} {'tensors':>8} {'save s':>7} {'fingerprint s':>14} {'ratio':>6}   where "
              "(index / hash / merge+write s)")
        for it, n, total, index, hashing, merge, save in rows:
            print(f"{int(it):>9} {int(n):>8} {save:>7.2f} {total:>14.2f} {100 * total / save:>5.1f}%   "
                  f"{index:.2f} / {hashing:.2f} / {merge:.2f}")
        med_save = statistics.median(r[6] for r in rows)
        med_fp = statistics.median(r[2] for r in rows)
        print(f"{'median':>9} {'':>8} {med_save:>7.2f} {med_fp:>14.2f} {100 * med_fp / med_save:>5.1f}%   "
              "(goal: at most 5 %)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

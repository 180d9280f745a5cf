"""What fingerprints at save cost a job: real Megatron-LM ``pretrain_gpt.py`` (CPU runner, world 2) saving a
real-size model with its Adam state every iteration, run twice the same way: with ``--preflight-fingerprint-on-save
off`` (the save's own time, as the plugin says it) and on. Per save of the second run: the save's wall time, the
fingerprints' time after it (reading the saved checkpoint's metadata, hashing or waiting for the hashing that ran
beside the save, gathering and writing) and where it goes. The cost is the median of (save + fingerprints after it)
of the run with fingerprints against the median save of the run without: the goal is at most 5 % added. The first
save of a run hashes after the save (no plan yet); later ones hash beside it, each replica's share on one rank.

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

ON = re.compile(r"fingerprints at save \(iteration (\d+)\): (\d+) tensors, .*? \(([\d.]+) s on rank 0 after the save: "
                r"(.*?)(?:; hashed beside the save in ([\d.]+) s)?; the save itself ([\d.]+) s\)")
OFF = re.compile(r"fingerprints at save \(iteration (\d+)\): off \(the save itself ([\d.]+) s\)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--megatron", required=True)
    ap.add_argument("--python", required=True)
    ap.add_argument("--pythonpath", default="")
    ap.add_argument("--extra", default="")
    ap.add_argument("--ckpt-format", default="torch", choices=("torch", "torch_dist"))
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--tp", type=int, default=1, choices=(1, 2), help="2: no data-parallel replicas (each rank "
                    "hashes what it writes, beside its own write)")
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
               "--ckpt-format", ns.ckpt_format, "--tensor-model-parallel-size", str(ns.tp), "--preflight", "check",
               "--preflight-allow-missing-checkpoint"]
        logs = {}
        for mode in ("off", "on"):
            save = os.path.join(work, f"ckpt_{mode}")
            r = subprocess.run([*cmd, "--save", save, "--preflight-fingerprint-on-save", mode], cwd=ns.megatron,
                               env=env, capture_output=True, text=True, timeout=3600)
            logs[mode] = r.stdout + r.stderr
            if r.returncode != 0:
                raise SystemExit(f"the run ({mode}) failed:\n{logs[mode][-4000:]}")
        off = [float(m.group(2)) for m in OFF.finditer(logs["off"])]
        on = [m.groups() for m in ON.finditer(logs["on"])]
        if not off or not on:
            raise SystemExit(f"no fingerprint lines:\n{logs['on'][-4000:]}")
        ckpt = os.path.join(work, "ckpt_on")
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt)
                   for f in fs if f.endswith((".pt", ".distcp"))) / len(on)
        print(f"{ns.ckpt_format}, world 2 (TP{ns.tp} DP{2 // ns.tp}), {ns.layers} layers x hidden {h}, Adam state; "
              f"~{size / 2**30:.2f} GiB per checkpoint; {len(off)} saves without fingerprints, {len(on)} with")
        print(f"{'iteration':>9} {'tensors':>8} {'save s':>7} {'after s':>8} {'beside s':>9}   where (after the save)")
        totals = []
        for it, n, after, where, beside, save in on:
            totals.append(float(save) + float(after))
            print(f"{int(it):>9} {int(n):>8} {float(save):>7.2f} {float(after):>8.2f} "
                  f"{(beside or '-'):>9}   {where}")
        base, with_fp = statistics.median(off), statistics.median(totals)
        later = statistics.median(totals[1:]) if len(totals) > 1 else with_fp
        print(f"\nsave without fingerprints, median of {len(off)}: {base:.2f} s (each: "
              f"{', '.join(f'{x:.2f}' for x in off)})")
        print(f"save + fingerprints, median of {len(totals)}: {with_fp:.2f} s = {100 * (with_fp / base - 1):+.1f} %; "
              f"the saves after the first: {later:.2f} s = {100 * (later / base - 1):+.1f} %   (goal: at most +5 %)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

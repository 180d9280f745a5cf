"""``megatron-preflight diff`` on ~1 GB checkpoints, against the time to read both once.

Builds (once, in --work) the dense GPT checkpoints of bench_reshard.py (16 layers, hidden 1024, fp32, TP2, ~1.0 GB,
model only; and 4 layers with the plain optimizer's Adam state, ~1.3 GB) and, with `megatron-preflight reshard`, the
same at TP1 and in torch_dist. For each pair it times diff_checkpoints in a fresh process (after torch's import:
the tool's own time) and the floor: reading every byte of both checkpoints with plain file I/O, in the same run.

Usage: python benchmarks/bench_diff.py [--work DIR] [--keep]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

from bench_reshard import dir_bytes, proving_inputs, run_case

PROBE = ("import json, resource, sys, time, torch\n"
         "from megatron_preflight.prove.diff import diff_checkpoints\n"
         "times = []\n"
         "for _ in range(4):\n"
         "    t = time.perf_counter(); r = diff_checkpoints(sys.argv[1], sys.argv[2])\n"
         "    times.append(time.perf_counter() - t)\n"
         "print(json.dumps({'first': times[0], 'secs': min(times[1:]), 'equal': r.equal, 'tensors': len(r.tensors),\n"
         "                  'rss': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))\n")


def read_floor(*roots: str) -> float:
    t0 = time.perf_counter()
    buf = bytearray(16 << 20)
    for root in roots:
        for dp, _, fs in os.walk(root):
            for f in fs:
                with open(os.path.join(dp, f), "rb", buffering=0) as fh:
                    while fh.readinto(buf):
                        pass
    return time.perf_counter() - t0


def main() -> None:
    ns, work, dense, adam = proving_inputs("bench_diff_")
    made = {}
    for name, src, flags in (("dense_tp1", dense, ["--tp", "1"]), ("dense_dist", dense, ["--ckpt-format", "torch_dist"]),
                             ("adam_tp1", adam, ["--tp", "1"]), ("adam_dist", adam, ["--ckpt-format", "torch_dist"])):
        made[name] = os.path.join(work, name)
        if not os.path.exists(made[name]):
            run_case(src, made[name], flags)
    cases = [("dense TP2 vs TP1 (legacy)", dense, made["dense_tp1"]),
             ("dense TP2 vs torch_dist", dense, made["dense_dist"]),
             ("dense+Adam TP2 vs TP1", adam, made["adam_tp1"]),
             ("dense+Adam TP2 vs torch_dist", adam, made["adam_dist"])]
    rows = []
    for label, a, b in cases:
        floor = min(read_floor(a, b) for _ in range(4))
        r = subprocess.run([sys.executable, "-c", PROBE, a, b], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(r.stderr)
        doc = json.loads(r.stdout.strip().splitlines()[-1])
        rows.append((label, (dir_bytes(a) + dir_bytes(b)) / 1e9, doc["first"], doc["secs"], floor, doc["rss"],
                     doc["equal"], doc["tensors"]))
    print(f"{'case':<30}{'both GB':>8}{'1st s':>7}{'diff s':>8}{'floor s':>9}{'diff/floor':>11}{'peak RSS MiB':>14}"
          f"{'equal':>7}{'tensors':>9}")
    for label, gb, first, secs, floor, rss, equal, n in rows:
        print(f"{label:<30}{gb:>8.2f}{first:>7.2f}{secs:>8.2f}{floor:>9.2f}{secs / floor:>11.2f}{rss:>14.0f}"
              f"{str(equal):>7}{n:>9}")
    print("1st s: the first diff_checkpoints in a fresh process after torch's import (with the lazy imports it "
          "triggers: torch.distributed.checkpoint for torch_dist); diff s: the best of the next three; floor: every "
          "byte of both checkpoints read once with plain file I/O, best of four (page cache warm, as for diff); "
          "peak RSS: ru_maxrss of the diff process.")
    if not ns.keep and not ns.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

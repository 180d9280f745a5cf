"""``megatron-preflight diff`` on ~1 GB checkpoints, against the time to read both once.

Builds (once, in --work) the dense GPT checkpoints of bench_reshard.py (16 layers, hidden 1024, fp32, TP2, ~1.0 GB,
model only; and 4 layers with the plain optimizer's Adam state, ~1.3 GB) and, with `megatron-preflight reshard`, the
same at TP1 and in torch_dist. For each pair, in a fresh process (after torch's import: the tool's own time), it
times diff_checkpoints once, then in rounds the floor (reading every byte of both checkpoints with plain file I/O,
the fastest of 1, 4 and 16 MiB reads) and diff_checkpoints again: a round's timings share the load of the moment on a
shared box.

Usage: python benchmarks/bench_diff.py [--work DIR] [--keep]
       BENCH_DIFF_COLD=1 python benchmarks/bench_diff.py ...   (each timing from disk: the files' pages dropped with
       posix_fadvise(DONTNEED) before it; 3 rounds)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from bench_reshard import dir_bytes, proving_inputs, run_case

PROBE = ("import json, os, resource, sys, time, torch\n"
         "from megatron_preflight.prove.diff import diff_checkpoints\n"
         "COLD = sys.argv[4] == 'cold'\n"
         "def evict(roots):\n"
         "    for root in roots if COLD else ():\n"
         "        for dp, _, fs in os.walk(root):\n"
         "            for f in fs:\n"
         "                fd = os.open(os.path.join(dp, f), os.O_RDONLY)\n"
         "                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)\n"
         "def read_all(roots, size):\n"
         "    evict(roots)\n"
         "    t0 = time.perf_counter(); buf = bytearray(size)\n"
         "    for root in roots:\n"
         "        for dp, _, fs in os.walk(root):\n"
         "            for f in fs:\n"
         "                with open(os.path.join(dp, f), 'rb', buffering=0) as fh:\n"
         "                    while fh.readinto(buf):\n"
         "                        pass\n"
         "    return time.perf_counter() - t0\n"
         "def hwm():  # VmHWM: reset at exec (ru_maxrss is not: it would carry the builder's peak)\n"
         "    for line in open('/proc/self/status'):\n"
         "        if line.startswith('VmHWM:'):\n"
         "            return int(line.split()[1]) / 1024\n"
         "    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024\n"
         "def floor(roots):\n"
         "    return min(read_all(roots, size) for size in (1 << 20, 4 << 20, 16 << 20))\n"
         "t = time.perf_counter(); r = diff_checkpoints(sys.argv[1], sys.argv[2]); first = time.perf_counter() - t\n"
         "diffs, floors = [], []\n"
         "for _ in range(int(sys.argv[3])):\n"
         "    floors.append(floor(sys.argv[1:3]))\n"
         "    evict(sys.argv[1:3])\n"
         "    t = time.perf_counter(); r = diff_checkpoints(sys.argv[1], sys.argv[2])\n"
         "    diffs.append(time.perf_counter() - t)\n"
         "print(json.dumps({'first': first, 'diffs': diffs, 'floors': floors, 'equal': r.equal,\n"
         "                  'tensors': len(r.tensors), 'rss': hwm()}))\n")
COLD = os.environ.get("BENCH_DIFF_COLD") == "1"  # every timing from disk: the files' pages dropped before each
ROUNDS = 3 if COLD else 7


def diff_pairs(prefix: str = "bench_diff_") -> tuple[object, str, list[tuple[str, str, str]]]:
    """The benchmark's checkpoint pairs (label, a, b), built in --work once."""
    ns, work, dense, adam = proving_inputs(prefix)
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
    return ns, work, cases


def main() -> None:
    ns, work, cases = diff_pairs()
    rows = []
    for label, a, b in cases:
        r = subprocess.run([sys.executable, "-c", PROBE, a, b, str(ROUNDS), "cold" if COLD else "warm"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(r.stderr)
        doc = json.loads(r.stdout.strip().splitlines()[-1])
        ratios = sorted(d / f for d, f in zip(doc["diffs"], doc["floors"], strict=True))
        rows.append((label, (dir_bytes(a) + dir_bytes(b)) / 1e9, doc["first"], min(doc["diffs"]), min(doc["floors"]),
                     ratios[len(ratios) // 2], doc["rss"], doc["equal"], doc["tensors"]))
    print(f"{'case':<30}{'both GB':>8}{'1st s':>7}{'diff s':>8}{'floor s':>9}{'best/best':>10}{'median':>8}"
          f"{'peak RSS MiB':>14}{'equal':>7}{'tensors':>9}")
    for label, gb, first, secs, floor, median, rss, equal, n in rows:
        print(f"{label:<30}{gb:>8.2f}{first:>7.2f}{secs:>8.2f}{floor:>9.2f}{secs / floor:>10.2f}{median:>8.2f}"
              f"{rss:>14.0f}{str(equal):>7}{n:>9}")
    print(f"1st s: the first diff_checkpoints in a fresh process after torch's import (with the lazy imports it "
          f"triggers); then {ROUNDS} rounds, each reading every byte of both checkpoints once with plain file I/O (the "
          f"floor: the fastest of 1, 4 and 16 MiB reads; "
          f"{'each timing from disk, the pages dropped first' if COLD else 'page cache warm, as for diff'}) and then "
          f"diffing them: diff s and floor s are the best of the rounds, "
          f"best/best their ratio, median the median of the rounds' own diff/floor ratios (each round's two "
          f"timings share the box's load of the moment); peak RSS: VmHWM of the probe process.")
    if not ns.keep and not ns.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

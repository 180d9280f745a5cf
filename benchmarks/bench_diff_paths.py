"""What diff's two fast paths cost, alternating in one process: the mapped comparison against the block reads it
replaces, and a torch_dist chunk blob opened with the struct zip reader against zipfile.

On bench_diff.py's checkpoint pairs (built in --work once). For each pair, rounds alternate the order of the two ways
(so both share the box's load of the moment): warm (page cache as left by the previous diff) and, with
BENCH_DIFF_COLD=1, from disk (every file's pages dropped with posix_fadvise(DONTNEED) before each diff).

Usage: python benchmarks/bench_diff_paths.py [--work DIR] [--keep]
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys

from bench_diff import diff_pairs

PROBE = ("import json, os, sys, time, torch, zipfile\n"
         "from megatron_preflight.prove import diff as D, lockstep as L\n"
         "a, b, rounds, cold = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == 'cold'\n"
         "def evict():\n"
         "    for root in (a, b) if cold else ():\n"
         "        for dp, _, fs in os.walk(root):\n"
         "            for f in fs:\n"
         "                fd = os.open(os.path.join(dp, f), os.O_RDONLY)\n"
         "                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)\n"
         "init = L.LockstepReader.__init__\n"
         "def reads_only(self, *args, **kw):\n"
         "    init(self, *args, **kw); self._maps = None\n"
         "out = {'mapped': [], 'read': []}\n"
         "D.diff_checkpoints(a, b)\n"
         "for r in range(rounds):\n"
         "    for way in ('mapped', 'read') if r % 2 else ('read', 'mapped'):\n"
         "        L.LockstepReader.__init__ = init if way == 'mapped' else reads_only\n"
         "        evict(); t = time.perf_counter(); D.diff_checkpoints(a, b)\n"
         "        out[way].append(time.perf_counter() - t)\n"
         "print(json.dumps(out))\n")

BLOBS = ("import json, os, sys, time, zipfile\n"
         "from megatron_preflight.layout.dist import read_dcp_metadata\n"
         "from megatron_preflight import torch_file\n"
         "it = [os.path.join(sys.argv[1], d) for d in os.listdir(sys.argv[1]) if d.startswith('iter_')][0]\n"
         "blobs = [(os.path.join(it, v.relative_path), v.offset, v.length)\n"
         "         for v in read_dcp_metadata(it).storage_data.values()]\n"
         "maps = {p: torch_file.map_file(p) for p in {p for p, _, _ in blobs}}\n"
         "def open_all():\n"
         "    t = time.perf_counter()\n"
         "    for p, off, n in blobs:\n"
         "        f = torch_file.TorchFile(p, window=(off, n), mapping=maps[p]); f.load_metadata()\n"
         "    return (time.perf_counter() - t) / len(blobs)\n"
         "fast = torch_file.read_directory\n"
         "out = {'struct': [], 'zipfile': []}\n"
         "for r in range(7):\n"
         "    torch_file.read_directory = fast; out['struct'].append(open_all())\n"
         "    torch_file.read_directory = lambda read, size: None; out['zipfile'].append(open_all())\n"
         "print(json.dumps({'blobs': len(blobs), **out}))\n")


def _run(code: str, *args: str) -> dict:
    import json

    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ns, work, cases = diff_pairs()
    cold = os.environ.get("BENCH_DIFF_COLD") == "1"
    rounds = 4 if cold else 10
    print(f"{'case':<30}{'mapped s':>10}{'read s':>9}{'read/mapped':>13}   (medians of {rounds} diffs each, "
          f"{'from disk' if cold else 'page cache warm'})")
    for label, a, b in cases:
        doc = _run(PROBE, a, b, str(rounds), "cold" if cold else "warm")
        m, r = statistics.median(doc["mapped"]), statistics.median(doc["read"])
        print(f"{label:<30}{m:>10.3f}{r:>9.3f}{r / m:>13.2f}")
    dist = [b for _, _, b in cases if b.endswith("_dist")][0]
    doc = _run(BLOBS, dist)
    s, z = min(doc["struct"]), min(doc["zipfile"])
    print(f"\ntorch_dist chunk blob opened (zip directory + pickle), {doc['blobs']} blobs, best of 7: "
          f"struct {s * 1e6:.0f} us, zipfile {z * 1e6:.0f} us ({z / s:.1f}x)")
    if not ns.keep and not ns.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

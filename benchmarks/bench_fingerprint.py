"""``reshard --fingerprint`` (the output hashed as the writer streams it) against the reshard alone and against the
reshard followed by ``megatron-preflight fingerprint`` of its output (reading it back), on ~1 GB checkpoints.

Uses the checkpoints of bench_diff.py (made once in --work: dense GPT, 16 layers, hidden 1024, fp32, TP2, ~1.0 GB;
4 layers with the plain optimizer's Adam state, ~1.3 GB). Each reshard runs in a fresh process, one worker.

Usage: python benchmarks/bench_fingerprint.py [--work DIR] [--keep]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

from bench_reshard import dir_bytes, proving_inputs, run_case


def _timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(r.stderr)
    return time.perf_counter() - t0


def main() -> None:
    ns, work, dense, adam = proving_inputs("bench_fingerprint_")
    rows = []
    for label, src, flags in (("dense TP2->TP1", dense, ["--tp", "1"]),
                              ("dense+Adam TP2->TP1", adam, ["--tp", "1"]),
                              ("dense TP2->torch_dist", dense, ["--ckpt-format", "torch_dist"])):
        times = []
        for mode in ("plain", "streamed", "read back"):
            out = os.path.join(work, "fp_out")
            shutil.rmtree(out, ignore_errors=True)
            secs, _ = run_case(src, out, flags + (["--fingerprint"] if mode == "streamed" else []))
            if mode == "read back":
                secs += _timed([sys.executable, "-m", "megatron_preflight", "fingerprint", out])
            times.append(secs)
        rows.append((label, dir_bytes(src) / 1e9, *times))
        shutil.rmtree(os.path.join(work, "fp_out"), ignore_errors=True)
    print(f"{'case':<24}{'src GB':>8}{'reshard s':>11}{'+streamed s':>13}{'+read back s':>14}{'streamed cost':>15}"
          f"{'read-back cost':>16}")
    for label, gb, plain, streamed, back in rows:
        print(f"{label:<24}{gb:>8.2f}{plain:>11.2f}{streamed:>13.2f}{back:>14.2f}{streamed / plain - 1:>14.0%}"
              f"{back / plain - 1:>16.0%}")
    print("reshard s: `megatron-preflight reshard` in a fresh process, its output fsynced; +streamed: the same with "
          "--fingerprint (hashed as written); +read back: the reshard, then `megatron-preflight fingerprint` of the "
          "output (a second process that reads it all).")
    if not ns.keep and not ns.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Per-piece cost of an MoE reshard: the DeepSeek-V3 structure narrowed 64x with 32 experts (tests/helpers/
synthetic_dsv3.py: MLA, 3 dense + 58 MoE layers, TE-grouped experts, a shared expert, MTP, uneven stages), saved at
PP4 EP8 with its distributed optimizer (~0.5 GB, ~2.3 * 10^4 model tensors, 32 shard dirs), resharded to PP2 EP4 by
``megatron-preflight reshard`` in a fresh process (interpreter and imports included), median of N. At this size the
bytes are few and the time is what the tool spends per piece (planning, replica checks, master checks, reading,
pickling, writing) — what a real 256-expert model pays ~10^5 times.

Usage: python benchmarks/bench_moe_reshard.py [--work DIR] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from tests.helpers.synthetic_dsv3 import DSV3, write_legacy  # noqa: E402 - the repo root first

SMALL = dict(scale=64, vocab=1024, experts=32)


def _flags(m: DSV3) -> list[str]:
    return [f for f in m.flags() if f not in ("--no-load-optim", "--no-load-rng")] + [
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--no-load-rng"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", help="where the checkpoint is written (kept); default: a temp dir")
    ap.add_argument("--repeat", type=int, default=3)
    ns = ap.parse_args()
    work = ns.work or tempfile.mkdtemp(prefix="bench_moe_reshard_")
    src = os.path.join(work, "pp4ep8")
    if not os.path.isdir(src):
        write_legacy(src, DSV3(pp=4, ep=8, **SMALL), hollow=False, optimizer=True)
    flags = _flags(DSV3(pp=2, ep=4, first_stage_layers=30, last_stage_layers=None, **SMALL))
    out = os.path.join(work, "pp2ep4")
    walls = []
    for _ in range(ns.repeat):
        shutil.rmtree(out, ignore_errors=True)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", src, out, "--no-progress", "--",
                        *flags], check=True, stdout=subprocess.DEVNULL)
        walls.append(time.perf_counter() - start)
    shutil.rmtree(out, ignore_errors=True)
    print(f"{'reshard':<52} {'median s':>9} {'runs':>24}")
    print(f"{'DeepSeek-V3 / 64, 32 experts, PP4 EP8 -> PP2 EP4 + dist-opt':<52} {statistics.median(walls):>9.2f} "
          f"{' '.join(f'{w:.2f}' for w in walls):>24}")
    if not ns.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

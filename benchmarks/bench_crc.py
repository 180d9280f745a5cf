"""What checking every record's CRC-32 costs a reshard: the same TP2 -> TP1 reshard of the ~1.0 GB dense checkpoint of
bench_reshard.py, in this process, with the check off, with zlib's CRC-32 and with ISA-L's (the default where `isal`
is installed). Prints, per mode, the median and minimum wall time and the median CPU time of --runs runs (interleaved,
so background noise hits every mode alike; on a busy 2-core box the wall time varies by 2x, the CPU time much less),
and the CPU time each CRC alone takes over the source files.

Usage: python benchmarks/bench_crc.py [--work DIR] [--keep] [--runs N]
"""

from __future__ import annotations

import argparse
import glob
import mmap
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from typing import Any

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from bench_reshard import make_checkpoint  # noqa: E402

import megatron_preflight.reshard.sources.files as source_files  # noqa: E402
from megatron_preflight import crc  # noqa: E402
from megatron_preflight.reshard import TargetLayout, write_resharded  # noqa: E402

MODES = {"off": (False, None), "zlib": (True, zlib.crc32), "isal": (True, crc._fastest()[1])}


def crc_seconds(src: str, fn: Any) -> tuple[float, int]:
    """CPU seconds of ``fn`` over every source file (mapped, as the readers do) and the bytes it covered."""
    total, started = 0, time.process_time()
    for path in glob.glob(f"{src}/iter_*/mp_rank_*/*.pt"):
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m, memoryview(m) as v:
            fn(v)
            total += len(v)
    return time.process_time() - started, total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--runs", type=int, default=5)
    ns = ap.parse_args()
    work = ns.work or tempfile.mkdtemp(prefix="bench_crc_")
    src = f"{work}/dense_tp2"
    try:
        if not glob.glob(f"{src}/iter_*"):
            make_checkpoint(src, layers=16, tp=2, ep=1, moe=None)
        if crc.implementation() != "isal":
            del MODES["isal"]
        original, fastest = source_files.SourceFiles.__init__, crc._chosen[0]
        wall: dict[str, list[float]] = {m: [] for m in MODES}
        cpu: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(ns.runs):
            for mode, (on, fn) in MODES.items():
                source_files.SourceFiles.__init__ = (  # every reader the reshard opens, in this mode
                    lambda self, iter_dir, trust=False, crc=None, _on=on: original(self, iter_dir, trust=trust,
                                                                                   crc=_on))
                crc._chosen[:] = [(mode, fn or fastest[1])]
                out = f"{work}/out"
                shutil.rmtree(out, ignore_errors=True)
                started, started_cpu = time.perf_counter(), time.process_time()
                write_resharded(src, out, TargetLayout(tp=1), workers=1)
                wall[mode].append(time.perf_counter() - started)
                cpu[mode].append(time.process_time() - started_cpu)
        source_files.SourceFiles.__init__, crc._chosen[:] = original, [fastest]
        base_wall, base_cpu = statistics.median(wall["off"]), statistics.median(cpu["off"])
        nbytes = crc_seconds(src, zlib.crc32)[1]
        print(f"{'CRC-32':<6} {'wall median':>11} {'min':>6} {'vs off':>7} {'CPU median':>11} {'vs off':>7} "
              f"{'CRC alone':>10}   ({ns.runs} runs, TP2 -> TP1, {nbytes / 2**30:.2f} GiB read)")
        for mode, (_on, fn) in MODES.items():
            alone = f"{crc_seconds(src, fn)[0]:.2f} s" if fn else "-"
            w, c = statistics.median(wall[mode]), statistics.median(cpu[mode])
            print(f"{mode:<6} {w:>10.2f}s {min(wall[mode]):>5.2f}s {100 * (w / base_wall - 1):>+6.1f}% "
                  f"{c:>10.2f}s {100 * (c / base_cpu - 1):>+6.1f}% {alone:>10}")
    finally:
        if not ns.keep and not ns.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

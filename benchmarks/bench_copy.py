"""The data path beside a plain durable copy of the same bytes: ``reshard`` (and ``reshard --verify``, and the
in-memory job-start path) against ``cp -r SRC DST && sync``, in the same minutes, warm page cache, median of N.

Rows, each a fresh process (interpreter and imports included), interleaved per repeat so background noise hits every
row alike:
  copy     ``cp -r CKPT DST && sync`` — the floor of an offline reshard (it reads and writes each byte once too);
  reshard  ``megatron-preflight reshard CKPT DST <flags>`` (it fsyncs its output; a ``sync`` follows, as for cp);
  verify   the same with ``--verify`` (each written file read back and compared);
  job      the in-memory path of a job start: ``build_rank_state_dict`` of rank 0 at the target layout (no file
           written), timed inside the process after ``import torch`` (a Megatron job has torch loaded before its
           load), beside reading the source files into fresh memory (timed the same way) — its floor: a state dict's
           bytes land in new pages, each read once.

Python's bytecode cache is on for the tool's processes (a temp PYTHONPYCACHEPREFIX, filled by an untimed first run),
as in an installed package, whatever PYTHONDONTWRITEBYTECODE says.

The checkpoint: any legacy or torch_dist checkpoint; the issue's is the ~1.3 GB TP2 one with Adam state written by
Megatron-LM's pretrain_gpt.py (its command is in bench_hf_export.py's docstring). ``--make-gb N`` writes a synthetic
TP2 legacy checkpoint with Adam state of about N GB instead (benchmarks/bench_reshard.make_checkpoint: random values,
Megatron's key names and file layout).

``--tmpfs DIR`` (a directory on tmpfs, e.g. /dev/shm) runs the copy and reshard rows a second time writing there:
on tmpfs no disk is involved, so that ratio is the tool's CPU path against ``cp``'s (the page cache is the file; the
writer goes through it, buffered), where the first is the disk's (the writer uses direct I/O where the file system
supports it: reshard/targets/output_file.py). Both ratios and the throughput (GiB/s) are printed.

Usage: python benchmarks/bench_copy.py [CKPT] [--make-gb 5] [--flags "--tp 1"] [--repeat 3] [--work DIR]
       [--rows copy,reshard,verify,job] [--tmpfs /dev/shm]
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from hf_dirs import timed  # noqa: E402

JOB = """
import sys, time
import torch  # (loaded in a Megatron job before its checkpoint load: not the plugin's time)
t0 = time.perf_counter()
from megatron_preflight.reshard import TargetLayout, build_rank_state_dict
src, tp, pp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sd = build_rank_state_dict(src, TargetLayout(tp=tp, pp=pp), 0)
print("job seconds", time.perf_counter() - t0)
"""

READ = """
import os, sys, time
import numpy as np
t0 = time.perf_counter()
held = []
for path in sys.argv[1:]:
    buf = np.empty(os.path.getsize(path), np.uint8)
    with open(path, "rb", buffering=0) as fh:
        fh.readinto(memoryview(buf))
    held.append(buf)
print("job seconds", time.perf_counter() - t0)
"""


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def source_files(path: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)


def warm(path: str) -> None:
    for f in source_files(path):
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


def make(root: str, gb: float) -> None:
    from bench_reshard import make_checkpoint  # (torch: only to write the synthetic checkpoint)

    # one Adam layer of bench_reshard's shape is ~0.16 GB of weights + moments at TP2 (both shards)
    make_checkpoint(root, layers=max(1, round((gb - 0.6) / 0.151)), tp=2, ep=1, moe=None, adam=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", nargs="?")
    ap.add_argument("--make-gb", type=float, help="write a synthetic TP2 checkpoint with Adam state of ~N GB")
    ap.add_argument("--flags", default="--tp 1", help="the reshard's layout flags (default: --tp 1)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--work", help="scratch dir on the same file system (default: a temp dir)")
    ap.add_argument("--rows", default="copy,reshard,verify,job")
    ap.add_argument("--tmpfs", help="a directory on tmpfs: the copy and reshard rows written there too")
    ns = ap.parse_args()
    work = ns.work or tempfile.mkdtemp(prefix="bench_copy_")
    os.makedirs(work, exist_ok=True)
    src = ns.checkpoint
    if src is None:
        if not ns.make_gb:
            raise SystemExit("give a checkpoint, or --make-gb N")
        src = os.path.join(work, f"synthetic_{ns.make_gb:g}gb")
        if not os.path.isdir(src):
            make(src, ns.make_gb)
    flags = shlex.split(ns.flags)
    tp = int(flags[flags.index("--tp") + 1]) if "--tp" in flags else 1
    pp = int(flags[flags.index("--pp") + 1]) if "--pp" in flags else 1
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONPYCACHEPREFIX=os.path.join(work, "pycache"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    tool = [sys.executable, "-m", "megatron_preflight.cli.main"]
    files = source_files(src)
    rows = ns.rows.split(",")
    places = [("disk", work)] + ([("tmpfs", ns.tmpfs)] if ns.tmpfs else [])

    def commands(dst: str) -> dict[str, list[str]]:
        return {
            "copy": ["sh", "-c", f"cp -r {shlex.quote(src)} {shlex.quote(dst)} && sync"],
            "reshard": ["sh", "-c", shlex.join([*tool, "reshard", src, dst, *flags, "--no-progress"]) + " && sync"],
            "verify": ["sh", "-c", shlex.join([*tool, "reshard", src, dst, *flags, "--no-progress", "--verify"])
                       + " && sync"],
            "job": [sys.executable, "-c", JOB, src, str(tp), str(pp)],
            "read": [sys.executable, "-c", READ, *files],
        }

    order = [("disk", r) for r in ("copy", "reshard", "verify") if r in rows]
    order += [("tmpfs", r) for r in ("copy", "reshard") if r in rows and ns.tmpfs]
    order += [("disk", r) for r in ("read", "job") if "job" in rows]
    warm(src)
    subprocess.run([*tool, "inspect", src], env=env, capture_output=True, check=False)  # (bytecode cached)
    subprocess.run([sys.executable, "-c", "import megatron_preflight.reshard.resharder"], env=env, check=False)
    got: dict[tuple[str, str], list[tuple[float, float]]] = {o: [] for o in order}
    for _ in range(ns.repeat):
        for where, r in order:
            dst = os.path.join(dict(places)[where], "out")
            shutil.rmtree(dst, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            wall, rss, rc, out = timed(commands(dst)[r], env=env)
            if rc != 0:
                raise SystemExit(f"{r} failed ({rc}):\n{out[-3000:]}")
            if r in ("job", "read"):
                wall = float(out.split("job seconds ")[1].split()[0])
            got[(where, r)].append((wall, rss))
    for _, place in places:
        shutil.rmtree(os.path.join(place, "out"), ignore_errors=True)
    size = dir_bytes(src)

    def median(key: tuple[str, str]) -> float | None:
        return statistics.median(w for w, _ in got[key]) if key in got else None

    print(f"{src}: {size / 2**30:.2f} GiB in {len(files)} files; reshard flags: {' '.join(flags)}; "
          f"median of {ns.repeat}, fresh processes, warm page cache, same minutes")
    labels = {"copy": "cp -r SRC DST && sync", "reshard": "reshard (fsynced)", "verify": "reshard --verify",
              "read": "read SRC into fresh memory", "job": "job start: rank 0's state dict"}
    print(f"{'written to':<12}{'row':<34}{'wall s':>8}{'GiB/s':>8}{'x floor':>9}{'peak RSS MiB':>14}")
    for where, r in order:
        wall = median((where, r))
        assert wall is not None
        floor = median(("disk", "read")) if r in ("read", "job") else median((where, "copy"))
        ratio = f"{wall / floor:>9.2f}" if floor else f"{'':>9}"
        place = where if r not in ("read", "job") else "memory"
        print(f"{place:<12}{labels[r]:<34}{wall:>8.2f}{size / 2**30 / wall:>8.2f}{ratio}"
              f"{max(m for _, m in got[(where, r)]):>14.0f}")
    print("x floor: reshard rows against the durable copy to the same place, the job row against reading the source "
          "once.")
    if not ns.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

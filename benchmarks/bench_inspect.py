"""Inspection cost vs checkpoint size: a legacy checkpoint with the same keys at 1x and 100x the bytes.

Prints a table: bytes on disk, wall seconds of `discover()` (median of 5), and bytes read from the files.
Usage: python benchmarks/bench_inspect.py [--big-mb 1000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from megatron_preflight.layout.discover import discover


def write(root: str, hidden: int, layers: int = 8, tp: int = 2) -> int:
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("1")
    import argparse as ap

    for r in range(tp):
        d = os.path.join(root, "iter_0000001", f"mp_rank_{r:02d}")
        os.makedirs(d, exist_ok=True)
        model = {}
        for i in range(layers):
            p = f"decoder.layers.{i}."
            model[p + "self_attention.linear_qkv.weight"] = torch.randn(3 * hidden // tp, hidden)
            model[p + "mlp.linear_fc1.weight"] = torch.randn(4 * hidden // tp, hidden)
            model[p + "mlp.linear_fc2.weight"] = torch.randn(hidden, 4 * hidden // tp)
        args = ap.Namespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                            expert_model_parallel_size=1, num_layers=layers, hidden_size=hidden)
        torch.save({"args": args, "iteration": 1, "checkpoint_version": 3.0, "model": model},
                   os.path.join(d, "model_optim_rng.pt"))
    return sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(root) for f in fs)


def io_read_bytes() -> int:
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--big-mb", type=int, default=1000)
    ns = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # 8 layers x 11 h^2 floats x 4 B: h=96 ~ 3 MB ... choose h for ~1/100 and ~1x of --big-mb
        for label, mb in (("small", ns.big_mb / 100), ("big", ns.big_mb)):
            hidden = int((mb * 2**20 / (8 * 11 * 4)) ** 0.5)
            root = os.path.join(tmp, label)
            nbytes = write(root, hidden)
            times, reads = [], []
            for _ in range(5):
                r0, t0 = io_read_bytes(), time.perf_counter()
                layout = discover(root)
                times.append(time.perf_counter() - t0)
                reads.append(io_read_bytes() - r0)
                assert layout.ok, layout.problems
            rows.append((label, nbytes, statistics.median(times), statistics.median(reads)))
    print(f"{'case':<8}{'bytes on disk':>16}{'inspect s':>12}{'bytes read':>14}")
    for label, nbytes, t, r in rows:
        print(f"{label:<8}{nbytes:>16,}{t:>12.4f}{r:>14,}")
    print(f"size ratio {rows[1][1] / rows[0][1]:.0f}x, time ratio {rows[1][2] / rows[0][2]:.2f}x")


if __name__ == "__main__":
    main()

"""``reshard --dry-run``'s predicted peak memory beside the measured peak of the same reshard, for every source and
target format: a synthetic TP2 legacy checkpoint with Adam state (benchmarks/bench_reshard.make_checkpoint), its
torch_dist and fsdp_dtensor forms, and a Mixtral-shaped bf16 Hugging Face model (benchmarks/bench_hf_import.py).

Each row: the dry run (its JSON prediction) and the run itself, each a fresh process; measured = the run's own
"peak RSS" line (every process it started, as the prediction counts them). The target is within 1.5x either way.

Usage: python benchmarks/bench_dry_run.py [--work DIR] [--layers 12] [--workers 1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

CLI = [sys.executable, "-m", "megatron_preflight"]


def cli(*args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    r = subprocess.run(CLI + list(args), capture_output=True, text=True, env=env, timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(args[:4])} failed:\n{(r.stdout + r.stderr)[-3000:]}")
    return r.stdout + r.stderr


def row(src: str, dst: str, flags: list[str], workers: int) -> tuple[float, float]:
    """(predicted MiB, measured MiB) of ``reshard src dst flags``."""
    common = ["--no-progress", "--workers", str(workers), *flags]
    predicted = json.loads(cli("reshard", src, dst, "--dry-run", "--json", *common))["peak_rss_bytes"] / 2**20
    out = cli("reshard", src, dst, *common)
    measured = float(re.search(r"peak RSS (\d+) MiB", out).group(1))
    return predicted, measured


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work")
    ap.add_argument("--layers", type=int, default=12, help="layers of the synthetic GPT (~45 MB of weights each)")
    ap.add_argument("--workers", type=int, default=1)
    ns = ap.parse_args()
    from bench_hf_import import model_flags, write_model
    from bench_reshard import make_checkpoint

    work = ns.work or tempfile.mkdtemp(prefix="bench_dry_run_")
    legacy = os.path.join(work, "legacy_tp2")
    if not os.path.exists(legacy):
        make_checkpoint(legacy, layers=ns.layers, tp=2, ep=1, moe=None, adam=True)
        with open(os.path.join(legacy, "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write("1")
    hf = os.path.join(work, "mixtral_hf")
    if not os.path.exists(hf):
        write_model(hf)
    out = os.path.join(work, "out")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    hf_run = ["--", *model_flags(hf), "--tokenizer-type", "NullTokenizer", "--vocab-size", "31999",
              "--make-vocab-size-divisible-by", "128"]
    cases = [  # (name, source, its output, flags)
        ("legacy TP2 -> legacy TP1", legacy, "l_tp1", ["--tp", "1"]),
        ("legacy TP2 -> torch_dist TP1", legacy, "d_tp1", ["--tp", "1", "--ckpt-format", "torch_dist"]),
        ("torch_dist -> legacy TP2", "d_tp1", "l_from_d", ["--tp", "2"]),
        ("legacy TP2 -> fsdp_dtensor", legacy, "f", ["--ckpt-format", "fsdp_dtensor"]),
        ("HF (bf16) -> legacy TP2 EP2", hf, "hf_l", [*hf_run, "--tensor-model-parallel-size", "2",
                                                       "--expert-model-parallel-size", "2"]),
        ("HF (bf16) -> torch_dist", hf, "hf_d", ["--ckpt-format", "torch_dist", *hf_run]),
        ("legacy (from HF) -> HF", "hf_l", "hf_back", ["--ckpt-format", "hf"]),
    ]
    print(f"{'reshard':<32} {'predicted MiB':>14} {'measured MiB':>13} {'ratio':>6}")
    for name, src, dst, flags in cases:
        src = src if os.path.isabs(src) else os.path.join(out, src)
        try:
            predicted, measured = row(src, os.path.join(out, dst), flags, ns.workers)
        except SystemExit as exc:
            print(f"{name:<32} {'-':>14} {'-':>13} {'-':>6}  ({str(exc).splitlines()[-1][:100]})")
            continue
        ratio = max(predicted, measured) / max(min(predicted, measured), 1e-9)
        print(f"{name:<32} {predicted:>14.0f} {measured:>13.0f} {ratio:>6.2f}{'' if ratio <= 1.5 else '  > 1.5x'}",
              flush=True)
    if not ns.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

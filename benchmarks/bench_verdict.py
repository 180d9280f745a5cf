"""The verdict's cost against `import torch`, measured side by side in fresh interpreters (issue 34: goal <= 0.1x).

    python benchmarks/bench_verdict.py [--repeat 7]

Each row runs its command in a new Python process, interleaved with `python -c "import torch"` (the same machine state
for both), and prints the median wall seconds of each and their ratio. Both run with compiled bytecode, as an
installed package does (a cache under a temp PYTHONPYCACHEPREFIX, filled by an untimed first run; this matters where
PYTHONDONTWRITEBYTECODE is set: compiling the package's sources every run costs ~0.17 s). Checkpoints: real Megatron-LM fixtures (a MoE
legacy checkpoint at TP2·PP2·EP2, its torch_dist twin, a distributed-optimizer one, a HybridModel one).
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "tests", "fixtures", "megatron-lm")
MODEL = ["--num-layers", "4", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
         "--vocab-size", "100"]
CASES = [
    ("check moe tp2pp2ep2 legacy", ["check", "moe_shared_tp2pp2ep2_torch", "--json", "--", *MODEL, "--num-experts", "4"]),
    ("check moe tp2pp2ep2 torch_dist", ["check", "moe_shared_tp2pp2ep2_torch_dist", "--json", "--", *MODEL,
                                        "--num-experts", "4"]),
    ("check distopt tp2dp2 -> tp1", ["check", "distopt_tp2dp2_torch", "--json", "--", *MODEL,
                                     "--use-distributed-optimizer"]),
    ("inspect hybrid tp2", ["inspect", "hyb_tp2_torch", "--json"]),
]


ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
ENV.update(PYTHONWARNINGS="ignore", PYTHONPYCACHEPREFIX=tempfile.mkdtemp(prefix="bench_verdict_pyc_"))
atexit.register(shutil.rmtree, ENV["PYTHONPYCACHEPREFIX"], True)


def _wall(cmd: list[str]) -> float:
    env = ENV
    t = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=False)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=7)
    n = ap.parse_args().repeat
    torch_cmd = [sys.executable, "-c", "import torch"]
    print(f"{'command':34} {'verdict s':>10} {'import torch s':>15} {'ratio':>7}")
    for label, args in CASES:
        args = [os.path.join(FIXTURES, a) if i == 1 else a for i, a in enumerate(args)]
        cmd = [sys.executable, "-m", "megatron_preflight", *args]
        _wall(cmd), _wall(torch_cmd)  # untimed: fills the bytecode cache
        ours, theirs = [], []
        for _ in range(n):  # interleaved: both see the same load
            ours.append(_wall(cmd))
            theirs.append(_wall(torch_cmd))
        a, b = statistics.median(ours), statistics.median(theirs)
        print(f"{label:34} {a:10.3f} {b:15.3f} {a / b:7.3f}")


if __name__ == "__main__":
    main()

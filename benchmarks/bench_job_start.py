"""Job start with real Megatron-LM: wall time from process start to the end of the checkpoint load.

Three ways to start the same job (the same checkpoint, the same world size), and a control:
  (a) Megatron's own load of the legacy checkpoint at the layout that saved it (no plugin),
  (a2) control: Megatron's own load of a legacy checkpoint of the same model saved at the run's layout (TP1; no
       plugin): the same model build as (b) and (c), so (b) - (a2) is what the plugin costs,
  (b) ``--preflight auto`` loading the legacy checkpoint at another layout (the in-memory resharder),
  (c) Megatron's own load-time reshard of the checkpoint's torch_dist twin to that layout (no plugin),
  (d) as (b) with ``--preflight verify`` (the loaded model proved against the fingerprints stored beside the
      checkpoint): (d) - (b) is what verify adds.

"End of the load" is the moment rank 0 prints "after model, optimizer, and learning rate scheduler are built" (the
load happens inside that step); the job is stopped there. Where (b)'s time goes comes from the plugin's own lines on
rank 0: the check (before the model is built), Megatron's load_checkpoint through the resharder, and inside it the
shared index (rank 0 sends the layout, each rank indexes it) and reading + building rank 0's state.

Needs the CPU runner of ../shared/tools/megatron-lm-cpu (a Megatron-LM checkout and its venv with this project
installed):

    source ../shared/tools/megatron-lm-cpu/env.sh
    python benchmarks/bench_job_start.py --megatron $MLM_ROOT --python $MLM_VENV/bin/python \\
        --pythonpath ../shared/tools/megatron-lm-cpu/shim --extra "$CPUFLAGS"
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(os.path.dirname(HERE), "tests", "fixtures", "megatron-lm")
sys.path.insert(0, os.path.dirname(HERE))

from tests.helpers.tiny import MODEL_FLAGS  # noqa: E402

TINY = MODEL_FLAGS + ("--hidden-dropout 0 --attention-dropout 0 --micro-batch-size 1 --global-batch-size 2 --lr 1e-4 "
                      "--min-lr 1e-5 --lr-decay-style constant --mock-data --seed 1234 --log-interval 1 "
                      "--eval-iters 0 --eval-interval 1000 --train-iters 4 "
                      "--use-checkpoint-opt-param-scheduler").split()
DONE = "after model, optimizer, and learning rate scheduler are built"


def start(ns: argparse.Namespace, ckpt: str, flags: list[str], plugin: bool, port: int) -> dict:
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ns.pythonpath, ns.megatron, env.get("PYTHONPATH", "")) if p)
    env["PATH"] = os.path.dirname(ns.python) + os.pathsep + env.get("PATH", "")
    launch = ["-m", "megatron_preflight.run", "pretrain_gpt.py"] if plugin else ["pretrain_gpt.py"]
    cmd = [ns.python, "-m", "torch.distributed.run", "--nproc-per-node", str(ns.world), "--master-port", str(port),
           *launch, *TINY, *ns.extra.split(), "--load", ckpt, *flags]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ns.megatron, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines, loaded = [], None
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if DONE in line:
            loaded = time.monotonic() - t0
            break
    os.killpg(proc.pid, signal.SIGKILL)  # the load is what is measured: stop before training
    proc.wait()
    log = "".join(lines)
    if ns.logs:
        os.makedirs(ns.logs, exist_ok=True)
        with open(os.path.join(ns.logs, f"{port}.log"), "w") as fh:
            fh.write(log)
    if loaded is None:
        raise SystemExit(f"the job did not get past the load:\n{log[-3000:]}")
    check = re.search(r"\(check ([0-9.]+) s on rank 0\)", log)
    load = re.search(r"load_checkpoint ([0-9.]+) s on rank 0, of which the shared index ([0-9.]+) s, reading and "
                     r"building its state ([0-9.]+) s", log)
    init = re.search(r"time to initialize megatron \(seconds\): ([0-9.]+)", log)
    verified = re.search(r"verify: the loaded model equals .*; ([0-9.]+) s on rank 0\)", log)
    return {"wall": loaded, "check": float(check.group(1)) if check else None,
            "load": float(load.group(1)) if load else None, "index": float(load.group(2)) if load else None,
            "build": float(load.group(3)) if load else None, "init": float(init.group(1)) if init else None,
            "verify": float(verified.group(1)) if verified else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--megatron", required=True, help="Megatron-LM work tree")
    p.add_argument("--python", default=sys.executable, help="a Python with Megatron-LM's deps and this project")
    p.add_argument("--pythonpath", default="", help="extra PYTHONPATH entries (the CPU shim)")
    p.add_argument("--extra", default="", help="extra pretrain_gpt.py flags (the CPU flags)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--legacy", default="tp2_torch", help="fixture saved at TP2 (legacy)")
    p.add_argument("--dist", default="tp2_torch_dist", help="its torch_dist twin")
    p.add_argument("--control", default="tp1_torch", help="a legacy checkpoint of the same model saved at TP1")
    p.add_argument("--logs", help="keep each run's log in this dir")
    ns = p.parse_args()
    work = tempfile.mkdtemp(prefix="bench-job-start-")
    try:
        legacy, dist, control = (os.path.join(work, n) for n in ("legacy", "dist", "control"))
        shutil.copytree(os.path.join(FIXTURES, ns.legacy), legacy)
        shutil.copytree(os.path.join(FIXTURES, ns.dist), dist)
        shutil.copytree(os.path.join(FIXTURES, ns.control), control)
        fingerprinted = os.path.join(work, "fingerprinted")
        shutil.copytree(os.path.join(FIXTURES, ns.legacy), fingerprinted)
        subprocess.run([sys.executable, "-m", "megatron_preflight", "fingerprint", fingerprinted], check=True)
        saved = ["--tensor-model-parallel-size", "2", "--ckpt-format", "torch", "--no-load-rng"]
        other = ["--tensor-model-parallel-size", "1", "--no-load-rng"]
        runs = {
            "(a) Megatron, legacy at the saved layout (TP2)": (legacy, saved, False),
            "(b) --preflight auto, legacy resharded in memory to TP1 DP2": (
                legacy, other + ["--ckpt-format", "torch", "--preflight", "auto"], True),
            "(c) Megatron, torch_dist twin resharded at load to TP1 DP2": (
                dist, other + ["--ckpt-format", "torch_dist"], False),
            "(a2) control: Megatron, legacy saved at TP1, loaded at TP1 DP2": (
                control, other + ["--ckpt-format", "torch"], False),
            "(d) --preflight verify: (b), then the load proved": (
                fingerprinted, other + ["--ckpt-format", "torch", "--preflight", "verify"], True),
        }
        results: dict[str, list[dict]] = {k: [] for k in runs}
        port = 29800
        for _ in range(ns.repeats):  # interleaved, so drift in the machine's load hits all three alike
            for name, (ckpt, flags, plugin) in runs.items():
                port += 1
                results[name].append(start(ns, ckpt, flags, plugin, port))
        print(f"Job start, real Megatron-LM pretrain_gpt.py on CPU, world {ns.world}, median of {ns.repeats} "
              f"(checkpoint {ns.legacy} / {ns.dist}, optimizer state loaded)")
        print(f"{'start':<62} {'to end of load s':>16} {'megatron init s':>15} {'check s':>8} "
              f"{'load_checkpoint s':>17} {'index s':>8} {'build s':>8} {'verify s':>8}")
        med = {}
        for name, rs in results.items():
            med[name] = statistics.median(r["wall"] for r in rs)

            def m(key: str, rs: list[dict] = rs) -> str:
                vals = [r[key] for r in rs if r[key] is not None]
                return f"{statistics.median(vals):.2f}" if vals else "-"

            print(f"{name:<62} {med[name]:>16.2f} {m('init'):>15} {m('check'):>8} {m('load'):>17} {m('index'):>8} "
                  f"{m('build'):>8} {m('verify'):>8}")
        a, b, c, a2, d = med.values()
        print(f"(b)/(a) = {b / a:.3f}   (b)/(c) = {b / c:.3f}   (b)/(a2) = {b / a2:.3f}   goal: (b) <= 1.1 x (a) "
              "and (b) <= (c)")
        print(f"verify adds (d) - (b) = {d - b:.2f} s to the job start; goal: at most 10 % of the load")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

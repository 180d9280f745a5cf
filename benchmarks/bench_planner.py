"""The layout planner at scale: ``megatron-preflight plan`` of a DeepSeek-V3-shaped checkpoint for 1,024 GPUs.

Writes (in a temp dir, once) the hollow DeepSeek-V3 671B checkpoint of tests/helpers/synthetic_dsv3.py (61 layers,
3 dense, MLA, 256 TE-grouped experts + a shared one, MTP; real shapes, no bytes) at TP1·PP16·EP64 (1,024 shard dirs),
then runs ``plan`` in a fresh process per repeat for several world sizes and prints: wall seconds, peak RSS, whether
torch was imported, the layouts listed and the top one. Also its torch_dist form (one ``.metadata`` file holds every
tensor's global shape: the planner is bound by reading it).

Usage: python benchmarks/bench_planner.py [--work DIR] [--repeat 3] [--worlds 256,1024] [--torch-dist]
       [--model deepseek-v3|kimi-k2] [--commands inspect,check,plan]
(Kimi K2: the same structure at 1 T parameters, 384 experts, 6 per EP64 rank; --commands: also inspect and check)
Bytecode is cached as in an installed package (a temp PYTHONPYCACHEPREFIX), whatever PYTHONDONTWRITEBYTECODE says.
"first s" (and its peak RSS): the first run after the metadata index (layout/dcp_cache.py, a temp dir here) is emptied:
a torch_dist .metadata read in full, as at the first job start after a save; "wall s": the median of the runs after it.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

# DeepSeek-V3's pre-training batch (15,360 sequences of 4,096 tokens), bf16, the distributed optimizer; the model from
# the checkpoint's saved args
RUN = ["--global-batch-size", "15360", "--micro-batch-size", "1", "--seq-length", "4096", "--bf16",
       "--use-distributed-optimizer"]

PROBE = """
import json, sys, time
t0 = time.perf_counter()


def hwm_mib():  # this process image's peak RSS (getrusage's ru_maxrss keeps the parent's across fork + exec)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


from megatron_preflight.cli.main import main
import contextlib, io
command, path, world, run = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
buf = io.StringIO()
if command == "plan":
    argv = ["plan", path, "--world-size", world, "--device-memory", "80", "--json", "--top", "1", "--check-top", "0",
            "--", *run]
elif command == "check":  # the saved layout at its own world size: the verdict a job start computes
    argv = ["check", path, "--json", "--", "--world-size", world, *run]
else:
    argv = ["inspect", path, "--json"]
with contextlib.redirect_stdout(buf):
    rc = main(argv, process_ends=True)  # (as the program runs it: see cli.main.entry)
doc = json.loads(buf.getvalue())
out = {"rc": rc, "wall": time.perf_counter() - t0, "rss_mib": hwm_mib(), "torch": "torch" in sys.modules}
if command == "plan":
    out.update(planned=doc["seconds"], layouts=doc["layouts"], fitting=doc["fitting"],
               top=doc["candidates"][0] if doc["candidates"] else None)
print(json.dumps(out))
"""


# Python's bytecode cache on, as an installed package has it (where PYTHONDONTWRITEBYTECODE is set, compiling the
# package's sources in every fresh process costs ~0.17 s): a temp cache, filled by an untimed first run
_PYC = tempfile.mkdtemp(prefix="bench_planner_pyc_")
atexit.register(shutil.rmtree, _PYC, True)
# the index of a torch_dist .metadata once read (layout/dcp_cache.py): its own dir here, emptied before each "first"
_INDEX = tempfile.mkdtemp(prefix="bench_planner_index_")
atexit.register(shutil.rmtree, _INDEX, True)
_warm: list[bool] = []


def runs_of(command: str, path: str, world: int, run: list[str], repeat: int) -> tuple[dict, list[dict]]:
    """The first run after the index is emptied (the .metadata read in full), then ``repeat`` runs as they come."""
    run_probe(command, path, world, run)  # (the bytecode cache filled)
    shutil.rmtree(os.path.join(_INDEX, "dcp-index"), ignore_errors=True)
    first = run_probe(command, path, world, run)
    return first, [run_probe(command, path, world, run) for _ in range(repeat)]


def run_probe(command: str, path: str, world: int, run: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONPYCACHEPREFIX=_PYC, MEGATRON_PREFLIGHT_CACHE=_INDEX)
    if not _warm:
        _warm.append(True)
        for c in ("inspect", "check", "plan"):
            subprocess.run([sys.executable, "-c", PROBE, c, path, str(world), *run], capture_output=True, env=env,
                           timeout=600)
    r = subprocess.run([sys.executable, "-c", PROBE, command, path, str(world), *run], capture_output=True,
                       text=True, env=env, timeout=600)
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", help="where the synthetic checkpoint is written (kept); default: a temp dir")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--worlds", default="256,1024,2048")
    ap.add_argument("--torch-dist", action="store_true", help="also the torch_dist form")
    ap.add_argument("--model", choices=("deepseek-v3", "kimi-k2"), default="deepseek-v3",
                    help="the hollow model: DeepSeek-V3 671B, or Kimi K2 1 T (384 experts, 64 heads, 1 dense layer)")
    ap.add_argument("--commands", default="plan",
                    help="comma-separated: inspect, check (the model's own flags at its saved layout, DP4: the "
                         "verdict a job start computes), plan (default: plan)")
    ns = ap.parse_args()
    from tests.helpers.synthetic_dsv3 import DSV3, dist_flags, write_legacy, write_torch_dist

    work = ns.work or tempfile.mkdtemp(prefix="bench_planner_")
    legacy = os.path.join(work, f"{ns.model}_legacy")
    m = DSV3() if ns.model == "deepseek-v3" else DSV3.kimi_k2()
    if not os.path.isdir(legacy):
        write_legacy(legacy, m)
    forms = [("legacy, 1,024 shard dirs", legacy)]
    dist = ""
    if ns.torch_dist:
        dist = os.path.join(work, f"{ns.model}_torch_dist")
        if not os.path.isdir(dist):
            write_torch_dist(dist, m, legacy)
        forms.append(("torch_dist", dist))
    name = "DeepSeek-V3 671B" if ns.model == "deepseek-v3" else "Kimi K2 1T"
    print(f"{name} (hollow, saved at TP{m.tp} PP{m.pp} EP{m.ep}), 80 GiB GPUs, 8 per node, run: "
          f"{' '.join(RUN)}; median of {ns.repeat} fresh processes")
    own = {legacy: m.flags(), **({dist: dist_flags(m.flags(), False)} if ns.torch_dist else {})}
    commands = ns.commands.split(",")
    if "inspect" in commands or "check" in commands:
        print(f"\n{'command':<8} {'checkpoint':<26} {'first s':>7} {'MiB':>5} {'wall s':>7} {'RSS MiB':>8} "
              f"{'torch':>6}  exit")
        for command in (c for c in commands if c != "plan"):
            for label, path in forms:
                first, runs = runs_of(command, path, m.tp * m.pp * m.ep * 4, own[path], ns.repeat)
                print(f"{command:<8} {label:<26} {first['wall']:>7.2f} {first['rss_mib']:>5.0f} "
                      f"{statistics.median(r['wall'] for r in runs):>7.2f} "
                      f"{max(r['rss_mib'] for r in runs):>8.0f} {str(any(r['torch'] for r in runs)):>6}  "
                      f"{runs[0]['rc']}")
    if "plan" not in commands:
        if not ns.work:
            shutil.rmtree(work, ignore_errors=True)
        return
    print(f"\n{'checkpoint':<26} {'world':>6} {'first s':>7} {'wall s':>7} {'plan s':>7} {'RSS MiB':>8} {'torch':>6} "
          f"{'layouts':>8} {'fit':>5}  top layout")
    for label, path in forms:
        for world in (int(w) for w in ns.worlds.split(",")):
            first, runs = runs_of("plan", path, world, RUN, ns.repeat)
            mid = statistics.median(r["wall"] for r in runs)
            top = runs[0]["top"]
            desc = "-" if top is None else (f"TP{top['tp']} PP{top['pp']} EP{top['ep']} ETP{top['etp']} CP{top['cp']} "
                                            f"DP{top['dp']} ({top['load']}, "
                                            f"{top['memory']['total'] / 2**30:.1f} GiB)")
            print(f"{label:<26} {world:>6} {first['wall']:>7.2f} {mid:>7.2f} "
                  f"{statistics.median(r['planned'] for r in runs):>7.2f} "
                  f"{max(r['rss_mib'] for r in runs):>8.0f} {str(any(r['torch'] for r in runs)):>6} "
                  f"{runs[0]['layouts']:>8} {runs[0]['fitting']:>5}  {desc}")
    if not ns.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

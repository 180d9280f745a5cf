"""Scale: the verdict's cost vs shard count, the layout rank 0 broadcasts, what each rank reads in memory, and the
reshard cost prediction against the measured run. Prints one table per part.

  A  `inspect` / `check` wall and peak RSS for 1, 64, 1,024 and 8,192 shard dirs (synthetic checkpoints with
     Megatron-Core's key names and the full state of a real save, hollow tensors: real shapes, no bytes), each in a
     fresh process, against `--all-shards`; and Megatron-LM's own torch_dist fixtures.
  B  the layout payload rank 0 sends (the compact transport vs plain pickle of the full layout) and its broadcast time
     over gloo to 4 processes, for 1,024 and 8,192 shards.
  C  in-memory resharding: per rank, bytes read vs bytes of the state it needs, TP8->TP4, PP16->PP8, EP64->EP32,
     sampled ranks built by 4 processes standing in for ranks (each receives the compact layout, as in the hook).
  D  `reshard --dry-run --json` predictions vs the measured run (bytes read, bytes on disk, peak RSS of the whole
     process tree polled from /proc, seconds) on ~0.3-1 GB checkpoints.
  E  the hook's full layout read before an in-memory reshard at 1,024 and 8,192 shards: rank 0 alone vs every rank
     parsing its share (gloo, 2 and 4 processes).

  F  DeepSeek-V3 671B at its own shape (tests/helpers/synthetic_dsv3.py: 61 layers, 3 dense, MLA, 256 TE-grouped
     experts + a shared one, MTP; hollow) at TP1·PP16·EP64, 1,024 shard dirs: `inspect` / `check` wall and RSS; the
     plan for PP16·EP64 -> PP8·EP32 and -> PP16·EP32 (open, every target rank planned and validated: time, memory,
     tensors); `reshard --dry-run` bytes, files and peak; the in-memory cost per rank `check` reports.

  G  real bytes: an offline reshard of a DeepSeek-V3-width slice (hidden 7168, MLA, a dense layer and an MoE layer
     of 16 routed experts + the shared one, bf16; vocabulary 32,768 so it fits here) PP2·EP2 -> PP1·EP1, one process
     and torchrun with 2, against the I/O floor measured the same way (every source byte read, as many written,
     fsynced); the projection of a full 671B reshard from the measured per-process throughput.

Usage: python benchmarks/bench_scale.py [--work DIR] [--parts ABCDEFG] [--big-shards 8192] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from megatron_preflight.layout import naming  # noqa: E402
from tests.helpers.synthetic import Model, write_legacy  # noqa: E402

MIB = 2**20
# one model (32 layers, 64 experts, hidden 4096) at four layouts
LAYOUTS = {1: (1, 1, 1), 64: (2, 4, 8), 1024: (8, 16, 8), 8192: (8, 16, 64)}


def big_model(tp: int, pp: int, ep: int) -> Model:
    return Model(tp=tp, pp=pp, ep=ep, layers_per_stage=32 // pp, experts=64, hidden=4096, heads=32, ffn=16384,
                 moe_ffn=2048, vocab=128000, seq=4096)


def hollow(work: str, n: int) -> str:
    """The hollow synthetic checkpoint of ``n`` shard dirs under ``work`` (written the first time)."""
    root = os.path.join(work, f"hollow_{n}")
    if not os.path.exists(root):
        write_legacy(root, big_model(*LAYOUTS[n]))
    return root


def run_flags(m: Model) -> list[str]:
    return ["--tensor-model-parallel-size", str(m.tp), "--pipeline-model-parallel-size", str(m.pp),
            "--expert-model-parallel-size", str(m.ep), "--expert-tensor-parallel-size", str(m.tp),
            "--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden), "--num-attention-heads", str(m.heads),
            "--ffn-hidden-size", str(m.ffn), "--num-experts", str(m.num_experts), "--moe-ffn-hidden-size",
            str(m.moe_ffn), "--seq-length", str(m.seq), "--max-position-embeddings", str(m.seq), "--vocab-size",
            str(m.vocab), "--untie-embeddings-and-output-weights", "--transformer-impl", "local",
            "--disable-bias-linear", "--ckpt-format", "torch", "--no-load-optim"]


def run_cli(args: list[str]) -> tuple[float, int, str]:
    """Wall, peak RSS (from the process's own /proc/self/status VmHWM) and stdout of `megatron-preflight ARGS`."""
    probe = ("import sys,runpy\nfrom megatron_preflight.cli.main import main\nrc=main(sys.argv[1:])\nsys.stdout.flush()\n"
             "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0], file=sys.stderr)\n"
             "sys.exit(rc)")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    rss = int(p.stderr.strip().splitlines()[-1]) * 1024
    return wall, rss, p.stdout


def median_run(args: list[str], n: int = 3) -> tuple[float, int, str]:
    runs = sorted((run_cli(args) for _ in range(n)), key=lambda r: r[0])
    return runs[len(runs) // 2]


def part_a(work: str, sizes: list[int]) -> None:
    print("\nA. inspect / check vs shard count (fresh process each; median of 3; `all` = --all-shards, once)")
    print(f"{'shards':>7} {'layout':>14} {'MiB on disk':>11} {'inspect s':>9} {'check s':>8} {'RSS MiB':>8} "
          f"{'parsed':>7} {'inspect --all-shards s':>23}")
    for n in sizes:
        tp, pp, ep = LAYOUTS[n]
        m = big_model(tp, pp, ep)
        root = hollow(work, n)
        disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
        wi, rss, out = median_run(["inspect", root, "--json"])
        layout = json.loads(out)
        assert layout["ok"], layout["problems"]
        wc, rss_c, out_c = median_run(["check", root, "--json", "--", *run_flags(m)])
        assert json.loads(out_c)["verdict"] == "load", out_c[-2000:]
        note = next((x for x in layout["notes"] if x.startswith("sampled: ")), "")
        parsed = int(note.split()[1]) if note else n  # the sample: rank 0's, each stage's first, the last
        wa = run_cli(["inspect", root, "--json", "--all-shards"])[0]
        print(f"{n:>7} {f'TP{tp} PP{pp} EP{ep}':>14} {disk / MIB:>11.1f} {wi:>9.2f} {wc:>8.2f} "
              f"{max(rss, rss_c) / MIB:>8.0f} {parsed:>7} {wa:>23.2f}")
    fixtures = os.path.join(os.path.dirname(HERE), "tests", "fixtures", "megatron-lm")
    rows = []
    for name in ("tp2_torch_dist", "moe_shared_tp2pp2ep2_torch_dist", "distopt_dpr_moe_ep2dp2_torch_dist"):
        wi = median_run(["inspect", os.path.join(fixtures, name)])[0]
        rows.append(f"{name} {wi:.2f} s")
    print("torch_dist (Megatron-LM's own saves), inspect: " + "; ".join(rows))


def part_b(work: str, sizes: list[int]) -> None:
    from megatron_preflight.layout import transport
    from megatron_preflight.layout.discover import discover

    print("\nB. layout payload rank 0 sends, and its broadcast (gloo, 4 processes on this machine)")
    print(f"{'shards':>7} {'read all s':>10} {'full pickle KiB/shard':>22} {'compact KiB/shard':>18} "
          f"{'compact MiB':>12} {'encode s':>9} {'decode s':>9} {'broadcast s':>12}")
    for n in sizes:
        root = hollow(work, n)
        t0 = time.perf_counter()
        layout = discover(root)
        read = time.perf_counter() - t0
        full = len(_full_pickle(layout))
        t0 = time.perf_counter()
        data = transport.dumps(layout)
        enc = time.perf_counter() - t0
        t0 = time.perf_counter()
        transport.loads(data)
        dec = time.perf_counter() - t0
        bcast = broadcast_seconds(data, world=4)
        print(f"{n:>7} {read:>10.1f} {full / n / 1024:>22.1f} {len(data) / n / 1024:>18.2f} {len(data) / MIB:>12.2f} "
              f"{enc:>9.2f} {dec:>9.2f} {bcast:>12.3f}")


def _full_pickle(layout) -> bytes:
    """What was sent before: the whole layout pickled (every shard's args and RNG state), uncompressed."""
    import io
    import pickle

    from megatron_preflight.layout import transport

    buf = io.BytesIO()
    transport._Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(layout)
    return buf.getvalue()


def _bcast_worker(rank: int, world: int, port: int, path: str, q) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    box = [open(path, "rb").read() if rank == 0 else None]
    dist.barrier()
    t0 = time.perf_counter()
    dist.broadcast_object_list(box, src=0)
    dist.barrier()
    q.put((rank, time.perf_counter() - t0, len(box[0])))
    dist.destroy_process_group()


def run_ranks(worker, world: int, *args) -> list[tuple]:
    """``worker(rank, world, port, *args, queue)`` in ``world`` spawned processes (a gloo job); what each put."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, *args, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = [q.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    return results


def broadcast_seconds(data: bytes, world: int = 4) -> float:
    with tempfile.NamedTemporaryFile(delete=False) as fh:
        fh.write(data)
    results = run_ranks(_bcast_worker, world, fh.name)
    os.unlink(fh.name)
    assert all(n == len(data) for _, _, n in results)
    return max(t for _, t, _ in results)


def _shared_worker(rank: int, world: int, port: int, root: str, q) -> None:
    import argparse

    import torch.distributed as dist

    from megatron_preflight.hook.legacy_load import shared_layout

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dist.barrier()
    t0 = time.perf_counter()
    layout = shared_layout(root, None, False, argparse.Namespace(no_load_optim=True, finetune=False))
    dist.barrier()
    q.put((rank, time.perf_counter() - t0, len(layout.shards)))
    dist.destroy_process_group()


def shared_read_seconds(root: str, world: int, alone: bool = False) -> float:
    """Wall seconds of the hook's layout read on ``world`` processes: every rank parses its share, rank 0 gathers,
    runs discovery and sends the layout (``alone``: rank 0 parses every file, as below the threshold)."""
    os.environ["MEGATRON_PREFLIGHT_COOPERATIVE_ABOVE"] = str(10**9 if alone else 32)  # read by the spawned ranks
    return max(t for _, t, _ in run_ranks(_shared_worker, world, root))


def part_e(work: str, sizes: list[int]) -> None:
    from megatron_preflight.layout.discover import discover

    print("\nE. the hook's full layout read before an in-memory reshard (until every rank holds it): rank 0 alone vs "
          "every rank its share")
    print(f"{'shards':>7} {'parse all, 1 proc s':>20} {'rank 0 alone, 4 procs s':>24} {'shared, 2 procs s':>18} "
          f"{'shared, 4 procs s':>18}")
    for n in sizes:
        root = hollow(work, n)
        t0 = time.perf_counter()
        discover(root)
        parse = time.perf_counter() - t0
        print(f"{n:>7} {parse:>20.1f} {shared_read_seconds(root, 4, alone=True):>24.1f} "
              f"{shared_read_seconds(root, 2):>18.1f} {shared_read_seconds(root, 4):>18.1f}")
    print("(this machine has 2 cores: 4 processes share them; on a cluster each rank parses its ~shards/world files)")


CASES_C = [
    ("TP8 -> TP4", (8, 16, 1), {"tp": 4}),
    ("PP16 -> PP8", (8, 16, 1), {"pp": 8}),
    ("EP64 -> EP32", (1, 2, 64), {"ep": 32}),
]


def _rank_worker(payload_path: str, target: dict, names: list[str], q) -> None:
    from megatron_preflight.layout import transport
    from megatron_preflight.reshard.resharder import open_resharder
    from megatron_preflight.reshard.sources.files import SourceFiles
    from megatron_preflight.reshard.target import TargetLayout

    layout = transport.loads(open(payload_path, "rb").read())
    r = open_resharder(layout, TargetLayout(**target))
    for name in names:
        plan = r.plan_for_coords(naming.shard_writers(r.tgt)[name], name)
        files = SourceFiles(r.layout.iter_dir or "")
        try:
            t0 = time.perf_counter()
            state = r.build(plan, files)
            secs = time.perf_counter() - t0
            need = sum(t.numel() * t.element_size() for k, v in state.items() if k.startswith("model")
                       for t in v.values() if hasattr(t, "numel"))
            q.put((name, files.bytes_read, need, len(files._files), secs))
        finally:
            files.close()


def part_c(work: str) -> None:
    import multiprocessing as mp

    from megatron_preflight.layout import transport
    from megatron_preflight.layout.discover import discover
    from megatron_preflight.reshard import cost
    from megatron_preflight.reshard.resharder import open_resharder
    from megatron_preflight.reshard.target import TargetLayout

    print("\nC. in-memory reshard: per rank, bytes read vs bytes of its state dict (sampled ranks, 4 processes)")
    print(f"{'case':<14} {'src shards':>10} {'ranks':>6} {'read MiB/rank':>14} {'needed MiB/rank':>16} "
          f"{'read/needed max':>15} {'predicted=read':>14} {'files/rank':>10} {'payload KiB':>11}")
    for label, (tp, pp, ep), target in CASES_C:
        m = Model(tp=tp, pp=pp, ep=ep, layers_per_stage=max(1, 16 // pp), experts=64 if ep > 1 else 0, hidden=256,
                  heads=16, ffn=1024, moe_ffn=512, vocab=4096, seq=256)
        root = os.path.join(work, f"real_{tp}_{pp}_{ep}")
        if not os.path.exists(root):
            write_legacy(root, m, hollow=False)
        layout = discover(root)
        payload = transport.dumps(layout)
        path = os.path.join(work, "payload.bin")
        with open(path, "wb") as fh:
            fh.write(payload)
        r = open_resharder(layout, TargetLayout(**target))
        names = list(naming.shard_writers(r.tgt))
        sample = names[:: max(1, len(names) // 16)]
        predicted = {c.name: c.bytes_read for c in cost.predict_in_memory(r, bandwidth=1e9, names=sample).ranks}
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=_rank_worker, args=(path, target, sample[i::4], q)) for i in range(4)]
        for p in procs:
            p.start()
        rows = [q.get(timeout=1800) for _ in sample]
        for p in procs:
            p.join()
        read = [x[1] for x in rows]
        need = [x[2] for x in rows]
        exact = all(predicted[x[0]] == x[1] for x in rows)
        ratio = max(a / b for a, b in zip(read, need, strict=True))
        print(f"{label:<14} {len(layout.shards):>10} {len(rows):>6} {max(read) / MIB:>14.2f} {max(need) / MIB:>16.2f} "
              f"{ratio:>15.3f} {str(exact):>14} {max(x[3] for x in rows):>10} {len(payload) / 1024:>11.1f}")


def _tree_rss(root_pid: int) -> int:
    """Resident set of a process and all its descendants (VmRSS summed), bytes."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/status") as fh:
                fields = dict(line.split(":", 1) for line in fh if ":" in line)
        except OSError:
            continue
        pid, ppid = int(d), int(fields.get("PPid", "0").strip() or 0)
        children.setdefault(ppid, []).append(pid)
        rss[pid] = int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
    total, stack = 0, [root_pid]
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        stack.extend(children.get(pid, []))
    return total


def measured_run(args: list[str]) -> tuple[float, int, str]:
    """Wall seconds, peak RSS of the whole process tree (polled every 20 ms) and stdout of a reshard."""
    p = subprocess.Popen([sys.executable, "-m", "megatron_preflight", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    peak = [0]
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _tree_rss(p.pid))
            time.sleep(0.02)

    t = threading.Thread(target=poll, daemon=True)
    t0 = time.perf_counter()
    t.start()
    out, err = p.communicate()
    wall = time.perf_counter() - t0
    done.set()
    t.join()
    if p.returncode:
        raise SystemExit(f"reshard failed: {err}")
    return wall, peak[0], out


def part_d(work: str) -> None:
    from bench_reshard import make_checkpoint

    print("\nD. reshard --dry-run --json prediction vs the measured run (bandwidth: the dry run's quick read)")
    print(f"{'case':<30} {'workers':>7} {'read MiB p/m':>16} {'written MiB p/m':>18} {'bytes err':>9} "
          f"{'peak RSS MiB p/m':>17} {'ratio':>6} {'seconds p/m':>13}")
    ckpts = {"dense": dict(layers=8, tp=2, ep=1, moe=None), "moe": dict(layers=4, tp=1, ep=2, moe=8),
             "adam": dict(layers=3, tp=2, ep=1, moe=None, adam=True),
             "distopt": dict(layers=4, tp=2, ep=1, moe=None, distributed=True)}
    for name, kw in ckpts.items():
        if not os.path.exists(os.path.join(work, name)):
            make_checkpoint(os.path.join(work, name), **kw)
    cases = [("dense TP2 -> TP1", "dense", ["--tp", "1"], 1), ("dense TP2 -> TP4", "dense", ["--tp", "4"], 2),
             ("dense TP2 -> PP2", "dense", ["--pp", "2"], 4), ("MoE EP2 -> EP4", "moe", ["--ep", "4"], 2),
             ("dense+Adam TP2 -> TP1", "adam", ["--tp", "1"], 1), ("dense+DistOpt TP2 -> PP2", "distopt",
                                                                   ["--pp", "2"], 2),
             ("dense TP2 -> TP1 --verify", "dense", ["--tp", "1", "--verify"], 1),
             ("dense TP2 -> torch_dist", "dense", ["--ckpt-format", "torch_dist"], 1)]
    for label, name, flags, workers in cases:
        src, dst = os.path.join(work, name), os.path.join(work, "out")
        shutil.rmtree(dst, ignore_errors=True)
        common = ["reshard", src, dst, *flags, "--workers", str(workers), "--no-progress"]
        _, _, out = measured_run([*common, "--dry-run", "--json"])
        pred = json.loads(out)
        assert not os.path.exists(dst)
        wall, peak, out = measured_run(common)
        read = float(out.split("read ")[1].split(" MiB")[0]) * MIB
        written = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dst) for f in fs)
        err = max(abs(pred["bytes_read"] - read) / max(read, 1), abs(pred["bytes_written"] - written) / written)
        ratio = pred["peak_rss_bytes"] / peak
        print(f"{label:<30} {workers:>7} {pred['bytes_read'] / MIB:>7.1f}/{read / MIB:<8.1f} "
              f"{pred['bytes_written'] / MIB:>8.1f}/{written / MIB:<9.1f} {err * 100:>8.2f}% "
              f"{pred['peak_rss_bytes'] / MIB:>8.0f}/{peak / MIB:<8.0f} {ratio:>6.2f} "
              f"{pred['estimated_seconds']:>6.1f}/{wall:<6.1f}")
        shutil.rmtree(dst, ignore_errors=True)
    print("read: as the summary counts it (the MiB it prints: rounded to 0.1); written: bytes on disk; peak RSS: the "
          "whole process tree, VmRSS summed and polled every 20 ms; seconds: predicted vs the process's wall time "
          "(incl. interpreter and torch start-up)")


def _plan_all(root: str, flags: list[str]) -> tuple[float, float, float, int, int, int]:
    """(open s, plan+validate s, peak MiB, target ranks, planned tensors, source tensors) in this process."""
    import resource

    from megatron_preflight.check.runtime_args import from_cli
    from megatron_preflight.reshard import TargetLayout, open_index, open_resharder

    t0 = time.perf_counter()
    index = open_index(root)
    rt = from_cli(flags)
    r = open_resharder(index, TargetLayout.from_args(rt, given=rt.given), keep_optimizer=False)
    t1 = time.perf_counter()
    tensors = 0
    for name, coords in naming.shard_writers(r.tgt).items():
        tensors += len(r.plan_for_coords(coords, name).tensors)  # each plan validated as it is made
    t2 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return t1 - t0, t2 - t1, peak, len(naming.shard_writers(r.tgt)), tensors, len(r.index)


def _plan_worker(root: str, flags: list[str], q) -> None:
    q.put(_plan_all(root, flags))


def part_f(work: str) -> None:
    import multiprocessing as mp

    from tests.helpers.synthetic_dsv3 import DSV3
    from tests.helpers.synthetic_dsv3 import write_legacy as write_dsv3

    src = DSV3()
    root = os.path.join(work, "dsv3_pp16_ep64")
    if not os.path.exists(root):
        started = time.perf_counter()
        write_dsv3(root, src)
        print(f"\n(wrote the hollow DeepSeek-V3 checkpoint in {time.perf_counter() - started:.1f} s)")
    disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
    version = ["--megatron-version", "0.20"]
    print("\nF. DeepSeek-V3 671B shape (hollow), TP1 PP16 EP64: 1,024 shard dirs, "
          f"{disk / MIB:.0f} MiB of metadata on disk (hard links counted per dir)")
    wi, rss_i, out = median_run(["inspect", root, "--json"])
    assert json.loads(out)["ok"], out[-2000:]
    wc, rss_c, out = median_run(["check", root, "--json", *version, "--", *src.flags()])
    assert json.loads(out)["verdict"] == "load", out[-2000:]
    print(f"{'verdict':<36} {'wall s':>7} {'RSS MiB':>8}")
    print(f"{'inspect':<36} {wi:>7.2f} {rss_i / MIB:>8.0f}")
    print(f"{'check, same layout (load)':<36} {wc:>7.2f} {rss_c / MIB:>8.0f}")
    targets = {"PP8 EP32": DSV3(pp=8, ep=32, first_stage_layers=5, last_stage_layers=None),
               "PP16 EP32": DSV3(pp=16, ep=32)}
    for label, tgt in targets.items():
        w, rss, out = median_run(["check", root, "--json", *version, "--", *tgt.flags()])
        doc = json.loads(out)
        assert doc["verdict"] == "reshard", out[-3000:]
        print(f"{'check, -> ' + label + ' (reshard)':<36} {w:>7.2f} {rss / MIB:>8.0f}")
    print(f"\n{'plan (one process)':<22} {'open s':>7} {'plan+validate s':>16} {'peak MiB':>9} {'target ranks':>13} "
          f"{'planned tensors':>16} {'global tensors':>15} {'us/tensor':>10}")
    ctx = mp.get_context("spawn")
    for label, tgt in targets.items():
        q = ctx.Queue()
        p = ctx.Process(target=_plan_worker, args=(root, tgt.flags(), q))
        p.start()
        t_open, t_plan, peak, ranks, planned, globals_ = q.get(timeout=3600)
        p.join()
        print(f"{'-> ' + label:<22} {t_open:>7.2f} {t_plan:>16.2f} {peak:>9.0f} {ranks:>13} {planned:>16} "
              f"{globals_:>15} {1e6 * t_plan / max(planned, 1):>10.1f}")
    print(f"\n{'dry run':<22} {'read GiB':>9} {'written GiB':>12} {'files':>7} {'peak RSS GiB':>13} {'wall s':>7}")
    for label, tgt in targets.items():
        out_dir = os.path.join(work, "dsv3_dry_" + label.replace(" ", "_"))
        w, _rss, out = run_cli(["reshard", root, out_dir, "--dry-run", "--json", "--bandwidth", "2000", "--",
                                *tgt.flags()])
        doc = json.loads(out)
        tot = doc.get("total", doc)
        print(f"{'-> ' + label:<22} {tot.get('bytes_read', 0) / 2**30:>9.1f} {tot.get('bytes_written', 0) / 2**30:>12.1f} "
              f"{tot.get('files_opened', 0):>7} {tot.get('peak_rss_bytes', 0) / 2**30:>13.2f} {w:>7.2f}")


def part_f_optimizer(work: str) -> None:
    """Part F with the distributed optimizer's files (a chained dense + expert optimizer, overlapped buckets)."""
    from tests.helpers.synthetic_dsv3 import DSV3
    from tests.helpers.synthetic_dsv3 import write_legacy as write_dsv3

    def with_optimizer(flags: list[str]) -> list[str]:
        return [f for f in flags if f != "--no-load-optim"] + ["--use-distributed-optimizer", "--overlap-grad-reduce"]

    src = DSV3()
    root = os.path.join(work, "dsv3_pp16_ep64_distopt")
    if not os.path.exists(root):
        started = time.perf_counter()
        write_dsv3(root, src, optimizer=True)
        print(f"\n(wrote the hollow DeepSeek-V3 checkpoint with distrib_optim.pt in {time.perf_counter() - started:.1f} s)")
    version = ["--megatron-version", "0.20"]
    print("\nF (optimizer). The same, with the distributed optimizer's distrib_optim.pt in every dir")
    print(f"{'verdict':<36} {'wall s':>7} {'RSS MiB':>8}")
    wc, rss_c, out = median_run(["check", root, "--json", *version, "--", *with_optimizer(src.flags())])
    doc = json.loads(out)
    assert doc["verdict"] == "load" and doc["load_optimizer"], out[-2000:]
    print(f"{'check, same layout (load)':<36} {wc:>7.2f} {rss_c / MIB:>8.0f}")
    tgt = DSV3(pp=8, ep=32, first_stage_layers=5, last_stage_layers=None)
    w, rss, out = median_run(["check", root, "--json", *version, "--", *with_optimizer(tgt.flags())])
    doc = json.loads(out)
    assert doc["verdict"] == "reshard" and doc["load_optimizer"], out[-3000:]
    print(f"{'check, -> PP8 EP32 (reshard)':<36} {w:>7.2f} {rss / MIB:>8.0f}")
    out_dir = os.path.join(work, "dsv3_dry_distopt")
    w, _rss, out = run_cli(["reshard", root, out_dir, "--dry-run", "--json", "--bandwidth", "2000", "--",
                            *with_optimizer(tgt.flags())])
    tot = json.loads(out)
    tot = tot.get("total", tot)
    print(f"dry run -> PP8 EP32 with the optimizer: {tot.get('bytes_read', 0) / 2**30:.1f} GiB read, "
          f"{tot.get('bytes_written', 0) / 2**30:.1f} GiB written, {tot.get('files_opened', 0)} files, peak "
          f"{tot.get('peak_rss_bytes', 0) / 2**30:.2f} GiB, {w:.2f} s")


def _unpickle_floor(path: str, n: int = 3) -> float:
    """Seconds torch's own classes take to unpickle a DCP ``.metadata`` (what any reader of the checkpoint pays,
    Megatron's dist loader included), median of ``n``, in a fresh interpreter each time."""
    code = ("import pickle, sys, time, torch.distributed.checkpoint\n"
            "data = open(sys.argv[1], 'rb').read()\nt = time.perf_counter()\npickle.loads(data)\n"
            "print(time.perf_counter() - t)")
    return statistics.median(float(subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                                                  check=True).stdout) for _ in range(n))


def part_f_torch_dist(work: str) -> None:
    """Part F's checkpoints in torch_dist form (Megatron's default format), hollow: sparse data files per saving rank
    (tests/helpers/synthetic_dsv3.py write_torch_dist), the optimizer's in the fully_reshardable form."""
    import multiprocessing as mp

    from tests.helpers.synthetic_dsv3 import DSV3, dist_flags
    from tests.helpers.synthetic_dsv3 import write_legacy as write_dsv3
    from tests.helpers.synthetic_dsv3 import write_torch_dist as write_dsv3_dist

    src = DSV3()
    tgt = DSV3(pp=8, ep=32, first_stage_layers=5, last_stage_layers=None)
    version = ["--megatron-version", "0.20"]
    print("\nF (torch_dist). The same model saved as torch_dist at PP16 EP64 (hollow: sparse data files, one per "
          "saving rank)")
    print(f"{'verdict':<52} {'wall s':>7} {'RSS MiB':>8}")
    for optimizer in (False, True):
        legacy = os.path.join(work, "dsv3_pp16_ep64" + ("_distopt" if optimizer else ""))
        root = legacy + "_torch_dist"
        if not os.path.exists(legacy):
            write_dsv3(legacy, src, optimizer=optimizer)
        if not os.path.exists(root):
            started = time.perf_counter()
            files = write_dsv3_dist(root, src, legacy, optimizer=optimizer)
            md = os.path.getsize(os.path.join(root, "iter_0001000", ".metadata"))
            print(f"(wrote it{' with the optimizer' if optimizer else ''}: {files} data files, .metadata "
                  f"{md / MIB:.1f} MiB, in {time.perf_counter() - started:.1f} s)")
        floor = _unpickle_floor(os.path.join(root, "iter_0001000", ".metadata"))
        print(f"{'(floor: torch unpickles its .metadata)' + (' (optimizer)' if optimizer else ''):<52} {floor:>7.2f}")
        label = " (optimizer)" if optimizer else ""
        if not optimizer:
            w, rss, out = median_run(["inspect", root, "--json"])
            assert json.loads(out)["ok"], out[-2000:]
            print(f"{'inspect':<52} {w:>7.2f} {rss / MIB:>8.0f}")
        for m, want, what in ((src, "load", "same layout"), (tgt, "reshard" if optimizer else "load", "-> PP8 EP32")):
            w, rss, out = median_run(["check", root, "--json", *version, "--", *dist_flags(m.flags(), optimizer)])
            doc = json.loads(out)
            assert doc["verdict"] == want, out[-3000:]
            print(f"{'check' + label + ', ' + what + ' (' + want + ', ' + str(doc['loader']) + ')':<52} {w:>7.2f} "
                  f"{rss / MIB:>8.0f}")
        if optimizer:
            continue
        # the resharder on a torch_dist source: plans (every target rank, one process) and the dry run of a
        # conversion to legacy shards at PP8 EP32
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_plan_worker, args=(root, dist_flags(tgt.flags(), False), q))
        p.start()
        t_open, t_plan, peak, ranks, planned, globals_ = q.get(timeout=3600)
        p.join()
        print(f"plan -> PP8 EP32 (one process): open {t_open:.2f} s, plan+validate {t_plan:.2f} s for {ranks} target "
              f"ranks ({planned} planned tensors, {1e6 * t_plan / max(planned, 1):.0f} us each), peak {peak:.0f} MiB")
        out_dir = os.path.join(work, "dsv3_dry_from_torch_dist")
        w, _rss, out = run_cli(["reshard", root, out_dir, "--dry-run", "--json", "--bandwidth", "2000", "--",
                                *tgt.flags()])
        tot = json.loads(out)
        tot = tot.get("total", tot)
        print(f"dry run -> legacy PP8 EP32: {tot.get('bytes_read', 0) / 2**30:.1f} GiB read, "
              f"{tot.get('bytes_written', 0) / 2**30:.1f} GiB written, {tot.get('files_opened', 0)} files, peak "
              f"{tot.get('peak_rss_bytes', 0) / 2**30:.2f} GiB, {w:.2f} s")


def part_g(work: str, repeat: int) -> None:
    from bench_reshard import dir_bytes, io_floor, io_floor_overlapped

    from tests.helpers.synthetic_dsv3 import DSV3
    from tests.helpers.synthetic_dsv3 import write_legacy as write_dsv3

    kw = dict(num_layers=2, dense_layers=1, experts=16, mtp_layers=0, vocab=32768, dtype="bfloat16",
              first_stage_layers=None, last_stage_layers=None)
    src_m, dst_m = DSV3(pp=2, ep=2, **kw), DSV3(pp=1, ep=1, **kw)
    src = os.path.join(work, "dsv3_slice_pp2_ep2")
    if not os.path.exists(src):
        write_dsv3(src, src_m, hollow=False)
    size = dir_bytes(src)
    print(f"\nG. real bytes: a DeepSeek-V3-width slice (hidden 7168, MLA, 1 dense + 1 MoE layer of 16 experts, bf16), "
          f"PP2 EP2 -> PP1 EP1; source {size / 2**30:.2f} GiB")
    print(f"{'run (median of ' + str(repeat) + ')':<26} {'wall s':>7} {'in-process s':>13} {'read GiB':>9} "
          f"{'written GiB':>12} {'floor s':>8} {'floor/wall':>11} {'floor/in-process':>17} {'2-thread floor s':>17} "
          f"{'2-thread floor/in-process':>26} {'GiB/s per process':>18}")
    launchers = {"1 process": [sys.executable, "-m", "megatron_preflight"],
                 "torchrun, 2 processes": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                           "--master-port", "29991", "-m", "megatron_preflight"]}
    def floors(read: int, written: int) -> tuple[float, float]:
        return io_floor(src, written, work, read_bytes=read), io_floor_overlapped(src, written, work, read_bytes=read)

    runs: dict[str, list[tuple[float, ...]]] = {label: [] for label in launchers}
    for i in range(repeat):  # interleaved, each run beside its floors, the order flipped every round: the VM's memory
        # and disk speed drift, and a write right after a 3.7 GiB delete meets other free pages than one before it
        for label, launcher in launchers.items():
            dst = os.path.join(work, "dsv3_slice_out")
            before = floors(*runs[label][-1][6:8]) if i % 2 and runs[label] else None
            shutil.rmtree(dst, ignore_errors=True)
            started = time.perf_counter()
            r = subprocess.run([*launcher, "reshard", src, dst, "--workers", "1", "--no-progress", "--",
                                *dst_m.flags()], capture_output=True, text=True)
            wall = time.perf_counter() - started
            assert r.returncode == 0, r.stderr[-3000:]
            m_read = re.search(r"read ([\d.]+) (GiB|MiB)", r.stdout)
            assert m_read, r.stdout[-2000:]
            read = float(m_read.group(1)) * (1 if m_read.group(2) == "GiB" else 1 / 1024)
            m_secs = re.search(r"wrote [\d.]+ (?:GiB|MiB) in ([\d.]+) s", r.stdout)
            assert m_secs, r.stdout[-2000:]
            inner = float(m_secs.group(1))  # the reshard itself: open, plan, check, write, fsync, rename
            written = dir_bytes(dst)
            shutil.rmtree(dst, ignore_errors=True)
            floor, both = before or floors(int(read * 2**30), written)  # the bytes this run read and wrote
            runs[label].append((wall, inner, read, written / 2**30, floor, both, int(read * 2**30), written))
    rows = []
    for label, measured in runs.items():
        wall, inner, read, written, floor, both = (statistics.median(m[i] for m in measured) for i in range(6))
        ratios = sorted(m[4] / m[1] for m in measured)  # each run against the floor measured beside it
        procs = 2 if "2" in label else 1
        rows.append((label, wall, inner, read, written, floor, procs))
        print(f"{label:<26} {wall:>7.2f} {inner:>13.2f} {read:>9.2f} {written:>12.2f} {floor:>8.2f} "
              f"{floor / wall:>11.2f} {floor / inner:>17.2f} {both:>17.2f} {both / inner:>26.2f} "
              f"{(read + written) / inner / procs:>18.2f}")
        print(f"{'':<26} floor/in-process run by run (each against its own floor): median "
              f"{statistics.median(ratios):.2f}, {ratios[0]:.2f}-{ratios[-1]:.2f}")
    print("floor: read as many source bytes as the run read, write as many as it wrote, fsync; plain file I/O in one "
          "process, measured beside each run (after it, and before it every other round), in that process (no "
          "start-up); 2-thread floor: the same bytes read in one "
          "thread and written in another at the same time, as the reshard overlaps them. wall: the whole command (interpreter and "
          "torch start-up included: a fixed cost per process). in-process: the time the reshard reports for itself "
          "(open, plan, replica check, write, fsync, rename; rank 0's under torchrun). GiB/s per process: read + "
          "written over the in-process time, per process.")
    best = max((read + written) / inner / procs for _, _, inner, read, written, _, procs in rows)
    full = 1.34e12 / 2**30  # DeepSeek-V3 671B in bf16, weights only, one copy (torch_dist; legacy repeats the
    # dense weights in every EP rank's file: part F's dry run)
    for nodes, per_node in ((32, 8),):
        secs = 2 * full / (best * nodes * per_node)  # read once, written once
        print(f"projection (not a measurement): 671B bf16 weights (~{full:.0f} GiB read and written), {nodes} nodes x "
              f"{per_node} processes at {best:.2f} GiB/s each: {secs / 60:.1f} min, if the filesystem scales with them")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default=None)
    ap.add_argument("--parts", default="ABCDEFTG", help="T: part F's model in torch_dist form")
    ap.add_argument("--big-shards", type=int, default=8192, choices=(1024, 8192))
    ap.add_argument("--repeat", type=int, default=3, help="part G: runs per case (medians)")
    ns = ap.parse_args()
    work = ns.work or tempfile.mkdtemp(prefix="bench_scale_")
    os.makedirs(work, exist_ok=True)
    sizes = [n for n in (1, 64, 1024, 8192) if n <= ns.big_shards]
    try:
        if "A" in ns.parts:
            part_a(work, sizes)
        if "B" in ns.parts:
            part_b(work, [n for n in sizes if n >= 1024])
        if "C" in ns.parts:
            part_c(work)
        if "D" in ns.parts:
            part_d(work)
        if "E" in ns.parts:
            part_e(work, [n for n in sizes if n >= 1024])
        if "F" in ns.parts:
            part_f(work)
            part_f_optimizer(work)
        if "T" in ns.parts:
            part_f_torch_dist(work)
        if "G" in ns.parts:
            part_g(work, ns.repeat)
    finally:
        if not ns.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Offline resharding speed and memory on ~1 GB legacy checkpoints, against the I/O floor.

Builds (once, in --work) a dense GPT checkpoint (16 layers, hidden 1024, ffn 4096, vocab 50304, fp32, TP2; model
only, ~1.0 GB), an MoE one (6 layers, hidden 1024, 8 experts of ffn 2048, EP2), a dense one with the plain
optimizer's Adam state (4 layers, ~1.3 GB: weights + exp_avg + exp_avg_sq) and the same with the distributed
optimizer's distrib_optim.pt (fp32 masters + moments in flat buffers, ~1.7 GB), with Megatron-Core's local-spec key names;
and the Adam one in the production form (Transformer Engine spec, fused Adam, torch_dist), made from it by
`megatron-preflight reshard --transformer-impl transformer_engine --optimizer-family fused --ckpt-format torch_dist`. For each case it runs `megatron-preflight reshard` in a fresh process (--workers 1) and prints: wall
seconds, peak RSS of that process, bytes read and written, and the ratio of the I/O floor to our time, where the
floor is reading every source byte plus writing as many bytes as we wrote, with plain file I/O in the same run.

Usage: python benchmarks/bench_reshard.py [--work DIR] [--keep]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zlib

import torch

H, FFN = 1024, 4096


def seeded(name: str, *shape: int, positive: bool = False) -> torch.Tensor:
    """Random values that depend only on the name and shape: replicated tensors (a position embedding on every TP
    rank, a dense weight on every EP rank) agree across shards, as in a real checkpoint (the resharder checks)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}{shape}".encode()))
    return torch.rand(*shape, generator=g) if positive else torch.randn(*shape, generator=g)


def _layer(prefix: str, tp: int, moe: int | None, ep: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(len(prefix))
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    sd = {
        prefix + "input_layernorm.weight": torch.ones(H), prefix + "input_layernorm.bias": torch.zeros(H),
        prefix + "self_attention.linear_qkv.weight": r(3 * H // tp, H),
        prefix + "self_attention.linear_qkv.bias": r(3 * H // tp),
        prefix + "self_attention.linear_proj.weight": r(H, H // tp), prefix + "self_attention.linear_proj.bias": r(H),
        prefix + "pre_mlp_layernorm.weight": torch.ones(H), prefix + "pre_mlp_layernorm.bias": torch.zeros(H),
    }
    if moe:
        sd[prefix + "mlp.router.weight"] = r(moe, H)
        for j in range(moe // ep):
            e = f"{prefix}mlp.experts.local_experts.{j}."
            sd[e + "linear_fc1.weight"] = r(2048, H)
            sd[e + "linear_fc2.weight"] = r(H, 2048)
    else:
        sd[prefix + "mlp.linear_fc1.weight"] = r(FFN // tp, H)
        sd[prefix + "mlp.linear_fc1.bias"] = r(FFN // tp)
        sd[prefix + "mlp.linear_fc2.weight"] = r(H, FFN // tp)
        sd[prefix + "mlp.linear_fc2.bias"] = r(H)
    return sd


def adam_state(model: dict[str, torch.Tensor]) -> dict:
    """A plain (fp32) Megatron optimizer state for ``model``: groups [weight decay, no weight decay], params numbered
    group after group in model order, exp_avg / exp_avg_sq per param."""
    groups: list[list[str]] = [[], []]
    for k, v in model.items():
        groups[1 if k.endswith(".bias") or v.dim() == 1 else 0].append(k)
    state, params, idx = {}, [], 0
    for names in groups:
        ids = []
        for k in names:
            state[idx] = {"step": torch.tensor(1.0), "exp_avg": seeded("m" + k, *model[k].shape),
                          "exp_avg_sq": seeded("v" + k, *model[k].shape, positive=True)}
            ids.append(idx)
            idx += 1
        params.append(ids)
    settings = dict(is_expert_parallel=False, default_config=True, lr_mult=1.0, is_decoupled_lr=False, lr=1e-4,
                    betas=(0.9, 0.999), eps=1e-8, amsgrad=False)
    return {"state": state, "param_groups": [dict(settings, wd_mult=1.0, weight_decay=0.01, params=params[0]),
                                             dict(settings, wd_mult=0.0, weight_decay=0.0, params=params[1])]}


def dist_state(model: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """A distributed optimizer's state for ``model`` (one fp32 buffer, one bucket, laid out by Megatron's DDP rules as
    megatron_preflight.reshard.optimizer.distributed models them): (model_optim_rng.pt's optimizer entry, distrib_optim.pt)."""
    from megatron_preflight.reshard.optimizer.distributed import Slot, world_offsets

    params = list(model.items())
    offsets, buckets = world_offsets([Slot(k, v.numel()) for k, v in params], None)
    numel = sum(buckets)
    world = {n: torch.zeros(numel) for n in ("param", "exp_avg", "exp_avg_sq")}
    for k, v in params:
        o = offsets[k]
        world["param"][o:o + v.numel()] = v.reshape(-1)
        world["exp_avg"][o:o + v.numel()] = seeded("m" + k, v.numel())
        world["exp_avg_sq"][o:o + v.numel()] = seeded("v" + k, v.numel(), positive=True)
    settings = dict(is_expert_parallel=False, default_config=True, lr_mult=1.0, is_decoupled_lr=False, lr=1e-4,
                    betas=(0.9, 0.999), eps=1e-8, amsgrad=False, step=1.0)
    groups = [dict(settings, wd_mult=1.0, weight_decay=0.01), dict(settings, wd_mult=0.0, weight_decay=0.0)]
    return ({"optimizer": {"param_groups": groups}},
            {"buckets_coalesced": True, 0: {(torch.float32, torch.float32): {**world, "numel_unpadded": numel}}})


def make_checkpoint(root: str, *, layers: int, tp: int, ep: int, moe: int | None, adam: bool = False,
                    distributed: bool = False) -> None:
    os.makedirs(root, exist_ok=True)
    names = ([(f"mp_rank_{t:02d}", t, 0) for t in range(tp)] if ep == 1 else
             [(f"mp_rank_00_{e:03d}", 0, e) for e in range(ep)])
    multiple = 128 * tp  # Megatron pads the vocab to a multiple of make-vocab-size-divisible-by x TP
    padded = -(-50257 // multiple) * multiple
    for name, _t, _e in names:
        model: dict[str, torch.Tensor] = {
            "embedding.word_embeddings.weight": seeded("word", padded // tp, H),
            "embedding.position_embeddings.weight": seeded("position", 2048, H),
        }
        for i in range(layers):
            model.update(_layer(f"decoder.layers.{i}.", tp, moe, ep))
        model["decoder.final_layernorm.weight"] = torch.ones(H)
        model["decoder.final_layernorm.bias"] = torch.zeros(H)
        args = argparse.Namespace(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1 if moe else tp, virtual_pipeline_model_parallel_size=None, num_layers=layers,
            hidden_size=H, ffn_hidden_size=FFN, num_attention_heads=16, num_query_groups=16, kv_channels=64,
            num_experts=moe, moe_ffn_hidden_size=2048 if moe else None, padded_vocab_size=padded, vocab_size=50257, make_vocab_size_divisible_by=128, swiglu=False,
            add_bias_linear=not moe, untie_embeddings_and_output_weights=False, use_distributed_optimizer=distributed,
            ckpt_format="torch", world_size=max(tp, ep), data_parallel_size=max(tp, ep) // tp)
        d = os.path.join(root, "iter_0000001", name)
        os.makedirs(d, exist_ok=True)
        state = {"args": args, "iteration": 1, "checkpoint_version": 3.0, "model": model}
        if adam:
            state["optimizer"] = adam_state(model)
        if distributed:
            state["optimizer"], dist = dist_state(model)
            torch.save(dist, os.path.join(d, "distrib_optim.pt"))
        torch.save(state, os.path.join(d, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("1")


def proving_inputs(prefix: str) -> tuple[argparse.Namespace, str, str, str]:
    """The command line (--work DIR, --keep) of the benchmarks that prove a checkpoint (bench_diff, bench_fingerprint)
    and their two inputs, made once in the work dir: (args, work dir, dense TP2 ~1.0 GB, 4 layers + Adam ~1.3 GB)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default=None)
    ap.add_argument("--keep", action="store_true")
    ns = ap.parse_args()
    work = ns.work or tempfile.mkdtemp(prefix=prefix)
    dense, adam = os.path.join(work, "dense_tp2"), os.path.join(work, "dense_adam_tp2")
    if not os.path.exists(dense):
        make_checkpoint(dense, layers=16, tp=2, ep=1, moe=None)
    if not os.path.exists(adam):
        make_checkpoint(adam, layers=4, tp=2, ep=1, moe=None, adam=True)
    return ns, work, dense, adam


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(path) for f in fs)


def io_floor(src: str, out_bytes: int, scratch: str, read_bytes: int | None = None) -> float:
    """Seconds to read ``read_bytes`` of the source's files (all of them when None; pass what the run read, so a run
    that skips replicas is not flattered) and write ``out_bytes`` (+fsync), with plain buffered file I/O."""
    t0 = time.perf_counter()
    buf = bytearray(16 << 20)
    left = float("inf") if read_bytes is None else read_bytes
    for dp, _, fs in os.walk(src):
        for f in sorted(fs):
            with open(os.path.join(dp, f), "rb", buffering=0) as fh:
                while left > 0:
                    n = fh.readinto(memoryview(buf)[:int(min(len(buf), left))])
                    if not n:
                        break
                    left -= n
    path = os.path.join(scratch, "floor.bin")
    with open(path, "wb") as fh:
        left = out_bytes
        while left > 0:
            n = min(left, len(buf))
            fh.write(memoryview(buf)[:n])
            left -= n
        fh.flush()
        os.fsync(fh.fileno())
    secs = time.perf_counter() - t0
    os.remove(path)
    return secs


def io_floor_overlapped(src: str, out_bytes: int, scratch: str, read_bytes: int) -> float:
    """The stricter floor: the same bytes as :func:`io_floor`, read in one thread and written in another at the same
    time (16 MiB pieces, each written as it was read: what a two-thread copy costs; +fsync). A reshard that overlaps
    its reads and writes should be held to this one."""
    import queue
    import threading

    pieces: queue.Queue = queue.Queue(maxsize=2)
    free: queue.Queue = queue.Queue()
    for _ in range(4):
        free.put(bytearray(16 << 20))
    path = os.path.join(scratch, "floor.bin")

    def write() -> None:
        with open(path, "wb", buffering=0) as fh:
            left = out_bytes
            while (item := pieces.get()) is not None:
                buf, n = item
                n = min(n, left)
                fh.write(memoryview(buf)[:n])
                left -= n
                free.put(buf)
            while left > 0:  # a run that writes more than it reads (zero padding)
                n = min(left, 16 << 20)
                fh.write(bytes(n))
                left -= n
            os.fsync(fh.fileno())

    t0 = time.perf_counter()
    writer = threading.Thread(target=write)
    writer.start()
    left = read_bytes
    for dp, _, fs in os.walk(src):
        for f in sorted(fs):
            with open(os.path.join(dp, f), "rb", buffering=0) as fh:
                while left > 0:
                    buf = free.get()
                    n = fh.readinto(memoryview(buf)[:int(min(len(buf), left))])
                    if not n:
                        free.put(buf)
                        break
                    left -= n
                    pieces.put((buf, n))
    pieces.put(None)
    writer.join()
    secs = time.perf_counter() - t0
    os.remove(path)
    return secs


def run_case(src: str, dst: str, flags: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", src, dst, "--workers", "1",
                        "--no-progress", *flags], capture_output=True, text=True)
    secs = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"reshard failed: {r.stderr}")
    for dp, _, fs in os.walk(dst):  # the floor fsyncs its writes too
        for f in fs:
            with open(os.path.join(dp, f), "rb+") as fh:
                os.fsync(fh.fileno())
    del secs
    return time.perf_counter() - t0, r.stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--only", help="run only the cases whose label contains this text")
    ns = ap.parse_args()
    work = ns.work or tempfile.mkdtemp(prefix="bench_reshard_")
    dense, moe = os.path.join(work, "dense_tp2"), os.path.join(work, "moe_ep2")
    adam = os.path.join(work, "dense_adam_tp2")
    distopt = os.path.join(work, "dense_distopt_tp2")
    everything = not ns.only
    if not os.path.exists(dense) and everything:
        make_checkpoint(dense, layers=16, tp=2, ep=1, moe=None)
    if not os.path.exists(moe) and everything:
        make_checkpoint(moe, layers=6, tp=1, ep=2, moe=8)
    if not os.path.exists(adam):
        make_checkpoint(adam, layers=4, tp=2, ep=1, moe=None, adam=True)
    if not os.path.exists(distopt) and everything:
        make_checkpoint(distopt, layers=4, tp=2, ep=1, moe=None, distributed=True)
    dense_dist = os.path.join(work, "dense_tp2_torch_dist")  # the same model in Megatron's default format
    if not os.path.exists(dense_dist) and everything:
        run_case(dense, dense_dist, ["--ckpt-format", "torch_dist"])
    te_dist = os.path.join(work, "dense_adam_te_fused_torch_dist")  # the production form: TE spec, fused Adam, torch_dist
    if not os.path.exists(te_dist) and (not ns.only or ns.only in "TE fused-Adam torch_dist -> TP1"):
        run_case(adam, te_dist, ["--transformer-impl", "transformer_engine", "--optimizer-family", "fused",
                                 "--ckpt-format", "torch_dist"])
    cases = [
        ("dense TP2 -> TP1", dense, ["--tp", "1"]),
        ("dense TP2 -> TP2 PP2", dense, ["--pp", "2"]),
        ("dense TP2 -> TP4", dense, ["--tp", "4"]),
        ("MoE EP2 -> EP1", moe, ["--ep", "1"]),
        ("MoE EP2 -> EP4", moe, ["--ep", "4"]),
        ("dense+Adam TP2 -> TP1", adam, ["--tp", "1"]),
        ("dense+Adam TP2 -> PP2", adam, ["--pp", "2"]),
        ("dense+DistOpt TP2 -> TP1", distopt, ["--tp", "1"]),
        ("dense+DistOpt TP2 -> PP2", distopt, ["--pp", "2"]),
        ("dense TP2 -> torch_dist", dense, ["--ckpt-format", "torch_dist"]),
        ("torch_dist -> dense TP1", dense_dist, ["--tp", "1"]),
        ("DistOpt TP2 -> torch_dist", distopt, ["--ckpt-format", "torch_dist"]),
        ("TE fused-Adam torch_dist -> TP1", te_dist, ["--tp", "1"]),
    ]
    if ns.only:
        cases = [c for c in cases if ns.only in c[0]]
    rows = []
    for label, src, flags in cases:
        dst = os.path.join(work, "out")
        shutil.rmtree(dst, ignore_errors=True)
        secs, out = run_case(src, dst, flags)
        rss = float(re.search(r"peak RSS (\d+) MiB", out).group(1))
        inner = float(re.search(r"MiB in ([\d.]+) s", out).group(1))
        read = float(re.search(r"read ([\d.]+) MiB", out).group(1))
        written = dir_bytes(dst)
        floor = io_floor(src, written, work, read_bytes=int(read * 2**20))
        rows.append((label, dir_bytes(src), secs, inner, rss, read, written / 2**20, floor, floor / inner))
        shutil.rmtree(dst, ignore_errors=True)
    print(f"{'case':<26}{'src GB':>8}{'wall s':>8}{'tool s':>8}{'peak RSS MiB':>14}{'read MiB':>10}"
          f"{'written MiB':>13}{'floor s':>9}{'floor/tool':>11}")
    for label, sb, secs, inner, rss, read, written, floor, ratio in rows:
        print(f"{label:<26}{sb / 1e9:>8.2f}{secs:>8.2f}{inner:>8.2f}{rss:>14.0f}{read:>10.0f}{written:>13.0f}"
              f"{floor:>9.2f}{ratio:>11.2f}")
    print("wall s: the whole `megatron-preflight reshard` process incl. interpreter and torch start-up, plus fsync of "
          "the output; tool s: the tool's own time (its summary); floor: read as many source bytes as the tool "
          "read + write as many as it wrote (+fsync), plain file I/O; peak RSS: VmHWM of the process.")
    if not ns.keep and not ns.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

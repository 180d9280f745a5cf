"""A reshard killed (SIGKILL) at any point leaves no valid-looking output: the destination is either absent or a
complete checkpoint. Writes are durable: every shard file, directory and the tracker is fsynced before the rename."""

import os
import signal
import subprocess
import sys

import torch

from megatron_preflight.layout.discover import discover
from megatron_preflight.reshard import write_resharded
from megatron_preflight.reshard.target import TargetLayout
from megatron_preflight.reshard.targets import durable
from megatron_preflight.torch_file import TensorRef, TorchFile
from tests.conftest import fixture_path
from tests.layout.test_problems import _snapshot

# Runs write_resharded in a child process and SIGKILLs it just before the N-th durable step (a zip record, a
# directory fsync, the tracker, the rename); prints the number of steps when N is never reached.
CHILD = r"""
import os, signal, sys
from megatron_preflight.reshard.targets import durable, offline as writer, zip_writer
from megatron_preflight.reshard import TargetLayout
kill_at, count = int(sys.argv[3]), [0]
def step(fn):
    def wrapped(*a, **k):
        count[0] += 1
        if count[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(*a, **k)
    return wrapped
zip_writer.TorchZipWriter.begin = step(zip_writer.TorchZipWriter.begin)
durable.fsync_dir = step(durable.fsync_dir)
durable.write_text = step(durable.write_text)
writer.os.rename = step(os.rename)
writer.write_resharded(sys.argv[1], sys.argv[2], TargetLayout(tp=1), verify=False)
print("STEPS", count[0])
"""


def run_child(src, dst, kill_at):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    return subprocess.run([sys.executable, "-c", CHILD, src, dst, str(kill_at)], capture_output=True, text=True,
                          env=env, timeout=300)


def tensors(root):
    lay = discover(root)
    out = {}
    for s in lay.shards:
        with TorchFile(os.path.join(s.path, "model_optim_rng.pt")) as f:
            meta = f.load_metadata()
            out.update({(s.name, k): f.tensor(v).clone() for k, v in meta["model"].items() if isinstance(v, TensorRef)})
    return out


def test_kill_at_random_points_leaves_no_valid_looking_output(tmp_path):
    src = fixture_path("tp2_torch")
    before = _snapshot(src)
    ref = tmp_path / "ref"
    r = run_child(src, str(ref), 10**9)
    assert r.returncode == 0, r.stderr
    steps = int(r.stdout.split("STEPS")[1])
    assert steps > 10
    want = tensors(str(ref))
    points = sorted({1, 2, steps // 3, steps // 2, steps - 4, steps - 3, steps - 2, steps - 1, steps})
    outcomes = []
    for n in points:
        dst = tmp_path / f"out{n}"
        r = run_child(src, str(dst), n)
        assert r.returncode == -signal.SIGKILL, (n, r.returncode, r.stderr[-2000:])
        if dst.exists():  # only once the rename happened: then it must be complete and right
            lay = discover(str(dst))
            assert lay.ok, [p.message for p in lay.problems]
            got = tensors(str(dst))
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
            outcomes.append("complete")
        else:
            outcomes.append("absent")
    assert "absent" in outcomes and outcomes[-1] == "complete"  # killed after the rename: the output stands
    assert _snapshot(src) == before


def test_every_file_and_dir_is_fsynced_before_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync = os.fsync

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    real_rename = os.rename

    def rename(a, b):
        events.append(("rename", str(b)))
        return real_rename(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    dst = tmp_path / "out"
    write_resharded(fixture_path("pp2_torch"), str(dst), TargetLayout(pp=1, tp=2))
    at = events.index(("rename", str(dst)))
    synced_before = {p.replace(f".out.tmp-{os.getpid()}", "out") for kind, p in events[:at] if kind == "fsync"}
    written = {os.path.join(d, n) for d, _, names in os.walk(dst) for n in names} | {d for d, _, _ in os.walk(dst)}
    assert written <= synced_before, sorted(written - synced_before)
    assert ("fsync", str(tmp_path)) in events[at:]  # the parent, after the rename


def test_fsync_dir_works_on_a_real_dir(tmp_path):
    (tmp_path / "x").write_text("1")
    durable.fsync_dir(str(tmp_path))
    durable.write_text(str(tmp_path / "t"), "7")
    assert (tmp_path / "t").read_text() == "7"

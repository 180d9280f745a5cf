"""Offline resharding under torchrun: each rank writes its share; the result is the single-process result, byte for
byte; a failure on any rank fails every rank and leaves nothing behind."""

import os
import subprocess
import sys
import zipfile

from megatron_preflight.reshard import write_resharded
from megatron_preflight.reshard.target import TargetLayout
from megatron_preflight.reshard.targets.share import deal
from megatron_preflight.torch_file import TorchFile
from tests.conftest import fixture_path


def test_deal_balances_bytes_and_is_deterministic():
    sizes = {"a": 100, "b": 60, "c": 50, "d": 10}
    owner = deal(sizes, 2)
    assert owner == deal(dict(reversed(sizes.items())), 2)
    load = [sum(s for n, s in sizes.items() if owner[n] == r) for r in range(2)]
    assert sorted(load) == [110, 110]
    assert set(deal(sizes, 8).values()) == {0, 1, 2, 3}


def _torchrun(*args, port):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
           "-m", "megatron_preflight", "reshard", *args, "--no-progress", "--workers", "1"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _files(root):
    """{relative path: content}; a torch file's content is its unpickled metadata and its tensor records (the pickle
    bytes themselves depend on object identity, and torch stamps each file with a serialization id)."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            path = os.path.join(d, n)
            if n.endswith(".pt"):
                with zipfile.ZipFile(path) as z, TorchFile(path) as f:
                    records = {r.split("/", 1)[1]: z.read(r) for r in z.namelist() if "/data/" in r}
                    out[os.path.relpath(path, root)] = (repr(f.load_metadata()), records)
            else:
                with open(path, "rb") as fh:
                    out[os.path.relpath(path, root)] = fh.read()
    return out


def test_torchrun_ranks_write_their_share(tmp_path):
    src = fixture_path("moe_ep2_torch")
    alone, shared = str(tmp_path / "alone"), str(tmp_path / "shared")
    write_resharded(src, alone, TargetLayout(ep=4, etp=1))
    r = _torchrun(src, shared, "--ep", "4", "--etp", "1", "--verify", port=29761)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("wrote 4 shard(s)") == 1  # one summary, from rank 0
    a, b = _files(alone), _files(shared)
    assert sorted(a) == sorted(b) and len(a) == 5  # 4 shards + the tracker
    assert all(a[k] == b[k] for k in a)
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_torchrun_failure_fails_every_rank(tmp_path):
    dst = tmp_path / "taken"
    dst.mkdir()
    (dst / "something").write_text("x")
    r = _torchrun(fixture_path("tp2_torch"), str(dst), "--tp", "1", port=29762)
    assert r.returncode != 0
    assert (r.stdout + r.stderr).count("the destination exists and is not empty") >= 2  # every rank says why
    assert "megatron_preflight/" not in r.stdout + r.stderr  # no traceback through our code (torchrun prints its own)
    assert os.listdir(dst) == ["something"]

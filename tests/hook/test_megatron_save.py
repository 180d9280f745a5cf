"""Fingerprints at save (issue 33), in the REAL Megatron-LM pretrain_gpt.py (skipped unless MEGATRON_LM_ROOT is set):
a job with --preflight on writes its checkpoint's fingerprints as it saves, from the tensors it holds; they must equal
what `megatron-preflight fingerprint` computes from the files afterwards, and a later --preflight verify load passes.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.hook.test_megatron_lm import ROOT, TINY, VERIFIED, megatron_env, run

pytestmark = pytest.mark.skipif(not ROOT, reason="MEGATRON_LM_ROOT is not set: no real Megatron-LM checkout here")


def save_run(tmp_path, nproc, *flags, port):
    """pretrain_gpt.py from scratch through the launcher, saving at iteration 2 into tmp_path/saved: (rc, log, dir)."""
    python, env = megatron_env(ROOT)
    out = tmp_path / "saved"
    cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port),
           "-m", "megatron_preflight.run", "pretrain_gpt.py", *TINY, "--train-iters", "2", "--save-interval", "2",
           *os.environ.get("MEGATRON_LM_EXTRA_ARGS", "").split(), "--save", str(out),
           "--preflight", "check", "--preflight-allow-missing-checkpoint", *flags]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    return r.returncode, r.stdout + r.stderr, out


def _tensors(root):
    with open(os.path.join(root, "megatron_preflight_fingerprints", "iter_0000002.json")) as fh:
        return json.load(fh)


def _equals_fingerprints_of_the_files(saved, tmp_path):
    """The fingerprints the job wrote equal what `megatron-preflight fingerprint` computes from a copy of the files
    (every tensor and Adam moment, the iteration and the optimizer step)."""
    at_save = _tensors(saved)
    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    shutil.rmtree(copy / "megatron_preflight_fingerprints")
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "fingerprint", str(copy)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    from_files = _tensors(copy)
    assert any("#exp_avg" in k for k in at_save["tensors"])  # the optimizer state too
    assert at_save["tensors"] == from_files["tensors"]
    assert (at_save["iteration"], at_save["optimizer_step"]) == (from_files["iteration"], from_files["optimizer_step"])


@pytest.mark.parametrize("nproc, flags", [
    (2, ["--ckpt-format", "torch", "--tensor-model-parallel-size", "2"]),
    (2, ["--ckpt-format", "torch_dist", "--use-distributed-optimizer"]),
    (2, ["--ckpt-format", "torch", "--use-distributed-optimizer", "--num-experts", "4", "--moe-router-topk", "2",
         "--expert-model-parallel-size", "2", "--disable-bias-linear"]),
    # saved at iterations 1 and 2: the second save hashes beside Megatron's write (the plan of the first), and the
    # two data-parallel replicas each hash a share (the writing rank none)
    (2, ["--ckpt-format", "torch", "--save-interval", "1"]),
    (2, ["--ckpt-format", "torch_dist", "--save-interval", "1"]),
], ids=["legacy tp2", "torch_dist distributed optimizer dp2", "legacy moe ep2 distributed optimizer",
        "legacy dp2 plain optimizer every iteration", "torch_dist dp2 plain optimizer every iteration"])
def test_the_job_fingerprints_what_it_saves(tmp_path, nproc, flags):
    rc, log, saved = save_run(tmp_path, nproc, *flags, port=29860)
    assert rc == 0, log[-3000:]
    assert "fingerprints at save (iteration 2):" in log and "tensors" in log, log[-3000:]
    if "--save-interval" in flags:
        assert "fingerprints at save (iteration 1):" in log and "hashed beside the save" in log, log[-3000:]
    _equals_fingerprints_of_the_files(saved, tmp_path)
    # a later --preflight verify resume of the saved checkpoint is proven against them
    rc2, log2 = run(tmp_path, str(saved), nproc, "--preflight", "verify", *flags, "--no-load-rng", port=29861)
    assert rc2 == 0 and VERIFIED.search(log2), log2[-3000:]


def test_an_asynchronous_save_is_fingerprinted_once_finalized(tmp_path):
    """--async-save: the fingerprints are written by the request's last finalize function (after Megatron's own,
    which completes the checkpoint and its tracker), read back from the files by every rank's share; they equal
    `megatron-preflight fingerprint` of the files, and a --preflight verify resume passes against them."""
    flags = ["--ckpt-format", "torch_dist", "--use-distributed-optimizer"]
    rc, log, saved = save_run(tmp_path, 2, *flags, "--async-save", "--use-persistent-ckpt-worker",
                              "--async-strategy", "mcore", port=29862)
    assert rc == 0, log[-3000:]
    assert "fingerprints of the asynchronous save (iteration 2, read back once finalized):" in log, log[-3000:]
    _equals_fingerprints_of_the_files(saved, tmp_path)
    rc2, log2 = run(tmp_path, str(saved), 2, "--preflight", "verify", *flags, "--no-load-rng", port=29861)
    assert rc2 == 0 and VERIFIED.search(log2), log2[-3000:]


@pytest.fixture(scope="module")
def saved_tp2(tmp_path_factory):
    """A legacy TP2 checkpoint saved by a job with fingerprints on (each saved slice's digest stored)."""
    tmp = tmp_path_factory.mktemp("saved_tp2")
    rc, log, saved = save_run(tmp, 2, *_TP2, port=29860)
    assert rc == 0, log[-3000:]
    return saved


_TP2 = ["--ckpt-format", "torch", "--tensor-model-parallel-size", "2"]


def _edit(shard, kind):
    """Change rank 1's file after the save: one element of one tensor (saved again: its CRCs right), every tensor of
    it (a shard of another run spliced in), or one bit on disk (its record's CRC fails)."""
    from tests.helpers import ckpt_edit

    if kind == "flipped bit":
        from megatron_preflight.torch_file import TorchFile

        with TorchFile(str(shard)) as f:
            ref = f.load_metadata()["model"]["decoder.layers.1.mlp.linear_fc1.weight"]
            start, _ = f._record_offset(ref.storage.key)
        with open(shard, "r+b") as fh:
            fh.seek(start + 7 * 4 + 1)
            b = fh.read(1)
            fh.seek(start + 7 * 4 + 1)
            fh.write(bytes([b[0] ^ 0x08]))
        return
    state = ckpt_edit.load(str(shard))
    if kind == "edited tensor":
        state["model"]["decoder.layers.1.mlp.linear_fc1.weight"].view(-1)[7] += 1.0
    else:  # spliced: every tensor of the model and the optimizer state other values

        def shift(tree):
            for v in tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list) else ():
                if hasattr(v, "is_floating_point") and v.is_floating_point() and v.numel() > 1:
                    v.add_(1e-3)
                else:
                    shift(v)

        shift(state["model"])
        shift(state["optimizer"])
    ckpt_edit.save(state, str(shard))


@pytest.mark.parametrize("kind, said", [
    ("edited tensor", "decoder.layers.1.mlp.linear_fc1.weight: 1 of its 2 saved slices differ"),
    ("spliced shard", "likely spliced in from another run"),
    ("flipped bit", "CRC-32"),
])
def test_a_saved_checkpoint_changed_afterwards_is_caught_by_every_consumer(saved_tp2, tmp_path, kind, said):
    """Saved with fingerprints (legacy, TP2), then rank 1's file changed: `inspect --verify-content`, `reshard
    --verify` and a --preflight verify resume each stop, naming rank 1's file (and the tensor, or the cause); the
    untouched checkpoint passes the content check."""
    saved = saved_tp2
    assert "boxes" in _tensors(saved)  # each saved slice's digest: what names the shard later
    cli = [sys.executable, "-m", "megatron_preflight"]
    ok = subprocess.run([*cli, "inspect", str(saved), "--verify-content"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "content     OK" in ok.stdout, ok.stdout + ok.stderr
    bad = tmp_path / "changed"
    shutil.copytree(saved, bad)
    _edit(bad / "iter_0000002" / "mp_rank_01" / "model_optim_rng.pt", kind)
    where = os.path.join("mp_rank_01", "model_optim_rng.pt")
    r = subprocess.run([*cli, "inspect", str(bad), "--verify-content"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and said in r.stdout and where in r.stdout, r.stdout + r.stderr
    out = tmp_path / "resharded"
    r = subprocess.run([*cli, "reshard", str(bad), str(out), "--tp", "1", "--verify", "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and where in r.stderr and not out.exists(), r.stderr
    rc2, log2 = run(tmp_path, str(bad), 2, "--preflight", "verify", *_TP2, "--no-load-rng", port=29861)
    assert rc2 != 0 and where in log2 and "the job must not train" in log2, log2[-3000:]

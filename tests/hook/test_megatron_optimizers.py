"""Megatron-LM main's other optimizers (Muon, Lion, SGD, SOAP) resumed at another layout in REAL Megatron-LM
(skipped unless MEGATRON_LM_ROOT is set, and MEGATRON_LM_EMERGING — a directory holding NVIDIA's
``emerging-optimizers`` package, which main imports for muon / lion / soap — for those optimizers).

The oracle: Megatron's own load of the torch_dist twin at the target layout (its load-time reshard of the weights and
the optimizer state). Four iterations from the iteration-2 checkpoint: iterations 3 and 4 use the loaded state
(momentum, moments), so their losses equal the oracle's only if every field reached the right parameter. SGD's
torch_dist twin Megatron cannot load at any layout: there the legacy and torch_dist sources, both through
``--preflight auto``, must agree with each other, and the offline outputs of both are compared bit for bit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import fixture_path
from tests.hook.test_megatron_lm import ROOT, loss, megatron_env, run

EMERGING = os.environ.get("MEGATRON_LM_EMERGING")
pytestmark = pytest.mark.skipif(not ROOT, reason="MEGATRON_LM_ROOT is not set: no real Megatron-LM checkout here")
needs_emerging = pytest.mark.skipif(not EMERGING, reason="MEGATRON_LM_EMERGING is not set: Megatron-LM main needs the "
                                                         "emerging-optimizers package for muon / lion / soap")


def _run(tmp_path, ckpt, nproc, *flags, **kw):
    """``run`` with the emerging-optimizers package on the path after the runner's own (the shim, Megatron-LM)."""
    _python, env = megatron_env(ROOT)
    path = os.pathsep.join(p for p in (env["PYTHONPATH"], EMERGING or "") if p)
    return run(tmp_path, ckpt, nproc, *flags, env_extra={"PYTHONPATH": path}, verify=False, **kw)


def _losses(log):
    return loss(log, 3, 4), loss(log, 4, 4)


@needs_emerging
@pytest.mark.parametrize("opt, nproc, target", [
    ("muon", 1, []),
    ("lion", 1, []),
    ("muon", 2, ["--pipeline-model-parallel-size", "2"]),
    ("lion", 2, ["--pipeline-model-parallel-size", "2"]),
], ids=["muon tp2->tp1", "lion tp2->tp1", "muon tp2->tp1pp2", "lion tp2->tp1pp2"])
def test_an_emerging_optimizers_legacy_state_resumes_like_megatrons_own_reshard(tmp_path, opt, nproc, target):
    flags = ["--optimizer", opt, "--train-iters", "4", *target]
    rc, log = _run(tmp_path, fixture_path(f"{opt}_tp2_torch"), nproc, "--preflight", "auto", "--ckpt-format", "torch",
                   *flags, port=29860)
    assert rc == 0, log[-3000:]
    assert "loaded through the in-memory resharder" in log and "applied: no_load_optim" not in log
    rc2, oracle = _run(tmp_path, fixture_path(f"{opt}_tp2_torch_dist"), nproc, "--no-load-rng", "--ckpt-format",
                       "torch_dist", *flags, plugin=False, port=29861)
    assert rc2 == 0, oracle[-3000:]
    assert _losses(log)[1] is not None and _losses(log) == _losses(oracle)


@needs_emerging
@pytest.mark.parametrize("opt", ["muon", "lion"])
def test_an_emerging_optimizers_offline_reshard_equals_megatrons_saved_one_and_resumes(tmp_path, opt):
    """Ours (from the legacy and from the torch_dist twin) against Megatron's own load of the twin at TP1 saved as
    legacy (--ckpt-convert-format torch): equal bit for bit; and plain Megatron resumes ours like the twin."""
    from megatron_preflight.prove.diff import diff_checkpoints
    from megatron_preflight.reshard import TargetLayout, write_resharded

    flags = ["--optimizer", opt]
    saved = tmp_path / "megatron_converted"
    rc, log = _run(tmp_path, fixture_path(f"{opt}_tp2_torch_dist"), 1, "--ckpt-format", "torch_dist",
                   "--ckpt-convert-format", "torch", "--ckpt-convert-save", str(saved), "--no-load-rng", *flags,
                   plugin=False, port=29862)
    assert rc == 0 and "converted checkpoint" in log, log[-3000:]
    for source in (f"{opt}_tp2_torch", f"{opt}_tp2_torch_dist"):
        ours = str(tmp_path / f"ours_{source}")
        write_resharded(fixture_path(source), ours, TargetLayout(tp=1), verify=True)
        report = diff_checkpoints(ours, str(saved / "torch"))
        assert report.equal, (source, report.render())
    rc, log = _run(tmp_path, str(tmp_path / f"ours_{opt}_tp2_torch"), 1, "--ckpt-format", "torch", "--no-load-rng",
                   "--train-iters", "4", *flags, plugin=False, port=29863)
    assert rc == 0, log[-3000:]
    shutil.rmtree(tmp_path / f"{opt}_tp2_torch_dist", ignore_errors=True)
    rc2, oracle = _run(tmp_path, fixture_path(f"{opt}_tp2_torch_dist"), 1, "--ckpt-format", "torch_dist",
                       "--no-load-rng", "--train-iters", "4", *flags, plugin=False, port=29864)
    assert rc2 == 0, oracle[-3000:]
    assert _losses(log)[1] is not None and _losses(log) == _losses(oracle)


def test_sgd_torch_dist_that_megatron_cannot_load_resumes_with_auto(tmp_path):
    """Megatron fails on its own SGD torch_dist save after the build (at the saved layout); with --preflight auto it
    loads in memory; at TP1 the legacy twin and the torch_dist one resume alike."""
    flags = ["--optimizer", "sgd", "--train-iters", "4"]
    rc, log = _run(tmp_path, fixture_path("sgd_tp2_torch_dist"), 2, "--ckpt-format", "torch_dist",
                   "--tensor-model-parallel-size", "2", *flags, plugin=False, port=29865)
    assert rc != 0 and "object is not callable" in log  # Megatron's own failure, after the build
    rc, at_saved = _run(tmp_path, fixture_path("sgd_tp2_torch_dist"), 2, "--preflight", "auto", "--ckpt-format",
                        "torch_dist", "--tensor-model-parallel-size", "2", *flags, port=29866)
    assert rc == 0 and "loaded through the in-memory resharder" in at_saved, at_saved[-3000:]
    rc, legacy_at_saved = _run(tmp_path, fixture_path("sgd_tp2_torch"), 2, "--ckpt-format", "torch",
                               "--tensor-model-parallel-size", "2", *flags, plugin=False, port=29867)
    assert rc == 0, legacy_at_saved[-3000:]
    assert _losses(at_saved)[1] is not None and _losses(at_saved) == _losses(legacy_at_saved)
    for nproc, target in ((1, []), (2, ["--pipeline-model-parallel-size", "2"])):  # TP1, and TP1 PP2
        results = []
        for name, fmt in (("sgd_tp2_torch", "torch"), ("sgd_tp2_torch_dist", "torch_dist")):
            rc, log = _run(tmp_path, fixture_path(name), nproc, "--preflight", "auto", "--ckpt-format", fmt, *flags,
                           *target, port=29868)
            assert rc == 0 and "loaded through the in-memory resharder" in log, log[-3000:]
            results.append(_losses(log))
        assert results[0][1] is not None and results[0] == results[1]


@needs_emerging
def test_soap_carries_its_preconditioners_across_a_pipeline_change_and_stops_at_another_tp(tmp_path):
    """SOAP's L / R / Q_L / Q_R are matrices of each shard's own: TP2 -> TP2 PP2 carries them (iteration 4 equals an
    offline reshard resumed by plain Megatron); TP2 -> TP1 stops at start with the weights-only fix, which resumes."""
    flags = ["--optimizer", "soap", "--train-iters", "4"]
    pp2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    rc, log = _run(tmp_path, fixture_path("soap_tp2_torch"), 4, "--preflight", "auto", "--ckpt-format", "torch", *pp2,
                   *flags, port=29869)
    assert rc == 0 and "loaded through the in-memory resharder" in log, log[-3000:]
    out = tmp_path / "soap_pp2"
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", fixture_path("soap_tp2_torch"), str(out),
                        "--tp", "2", "--pp", "2", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rc, offline = _run(tmp_path, str(out), 4, "--ckpt-format", "torch", "--no-load-rng", *pp2, *flags, plugin=False,
                       port=29870)
    assert rc == 0, offline[-3000:]
    assert _losses(log)[1] is not None and _losses(log) == _losses(offline)
    rc, stopped = _run(tmp_path, fixture_path("soap_tp2_torch"), 1, "--preflight", "auto", "--ckpt-format", "torch",
                       *flags, port=29871)
    assert rc != 0 and "SOAP's preconditioners" in stopped and "--no-load-optim" in stopped, stopped[-3000:]
    rc, weights = _run(tmp_path, fixture_path("soap_tp2_torch"), 1, "--preflight", "auto", "--ckpt-format", "torch",
                       "--no-load-optim", *flags, port=29872)
    assert rc == 0 and loss(weights, 4, 4) is not None, weights[-3000:]


@needs_emerging
def test_a_torch_dist_output_passes_megatrons_verify_integrity_and_resumes_like_the_twin(tmp_path):
    """Our torch_dist output (from the legacy Muon checkpoint, at TP1) loads in plain Megatron with --verify-integrity
    and resumes like Megatron's own load of the twin; one byte changed and Megatron's check refuses it."""
    from megatron_preflight.reshard import TargetLayout, write_resharded

    out = tmp_path / "ours_dist"
    write_resharded(fixture_path("muon_tp2_torch"), str(out), TargetLayout(tp=1, ckpt_format="torch_dist"))
    flags = ["--optimizer", "muon", "--train-iters", "4", "--no-load-rng", "--ckpt-format", "torch_dist"]
    rc, log = _run(tmp_path, str(out), 1, "--verify-integrity", *flags, plugin=False, port=29873)
    assert rc == 0, log[-3000:]
    rc, oracle = _run(tmp_path, fixture_path("muon_tp2_torch_dist"), 1, *flags, plugin=False, port=29874)
    assert rc == 0, oracle[-3000:]
    assert _losses(log)[1] is not None and _losses(log) == _losses(oracle)
    bad = tmp_path / "bad"
    shutil.copytree(out, bad / "ours_dist")
    with open(bad / "ours_dist" / "iter_0000002" / "common.pt", "ab") as fh:
        fh.write(b"x")
    rc, refused = _run(bad, str(bad / "ours_dist"), 1, "--verify-integrity", *flags, plugin=False, port=29875)
    assert rc != 0 and "integrity" in refused.lower(), refused[-3000:]


@needs_emerging
def test_a_muon_chain_with_experts_resumes_at_ep4_from_either_twin_and_offline(tmp_path):
    """Muon + MoE (a chain of four parts: Muon dense / expert, Adam dense / expert) from EP2 to EP4 — where Megatron's
    own torch_dist load fails across the EP change —: the legacy and the torch_dist twin both resume through
    --preflight auto alike, and so does the offline reshard in plain Megatron (iterations 3 and 4 use the momentum and
    Adam's moments). (EP4, not EP1: at EP1 Megatron's MoE forward with expert biases fails on this CPU runner, with or
    without us: "Output 0 of _ReduceFromModelParallelRegion is a view and is being modified inplace".)"""
    flags = ["--optimizer", "muon", "--train-iters", "4", "--num-experts", "4", "--moe-router-topk", "2",
             "--expert-model-parallel-size", "4", "--global-batch-size", "4"]  # (DP4 needs 4 samples)
    results = []
    for name, fmt in (("muon_moe_ep2_torch", "torch"), ("muon_moe_ep2_torch_dist", "torch_dist")):
        rc, log = _run(tmp_path, fixture_path(name), 4, "--preflight", "auto", "--ckpt-format", fmt, *flags,
                       port=29876)
        assert rc == 0 and "loaded through the in-memory resharder" in log, log[-3000:]
        results.append(_losses(log))
    out = tmp_path / "ep4"
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", fixture_path("muon_moe_ep2_torch"),
                        str(out), "--ep", "4", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rc, offline = _run(tmp_path, str(out), 4, "--ckpt-format", "torch", "--no-load-rng", *flags, plugin=False,
                       port=29877)
    assert rc == 0, offline[-3000:]
    assert results[0][1] is not None and results[0] == results[1] == _losses(offline)

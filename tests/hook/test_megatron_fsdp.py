"""Megatron-FSDP's fsdp_dtensor checkpoints resumed on the 3D-parallel path of the REAL Megatron-LM pretrain_gpt.py
(skipped unless MEGATRON_LM_ROOT and MEGATRON_LM_TE_CPU are set: Megatron-FSDP runs here only with the Transformer
Engine CPU stand-in ``te_cpu``, see tests/hook/test_megatron_lm.py).

The oracle is Megatron-FSDP's own resume of the checkpoint (iterations 3 and 4, optimizer state loaded). Megatron
itself cannot take an fsdp_dtensor checkpoint into a 3D-parallel run (it calls it torch_dcp and fails after the build);
with ``--preflight auto`` the plugin loads it in memory, and the offline conversion ``check`` advises, run as printed,
writes what plain Megatron loads — each with the oracle's losses, bit for bit.
"""

import os

import pytest

from tests.conftest import fixture_path
from tests.hook.test_megatron_lm import ROOT, TE_CPU, TINY, loss, run

pytestmark = pytest.mark.skipif(not (ROOT and TE_CPU), reason="needs MEGATRON_LM_ROOT and MEGATRON_LM_TE_CPU (the "
                                                              "Transformer Engine stand-in Megatron-FSDP runs with)")

FSDP_RUN = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--data-parallel-sharding-strategy",
            "optim_grads_params", "--no-gradient-reduce-div-fusion"]
# Megatron-FSDP asserts CUDA_DEVICE_MAX_CONNECTIONS is not 1 (the 3D path at TP > 1 asserts it is)
FSDP_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
COMMON = ["--train-iters", "4"]

CASES = [
    ("fsdp_dp2", 2, [], []),
    ("fsdp_tp2dp2", 4, ["--tensor-model-parallel-size", "2"], ["--tensor-model-parallel-size", "2"]),
    ("fsdp_moe_ep2", 2, [*MOE, "--expert-model-parallel-size", "2"], [*MOE, "--expert-model-parallel-size", "2"]),
    ("fsdp_dp2_bf16_swiglu", 2, ["--bf16", "--swiglu"], ["--bf16", "--swiglu"]),
]
# Models and layouts beyond the first four, resumed on the 3D path: (name, nproc, model flags, the layout of
# Megatron-FSDP's own resume (the oracle), the 3D run's layout). Where TP changes, --make-vocab-size-divisible-by 64
# keeps the saved padding (128 rows at TP2; Megatron-FSDP does not load another padding, and the padding rows' logits
# are in the loss). Under bf16 the 3D run keeps the expert layout: another expert split sums in another order.
GROUPED = [*MOE, "--moe-grouped-gemm", "--swiglu", "--bf16", "--disable-bias-linear"]
GQA = ["--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
       "--normalization", "RMSNorm", "--position-embedding-type", "rope"]
MTP = ["--mtp-num-layers", "1", "--position-embedding-type", "rope"]
SHARED = [*MOE, "--moe-shared-expert-intermediate-size", "32", "--global-batch-size", "4", "--disable-bias-linear"]
TP2 = ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]
TP2_SP = [*TP2, "--sequence-parallel"]
SAVED_GROUPED = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
                 "--expert-tensor-parallel-size", "1"]
MORE = [
    ("fsdp_grouped_tp2ep2_bf16", 4, GROUPED, SAVED_GROUPED, SAVED_GROUPED),
    ("fsdp_gqa_untied_rope", 2, GQA, TP2, TP2),
    # (not at PP2: Megatron-LM main cannot build the torch_dist state dict of an MTP model with tied embeddings at
    # PP > 1 — an assert in tie_embeddings_and_output_weights_state_dict on the last stage — whatever it loads)
    ("fsdp_mtp", 2, MTP, TP2, TP2),
    # (the oracle at the saved layout: Megatron-FSDP's own resumes at EP4 and at TP2·EP2 differ at iteration 4, by
    # 2e-6 — the MoE gradients reduce in another order; the 3D run at TP2·EP2 equals the one at EP4, bit for bit)
    ("fsdp_shared_ep4dp4", 4, SHARED, ["--expert-model-parallel-size", "4"],
     [*TP2_SP, "--expert-model-parallel-size", "2"]),
    ("fsdp_v019_bf16_swiglu", 2, ["--bf16", "--swiglu"], [], ["--pipeline-model-parallel-size", "2"]),
]
# Written by another Megatron-LM release (its work tree named in MEGATRON_LM_RELEASES, e.g. 0.19=/w/mlm-0.19): the
# oracle and both resumes run in that release's own pretrain_gpt.py
RELEASES = dict(item.split("=", 1) for item in os.environ.get("MEGATRON_LM_RELEASES", "").split(",") if "=" in item)
BY_RELEASE = {"fsdp_v019_bf16_swiglu": "0.19"}


def _root(name):
    """The work tree that wrote fixture ``name`` (None: MEGATRON_LM_ROOT); skips when that release is not set up."""
    release = BY_RELEASE.get(name)
    if release is None:
        return None
    if release not in RELEASES:
        pytest.skip(f"{name} was written by Megatron-LM {release}: name its work tree in MEGATRON_LM_RELEASES")
    return RELEASES[release]


def _alike(log, oracle, half: bool) -> bool:
    """Iteration 3 (the loaded weights) bit for bit; iteration 4 (after a step with the loaded Adam state) too in
    fp32. Under bf16 the two paths' gradient buffers accumulate and reduce differently (Megatron-FSDP's own buffers,
    the 3D path's DDP): the same converted state measured 1.3e-5 apart at iteration 4, so within 5e-5 there."""
    got, want = (loss(log, 3, 4), loss(log, 4, 4)), (loss(oracle, 3, 4), loss(oracle, 4, 4))
    if None in got or got[0] != want[0]:
        return False
    return got[1] == want[1] or (half and abs(float(got[1]) - float(want[1])) <= 5e-5)


@pytest.mark.parametrize("name, nproc, model, at, run_3d",
                         [(n, p, m, m, r) for n, p, m, r in CASES] + [(n, p, m, [*m, *a], [*m, *r])
                                                                    for n, p, m, a, r in MORE],
                         ids=[c[0] for c in CASES + MORE])
def test_an_fsdp_dtensor_checkpoint_resumes_on_the_3d_path_like_megatron_fsdp_itself(tmp_path, name, nproc, model,
                                                                                     at, run_3d):
    """Megatron-FSDP's own resume of the checkpoint (``at`` its layout) is the oracle; --preflight auto on the 3D path
    (``run_3d``) and the offline conversion check advises, run as printed, each resume with its losses."""
    from tests.helpers.advised import follow_advice

    root = _root(name)
    rc, oracle = run(tmp_path, fixture_path(name), nproc, *FSDP_RUN, *at, *COMMON, plugin=False, te=True,
                     port=29801, env_extra=FSDP_ENV, verify=False, root=root)
    assert rc == 0 and loss(oracle, 4, 4) is not None, oracle[-3000:]
    flags_3d = ["--use-distributed-optimizer", "--no-load-rng", *run_3d, *COMMON]

    rc, log = run(tmp_path, fixture_path(name), nproc, "--preflight", "auto", "--ckpt-format", "torch_dist", *flags_3d,
                  te=True, port=29802, verify=False, root=root)
    assert rc == 0 and _alike(log, oracle, "--bf16" in model), log[-3000:]

    extra = os.environ.get("MEGATRON_LM_EXTRA_ARGS", "").split()
    run_flags = [*TINY, *extra, "--transformer-impl", "transformer_engine", "--ckpt-format", "torch_dist", *flags_3d,
                 "--world-size", str(nproc)]
    new = str(tmp_path / "new")
    follow_advice(fixture_path(name), run_flags, new)
    rc, log = run(tmp_path, new, nproc, "--ckpt-format", "torch_dist", *flags_3d, plugin=False, te=True, port=29803,
                  verify=False, root=root)
    assert rc == 0 and _alike(log, oracle, "--bf16" in model), log[-3000:]


def test_a_megatron_fsdp_run_given_a_torch_dist_checkpoint_resumes_in_memory_and_as_advised(tmp_path):
    """A Megatron-FSDP run given the 3D-parallel twin of fsdp_dp2 (torch_dist, the same weights and Adam state):
    Megatron alone fails after the build; with --preflight auto the hook serves the checkpoint's fsdp_dtensor form to
    Megatron-FSDP's own load; and the offline conversion check names, run as printed, writes what Megatron-FSDP loads
    itself. Each resumes with the loss of Megatron-FSDP's own resume of fsdp_dp2, iterations 3 and 4 bit for bit."""
    from tests.helpers.advised import follow_advice

    src = fixture_path("fsdp_dp2_twin_torch_dist")
    rc, oracle = run(tmp_path, fixture_path("fsdp_dp2"), 2, *FSDP_RUN, *COMMON, "--no-load-rng", plugin=False,
                     te=True, port=29805, env_extra=FSDP_ENV, verify=False)
    assert rc == 0 and loss(oracle, 4, 4) is not None, oracle[-3000:]
    rc, log = run(tmp_path, src, 2, *FSDP_RUN, *COMMON, "--no-load-rng", plugin=False, te=True, port=29804,
                  env_extra=FSDP_ENV, verify=False)
    assert rc != 0 and loss(log, 3, 4) is None, log[-3000:]  # Megatron alone: fails after the build

    rc, log = run(tmp_path, src, 2, "--preflight", "auto", *FSDP_RUN, *COMMON, "--no-load-rng", te=True, port=29809,
                  env_extra=FSDP_ENV, verify=False)
    assert rc == 0 and "loaded through the in-memory resharder" in log, log[-3000:]
    assert _alike(log, oracle, False), log[-3000:]

    extra = os.environ.get("MEGATRON_LM_EXTRA_ARGS", "").split()
    run_flags = [*TINY, *extra, "--transformer-impl", "transformer_engine", *FSDP_RUN, *COMMON, "--no-load-rng",
                 "--world-size", "2"]
    new = str(tmp_path / "as_fsdp")
    follow_advice(src, run_flags, new)
    rc, log = run(tmp_path, new, 2, *FSDP_RUN, *COMMON, "--no-load-rng", plugin=False, te=True, port=29806,
                  env_extra=FSDP_ENV, verify=False)
    assert rc == 0 and _alike(log, oracle, False), log[-3000:]


@pytest.mark.parametrize("name, nproc, model", [(n, p, m) for n, p, m, _ in CASES[1:]] + [("fsdp_mtp", 2, MTP)],
                         ids=[c[0] for c in CASES[1:]] + ["fsdp_mtp"])
def test_fsdp_dtensor_written_from_torch_dist_resumes_under_megatron_fsdp_like_the_original(tmp_path, name, nproc,
                                                                                            model):
    """TP2, MoE EP2, bf16 SwiGLU: the fsdp_dtensor fixture converted to torch_dist, then resumed under Megatron-FSDP
    (a) in memory with --preflight auto and (b) converted back to fsdp_dtensor offline (the writer: SwiGLU halves,
    fp32 main parameters under bf16, experts by global index, group settings and step): each with the losses of the
    original's own resume, bit for bit; diff calls the two fsdp_dtensor checkpoints equal."""
    import subprocess
    import sys

    from megatron_preflight.prove.diff import diff_checkpoints

    dist, back = str(tmp_path / "dist"), str(tmp_path / "back")
    for src, dst, fmt in ((fixture_path(name), dist, "torch_dist"), (dist, back, "fsdp_dtensor")):
        r = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", src, dst, "--ckpt-format", fmt,
                            "--verify", "--no-progress"], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
    report = diff_checkpoints(fixture_path(name), back)
    assert report.equal, report.render()
    rc, oracle = run(tmp_path, fixture_path(name), nproc, *FSDP_RUN, *model, *COMMON, "--no-load-rng", plugin=False,
                     te=True, port=29807, env_extra=FSDP_ENV, verify=False)
    assert rc == 0 and loss(oracle, 4, 4) is not None, oracle[-3000:]
    rc, log = run(tmp_path, back, nproc, *FSDP_RUN, *model, *COMMON, "--no-load-rng", plugin=False, te=True,
                  port=29808, env_extra=FSDP_ENV, verify=False)
    assert rc == 0 and _alike(log, oracle, False), log[-3000:]
    rc, log = run(tmp_path, dist, nproc, "--preflight", "auto", *FSDP_RUN, *model, *COMMON, "--no-load-rng", te=True,
                  port=29810, env_extra=FSDP_ENV, verify=False)
    assert rc == 0 and "loaded through the in-memory resharder" in log, log[-3000:]
    assert _alike(log, oracle, False), log[-3000:]


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]],
                         ids=["tp2", "pp2"])
def test_an_fsdp_dtensor_checkpoint_resumes_at_another_3d_layout_like_megatrons_own_reshard_of_its_twin(tmp_path,
                                                                                                       layout):
    """fsdp_dp2 (Megatron-FSDP, DP2) resumed on the 3D path at TP2 or PP2, in memory (--preflight auto) and offline
    (converted to legacy at that layout), against the 3D-parallel twin of the same training (fsdp_dp2_twin_torch_dist):
    weights only, the losses of Megatron's own reshard of the twin (its dist loader; Megatron cannot carry the twin's
    dp_reshardable optimizer state across TP/PP: '(TP, PP) mismatch after resume ... not supported'); with the
    optimizer state, the losses of the twin resumed through --preflight auto (whose dp_reshardable reshards equal
    Megatron's own saved reshards: tests/hook/test_megatron_lm.py). Iterations 3 and 4, bit for bit."""
    import subprocess
    import sys

    flags = ["--use-distributed-optimizer", "--no-load-rng", *layout, *COMMON]
    twin, fsdp = fixture_path("fsdp_dp2_twin_torch_dist"), fixture_path("fsdp_dp2")
    rc, megatron = run(tmp_path, twin, 2, "--ckpt-format", "torch_dist", *flags, "--no-load-optim", plugin=False,
                       te=True, port=29811, verify=False)
    assert rc == 0 and loss(megatron, 4, 4) is not None, megatron[-3000:]
    rc, log = run(tmp_path, fsdp, 2, "--preflight", "auto", "--ckpt-format", "torch_dist", *flags, "--no-load-optim",
                  te=True, port=29812, verify=False)
    assert rc == 0 and "loaded through the in-memory resharder" in log, log[-3000:]
    assert (loss(log, 3, 4), loss(log, 4, 4)) == (loss(megatron, 3, 4), loss(megatron, 4, 4))

    rc, oracle = run(tmp_path, twin, 2, "--preflight", "auto", "--ckpt-format", "torch_dist", *flags, te=True,
                     port=29813, verify=False)
    assert rc == 0 and loss(oracle, 4, 4) is not None, oracle[-3000:]
    rc, log = run(tmp_path, fsdp, 2, "--preflight", "auto", "--ckpt-format", "torch_dist", *flags, te=True,
                  port=29814, verify=False)
    assert rc == 0 and (loss(log, 3, 4), loss(log, 4, 4)) == (loss(oracle, 3, 4), loss(oracle, 4, 4)), log[-3000:]
    out = str(tmp_path / "converted")
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", fsdp, out, "--ckpt-format", "torch",
                        "--verify", "--no-progress", "--", *TINY, *layout, "--use-distributed-optimizer",
                        "--transformer-impl", "transformer_engine"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rc, log = run(tmp_path, out, 2, "--ckpt-format", "torch", *flags, plugin=False, te=True, port=29815, verify=False)
    assert rc == 0 and (loss(log, 3, 4), loss(log, 4, 4)) == (loss(oracle, 3, 4), loss(oracle, 4, 4)), log[-3000:]


def test_verify_and_save_in_a_megatron_fsdp_run_loaded_in_memory(tmp_path):
    """--preflight verify in a Megatron-FSDP run given a torch_dist checkpoint: it loads in memory and trains; verify
    and the fingerprints at save say they do not apply to Megatron-FSDP's sharding (never a false alarm or a crash),
    and the offline command the save's message names fingerprints the saved fsdp_dtensor checkpoint as printed."""
    import re
    import shlex
    import subprocess
    import sys

    save = tmp_path / "saved"
    rc, log = run(tmp_path, fixture_path("fsdp_dp2_twin_torch_dist"), 2, "--preflight", "verify", *FSDP_RUN, *COMMON,
                  "--no-load-rng", "--save", str(save), "--save-interval", "4", te=True, port=29816,
                  env_extra=FSDP_ENV, verify=False)
    assert rc == 0 and loss(log, 4, 4) is not None, log[-3000:]
    assert "verify: not available in a Megatron-FSDP run" in log, log[-3000:]
    said = re.search(r"run `(megatron-preflight fingerprint [^`]+)` once it is written", log)
    assert said, log[-3000:]
    cmd = shlex.split(said.group(1))
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", *cmd[1:]], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_an_mtp_checkpoint_of_main_resumes_under_megatron_fsdp_of_another_release(tmp_path):
    """fsdp_mtp, written by Megatron-LM main (an MTP layer's tensors under `transformer_layer`), in core_r0.19.0's
    Megatron-FSDP, which asks for `mtp_model_layer`: alone it fails after the build ('Missing key in checkpoint
    state_dict'); --preflight auto serves both names, and the rewrite check advises (run as printed) is what 0.19 loads
    itself. Each resumes with the losses of main's own Megatron-FSDP resume, iterations 3 and 4."""
    from tests.helpers.advised import follow_advice

    if "0.19" not in RELEASES:
        pytest.skip("name core_r0.19.0's work tree in MEGATRON_LM_RELEASES (0.19=DIR)")
    root, src, flags = RELEASES["0.19"], fixture_path("fsdp_mtp"), [*FSDP_RUN, *MTP, *COMMON, "--no-load-rng"]
    rc, oracle = run(tmp_path, src, 2, *flags, plugin=False, te=True, port=29821, env_extra=FSDP_ENV, verify=False)
    assert rc == 0 and loss(oracle, 4, 4) is not None, oracle[-3000:]
    rc, log = run(tmp_path, src, 2, *flags, plugin=False, te=True, port=29822, env_extra=FSDP_ENV, verify=False,
                  root=root)
    assert rc != 0 and "Missing key in checkpoint state_dict" in log and "mtp_model_layer" in log, log[-3000:]
    rc, log = run(tmp_path, src, 2, "--preflight", "auto", *flags, te=True, port=29823, env_extra=FSDP_ENV,
                  verify=False, root=root)
    assert rc == 0 and "loaded through the in-memory resharder" in log, log[-3000:]
    assert _alike(log, oracle, False), log[-3000:]
    extra = os.environ.get("MEGATRON_LM_EXTRA_ARGS", "").split()
    run_flags = [*TINY, *extra, "--transformer-impl", "transformer_engine", *flags, "--world-size", "2"]
    new = str(tmp_path / "rewritten")
    follow_advice(src, run_flags, new, "--megatron-version", "0.19")
    rc, log = run(tmp_path, new, 2, *flags, plugin=False, te=True, port=29824, env_extra=FSDP_ENV, verify=False,
                  root=root)
    assert rc == 0 and _alike(log, oracle, False), log[-3000:]

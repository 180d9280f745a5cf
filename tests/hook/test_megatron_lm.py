"""End to end against the REAL Megatron-LM pretrain_gpt.py (skipped unless MEGATRON_LM_ROOT is set).

Environment: MEGATRON_LM_ROOT (a Megatron-LM checkout), MEGATRON_LM_PYTHON (a Python with Megatron-LM's
dependencies and megatron-preflight installed; default: this one), MEGATRON_LM_PYTHONPATH (extra entries, e.g. the
CPU shim of shared/tools/megatron-lm-cpu), MEGATRON_LM_EXTRA_ARGS (extra flags, e.g. the CPU flags).
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import fixture_path
from tests.helpers.tiny import MODEL_FLAGS

ROOT = os.environ.get("MEGATRON_LM_ROOT")
pytestmark = pytest.mark.skipif(not ROOT, reason="MEGATRON_LM_ROOT is not set: no real Megatron-LM checkout here "
                                                  "(megatron.training is not on PyPI)")

TINY = MODEL_FLAGS + ("--hidden-dropout 0 --attention-dropout 0 --micro-batch-size 1 --global-batch-size 2 --lr 1e-4 "
                      "--min-lr 1e-5 --lr-decay-style constant --mock-data --seed 1234 --log-interval 1 "
                      "--eval-iters 0 --eval-interval 1000 --train-iters 3 "
                      "--use-checkpoint-opt-param-scheduler").split()


# tests/fixtures/megatron-lm/LOCAL_FIXTURES.md: bf16 (fp32 master copies in the optimizer state), GQA, SwiGLU, RoPE,
# RMSNorm, untied head, no biases.
BF16_GQA = ("--bf16 --group-query-attention --num-query-groups 2 --swiglu --position-embedding-type rope "
            "--untie-embeddings-and-output-weights --normalization RMSNorm --disable-bias-linear").split()


FP16_QKLN = "--fp16 --initial-loss-scale 256 --qk-layernorm --position-embedding-type rope".split()
VPP_QKLN = "--qk-layernorm --swiglu".split()
MOE_SHARED = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-shared-expert-intermediate-size", "64",
              "--moe-layer-freq", "([0]+[1]*3)", "--swiglu", "--group-query-attention", "--num-query-groups", "2",
              "--disable-bias-linear", "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid"]

# tests/fixtures/megatron-lm/LOCAL_FIXTURES.md: the model flags of vppmoe_distopt_tp2pp2ep2 (its parallel sizes apart)
VPPMOE = ("--group-query-attention --num-query-groups 2 --swiglu --add-qkv-bias --disable-bias-linear "
          "--untie-embeddings-and-output-weights --position-embedding-type learned_absolute --num-experts 4 "
          "--moe-router-topk 2 --moe-ffn-hidden-size 48 --moe-layer-freq [1,0,1,1] --moe-router-load-balancing-type "
          "aux_loss --moe-aux-loss-coeff 0.01 --use-distributed-optimizer").split()


# The CPU stand-in for Transformer Engine 2.17.1 (../shared/tools/megatron-lm-cpu/te_cpu; NOT Transformer Engine:
# checkpoint-visible facts, plain torch math, no FP8). The TE-spec tests below run only when it is given.
TE_CPU = os.environ.get("MEGATRON_LM_TE_CPU")
# The CPU stand-ins for mamba_ssm 2.3.2.post1 and fla 0.5.1 (../shared/tools/megatron-lm-cpu/mamba_cpu; NOT those
# packages: their parameter layout and reference math): HybridModel's Mamba-2 and gated delta net layers on CPU.
MAMBA_CPU = os.environ.get("MEGATRON_LM_MAMBA_CPU")
TE_SPEC = ["--transformer-impl", "transformer_engine"]


# Every resume is verified (issue 20, proof (d): no false alarm, whoever loads): `run` takes the checkpoint's
# fingerprints (`megatron-preflight fingerprint`, unless they are stored already: `reshard --fingerprint` writes its
# output's as it streams) and turns `--preflight auto` into `--preflight verify` (auto + the proof after the load); a
# run without the plugin (Megatron's own parsing, checks and loaders, untouched) gets VERIFYING_LAUNCHER, which only
# calls verify after Megatron's own load_checkpoint. A run that trains must then say the loaded state equals the
# fingerprints, and no run may report a difference. MEGATRON_LM_VERIFY_EVERY_LOAD=0 turns it off; tests that damage a
# fingerprinted checkpoint on purpose pass verify=False to their plain run.
VERIFY_EVERY_LOAD = os.environ.get("MEGATRON_LM_VERIFY_EVERY_LOAD", "1") != "0"
VERIFIED = re.compile(r"verify: the loaded (model and optimizer state equal|model equals) the checkpoint's "
                      r"fingerprints")
VERIFYING_LAUNCHER = """
import runpy, sys
import megatron.training.checkpointing as ck, megatron.training.training as tr
from megatron.training.global_vars import get_args
from megatron_preflight.hook import verify
original = ck.load_checkpoint
def load_then_verify(ddp_model, optimizer, opt_param_scheduler, load_arg="load", *a, **k):
    result = original(ddp_model, optimizer, opt_param_scheduler, load_arg, *a, **k)
    if load_arg == "load" and result and result[0] > 0:
        verify.verify_after_load(ddp_model, get_args(), optimizer)
    return result
ck.load_checkpoint = tr.load_checkpoint = load_then_verify
sys.argv = ["SCRIPT", *sys.argv[1:]]
runpy.run_path("SCRIPT", run_name="__main__")
"""


def _fingerprinted_here(root) -> bool:
    """Whether ``root`` (a checkpoint root) has fingerprints stored, taking them if it has none; False for a
    directory without a checkpoint (a run that starts from scratch) or one the fingerprint command refuses."""
    if os.path.isdir(os.path.join(root, "megatron_preflight_fingerprints")):
        return True
    if not os.path.exists(os.path.join(root, "latest_checkpointed_iteration.txt")):
        return False
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "fingerprint", str(root)], capture_output=True,
                       text=True, timeout=300)
    return r.returncode == 0


def _verifying(tmp_path, dst, plugin, launch, flags, script="pretrain_gpt.py"):
    """(flags, launch, verifying) for a run of the checkpoint at ``dst``: see VERIFY_EVERY_LOAD."""
    if launch is not None or not _fingerprinted_here(dst):
        return flags, launch, False
    if plugin:
        at = [i for i, f in enumerate(flags[:-1]) if f == "--preflight" and flags[i + 1] == "auto"]
        if not at:
            return flags, launch, False
        return [*flags[:at[0] + 1], "verify", *flags[at[0] + 2:]], launch, True
    launcher = tmp_path / "verifying_launcher.py"
    launcher.write_text(VERIFYING_LAUNCHER.replace("SCRIPT", script))
    return flags, [str(launcher)], True


def megatron_env(root: str, te: bool = False, mamba: bool = False) -> tuple[str, dict]:
    """(the Python that runs Megatron-LM, its environment) for the Megatron-LM work tree ``root`` (``te``, ``mamba``:
    with the CPU stand-ins for Transformer Engine, and for mamba_ssm and fla, on the path)."""
    python = os.environ.get("MEGATRON_LM_PYTHON", sys.executable)
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="1")
    extra_path = [os.environ.get("MEGATRON_LM_PYTHONPATH", ""), root] + ([TE_CPU] if te else []) + (
        [MAMBA_CPU] if mamba else [])
    env["PYTHONPATH"] = os.pathsep.join(p for p in extra_path + [env.get("PYTHONPATH", "")] if p)
    env["PATH"] = os.path.dirname(python) + os.pathsep + env.get("PATH", "")  # Megatron builds helpers with python3
    return python, env


def run(tmp_path, ckpt, nproc, *flags, plugin=True, port=29700, te=False, drop=(), launch=None,
        verify=VERIFY_EVERY_LOAD, root=None, script="pretrain_gpt.py", base=None, env_extra=None):
    """``script`` (pretrain_gpt.py; pretrain_hybrid.py runs with both stand-ins) of the Megatron-LM work tree ``root``
    (default MEGATRON_LM_ROOT) loading a copy of ``ckpt``, with the ``base`` flags (default TINY): (exit status,
    log)."""
    root = root or ROOT
    hybrid = script == "pretrain_hybrid.py"
    python, env = megatron_env(root, te or hybrid, mamba=hybrid)
    env.update(env_extra or {})
    dst = tmp_path / os.path.basename(ckpt)
    if not dst.exists():
        shutil.copytree(ckpt, dst)
    verifying = False
    if verify:
        flags, launch, verifying = _verifying(tmp_path, dst, plugin, launch, list(flags), script)
    launch = launch or (["-m", "megatron_preflight.run", script] if plugin else [script])
    cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port),
           *launch, *_without(TINY if base is None else base, drop), *os.environ.get("MEGATRON_LM_EXTRA_ARGS", "").split(),
           *(TE_SPEC if te or hybrid else []),
           "--load", str(dst), *flags]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    log = r.stdout + r.stderr
    if verifying:
        assert "is not the checkpoint's" not in log and "no longer matches its fingerprints" not in log, log[-3000:]
        if "lm loss" in log:  # it loaded and trained: verify ran between the two
            assert VERIFIED.search(log), log[-3000:]
        _record(ckpt, plugin, VERIFIED.search(log) is not None)
    return r.returncode, log


def _record(ckpt, plugin, verified):
    """Appends one line per verified run to MEGATRON_LM_VERIFY_RECORD (a file), for the counts in the notes."""
    where = os.environ.get("MEGATRON_LM_VERIFY_RECORD")
    if where:
        with open(where, "a") as f:
            f.write(json.dumps({"ckpt": os.path.basename(str(ckpt)), "plugin": plugin, "verified": verified}) + "\n")


def _without(flags, drop):
    """``flags`` less the ``drop`` flags, each with its value (the next word when it is not a flag)."""
    out, skip = [], False
    for i, f in enumerate(flags):
        if skip:
            skip = False
            continue
        if f in drop:
            skip = i + 1 < len(flags) and not flags[i + 1].startswith("--")
            continue
        out.append(f)
    return out


def loss(log, it=3, total=3):
    m = re.search(rf"iteration +{it}/ +{total} .*?lm loss: ([0-9.E+-]+)", log)
    return m.group(1) if m else None


def mtp_losses(log):
    """Every MTP loss the run printed, in order."""
    return re.findall(r"mtp_1 loss: ([0-9.E+-]+)", log)


def assert_trains_alike_with_mtp(log, oracle):
    """Iterations 3 and 4 of a 4-iteration resume (iteration 4 needs the loaded Adam moments), and every MTP loss,
    equal the oracle run's."""
    assert loss(log, 4, 4) is not None and (loss(log, 3, 4), loss(log, 4, 4)) == (loss(oracle, 3, 4),
                                                                                   loss(oracle, 4, 4))
    assert mtp_losses(log) and mtp_losses(log) == mtp_losses(oracle)


def test_tp2_legacy_at_tp1_auto_equals_megatrons_dist_reshard(tmp_path):
    rc, log = run(tmp_path, fixture_path("tp2_torch"), 1, "--preflight", "auto", "--no-load-optim",
                  "--ckpt-format", "torch")
    assert rc == 0, log[-3000:]
    assert "loaded through the in-memory resharder" in log
    rc2, log2 = run(tmp_path, fixture_path("tp2_torch_dist"), 1, "--no-load-optim", "--no-load-rng",
                    "--ckpt-format", "torch_dist", plugin=False, port=29701)
    assert rc2 == 0, log2[-3000:]
    assert loss(log) is not None and loss(log) == loss(log2)


@pytest.mark.parametrize("legacy, dist, nproc, flags", [
    ("tp2_torch", "tp2_torch_dist", 1, []),
    ("pp2_torch", None, 1, []),
    ("moe_ep2_torch", "moe_ep2_torch_dist", 2,
     ["--num-experts", "4", "--moe-router-topk", "2", "--tensor-model-parallel-size", "2",
      "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--sequence-parallel"]),
    ("bf16_gqa_tp2_torch", "bf16_gqa_tp2_torch_dist", 1, BF16_GQA),
    ("fp16_qkln_tp2_torch", "fp16_qkln_tp2_torch_dist", 1, FP16_QKLN),
    ("vpp_qkln_pp2_torch", "vpp_qkln_pp2_torch_dist", 2, VPP_QKLN + ["--tensor-model-parallel-size", "2"]),
    ("moe_shared_tp2pp2ep2_torch", "moe_shared_tp2pp2ep2_torch_dist", 2, MOE_SHARED + ["--expert-model-parallel-size",
                                                                                     "2"]),
    ("declr_tp2_torch", "declr_tp2_torch_dist", 2, ["--decoupled-lr", "5e-4", "--decoupled-min-lr", "5e-5",
                                                    "--pipeline-model-parallel-size", "2"]),
    ("acct_emb_pp2_torch", "acct_emb_pp2_torch_dist", 1, ["--num-layers", "5"]),
    ("acct_emb_pp2_torch", "acct_emb_pp2_torch_dist", 3, ["--num-layers", "5", "--pipeline-model-parallel-size", "3",
                                                          "--account-for-embedding-in-pipeline-split"]),
], ids=["tp2->tp1", "pp2->pp1", "moe ep2->tp2ep2etp1", "bf16 gqa swiglu rope untied tp2->tp1", "fp16 qk-ln tp2->tp1",
        "vpp2 pp2->tp2", "moe shared-experts tp2pp2ep2->ep2dp2", "decoupled-lr tp2->pp2",
        "embedding-in-split pp2 [2,3] -> pp1",
        "embedding-in-split pp2 [2,3] -> pp3 [1,2,2]"])
def test_resharded_adam_state_trains_like_megatrons_dist_reshard(tmp_path, legacy, dist, nproc, flags):
    """With the optimizer state loaded (no --no-load-optim): the Adam moments decide the updates of iterations 3 and
    4, so the iteration-4 loss equals Megatron's own reshard of the torch_dist twin (weights and optimizer) only if
    every exp_avg / exp_avg_sq reached the right parameter."""
    rc, log = run(tmp_path, fixture_path(legacy), nproc, "--preflight", "auto", "--ckpt-format", "torch",
                  "--train-iters", "4", *flags, port=29710)
    assert rc == 0, log[-3000:]
    assert "loaded through the in-memory resharder" in log and "applied: no_load_optim" not in log
    assert loss(log, 4, 4) is not None
    if dist is None:  # no torch_dist twin of this fixture
        return
    rc2, log2 = run(tmp_path, fixture_path(dist), nproc, "--no-load-rng", "--ckpt-format", "torch_dist",
                    "--train-iters", "4", *flags, plugin=False, port=29711)
    assert rc2 == 0, log2[-3000:]
    assert (loss(log, 3, 4), loss(log, 4, 4)) == (loss(log2, 3, 4), loss(log2, 4, 4))


@pytest.mark.parametrize("legacy, dist, nproc, target, flags", [
    ("tp2_torch", "tp2_torch_dist", 1, ["--tp", "1"], []),
    ("moe_ep2_torch", "moe_ep2_torch_dist", 2, ["--tp", "2", "--ep", "2", "--etp", "1"],
     ["--num-experts", "4", "--moe-router-topk", "2", "--tensor-model-parallel-size", "2",
      "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--sequence-parallel"]),
], ids=["tp2->tp1", "moe ep2->tp2ep2etp1"])
def test_offline_reshard_loads_in_plain_megatron(tmp_path, legacy, dist, nproc, target, flags):
    """`megatron-preflight reshard` output, weights and Adam state, resumed by Megatron WITHOUT the plugin: the
    losses of iterations 3 and 4 equal Megatron's own reshard of the torch_dist twin."""
    out = tmp_path / "resharded"
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", fixture_path(legacy), str(out),
                        *target, "--verify", "--fingerprint", "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rc, log = run(tmp_path, str(out), nproc, "--ckpt-format", "torch", "--no-load-rng", "--train-iters", "4", *flags,
                  plugin=False, port=29712)
    assert rc == 0, log[-3000:]
    rc2, log2 = run(tmp_path, fixture_path(dist), nproc, "--no-load-rng", "--ckpt-format", "torch_dist",
                    "--train-iters", "4", *flags, plugin=False, port=29713)
    assert rc2 == 0, log2[-3000:]
    assert loss(log, 4, 4) is not None
    assert (loss(log, 3, 4), loss(log, 4, 4)) == (loss(log2, 3, 4), loss(log2, 4, 4))


def test_moe_optimizer_merged_into_dense_groups_at_ep1(tmp_path):
    """TP2·PP2·EP2 -> TP1·PP1·EP1: the experts stop being expert-parallel, so their Adam state moves from the expert
    optimizer part into the dense groups. Megatron's own torch_dist load cannot do this ("Could not find parameter
    group ..."); the losses must match the EP2·DP2 run that Megatron can load (the same model and data, so the same
    trajectory up to reduction order)."""
    rc, log = run(tmp_path, fixture_path("moe_shared_tp2pp2ep2_torch"), 1, "--preflight", "auto", "--ckpt-format",
                  "torch", "--train-iters", "4", *MOE_SHARED, port=29714)
    assert rc == 0, log[-3000:]
    assert "loaded through the in-memory resharder" in log
    rc2, log2 = run(tmp_path, fixture_path("moe_shared_tp2pp2ep2_torch_dist"), 2, "--no-load-rng", "--ckpt-format",
                    "torch_dist", "--train-iters", "4", *MOE_SHARED, "--expert-model-parallel-size", "2", plugin=False,
                    port=29715)
    assert rc2 == 0, log2[-3000:]
    for it in (3, 4):
        assert abs(float(loss(log, it, 4)) - float(loss(log2, it, 4))) <= 2e-6


def test_the_padded_vocab_fix_resumes_the_saved_models_loss_at_another_tp(tmp_path):
    """tp2_torch (vocab 100: 256 padded rows at TP2) resumed at TP1: with the padding re-made (128 rows) the first loss
    moves (the padding logits were part of the softmax: 5.54 -> 4.85 here); with the divisor `check` names, it equals
    the loss of a plain same-layout resume at TP2 (to the rounding of TP1's sums against TP2's)."""
    runs = {}
    for name, nproc, flags, plugin in (("same", 2, ["--tensor-model-parallel-size", "2"], False),
                                       ("remade", 1, ["--preflight", "auto"], True),
                                       ("kept", 1, ["--preflight", "auto", "--make-vocab-size-divisible-by", "256"],
                                        True)):
        (tmp_path / name).mkdir()
        rc, log = run(tmp_path / name, fixture_path("tp2_torch"), nproc, *flags, "--ckpt-format", "torch",
                      plugin=plugin, port=29705)
        assert rc == 0 and loss(log) is not None, log[-3000:]
        runs[name] = loss(log)
    kept, same, remade = (float(runs[k]) for k in ("kept", "same", "remade"))
    assert abs(kept - same) <= 1e-6 * same < abs(remade - same), runs  # TP1 vs TP2 sums: the last printed digit


def test_pp2_legacy_at_pp1_auto(tmp_path):
    rc, log = run(tmp_path, fixture_path("pp2_torch"), 1, "--preflight", "auto", "--no-load-optim",
                  "--ckpt-format", "torch", port=29702)
    assert rc == 0, log[-3000:]
    assert "loaded through the in-memory resharder" in log and loss(log)


def test_moe_ep2_legacy_at_tp2_ep2_etp1_equals_megatrons_dist_reshard(tmp_path):
    # (EP1 itself loads too, but Megatron's local-spec MoE-with-bias training step fails at EP1 on its own, with
    # or without the plugin: "Output 0 of _ReduceFromModelParallelRegion is a view ...".)
    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--tensor-model-parallel-size", "2",
           "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--sequence-parallel"]
    rc, log = run(tmp_path, fixture_path("moe_ep2_torch"), 2, "--preflight", "auto", "--no-load-optim",
                  "--ckpt-format", "torch", *moe, port=29706)
    assert rc == 0, log[-3000:]
    rc2, log2 = run(tmp_path, fixture_path("moe_ep2_torch_dist"), 2, "--no-load-optim", "--no-load-rng",
                    "--ckpt-format", "torch_dist", *moe, plugin=False, port=29707)
    assert rc2 == 0, log2[-3000:]
    assert "loaded through the in-memory resharder" in log and loss(log) == loss(log2) is not None


def test_architecture_mismatch_fails_every_rank_before_model_build(tmp_path):
    rc, log = run(tmp_path, fixture_path("tp2_torch"), 2, "--preflight", "check", "--tensor-model-parallel-size",
                  "2", "--hidden-size", "64", "--ckpt-format", "torch", port=29703)
    assert rc != 0
    assert "hidden_size" in log and "the job must not start" in log
    assert "number of parameters" not in log  # the model was never built
    assert log.count("exitcode  : 1") >= 1 or "exitcode: 1" in log


def test_off_behaves_like_megatron(tmp_path):
    rc, log = run(tmp_path, fixture_path("tp2_torch"), 2, "--preflight", "off", "--tensor-model-parallel-size", "2",
                  "--ckpt-format", "torch", port=29704)
    rc2, log2 = run(tmp_path, fixture_path("tp2_torch"), 2, "--tensor-model-parallel-size", "2",
                    "--ckpt-format", "torch", plugin=False, port=29705)
    assert rc == rc2 == 0 and loss(log) == loss(log2) and "[megatron-preflight]" not in log


DISTOPT_MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear", "--global-batch-size", "4"]
BUCKETS = ["--overlap-grad-reduce", "--ddp-bucket-size", "3000"]


@pytest.mark.parametrize("legacy, nproc, target, flags", [
    ("distopt_tp2dp2_torch", 2, ["--tp", "1"], []),
    ("distopt_tp2dp2_torch", 4, ["--tp", "1", "--pp", "2"], ["--pipeline-model-parallel-size", "2"]),
    ("distopt_moe_ep2dp2_torch", 4, ["--ep", "4"], DISTOPT_MOE + ["--expert-model-parallel-size", "4"]),
    ("distopt_bf16_tp2dp2_torch", 2, ["--tp", "1"], ["--bf16"]),
    ("distopt_vpp_pp2dp2_torch", 2, ["--pp", "1"], ["--global-batch-size", "4"]),
    ("distopt_tp2dp2_torch", 2, [], ["--tensor-model-parallel-size", "2"]),
    ("distopt_buckets_tp2dp2_torch", 2, ["--tp", "1"], BUCKETS),
], ids=["tp2dp2->tp1dp2", "tp2dp2->tp1pp2dp2", "moe ep2dp4->ep4", "bf16 tp2dp2->tp1dp2", "vpp2 pp2dp2->pp1dp2",
        "dp-only tp2dp2->tp2dp1", "6 buckets tp2dp2->tp1dp2"])
def test_offline_distributed_optimizer_reshard_trains_like_megatrons_dist_reshard(tmp_path, legacy, nproc, target,
                                                                                    flags):
    """`megatron-preflight reshard` of a --use-distributed-optimizer checkpoint (distrib_optim.pt at DP 2+), resumed
    by plain Megatron with the distributed optimizer at the new layout: iterations 3 and 4 equal Megatron's own
    reshard of the twin saved with --dist-ckpt-optim-fully-reshardable (iteration 4 is the first that depends on the
    loaded Adam moments; iteration 3 on the fp32 masters the distributed optimizer copies into the weights)."""
    out = tmp_path / "resharded"
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", fixture_path(legacy), str(out),
                        *target, "--verify", "--fingerprint", "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    common = ("--no-load-rng", "--train-iters", "4", "--use-distributed-optimizer", *flags)
    rc, log = run(tmp_path, str(out), nproc, "--ckpt-format", "torch", *common, plugin=False, port=29714)
    assert rc == 0, log[-3000:]
    rc2, log2 = run(tmp_path, fixture_path(legacy + "_dist"), nproc, "--ckpt-format", "torch_dist", *common,
                    plugin=False, port=29715)
    assert rc2 == 0, log2[-3000:]
    assert loss(log, 4, 4) is not None
    assert (loss(log, 3, 4), loss(log, 4, 4)) == (loss(log2, 3, 4), loss(log2, 4, 4))


def test_distributed_optimizer_moe_to_ep1_resumes(tmp_path):
    """MoE EP2 -> EP1 with the distributed optimizer: the experts move from the expert part (expert DP 2) into the
    dense buffers (DP 4). Megatron's own reshard of the twin fails here; ours resumes. Iteration 3 (the fp32 masters,
    copied into the weights) equals the EP2 run Megatron can load; iteration 4 reduces the expert gradients over 4
    ranks instead of 2 (another summation order), so it is only close."""
    out = tmp_path / "ep1"
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", fixture_path("distopt_moe_ep2dp2_torch"),
                        str(out), "--ep", "1", "--verify", "--fingerprint", "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    common = ("--no-load-rng", "--train-iters", "4", "--use-distributed-optimizer", *DISTOPT_MOE)
    rc, log = run(tmp_path, str(out), 4, "--ckpt-format", "torch", *common, plugin=False, port=29716)
    assert rc == 0, log[-3000:]
    rc2, log2 = run(tmp_path, fixture_path("distopt_moe_ep2dp2_torch_dist"), 4, "--ckpt-format", "torch_dist",
                    "--expert-model-parallel-size", "2", *common, plugin=False, port=29717)
    assert rc2 == 0, log2[-3000:]
    assert loss(log, 3, 4) == loss(log2, 3, 4)
    assert abs(float(loss(log, 4, 4)) - float(loss(log2, 4, 4))) < 1e-3


@pytest.mark.parametrize("legacy, nproc, flags", [
    ("distopt_tp2dp2_torch", 2, []),
    ("distopt_tp2dp2_torch", 4, ["--pipeline-model-parallel-size", "2"]),
    ("distopt_moe_ep2dp2_torch", 4, DISTOPT_MOE + ["--expert-model-parallel-size", "4"]),
    ("distopt_bf16_tp2dp2_torch", 2, ["--bf16"]),
    ("distopt_vpp_pp2dp2_torch", 2, ["--global-batch-size", "4"]),
    ("distopt_buckets_tp2dp2_torch", 2, BUCKETS),
], ids=["tp2dp2->tp1dp2", "tp2dp2->tp1pp2dp2", "moe ep2dp4->ep4", "bf16 tp2dp2->tp1dp2", "vpp2 pp2dp2->pp1dp2",
        "6 buckets tp2dp2->tp1dp2"])
def test_in_memory_distributed_optimizer_reshard_trains_like_megatrons_dist_reshard(tmp_path, legacy, nproc, flags):
    """--preflight auto with --use-distributed-optimizer at a new layout: each data-parallel rank 0 builds its dir's
    distrib_optim.pt buffers in memory and Megatron scatters them; iterations 3 and 4 equal Megatron's own reshard of
    the fully reshardable torch_dist twin."""
    common = ("--no-load-rng", "--train-iters", "4", "--use-distributed-optimizer", *flags)
    rc, log = run(tmp_path, fixture_path(legacy), nproc, "--preflight", "auto", "--ckpt-format", "torch", *common,
                  port=29718)
    assert rc == 0, log[-3000:]
    assert "loaded through the in-memory resharder" in log and "applied: no_load_optim" not in log
    rc2, log2 = run(tmp_path, fixture_path(legacy + "_dist"), nproc, "--ckpt-format", "torch_dist", *common,
                    plugin=False, port=29719)
    assert rc2 == 0, log2[-3000:]
    assert loss(log, 4, 4) is not None
    assert (loss(log, 3, 4), loss(log, 4, 4)) == (loss(log2, 3, 4), loss(log2, 4, 4))


@pytest.mark.parametrize("source, target_kind, run_flags, oracle, oracle_flags", [
    ("distopt_tp2dp2_torch", "plain", [], "tp2_torch_dist", []),
    ("tp2_torch", "distributed", ["--use-distributed-optimizer"], "distopt_tp2dp2_torch_dist",
     ["--use-distributed-optimizer"]),
], ids=["distributed->plain", "plain->distributed"])
@pytest.mark.parametrize("how", ["offline", "in-memory"])
def test_toggling_the_distributed_optimizer_converts_its_state(tmp_path, source, target_kind, run_flags, oracle,
                                                               oracle_flags, how):
    """A run that toggles --use-distributed-optimizer (and changes TP2 -> TP1) resumes WITH the optimizer state,
    converted. The oracle is Megatron's own reshard of a twin saved with the target's optimizer: tp2_torch (plain, DP1)
    and distopt_tp2dp2_torch (distributed, DP2) were trained with the same seed, data and model flags, so they hold
    the same weights and Adam moments (their iteration-3 losses are equal) and differ only in the optimizer kind."""
    common = ("--no-load-rng", "--train-iters", "4", *run_flags)
    if how == "offline":
        out = tmp_path / "converted"
        r = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", fixture_path(source), str(out),
                            "--tp", "1", "--optimizer", target_kind, "--verify", "--fingerprint", "--no-progress"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "optimizer state was converted" in r.stdout, r.stderr
        rc, log = run(tmp_path, str(out), 1, "--ckpt-format", "torch", *common, plugin=False, port=29720)
    else:
        rc, log = run(tmp_path, fixture_path(source), 1, "--preflight", "auto", "--ckpt-format", "torch", *common,
                      port=29720)
        assert "loaded through the in-memory resharder" in log and "applied: no_load_optim" not in log
    assert rc == 0, log[-3000:]
    rc2, log2 = run(tmp_path, fixture_path(oracle), 1, "--ckpt-format", "torch_dist", "--no-load-rng",
                    "--train-iters", "4", *oracle_flags, plugin=False, port=29721)
    assert rc2 == 0, log2[-3000:]
    assert loss(log, 4, 4) is not None
    assert (loss(log, 3, 4), loss(log, 4, 4)) == (loss(log2, 3, 4), loss(log2, 4, 4))


@pytest.mark.parametrize("dist, nproc, target, flags", [
    ("tp2_torch_dist", 1, ["--tp", "1"], []),
    ("bf16_gqa_tp2_torch_dist", 2, ["--tp", "1", "--pp", "2"], BF16_GQA + ["--pipeline-model-parallel-size", "2"]),
    ("moe_ep2_torch_dist", 2, ["--tp", "2", "--ep", "2", "--etp", "1"],
     ["--num-experts", "4", "--moe-router-topk", "2", "--tensor-model-parallel-size", "2",
      "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--sequence-parallel"]),
    ("distopt_tp2dp2_torch_dist", 2, ["--tp", "1"], ["--use-distributed-optimizer"]),
], ids=["tp2->tp1", "bf16 gqa tp2->tp1pp2", "moe ep2->tp2ep2etp1", "distopt fully-reshardable tp2dp2->tp1dp2"])
def test_torch_dist_to_legacy_loads_in_plain_megatron(tmp_path, dist, nproc, target, flags):
    """torch_dist -> legacy at another layout, weights and optimizer state (`reshard` of a torch_dist source), resumed
    by Megatron WITHOUT the plugin: iterations 3 and 4 equal Megatron's own load of the torch_dist checkpoint at that
    layout (its dist loader reshards it)."""
    out = tmp_path / "legacy"
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", fixture_path(dist), str(out),
                        *target, "--verify", "--fingerprint", "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    common = ("--no-load-rng", "--train-iters", "4", *flags)
    rc, log = run(tmp_path, str(out), nproc, "--ckpt-format", "torch", *common, plugin=False, port=29730)
    assert rc == 0, log[-3000:]
    rc2, log2 = run(tmp_path, fixture_path(dist), nproc, "--ckpt-format", "torch_dist", *common, plugin=False,
                    port=29731)
    assert rc2 == 0, log2[-3000:]
    assert loss(log, 4, 4) is not None
    assert (loss(log, 3, 4), loss(log, 4, 4)) == (loss(log2, 3, 4), loss(log2, 4, 4))


def test_dp_reshardable_converted_at_its_own_layout_trains_like_the_twins(tmp_path):
    """Megatron's default torch_dist distributed-optimizer form (dp_reshardable) -> legacy at the same TP2·DP2, resumed
    by plain Megatron: iterations 3 and 4 agree with Megatron's own load of the legacy twin (an earlier run with the
    same flags, values within 4.2e-8) to 1e-5. Measured here: ours 5.542379 / 5.529448, the legacy twin and the
    fully_reshardable twin 5.542380 / 5.529448 — while Megatron's own reload of the dp_reshardable checkpoint gives
    5.542379 / 5.529378 (its iteration-4 update differs; not asserted, recorded in the notes)."""
    src = fixture_path("distopt_dpr_tp2dp2_torch_dist")
    out = tmp_path / "legacy"
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", src, str(out), "--verify",
                        "--fingerprint", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    common = ("--no-load-rng", "--train-iters", "4", "--use-distributed-optimizer", "--tensor-model-parallel-size", "2")
    rc, log = run(tmp_path, str(out), 4, "--ckpt-format", "torch", *common, plugin=False, port=29732)
    assert rc == 0, log[-3000:]
    rc2, log2 = run(tmp_path, fixture_path("distopt_tp2dp2_torch"), 4, "--ckpt-format", "torch", *common,
                    plugin=False, port=29733)
    assert rc2 == 0, log2[-3000:]
    for it in (3, 4):
        assert abs(float(loss(log, it, 4)) - float(loss(log2, it, 4))) < 1e-5, (it, loss(log, it, 4), loss(log2, it, 4))


@pytest.mark.parametrize("dpr, nproc, target, flags", [
    ("distopt_dpr_tp2dp2_torch_dist", 2, ["--tp", "1"], []),
    ("distopt_dpr_moe_ep2dp2_torch_dist", 4, ["--ep", "4"], DISTOPT_MOE + ["--expert-model-parallel-size", "4"]),
    ("distopt_dpr_bf16_tp2dp2_torch_dist", 2, ["--tp", "1"], ["--bf16"]),
], ids=["tp2dp2->tp1dp2", "moe ep2dp4->ep4", "bf16 tp2dp2->tp1dp2"])
def test_dp_reshardable_at_a_layout_megatron_refuses_trains_like_the_twin(tmp_path, dpr, nproc, target, flags):
    """The layout change Megatron refuses for dp_reshardable (TP/PP, EP): converted offline, resumed by plain Megatron.
    The oracle is Megatron's own reshard of the fully_reshardable twin saved by an earlier run with the same flags
    (its values differ by <= 4.2e-8), so the losses agree to 5 decimals rather than bit for bit."""
    out = tmp_path / "legacy"
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", fixture_path(dpr), str(out), *target,
                        "--verify", "--fingerprint", "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    common = ("--no-load-rng", "--train-iters", "4", "--use-distributed-optimizer", *flags)
    rc, log = run(tmp_path, str(out), nproc, "--ckpt-format", "torch", *common, plugin=False, port=29734)
    assert rc == 0, log[-3000:]
    twin = dpr.replace("distopt_dpr_", "distopt_")
    rc2, log2 = run(tmp_path, fixture_path(twin), nproc, "--ckpt-format", "torch_dist", *common, plugin=False,
                    port=29735)
    assert rc2 == 0, log2[-3000:]
    for it in (3, 4):
        assert abs(float(loss(log, it, 4)) - float(loss(log2, it, 4))) < 1e-5, (it, loss(log, it, 4), loss(log2, it, 4))


MOE_EP4 = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "4",
           "--global-batch-size", "4"]


@pytest.mark.parametrize("dist, oracle, nproc, flags", [
    ("distopt_dpr_tp2dp2_torch_dist", "distopt_tp2dp2_torch_dist", 2,
     ["--use-distributed-optimizer", "--tensor-model-parallel-size", "1"]),
    ("moe_ep2_torch_dist", "moe_ep2_torch", 4, MOE_EP4),
], ids=["dp_reshardable tp2dp2->tp1dp2", "plain optimizer moe ep2->ep4"])
def test_torch_dist_that_megatron_refuses_loads_in_memory_with_auto(tmp_path, dist, oracle, nproc, flags):
    """torch_dist checkpoints whose optimizer state Megatron's own loader refuses at the run's layout (dp_reshardable
    at another TP; any EP change): `--preflight auto` loads weights and optimizer state through the in-memory
    resharder. Oracles: the dp_reshardable case against Megatron's own reshard of the fully_reshardable twin (an
    earlier run, values within 4.2e-8, so losses within 1e-5); the MoE case against the in-memory reshard of its
    bit-identical legacy twin (exactly equal)."""
    rc, log = run(tmp_path, fixture_path(dist), nproc, "--preflight", "auto", "--ckpt-format", "torch_dist",
                  "--train-iters", "4", *flags, port=29736)
    assert rc == 0, log[-3000:]
    assert "loaded through the in-memory resharder" in log and "applied: no_load_optim" not in log
    if oracle.endswith("_torch_dist"):
        rc2, log2 = run(tmp_path, fixture_path(oracle), nproc, "--no-load-rng", "--ckpt-format", "torch_dist",
                        "--train-iters", "4", *flags, plugin=False, port=29737)
        assert rc2 == 0, log2[-3000:]
        for it in (3, 4):
            assert abs(float(loss(log, it, 4)) - float(loss(log2, it, 4))) < 1e-5, (it, loss(log, it, 4),
                                                                                   loss(log2, it, 4))
    else:
        rc2, log2 = run(tmp_path, fixture_path(oracle), nproc, "--preflight", "auto", "--ckpt-format", "torch",
                        "--train-iters", "4", *flags, port=29737)
        assert rc2 == 0, log2[-3000:]
        assert loss(log, 4, 4) is not None
        assert (loss(log, 3, 4), loss(log, 4, 4)) == (loss(log2, 3, 4), loss(log2, 4, 4))


@pytest.mark.parametrize("legacy, dist, nproc, flags", [
    ("tp2_torch", "tp2_torch_dist", 1, []),
    ("bf16_gqa_tp2_torch", "bf16_gqa_tp2_torch_dist", 2, BF16_GQA + ["--pipeline-model-parallel-size", "2"]),
    ("moe_ep2_torch", "moe_ep2_torch_dist", 2,
     ["--num-experts", "4", "--moe-router-topk", "2", "--tensor-model-parallel-size", "2",
      "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--sequence-parallel"]),
    ("distopt_tp2dp2_torch", "distopt_tp2dp2_torch_dist", 2, ["--use-distributed-optimizer"]),
], ids=["tp2 -> torch_dist -> tp1", "bf16 gqa tp2 -> torch_dist -> tp1pp2", "moe ep2 -> torch_dist -> tp2ep2etp1",
        "distopt tp2dp2 -> torch_dist (fully_reshardable) -> tp1dp2"])
def test_legacy_to_torch_dist_loads_in_plain_megatron_at_another_layout(tmp_path, legacy, dist, nproc, flags):
    """`reshard --ckpt-format torch_dist` of a legacy checkpoint, weights and optimizer state, loaded by Megatron
    WITHOUT the plugin at another layout (its dist loader reshards it): iterations 3 and 4 equal Megatron's own load of
    the torch_dist twin."""
    out = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", fixture_path(legacy), str(out),
                        "--ckpt-format", "torch_dist", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    common = ("--no-load-rng", "--ckpt-format", "torch_dist", "--train-iters", "4", *flags)
    rc, log = run(tmp_path, str(out), nproc, *common, plugin=False, port=29738)
    assert rc == 0, log[-3000:]
    rc2, log2 = run(tmp_path, fixture_path(dist), nproc, *common, plugin=False, port=29739)
    assert rc2 == 0, log2[-3000:]
    assert loss(log, 4, 4) is not None
    assert (loss(log, 3, 4), loss(log, 4, 4)) == (loss(log2, 3, 4), loss(log2, 4, 4))


te_only = pytest.mark.skipif(not TE_CPU, reason="MEGATRON_LM_TE_CPU (the CPU stand-in for Transformer Engine) is not set")


@te_only
def test_te_torch_dist_with_fused_adam_offline_trains_like_megatrons_own_load(tmp_path):
    """TE spec (the stand-in), TE's FusedAdam, torch_dist TP2 -> legacy TP1 offline, weights and the per-group-step
    Adam state: iterations 3 and 4 equal Megatron's own load of the torch_dist twin at TP1."""
    out = tmp_path / "te_tp1"
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", fixture_path("te_tp2_torch_dist"),
                        str(out), "--tp", "1", "--verify", "--fingerprint", "--no-progress"],
                       capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    rc, log = run(tmp_path, str(out), 1, "--ckpt-format", "torch", "--no-load-rng", "--train-iters", "4",
                  plugin=False, port=29760, te=True)
    assert rc == 0, log[-3000:]
    rc2, log2 = run(tmp_path, fixture_path("te_tp2_torch_dist"), 1, "--ckpt-format", "torch_dist", "--no-load-rng",
                    "--train-iters", "4", plugin=False, port=29761, te=True)
    assert rc2 == 0, log2[-3000:]
    assert loss(log, 4, 4) is not None and (loss(log, 3, 4), loss(log, 4, 4)) == (loss(log2, 3, 4), loss(log2, 4, 4))


@te_only
def test_te_production_default_at_another_tp_loads_in_memory(tmp_path):
    """The production default (TE spec, FusedAdam, --use-distributed-optimizer, torch_dist dp_reshardable) at TP1
    through --preflight auto (Megatron refuses dp_reshardable across a TP change): iterations 3 and 4 equal Megatron's
    own load of the plain twin at TP1 (the same model, data and Adam math)."""
    rc, log = run(tmp_path, fixture_path("te_distopt_tp2dp2_torch_dist"), 2, "--ckpt-format", "torch_dist",
                  "--use-distributed-optimizer", "--tensor-model-parallel-size", "1", "--no-load-rng",
                  "--train-iters", "4", "--preflight", "auto", port=29762, te=True)
    assert rc == 0, log[-3000:]
    assert "loaded through the in-memory resharder" in log
    rc2, log2 = run(tmp_path, fixture_path("te_tp2_torch_dist"), 1, "--ckpt-format", "torch_dist", "--no-load-rng",
                    "--train-iters", "4", plugin=False, port=29763, te=True)
    assert rc2 == 0, log2[-3000:]
    assert loss(log, 4, 4) is not None and (loss(log, 3, 4), loss(log, 4, 4)) == (loss(log2, 3, 4), loss(log2, 4, 4))


# tests/fixtures/megatron-lm/LOCAL_FIXTURES.md: multi-latent attention (TE spec through the stand-in: the up projections
# fused with their q/kv layernorm), trained at TP2 with sequence parallelism (the duplicated down projections' gradients
# are reduced over TP only then)
MLA = ("--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 8 --qk-head-dim 8 --qk-pos-emb-head-dim 4 "
       "--v-head-dim 6 --qk-layernorm --position-embedding-type rope --rope-type rope --sequence-parallel").split()


# multi-token prediction (DeepSeek-V3's form: untied head), TE spec through the stand-in, trained at TP2·PP2: the MTP
# layer on the last stage, which holds its own copy of the word embedding (LOCAL_FIXTURES.md)
MTP = "--mtp-num-layers 1 --position-embedding-type rope --untie-embeddings-and-output-weights".split()
MTP_MOE = "--num-experts 4 --moe-router-topk 2 --disable-bias-linear --moe-grouped-gemm".split()


@te_only
@pytest.mark.parametrize("name, nproc, flags", [
    ("mtp_te_tp2pp2", 1, []), ("mtp_te_tp2pp2", 2, ["--tensor-model-parallel-size", "2"]),
    # an MoE MTP layer, EP2 -> PP2·EP2 (Megatron's own torch_dist load cannot change EP with the plain optimizer)
    ("mtp_moe_te_ep2", 4, MTP_MOE + ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]),
])
def test_mtp_legacy_at_another_layout_loads_in_memory_like_megatrons_dist_reshard(tmp_path, name, nproc, flags):
    """A legacy MTP checkpoint (TP2·PP2; an MoE one at EP2) at another layout through --preflight auto: iterations
    3 and 4 (the main and the MTP loss) equal Megatron's own load of the torch_dist twin at that layout."""
    rc, log = run(tmp_path, fixture_path(f"{name}_torch"), nproc, *MTP, *flags, "--ckpt-format", "torch",
                  "--no-load-rng", "--train-iters", "4", "--preflight", "auto", port=29769, te=True)
    assert rc == 0, log[-3000:]
    assert "loaded through the in-memory resharder" in log
    rc2, log2 = run(tmp_path, fixture_path(f"{name}_torch_dist"), nproc, *MTP, *flags, "--ckpt-format",
                    "torch_dist", "--no-load-rng", "--train-iters", "4", plugin=False, port=29770, te=True)
    assert rc2 == 0, log2[-3000:]
    assert_trains_alike_with_mtp(log, log2)


@te_only
@pytest.mark.parametrize("legacy, nproc, flags", [
    ("te_tp2_torch", 1, []),
    ("mla_te_tp2_torch", 1, MLA),
    ("mtp_te_tp2pp2_torch", 2, MTP + ["--pipeline-model-parallel-size", "2"]),
    ("mtp_moe_te_ep2_torch", 2, MTP + MTP_MOE + ["--expert-model-parallel-size", "2"]),
    ("mtp_te_distopt_pp2dp2_torch", 4, MTP + ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                                              "--global-batch-size", "4"]),
], ids=["te tp2 -> tp1", "mla tp2 -> tp1", "mtp tp2pp2 -> tp1pp2", "mtp moe ep2 -> ep2", "mtp distopt pp2dp2"])
def test_te_legacy_to_torch_dist_loads_in_plain_megatron(tmp_path, legacy, nproc, flags):
    """`reshard --ckpt-format torch_dist` of a Transformer Engine-spec legacy checkpoint (the stand-in), weights and
    optimizer state, loaded by plain Megatron's dist loader: every module's extra state is a sharded object where
    Megatron looks for it (the final norm's too: 'Missing key in checkpoint state_dict: decoder.final_layernorm.
    _extra_state/shard_0_1' otherwise), an MTP layer's inner layer is `transformer_layer`, its experts stacked.
    Iterations 3 and 4 (main and MTP loss) equal Megatron's own load of the torch_dist twin."""
    out = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", fixture_path(legacy), str(out),
                        "--ckpt-format", "torch_dist", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    common = ("--no-load-rng", "--ckpt-format", "torch_dist", "--train-iters", "4", *flags)
    rc, log = run(tmp_path, str(out), nproc, *common, plugin=False, port=29777, te=True)
    assert rc == 0, log[-3000:]
    rc2, log2 = run(tmp_path, fixture_path(legacy + "_dist"), nproc, *common, plugin=False, port=29778, te=True)
    assert rc2 == 0, log2[-3000:]
    assert loss(log, 4, 4) is not None
    assert (loss(log, 3, 4), loss(log, 4, 4)) == (loss(log2, 3, 4), loss(log2, 4, 4))
    assert mtp_losses(log) == mtp_losses(log2)


@te_only
def test_dp_reshardable_converted_to_torch_dist_resumes_exactly_like_the_source(tmp_path):
    """The production default (TE spec, FusedAdam, distributed optimizer, torch_dist dp_reshardable) through `reshard
    --ckpt-format torch_dist` at its own layout (the fully_reshardable form): plain Megatron's resume of it equals its
    resume of the source, iterations 3 and 4 (the second needs the loaded Adam moments and step).

    Why FusedAdam: with torch's Adam (no TE or apex) Megatron's own reload of a dp_reshardable state is not the saved
    state on the CPU runner: the per-parameter `step` is a LocalNonpersistentObject in that form, so the loaded
    optimizer keeps the fresh state's step (0) while the param groups say 2 (bias correction restarts; measured:
    iteration 4 5.529378 vs 5.529448 for the legacy twin, the fully_reshardable twin and this conversion). On a GPU
    without TE or apex, Megatron's DistributedOptimizer.state_dict() asserts on that empty state instead; the runner
    patches that assert (shim patch 8). FusedAdam keeps the step in the param groups: the two resumes are equal."""
    src = fixture_path("te_distopt_tp2dp2_torch_dist")
    out = tmp_path / "converted"
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", src, str(out), "--ckpt-format",
                        "torch_dist", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    common = ("--no-load-rng", "--ckpt-format", "torch_dist", "--train-iters", "4", "--use-distributed-optimizer",
              "--tensor-model-parallel-size", "2")
    rc, log = run(tmp_path, str(out), 4, *common, plugin=False, port=29779, te=True)
    assert rc == 0, log[-3000:]
    rc2, log2 = run(tmp_path, src, 4, *common, plugin=False, port=29780, te=True)
    assert rc2 == 0, log2[-3000:]
    assert loss(log, 4, 4) is not None
    assert (loss(log, 3, 4), loss(log, 4, 4)) == (loss(log2, 3, 4), loss(log2, 4, 4))


@te_only
def test_an_mtp_checkpoint_of_an_older_megatron_resumes_in_memory(tmp_path):
    """Megatron-LM before late 2025 wrote an MTP layer's transformer layer as `transformer_layer` in legacy files; this
    one names it `mtp_model_layer`, and its legacy loader, when the strict load fails, loads again non-strictly and
    trains on: the fixture renamed so (each shard) resumes in plain Megatron with the MTP layer at its random init
    (silently: a `load_return` line, and another MTP loss) — verify after that load names the MTP layer and stops
    every rank. With --preflight auto, at the saved layout, it loads
    through the in-memory resharder under the running modules' names, and iterations 3 and 4 (main and MTP loss)
    equal plain Megatron's load of the original."""
    from megatron_preflight.layout import naming
    from tests.helpers import ckpt_edit

    old = tmp_path / "older_megatron"
    shutil.copytree(fixture_path("mtp_te_tp2pp2_torch"), old)
    for dirpath, _, files in os.walk(old):
        if naming.MODEL_FILENAME in files:
            path = os.path.join(dirpath, naming.MODEL_FILENAME)
            state = ckpt_edit.load(path)
            state["model"] = {k.replace(".mtp_model_layer.", ".transformer_layer."): v for k, v in state["model"].items()}
            ckpt_edit.save(state, path)
    layout = (*MTP, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--ckpt-format",
              "torch", "--no-load-rng", "--train-iters", "4")
    rc2, log2 = run(tmp_path, fixture_path("mtp_te_tp2pp2_torch"), 4, *layout, plugin=False, port=29775, te=True)
    assert rc2 == 0, log2[-3000:]
    rc0, log0 = run(tmp_path, str(old), 4, *layout, plugin=False, port=29773, te=True, verify=False)
    assert rc0 == 0 and "load_return" in log0 and "mtp.layers.0.mtp_model_layer." in log0, log0[-3000:]
    # verify after plain Megatron's own load (its fingerprints taken from the file): the MTP layer is named
    assert subprocess.run([sys.executable, "-m", "megatron_preflight", "fingerprint", str(old)], capture_output=True,
                          timeout=300).returncode == 0
    launcher = tmp_path / "verifying_launcher.py"
    launcher.write_text(VERIFYING_LAUNCHER.replace("SCRIPT", "pretrain_gpt.py"))
    rcv, logv = run(tmp_path, str(old), 4, *layout, plugin=False, port=29776, te=True, verify=False,
                    launch=[str(launcher)])
    assert rcv == 1 and "verify: the loaded model is not the checkpoint's" in logv, logv[-3000:]
    assert "mtp.layers.0.mtp_model_layer.self_attention.linear_qkv.weight" in logv and "lm loss" not in logv
    rc, log = run(tmp_path, str(old), 4, *layout, "--preflight", "auto", port=29774, te=True)
    assert rc == 0 and "loaded through the in-memory resharder" in log, log[-3000:]
    assert_trains_alike_with_mtp(log, log2)
    assert mtp_losses(log0) != mtp_losses(log2)  # plain Megatron trained a fresh MTP layer


@te_only
@pytest.mark.parametrize("in_memory", [False, True], ids=["offline", "in-memory"])
def test_mtp_distributed_optimizer_reshard_trains_like_megatrons_dist_reshard(tmp_path, in_memory):
    """MTP with the distributed optimizer (TE spec and fused Adam through the stand-in), PP2·DP2 -> PP1·DP2: the MTP
    layer's and the last stage's own embedding's Adam state leave their stage's buffers. Iterations 3 and 4 (main and
    MTP loss) equal Megatron's own reshard of the twin saved with --dist-ckpt-optim-fully-reshardable."""
    common = (*MTP, "--use-distributed-optimizer", "--global-batch-size", "4", "--no-load-rng", "--train-iters", "4")
    legacy = fixture_path("mtp_te_distopt_pp2dp2_torch")
    if in_memory:
        rc, log = run(tmp_path, legacy, 2, "--ckpt-format", "torch", *common, "--preflight", "auto", port=29771,
                      te=True)
        assert "loaded through the in-memory resharder" in log, log[-3000:]
    else:
        out = tmp_path / "resharded"
        r = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", legacy, str(out), "--pp", "1",
                            "--verify", "--fingerprint", "--no-progress"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        rc, log = run(tmp_path, str(out), 2, "--ckpt-format", "torch", *common, plugin=False, port=29771, te=True)
    assert rc == 0, log[-3000:]
    rc2, log2 = run(tmp_path, fixture_path("mtp_te_distopt_pp2dp2_torch_dist"), 2, "--ckpt-format", "torch_dist",
                    *common, plugin=False, port=29772, te=True)
    assert rc2 == 0, log2[-3000:]
    assert_trains_alike_with_mtp(log, log2)


@te_only
def test_mla_legacy_at_another_tp_loads_in_memory_like_megatrons_dist_reshard(tmp_path):
    """A legacy MLA checkpoint (TE spec through the stand-in, TP2) at TP1 through --preflight auto (Megatron cannot
    load a legacy checkpoint at another TP): iterations 3 and 4 equal Megatron's own load of the torch_dist twin at
    TP1 (its dist loader reshards), weights and Adam state."""
    rc, log = run(tmp_path, fixture_path("mla_te_tp2_torch"), 1, *MLA, "--ckpt-format", "torch", "--no-load-rng",
                  "--train-iters", "4", "--preflight", "auto", port=29764, te=True)
    assert rc == 0, log[-3000:]
    assert "loaded through the in-memory resharder" in log
    rc2, log2 = run(tmp_path, fixture_path("mla_te_tp2_torch_dist"), 1, *MLA, "--ckpt-format", "torch_dist",
                    "--no-load-rng", "--train-iters", "4", plugin=False, port=29765, te=True)
    assert rc2 == 0, log2[-3000:]
    assert loss(log, 4, 4) is not None and (loss(log, 3, 4), loss(log, 4, 4)) == (loss(log2, 3, 4), loss(log2, 4, 4))


@te_only
def test_mla_replicas_megatron_lets_drift_resume_like_megatrons_own_torch_dist_save(tmp_path):
    """MLA trained at TP2 without --sequence-parallel (Megatron leaves the duplicated down projections' gradients
    unreduced over TP, so the TP replicas drift apart): --preflight auto at TP1 takes TP rank 0's copies, as Megatron's
    own torch_dist save keeps them, and says so; the losses of iterations 3 and 4 equal Megatron's resume at TP1 of its
    own torch_dist save of the checkpoint at the saved layout (the oracle)."""
    rc, log = run(tmp_path, fixture_path("mla_nosp_te_tp2_torch"), 1, *MLA, "--ckpt-format", "torch", "--no-load-rng",
                  "--train-iters", "4", "--preflight", "auto", port=29766, te=True, verify=False)
    assert rc == 0 and "loaded through the in-memory resharder" in log, log[-3000:]
    assert "Megatron lets drift" in log and "TP rank 0's copy is used" in log, log[-3000:]
    saved = tmp_path / "as_torch_dist"
    rc, log2 = run(tmp_path, fixture_path("mla_nosp_te_tp2_torch"), 2, *_without(MLA, ("--sequence-parallel",)),
                   "--tensor-model-parallel-size", "2", "--ckpt-format", "torch", "--ckpt-convert-format", "torch_dist",
                   "--ckpt-convert-save", str(saved), plugin=False, port=29767, te=True, verify=False)
    assert rc == 0 and "converted checkpoint" in log2, log2[-3000:]
    rc, log3 = run(tmp_path, str(saved / "torch_dist"), 1, *MLA, "--ckpt-format", "torch_dist", "--no-load-rng",
                   "--train-iters", "4", plugin=False, port=29768, te=True, verify=False)
    assert rc == 0 and loss(log3, 4, 4) is not None, log3[-3000:]
    assert (loss(log, 3, 4), loss(log, 4, 4)) == (loss(log3, 3, 4), loss(log3, 4, 4))


@pytest.mark.parametrize("legacy, twin, nproc, flags, oracle_flags", [
    ("tp2_torch", "tp2_torch_dist", 1, [], []),
    ("pp2_torch", None, 1, [], []),
    ("moe_shared_tp2pp2ep2_torch", "moe_shared_tp2pp2ep2_torch_dist", 1, MOE_SHARED,
     ["--expert-model-parallel-size", "2"]),
], ids=["tp2->tp1 (sizes left out)", "pp2->pp1 (sizes left out)", "tp2pp2ep2->tp1pp1ep1 (sizes left out)"])
def test_checks_advice_followed_word_for_word_resumes_like_megatrons_own_reshard(tmp_path, legacy, twin, nproc,
                                                                                 flags, oracle_flags):
    """The user's literal path: `check` of the run's flags (which leave the sizes at Megatron's defaults) prints one
    offline reshard; run as printed (NEW_DIR substituted), it writes the layout the run loads: `check` of the output
    says LOAD, and plain Megatron (no plugin) trains it, optimizer state loaded, with the losses of iterations 3 and 4
    of Megatron's own reshard of the torch_dist twin. At EP1 Megatron's own load of the twin's optimizer fails
    ("Could not find parameter group"): the oracle is then its EP2 resume of the twin (the same model and data; the
    expert gradients summed in another order: within 2e-6, as test_moe_optimizer_merged_into_dense_groups_at_ep1)."""
    from tests.helpers.advised import follow_advice

    extra = os.environ.get("MEGATRON_LM_EXTRA_ARGS", "").split()
    run_flags = [*TINY, *extra, "--ckpt-format", "torch", "--no-load-rng", "--train-iters", "4", *flags]
    new = str(tmp_path / "new")
    follow_advice(fixture_path(legacy), run_flags, new)
    rc, log = run(tmp_path, new, nproc, "--ckpt-format", "torch", "--no-load-rng", "--train-iters", "4", *flags,
                  plugin=False, port=29790)
    assert rc == 0 and loss(log, 4, 4) is not None, log[-3000:]
    if twin is None:
        return
    rc2, log2 = run(tmp_path, fixture_path(twin), nproc * (2 if oracle_flags else 1), "--ckpt-format", "torch_dist",
                    "--no-load-rng", "--train-iters", "4", *flags, *oracle_flags, plugin=False, port=29791)
    assert rc2 == 0, log2[-3000:]
    if not oracle_flags:
        assert (loss(log, 3, 4), loss(log, 4, 4)) == (loss(log2, 3, 4), loss(log2, 4, 4))
    for it in (3, 4):
        assert abs(float(loss(log, it, 4)) - float(loss(log2, it, 4))) <= 2e-6


@pytest.mark.parametrize("nproc, target", [(2, ["--pipeline-model-parallel-size", "2"]), (1, [])],
                         ids=["placement moved at PP2 (even split)", "PP1"])
@pytest.mark.parametrize("how", ["in memory", "offline as check advises"])
def test_a_flexible_pipeline_layout_checkpoint_resumes_elsewhere_like_megatrons_dist_reshard(tmp_path, nproc, target,
                                                                                             how):
    """flex_pp2_torch, saved with --pipeline-model-parallel-layout 'Et|tttL' (1 and 3 layers): a run at the even PP2
    split (the same PP size: Megatron's legacy loader fails after the build) or at PP1. `check` says reshard before
    the build; in memory (--preflight auto) and offline (the printed command, run as printed) the losses of iterations
    3 and 4, with the optimizer state loaded, equal Megatron's own reshard of the torch_dist twin (its dist loader
    places the layers)."""
    from tests.helpers.advised import follow_advice

    common = ["--no-load-rng", "--train-iters", "4", *target]
    if how == "in memory":
        rc, log = run(tmp_path, fixture_path("flex_pp2_torch"), nproc, "--preflight", "auto", "--ckpt-format", "torch",
                      *common, port=29792)
        assert rc == 0 and "loaded through the in-memory resharder" in log, log[-3000:]
    else:
        extra = os.environ.get("MEGATRON_LM_EXTRA_ARGS", "").split()
        run_flags = [*TINY, *extra, "--ckpt-format", "torch", *common]
        new = str(tmp_path / "new")
        follow_advice(fixture_path("flex_pp2_torch"), run_flags, new)
        rc, log = run(tmp_path, new, nproc, "--ckpt-format", "torch", *common, plugin=False, port=29792)
        assert rc == 0, log[-3000:]
    rc2, log2 = run(tmp_path, fixture_path("flex_pp2_torch_dist"), nproc, "--ckpt-format", "torch_dist", *common,
                    plugin=False, port=29793)
    assert rc2 == 0, log2[-3000:]
    assert loss(log, 4, 4) is not None
    assert (loss(log, 3, 4), loss(log, 4, 4)) == (loss(log2, 3, 4), loss(log2, 4, 4))


@pytest.mark.parametrize("ckpt, fmt", [("distopt_buckets_tp2dp2_torch", "torch"),
                                       ("distopt_dpr_buckets_tp2dp2_torch_dist", "torch_dist")])
def test_another_ddp_bucket_size_fails_in_megatron_after_the_build_and_at_start_with_the_plugin(tmp_path, ckpt, fmt):
    """Saved with --overlap-grad-reduce --ddp-bucket-size 3000 at TP2·DP2: a resume at the same layout without the
    bucket size (Megatron's default: 40M elements) fails in Megatron's own reload of the distributed optimizer state,
    after the model and optimizer are built; with the plugin it stops before the build naming the flag; with that flag
    it trains."""
    common = ["--ckpt-format", fmt, "--no-load-rng", "--use-distributed-optimizer", "--tensor-model-parallel-size",
              "2", "--overlap-grad-reduce", "--train-iters", "4"]
    rc, log = run(tmp_path, fixture_path(ckpt), 4, *common, plugin=False, port=29794, verify=False)
    megatron_says = "Global shape mismatch" if fmt == "torch_dist" else "Number of unpadded elements"
    assert rc != 0 and "lm loss" not in log and megatron_says in log, log[-3000:]
    rc, log = run(tmp_path, fixture_path(ckpt), 4, *common, "--preflight", "check", port=29795, verify=False)
    assert rc != 0 and "ddp_bucket_size" in log and "--ddp-bucket-size 3000" in log, log[-3000:]
    assert "building GPT model" not in log, log[-3000:]
    rc, log = run(tmp_path, fixture_path(ckpt), 4, *common, "--ddp-bucket-size", "3000", "--preflight", "check",
                  port=29796, verify=False)
    assert rc == 0 and loss(log, 4, 4) is not None, log[-3000:]


@te_only
@pytest.mark.parametrize("source", ["tp2_torch", "tp2_torch_dist"])
def test_local_spec_checkpoint_resumes_on_a_te_cluster_with_its_optimizer(tmp_path, source):
    """A checkpoint trained without TE (local spec, torch AdamW), resumed with the TE spec (the stand-in) and TE's
    FusedAdam at TP1 through --preflight auto: tensors renamed, TE's extra state made, the Adam state converted with
    its step. Megatron alone cannot: a legacy file has the other spec's keys, its own torch_dist load misses the TE
    final norm's extra state, and torch AdamW's param groups lack 'bias_correction'. Iterations 3 and 4 equal
    Megatron's own same-spec resume of the torch_dist twin (local spec, torch AdamW) exactly."""
    fmt = "torch_dist" if source.endswith("_dist") else "torch"
    rc, log = run(tmp_path, fixture_path(source), 1, "--ckpt-format", fmt, "--no-load-rng", "--train-iters", "4",
                  "--preflight", "auto", port=29764, te=True)
    assert rc == 0, log[-3000:]
    assert "loaded through the in-memory resharder" in log and "local -> transformer_engine" in log
    rc2, log2 = run(tmp_path, fixture_path("tp2_torch_dist"), 1, "--ckpt-format", "torch_dist", "--no-load-rng",
                    "--no-load-optim", "--train-iters", "4", plugin=False, port=29765, te=True)
    assert rc2 != 0 and "Missing key in checkpoint state_dict: decoder.final_layernorm._extra_state" in log2
    rc3, log3 = run(tmp_path, fixture_path("tp2_torch_dist"), 1, "--ckpt-format", "torch_dist", "--no-load-rng",
                    "--train-iters", "4", plugin=False, port=29766)
    assert rc3 == 0, log3[-3000:]
    assert loss(log, 4, 4) is not None and (loss(log, 3, 4), loss(log, 4, 4)) == (loss(log3, 3, 4), loss(log3, 4, 4))


@te_only
def test_te_spec_legacy_resumes_without_te_with_its_optimizer(tmp_path):
    """The other way: a TE-spec checkpoint (the stand-in's FusedAdam) resumed where TE is not installed (local spec,
    torch AdamW) at TP1 through --preflight auto: iterations 3 and 4 equal Megatron's own same-spec resume of the TE
    torch_dist twin (TE spec, FusedAdam) exactly."""
    rc, log = run(tmp_path, fixture_path("te_tp2_torch"), 1, "--ckpt-format", "torch", "--no-load-rng",
                  "--train-iters", "4", "--preflight", "auto", "--transformer-impl", "local", port=29767)
    assert rc == 0, log[-3000:]
    assert "loaded through the in-memory resharder" in log and "transformer_engine -> local" in log
    rc2, log2 = run(tmp_path, fixture_path("te_tp2_torch_dist"), 1, "--ckpt-format", "torch_dist", "--no-load-rng",
                    "--train-iters", "4", plugin=False, port=29769, te=True)
    assert rc2 == 0, log2[-3000:]
    assert loss(log, 4, 4) is not None and (loss(log, 3, 4), loss(log, 4, 4)) == (loss(log2, 3, 4), loss(log2, 4, 4))


@pytest.mark.parametrize("flags, field, megatron", [
    (["--train-iters", "4"], "lr_decay_steps", "do not match"),  # a longer horizon: the decay steps move
    (["--train-iters", "3", "--global-batch-size", "4", "--lr-decay-iters", "2"], "lr_decay_steps", "do not match"),
    (["--train-iters", "4", "--global-batch-size", "1", "--lr-decay-style", "linear"], "lr_decay_style",
     "do not match"),
    # a changed --lr: this Megatron-LM also pairs the optimizer's param groups by max_lr / min_lr, and fails there
    # first, before the scheduler ('Could not find parameter group with key'), whatever the scheduler flags say
    (["--train-iters", "4", "--global-batch-size", "1", "--lr", "2e-4"], "max_lr", "Could not find parameter group"),
])
def test_a_schedule_megatron_asserts_on_late_fails_at_start(tmp_path, flags, field, megatron):
    """Without the scheduler flags, Megatron builds the model and optimizer, loads the checkpoint and then asserts
    (AssertionError in OptimizerParamScheduler); with --preflight check every rank exits 1 before the model is built,
    naming the field, and either flag makes the run train."""
    drop = ("--use-checkpoint-opt-param-scheduler",)
    rc, log = run(tmp_path, fixture_path("tp2_torch"), 2, "--tensor-model-parallel-size", "2", "--ckpt-format",
                  "torch", *flags, plugin=False, port=29770, drop=drop)
    assert rc != 0 and megatron in log, log[-2000:]
    rc, log = run(tmp_path, fixture_path("tp2_torch"), 2, "--tensor-model-parallel-size", "2", "--ckpt-format",
                  "torch", *flags, "--preflight", "check", port=29771, drop=drop)
    assert rc == 1 and field in log, log[-2000:]
    assert "OptimizerParamScheduler: class input value" not in log.split("[megatron-preflight]")[-1]
    if field == "max_lr":  # the param groups: a scheduler flag does not help (Megatron fails late all the same)
        assert "optimizer param groups" in log and "--lr 0.0001" in log and "--no-load-optim" in log, log[-2000:]
        rc, log = run(tmp_path, fixture_path("tp2_torch"), 2, "--tensor-model-parallel-size", "2", "--ckpt-format",
                      "torch", *flags, plugin=False, port=29772)  # with --use-checkpoint-opt-param-scheduler
        assert rc != 0 and megatron in log and loss(log, 3, 4) is None, log[-2000:]
        rc, log = run(tmp_path, fixture_path("tp2_torch"), 2, "--tensor-model-parallel-size", "2", "--ckpt-format",
                      "torch", *flags, "--preflight", "check", port=29772)
        assert rc == 1 and "optimizer param groups" in log and "lm loss" not in log, log[-2000:]
        assert "in loaded checkpoint" not in log  # stopped at start: Megatron's own error never came
        return
    assert "--override-opt-param-scheduler" in log, log[-2000:]
    rc, log = run(tmp_path, fixture_path("tp2_torch"), 2, "--tensor-model-parallel-size", "2", "--ckpt-format",
                  "torch", *flags, "--preflight", "check", port=29772)  # with --use-checkpoint-opt-param-scheduler
    assert rc == 0 and loss(log, 3, int(flags[1])) is not None, log[-2000:]


@pytest.mark.parametrize("source, flags, megatron", [
    ("declr_tp2_torch", [], "doesn't match the size of optimizer's group"),  # --decoupled-lr dropped
    ("tp2_torch", ["--decoupled-lr", "5e-4"], "Could not find parameter group"),  # --decoupled-lr added
])
def test_a_decoupled_lr_added_or_dropped_on_resume_fails_at_start(tmp_path, source, flags, megatron):
    """The run builds one optimizer param group more or fewer than the checkpoint holds: Megatron fails pairing them
    inside load_checkpoint, after building the model and the optimizer; --preflight check stops every rank at start
    naming decoupled_lr and the fix."""
    common = ["--tensor-model-parallel-size", "2", "--ckpt-format", "torch", "--no-load-rng", *flags]
    rc, log = run(tmp_path, fixture_path(source), 2, *common, plugin=False, port=29792)
    assert rc != 0 and megatron in log and "lm loss" not in log, log[-2000:]
    rc, log = run(tmp_path, fixture_path(source), 2, *common, "--preflight", "check", port=29793)
    assert rc == 1 and "decoupled_lr" in log and "--no-load-optim" in log and "lm loss" not in log, log[-2000:]
    assert "ValueError" not in log  # stopped at start: Megatron's own error never came


def test_a_checkpoint_at_the_horizon_fails_at_start(tmp_path):
    """Megatron loads everything and exits 0 without training a step; --preflight check exits 1 at start."""
    rc, log = run(tmp_path, fixture_path("tp2_torch"), 2, "--tensor-model-parallel-size", "2", "--ckpt-format",
                  "torch", "--train-iters", "2", plugin=False, port=29773)
    assert rc == 0 and "lm loss" not in log, log[-2000:]
    rc, log = run(tmp_path, fixture_path("tp2_torch"), 2, "--tensor-model-parallel-size", "2", "--ckpt-format",
                  "torch", "--train-iters", "2", "--preflight", "check", port=29774)
    assert rc == 1 and "train_iters" in log and "raise --train-iters above 2" in log, log[-2000:]


def test_a_batch_schedule_the_layout_does_not_divide_fails_at_start(tmp_path):
    """A step batch-size schedule giving batch size 3 at the checkpoint's 4 consumed samples (threshold 64 tokens =
    2 samples of 32), with micro batch 2 × DP 1: Megatron builds the model and asserts inside load_checkpoint;
    --preflight check exits 1 at start; micro batch 1 trains."""
    flags = ["--tensor-model-parallel-size", "2", "--ckpt-format", "torch", "--no-load-rng",
             "--step-batch-size-schedule", "0:2 64:3"]
    drop = ("--global-batch-size", "--micro-batch-size")
    rc, log = run(tmp_path, fixture_path("tp2_torch"), 2, *flags, "--micro-batch-size", "2", plugin=False,
                  port=29787, drop=drop)
    assert rc != 0 and "is not divisible by" in log and "loading checkpoint" in log.lower(), log[-2000:]
    rc, log = run(tmp_path, fixture_path("tp2_torch"), 2, *flags, "--micro-batch-size", "2", "--preflight", "check",
                  port=29788, drop=drop)
    assert rc == 1 and "global_batch_size" in log and "batch size of 3" in log, log[-2000:]
    assert "loading checkpoint" not in log.lower()
    rc, log = run(tmp_path, fixture_path("tp2_torch"), 2, *flags, "--micro-batch-size", "1", "--preflight", "check",
                  port=29789, drop=drop)
    assert rc == 0 and loss(log) is not None, log[-2000:]


@pytest.mark.parametrize("flags, megatron, field", [
    (["--async-save"], "Async checkpoint save not implemented for legacy checkpoints", "async_save"),
    (["--non-persistent-save-interval", "3"], "Please use local or global non-persistent checkpoints",
     "non_persistent_ckpt_type"),
])
def test_a_save_setting_megatron_rejects_at_the_first_save_fails_at_start(tmp_path, flags, megatron, field):
    """Megatron trains, then raises NotImplementedError at the first save; --preflight check exits 1 at start."""
    base = ["--tensor-model-parallel-size", "2", "--ckpt-format", "torch", "--no-load-rng",
            "--save", str(tmp_path / "out"), "--save-interval", "3" if "--async-save" in flags else "100", *flags]
    rc, log = run(tmp_path, fixture_path("tp2_torch"), 2, *base, plugin=False, port=29790)
    assert rc != 0 and megatron in log and loss(log) is not None, log[-2000:]  # trained, then failed saving
    rc, log = run(tmp_path, fixture_path("tp2_torch"), 2, *base, "--preflight", "check", port=29791)
    assert rc == 1 and field in log and loss(log) is None, log[-2000:]


def fingerprinted(tmp_path, name):
    """A copy of a fixture with its fingerprints stored beside it (megatron-preflight fingerprint)."""
    dst = tmp_path / f"fp_{name}"
    shutil.copytree(fixture_path(name), dst)
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "fingerprint", str(dst)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return str(dst)


@pytest.mark.parametrize("name, nproc, flags", [
    ("tp2_torch", 2, ["--tensor-model-parallel-size", "2", "--ckpt-format", "torch"]),  # Megatron's own loader
    ("tp2_torch", 1, ["--ckpt-format", "torch"]),  # our in-memory reshard TP2 -> TP1
    ("moe_ep2_torch", 2, ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
                          "--ckpt-format", "torch"]),
    ("tp2_torch_dist", 1, ["--ckpt-format", "torch_dist"]),  # Megatron's dist loader, resharding TP2 -> TP1
    ("distopt_tp2dp2_torch", 4, ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
                                 "--ckpt-format", "torch"]),  # Megatron's own, distrib_optim.pt scattered over DP2
    ("distopt_tp2dp2_torch", 2, ["--use-distributed-optimizer", "--ckpt-format", "torch"]),  # ours, to TP1 DP2
    ("bf16_gqa_tp2_torch", 2, BF16_GQA + ["--tensor-model-parallel-size", "2", "--ckpt-format", "torch"]),  # masters
])
def test_verify_passes_a_correct_load(tmp_path, name, nproc, flags):
    """No false alarm: the loaded model and optimizer state (fp32 masters, exp_avg, exp_avg_sq; plain or the
    distributed optimizer's shards) equal the checkpoint's fingerprints, whoever loaded them."""
    ckpt = fingerprinted(tmp_path, name)
    rc, log = run(tmp_path, ckpt, nproc, *flags, "--no-load-rng", "--preflight", "verify", port=29775)
    assert rc == 0, log[-3000:]
    assert "verify: the loaded model and optimizer state equal the checkpoint's fingerprints" in log, log[-3000:]


@pytest.mark.parametrize("name, flags", [
    ("tp2_torch", ["--ckpt-format", "torch"]),  # Megatron's own legacy loader: each rank's file
    ("tp2_torch_dist", ["--ckpt-format", "torch_dist"]),  # its dist loader: the sharded object at (PP, TP)
])
def test_verify_checks_the_restored_rng_states(tmp_path, name, flags):
    """With the RNG loaded (no --no-load-rng), every rank's restored RNG states (Python, torch, the model-parallel
    tracker) equal its own checkpoint entry: no false alarm; and when rank 1's torch generator is moved after the load
    (a TEST DOUBLE standing in for a loader that restores another rank's state, or none), verify stops every rank
    naming rank 1 and the state."""
    ckpt = fingerprinted(tmp_path, name)
    rc, log = run(tmp_path, ckpt, 2, "--tensor-model-parallel-size", "2", *flags, "--preflight", "verify",
                  port=29840)
    assert rc == 0 and "the restored RNG states are each rank's entry" in log, log[-3000:]
    launcher = tmp_path / "rng_launcher.py"
    launcher.write_text(fault_launcher("torch.manual_seed(12345)"))
    rc, log = run(tmp_path, ckpt, 2, "--tensor-model-parallel-size", "2", *flags, "--preflight", "verify",
                  port=29841, launch=[str(launcher)])
    assert rc == 1 and "lm loss" not in log, log[-3000:]
    line = next(x for x in log.splitlines() if "rank 1: the RNG state" in x)
    assert "torch_rng_state" in line and "rank 0:" not in log, line


def test_verify_names_two_swapped_experts(tmp_path):
    """A fingerprinted legacy MoE checkpoint in which expert 1's weights were later swapped with expert 2's (same
    shapes, on different EP ranks: a bad copy): Megatron loads it and trains silently; verify stops every rank
    before iteration 1 and names both experts."""
    import torch

    from megatron_preflight import pickling
    from megatron_preflight.layout import naming
    from megatron_preflight.reshard import TargetLayout
    from megatron_preflight.reshard.resharder import open_resharder

    ckpt = fingerprinted(tmp_path, "moe_ep2_torch")
    r = open_resharder(ckpt, TargetLayout())
    states = {n: r.build(r.plan_for_coords(c, n)) for n, c in naming.shard_writers(r.tgt).items()}
    key1 = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"  # global expert 1 (EP rank 0)
    key2 = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"  # global expert 2 (EP rank 1)
    a, b = states["mp_rank_00_000"]["model"], states["mp_rank_00_001"]["model"]
    a[key1], b[key2] = b[key2].clone(), a[key1].clone()
    for n, sd in states.items():
        torch.save(sd, os.path.join(ckpt, "iter_0000002", n, "model_optim_rng.pt"), pickle_module=pickling)
    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--ckpt-format",
           "torch", "--no-load-rng"]
    rc, log = run(tmp_path, ckpt, 2, *moe, plugin=False, port=29776, verify=False)
    assert rc == 0 and loss(log) is not None  # Megatron: not a word
    rc, log = run(tmp_path, ckpt, 2, *moe, "--preflight", "verify", port=29777)
    assert rc == 1, log[-3000:]
    assert "experts.local_experts.1.linear_fc1.weight" in log and "experts.local_experts.2.linear_fc1.weight" in log
    assert "no longer matches its fingerprints" in log and "lm loss" not in log


@pytest.mark.parametrize("lost, stopped_by", [
    # the attention's output projection without its QKV partner: the check sees the broken pair in .metadata and
    # stops every rank before the model is built
    ("self_attention.linear_proj.weight", "check"),
    # a layer norm (no partner to miss; the local spec's input_layernorm under its torch_dist name): verify, after
    # the load, names the parameter (and its Adam state) the run does not hold from the checkpoint
    ("self_attention.linear_qkv.layer_norm_weight", "verify"),
])
def test_verify_names_a_parameter_a_non_strict_load_left_at_init(tmp_path, lost, stopped_by):
    """A fingerprinted torch_dist checkpoint whose .metadata later lost one parameter's entries (every layer's, with
    its Adam state), loaded with --dist-ckpt-strictness log_all: Megatron logs and trains with those weights at their
    random initialisation; --preflight verify stops every rank before iteration 1 and names them (the check already
    at start when the loss breaks a pair the model always has, verify after the load otherwise)."""
    from tests.helpers.ckpt_edit import drop_from_dcp_metadata

    ckpt = fingerprinted(tmp_path, "tp2_torch_dist")
    assert drop_from_dcp_metadata(os.path.join(ckpt, "iter_0000002"), f"decoder.layers.{lost}")
    flags = ["--tensor-model-parallel-size", "2", "--ckpt-format", "torch_dist", "--dist-ckpt-strictness", "log_all",
             "--no-load-rng"]
    rc, log = run(tmp_path, ckpt, 2, *flags, plugin=False, port=29778, verify=False)
    assert rc == 0 and loss(log) is not None, log[-3000:]  # Megatron trains on
    rc, log = run(tmp_path, ckpt, 2, *flags, "--preflight", "verify", port=29779)
    assert rc == 1 and "lm loss" not in log, log[-3000:]
    if stopped_by == "check":
        assert f"without {lost} (every layer)" in log and "random initialisation" in log, log[-3000:]
        assert "loading checkpoint" not in log.lower()
    else:
        assert "decoder.layers.0.input_layernorm.weight" in log and "stopping every rank" in log, log[-3000:]
        assert "verify: the loaded model is not the checkpoint's" in log


# -- the oracle: Megatron's own reshard, saved (issue 22) --------------------------------------------------------------
# Megatron loads the torch_dist twin at the target layout (its load-time reshard, optimizer included) and writes it back
# as a legacy checkpoint (--ckpt-convert-format torch --ckpt-convert-save DIR). Our reshard of the legacy twin to the
# same layout must equal it: the same files, the same keys in the same order, every tensor bit for bit (vocab padding
# rows excepted: `diff`), the same optimizer state (in model space, and the same param groups), the args a resume
# reads equal. Deliberate differences (README): our provenance entry, no rng_state (Megatron's is the fresh RNG of the
# converting run), args we rewrite that Megatron leaves as the converting run set them.
RESUME_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
               "kv_channels", "max_position_embeddings", "padded_vocab_size", "make_vocab_size_divisible_by",
               "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
               "expert_tensor_parallel_size", "num_experts", "swiglu", "normalization", "transformer_impl",
               "use_distributed_optimizer", "consumed_train_samples", "params_dtype")


def megatron_convert(tmp_path, twin, nproc, flags, port, te=False):
    out = tmp_path / "megatron_converted"
    rc, log = run(tmp_path, fixture_path(twin), nproc, "--ckpt-format", "torch_dist", "--ckpt-convert-format",
                  "torch", "--ckpt-convert-save", str(out), *flags, plugin=False, port=port, te=te)
    assert rc == 0 and "converted checkpoint" in log, log[-3000:]
    return str(out / "torch")


def assert_same_files(ours, theirs):
    from megatron_preflight.layout.discover import discover
    from megatron_preflight.torch_file import TensorRef
    from megatron_preflight.tree import iter_leaves

    a, b = discover(ours), discover(theirs)
    assert a.iteration == b.iteration and [s.name for s in a.shards] == [s.name for s in b.shards]
    for sa, sb in zip(a.shards, b.shards, strict=True):
        assert sorted(sa.files) == sorted(sb.files), sa.name
        ma, mb = sa.meta, sb.meta
        assert set(ma) - {"megatron_preflight", "rng_state"} == set(mb) - {"rng_state"}, sa.name
        for chunk in (k for k in ma if k.startswith("model")):
            assert list(ma[chunk]) == list(mb[chunk]), (sa.name, chunk)  # keys, in Megatron's order
        if "optimizer" in ma:
            pa = [(p, type(v).__name__) for p, v in iter_leaves(ma["optimizer"]) if p[-1] != "step"]
            pb = [(p, type(v).__name__) for p, v in iter_leaves(mb["optimizer"]) if p[-1] != "step"]
            assert pa == pb, (sa.name, sorted(set(pa) ^ set(pb))[:5])
            for (path, va), (_, vb) in zip(iter_leaves(ma["optimizer"]), iter_leaves(mb["optimizer"]), strict=True):
                if not isinstance(va, TensorRef) and "param_groups" in path:
                    assert va == vb, (sa.name, path, va, vb)
        assert ma["iteration"] == mb["iteration"], sa.name  # what a resume reads (args.iteration is the run's)
        fields = [n for n in RESUME_ARGS if n != "num_query_groups" or getattr(ma["args"], "group_query_attention",
                                                                               False)]
        differ = [(n, getattr(ma["args"], n, None), getattr(mb["args"], n, None)) for n in fields
                  if getattr(ma["args"], n, None) != getattr(mb["args"], n, None)]
        assert not differ, (sa.name, differ)


@pytest.mark.parametrize("legacy, twin, nproc, target, flags", [
    ("tp2_torch", "tp2_torch_dist", 1, {"tp": 1}, []),
    ("tp2_torch", "tp2_torch_dist", 2, {"tp": 1, "pp": 2}, ["--pipeline-model-parallel-size", "2"]),
    ("vpp_qkln_pp2_torch", "vpp_qkln_pp2_torch_dist", 2, {"tp": 2, "pp": 1}, VPP_QKLN +
     ["--tensor-model-parallel-size", "2"]),
    ("bf16_gqa_tp2_torch", "bf16_gqa_tp2_torch_dist", 1, {"tp": 1}, BF16_GQA),
    ("moe_shared_tp2pp2ep2_torch", "moe_shared_tp2pp2ep2_torch_dist", 4, {"tp": 1, "pp": 2, "ep": 2},
     MOE_SHARED + ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]),
    ("distopt_tp2dp2_torch", "distopt_tp2dp2_torch_dist", 2, {"tp": 1}, ["--use-distributed-optimizer"]),
    ("moe_shared_tp2pp2ep2_torch", "moe_shared_tp2pp2ep2_torch_dist", 8, {"tp": 2, "pp": 2, "ep": 2, "etp": 2},
     MOE_SHARED + ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                   "--expert-tensor-parallel-size", "2"]),  # ETP1 -> ETP2: the experts split by ETP, 8 ranks
    # VPP + MoE + the distributed optimizer, to TP1 PP1 (VPP gone) EP2 and to TP2 PP1 EP2: distrib_optim.pt included
    ("vppmoe_distopt_tp2pp2ep2_torch", "vppmoe_distopt_tp2pp2ep2_torch_dist", 2, {"tp": 1, "pp": 1, "ep": 2, "etp": 1},
     VPPMOE + ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]),
    ("vppmoe_distopt_tp2pp2ep2_torch", "vppmoe_distopt_tp2pp2ep2_torch_dist", 2, {"tp": 2, "pp": 1, "ep": 2, "etp": 1},
     VPPMOE + ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--sequence-parallel"]),
    # a flexible pipeline layout as the source ('Et|tttL') and as the target ('Ettt|tL'), plain and distributed
    ("flex_pp2_torch", "flex_pp2_torch_dist", 2, {"tp": 1, "pp": 2, "pipeline_model_parallel_layout": "Ettt|tL"},
     ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Ettt|tL"]),
    ("flex_pp2_torch", "flex_pp2_torch_dist", 2, {"tp": 1, "pp": 2, "pipeline_model_parallel_layout": "Et|t|t|tL"},
     ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|t|t|tL"]),  # VPP2 via the layout
    ("tp2_torch", "tp2_torch_dist", 2, {"tp": 1, "pp": 2, "pipeline_model_parallel_layout": "Et|tttL"},
     ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|tttL"]),  # no PP -> flexible
    ("flex_distopt_pp2dp2_torch", "flex_distopt_pp2dp2_torch_dist", 4,
     {"tp": 1, "pp": 2, "pipeline_model_parallel_layout": "Ettt|tL"},
     ["--use-distributed-optimizer", "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout",
      "Ettt|tL"]),
    pytest.param("te_tp2_torch", "te_tp2_torch_dist", 1, {"tp": 1}, TE_SPEC, marks=te_only, id="te-fused-adam"),
    pytest.param("mla_te_tp2_torch", "mla_te_tp2_torch_dist", 1, {"tp": 1}, TE_SPEC + MLA, marks=te_only,
                 id="te-mla"),  # multi-latent attention: column up projections, duplicated down projections
    pytest.param("mtp_te_tp2pp2_torch", "mtp_te_tp2pp2_torch_dist", 1, {"tp": 1, "pp": 1}, TE_SPEC + MTP,
                 marks=te_only, id="te-mtp-pp1"),  # multi-token prediction: the MTP layer and its own embedding
    pytest.param("mtp_te_tp2pp2_torch", "mtp_te_tp2pp2_torch_dist", 2, {"tp": 1, "pp": 2}, TE_SPEC + MTP +
                 ["--pipeline-model-parallel-size", "2"], marks=te_only, id="te-mtp-pp2"),
    pytest.param("flexmtp_te_pp2_torch", "flexmtp_te_pp2_torch_dist", 2,
                 {"tp": 1, "pp": 2, "pipeline_model_parallel_layout": "Ettt|tmL"},
                 TE_SPEC + MTP + ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Ettt|tmL"],
                 marks=te_only, id="te-mtp-flexible-layout"),  # 'Et|tttmL' -> 'Ettt|tmL': the MTP layer placed by 'm'
    pytest.param("mtp_moe_te_ep2_torch", "mtp_moe_te_ep2_torch_dist", 4, {"tp": 1, "pp": 2, "ep": 2},
                 TE_SPEC + MTP + MTP_MOE + ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"],
                 marks=te_only, id="te-mtp-moe-pp2ep2"),  # the MoE MTP layer's TE-grouped experts on the last stage
])
def test_our_reshard_equals_megatrons_own_saved_reshard(tmp_path, legacy, twin, nproc, target, flags):
    """Both sources: our reshard of the legacy twin, and of the torch_dist twin itself."""
    from megatron_preflight.prove.diff import diff_checkpoints
    from megatron_preflight.reshard import TargetLayout, write_resharded

    theirs = megatron_convert(tmp_path, twin, nproc, ["--tensor-model-parallel-size", str(target["tp"]), *flags],
                              port=29790, te=flags[:len(TE_SPEC)] == TE_SPEC)
    for source in (legacy, twin):
        ours = str(tmp_path / f"ours_{source}")
        write_resharded(fixture_path(source), ours, TargetLayout(**target), verify=True)
        report = diff_checkpoints(ours, theirs)
        assert report.equal, (source, report.render())
        assert_same_files(ours, theirs)


# TEST DOUBLES standing in for a loader bug: after Megatron's own load_checkpoint, rank 1 runs a fault (with the
# run's ddp_model and optimizer in scope); then the hook is installed (so verify runs after it) and pretrain_gpt.py
# runs unmodified.
FAULT_LAUNCHER = """
import runpy, sys
import torch
import megatron.training.checkpointing as ck, megatron.training.training as tr
original = ck.load_checkpoint
def load_then_fault(ddp_model, optimizer, *a, **k):
    result = original(ddp_model, optimizer, *a, **k)
    if torch.distributed.get_rank() == 1:
{fault}
    return result
ck.load_checkpoint = tr.load_checkpoint = load_then_fault
import megatron_preflight
megatron_preflight.install()
sys.argv = ["pretrain_gpt.py", *sys.argv[1:]]
runpy.run_path("pretrain_gpt.py", run_name="__main__")
"""


def fault_launcher(fault: str) -> str:
    """The launcher's source with ``fault`` (Python lines) run on rank 1 right after Megatron's load."""
    return FAULT_LAUNCHER.replace("{fault}", "\n".join("        " + line for line in fault.splitlines()))


# one parameter's exp_avg shard in the distributed optimizer moved by 1e-3 on rank 1
PERTURB_EXP_AVG = """part = (getattr(optimizer, "chained_optimizers", None) or [optimizer])[0]
for param in part.model_param_gbuf_map:
    if param.shape == (32, 32):  # the first of layer 0's attention projections this rank shards
        part._get_main_param_and_optimizer_states(param)["exp_avg"].add_(1e-3)
        break"""


def test_verify_names_the_parameter_and_the_rank_of_a_load_fault(tmp_path):
    """The distributed optimizer's state of one parameter perturbed on rank 1 right after Megatron's own load (the
    test double above): verify stops every rank before iteration 1 naming that parameter's exp_avg and rank 1."""
    ckpt = fingerprinted(tmp_path, "distopt_tp2dp2_torch")
    launcher = tmp_path / "perturbing_launcher.py"
    launcher.write_text(fault_launcher(PERTURB_EXP_AVG))
    rc, log = run(tmp_path, ckpt, 4, "--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
                  "--ckpt-format", "torch", "--no-load-rng", "--preflight", "verify", port=29781,
                  launch=[str(launcher)])
    assert rc == 1 and "lm loss" not in log, log[-3000:]
    line = next(x for x in log.splitlines() if "#exp_avg" in x and "differ" in x)
    assert "ranks [1]" in line and "is not the checkpoint's" in line, line


# A MEASURING PROBE (not a fake): after Megatron's own load, each rank sums the bytes it really holds: its model's
# parameters, their main_grad views of the DDP buffers (unpadded), and the optimizer's state (fp32 masters and Adam
# moments; the distributed optimizer's shards), and prints them with its shard dir.
MEMORY_PROBE = """
import json, runpy, sys
import torch
import megatron.training.checkpointing as ck, megatron.training.training as tr
from megatron.core import parallel_state as ps
from megatron_preflight.layout import naming
original = ck.load_checkpoint
def load_then_measure(ddp_model, optimizer, *a, **k):
    result = original(ddp_model, optimizer, *a, **k)
    params = {id(p): p for m in ddp_model for p in m.parameters()}
    grads = sum(p.main_grad.numel() * p.main_grad.element_size() for p in params.values())
    state = 0
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if hasattr(part, "_get_main_param_and_optimizer_states"):
            for param in part.model_param_gbuf_map:
                for key, t in part._get_main_param_and_optimizer_states(param).items():
                    if key == "param" and param.dtype == torch.float32:
                        continue  # a view of the fp32 parameter itself
                    if t.dim():
                        state += t.numel() * t.element_size()
            continue
        inner = part.optimizer
        for s in inner.state.values():
            state += sum(t.numel() * t.element_size() for t in s.values() if torch.is_tensor(t) and t.dim())
        for group in getattr(part, "fp32_from_float16_groups", []):
            state += sum(t.numel() * t.element_size() for t in group)
    name = naming.shard_dir_name(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                                 ps.get_expert_model_parallel_rank(), pp_size=ps.get_pipeline_model_parallel_world_size(),
                                 ep_size=ps.get_expert_model_parallel_world_size())
    print("MEMORY_PROBE " + json.dumps({"shard": name, "params": sum(p.numel() * p.element_size()
          for p in params.values()), "grads": grads, "optimizer": state}), flush=True)
    return result
ck.load_checkpoint = tr.load_checkpoint = load_then_measure
import megatron_preflight
megatron_preflight.install()
sys.argv = ["pretrain_gpt.py", *sys.argv[1:]]
runpy.run_path("pretrain_gpt.py", run_name="__main__")
"""


@pytest.mark.parametrize("name, nproc, flags", [
    ("tp2_torch", 2, ["--tensor-model-parallel-size", "2"]),  # fp32, plain Adam
    ("bf16_gqa_tp2_torch", 2, BF16_GQA + ["--tensor-model-parallel-size", "2"]),  # bf16: fp32 grads and masters
    ("distopt_tp2dp2_torch", 4, ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]),  # over DP2
    ("moe_ep2_torch", 2, ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2"]),
    ("acct_emb_pp2_torch", 2, ["--pipeline-model-parallel-size", "2", "--num-layers", "5",
                               "--account-for-embedding-in-pipeline-split"]),  # uneven stages: 2 and 3 layers
])
def test_predicted_memory_equals_what_the_run_allocates(tmp_path, name, nproc, flags):
    """The check's per-rank parameter, gradient and optimizer bytes (exact, from the plans) equal the bytes each rank
    of the real run holds after the load."""
    import json

    probe = tmp_path / "memory_probe.py"
    probe.write_text(MEMORY_PROBE)
    report = tmp_path / "plan.json"
    rc, log = run(tmp_path, fixture_path(name), nproc, *flags, "--ckpt-format", "torch", "--no-load-rng",
                  "--preflight", "check", "--preflight-report", str(report), port=29782, launch=[str(probe)])
    assert rc == 0, log[-3000:]
    predicted = {m["shard"]: m for m in json.loads(report.read_text())["plan"]["memory"]}
    # each rank prints one flat JSON object; two ranks' prints can land on one line of the merged log
    measured = [json.loads(doc) for doc in re.findall(r"MEMORY_PROBE (\{[^{}]*\})", log)]
    assert len(measured) == nproc
    for m in measured:
        p = predicted[m["shard"]]
        assert (p["params"], p["grads"]) == (m["params"], m["grads"]), (m, p)
        if not p["optimizer_group"]:
            assert p["optimizer"] == m["optimizer"], (m, p)
        else:  # the distributed optimizer: each rank holds its share of the group's state, up to bucket padding
            assert abs(p["optimizer"] - m["optimizer"]) <= 0.02 * p["optimizer"], (m, p)
    for shard, p in predicted.items():
        if p["optimizer_group"]:  # the data-parallel group's total, exact (every DP rank holding this shard dir)
            assert sum(m["optimizer"] for m in measured if m["shard"] == shard) == p["optimizer_group"], (shard, p)


BUILD_DATASET = """
import sys
import numpy, torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
prefix, top = sys.argv[1], int(sys.argv[2])
builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
for d in range(30):
    builder.add_item(torch.tensor([(d * 7 + i) % top for i in range(60)] + [top]))
    builder.end_document()
builder.finalize(prefix + ".idx")
"""


def _indexed_dataset(prefix, top=99):
    """A real Megatron indexed dataset, written by Megatron-LM's own IndexedDatasetBuilder (in the run's Python)."""
    python = os.environ.get("MEGATRON_LM_PYTHON", sys.executable)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("MEGATRON_LM_PYTHONPATH", ""), ROOT)
                                                          if p))
    r = subprocess.run([python, "-c", BUILD_DATASET, prefix, str(top)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return prefix


@pytest.mark.parametrize("damage, words", [
    ("missing_idx", "does not exist"),
    ("truncated_bin", "truncated"),
    ("ids_beyond_vocab", "beyond the run's vocab"),
])
def test_a_broken_dataset_fails_at_start_not_after_the_load(tmp_path, damage, words):
    """Megatron builds the model, loads the checkpoint, then opens the data and fails (token ids beyond the vocab: it
    trains, wrongly); --preflight check exits 1 on every rank at start, naming the file."""
    prefix = _indexed_dataset(str(tmp_path / "corpus"), top=300 if damage == "ids_beyond_vocab" else 99)
    if damage == "missing_idx":
        os.remove(prefix + ".idx")
    elif damage == "truncated_bin":
        os.truncate(prefix + ".bin", os.path.getsize(prefix + ".bin") // 2)
    flags = ["--tensor-model-parallel-size", "2", "--ckpt-format", "torch", "--data-path", prefix,
             "--split", "100,0,0", "--no-load-rng"]
    rc, log = run(tmp_path, fixture_path("tp2_torch"), 2, *flags, plugin=False, port=29783, drop=("--mock-data",))
    assert "loading checkpoint" in log.lower() or "loaded checkpoint" in log.lower(), log[-2000:]
    if damage == "ids_beyond_vocab":  # Megatron trains on, wrongly: the vocab-parallel embedding and loss mask
        assert rc == 0 and loss(log) is not None, log[-2000:]  # ids outside each rank's rows (zero vectors)
    else:
        assert rc != 0 and loss(log) is None, log[-2000:]  # Megatron fails after the load
    rc, log = run(tmp_path, fixture_path("tp2_torch"), 2, *flags, "--preflight", "check", port=29784,
                  drop=("--mock-data",))
    assert rc == 1 and words in log and prefix in log, log[-2000:]
    assert "loading checkpoint" not in log.lower()


@pytest.mark.parametrize("options, words", [("size=200k", "free"), ("size=10m,ro", "read-only")])
def test_a_save_dir_without_room_fails_at_start_not_at_the_first_save(tmp_path, options, words):
    """--save on a 200 KiB tmpfs (the checkpoint needs ~0.8 MB), or on a read-only one (root writes anywhere else):
    Megatron trains, then fails at the save; --preflight check exits 1 at start."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("this machine does not allow mounting a small filesystem")
    try:
        flags = ["--tensor-model-parallel-size", "2", "--ckpt-format", "torch", "--save", str(mnt / "ckpt"),
                 "--save-interval", "100", "--no-load-rng"]
        rc, log = run(tmp_path, fixture_path("tp2_torch"), 2, *flags, plugin=False, port=29785)
        assert rc != 0 and loss(log) is not None, log[-2000:]  # trained, then failed saving
        rc, log = run(tmp_path, fixture_path("tp2_torch"), 2, *flags, "--preflight", "check", port=29786)
        assert rc == 1 and words in log and loss(log) is None, log[-2000:]
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


@pytest.mark.parametrize("nproc, target, flags", [
    (1, {"ep": 1}, ["--expert-model-parallel-size", "1"]),  # EP2 -> EP1
    (4, {"ep": 4}, ["--expert-model-parallel-size", "4", "--global-batch-size", "4"]),  # EP2 -> EP4: an expert a rank
    # (ETP: this model has expert biases, and Megatron refuses "Bias in Moe is only supported when ETP==1")
])
def test_expert_reshards_equal_megatrons_own_saved_reshard_weights(tmp_path, nproc, target, flags):
    """EP changes: Megatron cannot carry a torch_dist optimizer state across an EP change ('Could not find
    parameter group'), so its saved reshard is taken with --no-load-optim and the weights are compared (bit for bit,
    the same files and keys); ours drops the optimizer state likewise."""
    from megatron_preflight.prove.diff import diff_checkpoints
    from megatron_preflight.reshard import TargetLayout, write_resharded

    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--no-load-optim"]
    theirs = megatron_convert(tmp_path, "moe_ep2_torch_dist", nproc, [*moe, *flags], port=29791)
    for source in ("moe_ep2_torch", "moe_ep2_torch_dist"):
        ours = str(tmp_path / f"ours_{source}")
        write_resharded(fixture_path(source), ours, TargetLayout(**target), drop_optimizer=True, verify=True)
        report = diff_checkpoints(ours, theirs, weights_only=True)
        assert report.equal, (source, report.render())
        from megatron_preflight.layout.discover import discover

        a, b = discover(ours), discover(theirs)
        assert [s.name for s in a.shards] == [s.name for s in b.shards]
        for sa, sb in zip(a.shards, b.shards, strict=True):
            assert list(sa.meta["model"]) == list(sb.meta["model"]), sa.name


MEGATRON_ACTIVATION = """
import argparse, json, sys
from megatron.training.theoretical_memory_usage import compute_activation_memory
cases = json.loads(sys.argv[1])
print(json.dumps([compute_activation_memory(argparse.Namespace(**c["args"]), c["nmb"]) for c in cases]))
"""


def test_activation_estimate_equals_megatrons_theoretical_memory_report():
    """Our activation estimate against Megatron-LM's own compute_activation_memory (its --log-memory report):
    equal for dense models with the TE spec (no unfused-attention term) at TP, PP (fewer microbatches than stages
    included); for MoE Megatron counts every layer's MLP with --ffn-hidden-size, ours with topk × moe_ffn (tokens go
    to topk experts): the difference is exactly that term."""
    from megatron_preflight.check.memory import activation_estimate
    from megatron_preflight.check.runtime_args import from_mapping

    base = dict(num_layers=8, hidden_size=64, ffn_hidden_size=256, num_attention_heads=8, seq_length=128,
                micro_batch_size=2, vocab_size=1000, transformer_impl="transformer_engine")
    grid = [dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, nmb=4),
            dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2, nmb=4),
            dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=4, nmb=2),
            dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2, nmb=4, num_experts=4,
                 moe_ffn_hidden_size=128, moe_router_topk=2)]
    cases, ours = [], []
    for g in grid:
        nmb = g.pop("nmb")
        rt = from_mapping({**base, **g})
        args = {**base, **g, "padded_vocab_size": rt.padded_vocab_size, "virtual_pipeline_model_parallel_size": None}
        cases.append({"args": args, "nmb": nmb})
        layers = rt.num_layers // rt.pp
        ours.append(activation_estimate(rt, layers, layers if rt.num_experts else 0, nmb))
    python = os.environ.get("MEGATRON_LM_PYTHON", sys.executable)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("MEGATRON_LM_PYTHONPATH", ""))
                                                          if p))
    r = subprocess.run([python, "-c", MEGATRON_ACTIVATION, json.dumps(cases)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    theirs = json.loads(r.stdout.strip().splitlines()[-1])
    for got, want in zip(ours[:3], theirs[:3], strict=True):
        assert abs(got - want) <= 1, (got, want)
    moe = cases[3]["args"]
    s, b, h = moe["seq_length"], moe["micro_batch_size"], moe["hidden_size"]
    mlp_term = moe["num_layers"] * s * b * h * 4 * (2 * moe["moe_ffn_hidden_size"] - moe["ffn_hidden_size"]) / h
    assert abs(ours[3] - (theirs[3] + mlp_term)) <= 1, (ours[3], theirs[3], mlp_term)


TE_MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-grouped-gemm", "--disable-bias-linear"]


@te_only
def test_te_moe_torch_dist_sources_every_optimizer_form_offline_and_in_memory(tmp_path):
    """TE spec (the stand-in) MoE with TE-grouped experts and TE's FusedAdam, saved by Megatron as torch_dist at
    TP2·SP in each optimizer form it writes (plain; distributed dp_reshardable, fully_reshardable; it can no longer
    write the older fully_sharded_model_space: "ShardedTensor.flattened_range is not supported"), resumed at TP1:
    offline (legacy TP1, then Megatron's own loader) and in memory (--preflight auto). Iterations 3 and 4 equal
    Megatron's own load of the plain form at TP1 (the forms are the same training: the same weights and Adam math)."""
    empty = tmp_path / "nothing"
    empty.mkdir()
    save_flags = ["--ckpt-format", "torch_dist", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                  "--train-iters", "2", "--save-interval", "2", *TE_MOE]
    forms = {"plain": [], "dp_reshardable": ["--use-distributed-optimizer"],
             "fully_reshardable": ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]}
    sources = {}
    for n, (form, extra) in enumerate(forms.items()):
        src = tmp_path / f"te_moe_{form}"
        rc, log = run(tmp_path, str(empty), 2, *save_flags, *extra, "--save", str(src), plugin=False,
                      port=29800 + n, te=True)
        assert rc == 0 and (src / "iter_0000002").is_dir(), log[-3000:]
        if form != "plain":
            assert f"distributed optimizer sharded state of type {form}" in log, log[-3000:]
        sources[form] = src
    resume = ["--no-load-rng", "--train-iters", "4", *TE_MOE]
    rc, ref = run(tmp_path, str(sources["plain"]), 1, "--ckpt-format", "torch_dist", *resume, plugin=False,
                  port=29810, te=True)
    assert rc == 0 and loss(ref, 4, 4) is not None, ref[-3000:]
    want = (loss(ref, 3, 4), loss(ref, 4, 4))
    for n, (form, extra) in enumerate(forms.items()):
        out = tmp_path / f"legacy_{form}"
        r = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", str(sources[form]), str(out),
                            "--tp", "1", "--verify", "--fingerprint", "--no-progress"],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        rc, log = run(tmp_path, str(out), 1, "--ckpt-format", "torch", *extra[:1], *resume, plugin=False,
                      port=29820 + n, te=True)
        assert rc == 0 and (loss(log, 3, 4), loss(log, 4, 4)) == want, (form, log[-3000:])
        rc, log = run(tmp_path, str(sources[form]), 1, "--ckpt-format", "torch_dist", *extra[:1], *resume,
                      "--preflight", "auto", port=29830 + n, te=True)
        assert rc == 0 and (loss(log, 3, 4), loss(log, 4, 4)) == want, (form, log[-3000:])


# megatron-core 0.13.1's default distributed-optimizer form, in a checkpoint it wrote (tests/fixtures/megatron-core-0.13)
FSMS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "megatron-core-0.13",
                    "fsms_bf16_tp2dp2_torch_dist")
FSMS_RUN = ["--bf16", "--group-query-attention", "--num-query-groups", "2", "--swiglu", "--disable-bias-linear",
            "--use-distributed-optimizer", "--tensor-model-parallel-size", "2", "--no-load-rng", "--train-iters", "4",
            "--make-vocab-size-divisible-by", "16"]  # as saved (tests/helpers/mcore_models.py's args)


def test_a_fully_sharded_model_space_state_fails_at_start_and_loads_once_converted(tmp_path):
    """A torch_dist checkpoint megatron-core 0.13.1 saved with its default distributed-optimizer form
    (fully_sharded_model_space): Megatron-LM main fails inside load_checkpoint (after building the model and the
    optimizer); --preflight check stops every rank at start naming the form and the conversion; after `megatron-
    preflight reshard --ckpt-format torch_dist` (the fully_reshardable form) Megatron's own loader resumes it, and
    iterations 3-4 equal its resume of our legacy conversion (another format, another loader; both hold what
    megatron-core 0.13.1's own load holds: tests/reshard/sources/test_fully_sharded_model_space.py)."""
    rc, log = run(tmp_path, FSMS, 2, *FSMS_RUN, "--ckpt-format", "torch_dist", plugin=False, port=29861)
    assert rc != 0 and "Missing key in checkpoint state_dict: optimizer.distributed" in log, log[-3000:]
    rc, log = run(tmp_path, FSMS, 2, *FSMS_RUN, "--ckpt-format", "torch_dist", "--preflight", "check", port=29862)
    assert rc == 1 and "fully_sharded_model_space" in log and "megatron-preflight reshard" in log, log[-3000:]
    assert "lm loss" not in log
    losses = {}
    for n, fmt in enumerate(("torch_dist", "torch")):
        out = tmp_path / f"converted_{fmt}"
        r = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", FSMS, str(out), "--tp", "2",
                            "--ckpt-format", fmt, "--optimizer", "distributed", "--verify", "--fingerprint",
                            "--no-progress"],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        rc, log = run(tmp_path, str(out), 2, *FSMS_RUN, "--ckpt-format", fmt, plugin=False, port=29863 + n)
        assert rc == 0 and loss(log, 4, 4) is not None, (fmt, log[-3000:])
        losses[fmt] = (loss(log, 3, 4), loss(log, 4, 4))
    assert losses["torch_dist"] == losses["torch"], losses


CP_DPR, CP_TWIN = "cp2_distopt_dpr_dp2_torch_dist", "cp2_distopt_dp2_torch_dist"


@te_only
@pytest.mark.parametrize("nproc, flags", [(4, ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2"]),
                                          (2, [])], ids=["TP2 CP2", "CP1 DP2"])
@pytest.mark.parametrize("how", ["in memory", "offline as check advises"])
def test_dp_reshardable_saved_with_context_parallelism_resumes_at_another_layout(tmp_path, nproc, flags, how):
    """A dp_reshardable checkpoint saved at TP1 CP2 DP2 (the TE stand-in's CP attention; its buckets sharded over
    DP x CP) resumed at another TP — where Megatron refuses a dp_reshardable state ('(TP, PP) mismatch') — or at CP1
    with another DP: the losses of Megatron's own reshard of the fully_reshardable twin (the same run, the other
    form; measured equal to all printed digits, compared within 1e-5 as the twins' values may differ by 1e-8)."""
    from tests.helpers.advised import follow_advice

    common = ["--use-distributed-optimizer", "--no-load-rng", "--train-iters", "4", *flags]
    if how == "in memory":
        rc, log = run(tmp_path, fixture_path(CP_DPR), nproc, "--preflight", "auto", "--ckpt-format", "torch_dist",
                      *common, te=True, port=29811)
    else:
        extra = os.environ.get("MEGATRON_LM_EXTRA_ARGS", "").split()
        run_flags = [*TINY, *extra, *TE_SPEC, "--ckpt-format", "torch_dist", *common, "--world-size", str(nproc)]
        new = str(tmp_path / "new")
        follow_advice(fixture_path(CP_DPR), run_flags, new) if flags else _convert(CP_DPR, new)
        rc, log = run(tmp_path, new, nproc, "--ckpt-format", "torch", *common, plugin=False, te=True, port=29812)
    assert rc == 0, log[-3000:]
    rc2, oracle = run(tmp_path, fixture_path(CP_TWIN), nproc, "--ckpt-format", "torch_dist", *common, plugin=False,
                      te=True, port=29813)
    assert rc2 == 0, oracle[-3000:]
    for it in (3, 4):
        assert abs(float(loss(log, it, 4)) - float(loss(oracle, it, 4))) < 1e-5, (it, loss(log, it, 4),
                                                                                 loss(oracle, it, 4))


def _convert(name, out):
    """At the same TP/PP Megatron loads a dp_reshardable state as is (check advises no reshard): converted here to
    legacy at CP1 to prove the state itself."""
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", fixture_path(name), out, "--verify",
                        "--no-progress"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


FLEX_TARGETS = [(4, ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Ettt|tL"]),
                (2, [])]


@pytest.mark.parametrize("source", ["flex_distopt_pp2dp2_torch", "flex_distopt_dpr_pp2dp2_torch_dist"],
                         ids=["legacy", "dp_reshardable"])
@pytest.mark.parametrize("nproc, target", FLEX_TARGETS, ids=["another flexible layout at PP2", "PP1"])
@pytest.mark.parametrize("how", ["in memory", "offline as check advises"])
def test_a_flexible_layout_distributed_optimizer_checkpoint_resumes_at_another_placement(tmp_path, source, nproc,
                                                                                        target, how):
    """Saved with --pipeline-model-parallel-layout 'Et|tttL' and the distributed optimizer (legacy, and torch_dist in
    Megatron's default dp_reshardable form, which Megatron refuses at another layout): resumed at another flexible
    layout ('Ettt|tL': 3 and 1 layers) or at PP1, in memory and offline as printed, with the losses of iterations 3 and
    4 of Megatron's own reshard of the fully_reshardable twin (the same flags, a later run: compared within 1e-5)."""
    from tests.helpers.advised import follow_advice

    fmt = "torch_dist" if source.endswith("_dist") else "torch"
    common = ["--use-distributed-optimizer", "--no-load-rng", "--train-iters", "4", *target]
    if how == "in memory":
        rc, log = run(tmp_path, fixture_path(source), nproc, "--preflight", "auto", "--ckpt-format", fmt, *common,
                      port=29821)
        assert rc == 0 and "loaded through the in-memory resharder" in log, log[-3000:]
    else:
        extra = os.environ.get("MEGATRON_LM_EXTRA_ARGS", "").split()
        run_flags = [*TINY, *extra, "--ckpt-format", fmt, *common, "--world-size", str(nproc)]
        new = str(tmp_path / "new")
        follow_advice(fixture_path(source), run_flags, new)
        rc, log = run(tmp_path, new, nproc, "--ckpt-format", "torch", *common, plugin=False, port=29822)
        assert rc == 0, log[-3000:]
    rc2, oracle = run(tmp_path, fixture_path("flex_distopt_pp2dp2_torch_dist"), nproc, "--ckpt-format", "torch_dist",
                      *common, plugin=False, port=29823)
    assert rc2 == 0, oracle[-3000:]
    for it in (3, 4):
        assert abs(float(loss(log, it, 4)) - float(loss(oracle, it, 4))) < 1e-5, (it, loss(log, it, 4),
                                                                                 loss(oracle, it, 4))


def test_an_impossible_layout_on_a_hugging_face_model_is_answered_by_the_plugin(tmp_path):
    """TP3 on the 4-head Llama: the plugin's message at argument parsing, not Megatron's ValueError per rank."""
    from tests.hook.test_megatron_releases import assert_stopped_by_the_plugin

    rc, log = run(tmp_path, os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf", "llama"), 3,
                  "--preflight", "auto", "--tensor-model-parallel-size", "3", port=29797, verify=False)
    assert_stopped_by_the_plugin(rc, log, "4 attention heads are not divisible by TP3")


def test_a_checkpoint_on_object_storage_resumes_as_from_disk(tmp_path):
    """Real Megatron-LM with ``--load msc://... --enable-msc`` against a real S3-compatible server (SeaweedFS,
    tests/helpers/s3_server.py): a dp_reshardable TP2·DP2 checkpoint at TP1·DP2, which Megatron's own loader refuses,
    loads through the in-memory resharder from the store — each rank fetching its own bytes into its node's staged
    mirror — and iterations 3 and 4 equal the same load from the local copy, exactly. A TP1 load of the plain TP2
    torch_dist checkpoint (Megatron's dist loader reads the store itself) likewise."""
    python, env = megatron_env(ROOT)
    if subprocess.run([python, "-c", "import multistorageclient, boto3"], env=env).returncode != 0:
        pytest.skip("multi-storage-client[boto3] is not installed in MEGATRON_LM_PYTHON")
    from tests.helpers import s3_server

    store = s3_server.server()
    config = store.config("megatron.yaml")
    for name, nproc, flags, port in (
            ("distopt_dpr_tp2dp2_torch_dist", 2, ["--use-distributed-optimizer", "--tensor-model-parallel-size", "1"],
             29790),
            ("tp2_torch_dist", 1, ["--tensor-model-parallel-size", "1"], 29792)):
        store.upload_dir(fixture_path(name), f"megatron/{name}")
        mode = "auto"
        if name == "tp2_torch_dist":  # fingerprinted on the store, then loaded and verified against them
            r = subprocess.run([sys.executable, "-m", "megatron_preflight", "fingerprint", f"msc://store/megatron/{name}"],
                               capture_output=True, text=True, timeout=300, env={**os.environ, "MSC_CONFIG": config})
            assert r.returncode == 0, r.stderr
            mode = "verify"
        common = ("--preflight", mode, "--ckpt-format", "torch_dist", "--train-iters", "4", *flags)
        rc, local = run(tmp_path, fixture_path(name), nproc, *common, port=port, verify=False)
        assert rc == 0, local[-3000:]
        rc, remote = run(tmp_path, fixture_path(name), nproc, *common, "--load", f"msc://store/megatron/{name}",
                         "--enable-msc", port=port + 1, verify=False, env_extra={"MSC_CONFIG": config})
        assert rc == 0, remote[-3000:]
        said = [line for line in remote.splitlines() if "[megatron-preflight]" in line]
        assert f"checkpoint msc://store/megatron/{name}" in remote and not any("preflight-msc-" in s for s in said)
        if name.startswith("distopt_dpr"):
            assert "loaded through the in-memory resharder" in remote
        else:
            assert VERIFIED.search(remote), remote[-3000:]
        for it in (3, 4):
            assert loss(remote, it, 4) is not None and loss(remote, it, 4) == loss(local, it, 4), (name, it)


def test_megatron_saves_moe_to_object_storage_and_the_plugin_reads_reshards_and_resumes_it(tmp_path):
    """Real Megatron-LM saves an MoE model with the distributed optimizer (dp_reshardable, its default) at EP2·DP2 to
    ``msc://`` on a real S3-compatible server (SeaweedFS); ``inspect`` of it fetches the metadata only; a job at EP4
    loads it through the in-memory resharder from the store with the losses of the same load from a local download;
    ``reshard msc://... msc://...`` at EP4 is loaded by plain Megatron from the store (``--enable-msc``, no plugin)
    with those losses (another optimizer form of the same state: within 1e-5)."""
    python, env = megatron_env(ROOT)
    if subprocess.run([python, "-c", "import multistorageclient, boto3"], env=env).returncode != 0:
        pytest.skip("multi-storage-client[boto3] is not installed in MEGATRON_LM_PYTHON")
    from tests.helpers import s3_server

    store = s3_server.server()
    msc = {"MSC_CONFIG": store.config("megatron_moe.yaml")}
    url = "msc://store/megatron/moe_ep2dp2"
    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear", "--global-batch-size", "4",
           "--use-distributed-optimizer", "--ckpt-format", "torch_dist"]
    empty = tmp_path / "nothing"
    empty.mkdir()
    rc, log = run(tmp_path, str(empty), 4, *moe, "--expert-model-parallel-size", "2", "--train-iters", "2",
                  "--save-interval", "2", "--save", url, "--enable-msc", plugin=False, port=29840, verify=False,
                  env_extra=msc)
    assert rc == 0, log[-3000:]
    cli = [sys.executable, "-m", "megatron_preflight"]
    r = subprocess.run([*cli, "inspect", url], capture_output=True, text=True, timeout=300, env={**os.environ, **msc})
    assert r.returncode == 0 and "dist. optim yes (dp_reshardable)" in r.stdout, r.stdout + r.stderr
    fetched = re.search(r"fetched of .* in (\d+) objects", r.stderr)
    assert fetched, r.stderr
    local = tmp_path / "downloaded"
    c = store.client()
    for o in c.list_objects_v2(Bucket=s3_server.BUCKET, Prefix="megatron/moe_ep2dp2/")["Contents"]:
        dst = local / o["Key"][len("megatron/moe_ep2dp2/"):]
        dst.parent.mkdir(parents=True, exist_ok=True)
        c.download_file(s3_server.BUCKET, o["Key"], str(dst))
    resume = [*moe, "--expert-model-parallel-size", "4", "--train-iters", "4", "--no-load-rng"]
    rc, from_disk = run(tmp_path, str(local), 4, *resume, "--preflight", "auto", port=29842, verify=False)
    assert rc == 0 and "loaded through the in-memory resharder" in from_disk, from_disk[-3000:]
    rc, from_store = run(tmp_path, str(local), 4, *resume, "--preflight", "auto", "--load", url, "--enable-msc",
                         port=29844, verify=False, env_extra=msc)
    assert rc == 0 and "loaded through the in-memory resharder" in from_store, from_store[-3000:]
    want = [loss(from_disk, it, 4) for it in (3, 4)]
    assert None not in want and [loss(from_store, it, 4) for it in (3, 4)] == want
    r = subprocess.run([*cli, "reshard", url, url + "_ep4", "--ep", "4", "--no-progress"], capture_output=True,
                       text=True, timeout=600, env={**os.environ, **msc})
    assert r.returncode == 0 and "published" in r.stderr, r.stdout + r.stderr
    rc, plain = run(tmp_path, str(local), 4, *resume, "--load", url + "_ep4", "--enable-msc", plugin=False,
                    port=29846, verify=False, env_extra=msc)
    assert rc == 0, plain[-3000:]
    for it, value in zip((3, 4), want, strict=True):
        assert abs(float(loss(plain, it, 4)) - float(value)) < 1e-5, (it, loss(plain, it, 4), value)

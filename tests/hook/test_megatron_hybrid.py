"""HybridModel end to end against the REAL Megatron-LM pretrain_hybrid.py (issue 32): Mamba-2 (M), gated delta net
(G), attention (*), MLP (-), MoE (E) and MTP layers, checked, resharded in memory and offline, proven by Megatron.

Skipped unless MEGATRON_LM_ROOT, MEGATRON_LM_TE_CPU and MEGATRON_LM_MAMBA_CPU are set. These runs use CPU STAND-INS,
not the real packages: ``te_cpu`` for Transformer Engine and ``mamba_cpu`` for mamba_ssm and fla
(../shared/tools/megatron-lm-cpu/; the real parameter layout, reference math). The fixtures were written the same way
(tests/fixtures/megatron-lm/LOCAL_FIXTURES.md, "HybridModel").

Oracles: Megatron's own load-time reshard of each fixture's torch_dist twin (the losses of iterations 3 and 4 and every
MTP loss, with the optimizer state loaded), Megatron's saved reshard of the twin (``--ckpt-convert-format torch``:
bit for bit), and, where Megatron's dist loader cannot serve, Megatron's legacy resume of the source at its own layout.
"""

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import fixture_path
from tests.hook.test_megatron_lm import (
    MAMBA_CPU,
    ROOT,
    TE_CPU,
    TINY,
    _without,
    assert_same_files,
    assert_trains_alike_with_mtp,
    loss,
    run,
)

pytestmark = pytest.mark.skipif(not (ROOT and TE_CPU and MAMBA_CPU),
                                reason="needs MEGATRON_LM_ROOT, MEGATRON_LM_TE_CPU and MEGATRON_LM_MAMBA_CPU (the CPU "
                                       "stand-ins for Transformer Engine, mamba_ssm and fla)")

# the fixtures' model (LOCAL_FIXTURES.md): hidden 32; Mamba 8 heads x 8 in 2 groups, state 8; GDN 2 key / 4 value
# heads of 8; attention 4 heads in 2 query groups; 4 experts
HYBRID = TINY + ("--spec megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec --normalization RMSNorm "
                 "--position-embedding-type none --disable-bias-linear --swiglu --untie-embeddings-and-output-weights "
                 "--group-query-attention --num-query-groups 2 --mamba-state-dim 8 --mamba-head-dim 8 "
                 "--mamba-num-groups 2 --linear-key-head-dim 8 --linear-value-head-dim 8 --linear-num-key-heads 2 "
                 "--linear-num-value-heads 4 --num-experts 4 --moe-router-topk 2 --train-iters 4").split()
PATTERN = "MG*-E/*-"  # hyb_tp2_torch: every family and an MTP depth


def hybrid(tmp_path, ckpt, nproc, *flags, **kw):
    return run(tmp_path, ckpt, nproc, *flags, script="pretrain_hybrid.py", base=HYBRID, **kw)


def iteration_losses(log):
    return loss(log, 3, 4), loss(log, 4, 4)


@pytest.mark.parametrize("nproc, target", [
    (1, ["--hybrid-layer-pattern", PATTERN]),
    (2, ["--hybrid-layer-pattern", "MG|*-E/*-", "--pipeline-model-parallel-size", "2"]),
], ids=["tp2->tp1", "tp2->tp1pp2 unequal segments"])
def test_auto_resumes_a_tp2_hybrid_like_megatrons_dist_reshard(tmp_path, nproc, target):
    """The sectioned Mamba / GDN projections re-split, the layers placed by the run's '|' segments, the MTP stack on
    the last stage, the Adam state with them: iterations 3, 4 and the MTP losses equal Megatron's own reshard."""
    rc, log = hybrid(tmp_path, fixture_path("hyb_tp2_torch"), nproc, "--preflight", "auto", "--ckpt-format", "torch",
                     *target, port=29970)
    assert rc == 0, log[-3000:]
    assert "loaded through the in-memory resharder" in log and "applied: no_load_optim" not in log
    rc2, log2 = hybrid(tmp_path, fixture_path("hyb_tp2_torch_dist"), nproc, "--no-load-rng", "--ckpt-format",
                       "torch_dist", *target, plugin=False, port=29971)
    assert rc2 == 0, log2[-3000:]
    assert_trains_alike_with_mtp(log, log2)


def test_checks_advice_for_a_tp2_hybrid_followed_word_for_word_resumes_like_megatrons_dist_reshard(tmp_path):
    """The user's literal path for a HybridModel: a pretrain_hybrid.py run that leaves TP at Megatron's default (1);
    `check` prints one offline reshard, run as printed (NEW_DIR substituted); `check` of the output says LOAD and plain
    pretrain_hybrid.py trains it like Megatron's own reshard of the twin (iterations 3, 4 and every MTP loss). `check`
    judges for the release that loads it (--megatron-version of the Megatron-LM here: main, megatron-core 0.20, which
    names a Mamba conv `conv1d_weight`; the CLI's default is the megatron-core installed beside it)."""
    from tests.helpers.advised import follow_advice

    extra = os.environ.get("MEGATRON_LM_EXTRA_ARGS", "").split()
    flags = ["--hybrid-layer-pattern", PATTERN, "--no-load-rng"]
    run_flags = [*HYBRID, *extra, "--transformer-impl", "transformer_engine", "--ckpt-format", "torch", *flags]
    new = str(tmp_path / "new")
    follow_advice(fixture_path("hyb_tp2_torch"), run_flags, new, "--megatron-version", "0.20")
    rc, log = hybrid(tmp_path, new, 1, "--ckpt-format", "torch", *flags, plugin=False, port=29978)
    assert rc == 0, log[-3000:]
    rc2, log2 = hybrid(tmp_path, fixture_path("hyb_tp2_torch_dist"), 1, "--ckpt-format", "torch_dist", *flags,
                       plugin=False, port=29979)
    assert rc2 == 0, log2[-3000:]
    assert_trains_alike_with_mtp(log, log2)


@pytest.mark.parametrize("how", ["in memory", "offline as check advises"])
def test_a_gdn_checkpoint_whose_out_norm_copies_drifted_resumes_at_tp1_like_megatrons_dist_reshard(tmp_path, how):
    """gdn_tp2_torch: gated delta net layers at TP2 without --sequence-parallel; their out_norm TP copies differ, as
    Megatron's training leaves them (it does not reduce that gradient over TP). At TP1, in memory (--preflight auto)
    and offline (the command `check` prints, run as printed), TP rank 0's copy is used, as Megatron's torch_dist save
    keeps it: iterations 3 and 4 equal Megatron's own reshard of the torch_dist twin at TP1."""
    from tests.helpers.advised import follow_advice

    base = _without(HYBRID, ("--num-experts", "--moe-router-topk"))

    def gdn_run(ckpt, *more, **kw):
        return run(tmp_path, ckpt, 1, *more, script="pretrain_hybrid.py", base=base, **kw)

    flags = ["--hybrid-layer-pattern", "MG*-G-", "--no-load-rng"]
    if how == "in memory":
        rc, log = gdn_run(fixture_path("gdn_tp2_torch"), "--preflight", "auto", "--ckpt-format", "torch", *flags,
                          port=29980)
        assert rc == 0 and "loaded through the in-memory resharder" in log, log[-3000:]
        assert "Megatron lets drift" in log and "out_norm" in log, log[-3000:]
    else:
        extra = os.environ.get("MEGATRON_LM_EXTRA_ARGS", "").split()
        run_flags = [*base, *extra, "--transformer-impl", "transformer_engine", "--ckpt-format", "torch", *flags]
        new = str(tmp_path / "new")
        done = follow_advice(fixture_path("gdn_tp2_torch"), run_flags, new, "--megatron-version", "0.20")
        assert "Megatron lets drift" in done.stdout, done.stdout
        rc, log = gdn_run(new, "--ckpt-format", "torch", *flags, plugin=False, port=29980)
        assert rc == 0, log[-3000:]
    rc2, log2 = gdn_run(fixture_path("gdn_tp2_torch_dist"), "--ckpt-format", "torch_dist", *flags, plugin=False,
                        port=29981)
    assert rc2 == 0, log2[-3000:]
    assert loss(log, 4, 4) is not None and iteration_losses(log) == iteration_losses(log2)


def test_offline_reshard_of_a_virtual_pipeline_resumes_in_plain_megatron(tmp_path):
    """PP2 with four '|' segments (VPP2) -> PP1: `megatron-preflight reshard` writes the pattern without cuts into the
    args; plain pretrain_hybrid.py resumes it like Megatron's reshard of the twin."""
    out = tmp_path / "pp1"
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", fixture_path("hyb_vpp_pp2_torch"),
                        str(out), "--pp", "1", "--verify", "--fingerprint", "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    flags = ["--hybrid-layer-pattern", "M*G-E*M-", "--no-load-rng"]
    rc, log = hybrid(tmp_path, str(out), 1, "--ckpt-format", "torch", *flags, plugin=False, port=29972)
    assert rc == 0, log[-3000:]
    rc2, log2 = hybrid(tmp_path, fixture_path("hyb_vpp_pp2_torch_dist"), 1, "--ckpt-format", "torch_dist", *flags,
                       plugin=False, port=29973)
    assert rc2 == 0, log2[-3000:]
    assert loss(log, 4, 4) is not None and iteration_losses(log) == iteration_losses(log2)


def test_the_distributed_optimizer_of_unequal_segments_resumes_exactly(tmp_path):
    """'MG*|-EM*E' at PP2·EP2·DP2 with the distributed optimizer -> PP1·EP2: the expert param group of stage 0 (which
    holds no expert) never stepped; its fused Adam step is taken from the stage that has the experts. Oracle: Megatron's
    legacy resume of the source at its own layout (iteration 4 needs every Adam moment and step). Megatron's dist
    loader of the twin gives another iteration 4 even at the twin's own layout, so it is not the oracle here."""
    common = ["--num-experts", "4", "--use-distributed-optimizer", "--expert-model-parallel-size", "2", "--no-load-rng"]
    rc, log = hybrid(tmp_path, fixture_path("hyb_distopt_pp2ep2_torch"), 2, "--preflight", "auto", "--ckpt-format",
                     "torch", "--hybrid-layer-pattern", "MG*-EM*E", *common, port=29974)
    assert rc == 0 and "loaded through the in-memory resharder" in log, log[-3000:]
    rc2, log2 = hybrid(tmp_path, fixture_path("hyb_distopt_pp2ep2_torch"), 4, "--ckpt-format", "torch",
                       "--hybrid-layer-pattern", "MG*|-EM*E", "--pipeline-model-parallel-size", "2", *common,
                       plugin=False, port=29975)
    assert rc2 == 0, log2[-3000:]
    assert loss(log, 4, 4) is not None and iteration_losses(log) == iteration_losses(log2)


@pytest.mark.parametrize("name, nproc, target, flags", [
    ("hyb_tp2", 1, {"tp": 1}, ["--hybrid-layer-pattern", PATTERN]),
    ("hyb_tp2", 2, {"tp": 1, "pp": 2, "hybrid_layer_pattern": "MG|*-E/*-"},
     ["--hybrid-layer-pattern", "MG|*-E/*-", "--pipeline-model-parallel-size", "2"]),
    ("hyb_vpp_pp2", 1, {"pp": 1}, ["--hybrid-layer-pattern", "M*G-E*M-"]),
], ids=["tp1", "tp1pp2", "vpp2pp2->pp1"])
def test_our_hybrid_reshard_equals_megatrons_own_saved_reshard(tmp_path, name, nproc, target, flags):
    """Megatron loads the twin at the target layout and saves it as legacy: our reshard of the legacy checkpoint has
    the same files, keys in the same order, every tensor bit for bit and the same optimizer state."""
    from megatron_preflight.prove.diff import diff_checkpoints
    from megatron_preflight.reshard import TargetLayout, write_resharded

    saved = tmp_path / "megatron_converted"
    rc, log = hybrid(tmp_path, fixture_path(f"{name}_torch_dist"), nproc, "--ckpt-format", "torch_dist",
                     "--ckpt-convert-format", "torch", "--ckpt-convert-save", str(saved), *flags, plugin=False,
                     port=29976, verify=False)
    assert rc == 0 and "converted checkpoint" in log, log[-3000:]
    ours = str(tmp_path / "ours")
    write_resharded(fixture_path(f"{name}_torch"), ours, TargetLayout(**target), verify=True)
    report = diff_checkpoints(ours, str(saved / "torch"))
    assert report.equal, report.render()
    assert_same_files(ours, str(saved / "torch"))


def test_another_pattern_fails_every_rank_before_model_build(tmp_path):
    rc, log = hybrid(tmp_path, fixture_path("hyb_tp2_torch"), 2, "--preflight", "check", "--ckpt-format", "torch",
                     "--tensor-model-parallel-size", "2", "--sequence-parallel", "--hybrid-layer-pattern", "MG*-M/*-",
                     port=29977)
    assert rc != 0
    assert "hybrid_layer_pattern" in log and "the job must not start" in log
    assert "number of parameters" not in log  # the model was never built


def test_legacy_hybrid_written_as_torch_dist_resumes_exactly(tmp_path):
    """`reshard --ckpt-format torch_dist` of the PP2·EP2 distributed-optimizer checkpoint: per-layer keys, each
    section a global tensor, the fused Adam's step in every group. Megatron's dist loader resumes it at PP1·EP2 exactly
    as its legacy loader resumes the source at its own layout (its own twin's resume differs: the twin's expert group
    was saved without a step by a rank that holds no expert)."""
    out = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", fixture_path("hyb_distopt_pp2ep2_torch"),
                        str(out), "--ckpt-format", "torch_dist", "--verify", "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    common = ["--num-experts", "4", "--use-distributed-optimizer", "--expert-model-parallel-size", "2", "--no-load-rng"]
    rc, log = hybrid(tmp_path, str(out), 2, "--ckpt-format", "torch_dist", "--hybrid-layer-pattern", "MG*-EM*E",
                     *common, plugin=False, port=29978)
    assert rc == 0, log[-3000:]
    rc2, log2 = hybrid(tmp_path, fixture_path("hyb_distopt_pp2ep2_torch"), 4, "--ckpt-format", "torch",
                       "--hybrid-layer-pattern", "MG*|-EM*E", "--pipeline-model-parallel-size", "2", *common,
                       plugin=False, port=29979)
    assert rc2 == 0, log2[-3000:]
    assert loss(log, 4, 4) is not None and iteration_losses(log) == iteration_losses(log2)


def test_the_patched_pretrain_hybrid_reshards_in_memory(tmp_path):
    """patches/pretrain_hybrid.py.patch, applied with `git apply` to this Megatron-LM's pretrain_hybrid.py: the one
    flag turns the hook on."""
    work = tmp_path / "patched"
    work.mkdir()
    shutil.copy(os.path.join(ROOT, "pretrain_hybrid.py"), work / "pretrain_hybrid.py")
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    patch = os.path.join(os.path.dirname(__file__), "..", "..", "patches", "pretrain_hybrid.py.patch")
    r = subprocess.run(["git", "-C", str(work), "apply", os.path.abspath(patch)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rc, log = hybrid(tmp_path, fixture_path("hyb_tp2_torch"), 1, "--preflight", "auto", "--ckpt-format", "torch",
                     "--hybrid-layer-pattern", PATTERN, launch=[str(work / "pretrain_hybrid.py")], port=29980,
                     verify=False)
    assert rc == 0 and "loaded through the in-memory resharder" in log, log[-3000:]


SPEC = ["--spec", "megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec"]
GPT_MTP_MOE = ("--mtp-num-layers 1 --position-embedding-type rope --untie-embeddings-and-output-weights --num-experts 4 "
               "--moe-router-topk 2 --disable-bias-linear --moe-grouped-gemm --expert-model-parallel-size 2").split()


@pytest.mark.parametrize("legacy, oracle, nproc, flags, pattern", [
    ("te_tp2_torch", "te_tp2_torch_dist", 2, ["--pipeline-model-parallel-size", "2"], "*-*-|*-*-"),
    ("mtp_moe_te_ep2_torch", "mtp_moe_te_ep2_torch", 2, GPT_MTP_MOE, "*E*E*E*E/*E"),
], ids=["gpt tp2 -> hybrid tp1pp2", "gpt moe+mtp ep2 -> hybrid ep2"])
def test_a_legacy_gpt_checkpoint_resumes_in_a_hybrid_run_with_the_gpt_runs_loss(tmp_path, legacy, oracle, nproc,
                                                                                flags, pattern):
    """GPT layer i is hybrid layers 2i (attention) and 2i+1 (MLP / MoE): pretrain_hybrid.py with --preflight auto
    trains on exactly as pretrain_gpt.py resumes the GPT checkpoint (Megatron's own torch_dist twin at TP1, or the
    legacy source at its own layout): iterations 3 and 4 (and the MTP losses) equal."""
    rc, log = run(tmp_path, fixture_path(legacy), nproc, "--preflight", "auto", "--ckpt-format", "torch",
                  "--no-load-rng", "--train-iters", "4", *SPEC, "--hybrid-layer-pattern", pattern, *flags,
                  script="pretrain_hybrid.py", port=29981)
    assert rc == 0 and "loaded through the in-memory resharder" in log, log[-3000:]
    dist = oracle.endswith("_dist")
    rc2, log2 = run(tmp_path, fixture_path(oracle), 1 if dist else nproc, "--ckpt-format",
                    "torch_dist" if dist else "torch", "--no-load-rng", "--train-iters", "4",
                    *([] if dist else flags), plugin=False, te=True, port=29982)
    assert rc2 == 0, log2[-3000:]
    assert loss(log, 4, 4) is not None and iteration_losses(log) == iteration_losses(log2)
    if "--mtp-num-layers" in flags:
        assert_trains_alike_with_mtp(log, log2)


RELEASE_018 = dict(item.split("=", 1) for item in os.environ.get("MEGATRON_LM_RELEASES", "").split(",")
                   if "=" in item).get("0.18")


def test_a_hybrid_checkpoint_of_megatron_0_18_resumes_through_auto(tmp_path):
    """core_r0.18.0 wrote its Mamba convs as `mixer.conv1d.weight` (a module after in_proj); this Megatron holds
    `mixer.conv1d_weight` first. Plain pretrain_hybrid.py loads it non-strictly (the convs stay at init) and then
    crashes in Adam on moments of other shapes; with --preflight auto the keys are renamed and moved, the Adam state
    with them, and training continues as 0.18's own resume (where its work tree is given)."""
    flags = ["--ckpt-format", "torch", "--hybrid-layer-pattern", "M*-", "--tensor-model-parallel-size", "2",
             "--no-load-rng"]
    no_moe = ("--num-experts", "--moe-router-topk")  # (this fixture has no MoE layer)
    rc, log = hybrid(tmp_path, fixture_path("hyb18_tp2_torch"), 2, "--preflight", "auto", *flags, port=29983,
                     drop=no_moe)
    assert rc == 0 and "loaded through the in-memory resharder" in log, log[-3000:]
    rc0, log0 = hybrid(tmp_path, fixture_path("hyb18_tp2_torch"), 2, *flags, plugin=False, port=29984, verify=False,
                       drop=no_moe)
    assert rc0 != 0 and "lm loss" not in log0
    if RELEASE_018:
        rc2, log2 = hybrid(tmp_path, fixture_path("hyb18_tp2_torch"), 2, *flags, plugin=False, port=29985,
                           root=RELEASE_018, verify=False, drop=no_moe)
        assert rc2 == 0, log2[-3000:]
        assert loss(log, 4, 4) is not None and iteration_losses(log) == iteration_losses(log2)


def test_an_impossible_hybrid_layout_is_answered_by_the_plugin_before_megatron(tmp_path):
    """TP3 on pretrain_hybrid.py: the heads, query groups, Mamba heads and groups named at argument parsing, every
    rank stopped with status 1 (hook/early.py), not Megatron's error per rank."""
    from tests.hook.test_megatron_releases import assert_stopped_by_the_plugin

    rc, log = hybrid(tmp_path, fixture_path("hyb_tp2_torch"), 3, "--hybrid-layer-pattern", "M*-M*-",
                     "--tensor-model-parallel-size", "3", "--ckpt-format", "torch", "--preflight", "check",
                     port=29798, verify=False)
    assert_stopped_by_the_plugin(rc, log, "8 Mamba heads are not divisible by TP3")


def test_the_printed_flags_of_a_hybrid_checkpoint_start_pretrain_hybrid_as_the_hand_written_ones(tmp_path):
    """`flags` of a HybridModel checkpoint (its spec, pattern, Mamba-2 and gated delta net sizes; no MLA or rotary
    defaults it never used), run as printed by pretrain_hybrid.py with --preflight auto at TP1: iterations 3, 4 and the
    MTP losses equal those of the same resume with the fixture's hand-written flags."""
    import shlex
    import subprocess
    import sys

    from tests.helpers.tiny import MODEL_FLAGS

    ckpt = fixture_path("hyb_tp2_torch")
    done = subprocess.run([sys.executable, "-m", "megatron_preflight", "flags", ckpt], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("# run pretrain_hybrid.py"), done.stderr
    printed = [w for line in done.stdout.splitlines() if not line.startswith("#")
               for w in shlex.split(line.rstrip(" \\"))]
    assert "--kv-lora-rank" not in printed and "--rotary-base" not in printed
    train = TINY[len(MODEL_FLAGS):] + ["--train-iters", "4", "--seq-length", "32"]  # (a run setting, not the model)
    rc, log = run(tmp_path, ckpt, 1, *printed, "--preflight", "auto", "--ckpt-format", "torch",
                  script="pretrain_hybrid.py", base=train, port=29973)
    assert rc == 0, log[-3000:]
    rc2, log2 = hybrid(tmp_path, ckpt, 1, "--preflight", "auto", "--ckpt-format", "torch", "--hybrid-layer-pattern",
                       PATTERN, port=29974)
    assert rc2 == 0, log2[-3000:]
    assert_trains_alike_with_mtp(log, log2)


def test_an_impossible_layout_of_a_hybrid_run_is_answered_by_the_plugin_before_megatron(tmp_path):
    """pretrain_hybrid.py at TP3 over 4 ranks on the hybrid fixture (4 attention heads, 2 gated delta net key heads):
    the plugin's message at argument parsing with its fix and the nearest layouts of 4 ranks, every rank exit 1, no
    Megatron traceback. (Over 3 ranks this model has no layout at all: its global batch of 2 takes no DP3, its 5
    layers no PP3; the message then names none.)"""
    from tests.hook.test_megatron_releases import assert_stopped_by_the_plugin

    rc, log = hybrid(tmp_path, fixture_path("hyb_tp2_torch"), 4, "--preflight", "check", "--ckpt-format", "torch",
                     "--hybrid-layer-pattern", PATTERN, "--tensor-model-parallel-size", "3", port=29975, verify=False)
    assert_stopped_by_the_plugin(rc, log, "4 attention heads are not divisible by TP3")

"""Megatron-FSDP and fsdp_dtensor checkpoints in ``check`` (check/fsdp.py), on real fsdp_dtensor saves: each run that
Megatron would fail after the build is named before it, with a fix that works (the advised offline conversion is run
as printed; the real-Megatron resumes are in tests/hook/test_megatron_fsdp.py)."""

import pytest

from megatron_preflight.check.plan import make_plan
from megatron_preflight.check.runtime_args import from_cli
from megatron_preflight.check.verdict import Loader, Verdict
from megatron_preflight.layout.discover import discover
from tests.conftest import fixture_path
from tests.helpers.advised import follow_advice
from tests.helpers.tiny import FLAGS

TE = ["--transformer-impl", "transformer_engine"]
FSDP = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--data-parallel-sharding-strategy",
        "optim_grads_params"]


def _plan(name: str, *flags: str):
    return make_plan(fixture_path(name), from_cli([*FLAGS, *TE, *flags], env={}))


def _fields(findings) -> set[str]:
    return {f.field for f in findings}


@pytest.mark.parametrize("name", ["fsdp_dp2", "fsdp_tp2dp2", "fsdp_dp2_bf16_swiglu"])
def test_no_unsafe_pickle_finding_and_the_fsdp_run_loads_as_is(name):
    layout = discover(fixture_path(name))
    precision = ["--bf16", "--swiglu"] if layout.saved_args.bf16 else []
    tp = layout.tp or 1  # (at its TP: another TP pads the vocab otherwise, which Megatron-FSDP does not load)
    plan = _plan(name, *FSDP, *precision, "--tensor-model-parallel-size", str(tp), "--world-size", str(2 * tp))
    assert plan.verdict == Verdict.LOAD and plan.loader == Loader.DIST, [f.message for f in plan.fatal]
    assert "unsafe_pickle" not in _fields(plan.findings)


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])
def test_a_3d_run_is_a_reshard_whose_printed_conversion_writes_what_it_loads(tmp_path, ckpt_format):
    flags = [*FLAGS, *TE, "--use-distributed-optimizer", "--tensor-model-parallel-size", "2", "--world-size", "4",
             "--ckpt-format", ckpt_format]
    plan = make_plan(fixture_path("fsdp_dp2"), from_cli(flags, env={}))
    assert plan.verdict == Verdict.RESHARD and plan.loader == Loader.RESHARD
    (f,) = [f for f in plan.findings if f.field == "ckpt_format"]
    assert "--preflight auto" in f.fix and "--use-megatron-fsdp --ckpt-format fsdp_dtensor" in f.fix
    new = str(tmp_path / "new")
    follow_advice(fixture_path("fsdp_dp2"), flags, new)
    assert discover(new).format.value == ckpt_format


@pytest.mark.parametrize("name, own", [("fsdp_dp2_twin_torch_dist", TE),
                                       ("tp2_torch", ["--tensor-model-parallel-size", "2"])])
def test_a_megatron_fsdp_run_given_a_3d_checkpoint_is_a_reshard_whose_printed_conversion_writes_what_it_loads(
        tmp_path, name, own):
    """torch_dist and legacy (at their own layout and spec): the hook serves it in memory (--preflight auto) or the
    printed command converts it."""
    flags = [*FLAGS, *own, *FSDP, "--no-load-rng", "--world-size", "2"]
    plan = make_plan(fixture_path(name), from_cli(flags, env={}))
    assert plan.verdict == Verdict.RESHARD and plan.loader == Loader.RESHARD, [f.message for f in plan.fatal]
    (f,) = [f for f in plan.findings if f.field == "use_megatron_fsdp"]
    assert "KeyError: 'model'" in f.message and "--preflight auto" in f.fix and "drop --use-megatron-fsdp" in f.fix
    assert any("each rank reads the whole checkpoint" in n for n in plan.notes)
    new = str(tmp_path / "new")
    follow_advice(fixture_path(name), flags, new)
    assert discover(new).format.value == "fsdp_dtensor"


@pytest.mark.parametrize("flags, field, said", [
    (["--use-megatron-fsdp", "--ckpt-format", "torch_dist"], "ckpt_format", "requires the `fsdp_dtensor`"),
    (["--ckpt-format", "fsdp_dtensor"], "ckpt_format", "only tested with Megatron FSDP"),
    ([*FSDP, "--bf16"], "precision", "'Missing key"),
])
def test_a_run_megatron_would_refuse_is_fatal_before_the_build(flags, field, said):
    plan = _plan("fsdp_dp2", *flags, "--world-size", "2")
    assert plan.verdict == Verdict.FAIL
    assert any(f.field == field and said in f.message for f in plan.fatal), [f.message for f in plan.fatal]


def test_without_the_optimizer_state_a_half_precision_fsdp_run_is_fatal_and_fp32_loads():
    """Measured in real Megatron-LM: a bf16 Megatron-FSDP run with --no-load-optim fails after the build ('does not
    implement a model-to-main parameter update'); the fp32 one trains."""
    half = _plan("fsdp_dp2", *FSDP, "--bf16", "--no-load-optim", "--world-size", "2")
    assert "no_load_optim" in _fields(half.fatal) and "precision" not in _fields(half.fatal)
    full = _plan("fsdp_dp2", *FSDP, "--no-load-optim", "--world-size", "2")
    assert full.verdict == Verdict.LOAD


def test_an_fp32_swiglu_megatron_fsdp_run_that_saves_is_fatal_before_it_trains(tmp_path):
    """Measured in real Megatron-LM main: fp32 + --swiglu under Megatron-FSDP trains, then its save fails ('GPTModel
    has no attribute `module`'); bf16, or no --save, is fine."""
    save = ["--save", str(tmp_path / "save")]

    def fails_at_save(*flags: str) -> bool:
        plan = _plan("fsdp_dp2_bf16_swiglu", *FSDP, "--swiglu", *flags, "--world-size", "2")
        return any(f.field == "save" and "no attribute `module`" in f.message and "--bf16" in f.fix
                   for f in plan.fatal)

    assert fails_at_save(*save)
    assert not fails_at_save()
    assert not fails_at_save("--bf16", *save)


def test_megatron_fsdp_with_pipeline_parallelism_is_fatal_and_plan_lists_pp1_only():
    """Measured in real Megatron-LM main: Megatron-FSDP at PP2 fails wrapping the model (its device mesh has no
    pipeline dimension)."""
    from megatron_preflight import fit, reshard

    plan = _plan("fsdp_dp2", *FSDP, "--pipeline-model-parallel-size", "2", "--world-size", "2")
    (f,) = [f for f in plan.fatal if f.field == "pipeline_model_parallel_size" and "Megatron-FSDP" in f.message]
    assert "--pipeline-model-parallel-size 1" in f.fix
    index = reshard.open_index(fixture_path("fsdp_dp2"))
    argv = [*FLAGS, *TE, *FSDP]
    layouts = fit.plan_layouts(index, fit.run_args(index.layout.saved_args, argv), argv, 8).candidates
    assert layouts and {c.layout.pp for c in layouts} == {1}


@pytest.mark.parametrize("version, expected", [("0.19", "mtp_model_layer"), ("0.17", "mtp_model_layer"),
                                               ("0.20", None), ("0.16", None)])
def test_mtp_layers_named_as_another_release_names_them_are_a_reshard_whose_printed_rewrite_loads(tmp_path, version,
                                                                                                  expected):
    """fsdp_mtp (main: MTP tensors under `transformer_layer`) in a Megatron-FSDP run of megatron-core 0.17-0.19, which
    asks for `mtp_model_layer` (core_r0.19.0 fails after the build: 'Missing key in checkpoint state_dict'): a reshard,
    and the printed rewrite (both names) is what that run loads; main and 0.16 name them as saved."""
    from megatron_preflight.check import releases

    flags = [*FLAGS, *TE, *FSDP, "--mtp-num-layers", "1", "--position-embedding-type", "rope", "--no-load-rng",
             "--world-size", "2"]
    rt = from_cli(flags, env={})
    releases.apply(rt, releases.facts(releases.parse_version(version)))
    plan = make_plan(fixture_path("fsdp_mtp"), rt)
    found = [f for f in plan.findings if f.field == "mtp_layer_name"]
    if expected is None:
        assert not found and plan.verdict == Verdict.LOAD, [f.message for f in plan.findings]
        return
    (f,) = found
    assert (f.runtime, plan.verdict) == (expected, Verdict.RESHARD) and "--preflight auto" in f.fix, f.message
    new = str(tmp_path / "new")
    follow_advice(fixture_path("fsdp_mtp"), flags, new, "--megatron-version", version)
    names = {k.split(".mtp.layers.0.")[1].split(".")[0] for k in discover(new).dist_tensors if ".mtp.layers.0." in k}
    assert {"transformer_layer", "mtp_model_layer"} <= names


def test_another_vocab_padding_under_megatron_fsdp_is_a_reshard_and_the_divisor_that_keeps_it_loads_as_is():
    """fsdp_gqa_untied_rope (TP1, vocab 100 padded to 128) in a Megatron-FSDP run at TP2: the vocab pads to 256 and
    Megatron-FSDP fails after the build ('Size mismatch between saved torch.Size([128, 32]) and current:
    torch.Size([256, 32])', measured in Megatron-LM main); the divisor the fix names keeps 128: loads as is."""
    flags = [*FLAGS, *TE, *FSDP, "--group-query-attention", "--num-query-groups", "2",
             "--untie-embeddings-and-output-weights", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
             "--tensor-model-parallel-size", "2", "--no-load-rng", "--world-size", "2"]
    plan = make_plan(fixture_path("fsdp_gqa_untied_rope"), from_cli(flags, env={}))
    (f,) = [f for f in plan.findings if f.field == "padded_vocab_size"]
    assert (f.checkpoint, f.runtime, plan.verdict, plan.loader) == (128, 256, Verdict.RESHARD, Loader.RESHARD)
    assert "--preflight auto" in f.fix, f.fix
    divisor = f.fix.split("--make-vocab-size-divisible-by ")[1].split()[0]
    kept = make_plan(fixture_path("fsdp_gqa_untied_rope"),
                     from_cli([*flags, "--make-vocab-size-divisible-by", divisor], env={}))
    assert kept.verdict == Verdict.LOAD and kept.loader == Loader.DIST, [g.message for g in kept.findings]

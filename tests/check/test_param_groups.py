"""The optimizer's param groups as the run's Megatron pairs them on load (real Megatron-LM checkpoints, saved with
--lr 1e-4 --min-lr 1e-5; declr_*: --decoupled-lr 5e-4 --decoupled-min-lr 5e-5 for the embedding and output layer).

Megatron-LM main pairs saved groups by (…, max_lr, min_lr, …): a resume with another --lr fails in load_checkpoint
whatever the scheduler flags say (proven against the real thing in tests/hook/test_megatron_lm.py); megatron-core 0.16
pairs by structure only and loads it."""

import copy

import pytest

from megatron_preflight.check.param_groups import param_group_findings, saved_param_groups
from megatron_preflight.check.plan import Verdict, make_plan
from megatron_preflight.check.runtime_args import from_cli
from megatron_preflight.check.schedule import scheduler_flag_findings
from megatron_preflight.layout.discover import discover
from tests.conftest import fixture_path
from tests.helpers.tiny import FLAGS

# megatron.core.optimizer.optimizer.param_group_identifier_keys of Megatron-LM main (d98e8a64) and of 0.16.1
MAIN_KEYS = ("end_wd", "max_lr", "min_lr", "optimizer", "start_wd", "wd_mult", "lr_mult", "is_expert_parallel",
             "is_decoupled_lr")
CORE_016_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
RUN = ["--min-lr", "1e-5", "--lr-decay-style", "constant", "--train-iters", "4", "--global-batch-size", "1",
       "--use-checkpoint-opt-param-scheduler"]


def rt(*flags, keys=MAIN_KEYS):
    args = from_cli(FLAGS + ["--tensor-model-parallel-size", "2", *RUN, *flags])
    args.param_group_keys = keys
    return args


@pytest.mark.parametrize("name", ["tp2_torch", "tp2_torch_dist", "distopt_tp2dp2_torch", "moe_ep2_torch",
                                  "fp16_qkln_tp2_torch", "declr_tp2_torch", "declr_tp2_torch_dist"])
def test_every_optimizer_form_shows_its_groups_and_the_saved_rates_load(name):
    groups = saved_param_groups(discover(fixture_path(name)))
    assert len(groups) >= 2 and all(g["max_lr"] in (1e-4, 5e-4) for g in groups), groups
    flags = ["--lr", "1e-4"] + (["--decoupled-lr", "5e-4", "--decoupled-min-lr", "5e-5"] if "declr" in name else [])
    assert param_group_findings(discover(fixture_path(name)), rt(*flags)) == []


@pytest.mark.parametrize("name", ["tp2_torch", "tp2_torch_dist", "distopt_tp2dp2_torch"])
def test_another_lr_is_fatal_where_megatron_pairs_groups_by_it(name):
    layout = discover(fixture_path(name))
    [f] = param_group_findings(layout, rt("--lr", "2e-4"))
    assert f.severity.value == "fatal" and f.field == "optimizer param groups"
    assert (f.checkpoint, f.runtime) == ("max_lr 0.0001", "max_lr 0.0002")
    assert "Could not find parameter group" in f.message and "whatever the scheduler flags say" in f.message
    assert "--lr 0.0001" in f.fix and "--no-load-optim" in f.fix
    [f] = param_group_findings(layout, rt("--lr", "1e-4", "--min-lr", "0"))  # the min LR too
    assert f.checkpoint == "min_lr 1e-05" and "--min-lr 1e-05" in f.fix
    assert param_group_findings(layout, rt("--lr", "2e-4", keys=CORE_016_KEYS)) == []  # pairs by structure: loads
    [f] = param_group_findings(layout, rt("--lr", "2e-4", keys=None))  # offline: what such a Megatron does
    assert f.severity.value == "info" and "Megatron-LM main" in f.message
    assert param_group_findings(layout, rt("--lr", "2e-4", "--no-load-optim")) == []
    assert param_group_findings(layout, rt("--lr", "2e-4", "--finetune")) == []


def test_the_decoupled_groups_are_compared_with_the_decoupled_rates():
    layout = discover(fixture_path("declr_tp2_torch"))
    [f] = param_group_findings(layout, rt("--lr", "1e-4", "--decoupled-lr", "1e-3", "--decoupled-min-lr", "5e-5"))
    assert f.checkpoint == "decoupled max_lr 0.0005" and "--decoupled-lr 0.0005" in f.fix


def test_groups_saved_without_their_rates_cannot_be_paired():
    """A checkpoint of a Megatron that did not record max_lr / min_lr in its groups: Megatron-LM main pairs them as
    None against the run's values and fails."""
    layout = copy.deepcopy(discover(fixture_path("tp2_torch")))
    for g in saved_param_groups(layout):
        del g["max_lr"], g["min_lr"]
    [f] = param_group_findings(layout, rt("--lr", "1e-4"))
    assert f.severity.value == "fatal" and "max_lr not recorded" in f.checkpoint
    assert "the Megatron version that saved" in f.fix
    assert param_group_findings(layout, rt("--lr", "1e-4", keys=CORE_016_KEYS)) == []


def test_the_plan_fails_where_the_scheduler_flags_used_to_make_it_load():
    args = rt("--lr", "2e-4")  # --use-checkpoint-opt-param-scheduler: the schedule itself is no longer fatal
    p = make_plan(fixture_path("tp2_torch"), args)
    assert p.verdict == Verdict.FAIL
    assert {f.field for f in p.findings if f.severity.value == "fatal"} == {"optimizer param groups"}
    args.param_group_keys = CORE_016_KEYS
    assert make_plan(fixture_path("tp2_torch"), args).verdict == Verdict.LOAD


def test_both_scheduler_flags_are_fatal_at_start():
    [f] = scheduler_flag_findings(rt("--lr", "1e-4", "--override-opt-param-scheduler"))
    assert f.severity.value == "fatal" and "both override and use-checkpoint are set" in f.message
    assert scheduler_flag_findings(rt("--lr", "1e-4")) == []


def test_the_hook_asks_megatron_core_for_its_pairing_keys():
    import megatron.core

    from megatron_preflight.hook.runtime import param_group_keys

    keys = param_group_keys()
    assert keys is not None and {"wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr"} <= set(keys)
    if megatron.core.__version__.startswith("0.16"):  # the pinned megatron-core: pairs by structure only
        assert "max_lr" not in keys


def test_a_decoupled_lr_added_or_dropped_on_resume_is_fatal_in_every_megatron():
    """Megatron-LM main, measured: dropping --decoupled-lr fails with "loaded state dict contains a parameter group
    that doesn't match the size of optimizer's group", adding it with "Could not find parameter group"."""
    declr = discover(fixture_path("declr_tp2_torch_dist"))
    for keys in (MAIN_KEYS, CORE_016_KEYS, None):
        [f] = param_group_findings(declr, rt("--lr", "1e-4", keys=keys))
        assert f.field == "decoupled_lr" and f.severity.value == "fatal" and f.checkpoint == 0.0005
        assert "--decoupled-lr 0.0005 --decoupled-min-lr 5e-05" in f.fix and "--no-load-optim" in f.fix
        [f] = param_group_findings(discover(fixture_path("tp2_torch")), rt("--lr", "1e-4", "--decoupled-lr", "5e-4",
                                                                           keys=keys))
        assert f.field == "decoupled_lr" and f.runtime == 0.0005 and "without --decoupled-lr" in f.fix
    assert param_group_findings(declr, rt("--lr", "1e-4", "--no-load-optim")) == []

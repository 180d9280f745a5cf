"""The LR schedule and the horizon, decided at job start from the run's flags and the checkpoint's saved scheduler
(real Megatron-LM checkpoints: 2 iterations at global batch size 2, --lr 1e-4 --min-lr 1e-5 constant, so the saved
scheduler holds 4 decay steps and 4 weight-decay steps, counted in samples)."""

import pytest

from megatron_preflight.check.plan import Verdict, make_plan
from megatron_preflight.check.runtime_args import from_cli
from tests.conftest import fixture_path
from tests.helpers.tiny import FLAGS

SCHEDULE = "--lr 1e-4 --min-lr 1e-5 --lr-decay-style constant".split()


def plan(name, *flags):
    return make_plan(fixture_path(name), from_cli(FLAGS + ["--tensor-model-parallel-size", "2"] + list(flags)))


def fatal(p):
    return {f.field: f for f in p.findings if f.severity.value == "fatal"}


@pytest.mark.parametrize("name", ["tp2_torch", "tp2_torch_dist"])
def test_the_same_schedule_loads(name):
    p = plan(name, *SCHEDULE, "--train-iters", "4", "--global-batch-size", "1")  # 4 x 1 samples: as saved
    assert p.verdict == Verdict.LOAD and not fatal(p), [f.to_json() for f in p.findings]


@pytest.mark.parametrize("name", ["tp2_torch", "tp2_torch_dist"])
def test_a_longer_horizon_trips_megatrons_assert_and_is_named(name):
    p = plan(name, *SCHEDULE, "--train-iters", "4", "--global-batch-size", "2")
    f = fatal(p)
    assert p.verdict == Verdict.FAIL and {"lr_decay_steps", "wd_incr_steps"} <= set(f)
    assert (f["lr_decay_steps"].checkpoint, f["lr_decay_steps"].runtime) == (4, 8)
    assert "--train-iters 2 → 4" in f["lr_decay_steps"].message
    assert "--use-checkpoint-opt-param-scheduler" in f["lr_decay_steps"].fix
    assert "--override-opt-param-scheduler" in f["lr_decay_steps"].fix


def test_a_larger_global_batch_multiplies_the_steps():
    f = fatal(plan("tp2_torch", *SCHEDULE, "--train-iters", "2", "--lr-decay-iters", "2", "--global-batch-size", "4",
                   "--skip-train"))
    assert "global batch size 2 → 4 multiplies the steps by 2" in f["lr_decay_steps"].message


def test_every_changed_value_is_reported_at_once():
    p = plan("tp2_torch", "--lr", "2e-4", "--min-lr", "0", "--lr-decay-style", "cosine", "--train-iters", "4",
             "--global-batch-size", "1")
    assert {"max_lr", "min_lr", "lr_decay_style"} <= set(fatal(p))


@pytest.mark.parametrize("flag", ["--use-checkpoint-opt-param-scheduler", "--override-opt-param-scheduler",
                                  "--use-checkpoint-opt_param-scheduler"])
def test_either_flag_makes_it_loadable_and_says_who_wins(flag):
    p = plan("tp2_torch", *SCHEDULE, "--train-iters", "4", "--global-batch-size", "2", flag)
    assert p.verdict == Verdict.LOAD, [f.to_json() for f in p.fatal]
    info, = [f for f in p.findings if f.field == "opt_param_scheduler"]
    assert "apply" in info.message


def test_no_load_optim_restarts_the_schedule_and_says_so():
    p = plan("tp2_torch", *SCHEDULE, "--train-iters", "4", "--global-batch-size", "2", "--no-load-optim")
    assert p.verdict == Verdict.LOAD
    info, = [f for f in p.findings if f.field == "opt_param_scheduler"]
    assert "restarts at step 0" in info.message


def test_without_the_schedule_flags_nothing_is_guessed():
    assert not [f for f in plan("tp2_torch", "--train-iters", "9").findings if f.field.startswith(("lr", "wd"))]


@pytest.mark.parametrize("name", ["tp2_torch", "tp2_torch_dist"])
def test_a_checkpoint_at_the_horizon_is_fatal(name):
    f = fatal(plan(name, "--train-iters", "2"))
    assert "train_iters" in f and "raise --train-iters above 2" in f["train_iters"].fix
    assert "train_iters" not in fatal(plan(name, "--train-iters", "2", "--skip-train"))
    assert "train_iters" not in fatal(plan(name, "--train-iters", "3"))

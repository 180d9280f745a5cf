"""The batch size at the checkpoint's consumed samples and the training set's size, decided at job start (real
Megatron-LM checkpoint tp2_torch: iteration 2, global batch size 2, 4 samples consumed)."""

import pytest

from megatron_preflight.check.batches import batch_size_at, parse_step_schedule
from megatron_preflight.check.plan import Verdict, make_plan
from megatron_preflight.check.runtime_args import from_cli
from tests.conftest import fixture_path
from tests.helpers.tiny import FLAGS


def plan(*flags):
    return make_plan(fixture_path("tp2_torch"), from_cli(FLAGS + ["--tensor-model-parallel-size", "2", *flags]))


def test_step_schedules_parse_as_megatron_does():
    assert parse_step_schedule("0:768 250B:1536, 1K:1000", None) == [(0, 768), (1000, 1000), (250 * 10**9, 1536)]
    assert parse_step_schedule("0:8 64:16", 32) == [(0, 8), (2, 16)]  # thresholds in tokens: 64 // 32 samples
    with pytest.raises(ValueError):
        parse_step_schedule("0:8 64", None)


def test_the_batch_size_at_the_consumed_samples():
    rt = from_cli(["--step-batch-size-schedule", "0:2 4:6", "--seq-length", "1"])
    assert batch_size_at(rt, 3)[0] == 2 and batch_size_at(rt, 4)[0] == 6
    ramp = from_cli(["--rampup-batch-size", "2", "2", "8", "--global-batch-size", "8"])
    # 3 increments over 8 samples: one per 8/3 samples (megatron-core's RampupBatchsizeNumMicroBatchesCalculator)
    assert [batch_size_at(ramp, c)[0] for c in (0, 2, 3, 6, 8, 9)] == [2, 2, 4, 6, 8, 8]
    assert batch_size_at(from_cli(["--global-batch-size", "8"]), 100) is None


def test_a_schedule_batch_that_the_new_dp_does_not_divide_is_fatal():
    # 4 consumed samples → batch size 6 (threshold 4 samples, --seq-length 32 in FLAGS: 128 tokens); TP2 × 4 GPUs
    # is DP 2 with micro batch 4: 6 % 8 != 0, which Megatron asserts inside load_checkpoint
    bad = plan("--step-batch-size-schedule", "0:8 128:6", "--micro-batch-size", "4", "--world-size", "4")
    f, = [f for f in bad.fatal if f.field == "global_batch_size"]
    assert bad.verdict == Verdict.FAIL and "6" in f.message and "micro batch size 4" in f.message
    ok = plan("--step-batch-size-schedule", "0:8 128:6", "--micro-batch-size", "3", "--world-size", "4")
    assert "global_batch_size" not in [f.field for f in ok.findings]
    assert "global_batch_size" not in [f.field for f in plan(
        "--step-batch-size-schedule", "0:8 128:6", "--micro-batch-size", "4", "--world-size", "4",
        "--decrease-batch-size-if-needed").findings]


def test_a_smaller_global_batch_outgrows_the_training_set():
    # 4 samples consumed in 2 iterations; at gbs 1 the set is built for 3 × 1 samples but the run needs 4 + 1
    warn, = [f for f in plan("--train-iters", "3", "--global-batch-size", "1").findings
             if f.field == "consumed_train_samples"]
    assert warn.severity.value == "info" and "5" in warn.message and "--train-samples 5" in warn.fix
    assert "at once" in warn.message  # 4 consumed ≥ 3 built
    assert not [f for f in plan("--train-iters", "3", "--global-batch-size", "2").findings
                if f.field == "consumed_train_samples"]
    assert not [f for f in plan("--train-iters", "3", "--global-batch-size", "1", "--finetune").findings
                if f.field == "consumed_train_samples"]

"""The distributed optimizer's buckets across a resume (check/ddp_buckets.py), on real checkpoints saved with
--overlap-grad-reduce --ddp-bucket-size 3000 (6 buckets per buffer; legacy distrib_optim.pt and the torch_dist
dp_reshardable twin): a run that cuts its buffers otherwise is stopped before the build with the flag that keeps the
saved buckets (real Megatron's failure after the build: tests/hook/test_megatron_lm.py, `*ddp_bucket*`)."""

import pytest

from megatron_preflight.check.plan import make_plan
from megatron_preflight.check.runtime_args import from_cli
from megatron_preflight.check.verdict import Verdict
from tests.conftest import fixture_path
from tests.helpers.tiny import FLAGS

RUN = [*FLAGS, "--use-distributed-optimizer", "--tensor-model-parallel-size", "2", "--world-size", "4"]


def _plan(name: str, *more: str):
    fmt = "torch_dist" if name.endswith("_dist") else "torch"
    return make_plan(fixture_path(name), from_cli([*RUN, "--ckpt-format", fmt, *more], env={}))


@pytest.mark.parametrize("name", ["distopt_buckets_tp2dp2_torch", "distopt_dpr_buckets_tp2dp2_torch_dist"])
@pytest.mark.parametrize("flags, said", [
    (["--overlap-grad-reduce"], "40,000,000 elements"),
    ([], "one bucket per buffer"),
])
def test_another_bucket_size_is_fatal_with_the_flag_that_keeps_the_saved_buckets(name, flags, said):
    plan = _plan(name, *flags)
    (f,) = [f for f in plan.fatal if f.field == "ddp_bucket_size"]
    assert plan.verdict == Verdict.FAIL and f.checkpoint == "3,000 elements" and said in f.runtime
    megatron_says = "Global shape mismatch" if name.endswith("_dist") else "Number of unpadded elements"
    assert "--overlap-grad-reduce --ddp-bucket-size 3000" in f.fix and megatron_says in f.message
    fixed = _plan(name, "--overlap-grad-reduce", "--ddp-bucket-size", "3000")
    assert fixed.verdict == Verdict.LOAD, [(x.field, x.message) for x in fixed.findings if x.severity.value != "info"]


def test_a_default_bucket_size_that_changes_with_dp_times_cp_matters_only_for_a_buffer_larger_than_it():
    """distopt_dpr_tp2dp2 was saved without --overlap-grad-reduce: one bucket per buffer. A run with it at DP x CP = 64
    cuts at max(40M, 64M) = 64M elements; the fixture's buffers are far smaller: one bucket either way, no finding.
    Without a world size the run's DP x CP is unknown: nothing is claimed."""
    world = ["--world-size", "128", "--context-parallel-size", "1"]
    plan = make_plan(fixture_path("distopt_dpr_tp2dp2_torch_dist"),
                     from_cli([*RUN[:-2], *world, "--ckpt-format", "torch_dist", "--overlap-grad-reduce"], env={}))
    assert not [f for f in plan.findings if f.field == "ddp_bucket_size"]
    plan = make_plan(fixture_path("distopt_buckets_tp2dp2_torch"),
                     from_cli([*RUN[:-2], "--ckpt-format", "torch", "--overlap-grad-reduce"], env={}))
    assert not [f for f in plan.findings if f.field == "ddp_bucket_size"]

"""Per-rank memory at job start (the exact parts are proven against a real run's allocation in
tests/hook/test_megatron_lm.py::test_predicted_memory_equals_what_the_run_allocates)."""

import pytest

from megatron_preflight.check.memory import activation_estimate
from megatron_preflight.check.plan import Verdict, make_plan
from megatron_preflight.check.runtime_args import from_cli
from tests.conftest import fixture_path
from tests.helpers.tiny import FLAGS

RUN = FLAGS + ["--tensor-model-parallel-size", "2", "--world-size", "2", "--micro-batch-size", "1",
               "--global-batch-size", "2"]


def memory(p):
    f, = [f for f in p.findings if f.field == "memory"]
    return f


def test_the_breakdown_is_reported_and_exact_for_params():
    p = make_plan(fixture_path("tp2_torch"), from_cli(RUN))
    assert p.verdict == Verdict.LOAD and len(p.memory) == 2
    m = p.memory[0]
    # tp2_torch at TP2, fp32: every rank holds half of the split weights and all the replicated ones
    assert m["params"] == m["grads"] and m["optimizer"] == 2 * m["params"]
    assert "exact" in memory(p).message and "estimate" in memory(p).message


def test_a_layout_that_does_not_fit_is_fatal_and_one_that_nearly_does_is_a_warning():
    p = make_plan(fixture_path("tp2_torch"), from_cli(RUN + ["--preflight-device-memory", "0.0001"]))
    f = memory(p)
    assert p.verdict == Verdict.FAIL and f.severity.value == "fatal" and "does not fit" in f.message
    total = max(m["total"] for m in p.memory) / (1 << 30)
    near = make_plan(fixture_path("tp2_torch"), from_cli(RUN + ["--preflight-device-memory", str(total * 1.05)]))
    assert near.verdict == Verdict.LOAD and "warning" in memory(near).message


def test_the_distributed_optimizer_divides_the_state_over_data_parallel_ranks():
    plain = make_plan(fixture_path("tp2_torch"), from_cli(RUN + ["--world-size", "4"]))
    dist = make_plan(fixture_path("tp2_torch"), from_cli(RUN + ["--world-size", "4", "--use-distributed-optimizer"]))
    assert dist.memory[0]["optimizer"] == pytest.approx(plain.memory[0]["optimizer"] / 2, abs=8)
    assert dist.memory[0]["optimizer_group"] == plain.memory[0]["optimizer"]


def test_the_activation_estimate_is_megatrons_formula_for_a_te_run():
    """s=2048, b=1, h=4096, ffn=16384, 32 layers on the stage, PP4 (4 microbatches in flight), TP8, TE (fused
    attention): per layer s*b*h*(18 + 4*ffn/h) = 2048*4096*34 bytes, plus the embedding terms, / TP."""
    rt = from_cli(["--num-layers", "128", "--hidden-size", "4096", "--ffn-hidden-size", "16384",
                   "--num-attention-heads", "32", "--seq-length", "2048", "--micro-batch-size", "1",
                   "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4",
                   "--max-position-embeddings", "2048"])
    s, b, h = 2048, 1, 4096
    want = ((s * b * h * 34 * 32) + s * b * h + 8 * s * b) * 4 / 8
    assert activation_estimate(rt, 32, 0, None) == int(want)

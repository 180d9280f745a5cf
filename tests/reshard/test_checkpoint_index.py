"""One CheckpointIndex per checkpoint per process: the check (with its cost line), every resharder of an offline run
(legacy or torch_dist output) and the optimizer's status reuse the one global index (the hook's ranks: see
tests/hook/test_install.py and tests/hook/test_shared_read.py)."""

from __future__ import annotations

import pytest

from megatron_preflight.check.plan import make_plan
from megatron_preflight.check.runtime_args import from_cli
from megatron_preflight.reshard import (
    TargetLayout,
    checkpoint_index,
    choose_optimizer,
    global_resharders,
    index_builds,
    open_index,
    open_resharder,
    write_resharded,
)
from tests.conftest import fixture_path
from tests.helpers.tiny import FLAGS as TINY


@pytest.fixture
def reads(monkeypatch):
    """Every discovery of a checkpoint in this process (the index is where discovery happens)."""
    real, out = checkpoint_index.discover, []

    def counted(*a, **k):
        out.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(checkpoint_index, "discover", counted)
    return out


def test_the_check_and_its_cost_line_build_one_index(reads):
    before = index_builds()
    plan = make_plan(fixture_path("distopt_tp2dp2_torch"), from_cli(TINY + ["--tensor-model-parallel-size", "1",
                                                                           "--use-distributed-optimizer"]))
    assert plan.verdict.value == "reshard" and plan.cost is not None  # consistency, status and cost all ran
    assert index_builds() - before == 1 and len(reads) == 1
    r = open_resharder(plan.index, TargetLayout(tp=1))  # the hook's loader, from the plan
    assert r.checkpoint is plan.index and index_builds() - before == 1


@pytest.mark.parametrize("workers", [1, 2])
def test_an_offline_run_builds_one_index_in_its_main_process(tmp_path, reads, workers):
    before = index_builds()
    write_resharded(fixture_path("tp2_torch"), str(tmp_path / "out"), TargetLayout(tp=1, pp=2), workers=workers)
    assert index_builds() - before == 1 and len(reads) == 1  # workers got the layout, not the path


def test_torch_dist_output_shares_one_index_between_its_resharders(reads):
    before = index_builds()
    r, g, carry = global_resharders(fixture_path("tp2_torch"), TargetLayout(tp=2, ckpt_format="torch_dist"))
    assert carry and r.checkpoint is g.checkpoint and index_builds() - before == 1 and len(reads) == 1


def test_choose_optimizer_keeps_converts_or_drops():
    index = open_index(fixture_path("distopt_tp2dp2_torch"))
    kept = choose_optimizer(index, distributed=True, keep=True)
    assert kept.distributed is not None and kept.plain is None and not kept.converted and not kept.dropped
    converted = choose_optimizer(index, distributed=False, keep=True)
    assert converted.plain is not None and converted.distributed is None
    assert converted.converted == "the optimizer state was converted from the distributed to the plain optimizer"
    dropped = choose_optimizer(index, distributed=True, keep=False)
    assert not dropped.written and "left out on request" in dropped.dropped
    plain = open_index(fixture_path("tp2_torch"))
    saved_order = plain.optimizer.plain.per_rank_order
    ordered = choose_optimizer(plain, distributed=False, keep=True, group_order="per_rank" if not saved_order
                               else "sorted")
    assert ordered.plain.per_rank_order != saved_order
    assert plain.optimizer.plain.per_rank_order == saved_order  # the order is the target's: the index is shared

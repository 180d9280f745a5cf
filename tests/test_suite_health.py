"""The suite leaves the machine usable: the persistent gloo workers do not pile up process groups (and their
threads) task after task."""

from __future__ import annotations

from tests.helpers.mcore_models import Layout, ModelSpec
from tests.helpers.pool import thread_counts


def test_pool_workers_do_not_accumulate_threads(mcore_pool2, tmp_path):
    from dataclasses import asdict

    spec = asdict(ModelSpec())
    mcore_pool2.run("tests.helpers.tasks:write_checkpoint", spec=spec, layout=asdict(Layout(tp=2)),
                    root=str(tmp_path / "warm"))
    before = thread_counts(mcore_pool2.pids)
    for i, lay in enumerate([Layout(tp=2), Layout(pp=2), Layout(tp=1), Layout(tp=2), Layout(pp=2)]):
        mcore_pool2.run("tests.helpers.tasks:write_checkpoint", spec=spec, layout=asdict(lay),
                        root=str(tmp_path / f"c{i}"))
    after = thread_counts(mcore_pool2.pids)
    grown = {pid: after[pid] - before[pid] for pid in before}
    # Each initialize_model_parallel makes ~20 gloo groups with their threads; without release, 5 tasks add 100+.
    assert max(grown.values()) <= 4, (before, after)
    assert max(after.values()) < 64, after


def test_release_groups_leaves_only_the_world(mcore_pool2):
    counts = mcore_pool2.run("tests.helpers.tasks:count_groups_after_release")
    assert counts == [1] * mcore_pool2.world


def test_layouts_set_up_in_one_task_do_not_accumulate_threads(mcore_pool2):
    """A fresh-clone suite once held 306 threads in one pool worker: tasks that set up several layouts kept every
    layout's gloo groups (megatron-core's destroy_model_parallel forgets them, their threads stay)."""
    for counts in mcore_pool2.run("tests.helpers.tasks:threads_across_layouts"):
        assert max(counts) - counts[0] <= 4, counts
        assert max(counts) < 128, counts

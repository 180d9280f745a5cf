"""The hook serves a distributed optimizer's parameter state from memory (Megatron reads distrib_optim.pt by path).

The optimizer objects here are FAKES (a DistributedOptimizer cannot be built on this CPU-only machine outside the
real Megatron-LM run, which tests/hook/test_megatron_lm.py covers): they record what Megatron's
load_parameter_state_from_dp_zero would receive."""

import argparse

import pytest
import torch

from megatron_preflight.errors import PreflightError
from megatron_preflight.hook import legacy_load
from megatron_preflight.hook import state as state_mod
from megatron_preflight.reshard.api import TargetLayout
from megatron_preflight.reshard.writer import write_resharded
from tests.conftest import fixture_path
from tests.reshard.test_dist_optimizer import _world


class FakeGroup:
    def __init__(self, rank):
        self._rank = rank

    def rank(self):
        return self._rank


class FakeBuffer:
    def __init__(self, numel):
        self.numel_unpadded = numel


class FakeDistOptimizer:
    """Stands in for megatron.core's DistributedOptimizer: a DP group and gradient buffers."""

    def __init__(self, dp_rank, numels):
        self.data_parallel_group = FakeGroup(dp_rank)
        self.buffers = [FakeBuffer(n) for n in numels]
        self.received = "nothing"

    def load_parameter_state(self, filename, *, update_legacy_format=False):
        raise AssertionError(f"read {filename} from disk")

    def load_parameter_state_from_dp_zero(self, state, update_legacy_format=False):
        self.received = state


def args_for(tmp_path, **kw):
    return argparse.Namespace(load=fixture_path("distopt_tp2dp2_torch"), use_distributed_optimizer=True,
                              tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              expert_model_parallel_size=1, ckpt_step=None, **kw)


def test_dp_rank_0_gets_the_state_the_offline_writer_writes(tmp_path):
    state_mod.reset()
    opt = FakeDistOptimizer(0, [40320])
    args = args_for(tmp_path)
    restore = legacy_load.serve_parameter_state(opt, args)
    opt.load_parameter_state("/nonexistent/distrib_optim.pt")
    restore()
    assert opt.load_parameter_state.__func__ is FakeDistOptimizer.load_parameter_state
    write_resharded(fixture_path("distopt_tp2dp2_torch"), str(tmp_path / "tp1"), TargetLayout(tp=1))
    (_, key, numel, tensors), = _world(str(tmp_path / "tp1" / "iter_0000002" / "mp_rank_00" / "distrib_optim.pt"))
    got = opt.received[0][key]
    assert got["numel_unpadded"] == numel == 40320
    assert all(torch.equal(got[n], tensors[n]) for n in tensors)


def test_other_dp_ranks_build_nothing_and_receive_the_scatter():
    state_mod.reset()
    opt = FakeDistOptimizer(1, [40320])
    restore = legacy_load.serve_parameter_state(opt, args_for(None))
    opt.load_parameter_state("/nonexistent/distrib_optim.pt")
    restore()
    assert opt.received is None


def test_a_live_buffer_of_another_size_is_refused_with_a_fix():
    state_mod.reset()
    opt = FakeDistOptimizer(0, [23000])
    restore = legacy_load.serve_parameter_state(opt, args_for(None))
    with pytest.raises(PreflightError, match="holds 23000 elements, the resharded state 40320") as exc:
        opt.load_parameter_state("/nonexistent/distrib_optim.pt")
    restore()
    assert "--no-load-optim" in exc.value.fix


def test_no_load_optim_leaves_megatron_alone():
    opt = FakeDistOptimizer(0, [1])
    restore = legacy_load.serve_parameter_state(opt, args_for(None, no_load_optim=True))
    assert opt.load_parameter_state.__func__ is FakeDistOptimizer.load_parameter_state
    restore()

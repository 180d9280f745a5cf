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
from megatron_preflight.reshard import write_resharded
from megatron_preflight.reshard.target import TargetLayout
from tests.conftest import fixture_path
from tests.reshard.optimizer.test_distributed import _world


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


class FakeModule(torch.nn.Module):
    """A FAKE model chunk whose named_parameters() are the run's parameter names (DDP's 'module.' prefix kept)."""

    def __init__(self, names):
        super().__init__()
        self.names = names
        self.params = [torch.nn.Parameter(torch.zeros(1)) for _ in names]

    def named_parameters(self, *a, **k):
        return iter([("module." + n, p) for n, p in zip(self.names, self.params, strict=True)])


class FakeBucket:
    def __init__(self, numel):
        self.numel_unpadded = numel


class FakeLiveBuffer(FakeBuffer):
    """A FAKE gradient buffer exposing Megatron's index map: param -> (start, end, bucket)."""

    def __init__(self, numel, index_map):
        super().__init__(numel)
        self.param_index_map = index_map
        self.bucket_indices = [(0, numel + 64)]  # one bucket, end padding not in the world tensors
        self.buckets = [FakeBucket(numel)]


def test_parameters_are_placed_where_the_running_optimizer_keeps_them(tmp_path):
    """The running optimizer's own index map decides the target places: here it swaps two same-size parameters
    against the modelled layout, and the served world tensors follow it."""
    from megatron_preflight.reshard.optimizer.distributed import Slot, target_params, world_offsets

    state_mod.reset()
    args = args_for(tmp_path)
    r = legacy_load.resharder_for(args.load, args)
    plan = r.plan_for_rank(0, 1)
    params = target_params(plan, r.tgt, r.tied)
    offsets, buckets = world_offsets([Slot(p.name, p.numel, p.shared_embedding) for p in params], None)
    a, b = "0:decoder.layers.0.input_layernorm.weight", "0:decoder.layers.1.input_layernorm.weight"
    live = dict(offsets)
    live[a], live[b] = offsets[b], offsets[a]
    module = FakeModule([p.key for p in params])
    index_map = {prm: (live[f"0:{n}"], live[f"0:{n}"] + 1, 0) for n, prm in zip(module.names, module.params, strict=True)}
    opt = FakeDistOptimizer(0, [sum(buckets)])
    opt.buffers = [FakeLiveBuffer(sum(buckets), index_map)]
    restore = legacy_load.serve_parameter_state(opt, args, [module])
    opt.load_parameter_state("/nonexistent/distrib_optim.pt")
    restore()
    got = next(iter(opt.received[0].values()))["exp_avg"]
    write_resharded(fixture_path("distopt_tp2dp2_torch"), str(tmp_path / "tp1"), TargetLayout(tp=1))
    (_, _, _, want), = _world(str(tmp_path / "tp1" / "iter_0000002" / "mp_rank_00" / "distrib_optim.pt"))
    n = 32  # hidden size: a layernorm weight
    assert torch.equal(got[offsets[a]:offsets[a] + n], want["exp_avg"][offsets[b]:offsets[b] + n])
    assert torch.equal(got[offsets[b]:offsets[b] + n], want["exp_avg"][offsets[a]:offsets[a] + n])
    assert not torch.equal(got, want["exp_avg"])

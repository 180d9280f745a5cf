"""--preflight verify's RNG check, on the RNG entries of real Megatron-LM checkpoints (legacy and torch_dist)."""

import argparse

import pytest
import torch

from megatron_preflight import reshard
from megatron_preflight.hook import verify_rng
from tests.conftest import fixture_path


def _live_like(entry):
    out = {"random_rng_state": entry["random_rng_state"], "torch_rng_state": entry["torch_rng_state"].clone()}
    for name, state in entry["rng_tracker_states"].items():
        out[f"rng_tracker_states/{name}"] = state.clone()
    return out


@pytest.mark.parametrize("name", ["tp2_torch", "tp2_torch_dist"])
def test_each_rank_reads_its_own_entry_and_a_changed_state_is_named(name):
    index = reshard.open_index(fixture_path(name))
    entries = [verify_rng.saved_entry(index, {"tp": tp, "pp": 0, "ep": 0}, f"mp_rank_{tp:02d}", 0, False, False)
               for tp in (0, 1)]
    for entry in entries:
        assert isinstance(entry["torch_rng_state"], torch.Tensor) and entry["rng_tracker_states"]
        assert verify_rng.compare(entry, _live_like(entry)) == []
    live = _live_like(entries[1])
    live["torch_rng_state"] = torch.Generator().manual_seed(12345).get_state()
    assert verify_rng.compare(entries[1], live) == ["torch_rng_state"]
    tracker = next(k for k in live if k.startswith("rng_tracker_states/"))
    live[tracker] = torch.Generator().manual_seed(7).get_state()
    assert tracker in verify_rng.compare(entries[1], live)


def test_no_rng_restored_no_check():
    index = reshard.open_index(fixture_path("tp2_torch"))
    assert not verify_rng.restores_rng(argparse.Namespace(no_load_rng=True), index)
    assert not verify_rng.restores_rng(argparse.Namespace(finetune=True), index)
    assert verify_rng.restores_rng(argparse.Namespace(), index)


def test_a_torch_dist_checkpoint_at_another_tp_pp_restores_no_rng():
    """Megatron ignores a torch_dist checkpoint's RNG at another (TP, PP) ("(TP, PP) mismatch after resume ...: RNG
    state will be ignored"): verify must not expect it (a false alarm on every such resume, found by verifying
    Megatron's own saved reshard of the twin)."""
    index = reshard.open_index(fixture_path("tp2_torch_dist"))
    run = argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    assert verify_rng.restores_rng(run, index)
    for tp, pp in ((1, 1), (2, 2)):
        run = argparse.Namespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        assert not verify_rng.restores_rng(run, index)

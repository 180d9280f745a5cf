"""The in-memory loader's guards against the running model."""

import pytest
import torch

from megatron_preflight.errors import PreflightError
from megatron_preflight.hook.legacy_load import refuse_grouped_mlp


class _Experts(torch.nn.Module):
    def __init__(self, packed: bool):
        super().__init__()
        if packed:  # the legacy GroupedMLP's parameters
            self.weight1 = torch.nn.Parameter(torch.zeros(2, 4))
            self.weight2 = torch.nn.Parameter(torch.zeros(4, 2))
        else:
            self.local_experts = torch.nn.ModuleList([torch.nn.Linear(2, 2)])


class _Model(torch.nn.Module):
    def __init__(self, packed: bool):
        super().__init__()
        self.mlp = torch.nn.Module()
        self.mlp.experts = _Experts(packed)


def test_a_run_that_builds_grouped_mlp_is_refused_with_the_fix():
    with pytest.raises(PreflightError, match="legacy GroupedMLP") as exc:
        refuse_grouped_mlp([_Model(packed=True)], "/ckpt")
    assert "without --moe-grouped-gemm" in exc.value.fix
    refuse_grouped_mlp([_Model(packed=False)], "/ckpt")  # sequential experts: fine

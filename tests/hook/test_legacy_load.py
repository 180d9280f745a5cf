"""The in-memory loader's guards against the running model."""

import pytest
import torch

from megatron_preflight.errors import PreflightError
from megatron_preflight.hook.legacy_load import match_mtp_names, refuse_grouped_mlp


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


class _MTPModel(torch.nn.Module):
    """A stand-in named like Megatron's MTP block (``mtp.layers.0.<inner>.…``): only the names matter here."""

    def __init__(self, inner: str):
        super().__init__()
        self.mtp = torch.nn.Module()
        self.mtp.layers = torch.nn.ModuleList([torch.nn.Module()])
        layer = self.mtp.layers[0]
        layer.eh_proj = torch.nn.Linear(4, 2, bias=False)
        setattr(layer, inner, torch.nn.Linear(2, 2))


@pytest.mark.parametrize("saved, running", [("transformer_layer", "mtp_model_layer"),
                                            ("mtp_model_layer", "transformer_layer"),
                                            ("mtp_model_layer", "mtp_model_layer")])
def test_mtp_keys_are_handed_over_under_the_running_modules_names(saved, running):
    state = {"model": {"mtp.layers.0.eh_proj.weight": torch.zeros(2, 4),
                       f"mtp.layers.0.{saved}.weight": torch.ones(2, 2), f"mtp.layers.0.{saved}.bias": torch.ones(2),
                       "mtp.layers.0.unknown.weight": torch.zeros(1)}}
    moved = match_mtp_names(state, [_MTPModel(running)])
    assert moved == (0 if saved == running else 2)
    assert sorted(state["model"]) == sorted(["mtp.layers.0.eh_proj.weight", f"mtp.layers.0.{running}.weight",
                                             f"mtp.layers.0.{running}.bias", "mtp.layers.0.unknown.weight"])
    assert torch.equal(state["model"][f"mtp.layers.0.{running}.weight"], torch.ones(2, 2))

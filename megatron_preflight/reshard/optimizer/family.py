"""The optimizer state across a change of Adam implementation or of parameter names.

Megatron builds TE's ``FusedAdam`` when Transformer Engine is installed, apex's when only apex is, and torch's
``AdamW`` (``Adam`` without decoupled weight decay) otherwise (``megatron/core/optimizer/__init__.py``). Their states
hold the same tensors (``exp_avg``, ``exp_avg_sq``; Megatron keeps the fp32 masters) but not the same bookkeeping:

* torch: a ``step`` tensor per parameter; param groups with torch's options (``amsgrad``, ``foreach``, ...);
* fused (TE / apex): one integer ``step`` per param group and ``bias_correction`` in each group; no per-parameter step.

``torch.optim.Optimizer.load_state_dict`` takes the saved group settings as they are, so the other family's groups
break the first step (``KeyError: 'bias_correction'``, or a missing per-parameter ``step``). :func:`to_family`
rewrites an indexed state into the run's family with the same step, so Adam's bias correction continues exactly.
The distributed optimizer keeps ``step`` in its groups for either family; only the group options change there.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from megatron_preflight import dtypes
from megatron_preflight.held_tensor import HeldTensor
from megatron_preflight.reshard.plan.types import GlobalKey, SourcePiece

if TYPE_CHECKING:  # the indexes' modules load where a state is converted, not for a verdict's family question
    from megatron_preflight.reshard.optimizer.distributed import DistOptimizerIndex
    from megatron_preflight.reshard.optimizer.plain import OptimizerIndex

TORCH, FUSED = "torch", "fused"
FAMILIES = (TORCH, FUSED)

# torch's Adam / AdamW group options, with the values Megatron's AdamW saves (torch's defaults; AdamW forces
# decoupled_weight_decay True, Adam (Megatron without --decoupled-weight-decay) False)
_TORCH_OPTIONS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
                  "fused": None, "decoupled_weight_decay": True}
_TORCH_ONLY = tuple(_TORCH_OPTIONS)


def step_value(step: float) -> Any:
    """A parameter's ``step`` in torch's Adam: a tensor of its own (incremented in place); its bytes while torch is
    not loaded (a :class:`~megatron_preflight.held_tensor.HeldTensor`: a legacy writer saves it as that tensor)."""
    if not dtypes.torch_loaded():
        return HeldTensor.scalar(step)
    import torch  # deferred: torch only where tensors are made (metadata paths run without it)

    return torch.tensor(step)


def is_fused_adam(settings: dict[str, Any]) -> bool:
    """A param group of TE's or apex's FusedAdam (``bias_correction`` in it, one ``step`` per group), not torch's."""
    return "bias_correction" in settings


def family_of(settings: list[dict[str, Any]]) -> str:
    """The Adam family whose param groups these are."""
    return FUSED if any(is_fused_adam(s) for s in settings) else TORCH


def saved_family(value: Any) -> str | None:
    """The Adam family of a saved ``optimizer`` entry, from the first param groups found in it (a chained
    optimizer's list, a Float16 wrapper's inner state); None when it holds none (a torch_dist distributed state keeps
    its groups in sharded objects)."""
    if isinstance(value, dict):
        groups = value.get("param_groups")
        if isinstance(groups, list) and groups and all(isinstance(g, dict) for g in groups):
            return family_of(groups)
        return next((f for f in map(saved_family, value.values()) if f is not None), None)
    if isinstance(value, (list, tuple)):
        return next((f for f in map(saved_family, value) if f is not None), None)
    return None


def _group(settings: dict[str, Any], family: str, step: float, distributed: bool, decoupled: bool) -> dict[str, Any]:
    out = {k: v for k, v in settings.items() if not (family == FUSED and k in _TORCH_ONLY)}
    if family == FUSED:
        out.setdefault("bias_correction", True)  # Megatron builds FusedAdam with its default, True
        out["step"] = int(step)
    else:
        out.pop("bias_correction", None)
        if not distributed:
            out.pop("step", None)  # kept per parameter by torch's Adam
        for key, value in _TORCH_OPTIONS.items():
            out.setdefault(key, decoupled if key == "decoupled_weight_decay" else value)
    return out


def _step(settings: list[dict[str, Any]], fallback: float) -> float:
    steps = {float(s["step"]) for s in settings if "step" in s}
    return steps.pop() if len(steps) == 1 else fallback


def to_family(index: OptimizerIndex | DistOptimizerIndex, family: str, step: float, *, decoupled: bool = True) -> Any:
    """``index`` as the state of ``family``'s Adam (itself when it already is), ``step`` the optimizer step;
    ``decoupled``: the run's --decoupled-weight-decay (AdamW, Megatron's default, or Adam)."""
    settings = [index.settings[s] for s in index.order]
    if family_of(settings) == family:
        return index
    # the indexes' modules: loaded where a state is converted (not for a verdict's family question)
    from megatron_preflight.reshard.optimizer.distributed import DistOptimizerIndex
    from megatron_preflight.reshard.optimizer.plain import _signature

    step = _step(settings, step)
    distributed = isinstance(index, DistOptimizerIndex)
    new_settings = {sig: _group(index.settings[sig], family, step, distributed, decoupled) for sig in index.order}
    sigs = {sig: _signature(s) for sig, s in new_settings.items()}
    if distributed:
        return dataclasses.replace(index, settings={sigs[s]: new_settings[s] for s in index.order},
                                   order=[sigs[s] for s in index.order],
                                   expert_groups={sigs[s] for s in index.expert_groups})
    fields: dict[GlobalKey, OrderedDict[str, Any]] = {}
    for gkey, state in index.fields.items():
        rest = OrderedDict((k, v) for k, v in state.items() if k != "step")
        if family == TORCH:  # torch's Adam: a step of its own per parameter, first in its state (a made value)
            rest = OrderedDict([("step", SourcePiece("", step_value(step), 0, 1)), *rest.items()])
        fields[gkey] = rest
    return dataclasses.replace(index, settings={sigs[s]: new_settings[s] for s in index.order},
                               order=[sigs[s] for s in index.order], dense={sigs[s] for s in index.dense},
                               expert={sigs[s] for s in index.expert},
                               membership={k: sigs[v] for k, v in index.membership.items()}, fields=fields,
                               template=dataclasses.replace(index.template, groups=[
                                   _group(g, family, step, False, decoupled) for g in index.template.groups]))


def renamed(index: OptimizerIndex | DistOptimizerIndex, mapping: dict[GlobalKey, GlobalKey]) -> Any:
    """``index`` with its parameters under new global keys (a spec bridge renames some; the state is the same)."""
    if not mapping:
        return index
    from megatron_preflight.reshard.optimizer.distributed import DistOptimizerIndex  # (see to_family)

    fields = {mapping.get(k, k): v for k, v in index.fields.items()}
    if isinstance(index, DistOptimizerIndex):
        return dataclasses.replace(index, fields=fields)
    return dataclasses.replace(index, fields=fields, membership={mapping.get(k, k): v
                                                                 for k, v in index.membership.items()})

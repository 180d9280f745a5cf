"""The optimizer's parameter groups as Megatron pairs them on load: a saved group is found for each of the run's
groups by an identifier tuple of per-group settings (``param_group_identifier_keys`` in
``megatron/core/optimizer/optimizer.py``). Megatron-LM main puts the group's ``max_lr`` and ``min_lr`` in that tuple
(each group carries ``--lr`` / ``--min-lr``; the decoupled embedding group ``--decoupled-lr`` / ``--decoupled-min-lr``),
so resuming the optimizer state with another learning rate fails inside ``load_checkpoint``, after the model and the
optimizer are built ("Could not find parameter group with key ..."; the distributed optimizer: a KeyError), whatever
the scheduler flags say. megatron-core 0.16 pairs by ``(wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr)`` and
loads it. Decided here from the saved groups (metadata only) and the keys the run's megatron.core uses (the hook asks
it; offline they are unknown and a difference is reported as what such a Megatron does).
"""

from __future__ import annotations

from typing import Any

from megatron_preflight.check.findings import Finding, Severity
from megatron_preflight.check.runtime_args import RuntimeArgs
from megatron_preflight.layout import optimizer_entry
from megatron_preflight.layout.model import Layout

FATAL, INFO = Severity.FATAL, Severity.INFO
LR_KEYS = ("max_lr", "min_lr")
NOT_RECORDED = "not recorded"


def saved_param_groups(layout: Layout) -> list[dict[str, Any]]:
    """Every param group of the checkpoint's optimizer state (each part of a chained optimizer; plain, fp16/bf16 or
    distributed), from the first file's header or the torch_dist common state: metadata only."""
    head = layout.common_state if layout.common_state is not None else (
        layout.shards[0].meta if layout.shards else None)
    return (optimizer_entry.param_groups(head.get("optimizer")) or []) if isinstance(head, dict) else []


def _decoupled(group: dict[str, Any], saved_args: Any) -> bool:
    """Whether the saved ``group`` is the decoupled-LR group (the embedding and output layer): flagged as such
    (megatron-core 0.16), or, where Megatron-LM main sets it as a per-group override, the group whose max_lr is the
    saved --decoupled-lr."""
    if group.get("is_decoupled_lr"):
        return True
    saved = getattr(saved_args, "decoupled_lr", None) if saved_args is not None else None
    return group.get("default_config") is False and saved is not None and _same(group.get("max_lr"), saved)


def _run_lrs(group: dict[str, Any], rt: RuntimeArgs, decoupled: bool) -> dict[str, Any] | None:
    """The (max_lr, min_lr) the run gives the group the saved ``group`` pairs with; None for a group whose rates
    come from per-parameter overrides the run's flags do not show."""
    if decoupled:
        if rt.decoupled_lr is None:
            return None  # the run has no decoupled group: the structure differs, not the rates
        return {"max_lr": rt.decoupled_lr, "min_lr": rt.decoupled_min_lr if rt.decoupled_min_lr is not None
                else rt.min_lr}
    if group.get("default_config") is False:
        return None
    return {"max_lr": rt.lr, "min_lr": rt.min_lr}


def _same(a: Any, b: Any) -> bool:
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return a == b


def param_group_findings(layout: Layout, rt: RuntimeArgs) -> list[Finding]:
    """The run's param groups against the saved ones: a decoupled-LR group added or dropped (every Megatron), and
    the learning rates where the run's Megatron pairs groups by them."""
    if rt.no_load_optim or rt.finetune or rt.lr is None:
        return []
    groups = saved_param_groups(layout)
    if not groups:
        return []
    structure = _decoupled_group_findings(groups, layout.saved_args, rt)
    keys = rt.param_group_keys
    compared = [k for k in LR_KEYS if keys is None or k in keys]
    if structure or not compared:
        return structure  # a structural difference first; or this megatron.core pairs by structure only
    differs: dict[tuple[str, Any, Any], None] = {}
    for group in groups:
        decoupled = _decoupled(group, layout.saved_args)
        run = _run_lrs(group, rt, decoupled)
        if run is None:
            continue
        name = ("decoupled " if decoupled else "") + "{}"
        for key in compared:
            if key not in group:  # saved by a Megatron that did not record it: paired as None
                differs[(name.format(key), NOT_RECORDED, run[key])] = None
            elif not _same(group[key], run[key]):
                differs[(name.format(key), group[key], run[key])] = None
    if not differs:
        return []
    saved = ", ".join(f"{name} {ck}" for name, ck, _ in differs)
    ours = ", ".join(f"{name} {run}" for name, _, run in differs)
    flags = {"max_lr": "--lr", "min_lr": "--min-lr", "decoupled max_lr": "--decoupled-lr",
             "decoupled min_lr": "--decoupled-min-lr"}
    drop = ("add --no-load-optim to load the weights without the optimizer state (the Adam moments and the LR "
            "schedule restart)")
    if any(ck is NOT_RECORDED for _, ck, _ in differs):
        fix = f"{drop}, or resume with the Megatron version that saved the checkpoint"
    else:
        fix = ("resume with the checkpoint's rates (" + " ".join(f"{flags[name]} {ck}" for name, ck, _ in differs)
               + f"), or {drop}")
    effect = ("its load_checkpoint fails after building the model and the optimizer (\"Could not find parameter "
              "group with key ...\"; the distributed optimizer: a KeyError), whatever the scheduler flags say")
    if keys is None:
        return [Finding("optimizer param groups", saved, ours, INFO,
                        "the saved optimizer param groups carry other learning rates than the run's: a Megatron whose "
                        "megatron.core pairs saved groups by max_lr / min_lr (in param_group_identifier_keys: "
                        f"Megatron-LM main) cannot pair them, and {effect}; megatron-core 0.16 pairs by structure "
                        "and loads it", fix)]
    return [Finding("optimizer param groups", saved, ours, FATAL,
                    f"this Megatron pairs the saved optimizer param groups with the run's by "
                    f"({', '.join(keys)}); the run's groups get other learning rates than the saved ones, so "
                    f"{effect}", fix)]


def _decoupled_group_findings(groups: list[dict[str, Any]], saved_args: Any, rt: RuntimeArgs) -> list[Finding]:
    """--decoupled-lr added or dropped on resume: the run builds one param group more or fewer than the checkpoint
    holds (the embedding and output layer's), and Megatron's load fails pairing them."""
    saved = [g for g in groups if _decoupled(g, saved_args)]
    drop = "or add --no-load-optim to load the weights without the optimizer state (the Adam moments restart)"
    if saved and rt.decoupled_lr is None:
        lr, min_lr = saved[0].get("max_lr"), saved[0].get("min_lr")
        return [Finding("decoupled_lr", lr, None, FATAL,
                        f"the checkpoint's optimizer has a decoupled-LR param group (the embedding and output layer "
                        f"at {lr}) and the run has none: Megatron's load fails pairing the groups (Megatron-LM main: "
                        "\"loaded state dict contains a parameter group that doesn't match the size of optimizer's "
                        "group\") after building the model and the optimizer",
                        f"resume with --decoupled-lr {lr}" + (f" --decoupled-min-lr {min_lr}" if min_lr is not None
                                                              else "") + f", {drop}")]
    if not saved and rt.decoupled_lr is not None:
        return [Finding("decoupled_lr", None, rt.decoupled_lr, FATAL,
                        "the run adds a decoupled-LR param group (--decoupled-lr: the embedding and output layer) that "
                        "the checkpoint's optimizer does not have: Megatron's load fails pairing the groups "
                        "(\"Could not find parameter group with key ...\") after building the model and the optimizer",
                        f"resume without --decoupled-lr, {drop}")]
    return []

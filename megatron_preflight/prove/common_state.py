"""The common state a resume reads beside the tensors, in a layout-independent form: the LR scheduler's state and the
param groups' settings that change what a step does. ``diff`` compares it between two checkpoints; fingerprints store
it, so a later content check finds a scheduler or a group setting changed since."""

from __future__ import annotations

import json
from typing import Any

# a param group's settings that change what a step does (the family's own flags, e.g. fused Adam's bias_correction
# or AdamW's decoupled_weight_decay, are bridged when the state is converted, and not compared)
GROUP_SETTINGS = ("lr", "max_lr", "min_lr", "weight_decay", "betas", "eps", "wd_mult", "lr_mult")


def scheduler(index: Any) -> dict[str, Any] | None:
    """The LR scheduler's saved state (the first shard's, as Megatron loads it), or None."""
    shards = index.view.shards
    meta = shards[0].meta if shards else None
    value = meta.get("opt_param_scheduler") if isinstance(meta, dict) else None
    return value if isinstance(value, dict) else None


def group_settings(plain: Any) -> list[dict[str, Any]]:
    """Each distinct param group's :data:`GROUP_SETTINGS` (a plain optimizer index's), in a stable order."""
    if plain is None:
        return []
    seen = {json.dumps(_plain(_pick(s)), sort_keys=True) for s in plain.settings.values()}
    return [json.loads(text) for text in sorted(seen)]


def document(index: Any, plain: Any) -> dict[str, Any]:
    """What fingerprints store of it (JSON values only)."""
    return {"opt_param_scheduler": _plain(scheduler(index)), "param_groups": group_settings(plain)}


def _pick(settings: dict[str, Any]) -> dict[str, Any]:
    return {k: settings.get(k) for k in GROUP_SETTINGS}


def _plain(value: Any) -> Any:
    """JSON's view of a value (tuples as lists; anything else not JSON as its repr)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)

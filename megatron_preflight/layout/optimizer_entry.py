"""Where things sit in a checkpoint's saved ``optimizer`` entry (a legacy file's, or a torch_dist common state's):
the parts of a chained optimizer, the param groups of each, the distributed optimizer's recorded form. Metadata only;
the one place that knows these nestings (the check, the layout and the torch_dist optimizer source all ask it)."""

from __future__ import annotations

from typing import Any


def parts(entry: Any) -> list[Any]:
    """A chained optimizer's parts (saved as a list, or a dict keyed 0, 1, ...), or the one optimizer."""
    if isinstance(entry, list):
        return entry
    if isinstance(entry, dict) and entry and all(isinstance(k, int) for k in entry):
        return [entry[k] for k in sorted(entry)]
    return [entry]


def param_groups(entry: Any) -> list[dict[str, Any]] | None:
    """Every param group, part by part (plain: ``{state, param_groups}``; fp16/bf16: wrapped once more in
    ``{optimizer: ...}``; distributed: ``{optimizer: {param_groups}, param_state_sharding_type}``); None when a part
    has none (no optimizer state, or a form not listed here)."""
    out: list[dict[str, Any]] = []
    for part in parts(entry):
        inner = part.get("optimizer", part) if isinstance(part, dict) else None
        if isinstance(inner, dict) and "param_groups" not in inner and isinstance(inner.get("optimizer"), dict):
            inner = inner["optimizer"]
        groups = inner.get("param_groups") if isinstance(inner, dict) else None
        if not isinstance(groups, list):
            return None
        out.extend(g for g in groups if isinstance(g, dict))
    return out


def sharding_kinds(entry: Any) -> set[str]:
    """The distributed optimizer's forms its parts record (``param_state_sharding_type``): empty for a plain
    optimizer or a checkpoint that does not say."""
    return {k for p in parts(entry) if isinstance(p, dict)
            and isinstance(k := p.get("param_state_sharding_type"), str)}

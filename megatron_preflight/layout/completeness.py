"""A checkpoint that lost one tensor of a pair the model always has together: found from key names only.

A Megatron GPT layer's attention with a fused QKV has its output projection too, an MLP (dense, each sequential expert,
TE-grouped experts, the legacy GroupedMLP, the shared experts) both its fc1 and its fc2. A file (legacy) or a
``.metadata`` (torch_dist) that holds one and not the other lost a tensor: Megatron's load fails on the missing key
after the model is built — or, with ``--dist-ckpt-strictness log_all``, trains on with that tensor at its random
initialisation. Only key names are compared, so it is cheap and independent of the spec's other details; a model
with other attention or MLP modules (MLA, Mamba) has none of these keys and is not judged.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# (the key found, its partner that must be there), as suffixes after the layer (and expert); the MLP pairs both ways,
# the attention one way only (multi-latent attention has an output projection and no linear_qkv)
_ONE_WAY = (("self_attention.linear_qkv.weight", "self_attention.linear_proj.weight"),)
_PAIRS = (
    ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight"),
    ("mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight"),
    ("mlp.experts.local_experts.*.linear_fc1.weight", "mlp.experts.local_experts.*.linear_fc2.weight"),
    ("mlp.experts.linear_fc1.weight*", "mlp.experts.linear_fc2.weight*"),  # TE grouped (weight{j})
    ("mlp.experts.experts.linear_fc1.weight", "mlp.experts.experts.linear_fc2.weight"),  # torch_dist experts
    ("mlp.experts.weight1", "mlp.experts.weight2"),  # the legacy GroupedMLP
)
PARTNER = {a: b for a, b in _PAIRS} | {b: a for a, b in _PAIRS} | dict(_ONE_WAY)

_LAYER = re.compile(r"^decoder\.layers\.(?:(\d+)\.)?(.+)$")
_EXPERT = re.compile(r"(local_experts\.)\d+(\.)")
_GROUPED = re.compile(r"(linear_fc[12]\.weight)\d+$")


def _normal(key: str) -> tuple[str | None, str] | None:
    """(the layer, or None for a tensor stacked over layers; the suffix with expert numbers starred)."""
    m = _LAYER.match(key)
    if not m:
        return None
    suffix = _GROUPED.sub(r"\1*", _EXPERT.sub(r"\1*\2", m.group(2)))
    return m.group(1), suffix


def unpaired(keys: Iterable[str]) -> list[tuple[str | None, str, str]]:
    """(layer, the tensor held, its partner missing) for every pair broken in ``keys`` (one chunk or file)."""
    held: dict[str | None, set[str]] = {}
    for key in keys:
        n = _normal(key)
        if n is not None:
            held.setdefault(n[0], set()).add(n[1])
    out = []
    for layer, suffixes in sorted(held.items(), key=lambda kv: (kv[0] is not None, int(kv[0] or 0))):
        for suffix in sorted(s for s in suffixes if s in PARTNER):
            if PARTNER[suffix] not in suffixes:
                out.append((layer, suffix, PARTNER[suffix]))
    return out


def describe(broken: list[tuple[str | None, str, str]], limit: int = 3) -> str:
    """One sentence naming the broken pairs."""
    parts = [f"{have} without {missing}" + (f" (layer {layer})" if layer is not None else " (every layer)")
             for layer, have, missing in broken[:limit]]
    more = f", and {len(broken) - limit} more" if len(broken) > limit else ""
    return "it holds " + "; ".join(parts) + more

"""The source checkpoint's parallel layout, completed from its shards (layer and expert counts, the layers each
(chunk, stage) holds), and whether its output layer is tied to the embedding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_preflight.layout import naming
from megatron_preflight.layout.model import Layout
from megatron_preflight.parallel import ParallelLayout
from megatron_preflight.reshard.plan.rules import parse_key


def saved_arg(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default) if args is not None else default


def source_topology(layout: Layout) -> ParallelLayout:
    """The source's parallel layout, completed from its shards: layer and expert counts when the args lack them, and
    the layers each (chunk, stage) actually holds."""
    base = layout.parallel or ParallelLayout(tp=layout.tp or 1, pp=layout.pp or 1, ep=layout.ep or 1,
                                             etp=layout.etp, vpp=layout.vpp, cp=layout.cp or 1)
    topo = dataclasses.replace(base, num_layers=base.num_layers or _count_layers(layout),
                               num_experts=base.num_experts or _count_experts(layout))
    observed = _observed_layer_counts(layout, topo)
    return dataclasses.replace(topo, observed=observed) if observed is not None else topo


def _observed_layer_counts(layout: Layout, topo: ParallelLayout) -> tuple[tuple[int, ...], ...] | None:
    """Layers per (chunk, stage) as the shards hold them: whatever scheme placed them (uneven stages, the
    embedding/loss counted as layers, a custom pipeline layout), the keys say where each layer is. None when a
    stage was not read or the counts do not add up to the model's layers. Every shard of a stage holds the same
    layers (that they agree — every split tensor has a piece from every rank of its group — is
    reshard/plan/consistency's to check): the first read shard of each stage is asked (a torch_dist view makes a
    shard's entries when first read)."""
    dirs = naming.shard_writers(topo)
    counts: dict[tuple[int, int], int] = {}
    stages: set[int] = set()
    for s in layout.shards:
        coords = dirs.get(s.name)
        if coords is None or coords["pp"] in stages or not isinstance(s.meta, dict):
            continue
        stages.add(coords["pp"])
        for chunk, ck in model_chunks(s.meta):
            layers = {parse_key(k).layer for k in s.meta[ck]} - {None}
            key = (chunk, coords["pp"])
            counts[key] = max(counts.get(key, 0), len(layers))
    table = tuple(tuple(counts.get((c, p), -1) for p in range(topo.pp)) for c in range(topo.chunks))
    if any(n < 0 for row in table for n in row) or sum(map(sum, table)) != topo.num_layers:
        return None
    return table


def model_chunks(meta: dict[str, Any]) -> list[tuple[int, str]]:
    if "model" in meta and isinstance(meta["model"], dict):
        return [(0, "model")]
    out = [(int(k[5:]), k) for k in meta if k.startswith("model") and k[5:].isdigit() and isinstance(meta[k], dict)]
    return sorted(out)


def _count_layers(layout: Layout) -> int:
    total = 0
    for s in layout.shards:
        if s.tp_rank != 0 or s.ep_rank not in (0, None) or s.meta is None:
            continue
        for _, ck in model_chunks(s.meta):
            total += len({parse_key(k).layer for k in s.meta[ck] if parse_key(k).layer is not None})
    return total


def _count_experts(layout: Layout) -> int | None:
    local = set()
    for s in layout.shards:
        if s.meta is None:
            continue
        for _, ck in model_chunks(s.meta):
            for k in s.meta[ck]:
                info = parse_key(k)
                if info.expert is not None:
                    local.add(info.expert)
        break
    return len(local) * (layout.ep or 1) if local else None


def is_tied(layout: Layout) -> bool:
    args = layout.saved_args
    if args is not None and hasattr(args, "untie_embeddings_and_output_weights"):
        return not bool(args.untie_embeddings_and_output_weights)
    # No args: tied iff a PP=1 shard has no output_layer.weight.
    for s in layout.shards:
        if s.meta and (layout.pp or 1) == 1:
            return all("output_layer.weight" not in s.meta[ck] for _, ck in model_chunks(s.meta))
    return True

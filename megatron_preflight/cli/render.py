"""Human-readable, one-screen renderings of reports."""

from __future__ import annotations

from typing import Any

from megatron_preflight.layout.model import Layout

KEY_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "num_experts", "moe_router_topk", "padded_vocab_size", "max_position_embeddings", "position_embedding_type",
    "normalization", "swiglu", "untie_embeddings_and_output_weights", "transformer_impl", "params_dtype",
)


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1024 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _size(v: Any) -> str:
    return "-" if v is None else str(v)


def render_layout(layout: Layout, *, max_shards: int = 16) -> str:
    lines: list[str] = []
    lines.append(f"checkpoint  {layout.path}")
    if layout.format is None:
        what = layout.looks_like or "not a Megatron checkpoint"
        lines.append(f"format      none: this is not a Megatron checkpoint; it looks like {what}")
    else:
        lines.append(f"format      {layout.format.value}")
        lines.append(f"iteration   {layout.iteration}  (tracker: {layout.tracker_iteration}; "
                     f"available: {', '.join(map(str, layout.available_iterations)) or '-'})")
        lines.append(f"parallel    TP={_size(layout.tp)} PP={_size(layout.pp)} EP={_size(layout.ep)} "
                     f"ETP={_size(layout.etp)} VPP={_size(layout.vpp)} CP={_size(layout.cp)}"
                     + ("" if layout.sizes_from == "args" else f"  [from {layout.sizes_from}]"))
        if layout.dims:
            lines.append(f"class       {layout.dims}  (shard names: {layout.name_pattern})")
        dist_opt = {True: "yes", False: "no", None: "unknown"}[layout.distributed_optimizer]
        if layout.dist_optimizer_sharding:
            dist_opt += f" ({layout.dist_optimizer_sharding})"
        lines.append(f"dist. optim {dist_opt}")
        optim = _optimizer_line(layout)
        if optim:
            lines.append(f"optimizer   {optim}")
        lines.append(f"size        {human_bytes(layout.total_bytes)}")
        args = layout.saved_args
        if args is not None:
            shown = []
            for k in KEY_ARGS:
                if hasattr(args, k):
                    v = getattr(args, k)
                    shown.append(f"{k}={v}")
            lines.append("model args  " + ", ".join(shown))
        if layout.shards:
            lines.append(f"shards      {len(layout.shards)} dirs")
            lines.append("  name                  tp  pp  ep  files")
            for s in layout.shards[:max_shards]:
                files = ", ".join(f"{f} ({human_bytes(b)})" for f, b in sorted(s.files.items()))
                lines.append(f"  {s.name:<20} {_size(s.tp_rank):>3} {_size(s.pp_rank):>3} {_size(s.ep_rank):>3}  {files}")
            if len(layout.shards) > max_shards:
                lines.append(f"  ... {len(layout.shards) - max_shards} more")
        if layout.missing_shards:
            lines.append(f"missing     {', '.join(layout.missing_shards)}")
    for note in layout.notes:
        lines.append(f"note        {note}")
    if layout.problems:
        lines.append(f"PROBLEMS    {len(layout.problems)}")
        for p in layout.problems:
            j = p.to_json()
            lines.append(f"  [{p.code}] {p.path}: {j['message']}")
    elif layout.format is not None:
        lines.append("status      OK: complete and consistent")
    return "\n".join(lines)


def _optimizer_line(layout: Layout) -> str | None:
    """What the plain optimizer state of a legacy checkpoint is, and whether it can follow a layout change."""
    from megatron_preflight.layout.model import Format

    first = layout.shards[0].meta if layout.shards else None
    if layout.format != Format.TORCH or not isinstance(first, dict) or layout.problems:
        return None
    if "optimizer" not in first:
        return "none saved (--no-save-optim)"
    from megatron_preflight.errors import PreflightError
    from megatron_preflight.reshard.optimizer import index_optimizer, parse_optimizer
    from megatron_preflight.reshard.planner import source_topology

    try:
        parts = parse_optimizer(first["optimizer"], layout.shards[0].path)
        index = index_optimizer(layout, source_topology(layout))
    except PreflightError as e:
        return f"not reshardable: {e.message}"
    kind = "fp32 masters (bf16/fp16 run)" if parts[0].wrapped else "fp32"
    order = "ordered per rank" if index and index.per_rank_order else "in the same order on every rank"
    return f"plain, {kind}, {len(parts)} part(s), param groups {order}; reshardable with the weights"

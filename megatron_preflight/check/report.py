"""Human-readable, one-screen renderings of a checkpoint's layout and of a check's plan: the CLI and the hook print
these (the hook imports this module without the CLI)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megatron_preflight import parallel, reshard  # its modules load on first use (a lazy package)
from megatron_preflight.check.verdict import Verdict
from megatron_preflight.layout.model import Format, Layout
from megatron_preflight.prove.stored import stored
from megatron_preflight.units import human_bytes

if TYPE_CHECKING:
    from megatron_preflight.check.plan import Plan

KEY_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "num_experts", "moe_router_topk", "padded_vocab_size", "max_position_embeddings", "position_embedding_type",
    "normalization", "swiglu", "untie_embeddings_and_output_weights", "transformer_impl", "params_dtype",
)


def _size(v: Any) -> str:
    return "-" if v is None else str(v)


def _shard_domain(layout: Layout) -> str:
    """Over which ranks the distributed optimizer's state is sharded (DP x CP), from the saved args."""
    args = layout.saved_args
    dp = getattr(args, "data_parallel_size", None)
    if not isinstance(dp, int) or not (layout.format == Format.FSDP_DTENSOR or
                                       layout.dist_optimizer_sharding == "dp_reshardable"):
        return ""  # (the other forms are gathered or in model space: no per-rank domain on disk)
    cp = layout.cp or 1
    return f"sharded over DP x CP = {dp} x {cp} = {dp * cp} ranks" if cp > 1 else f"sharded over DP = {dp} ranks"


def _fsdp_line(layout: Layout) -> str:
    """What a Megatron-FSDP (fsdp_dtensor) save was made with."""
    if layout.format != Format.FSDP_DTENSOR:
        return ""
    args = layout.saved_args
    parts = ["Megatron-FSDP"]
    strategy = getattr(args, "data_parallel_sharding_strategy", None)
    if strategy:
        parts.append(f"--data-parallel-sharding-strategy {strategy}")
    precision = "--bf16" if getattr(args, "bf16", False) else "--fp16" if getattr(args, "fp16", False) else "fp32"
    parts.append(precision)
    state = "yes" if layout.dist_optimizer_sharding else "no"
    return ", ".join(parts) + f"; optimizer state: {state}"


def render_layout(checkpoint: reshard.CheckpointIndex | Layout, *, max_shards: int = 16, problems: bool = True) -> str:
    """The layout report of a checkpoint (its index, or a discovered layout); ``problems=False`` leaves the problems
    out (a plan lists them as its findings)."""
    index = reshard.open_index(checkpoint)
    layout = index.layout
    lines: list[str] = []
    lines.append(f"checkpoint  {layout.path}")
    if layout.format is None:
        what = layout.looks_like or "not a Megatron checkpoint"
        lines.append(f"format      none: this is not a Megatron checkpoint; it looks like {what}")
    else:
        lines.append(f"format      {layout.format.value}")
        hf = layout.format == Format.HF
        if hf:  # (no tracker, no iteration dirs, no optimizer: a model's weights)
            lines.append("iteration   none: a model's weights, loaded as Megatron loads a release checkpoint "
                         "(iteration 0, no optimizer or RNG state)")
        else:
            lines.append(f"iteration   {layout.iteration}  (tracker: {layout.tracker_iteration}; "
                         f"available: {', '.join(map(str, layout.available_iterations)) or '-'})")
        lines.append(f"parallel    TP={_size(layout.tp)} PP={_size(layout.pp)} EP={_size(layout.ep)} "
                     f"ETP={_size(layout.etp)} VPP={_size(layout.vpp)} CP={_size(layout.cp)}"
                     + ("" if layout.sizes_from == "args" else f"  [from {layout.sizes_from}]"))
        if layout.dims and not hf:
            lines.append(f"class       {layout.dims}  (shard names: {layout.name_pattern})")
        dist_opt = {True: "yes", False: "no", None: "unknown"}[layout.distributed_optimizer]
        if layout.dist_optimizer_sharding:
            dist_opt += f" ({layout.dist_optimizer_sharding})"
        domain = _shard_domain(layout)
        if domain:
            dist_opt += f", {domain}"
        if not hf:
            lines.append(f"dist. optim {dist_opt}")
        fsdp = _fsdp_line(layout)
        if fsdp:
            lines.append(f"fsdp        {fsdp}")
        optim = _optimizer_line(index)
        if optim:
            lines.append(f"optimizer   {optim}")
        experts = _experts_line(layout)
        if experts:
            lines.append(f"experts     {experts}")
        hybrid = _hybrid_line(layout)
        if hybrid:
            lines.append(f"hybrid      {hybrid}")
        lines.append(f"size        {human_bytes(layout.total_bytes)}")
        args = layout.saved_args
        if args is not None:
            shown = []
            for k in KEY_ARGS:
                if hasattr(args, k):
                    v = getattr(args, k)
                    shown.append(f"{k}={v}")
            lines.append("model args  " + ", ".join(shown))
        if layout.shards and hf:
            files = sorted(layout.shards[0].files.items())
            lines.append(f"files       {len(files)} safetensors: " + ", ".join(
                f"{f} ({human_bytes(b)})" for f, b in files[:max_shards]) + (" ..." if len(files) > max_shards else ""))
        elif layout.shards:
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
    # legacy files' extra states are in the headers already read; a torch_dist index is not built just for this
    known = layout.format == Format.TORCH or "tensors" in vars(index)
    fp8 = index.fp8_extra_states if known and not layout.problems and not layout.sampled else 0
    if fp8:
        lines.append(f"fp8         {fp8} module extra states hold Transformer Engine FP8 metadata (scales, amax "
                     "history): kept per rank where a reshard keeps a tensor's slice, TP rank 0's where it re-splits "
                     "one (as Megatron's own torch_dist reshard)")
    fingerprints = stored(layout.root, layout.iteration)
    if fingerprints:
        lines.append(f"fingerprints {fingerprints} (`inspect --verify-content` compares the files with them, "
                     "--preflight verify the loaded model)")
    if layout.problems and not problems:
        lines.append(f"problems    {len(layout.problems)} (below)")
    elif layout.problems:
        lines.append(f"PROBLEMS    {len(layout.problems)}")
        for p in layout.problems:
            j = p.to_json()
            lines.append(f"  [{p.code}] {p.path}: {j['message']}")
    elif layout.format is not None and layout.sampled:
        lines.append("status      OK: complete (every shard present, sized, zip intact); consistent in the shards parsed")
    elif layout.format is not None:
        lines.append("status      OK: complete and consistent")
    return "\n".join(lines)


_FAMILIES = {"M": "Mamba-2", "G": "gated delta net", "*": "attention", "D": "DeepSeek sparse attention", "+": "MLA",
             "-": "MLP", "E": "MoE"}


def _hybrid_line(layout: Layout) -> str | None:
    """A HybridModel's layer pattern, its layers per pipeline stage (and virtual stage) and its families."""
    pattern = parallel.hybrid_pattern(layout.saved_args)
    if pattern is None:
        return None
    layers = parallel.hybrid_layers(pattern)
    families = ", ".join(f"{layers.count(c)} {name}" for c, name in _FAMILIES.items() if c in layers)
    text = f"layer pattern {pattern!r} ({families}"
    mtp = pattern.count(parallel.MTP_SEPARATOR)
    text += f"; {mtp} MTP depth(s) of {pattern.rsplit(parallel.MTP_SEPARATOR, 1)[1]!r})" if mtp else ")"
    try:
        counts = parallel.from_args(layout.saved_args).chunk_layer_counts()
    except parallel.LayoutError as e:
        return f"{text}; its pipeline split: {e.message}"
    if len(counts) * len(counts[0]) > 1:
        parts, at = [], 0
        for chunk, row in enumerate(counts):
            for stage, n in enumerate(row):
                where = f"stage {stage}" + (f".{chunk}" if len(counts) > 1 else "")
                parts.append(f"{where} {layers[at:at + n]!r}")
                at += n
        text += "; " + ", ".join(parts)
    return text


def _experts_line(layout: Layout) -> str | None:
    """The expert module a MoE checkpoint's keys come from."""
    args = layout.saved_args
    if args is None or not getattr(args, "num_experts", None):
        return None
    if layout.format == Format.TORCH and reshard.has_legacy_grouped(layout):
        return ("legacy GroupedMLP (experts.weight1/weight2, all local experts packed): read as sequential experts, "
                "with their optimizer state; Megatron-LM main cannot load it as is")
    if reshard.grouped_experts(args):
        return "Transformer Engine grouped (experts.linear_fc1.weight{j})"
    return "sequential (experts.local_experts.{j})"


def _optimizer_line(index: reshard.CheckpointIndex) -> str | None:
    """What the optimizer state of a legacy checkpoint is, and whether it can follow a layout change."""
    if index.layout.problems:
        return None
    status = index.optimizer_status
    return status.describe() if status else None


def render_plan(plan: Plan) -> str:
    lines = [render_layout(plan.index, max_shards=8, problems=False), ""]
    if plan.findings:
        width = max([14, *(len(str(v)) for f in plan.findings for v in (f.checkpoint, f.runtime) if v is not None)])
        width = min(width, 24)  # values are shown whole up to 24 characters (transformer_engine, dp_reshardable)
        lines.append(f"{'severity':<8} {'field':<38} {'checkpoint':>{width}} {'run':>{width}}")
        for f in plan.findings:
            ck = "-" if f.checkpoint is None else str(f.checkpoint)
            run = "-" if f.runtime is None else str(f.runtime)
            long = [(name, v) for name, v in (("checkpoint", ck), ("run", run)) if len(v) > width]
            cells = ["(below)" if len(v) > width else v for v in (ck, run)]  # never a value cut mid-word
            lines.append(f"{f.severity.value:<8} {f.field:<38} {cells[0]:>{width}} {cells[1]:>{width}}")
            for name, v in long:
                lines.append(f"         {name}: {v}")
            lines.append(f"         {f.message}")
            if f.fix:
                lines.append(f"         fix: {f.fix}")
    else:
        lines.append("no differences: the run matches the checkpoint")
    lines.append("")
    lines.append(f"loader      {plan.loader.value if plan.loader else '-'}")
    if plan.cost is not None:
        lines.append(f"cost        {plan.cost.render().removeprefix('reshard cost: ')}")
    lines.append(f"optimizer   {'load' if plan.load_optimizer else 'not loaded'};  "
                 f"rng {'load' if plan.load_rng else 'not loaded'}")
    n_fatal = len(plan.fatal)
    word = {Verdict.LOAD: "LOAD: the job may start; the checkpoint loads as is",
            Verdict.RESHARD: "RESHARD: the job may start with --preflight auto (in-memory reshard) or after an "
                             "offline `megatron-preflight reshard`",
            Verdict.FAIL: f"FAIL: the job must not start ({n_fatal} fatal finding{'s' if n_fatal != 1 else ''})"}
    lines.append(f"verdict     {word[plan.verdict]}   [{plan.seconds * 1000:.0f} ms]")
    return "\n".join(lines)

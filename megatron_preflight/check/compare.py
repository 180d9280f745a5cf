"""Compare a run's args with a checkpoint's layout and saved args: every mismatch, classified, with its fix."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_preflight import parallel
from megatron_preflight.check import advice
from megatron_preflight.check.findings import Finding, Severity
from megatron_preflight.check.runtime_args import RuntimeArgs
from megatron_preflight.errors import PreflightError
from megatron_preflight.layout.model import Format, Layout
from megatron_preflight.parallel import VOCAB_DIVISOR, LayoutError, divisor_keeping, pad_vocab
from megatron_preflight.reshard.plan.rules import mamba_conv_name, mtp_layer_name

FATAL, RESHARD, INFO = Severity.FATAL, Severity.RESHARD, Severity.INFO


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _bool_fix(field: str, ckpt_value: bool) -> str:
    flags = {
        "swiglu": "--swiglu", "quick_geglu": "--quick-geglu",
        "qk_layernorm": "--qk-layernorm",
        "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
        "group_query_attention": "--group-query-attention",
        "moe_grouped_gemm": "--moe-grouped-gemm",
    }
    if field == "add_bias_linear":
        return "remove --disable-bias-linear" if ckpt_value else "add --disable-bias-linear"
    flag = flags.get(field, _flag(field))
    return f"add {flag}" if ckpt_value else f"remove {flag}"


# Architecture fields: (field, explanation). A difference in any of them means the weights do not fit the model.
ARCH_FIELDS = (
    ("num_layers", "the number of transformer layers differs"),
    ("hidden_size", "the hidden size differs"),
    ("ffn_hidden_size", "the MLP (ffn) hidden size differs"),
    ("num_attention_heads", "the number of attention heads differs"),
    ("num_query_groups", "the number of query groups (GQA) differs: the QKV weight has another shape"),
    ("kv_channels", "kv_channels (head dim) differs"),
    ("num_experts", "the number of MoE experts differs"),
    ("moe_ffn_hidden_size", "the expert ffn hidden size differs"),
    ("position_embedding_type", "the position embedding type differs"),
    ("normalization", "the normalization differs (LayerNorm has a bias, RMSNorm not)"),
    ("swiglu", "SwiGLU changes the fc1 weight's shape and meaning"),
    ("squared_relu", "a squared-ReLU MLP computes another function than the checkpoint's"),
    ("quick_geglu", "a quick-GEGLU MLP (gated: fc1 is [gate; up]) computes another function than the checkpoint's"),
    ("add_bias_linear", "linear-layer biases are present in one and not the other"),
    ("qk_layernorm", "q/k layernorm weights are present in one and not the other"),
    ("untie_embeddings_and_output_weights", "tied vs untied output layer: a separate output_layer.weight exists in one"),
    ("multi_latent_attention", "multi-latent attention (MLA) in one and standard attention in the other: other "
                               "attention weights"),
    ("q_lora_rank", "MLA's query low-rank size differs (the Q down / up projections' shapes)"),
    ("kv_lora_rank", "MLA's key-value low-rank size differs (the KV down / up projections' shapes)"),
    ("qk_head_dim", "MLA's query-key head dim differs"),
    ("qk_pos_emb_head_dim", "MLA's rotary part of the query-key head dim differs"),
    ("v_head_dim", "MLA's value head dim differs (the output projection's shape)"),
    ("mtp_num_layers", "the number of multi-token prediction (MTP) layers differs: MTP layers are in one and not the "
                       "other"),
)
_MLA_SIZES = frozenset({"q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"})


def _derived_kv(saved: Any, kv: Any) -> bool:
    h, n = _get(saved, "hidden_size"), _get(saved, "num_attention_heads")
    return bool(h and n and kv == h // n)


def _get(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default) if args is not None else default


def _norm(field: str, value: Any) -> Any:
    if field in ("num_experts", "mtp_num_layers") and value in (0, None):
        return None
    if field in ("swiglu", "add_bias_linear", "qk_layernorm", "untie_embeddings_and_output_weights",
                 "multi_latent_attention", "squared_relu", "quick_geglu"):
        return bool(value)
    if isinstance(value, str):
        return value.lower() if field == "normalization" else value
    return value


def compare_architecture(layout: Layout, rt: RuntimeArgs) -> list[Finding]:
    saved = layout.saved_args
    out: list[Finding] = []
    if saved is None:
        out.append(Finding("args", None, None, INFO,
                           "the checkpoint carries no saved args: the architecture cannot be compared before load",
                           "make sure the model flags match the run that wrote it"))
        return out
    if rt.use_checkpoint_args:
        out.append(Finding("use_checkpoint_args", True, True, INFO,
                           "--use-checkpoint-args: Megatron takes the architecture args from the checkpoint", ""))
        return out
    gpt_to_hybrid = parallel.hybrid_pattern(saved) is None and parallel.hybrid_pattern(rt) is not None
    for field, why in ARCH_FIELDS:
        ck = _norm(field, _get(saved, field))
        run = _norm(field, getattr(rt, field, None))
        if gpt_to_hybrid and field == "num_layers":
            continue  # a GPT layer is two hybrid layers: the pattern is compared below
        if field == "moe_ffn_hidden_size" and not (ck and run and _norm("num_experts", _get(saved, "num_experts"))):
            continue
        if field in _MLA_SIZES and not (_get(saved, "multi_latent_attention") and rt.multi_latent_attention):
            continue  # sizes of MLA on both sides only (a change of attention kind is reported once, above)
        if ck is None and run is None:
            continue
        if run is None and field not in rt.given:
            out.append(Finding(field, ck, None, FATAL, f"{field} is not set for the run (the checkpoint has {ck})",
                               f"add {_flag(field)} {ck}"))
            continue
        if ck is None and field in ("kv_channels", "ffn_hidden_size", "num_query_groups"):
            continue
        if field == "num_query_groups" and not rt.group_query_attention and not _get(saved, "group_query_attention"):
            continue  # groups = heads on both sides: a heads change is reported once, as num_attention_heads
        if field == "kv_channels" and _derived_kv(saved, ck) and rt.hidden_size and rt.num_attention_heads and \
                run == rt.hidden_size // rt.num_attention_heads:
            continue  # hidden / heads on both sides: the difference is reported as hidden_size / heads
        if ck != run:
            fix = _bool_fix(field, bool(ck)) if isinstance(ck, bool) else (
                f"remove {_flag(field)}" if ck is None else f"set {_flag(field)} {ck}")
            if field == "num_query_groups" and ck is not None:
                fix = f"set --group-query-attention --num-query-groups {ck}" if ck != _get(
                    saved, "num_attention_heads") else "remove --group-query-attention"
            out.append(Finding(field, ck, run, FATAL, f"{why}: checkpoint {ck}, run {run}", fix))
    # Learned positions: the table's size is max_position_embeddings.
    if _norm("position_embedding_type", _get(saved, "position_embedding_type")) == "learned_absolute":
        ck, run = _get(saved, "max_position_embeddings"), rt.max_position_embeddings
        if ck is not None and run is not None and ck != run:
            out.append(Finding("max_position_embeddings", ck, run, FATAL,
                               "learned position embeddings have max_position_embeddings rows: the table differs",
                               f"set --max-position-embeddings {ck}"))
    if layout.format != Format.HF:  # an HF model's rows are its vocab: check/hf_model.py compares the run's
        out.extend(_compare_vocab(layout, rt))
    out.extend(_compare_dtype(saved, rt))
    out.extend(_compare_spec(layout, rt))
    out.extend(_compare_hybrid(layout, rt))
    out.extend(_compare_mamba(saved, rt))
    if parallel.hybrid_pattern(saved) is None:  # (HybridModel's MTP stack is `mtp_model_layer` wherever it exists)
        out.extend(_compare_mtp_name(layout, rt))
    else:
        out.extend(_compare_mamba_conv(layout, rt))
    return out


def _saved_naming(layout: Layout, naming_of: Callable[[str], str | None]) -> str | None:
    """The first naming ``naming_of`` finds among the model keys of a legacy checkpoint's parsed shards (None: no
    such key)."""
    for shard in layout.shards:
        for chunk, sd in (shard.meta or {}).items():
            if chunk.startswith("model") and isinstance(sd, dict):
                found = next((n for n in map(naming_of, sd) if n is not None), None)
                if found is not None:
                    return found
    return None


def _compare_hybrid(layout: Layout, rt: RuntimeArgs) -> list[Finding]:
    """HybridModel's layer pattern: the same layers in the same order (and MTP depths) or the weights do not fit;
    its ``|`` cuts are the pipeline layout, which a reshard moves."""
    ck, run = parallel.hybrid_pattern(layout.saved_args), parallel.hybrid_pattern(rt)
    if ck is None and run is None:
        return []
    if run is None:
        return [Finding("hybrid_layer_pattern", ck, None, FATAL,
                        f"the checkpoint is a HybridModel's (layer pattern {ck!r}); this run builds a GPT model",
                        f"run pretrain_hybrid.py with --hybrid-layer-pattern '{ck}' (its '|' cuts may move)")]
    if ck is None:
        from megatron_preflight.reshard.plan.hybrid import gpt_to_hybrid_problem  # (only for a GPT -> hybrid run)

        problem = gpt_to_hybrid_problem(layout.saved_args, run)
        if problem is not None:
            return [Finding("hybrid_layer_pattern", None, run, FATAL,
                            f"the checkpoint is a GPT model's and this HybridModel run cannot hold it: {problem}",
                            "run pretrain_gpt.py with the checkpoint's flags, or the pattern named")]
        return [Finding("hybrid_layer_pattern", None, run, RESHARD,
                        "a GPT checkpoint into a HybridModel run: each GPT layer i is hybrid layers 2i (attention) and "
                        "2i+1 (MLP / MoE), the same tensors renumbered (Megatron's legacy loader cannot; the "
                        "resharder renames them, with the optimizer state)",
                        _reshard_fix(layout, rt))]
    try:
        parallel.repipe(ck, run, rt.pp, rt.vpp, keep=False)
    except PreflightError as e:
        return [Finding("hybrid_layer_pattern", ck, run, FATAL, e.message, e.fix or "")]
    if ck != run and parallel.hybrid_segments(ck) != parallel.hybrid_segments(run) and (layout.pp or 1) == rt.pp:
        legacy = layout.format == Format.TORCH
        return [Finding("hybrid_layer_pattern", ck, run, RESHARD if legacy else INFO,
                        "the pattern's '|' cuts moved: layers change pipeline stage"
                        + ("" if legacy else " (Megatron's dist loader places them)"),
                        _reshard_fix(layout, rt) if legacy else "")]
    return []


# a Mamba-2 mixer's sizes: (field, Megatron's default, what it sizes)
MAMBA_SIZES = (("mamba_state_dim", 128, "the Mamba-2 state size (the B and C rows of in_proj, the conv channels)"),
               ("mamba_head_dim", 64, "the Mamba-2 head dim"),
               ("mamba_num_groups", 8, "the Mamba-2 groups (the B and C rows of in_proj)"))


def _compare_mamba(saved: Any, rt: RuntimeArgs) -> list[Finding]:
    """A HybridModel's Mamba-2 sizes, run against checkpoint (Megatron's defaults where a side leaves one out): any
    difference gives the mixers other shapes."""
    ck_pattern, run_pattern = parallel.hybrid_pattern(saved), parallel.hybrid_pattern(rt)
    if not (ck_pattern and run_pattern and "M" in ck_pattern):
        return []
    out = []
    for field, default, what in MAMBA_SIZES:
        ck, run = _get(saved, field) or default, getattr(rt, field, None) or default
        if ck != run:
            out.append(Finding(field, ck, run, FATAL, f"{what} differs: checkpoint {ck}, run {run}",
                               f"set {_flag(field)} {ck}"))

    def heads(args: Any, head_dim: int) -> int | None:
        given = _get(args, "mamba_num_heads")
        hidden = _get(args, "hidden_size")
        return given or ((_get(args, "mamba_expand") or 2) * hidden // head_dim if hidden and head_dim else None)

    ck_heads = heads(saved, _get(saved, "mamba_head_dim") or 64)
    run_heads = heads(rt, rt.mamba_head_dim or 64)
    if ck_heads and run_heads and ck_heads != run_heads and not out:
        out.append(Finding("mamba_num_heads", ck_heads, run_heads, FATAL,
                           f"the Mamba-2 heads differ: checkpoint {ck_heads}, run {run_heads}",
                           f"set --mamba-num-heads {ck_heads}"))
    return out


def _reshard_fix(layout: Layout, rt: RuntimeArgs) -> str:
    return ("megatron-preflight renames them in memory at load (--preflight auto), or offline: "
            + advice.offline_fix(layout, rt))


def _renamed(layout: Layout, field: str, running: str | None, naming_of: Any, what: str, release: str,
             consequence: str) -> list[Finding]:
    """A legacy checkpoint whose keys name a module as one Megatron release does while the running Megatron names it
    otherwise (read from the saved keys by ``naming_of``): a reshard (the in-memory resharder loads them under the
    running names), said with what Megatron's own loader would do."""
    if layout.format != Format.TORCH or running is None:
        return []
    ck = _saved_naming(layout, naming_of)
    if ck is None or ck == running:
        return []
    return [Finding(field, ck, running, RESHARD,
                    f"the checkpoint names {what} `{ck}` and this Megatron `{running}` (renamed in megatron-core "
                    f"{release}): {consequence}; the in-memory resharder loads them under this Megatron's names",
                    "run with --preflight auto")]


def _compare_mtp_name(layout: Layout, rt: RuntimeArgs) -> list[Finding]:
    """An MTP layer's transformer layer is ``transformer_layer`` in the legacy files of megatron-core before 0.17
    and ``mtp_model_layer`` after; a Megatron of the other naming loads the file strictly and fails on every key."""
    return _renamed(layout, "mtp_layer_name", rt.mtp_layer_name, mtp_layer_name,
                    "its MTP layers' transformer layer", "0.17", "its own legacy loader would miss every key of them")


def _compare_mamba_conv(layout: Layout, rt: RuntimeArgs) -> list[Finding]:
    """A Mamba mixer's conv is a module (``conv1d.weight``) in the legacy files of megatron-core up to 0.18 and the
    mixer's parameters (``conv1d_weight``) from 0.19: a Megatron of the other naming misses them."""
    return _renamed(layout, "mamba_conv_name", rt.mamba_conv_name, mamba_conv_name, "its Mamba mixers' conv", "0.19",
                    "its own legacy loader misses them and, after the strict load fails, loads again non-strictly, "
                    "leaving every Mamba conv at its init")


def _compare_spec(layout: Layout, rt: RuntimeArgs) -> list[Finding]:
    """The layer spec (--transformer-impl) and the expert form (--moe-grouped-gemm): other tensor names in a legacy
    file, the same tensors (reshard/plan/spec.py bridges them); torch_dist maps the names itself."""
    saved = layout.saved_args
    out: list[Finding] = []
    if layout.format == Format.HF:
        return out  # read under the local spec's names and built under the run's (reshard/plan/spec.py)
    ck_impl = _get(saved, "transformer_impl")
    run_impl = rt.transformer_impl
    legacy = layout.format == Format.TORCH
    if ck_impl and run_impl and ck_impl != run_impl:
        if legacy:
            out.append(Finding("transformer_impl", ck_impl, run_impl, RESHARD,
                               "a legacy file names layer norms and extra state by its layer spec (local "
                               "`input_layernorm.weight` vs Transformer Engine `linear_qkv.layer_norm_weight`); the "
                               "tensors are the same", _reshard_fix(layout, rt)))
        elif ck_impl == "local" and run_impl == "transformer_engine":
            out.append(Finding("transformer_impl", ck_impl, run_impl, RESHARD,
                               "torch_dist maps the layer norms' names, but the Transformer Engine modules' extra "
                               "state is not in a local-spec checkpoint: Megatron's dist loader fails ('Missing key "
                               "in checkpoint state_dict: decoder.final_layernorm._extra_state/shard_0_1'); the "
                               "in-memory resharder loads it (extra state made empty, as a fresh TE module's)",
                               "run with --preflight auto; or offline: " + advice.offline_fix(layout, rt)))
        else:
            out.append(Finding("transformer_impl", ck_impl, run_impl, INFO,
                               "torch_dist maps Transformer Engine names to the local spec's (dense models): "
                               "Megatron's dist loader loads it", ""))
    ck_gg, run_gg = bool(_get(saved, "moe_grouped_gemm", False)), rt.moe_grouped_gemm
    if not _get(saved, "num_experts"):
        return out
    if legacy and ck_gg and ck_impl == "local":  # the legacy GroupedMLP: experts.weight1/weight2
        packed = ("the experts are the legacy GroupedMLP (experts.weight1/weight2: all local experts in one transposed "
                  "tensor)")
        same = run_gg and run_impl == "local"  # the flags that built it
        carried = "with the optimizer state, plain or distributed, mapped to each expert like its weights"
        if same and rt.builds_grouped_mlp is None:  # offline: which Megatron runs is not known
            out.append(Finding("moe_grouped_gemm", "legacy GroupedMLP", run_gg, INFO,
                               f"{packed}: a Megatron whose local spec still builds it loads them as is; Megatron-LM "
                               "main builds sequential experts and cannot load them",
                               "on Megatron-LM main, run without --moe-grouped-gemm: the resharder reads GroupedMLP's "
                               f"weights as sequential experts ({carried})"))
        elif not (same and rt.builds_grouped_mlp):
            why = " and this Megatron's local spec builds sequential experts (it has no GroupedMLP)" if same else ""
            out.append(Finding("moe_grouped_gemm", "legacy GroupedMLP", "sequential experts" if same else run_gg,
                               RESHARD, f"{packed}{why}: the resharder reads them as each expert's weights ({carried})",
                               _reshard_fix(layout, rt)))
        return out
    if ck_gg != run_gg:
        if not legacy:
            out.append(Finding("moe_grouped_gemm", ck_gg, run_gg, INFO,
                               "torch_dist stores grouped and sequential experts alike: loads either way", ""))
        elif run_gg and run_impl == "local":
            out.append(Finding("moe_grouped_gemm", ck_gg, run_gg, INFO,
                               "Megatron-LM main's local spec builds sequential experts whatever --moe-grouped-gemm "
                               "says (loads as is); an older one builds the legacy GroupedMLP, which megatron-preflight "
                               "reads but does not write", "on an older Megatron, drop --moe-grouped-gemm"))
        else:
            out.append(Finding("moe_grouped_gemm", ck_gg, run_gg, RESHARD,
                               "grouped experts (Transformer Engine: experts.linear_fc1.weight{j}) and sequential ones "
                               "(local_experts.{j}.linear_fc1.weight) hold the same tensors under other names in a "
                               "legacy file", _reshard_fix(layout, rt)))
    return out


def _compare_vocab(layout: Layout, rt: RuntimeArgs) -> list[Finding]:
    saved = layout.saved_args
    out: list[Finding] = []
    ck_padded = _get(saved, "padded_vocab_size")
    ck_vocab = _get(saved, "vocab_size")
    ck_div = _get(saved, "make_vocab_size_divisible_by", VOCAB_DIVISOR) or VOCAB_DIVISOR
    ck_tp = layout.tp or 1
    if rt.vocab_size is None:
        if ck_padded is not None:
            out.append(Finding("vocab_size", ck_vocab or ck_padded, None, INFO,
                               "the run's vocab size comes from its tokenizer, which is not read here; the padded "
                               f"vocab must end up {pad_vocab(ck_vocab, rt.make_vocab_size_divisible_by, rt.tp) if ck_vocab else 'compatible'}",
                               "pass --vocab-size to have it checked"))
        return out
    if ck_vocab is not None and ck_vocab != rt.vocab_size:
        out.append(Finding("vocab_size", ck_vocab, rt.vocab_size, FATAL,
                           "the vocabulary size differs: the embedding and output layer have other rows",
                           f"use the tokenizer of the checkpoint (vocab size {ck_vocab})"))
        return out
    if ck_padded is not None and ck_vocab is None:
        # Only the padded size is known: the run's vocab must pad to it at the checkpoint's TP.
        if pad_vocab(rt.vocab_size, ck_div, ck_tp) != ck_padded:
            out.append(Finding("padded_vocab_size", ck_padded, rt.padded_vocab_size, FATAL,
                               f"the run's vocab ({rt.vocab_size}) pads to {pad_vocab(rt.vocab_size, ck_div, ck_tp)} at the "
                               f"checkpoint's TP{ck_tp}, but the checkpoint has {ck_padded} rows",
                               "use the tokenizer the checkpoint was trained with"))
            return out
    run_padded = rt.padded_vocab_size
    if ck_padded is not None and run_padded is not None and ck_padded != run_padded:
        # Megatron-FSDP loads fsdp_dtensor at the saved shapes: measured in Megatron-LM main at TP1 -> TP2, 'Size
        # mismatch between saved torch.Size([128, 32]) and current: torch.Size([256, 32])' after the build
        fsdp = layout.format == Format.FSDP_DTENSOR and rt.use_megatron_fsdp
        sev = RESHARD if layout.format == Format.TORCH or fsdp else INFO
        keep = divisor_keeping(rt.vocab_size, ck_padded, rt.tp)
        fix = (f"to resume the saved model's function exactly, add --make-vocab-size-divisible-by {keep} (the vocab "
               f"then pads to {ck_padded} at TP{rt.tp}, as saved)") if keep else ""
        if fsdp:
            fix = "run with --preflight auto and --no-load-rng (the padding re-made)" + (f"; or {fix}" if fix else "")
        out.append(Finding("padded_vocab_size", ck_padded, run_padded, sev,
                           ("Megatron-FSDP loads the embedding and output layer at their saved rows and fails after "
                            f"the build ('Size mismatch between saved torch.Size([{ck_padded}, ...]) and current'); "
                            if fsdp else "")
                           + "the padded vocab differs (padding follows make-vocab-size-divisible-by × TP); the real "
                           f"{rt.vocab_size} rows are kept and the padding is re-made, so the first losses after the "
                           "resume differ a little from the saved model's (the padding rows' logits are part of the "
                           "softmax)", fix))
    return out


def _compare_dtype(saved: Any, rt: RuntimeArgs) -> list[Finding]:
    def name(bf16: bool, fp16: bool) -> str:
        return "bf16" if bf16 else "fp16" if fp16 else "fp32"

    ck = name(bool(_get(saved, "bf16", False)), bool(_get(saved, "fp16", False)))
    run = name(rt.bf16, rt.fp16)
    if ck != run:
        return [Finding("dtype", ck, run, INFO,
                        f"training dtype changes {ck} -> {run}: weights are cast on load", "")]
    return []


def check_runtime_layout(rt: RuntimeArgs) -> list[Finding]:
    """Is the run's own parallel layout valid? (What Megatron would assert later, or fail on mid-load.)"""
    out: list[Finding] = []
    tp, pp, ep, etp, cp = rt.tp, rt.pp, rt.ep, rt.etp, rt.cp

    def bad(field: str, value: Any, msg: str, fix: str) -> None:
        out.append(Finding(field, None, value, FATAL, msg, fix))

    try:  # layers over stages and virtual stages: the one layout type decides, as for the resharder
        layout = rt.layout()
        if rt.num_layers and not rt.pipeline_model_parallel_layout:
            layout.chunk_layer_counts()
    except LayoutError as e:
        bad(e.field or "pipeline_model_parallel_size", None, e.message, e.fix or "")
    if rt.num_layers_per_virtual_pipeline_stage and pp == 1:
        bad("num_layers_per_virtual_pipeline_stage", rt.num_layers_per_virtual_pipeline_stage,
            "a virtual pipeline needs PP > 1", "remove --num-layers-per-virtual-pipeline-stage")
    sizes = parallel.ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp, cp=cp)
    value = {"tensor_model_parallel_size": tp, "expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp}
    for e in parallel.fit_problems(sizes, rt):  # heads, groups, ffn over TP; experts over EP, ETP: as the resharder
        bad(e.field, value.get(e.field), e.message, e.fix or "")
    if ep > 1 and not rt.num_experts:
        bad("expert_model_parallel_size", ep, "expert parallelism without --num-experts",
            "remove --expert-model-parallel-size or add --num-experts")
    if cp > 1 and rt.transformer_impl == "local":
        bad("context_parallel_size", cp, "context parallelism with --transformer-impl local: Megatron asserts "
            "'Context parallelism is only supported by TEDotProductAttention!' when it builds the model",
            "use --transformer-impl transformer_engine, or --context-parallel-size 1")
    if cp > 1 and rt.seq_length and rt.seq_length % (2 * cp):
        bad("context_parallel_size", cp, f"sequence length {rt.seq_length} is not a multiple of 2·CP = {2 * cp} "
            "(context parallelism splits each sequence in 2·CP chunks for load balancing)",
            f"choose a CP size with --seq-length a multiple of 2·CP, or a --seq-length that is a multiple of {2 * cp}")
    problem = sizes.world_problem(rt.world_size) if rt.world_size else None
    if problem is not None:
        bad("world_size", rt.world_size, problem.message, problem.fix or "")
    return out

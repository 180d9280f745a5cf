"""Does a legacy checkpoint agree with itself? Metadata only: no tensor bytes are read.

Each shard's tensors must be pieces of one model: every split tensor has a piece from every rank of its group, the
pieces and replicas of a tensor share one shape and dtype, a parameter has one dtype across shards, and the global
shapes and layer count match the saved args. :func:`checkpoint_problems` lists every disagreement (``inspect``,
``check`` and the hook report them as problems); the resharder refuses on the first.
"""

from __future__ import annotations

import os
from typing import Any

from megatron_preflight import parallel
from megatron_preflight.errors import PreflightError
from megatron_preflight.layout import naming
from megatron_preflight.layout.model import Layout
from megatron_preflight.torch_file import TensorRef

_MIXED = "restore the iteration dir from one consistent save"
_AGAINST_ARGS = ("the shards' tensors and their saved args disagree (args edited, or shards mixed from another "
                 "model): restore the iteration dir from one consistent save")


def _file(layout: Layout, shard: str) -> str:
    return os.path.join(layout.iter_dir or layout.path, shard, naming.MODEL_FILENAME)


def raise_first(problems: list[PreflightError]) -> None:
    if problems:
        raise problems[0]


def complete_problems(index: Any, layout: Layout) -> list[PreflightError]:
    """Every split tensor has a piece from every rank of its group; pieces and replicas share shape and dtype."""
    out: list[PreflightError] = []
    for entry in index.values():
        pieces = entry.pieces
        first = entry.first()
        if entry.rule.dim is not None and not (first.group_size == 1 and 0 in pieces):
            missing = [r for r in range(first.group_size) if r not in pieces]
            if missing:
                out.append(PreflightError(
                    f"tensor {_name(entry)} has no source for {'expert-' if entry.rule.group == 'etp' else ''}"
                    f"tensor-parallel rank(s) {missing}", path=layout.iter_dir,
                    fix="the checkpoint is incomplete: restore the missing shards", code="missing_shard"))
        ref = first.ref
        if not isinstance(ref, TensorRef):
            continue
        for replicas in pieces.values():
            for p in replicas:
                if p is first or isinstance(p.ref, TensorRef) and p.ref.shape == ref.shape \
                        and p.ref.dtype == ref.dtype:
                    continue
                what = f"{tuple(p.ref.shape)} {p.ref.dtype}" if isinstance(p.ref, TensorRef) else type(p.ref).__name__
                out.append(PreflightError(
                    f"tensor {_name(entry)} is {what} in {p.shard} but {tuple(ref.shape)} {ref.dtype} in "
                    f"{first.shard}: the shards do not hold pieces of one model", path=_file(layout, p.shard),
                    fix=_MIXED, code="inconsistent_shards"))
                break
    return out


def _name(entry: Any) -> str:
    """The global tensor's name in messages (made only for one: a DeepSeek-V3 has 31k entries)."""
    return entry.info.render(entry.key.layer, entry.key.expert)


def dtype_problems(index: Any, layout: Layout) -> list[PreflightError]:
    """One parameter name (across layers, experts and shards) has one dtype: a shard saved in fp32 among bf16 shards
    (or the reverse) was mixed in from another save. Shards are visited stage by stage, TP rank, then EP rank."""
    out: list[PreflightError] = []
    seen: dict[tuple[str, str], tuple[Any, str]] = {}
    flagged: set[str] = set()
    rank = {s.name: (s.pp_rank or 0, s.tp_rank or 0, s.ep_rank or 0) for s in layout.shards}
    pieces = sorted(((rank.get(p.shard, (0, 0, 0)), n, entry, p) for n, entry in enumerate(index.values())
                     for ps in entry.pieces.values() for p in ps if isinstance(p.ref, TensorRef)),
                    key=lambda x: (x[0], x[1]))
    for _, _, entry, p in pieces:
        slot = (entry.info.style, entry.info.suffix)
        ref = seen.setdefault(slot, (p.ref.dtype, p.shard))
        if ref[0] != p.ref.dtype and p.shard not in flagged:
            flagged.add(p.shard)
            out.append(PreflightError(
                f"{entry.info.render(entry.key.layer, entry.key.expert)} is {p.ref.dtype} in {p.shard} but {ref[0]} "
                f"in {ref[1]}: the shards were saved with different precisions", path=_file(layout, p.shard),
                fix=_MIXED, code="inconsistent_shards"))
    return out


def args_problems(index: Any, layout: Layout) -> list[PreflightError]:
    """The shards hold the model their saved args describe: the layer count and the global shapes of the main
    tensors. A shard that contradicts its args is named, with the args and shapes involved."""
    args = layout.saved_args
    if args is None:
        return []
    out: list[PreflightError] = []
    want_layers = getattr(args, "num_layers", None)
    have = {k.layer for k in index if k.layer is not None}
    if isinstance(want_layers, int) and have and len(have) != want_layers:
        out.append(PreflightError(f"the saved args say {want_layers} layers, but the shards hold {len(have)}",
                                  path=layout.iter_dir, fix=_AGAINST_ARGS, code="inconsistent_shards"))
    expected = expected_shapes(args)
    reported: set[tuple[bool, str]] = set()
    fit: set[tuple] = set()  # (slot, piece shape, split dim, group size) found right (each expert of a layer alike)
    for key, entry in index.items():
        slot = (key.expert is not None, key.suffix)
        want = expected.get(slot)
        if want is None or slot in reported:
            continue
        first = entry.first()
        if not isinstance(first.ref, TensorRef):
            continue
        form = (slot, first.ref.shape, entry.rule.dim, first.group_size)
        if form in fit:
            continue
        shape = list(first.ref.shape)
        if entry.rule.dim is not None and entry.rule.dim < len(shape):
            shape[entry.rule.dim] = entry.global_len()
        if len(shape) == len(want) and all(w is None or w == g for w, g in zip(want, shape, strict=True)):
            fit.add(form)
            continue
        reported.add(slot)
        name = entry.info.render(key.layer, key.expert)
        dims = ", ".join(f"{n}={getattr(args, n, None)}" for n in ("hidden_size", "num_attention_heads",
                                                                  "num_query_groups", "ffn_hidden_size")
                         if getattr(args, n, None) is not None)
        out.append(PreflightError(
            f"{first.shard} holds {name} with global shape {tuple(shape)}, but its saved args ({dims}) make it "
            f"{tuple(w if w is not None else '*' for w in want)}", path=_file(layout, first.shard),
            fix=_AGAINST_ARGS, code="inconsistent_shards"))
    return out


def expected_shapes(args: Any) -> dict[tuple[bool, str], tuple[int | None, ...]]:
    """Global shapes Megatron-Core gives the main tensors of a GPT model with ``args`` (None: not checked)."""
    def get(name: str) -> Any:
        value = getattr(args, name, None)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    hidden, heads = get("hidden_size"), get("num_attention_heads")
    if not hidden or not heads:
        return {}
    groups = get("num_query_groups") if getattr(args, "group_query_attention", False) else heads
    kv = get("kv_channels") or hidden // heads
    glu = 2 if parallel.gated_mlp(args) else 1
    ffn, moe_ffn = get("ffn_hidden_size"), get("moe_ffn_hidden_size") or get("ffn_hidden_size")
    out: dict[tuple[bool, str], tuple[int | None, ...]] = {
        (False, "embedding.word_embeddings.weight"): (None, hidden),
        # (--attention-output-gate: each query head's gate beside it, per group)
        (False, "self_attention.linear_qkv.weight"): ((heads * (2 if getattr(args, "attention_output_gate", False)
                                                                else 1) + 2 * (groups or heads)) * kv, hidden),
        (False, "self_attention.linear_proj.weight"): (hidden, heads * kv),
        (False, "input_layernorm.weight"): (hidden,),
        (False, "self_attention.linear_qkv.layer_norm_weight"): (hidden,),
        (False, "pre_mlp_layernorm.weight"): (hidden,),
        (False, "decoder.final_layernorm.weight"): (hidden,),
    }
    if getattr(args, "multi_latent_attention", False):  # no fused QKV; the output projection reads v_head_dim
        del out[(False, "self_attention.linear_qkv.weight")], out[(False, "self_attention.linear_proj.weight")]
        out.update(_mla_shapes(get, hidden, heads))
    if ffn:
        out[(False, "mlp.linear_fc1.weight")] = (ffn * glu, hidden)
        out[(False, "mlp.linear_fc2.weight")] = (hidden, ffn)
    if moe_ffn:  # (the experts compute in the latent width where the model has one: --moe-latent-size)
        width = get("moe_latent_size") or hidden
        out[(True, "linear_fc1.weight")] = (moe_ffn * glu, width)
        out[(True, "linear_fc2.weight")] = (width, moe_ffn)
        if get("moe_latent_size"):
            out[(False, "mlp.fc1_latent_proj.weight")] = (width, hidden)
            out[(False, "mlp.fc2_latent_proj.weight")] = (hidden, width)
    return out


def _mla_shapes(get: Any, hidden: int, heads: int) -> dict[tuple[bool, str], tuple[int | None, ...]]:
    """Multi-latent attention's projections, as its args size them (None: a size the args do not give)."""
    qk, pos, v = get("qk_head_dim"), get("qk_pos_emb_head_dim"), get("v_head_dim")
    q_lora, kv_lora = get("q_lora_rank"), get("kv_lora_rank")
    out: dict[tuple[bool, str], tuple[int | None, ...]] = {
        (False, "self_attention.linear_proj.weight"): (hidden, heads * v if v else None)}
    q_out = heads * (qk + pos) if qk and pos else None
    if q_lora:
        out[(False, "self_attention.linear_q_down_proj.weight")] = (q_lora, hidden)
        out[(False, "self_attention.linear_q_up_proj.weight")] = (q_out, q_lora)
    else:
        out[(False, "self_attention.linear_q_proj.weight")] = (q_out, hidden)
    if kv_lora:
        out[(False, "self_attention.linear_kv_down_proj.weight")] = (kv_lora + pos if pos else None, hidden)
        out[(False, "self_attention.linear_kv_up_proj.weight")] = (heads * (qk + v) if qk and v else None, kv_lora)
    return out


def checkpoint_problems(index: Any, layout: Layout) -> list[PreflightError]:
    """Every way the legacy checkpoint's shards disagree with each other or with their saved args (``index``: its
    global index, built with ``check=False``)."""
    return complete_problems(index, layout) + dtype_problems(index, layout) + args_problems(index, layout)

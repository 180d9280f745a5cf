"""The one table that says how every Megatron-Core GPT parameter is split across ranks.

Keys are matched against the parameter name *after* its layer / expert prefix is removed (see :func:`parse_key`).
Each rule says along which dim the tensor is split and by which group (TP for dense, ETP for experts), and how the
rows are laid out:

* ``column``  — dim 0 split in contiguous chunks (QKV is grouped per query group ``[q…, k, v]`` and TP gives each
  rank whole groups, so contiguous chunks are whole groups);
* ``glu``     — dim 0, SwiGLU fc1: the global tensor is ``[gate; up]`` and each rank holds ``[gate_r; up_r]``;
* ``row``     — dim 1 split in contiguous chunks;
* ``vocab``   — dim 0, word embeddings / output layer with ``padded_vocab_size`` rows (padding follows TP);
* ``replicated`` — the same on every rank of the group;
* ``extra``   — ``_extra_state`` (None, or TE/FP8 metadata): carried from the main replica.

Unknown keys raise :class:`UnknownKeyError` naming the key: never silently copied or dropped.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from megatron_preflight.errors import PreflightError


class UnknownKeyError(PreflightError):
    """A state-dict key no rule covers."""


@dataclass(frozen=True)
class Rule:
    kind: str  # column | glu | row | vocab | replicated | extra
    group: str = "tp"  # tp (dense) or etp (experts)

    @property
    def dim(self) -> int | None:
        return _SPLIT_DIM.get(self.kind)


_SPLIT_DIM = {"column": 0, "glu": 0, "vocab": 0, "row": 1}  # the dim each kind of split cuts (none: not split)


COLUMN, ROW, VOCAB, REPL, EXTRA = Rule("column"), Rule("row"), Rule("vocab"), Rule("replicated"), Rule("extra")

# (pattern on the suffix, rule for dense layers, rule inside an expert). "fc1" depends on SwiGLU: see rule_for().
_TABLE: list[tuple[str, Rule]] = [
    (r"(.+\.)?_extra_state", EXTRA),  # every module's extra state, TE-grouped experts' included
    # embeddings and head
    (r"embedding\.word_embeddings\.weight", VOCAB),
    (r"output_layer\.weight", VOCAB),
    (r"output_layer\.bias", VOCAB),
    (r"embedding\.position_embeddings\.weight", REPL),
    (r"embedding\.tokentype_embeddings\.weight", REPL),
    (r"decoder\.final_layernorm\.(weight|bias)", REPL),
    (r"decoder\.final_norm\.(weight|bias)", REPL),
    # attention
    (r"input_layernorm\.(weight|bias)", REPL),
    (r"self_attention\.linear_qkv\.layer_norm_(weight|bias)", REPL),
    (r"self_attention\.linear_qkv\.(weight|bias)", COLUMN),
    (r"self_attention\.(q|k)_layernorm\.(weight|bias)", REPL),
    (r"self_attention\.linear_proj\.weight", ROW),
    (r"self_attention\.linear_proj\.bias", REPL),
    # multi-latent attention (MLASelfAttention, TE spec): the up projections and the plain Q projection are
    # column-parallel, whole heads per rank ([q_nope, q_pe] / [k_nope, v] per head); the down projections are TE's
    # duplicated linears, the same on every TP rank (the local spec's column-split down projections cannot be built
    # by Megatron 0.16 and later; a checkpoint that has them fails the shape check against its args)
    (r"self_attention\.linear_q_proj\.(weight|bias)", COLUMN),
    (r"self_attention\.linear_(q|kv)_up_proj\.(weight|bias)", COLUMN),
    (r"self_attention\.linear_(q|kv)_up_proj\.layer_norm_(weight|bias)", REPL),
    (r"self_attention\.linear_(q|kv)_down_proj\.(weight|bias)", REPL),
    (r"self_attention\.kv_layernorm\.(weight|bias)", REPL),
    # dense MLP
    (r"pre_mlp_layernorm\.(weight|bias)", REPL),
    (r"mlp\.linear_fc1\.layer_norm_(weight|bias)", REPL),
    (r"mlp\.linear_fc1\.(weight|bias)", Rule("fc1")),
    (r"mlp\.linear_fc2\.weight", ROW),
    (r"mlp\.linear_fc2\.bias", REPL),
    # MoE router (replicated over TP and EP)
    (r"mlp\.router\.(weight|bias|expert_bias)", REPL),
    # shared experts use dense TP
    (r"mlp\.shared_experts\.linear_fc1\.(weight|bias)", Rule("fc1")),
    (r"mlp\.shared_experts\.linear_fc2\.weight", ROW),
    (r"mlp\.shared_experts\.linear_fc2\.bias", REPL),
    (r"mlp\.shared_experts\.gate_weight", REPL),
]

# Inside one expert (the suffix after `local_experts.{j}.` or the TE-grouped `weight{j}`), split by ETP.
_EXPERT_TABLE: list[tuple[str, Rule]] = [
    (r"(.+\.)?_extra_state", EXTRA),
    (r"linear_fc1\.(weight|bias)", Rule("fc1", "etp")),
    (r"linear_fc2\.weight", Rule("row", "etp")),
    (r"linear_fc2\.bias", Rule("replicated", "etp")),
]

_COMPILED = [(re.compile(p + r"$"), r) for p, r in _TABLE]
_EXPERT_COMPILED = [(re.compile(p + r"$"), r) for p, r in _EXPERT_TABLE]

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_SEQ_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_TE_GROUPED_RE = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
_LEGACY_GROUPED_RE = re.compile(r"^mlp\.experts\.weight[12]$")


@dataclass(frozen=True)
class KeyInfo:
    """A local state-dict key split into its parts: layer (local index), expert (local index), suffix."""

    layer: int | None
    expert: int | None
    suffix: str  # for layers: the part after `decoder.layers.N.` (experts: after the expert prefix)
    style: str = "plain"  # plain | seq_expert | te_grouped | legacy_grouped (GroupedMLP's weight1/weight2)

    def render(self, layer: int | None, expert: int | None) -> str:
        if self.layer is None:
            return self.suffix
        if self.style == "seq_expert":
            return f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{self.suffix}"
        if self.style == "te_grouped":
            linear, param = self.suffix.split(".")
            return f"decoder.layers.{layer}.mlp.experts.{linear}.{param}{expert}"
        return f"decoder.layers.{layer}.{self.suffix}"


@functools.lru_cache(maxsize=1 << 17)  # the same keys recur in every shard and every pass over them
def parse_key(key: str) -> KeyInfo:
    m = _LAYER_RE.match(key)
    if not m:
        return KeyInfo(None, None, key)
    layer, rest = int(m.group(1)), m.group(2)
    e = _SEQ_EXPERT_RE.match(rest)
    if e:
        return KeyInfo(layer, int(e.group(1)), e.group(2), "seq_expert")
    g = _TE_GROUPED_RE.match(rest)
    if g:
        return KeyInfo(layer, int(g.group(3)), f"{g.group(1)}.{g.group(2)}", "te_grouped")
    if _LEGACY_GROUPED_RE.match(rest):  # every local expert in one tensor: unpacked by reshard/plan/spec.py
        return KeyInfo(layer, None, rest, "legacy_grouped")
    return KeyInfo(layer, None, rest)


class AmbiguousRuleError(PreflightError):
    """Two rows of the split-rule table match one key: the table itself is wrong (never first-match-wins)."""


def matching_rules(info: KeyInfo) -> list[tuple[str, Rule]]:
    """Every table row whose pattern matches the key's suffix (the expert table inside an expert)."""
    table = _EXPERT_COMPILED if info.expert is not None else _COMPILED
    return [(pattern.pattern, rule) for pattern, rule in table if pattern.match(info.suffix)]


def rule_for(info: KeyInfo, *, swiglu: bool) -> Rule:
    """The split rule of a parsed key: exactly one table row must match (SwiGLU decides whether fc1 is a GLU
    split). It depends on the suffix alone (and whether it is inside an expert): matched once per suffix."""
    found = _rule_of_suffix(info.suffix, info.expert is not None, swiglu)
    if isinstance(found, Rule):
        return found
    where = info.render(info.layer, info.expert)
    if found:
        raise AmbiguousRuleError(f"key {where} matches {len(found)} rows of the split-rule table ({', '.join(found)})",
                                 fix="this is a bug in megatron-preflight's rule table: report it", code="rules")
    raise UnknownKeyError(
        f"key {where} has no split rule (unknown parameter: another model type, MLA, MTP or a newer Megatron?)",
        fix="no layout change can be done safely for it; load at the checkpoint's own layout, or convert with "
            "Megatron to torch_dist and let its dist loader reshard", code="unknown_key")


@functools.lru_cache(maxsize=1 << 14)
def _rule_of_suffix(suffix: str, expert: bool, swiglu: bool) -> Rule | tuple[str, ...]:
    """The one rule for ``suffix``, or the patterns that matched (none, or more than one)."""
    matches = matching_rules(KeyInfo(0, 0 if expert else None, suffix))
    if len(matches) != 1:
        return tuple(p for p, _ in matches)
    rule = matches[0][1]
    if rule.kind == "fc1":
        return Rule("glu" if swiglu else "column", rule.group)
    return rule


def segments(rule: Rule, global_len: int, group_size: int, rank: int) -> list[tuple[int, int, int]]:
    """Where rank ``rank``'s local tensor sits in the global tensor along the split dim:
    ``[(global_start, length, local_start), ...]`` (two segments for GLU, one otherwise)."""
    if rule.kind == "glu":
        half = global_len // 2
        n = half // group_size
        return [(rank * n, n, 0), (half + rank * n, n, n)]
    n = global_len // group_size
    return [(rank * n, n, 0)]

"""The one table that says how every Megatron-Core GPT parameter is split across ranks.

Keys are matched against the parameter name *after* its layer / expert prefix is removed (see :func:`parse_key`).
Each rule says along which dim the tensor is split and by which group (TP for dense, ETP for experts), and how the
rows are laid out:

* ``column``  — dim 0 split in contiguous chunks (QKV is grouped per query group ``[q…, k, v]`` and TP gives each
  rank whole groups, so contiguous chunks are whole groups);
* ``glu``     — dim 0, SwiGLU fc1: the global tensor is ``[gate; up]`` and each rank holds ``[gate_r; up_r]``;
* ``row``     — dim 1 split in contiguous chunks;
* ``vocab``   — dim 0, word embeddings / output layer with ``padded_vocab_size`` rows (padding follows TP);
* ``sections`` — dim 0 holds N unequal sections side by side (``parts``: their global sizes), each split over TP,
  so that a rank holds ``[s1_r; s2_r; …]`` (HybridModel's Mamba-2 and gated-delta-net projections: ``[z|x|B|C|dt]``).
  The table names the section family (``mamba_in``, ``mamba_conv``, ``gdn_in``, ``gdn_conv``); the sizes come from
  the model (:mod:`~megatron_preflight.reshard.plan.sections`) and replace the family with a ``sections`` rule;
* ``replicated`` — the same on every rank of the group;
* ``extra``   — ``_extra_state`` (None, or TE/FP8 metadata): carried from the main replica.

Unknown keys raise :class:`UnknownKeyError` naming the key: never silently copied or dropped.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import NamedTuple

from megatron_preflight.errors import PreflightError


class UnknownKeyError(PreflightError):
    """A state-dict key no rule covers."""


@dataclass(frozen=True)
class Rule:
    kind: str  # column | glu | row | vocab | sections | replicated | extra (and the section families, unresolved)
    group: str = "tp"  # tp (dense) or etp (experts)
    parts: tuple[int, ...] = ()  # sections: the global size of each section along dim 0

    @property
    def dim(self) -> int | None:
        return _SPLIT_DIM.get(self.kind)


# the section families of HybridModel's sectioned projections (sizes from the model: reshard/plan/sections.py)
SECTION_FAMILIES = ("mamba_in", "mamba_conv", "gdn_in", "gdn_conv")
# the dim each kind of split cuts (none: not split)
_SPLIT_DIM = {"column": 0, "glu": 0, "vocab": 0, "row": 1, "sections": 0, **{f: 0 for f in SECTION_FAMILIES}}


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
    # learnable softmax offsets (attention sinks, GPT-OSS): one per head, the heads split over TP
    (r"self_attention\.core_attention\.softmax_offset", COLUMN),
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
    # MoE latent projections (NemotronH: the experts compute in a latent width): "duplicated" on every rank
    (r"mlp\.fc(1|2)_latent_proj\.(weight|bias)", REPL),
    # shared experts use dense TP
    (r"mlp\.shared_experts\.linear_fc1\.(weight|bias)", Rule("fc1")),
    (r"mlp\.shared_experts\.linear_fc2\.weight", ROW),
    (r"mlp\.shared_experts\.linear_fc2\.bias", REPL),
    (r"mlp\.shared_experts\.gate_weight", REPL),
    # multi-token prediction (MTP): per MTP layer its norms of the embedding and of the hidden state, the
    # column-parallel projection of their concatenation to the hidden size, and its final norm; the transformer layer
    # inside it is parsed as a decoder layer is (see parse_key)
    (r"mtp\.layers\.\d+\.(enorm|hnorm|final_layernorm)\.(weight|bias)", REPL),
    (r"mtp\.layers\.\d+\.eh_proj\.weight", COLUMN),
    # HybridModel (hybrid_layer_specs): a Mamba-2 layer (`M`): the mixer's in_proj rows are [z | x | B | C | dt] and
    # its depthwise conv's channels [x | B | C], each section split over TP; per-head dt_bias, A_log, D and the gated
    # norm over d_inner split contiguously; out_proj row-parallel; the fused pre-norm and a plain pre-norm replicated.
    # The conv is `conv1d_weight` / `conv1d_bias` from megatron-core 0.19 (module `conv1d.weight` / `.bias` before).
    (r"norm\.(weight|bias)", REPL),
    (r"mixer\.in_proj\.layer_norm_(weight|bias)", REPL),
    (r"mixer\.in_proj\.(weight|bias)", Rule("mamba_in")),
    (r"mixer\.(conv1d_weight|conv1d_bias|conv1d\.weight|conv1d\.bias)", Rule("mamba_conv")),
    (r"mixer\.(dt_bias|A_log|D)", COLUMN),
    (r"mixer\.norm\.weight", COLUMN),
    (r"mixer\.out_proj\.weight", ROW),
    (r"mixer\.out_proj\.bias", REPL),
    # a gated delta net layer (`G`): in_proj rows [query | key | value | z | beta | alpha], conv channels
    # [query | key | value], per value head dt_bias and A_log, the per-head output norm replicated
    (r"self_attention\.in_proj\.layer_norm_(weight|bias)", REPL),
    (r"self_attention\.in_proj\.(weight|bias)", Rule("gdn_in")),
    (r"self_attention\.conv1d\.(weight|bias)", Rule("gdn_conv")),
    (r"self_attention\.(dt_bias|A_log)", COLUMN),
    (r"self_attention\.out_norm\.(weight|bias)", REPL),
    (r"self_attention\.out_proj\.weight", ROW),
    (r"self_attention\.out_proj\.bias", REPL),
]

# Inside one expert (the suffix after `local_experts.{j}.` or the TE-grouped `weight{j}`), split by ETP.
_EXPERT_TABLE: list[tuple[str, Rule]] = [
    (r"(.+\.)?_extra_state", EXTRA),
    (r"linear_fc1\.(weight|bias)", Rule("fc1", "etp")),
    (r"linear_fc2\.weight", Rule("row", "etp")),
    (r"linear_fc2\.bias", Rule("replicated", "etp")),
]


class _Names:
    """A row whose pattern only names keys (escaped dots, words, ``(a|b)`` choices), matched as the set of names it
    spells: compiling the table's ~50 patterns cost ~6 ms of every process, a verdict's included."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern + "$"
        names = [""]
        for choice, word in _NAME_PART.findall(pattern):
            names = [n + part.replace("\\.", ".") for n in names for part in (choice.split("|") if choice else [word])]
        self.names = frozenset(names)

    def match(self, suffix: str) -> bool:
        return suffix in self.names


_NAMES_ONLY = re.compile(r"(?:\\\.|\w|\((?:\\\.|\w)+(?:\|(?:\\\.|\w)+)*\))+")
_NAME_PART = re.compile(r"\(([^)]*)\)|((?:\\\.|\w)+)")


def _row(pattern: str) -> _Names | re.Pattern[str]:
    return _Names(pattern) if _NAMES_ONLY.fullmatch(pattern) else re.compile(pattern + "$")


_COMPILED = [(_row(p), r) for p, r in _TABLE]
_EXPERT_COMPILED = [(_row(p), r) for p, r in _EXPERT_TABLE]

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# an MTP layer's transformer layer: ``mtp_model_layer`` from megatron-core 0.17 (module and legacy files),
# ``transformer_layer`` before and in every torch_dist checkpoint (Megatron maps the new name to it when it saves).
# The newer name is the one global name (GlobalKey, diff, fingerprints, verify), whichever the source wrote.
MTP_LAYER_NAMES = ("mtp_model_layer", "transformer_layer")
MTP_INNER = MTP_LAYER_NAMES[0] + "."
_MTP_LAYER_RE = re.compile(rf"^(mtp\.layers\.(\d+)\.)({'|'.join(MTP_LAYER_NAMES)})\.(.+)$")
# HybridModel's MTP layer holds a stack of its own (`mtp_model_layer.layers.{j}.`): each one a layer of the stack
_NESTED_RE = re.compile(r"^(layers\.(\d+)\.)(.+)$")
_SEQ_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_TE_GROUPED_RE = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
_LEGACY_GROUPED_RE = re.compile(r"^mlp\.experts\.weight[12]$")


class KeyInfo(NamedTuple):  # (a tuple: every key of every shard is parsed, a DeepSeek-V3 has 62k)
    """A local state-dict key split into its parts: layer (local index), expert (local index), suffix."""

    layer: int | None
    expert: int | None
    suffix: str  # for layers: the part after `decoder.layers.N.` (experts: after the expert prefix)
    style: str = "plain"  # plain | seq_expert | te_grouped | legacy_grouped (GroupedMLP's weight1/weight2)
    head: str = ""  # a transformer layer outside the decoder (an MTP layer's): its prefix, as the source names it

    def render(self, layer: int | None, expert: int | None) -> str:
        if self.layer is None and not self.head:
            return self.suffix
        prefix = self.head or f"decoder.layers.{layer}."
        if self.style == "seq_expert":
            return f"{prefix}mlp.experts.local_experts.{expert}.{self.suffix}"
        if self.style == "te_grouped":
            linear, param = self.suffix.split(".")
            return f"{prefix}mlp.experts.{linear}.{param}{expert}"
        return f"{prefix}{self.suffix}"

    @property
    def global_suffix(self) -> str:
        """The suffix of the key's global name (:class:`~megatron_preflight.reshard.plan.types.GlobalKey`): an MTP
        layer's transformer layer under one name, whichever the source wrote."""
        return canonical_name(self.head + self.suffix) if self.head else self.suffix


def mtp_index(suffix: str) -> int | None:
    """The MTP layer a global suffix belongs to (None: not an MTP key)."""
    if not suffix.startswith("mtp.layers."):
        return None
    number = suffix[len("mtp.layers."):].split(".", 1)[0]
    return int(number) if number.isdigit() else None


# the modules of an MTP layer, in Megatron's order (a module's place, its parameters, the distributed optimizer's
# buffers all follow it)
MTP_PARTS = ("enorm.", "hnorm.", "eh_proj.", MTP_INNER, "final_layernorm.")


def mtp_place(suffix: str) -> int:
    """An MTP global suffix's place among the model's MTP modules: its layer, then its module in the layer (then,
    inside a HybridModel MTP layer's own stack, its layer there)."""
    index = mtp_index(suffix)
    assert index is not None, suffix
    rest = suffix.split(".", 3)[3]
    part = next((i for i, p in enumerate(MTP_PARTS) if rest.startswith(p)), len(MTP_PARTS))
    nested = _NESTED_RE.match(rest[len(MTP_INNER):]) if rest.startswith(MTP_INNER) else None
    return (index * (len(MTP_PARTS) + 1) + part) * 1024 + (int(nested.group(2)) if nested else 0)


def canonical_name(key: str) -> str:
    """``key`` with an MTP layer's transformer layer under its one global name (``mtp_model_layer``), whichever name
    its Megatron wrote: checkpoints of one model by Megatron versions that name it differently compare, fingerprint
    and verify alike (every other key is itself)."""
    m = _MTP_LAYER_RE.match(key)
    return f"{m.group(1)}{MTP_INNER}{m.group(4)}" if m else key


def torch_dist_name(key: str) -> str:
    """``key`` with an MTP layer's transformer layer named as every torch_dist checkpoint names it
    (``transformer_layer``: Megatron maps the newer module name to it when it saves); every other key is itself."""
    m = _MTP_LAYER_RE.match(key)
    return f"{m.group(1)}{MTP_LAYER_NAMES[1]}.{m.group(4)}" if m else key


def mtp_layer_name(key: str) -> str | None:
    """The name ``key`` gives an MTP layer's transformer layer (one of :data:`MTP_LAYER_NAMES`; None: no such key)."""
    m = _MTP_LAYER_RE.match(key)
    return m.group(3) if m else None


def mtp_spellings(key: str) -> tuple[str, ...]:
    """``key`` as written, then under the other name of an MTP layer's transformer layer (itself alone otherwise)."""
    m = _MTP_LAYER_RE.match(key)
    if not m:
        return (key,)
    return (key, *(f"{m.group(1)}{name}.{m.group(4)}" for name in MTP_LAYER_NAMES if name != m.group(3)))


# a Mamba-2 mixer's depthwise conv in a legacy state dict: a module (``mixer.conv1d.weight``) up to megatron-core 0.18,
# parameters of the mixer (``mixer.conv1d_weight``) from 0.19 (torch_dist keeps the module's names)
MAMBA_CONV_NAMES = ("conv1d_weight", "conv1d.weight")
_MAMBA_CONV_RE = re.compile(r"^((?:.*\.)?mixer\.)conv1d[._](weight|bias)$")


def mamba_conv_name(key: str) -> str | None:
    """The naming ``key`` gives a Mamba mixer's conv (one of :data:`MAMBA_CONV_NAMES`; None: no such key)."""
    m = _MAMBA_CONV_RE.match(key)
    if not m:
        return None
    return MAMBA_CONV_NAMES[0] if key.endswith(("conv1d_weight", "conv1d_bias")) else MAMBA_CONV_NAMES[1]


def spellings(key: str) -> tuple[str, ...]:
    """``key`` as written, then under every other name a Megatron release gives it: an MTP layer's transformer layer
    (:func:`mtp_spellings`), a Mamba mixer's conv (``conv1d.weight`` / ``conv1d_weight``)."""
    out = list(mtp_spellings(key))
    for k in list(out):
        m = _MAMBA_CONV_RE.match(k)
        if m:
            other = f"{m.group(1)}conv1d.{m.group(2)}" if mamba_conv_name(k) == MAMBA_CONV_NAMES[0] else \
                f"{m.group(1)}conv1d_{m.group(2)}"
            out.append(other)
    return tuple(out)


def info_of_global(layer: int | None, expert: int | None, style: str, suffix: str) -> KeyInfo:
    """The parsed key of a global name (the inverse of :attr:`KeyInfo.global_suffix`; the layer number only says
    "a decoder layer")."""
    m = _MTP_LAYER_RE.match(suffix) if layer is None else None
    if m:
        head, rest = f"{m.group(1)}{MTP_INNER}", m.group(4)
        nested = _NESTED_RE.match(rest)
        if nested:
            head, rest = head + nested.group(1), nested.group(3)
        return KeyInfo(None, expert, rest, style, head=head)
    return KeyInfo(None if layer is None else 0, expert, suffix, style)


@functools.lru_cache(maxsize=1 << 17)  # the same keys recur in every shard and every pass over them
def parse_key(key: str) -> KeyInfo:
    m = _LAYER_RE.match(key)
    if m:
        return _inside_layer(int(m.group(1)), m.group(2), "")
    t = _MTP_LAYER_RE.match(key)
    if t and not _LEGACY_GROUPED_RE.match(t.group(4)):  # (an MTP layer of the legacy GroupedMLP: no rule)
        head, rest = f"{t.group(1)}{t.group(3)}.", t.group(4)
        nested = _NESTED_RE.match(rest)
        if nested:
            head, rest = head + nested.group(1), nested.group(3)
        return _inside_layer(None, rest, head)
    return KeyInfo(None, None, key)


def _inside_layer(layer: int | None, rest: str, head: str) -> KeyInfo:
    e = _SEQ_EXPERT_RE.match(rest)
    if e:
        return KeyInfo(layer, int(e.group(1)), e.group(2), "seq_expert", head)
    g = _TE_GROUPED_RE.match(rest)
    if g:
        return KeyInfo(layer, int(g.group(3)), f"{g.group(1)}.{g.group(2)}", "te_grouped", head)
    if _LEGACY_GROUPED_RE.match(rest):  # every local expert in one tensor: unpacked by reshard/plan/spec.py
        return KeyInfo(layer, None, rest, "legacy_grouped", head)
    return KeyInfo(layer, None, rest, head=head)


class AmbiguousRuleError(PreflightError):
    """Two rows of the split-rule table match one key: the table itself is wrong (never first-match-wins)."""


def matching_rules(info: KeyInfo) -> list[tuple[str, Rule]]:
    """Every table row whose pattern matches the key's suffix (the expert table inside an expert; an MTP layer's
    transformer layer as a decoder layer)."""
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
    ``[(global_start, length, local_start), ...]`` (two segments for GLU, one per section of a sectioned tensor, one
    otherwise)."""
    if rule.kind == "glu":
        half = global_len // 2
        n = half // group_size
        return [(rank * n, n, 0), (half + rank * n, n, n)]
    if rule.kind == "sections":
        if sum(rule.parts) != global_len:
            raise PreflightError(f"sections {rule.parts} do not add up to the tensor's {global_len} rows",
                                 fix="the checkpoint's tensors disagree with its args: run `megatron-preflight "
                                     "inspect` on it", code="plan")
        out, start, local = [], 0, 0
        for size in rule.parts:
            n = size // group_size
            out.append((start + rank * n, n, local))
            start, local = start + size, local + n
        return out
    if rule.kind in SECTION_FAMILIES:
        raise PreflightError(f"the {rule.kind} sections of this tensor are not known here (a HybridModel tensor read "
                             "outside a checkpoint index)", fix="this is a bug in megatron-preflight: report it",
                             code="plan")
    n = global_len // group_size
    return [(rank * n, n, 0)]

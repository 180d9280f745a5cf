"""torch_dist checkpoints as a source of the resharder: their model tensors, seen as the legacy shards of the
layout that saved them.

A torch_dist ``.metadata`` describes every model tensor by its *global* shape, with decoder layers stacked along a
leading layer dim (and expert weights along an expert dim after it), and the chunks each rank wrote (offsets, sizes,
and the byte range of the chunk's ``torch.save`` blob inside a ``__*_*.distcp`` file). :func:`virtual_layout` turns
that into the shards a legacy save at the same layout would have written — same keys, same local shapes — whose
tensors are :class:`RegionRef` pieces of the global tensors. Every later stage (index, planner, executor, writer,
verification) then works unchanged; only :class:`~.torch_dist_reader.DistReader` knows how to read a region.

Where a legacy tensor sits in the global one comes from the split-rule table (:func:`rules.segments`): SwiGLU's
``[gate; up]`` halves, vocab padding and ETP for experts included. Key names follow the model's spec: with
``--transformer-impl local`` Megatron saves ``input_layernorm`` / ``pre_mlp_layernorm`` under the fused names
(``self_attention.linear_qkv.layer_norm_*`` / ``mlp.linear_fc1.layer_norm_*``), and the legacy keys get their module
names back.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_preflight import dtypes, parallel
from megatron_preflight.errors import PreflightError
from megatron_preflight.layout import naming
from megatron_preflight.layout.dist import METADATA_JSON, ObjectReader, metadata_facts, object_index
from megatron_preflight.layout.model import Format, Layout, LazyShard, Shard
from megatron_preflight.parallel import ParallelLayout
from megatron_preflight.reshard.carried import FROM_TORCH_DIST, REWRITTEN
from megatron_preflight.reshard.plan.rules import (
    Rule,
    canonical_name,
    mtp_index,
    mtp_place,
    parse_key,
    rule_for,
    segments,
)
from megatron_preflight.reshard.plan.spec import (
    MODULE_ORDER,
    grouped_experts,
    is_local_spec,
    legacy_suffix,
    param_rank,
    rank_in,
)
from megatron_preflight.reshard.sources.te_extra_state import described, no_fp8_copy
from megatron_preflight.reshard.sources.torch_dist_reader import RegionRef, Slab, source_metadata
from megatron_preflight.torch_file import StorageRef, row_major

if TYPE_CHECKING:  # tensors are made only when a plan runs: planning and costing need no torch
    import torch

LAYERS = "decoder.layers."


EXPERTS = "mlp.experts.experts."

# HybridModel's sectioned projections: torch_dist saves each section as a global tensor of its own
# (``<name>.<section>``); a legacy file holds one tensor per rank, its share of every section side by side. The legacy
# name of Mamba's conv is main's (``conv1d_weight``; ``conv1d.weight`` in megatron-core 0.18 and before and in every
# torch_dist).
SECTIONED = {
    "mixer.in_proj.weight": (("z", "x", "B", "C", "dt"), "mixer.in_proj.weight"),
    "mixer.conv1d.weight": (("x", "B", "C"), "mixer.conv1d_weight"),
    "mixer.conv1d.bias": (("x", "B", "C"), "mixer.conv1d_bias"),
    "self_attention.in_proj.weight": (("query", "key", "value", "z", "beta", "alpha"), "self_attention.in_proj.weight"),
    "self_attention.conv1d.weight": (("query", "key", "value"), "self_attention.conv1d.weight"),
    "self_attention.conv1d.bias": (("query", "key", "value"), "self_attention.conv1d.bias"),
}


def section_of(fqn: str) -> tuple[str, str] | None:
    """(the sectioned tensor, the section) a torch_dist key names, or None."""
    parent, _, section = fqn.rpartition(".")
    for name, (sections, _legacy) in SECTIONED.items():
        if parent.endswith("." + name) and section in sections:
            return parent, section
    return None


def _legacy_sectioned(parent: str) -> str:
    name = next(n for n in SECTIONED if parent.endswith("." + n))
    return parent[: -len(name)] + SECTIONED[name][1]


def object_fqn(base: str, index: tuple[int, ...], count: tuple[int, ...]) -> str:
    """A sharded object's key: ``<base>/shard_<index>_<count>`` (dims joined by dots; ``0_1`` when not stacked).
    :meth:`_Builder.extra_state` parses it."""
    return f"{base}/shard_{'.'.join(map(str, index)) or '0'}_{'.'.join(map(str, count)) or '1'}"


_UNREAD = object()

NON_LAYER_ORDER = ("embedding.word_embeddings.", "embedding.position_embeddings.", "embedding.",
                   "decoder.final_layernorm.", "decoder.final_norm.", "mtp.", "output_layer.")




@dataclass
class _Entry:
    sort: tuple
    key: str
    value: Any


class _Builder:
    """Collects, per virtual shard and model chunk, the legacy keys and their regions."""

    def __init__(self, layout: Layout, par: ParallelLayout, md: Any, objects: dict[str, Any],
                 trust: bool = False) -> None:
        self.layout = layout
        self.par = par
        self.md = md
        args = layout.saved_args
        self.swiglu = parallel.gated_mlp(args)
        self.local_spec = is_local_spec(args)
        self.te_grouped = grouped_experts(args)
        self.dirs = naming.shard_writers(par)
        self.position = {fqn: i for i, fqn in enumerate(md.state_dict_metadata)}
        self.iter_dir = layout.iter_dir or ""
        self.objects = objects  # bytes item -> where it lies (a model has thousands of extra-state items)
        self.reader = ObjectReader(self.iter_dir, trust=trust)
        self.trust = trust
        self._strides: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._refs: dict[tuple, RegionRef] = {}  # a piece shared by the shards that hold it (every EP rank's)
        self._values: dict[str, Any] = {}  # an extra state's value, read once
        # what is made for a group of shards (one pipeline stage and EP rank): the work the metadata's items need,
        # sorted by where it lands, so a shard's entries are made from its own items alone
        self.everywhere: list[tuple[str, Any]] = []  # the few items outside the layers: each asks its shards
        self.at_stage: dict[tuple[int, int | None], list[tuple]] = {}  # (stage, ep or None) -> work
        self.has_mtp = False
        self._extra_bases: dict[str, tuple[int | None, str, bool]] = {}  # module -> (layer, name in it, experts)
        # the output layer is the word embeddings
        self.tied = not bool(getattr(args, "untie_embeddings_and_output_weights", False))
        # the shards of the group being made (see materialize)
        self.entries: dict[tuple[str, int], list[_Entry]] = {}
        self._by_place: dict[tuple[int | None, int | None], list[tuple[str, dict[str, int]]]] = {}
        self._eps: dict[int, list[int]] = {}  # stage -> the EP ranks being made
        self.made: dict[str, dict[str, Any]] = {}  # shard name -> its model dicts (chunk -> {key: value})
        self._by_stage: dict[int, dict[str, dict[str, int]]] = {}
        self.lock = threading.Lock()

    def _shards(self, stage: int | None, ep: int | None = None) -> list[tuple[str, dict[str, int]]]:
        return self._by_place.get((stage, ep), [])

    def _experts_made(self, stage: int, count: int) -> list[tuple[int, int, int]]:
        """(global expert, EP rank, local expert) of the ``count`` experts of a layer on ``stage`` that the shards
        being made hold."""
        eps = self._eps.get(stage)
        if not eps:
            return []
        n = count // self.par.ep if self.par.ep and count % self.par.ep == 0 else 0
        if not n:  # (experts that do not divide over EP: placed one by one, as the layout's own rule says)
            return [(ge, *self.par.place_expert(ge)) for ge in range(count) if self.par.place_expert(ge)[0] in eps]
        return [(e * n + le, e, le) for e in eps for le in range(n)]

    # -- planning: where each metadata item lands (once) ------------------------------------------------------------
    def plan_tensor(self, fqn: str, tm: Any) -> None:
        if not fqn.startswith(LAYERS):
            self.everywhere.append(("tensor", (fqn, tm)))
            return
        shape = tuple(int(s) for s in tm.size)
        layers, rest = self._layers_of(fqn, shape[0])
        for g, lead in layers:
            self.at_stage.setdefault((self.par.place_layer(g)[0], None), []).append(("layer", fqn, tm, g, lead, rest))

    def _extra_site(self, fqn: str) -> tuple[str, int | None, list[int], str, bool]:
        """An extra-state item ``…_extra_state/shard_<index>_<count>``: (its module, the module's global layer — None
        outside the layers —, the index after the layer (an expert module's: the expert first), the name inside the
        layer, whether it is an expert module's). The index gives the layer first when the module is stacked."""
        base, _, shard = fqn.partition("/shard_")
        index = [int(i) for i in shard.partition("_")[0].split(".")]
        layer, rest, experts = self._module_site(base)
        if base.startswith(LAYERS) and layer is None:  # stacked: the layer is the first index
            return base, index[0], index[1:], rest, experts
        return base, layer, index, rest, experts

    def _module_site(self, base: str) -> tuple[int | None, str, bool]:
        """An extra-state module's (global layer — None outside the layers, or stacked —, name inside the layer,
        whether it is an expert module's), once per module (~30k items of ~200 modules)."""
        how = self._extra_bases.get(base)
        if how is None:
            if base.startswith(LAYERS):
                layers, rest = self._layers_of(base, None)
                how = (layers[0][0] if layers else None, rest, rest.startswith(EXPERTS))
            else:
                how = (None, base, mtp_index(base) is not None and f".{EXPERTS}" in base)
            self._extra_bases[base] = how
        return how

    def _keeps_expert_item(self, local_expert: int) -> bool:
        """Whether an expert module's extra state is in a legacy file: with TE's grouped experts one module per EP
        rank (its first expert's item), one per local expert otherwise."""
        return not self.te_grouped or local_expert == 0

    def plan_extra_states(self, base: str, fqns: list[str]) -> None:
        """The extra-state items of one module, as :meth:`plan_extra_state` places each: those of an expert module of
        one layer (or outside the layers), indexed by the expert alone — TE's grouped experts: ~5 * 10^4 items in a
        1 T-parameter MoE — placed by integer arithmetic over the module's items, not one parse each."""
        layer, _rest, experts = self._module_site(base)
        cut = len(base) + len("/shard_")
        heads = [fqn[cut:].partition("_")[0] for fqn in fqns] if experts and self.par.num_experts else []
        if not heads or (base.startswith(LAYERS) and layer is None) or not all(map(str.isdigit, heads)):
            for fqn in fqns:  # (stacked modules, items of several dims)
                self.plan_extra_state(fqn)
            return
        stage = self.par.pp - 1 if layer is None else self.par.place_layer(layer)[0]
        per_rank = self.par.experts_per_rank()
        for fqn, head in zip(fqns, heads):  # noqa: B905 - one head per item
            ep, local = divmod(int(head), per_rank)  # (ParallelLayout.place_expert, its size asked once)
            if self._keeps_expert_item(local):
                self.at_stage.setdefault((stage, ep), []).append(("extra", fqn))

    def plan_extra_state(self, fqn: str) -> None:
        """Where a module's extra-state item lands (see :meth:`extra_state`); an item no legacy file holds, nowhere."""
        _base, g, index, _rest, experts = self._extra_site(fqn)
        stage = self.par.pp - 1 if g is None else self.par.place_layer(g)[0]
        ep = None
        if experts and index:
            ep, le = self.par.place_expert(index[0])
            if not self._keeps_expert_item(le):
                return
        self.at_stage.setdefault((stage, ep), []).append(("extra", fqn))

    # -- making a group of shards' entries ----------------------------------------------------------------------------
    def materialize(self, name: str) -> dict[str, Any]:
        """The model dicts of shard ``name``, made once: with the shards of its pipeline stage and EP rank (they
        differ in TP rank only) the first time its stage is asked for (a verdict reads one shard per stage), with
        every shard of the stage not made yet the next time (a reshard reads them all: each item is then handled once
        per stage, not once per EP rank)."""
        with self.lock:  # (kept once made: two threads reading one shard's meta get the same dicts)
            if name not in self.made:
                self._make(name)
            return self.made[name]

    def _make(self, name: str) -> None:
        c = self.dirs[name]
        stage = c["pp"]
        rest = {n: d for n, d in self._stage_dirs(stage).items() if n not in self.made}
        begun = len(rest) < len(self._stage_dirs(stage))  # (a shard of this stage was made before)
        group = rest if begun else self._group_of(c)
        self.entries = {(n, k): [] for n in group for k in range(self.par.chunks)}
        self._by_place = {}
        for n, d in group.items():
            for place in ((None, None), (d["pp"], None), (None, d["ep"]), (d["pp"], d["ep"])):
                self._by_place.setdefault(place, []).append((n, d))
        eps = sorted({d["ep"] for d in group.values()})
        self._eps = {stage: eps}
        try:
            for kind, item in self.everywhere:
                if kind == "tensor":
                    self.tensor(*item)
                else:
                    self.sectioned(*item)
            for place in ((stage, None), *((stage, ep) for ep in eps)):
                for work in self.at_stage.get(place, ()):
                    if work[0] == "layer":
                        self.layer_tensor(*work[1:])
                    else:
                        self.extra_state(work[1])
            self.tied_output()
            self.mtp_embedding()
            self.output_extra_state()
            self.attention_extra_state()
        finally:
            self.reader.close_files()  # (a view of 1,024 shards reads as many data files: none held open)
        for n in group:
            self.made[n] = {k: {e.key: e.value for e in sorted(self.entries[(n, k)], key=lambda e: e.sort)}
                            for k in range(self.par.chunks)}
        self.entries, self._by_place, self._eps = {}, {}, {}

    def _group_of(self, c: dict[str, int]) -> dict[str, dict[str, int]]:
        """The shards that share ``c``'s stage and EP rank."""
        return {n: d for n, d in self._stage_dirs(c["pp"]).items() if d["ep"] == c["ep"]}

    def _stage_dirs(self, stage: int) -> dict[str, dict[str, int]]:
        """The shards of a pipeline stage (indexed once: a DeepSeek-V3 view has 1,024)."""
        if not self._by_stage:
            for n, d in self.dirs.items():
                self._by_stage.setdefault(d["pp"], {})[n] = d
        return self._by_stage[stage]

    def _ref(self, fqn: str, dtype: torch.dtype, lead: tuple[int, ...], shape: tuple[int, ...], key: str,
             rank: int, size: int, rule: Rule | None = None) -> RegionRef:
        """The legacy piece of rank ``rank`` (of ``size``) of the tensor under ``key``: boxes of global ``fqn`` at
        stacked index ``lead`` (layer, expert); ``rule``: the key's split rule where the caller knows it (the same
        for every expert of a stacked tensor)."""
        memo = (fqn, lead, key, rank, size)
        ref = self._refs.get(memo)
        if ref is not None:
            return ref
        if rule is None:
            rule = rule_for(parse_key(key), swiglu=self.swiglu)
        local = list(shape)
        slabs: list[Slab] = []
        if rule.dim is None or size == 1:
            slabs.append(Slab(fqn, lead + (0,) * len(shape), tuple(1 for _ in lead) + shape, 0, 0))
        else:
            dim = rule.dim
            if shape[dim] % size:
                raise PreflightError(f"tensor {fqn}: {shape[dim]} rows along dim {dim} do not split over {size} ranks",
                                     path=os.path.join(self.iter_dir, ".metadata"), code="inconsistent_shards",
                                     fix="the checkpoint's args and its tensors disagree: restore it from a good copy")
            local[dim] = 0
            for gstart, length, lstart in segments(rule, shape[dim], size, rank):
                offsets = [0] * len(shape)
                sizes = list(shape)
                offsets[dim], sizes[dim] = gstart, length
                slabs.append(Slab(fqn, lead + tuple(offsets), tuple(1 for _ in lead) + tuple(sizes), dim, lstart))
                local[dim] += length
        shape_ = tuple(local)
        strides = self._strides.get(shape_)
        if strides is None:  # (every expert's piece has the same shape)
            strides = self._strides[shape_] = row_major(shape_)
        ref = self._refs[memo] = RegionRef(self.iter_dir, StorageRef(fqn, dtype, math.prod(shape_)), 0, shape_,
                                           strides, slabs=tuple(slabs))
        return ref

    def sectioned(self, parent: str, parts: list[tuple[str, Any]]) -> None:
        """A sectioned projection (:data:`SECTIONED`): each rank's legacy tensor is its TP share of every section, in
        Megatron's section order."""
        name = next(n for n in SECTIONED if parent.endswith("." + n))
        order = {section: i for i, section in enumerate(SECTIONED[name][0])}
        parts = sorted(parts, key=lambda p: order[p[0].rpartition(".")[2]])
        shapes = [(fqn, tuple(int(d) for d in tm.size)) for fqn, tm in parts]
        dtype = parts[0][1].properties.dtype
        pos = min(self.position[fqn] for fqn, _ in parts)
        key = _legacy_sectioned(parent)
        if key.startswith(LAYERS):
            layers, rest = self._layers_of(key, None)
            g = layers[0][0]
            stage, chunk, local = self.par.place_layer(g)
            key, sort = f"{LAYERS}{local}.{rest}", self._layer_sort(g, rest, 0, pos)
        else:
            key = canonical_name(key)
            stage, chunk, sort = self.par.pp - 1, self.par.chunks - 1, self._top_sort(key, pos)
        for shard, c in self._shards(stage):
            self._add(shard, chunk, sort, key, self._sectioned_ref(shapes, dtype, key, c["tp"], self.par.tp))

    def _sectioned_ref(self, shapes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, key: str, rank: int,
                       size: int) -> RegionRef:
        slabs, rows = [], 0
        for fqn, shape in shapes:
            if shape[0] % size:
                raise PreflightError(f"tensor {fqn}: {shape[0]} rows do not split over {size} ranks",
                                     path=os.path.join(self.iter_dir, ".metadata"), code="inconsistent_shards",
                                     fix="the checkpoint's args and its tensors disagree: restore it from a good copy")
            n = shape[0] // size
            slabs.append(Slab(fqn, (rank * n,) + (0,) * (len(shape) - 1), (n, *shape[1:]), 0, rows))
            rows += n
        local = (rows, *shapes[0][1][1:])
        return RegionRef(self.iter_dir, StorageRef(shapes[0][0], dtype, math.prod(local)), 0, local, row_major(local),
                         slabs=tuple(slabs))

    def _add(self, shard: str, chunk: int, sort: tuple, key: str, value: Any) -> None:
        self.entries[(shard, chunk)].append(_Entry(sort, key, value))

    def _layer_sort(self, g: int, suffix: str, expert: int, pos: int) -> tuple:
        if suffix.startswith(EXPERTS):
            inner = rank_in(suffix[len(EXPERTS):], ("linear_fc1.", "linear_fc2."), pos)
            slot = rank_in("mlp.experts.", MODULE_ORDER, pos)
            if self.te_grouped:  # one module per linear: every expert's fc1 (weight{j}, bias{j}), its extra state,
                # then fc2 — the order TE registers them (the distributed optimizer's buffers follow it)
                last = suffix.endswith("_extra_state")
                return (1, g, slot, inner, 1 << 30 if last else expert, param_rank(suffix), pos)
            # sequential experts: one block, expert-major, then fc1 before fc2
            return (1, g, slot, expert, inner, param_rank(suffix), pos)
        return (1, g, rank_in(suffix, MODULE_ORDER, pos), 0, 0, param_rank(suffix), pos)

    @staticmethod
    def _layers_of(fqn: str, count: int | None) -> tuple[list[tuple[int, tuple[int, ...]]], str]:
        """The global layers a ``decoder.layers.`` tensor holds, each with its index into the stacked dims, and the
        name inside the layer: ``decoder.layers.<name>`` is stacked along dim 0 (one entry per layer, ``count``
        of them); ``decoder.layers.<g>.<name>`` (heterogeneous layers) is layer ``g`` alone."""
        rest = fqn[len(LAYERS):]
        head, _, tail = rest.partition(".")
        if head.isdigit():
            return [(int(head), ())], tail
        return [(g, (g,)) for g in range(count or 0)], rest

    def tensor(self, fqn: str, tm: Any) -> None:
        """A tensor outside the decoder layers, in the shards being made."""
        shape = tuple(int(s) for s in tm.size)
        dtype = tm.properties.dtype
        pos = self.position[fqn]
        if mtp_index(fqn) is not None and f".{EXPERTS}" in fqn:
            self._mtp_experts(fqn, dtype, shape, pos)
            return
        first = fqn.startswith("embedding.")
        stage, chunk = (0, 0) if first else (self.par.pp - 1, self.par.chunks - 1)
        shards = self._shards(stage)
        if not shards:
            return
        key = canonical_name(fqn)  # torch_dist's `transformer_layer` of an MTP layer: the newer legacy name
        sort = self._top_sort(key, pos)
        for name, c in shards:
            self._add(name, chunk, sort, key, self._ref(fqn, dtype, (), shape, key, c["tp"], self.par.tp))

    def layer_tensor(self, fqn: str, tm: Any, g: int, lead: tuple[int, ...], rest: str) -> None:
        """Layer ``g``'s piece of a ``decoder.layers.`` tensor (stacked: at index ``lead``), in the shards being
        made."""
        shape = tuple(int(s) for s in tm.size)
        dtype = tm.properties.dtype
        pos = self.position[fqn]
        stage, chunk, local = self.par.place_layer(g)
        inner = shape[len(lead):]
        if rest.startswith(EXPERTS):
            suffix = rest[len(EXPERTS):]
            rule = None
            for ge, ep_rank, le in self._experts_made(stage, inner[0]):
                key = f"{LAYERS}{local}.mlp.experts" + self._expert_key(suffix, le)
                if rule is None:  # (one rule for every expert's piece: the suffix decides it)
                    rule = rule_for(parse_key(key), swiglu=self.swiglu)
                sort = self._layer_sort(g, EXPERTS + suffix, ge, pos)
                for name, c in self._shards(stage, ep_rank):
                    self._add(name, chunk, sort, key, self._ref(fqn, dtype, lead + (ge,), inner[1:], key, c["etp"],
                                                                self.par.etp_eff, rule))
            return
        suffix = legacy_suffix(rest, self.local_spec)
        key = f"{LAYERS}{local}.{suffix}"
        sort = self._layer_sort(g, suffix, 0, pos)
        for name, c in self._shards(stage):
            self._add(name, chunk, sort, key, self._ref(fqn, dtype, lead, inner, key, c["tp"], self.par.tp))

    def _top_sort(self, key: str, pos: int, expert: int = 0) -> tuple:
        """A non-layer legacy key's place in its model chunk: embedding, final norm, MTP layers (layer by layer, each
        module in Megatron's order, the transformer layer inside as a decoder layer's), output layer."""
        first = 0 if key.startswith("embedding.") else 2
        if mtp_index(key) is None:
            return (first, 0, rank_in(key, NON_LAYER_ORDER, pos), param_rank(key), pos)
        info = parse_key(key)
        base = (first, 0, rank_in(key, NON_LAYER_ORDER, pos), mtp_place(info.global_suffix))
        if not info.head:
            return (*base, 0, 0, 0, param_rank(key), pos)
        experts = info.expert is not None or info.suffix.startswith("mlp.experts.")
        inner = EXPERTS + info.suffix.removeprefix("mlp.experts.") if experts else info.suffix
        return (*base, *self._layer_sort(0, inner, expert, pos)[2:])

    def _extra_expert_key(self, prefix: str, suffix: str, local_expert: int) -> str | None:
        """The legacy key of an expert module's extra state (``prefix`` ends in ``mlp.experts``): one grouped module
        per rank with TE's grouped experts (None for the others), one per local expert otherwise."""
        if not self._keeps_expert_item(local_expert):
            return None
        return f"{prefix}.{suffix}" if self.te_grouped else prefix + self._expert_key(suffix, local_expert)

    def _mtp_experts(self, fqn: str, dtype: Any, shape: tuple[int, ...], pos: int) -> None:
        """An MoE MTP layer's experts: ``mtp.layers.<i>.transformer_layer.mlp.experts.experts.<linear>.<param>``,
        stacked over the experts (dim 0), in the last stage's legacy files of each expert's EP rank."""
        head, _, suffix = fqn.partition(f".{EXPERTS}")
        stage, chunk = self.par.pp - 1, self.par.chunks - 1
        for ge, ep_rank, le in self._experts_made(stage, shape[0]):
            key = canonical_name(f"{head}.mlp.experts" + self._expert_key(suffix, le))
            for name, c in self._shards(stage, ep_rank):
                ref = self._ref(fqn, dtype, (ge,), shape[1:], key, c["etp"], self.par.etp_eff)
                self._add(name, chunk, self._top_sort(key, pos, ge), key, ref)

    def _expert_key(self, suffix: str, local_expert: int) -> str:
        if self.te_grouped:
            return f".{suffix}{local_expert}"  # TE grouped GEMM: mlp.experts.linear_fc1.weight{j}
        return f".local_experts.{local_expert}.{suffix}"

    def extra_state(self, fqn: str) -> None:
        """A module's extra state (None without Transformer Engine FP8), read from its bytes item:
        ``…_extra_state/shard_<index>_<count>`` (see :meth:`_extra_site`)."""
        base, g, index, rest, experts = self._extra_site(fqn)
        if g is None:  # outside the layers (a TE final norm, MTP): in the last stage's legacy files
            pos = self.position[fqn]
            if experts:  # an MoE MTP layer's: indexed by expert
                head, _, suffix = base.partition(f".{EXPERTS}")
                ge = index[0]
                ep_rank, le = self.par.place_expert(ge)
                key = self._extra_expert_key(canonical_name(head + ".mlp.experts"), suffix, le)
                for name, _c in self._shards(self.par.pp - 1, ep_rank) if key is not None else ():
                    self._add(name, self.par.chunks - 1, self._top_sort(key, pos, ge), key, self._bytes_item(fqn))
            elif base.startswith(("decoder.", "mtp.")):
                key = canonical_name(base)
                for name, _c in self._shards(self.par.pp - 1):
                    self._add(name, self.par.chunks - 1, self._top_sort(key, pos), key, self._bytes_item(fqn))
            return  # (_bytes_item reads an item only for a shard being made that holds it)
        stage, chunk, local = self.par.place_layer(g)
        pos = self.position[fqn]
        if experts:
            if not index:
                return
            ep_rank, le = self.par.place_expert(index[0])
            suffix = rest[len(EXPERTS):]
            key = self._extra_expert_key(f"{LAYERS}{local}.mlp.experts", suffix, le)
            shards = self._shards(stage, ep_rank)
            if key is None or not shards:  # (TE's grouped experts: one module per rank; the other experts' items
                return  # are not read)
            sort = self._layer_sort(g, EXPERTS + suffix, index[0], pos)
            value = self._bytes_item(fqn)
            for name, _c in shards:
                self._add(name, chunk, sort, key, value)
            return
        shards = self._shards(stage)
        if not shards:
            return
        suffix = legacy_suffix(rest, self.local_spec)
        key = f"{LAYERS}{local}.{suffix}"
        sort = self._layer_sort(g, suffix, 0, pos)
        value = self._bytes_item(fqn)
        for name, _c in shards:
            self._add(name, chunk, sort, key, value)

    def tied_output(self) -> None:
        """With tied embeddings and PP > 1 the last stage's legacy file holds its copy of the word embeddings as
        ``output_layer.weight`` (torch_dist saves the embedding once)."""
        if not self.tied or self.par.pp == 1:
            return
        tm = self.md.state_dict_metadata.get("embedding.word_embeddings.weight")
        if tm is None:
            return
        shape = tuple(int(s) for s in tm.size)
        chunk = self.par.chunks - 1
        for name, c in self._shards(self.par.pp - 1):
            ref = self._ref("embedding.word_embeddings.weight", tm.properties.dtype, (), shape, "output_layer.weight",
                            c["tp"], self.par.tp)
            self._add(name, chunk, self._top_sort("output_layer.weight", 0), "output_layer.weight", ref)

    def mtp_embedding(self) -> None:
        """With MTP and PP > 1 the last stage builds its own word embedding (the MTP layers embed the next tokens):
        its legacy files hold a copy (torch_dist saves the embedding once)."""
        if self.par.pp == 1 or not self.has_mtp:
            return
        for fqn in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight"):
            tm = self.md.state_dict_metadata.get(fqn)
            if tm is None:
                continue
            shape = tuple(int(s) for s in tm.size)
            for name, c in self._shards(self.par.pp - 1):
                ref = self._ref(fqn, tm.properties.dtype, (), shape, fqn, c["tp"], self.par.tp)
                self._add(name, self.par.chunks - 1, self._top_sort(fqn, self.position[fqn]), fqn, ref)

    def output_extra_state(self) -> None:
        """The output layer's ``_extra_state`` (None): in every legacy file of the last stage, not in torch_dist."""
        chunk = self.par.chunks - 1
        for name, _c in self._shards(self.par.pp - 1):
            if not any(e.key == "output_layer._extra_state" for e in self.entries[(name, chunk)]):
                self._add(name, chunk, self._top_sort("output_layer._extra_state", 0), "output_layer._extra_state",
                          None)

    def attention_extra_state(self) -> None:
        """Transformer Engine's attention module (``self_attention.core_attention``) has an ``_extra_state`` that a
        legacy save holds and torch_dist does not. Without FP8 it is TE's empty value, the same as the layer's
        ``linear_proj._extra_state`` (one serialization for TE's Linear and DotProductAttention per TE version): made
        from it, as Megatron's own conversion saves a freshly built module's. With FP8 (a non-empty value) it is left
        out: TE's load hook fills a missing one."""
        if self.local_spec:
            return
        for (name, chunk), entries in self.entries.items():
            keys = {e.key for e in entries}
            for e in list(entries):
                if not e.key.endswith(".self_attention.linear_proj._extra_state"):
                    continue
                key = e.key.replace(".linear_proj._extra_state", ".core_attention._extra_state")
                value = no_fp8_copy(e.value)
                if key not in keys and value is not None:
                    sort = self._top_sort(key, e.sort[-1]) if mtp_index(key) is not None else self._layer_sort(
                        e.sort[1], "self_attention.core_attention._extra_state", 0, e.sort[-1])
                    self._add(name, chunk, sort, key, value)

    def _bytes_item(self, fqn: str) -> Any:
        info = self.objects.get(fqn)
        # a TE module's extra state is a small uint8 tensor: read into a tensor where one will be written (torch is
        # loaded); a verdict (no torch) only needs to know what it is (described once per distinct blob). Either way
        # a value, never a piece to plan. (Not skipped for a run saved without FP8: a run that resumed an FP8
        # checkpoint with FP8 off saves TE's FP8 metadata again, and how many modules hold it is reported.)
        if info is None:
            return None
        value = self._values.get(fqn, _UNREAD)
        if value is _UNREAD:  # (read once: every shard of the stage holds it)
            value = self._values[fqn] = (self.reader.read(fqn, info, tensors=True) if dtypes.torch_loaded() else
                                         self.reader.read(fqn, info, describe=described))
        return value


@dataclass(frozen=True)
class _Properties:
    dtype: Any


@dataclass(frozen=True)
class _TensorEntry:
    """A tensor of the table as the builder reads it (torch's ``TensorStorageMetadata`` has these fields and more)."""

    size: tuple[int, ...]
    properties: _Properties


_BYTES_ENTRY = object()  # a bytes item of the table (no size)


def _table(iter_dir: str, trust: bool) -> tuple[Any, dict[str, Any]]:
    """The tensor table the builder reads (``state_dict_metadata``: name -> an entry with ``size`` and
    ``properties.dtype``, bytes items without a size) and where each bytes item lies: for a torch_dist save from the
    facts a verdict reads (:func:`~megatron_preflight.layout.dist.metadata_facts`, the ``.metadata`` never unpickled
    again once indexed), for an fsdp_dtensor save from its metadata renamed as torch_dist's."""
    if os.path.exists(os.path.join(iter_dir, METADATA_JSON)):  # (a torch_dist save: never an fsdp_dtensor one)
        facts = metadata_facts(iter_dir, trust=trust)
        try:
            table: dict[str, Any] = {fqn: _BYTES_ENTRY for fqn in facts.order}
            for fqn, (shape, dtype) in facts.tensors.items():
                table[fqn] = _TensorEntry(shape, _Properties(dtypes.dtype(dtype.removeprefix("torch."))))
        except KeyError:  # a dtype not known by name: the metadata's own objects
            pass
        else:
            return types.SimpleNamespace(state_dict_metadata=table), facts.objects
    md = source_metadata(iter_dir, trust=trust)  # (an fsdp_dtensor save: renamed as torch_dist's)
    return md, object_index(md)


def virtual_layout(layout: Layout, *, trust: bool = False) -> tuple[Layout, bool]:
    """The legacy shards a save of ``layout``'s torch_dist checkpoint at its own layout would have written, their
    tensors as :class:`RegionRef` (read them with :func:`dist_reader`); and whether it holds optimizer state.

    The metadata is sorted once by where each item lands; a shard's ``meta`` is made when first read
    (:class:`LazyShard`), with the other shards of its stage and EP rank: a verdict that reads one shard per stage
    makes (and reads the extra states of) those alone."""
    if layout.format not in (Format.TORCH_DIST, Format.FSDP_DTENSOR) or layout.iter_dir is None:
        raise PreflightError("not a torch_dist or fsdp_dtensor checkpoint", path=layout.path, code="format")
    if layout.saved_args is None or layout.parallel is None:
        raise PreflightError("the torch_dist checkpoint has no saved args (common state), so the layout that saved "
                             "it is unknown", path=layout.iter_dir, code="format",
                             fix="restore common.pt (or the common_state item) from a complete copy")
    md, objects = _table(layout.iter_dir, trust)
    par = layout.parallel
    b = _Builder(layout, par, md, objects, trust)
    has_optimizer = False
    sectioned: dict[str, list[tuple[str, Any]]] = {}
    extra: dict[str, list[str]] = {}  # extra-state module -> its items
    for fqn, tm in md.state_dict_metadata.items():
        if fqn.startswith("optimizer.") or (fqn.startswith("chained_") and ".optimizer." in fqn):
            has_optimizer = True
            continue
        if "/shard_" in fqn and fqn.split("/")[0].endswith("_extra_state"):
            extra.setdefault(fqn.partition("/shard_")[0], []).append(fqn)
            continue
        if not hasattr(tm, "size") or fqn.startswith(("rng_state", "rerun_state")):
            continue
        b.has_mtp = b.has_mtp or mtp_index(fqn) is not None
        section = section_of(fqn)
        if section is not None:
            sectioned.setdefault(section[0], []).append((fqn, tm))
            continue
        b.plan_tensor(fqn, tm)
    for base, fqns in extra.items():
        b.plan_extra_states(base, fqns)
    b.everywhere += [("sectioned", (parent, parts)) for parent, parts in sectioned.items()]
    common = layout.common_state or {}
    head = {k: common[k] for k in REWRITTEN + FROM_TORCH_DIST if k in common}  # what a legacy file holds at top level

    def load(name: str) -> dict[str, Any]:
        meta: dict[str, Any] = dict(head)
        for chunk, model in b.materialize(name).items():
            meta["model" if par.chunks == 1 else f"model{chunk}"] = model
        return meta

    shards: list[Shard] = [LazyShard(name=name, tp_rank=c["tp"], pp_rank=c["pp"], ep_rank=c["ep"],
                                     path=os.path.join(layout.iter_dir, name), load=load)
                           for name, c in b.dirs.items()]
    virtual = dataclasses.replace(layout, format=Format.TORCH, shards=shards, problems=list(layout.problems),
                                  notes=list(layout.notes))
    return virtual, has_optimizer

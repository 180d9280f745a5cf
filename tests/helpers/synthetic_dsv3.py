"""A synthetic DeepSeek-V3-shaped legacy checkpoint (scale benchmarks and their small-scale test).

The model of DeepSeek-V3 671B as Megatron-Core's Transformer Engine spec saves it: 61 layers (the first 3 dense),
multi-latent attention (q_lora 1536, kv_lora 512, qk 128 + rope 64, v 128, 128 heads), 256 routed experts of ffn 2048
(TE-grouped, 8 active) and one shared expert per MoE layer, a router with its expert bias, one MTP layer (MoE),
RMSNorm, SwiGLU, no biases, untied embeddings of a 129,280-token vocabulary; hidden 7168. Laid out at TP1·PP16·EP64
(1,024 shard dirs) with 3 layers on the first stage and 2 (plus the MTP layer) on the last, as a 61-layer model is
cut. Every shard file is a real ``torch.save`` with the full top-level state of a real save (args, RNG, scheduler
from a fixture Megatron-LM wrote); with ``hollow=True`` every tensor is a stride-0 view of one element (real
shapes, almost no bytes). Files with the same content (the EP ranks of one stage) are hard links of one file.
Model only, or with ``optimizer=True`` the distributed optimizer's state as a run with ``--use-distributed-optimizer
--overlap-grad-reduce`` saves it (:func:`write_dist_optimizer`). ``scale`` divides every width (for a small test of
the same structure).
"""

from __future__ import annotations

import argparse
import copy
import io
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_preflight import pickling
from megatron_preflight.layout import naming
from megatron_preflight.parallel import ParallelLayout
from megatron_preflight.torch_file import TensorRef, read_torch_file
from megatron_preflight.tree import map_leaves

_FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "megatron-lm")
TEMPLATE = os.path.join(_FIXTURES, "mtp_moe_te_ep2_torch", "iter_0000002", "mp_rank_00_000", "model_optim_rng.pt")
# a chained (dense + expert) distributed optimizer's param groups, as Megatron-LM saved them
OPTIMIZER_TEMPLATE = os.path.join(_FIXTURES, "distopt_moe_ep2dp2_torch", "iter_0000002", "mp_rank_00_000",
                                  "model_optim_rng.pt")


@dataclass
class DSV3:
    tp: int = 1
    pp: int = 16
    ep: int = 64
    scale: int = 1  # widths divided by this (1: the real model)
    num_layers: int = 61
    dense_layers: int = 3
    first_stage_layers: int | None = 3
    last_stage_layers: int | None = 2
    experts: int = 256
    mtp_layers: int = 1
    vocab: int = 129280
    dtype: str = "float32"  # the saved parameters' (a bf16 run's: "bfloat16")
    seq: int = 4096
    widths: dict[str, int] = field(default_factory=lambda: dict(
        hidden=7168, heads=128, ffn=18432, moe_ffn=2048, shared_ffn=2048, q_lora=1536, kv_lora=512, qk=128, rope=64,
        v=128))

    @classmethod
    def kimi_k2(cls, **kw) -> "DSV3":
        """Kimi K2 (1.04 T parameters): DeepSeek-V3's structure with 64 heads, one dense layer, 384 routed experts
        (+1 shared), a 163,840-token vocab and no MTP layer (its config.json: first_k_dense_replace 1,
        n_routed_experts 384, num_nextn_predict_layers 0)."""
        widths = dict(hidden=7168, heads=64, ffn=18432, moe_ffn=2048, shared_ffn=2048, q_lora=1536, kv_lora=512,
                      qk=128, rope=64, v=128)
        return cls(**{"dense_layers": 1, "experts": 384, "vocab": 163840, "mtp_layers": 0, "widths": widths, **kw})

    def w(self, name: str) -> int:
        return max(1, self.widths[name] // (1 if name == "heads" else self.scale))

    @property
    def padded_vocab(self) -> int:
        multiple = 128 * self.tp
        return -(-self.vocab // multiple) * multiple

    def stage_layers(self) -> list[list[int]]:
        """The global layers of each pipeline stage."""
        first = self.first_stage_layers if self.pp > 1 else None
        last = self.last_stage_layers if self.pp > 1 else None
        middle = self.num_layers - (first or 0) - (last or 0)
        inner = self.pp - (first is not None) - (last is not None)
        sizes = ([first] if first is not None else []) + [middle // inner] * inner + ([last] if last is not None else [])
        assert sum(sizes) == self.num_layers and len(sizes) == self.pp, sizes
        out, at = [], 0
        for n in sizes:
            out.append(list(range(at, at + n)))
            at += n
        return out

    def flags(self) -> list[str]:
        """The pretrain_gpt.py flags of a run of this model at this layout."""
        f = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp),
             "--expert-model-parallel-size", str(self.ep), "--expert-tensor-parallel-size", "1",
             "--num-layers", str(self.num_layers), "--hidden-size", str(self.w("hidden")),
             "--num-attention-heads", str(self.w("heads")), "--kv-channels", str(self.w("qk")),
             "--ffn-hidden-size", str(self.w("ffn")),
             "--num-experts", str(self.experts), "--moe-ffn-hidden-size", str(self.w("moe_ffn")),
             "--moe-shared-expert-intermediate-size", str(self.w("shared_ffn")), "--moe-router-topk", "8",
             "--moe-layer-freq", f"([0]*{self.dense_layers}+[1]*{self.num_layers - self.dense_layers})",
             "--moe-grouped-gemm", "--moe-router-enable-expert-bias",
             "--multi-latent-attention", "--q-lora-rank", str(self.w("q_lora")), "--kv-lora-rank",
             str(self.w("kv_lora")), "--qk-head-dim", str(self.w("qk")), "--qk-pos-emb-head-dim", str(self.w("rope")),
             "--v-head-dim", str(self.w("v")), "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
             "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
             "--seq-length", str(self.seq), "--max-position-embeddings", str(self.seq), "--vocab-size",
             str(self.vocab), "--transformer-impl", "transformer_engine", "--ckpt-format", "torch",
             "--no-load-optim", "--no-load-rng"]
        if self.mtp_layers:
            f += ["--mtp-num-layers", str(self.mtp_layers)]
        if self.dtype == "bfloat16":
            f.append("--bf16")
        if self.pp > 1 and self.first_stage_layers is not None:
            f += ["--decoder-first-pipeline-num-layers", str(self.first_stage_layers)]
        if self.pp > 1 and self.last_stage_layers is not None:
            f += ["--decoder-last-pipeline-num-layers", str(self.last_stage_layers)]
        return f


def _args(m: DSV3, template: argparse.Namespace, optimizer: bool = False) -> argparse.Namespace:
    args = copy.copy(template)
    values = dict(
        tensor_model_parallel_size=m.tp, pipeline_model_parallel_size=m.pp, expert_model_parallel_size=m.ep,
        expert_tensor_parallel_size=1, num_layers=m.num_layers, hidden_size=m.w("hidden"), ffn_hidden_size=m.w("ffn"),
        num_attention_heads=m.w("heads"), num_query_groups=m.w("heads"), kv_channels=m.w("qk"),
        num_experts=m.experts, moe_ffn_hidden_size=m.w("moe_ffn"), moe_shared_expert_intermediate_size=m.w("shared_ffn"),
        moe_router_topk=8, moe_layer_freq=[0] * m.dense_layers + [1] * (m.num_layers - m.dense_layers),
        moe_grouped_gemm=True, moe_router_enable_expert_bias=True, mtp_num_layers=m.mtp_layers or None,
        multi_latent_attention=True, q_lora_rank=m.w("q_lora"), kv_lora_rank=m.w("kv_lora"), qk_head_dim=m.w("qk"),
        qk_pos_emb_head_dim=m.w("rope"), v_head_dim=m.w("v"), normalization="RMSNorm", swiglu=True,
        add_bias_linear=False, untie_embeddings_and_output_weights=True, position_embedding_type="rope",
        padded_vocab_size=m.padded_vocab, vocab_size=m.vocab, seq_length=m.seq, max_position_embeddings=m.seq,
        world_size=m.tp * m.pp * m.ep, data_parallel_size=m.ep, use_distributed_optimizer=optimizer,
        overlap_grad_reduce=optimizer, ddp_bucket_size=None, no_save_optim=None if optimizer else True,
        bf16=m.dtype == "bfloat16", fp16=m.dtype == "float16", params_dtype=getattr(torch, m.dtype),
        virtual_pipeline_model_parallel_size=None, num_layers_per_virtual_pipeline_stage=None,
        decoder_first_pipeline_num_layers=m.first_stage_layers if m.pp > 1 else None,
        decoder_last_pipeline_num_layers=m.last_stage_layers if m.pp > 1 else None,
        transformer_impl="transformer_engine", qk_layernorm=False, group_query_attention=False)
    for k, v in values.items():
        setattr(args, k, v)
    return args


def _layer(m: DSV3, p: str, moe: bool, t: Any, extra: Any) -> dict[str, Any]:
    """One transformer layer's local tensors under prefix ``p`` (TE spec, MLA, a dense MLP or the MoE)."""
    h, tp, heads = m.w("hidden"), m.tp, m.w("heads")
    sd: dict[str, Any] = {
        p + "input_layernorm.weight": t(h), p + "input_layernorm._extra_state": extra(),
        p + "self_attention.core_attention._extra_state": extra(),
        p + "self_attention.linear_proj.weight": t(h, heads * m.w("v") // tp),
        p + "self_attention.linear_proj._extra_state": extra(),
        p + "self_attention.linear_q_down_proj.weight": t(m.w("q_lora"), h),
        p + "self_attention.linear_q_down_proj._extra_state": extra(),
        p + "self_attention.linear_q_up_proj.layer_norm_weight": t(m.w("q_lora")),
        p + "self_attention.linear_q_up_proj.weight": t(heads * (m.w("qk") + m.w("rope")) // tp, m.w("q_lora")),
        p + "self_attention.linear_q_up_proj._extra_state": extra(),
        p + "self_attention.linear_kv_down_proj.weight": t(m.w("kv_lora") + m.w("rope"), h),
        p + "self_attention.linear_kv_down_proj._extra_state": extra(),
        p + "self_attention.linear_kv_up_proj.layer_norm_weight": t(m.w("kv_lora")),
        p + "self_attention.linear_kv_up_proj.weight": t(heads * (m.w("qk") + m.w("v")) // tp, m.w("kv_lora")),
        p + "self_attention.linear_kv_up_proj._extra_state": extra(),
    }
    if not moe:
        sd.update({p + "mlp.linear_fc1.layer_norm_weight": t(h), p + "mlp.linear_fc1.weight": t(2 * m.w("ffn") // tp, h),
                   p + "mlp.linear_fc1._extra_state": extra(), p + "mlp.linear_fc2.weight": t(h, m.w("ffn") // tp),
                   p + "mlp.linear_fc2._extra_state": extra()})
        return sd
    sd.update({p + "pre_mlp_layernorm.weight": t(h), p + "pre_mlp_layernorm._extra_state": extra(),
               p + "mlp.router.weight": t(m.experts, h), p + "mlp.router.expert_bias": t(m.experts)})
    local = m.experts // m.ep
    for j in range(local):
        sd[f"{p}mlp.experts.linear_fc1.weight{j}"] = t(2 * m.w("moe_ffn"), h)
    sd[p + "mlp.experts.linear_fc1._extra_state"] = extra()
    for j in range(local):
        sd[f"{p}mlp.experts.linear_fc2.weight{j}"] = t(h, m.w("moe_ffn"))
    sd[p + "mlp.experts.linear_fc2._extra_state"] = extra()
    sd.update({p + "mlp.shared_experts.linear_fc1.weight": t(2 * m.w("shared_ffn") // tp, h),
               p + "mlp.shared_experts.linear_fc1._extra_state": extra(),
               p + "mlp.shared_experts.linear_fc2.weight": t(h, m.w("shared_ffn") // tp),
               p + "mlp.shared_experts.linear_fc2._extra_state": extra()})
    return sd


def stage_state(m: DSV3, pp: int, hollow: bool) -> dict[str, Any]:
    """The model state dict of one (tp, ep) shard of stage ``pp`` (local layer and expert numbers, as saved)."""
    dtype = getattr(torch, m.dtype)

    def t(*shape: int) -> torch.Tensor:  # (not hollow: values from the shape alone, so replicas agree)
        if hollow:
            return torch.zeros(1, dtype=dtype).expand(*shape)
        n = 1
        for s in shape:
            n *= s
        return (torch.arange(n, dtype=torch.float32) % 13 / 13).to(dtype).reshape(shape)

    def extra() -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    h, tp = m.w("hidden"), m.tp
    stages = m.stage_layers()
    sd: dict[str, Any] = {}
    if pp == 0 or (pp == m.pp - 1 and m.mtp_layers):
        sd["embedding.word_embeddings.weight"] = t(m.padded_vocab // tp, h)
    for i, layer in enumerate(stages[pp]):
        sd.update(_layer(m, f"decoder.layers.{i}.", layer >= m.dense_layers, t, extra))
    if pp == m.pp - 1:
        sd["decoder.final_layernorm.weight"], sd["decoder.final_layernorm._extra_state"] = t(h), extra()
        for d in range(m.mtp_layers):
            p = f"mtp.layers.{d}."
            sd.update({p + "enorm.weight": t(h), p + "enorm._extra_state": extra(), p + "hnorm.weight": t(h),
                       p + "hnorm._extra_state": extra(), p + "eh_proj.weight": t(h // tp, 2 * h),
                       p + "eh_proj._extra_state": extra()})
            sd.update(_layer(m, p + "mtp_model_layer.", True, t, extra))
            sd[p + "final_layernorm.weight"], sd[p + "final_layernorm._extra_state"] = t(h), extra()
        sd["output_layer.weight"], sd["output_layer._extra_state"] = t(m.padded_vocab // tp, h), None
    return sd


def write_legacy(root: str, m: DSV3, *, hollow: bool = True, iteration: int = 1000, optimizer: bool = False) -> int:
    """Write the checkpoint under ``root`` (tracker included, with the distributed optimizer's state when
    ``optimizer``); returns the number of shard dirs."""
    meta = read_torch_file(TEMPLATE)
    template = map_leaves(meta, lambda v, _p: torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, TensorRef) else v)
    args = _args(m, template["args"], optimizer)
    it_dir = os.path.join(root, naming.iteration_dir_name(iteration))
    os.makedirs(it_dir, exist_ok=True)
    names = naming.expected_shards(ParallelLayout(tp=m.tp, pp=m.pp, ep=m.ep, etp=1))
    first: dict[tuple[int, int], str] = {}
    for name, (tp, pp, _ep) in sorted(names.items()):
        d = os.path.join(it_dir, name)
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, naming.MODEL_FILENAME)
        if (tp, pp) in first and hollow:  # (real bytes: every file written, as a reshard's reads would meet them)
            os.link(first[(tp, pp)], path)
            continue
        state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": stage_state(m, pp, hollow),
                 "opt_param_scheduler": template.get("opt_param_scheduler"), "rng_state": template["rng_state"],
                 "num_floating_point_operations_so_far": 0}
        if optimizer:
            state["optimizer"] = read_torch_file(OPTIMIZER_TEMPLATE)["optimizer"]  # the parts' param groups
        torch.save(state, path, pickle_module=pickling)
        first[(tp, pp)] = path
    if optimizer:
        write_dist_optimizer(it_dir, m, hollow)
    with open(os.path.join(root, naming.TRACKER_FILENAME), "w") as fh:
        fh.write(str(iteration))
    return len(names)


def write_dist_optimizer(it_dir: str, m: DSV3, hollow: bool) -> None:
    """Every shard dir's ``distrib_optim.pt``, laid out by megatron-preflight's own model of Megatron's gradient
    buffers (reshard/optimizer/distributed.py, proven on files Megatron-LM wrote; here it only gives the scale run
    files of the right sizes). The data-parallel size equals EP (expert data-parallel size 1): the dense part is
    saved by the EP rank 0 of each (tp, pp), the expert part by every rank. Not hollow: ``param`` holds each
    weight's values at its offset (the fp32 master of the saved weight), ``exp_avg`` / ``exp_avg_sq`` that times
    0.5 / 0.25; hollow: each world tensor a stride-0 view of one zero."""
    from megatron_preflight.reshard import open_index
    from megatron_preflight.reshard.optimizer.distributed import (
        Slot,
        bucket_size,
        buffers_of,
        source_params,
        world_offsets,
    )

    ci = open_index(os.path.dirname(it_dir), iteration=int(os.path.basename(it_dir)[len("iter_"):]))
    layout, src = ci.view, ci.topology
    size = bucket_size(layout.saved_args)
    params = source_params(layout, src)
    coords = naming.expected_shards(ParallelLayout(tp=m.tp, pp=m.pp, ep=m.ep, etp=1))
    written: dict[tuple[int, bool], str] = {}  # (pp, holds the dense part) -> the first file (hollow: linked)
    for shard in layout.shards:
        path = os.path.join(shard.path, naming.DISTRIB_OPTIM_FILENAME)
        _tp, pp, ep = coords[shard.name]
        key = (pp, ep == 0)
        if hollow and key in written:
            os.link(written[key], path)
            continue
        weights = None if hollow else stage_state(m, pp, hollow=False)  # the values the model file holds
        parts: list[Any] = []
        for expert in (False, True):
            if not expert and ep != 0:
                parts.append(None)  # saved by the dense part's data-parallel rank 0 (EP rank 0's dir)
                continue
            state: dict[Any, Any] = {"buckets_coalesced": True}
            for gbuf, (dtype, members) in enumerate(buffers_of(params[shard.name], expert)):
                offsets, buckets = world_offsets([Slot(p.name, p.numel, p.shared_embedding) for p in members], size)
                numel = sum(buckets)
                if hollow:
                    world = {k: torch.zeros(1, dtype=torch.float32).expand(numel)
                             for k in ("param", "exp_avg", "exp_avg_sq")}
                else:
                    master = torch.zeros(numel, dtype=torch.float32)
                    for p in members:
                        w = weights[p.key]
                        master[offsets[p.name]:offsets[p.name] + p.numel] = w.reshape(-1).float()
                    world = {"param": master, "exp_avg": master * 0.5, "exp_avg_sq": master * 0.25}
                state[gbuf] = {(dtype, torch.float32): {**world, "numel_unpadded": numel}}
            parts.append(state)
        torch.save(parts, path, pickle_module=pickling)
        written[key] = path


def dist_flags(flags: list[str], optimizer: bool) -> list[str]:
    """A run's flags with ``--ckpt-format torch_dist`` (and the distributed optimizer, loaded, when ``optimizer``)."""
    out = [f for f in flags if not (optimizer and f == "--no-load-optim")]
    out[out.index("--ckpt-format") + 1] = "torch_dist"
    return out + (["--use-distributed-optimizer", "--overlap-grad-reduce"] if optimizer else [])


def write_torch_dist(root: str, m: DSV3, legacy_root: str, *, iteration: int = 1000, optimizer: bool = False,
                     hollow: bool = True) -> int:
    """The torch_dist form of ``legacy_root`` (written by :func:`write_legacy` for ``m``, with ``optimizer`` when the
    optimizer state is wanted: the distributed optimizer's ``fully_reshardable`` form), as a run at ``m``'s layout
    saves it, through megatron-preflight's own torch_dist writer: every global tensor chunked as Megatron shards it
    (experts one chunk each; layers keyed per layer, as DeepSeek-V3's dense + MoE layers are), ``.metadata``,
    ``common.pt`` and ``metadata.json``. ``hollow``: each chunk placed in the data file of the rank that saves it
    (``__<rank>_0.distcp``: a routed expert's in its EP rank's, a replicated tensor's in turn among its stage's ranks),
    no tensor bytes made or written (sparse data files of the right sizes); else one real data file. Returns the
    number of data files."""
    from megatron_preflight.check.runtime_args import from_cli
    from megatron_preflight.reshard import TargetLayout
    from megatron_preflight.reshard.targets.torch_dist import ChunkWriter
    from megatron_preflight.reshard.targets.torch_dist import write_torch_dist as convert

    rt = from_cli(dist_flags(m.flags(), optimizer))
    it_dir = os.path.join(root, naming.iteration_dir_name(iteration))
    os.makedirs(it_dir, exist_ok=True)
    made: list[ChunkWriter] = []

    def writer(d: str) -> ChunkWriter:
        made.append(_hollow_writer(d, m) if hollow else ChunkWriter(d))
        return made[-1]

    kw = dict(build=_hollow_values) if hollow else {}
    convert(legacy_root, it_dir, TargetLayout.from_args(rt, named=rt.given), keep_optimizer=optimizer, writer=writer,
            **kw)
    with open(os.path.join(root, naming.TRACKER_FILENAME), "w") as fh:
        fh.write(str(iteration))
    return len({it.file for it in made[0].items})


def _saved(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf, pickle_module=pickling)
    return buf.getvalue()


def _hollow_values(tp: Any, _files: Any) -> torch.Tensor:
    return torch.zeros(1, dtype=tp.dtype).expand(tp.shape)


_OPTIMIZER_STATE = re.compile(r"^optimizer\.state\.[^.]+\.")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _hollow_writer(iter_dir: str, m: DSV3) -> Any:
    from megatron_preflight.reshard.targets.stream_save import blob_size
    from megatron_preflight.reshard.targets.torch_dist import ChunkWriter, Item

    assert m.tp == 1, "the hollow torch_dist places chunks for TP1"
    stage_of = {g: s for s, layers in enumerate(m.stage_layers()) for g in layers}
    per_expert_rank = m.experts // m.ep

    class HollowChunks(ChunkWriter):
        """Each chunk in its saving rank's data file; no bytes written (the files are made sparse at close)."""

        def __init__(self) -> None:
            super().__init__(iter_dir)
            self.ends: dict[str, int] = {}  # data file -> its size so far
            self.turn: dict[int, int] = {}  # stage -> the rank within it that saves the next replicated chunk

        def put(self, fqn: str, offsets: tuple[int, ...] | None, value: Any) -> Item:
            name = _OPTIMIZER_STATE.sub("", fqn)
            layer = _LAYER.match(name)
            stage = stage_of[int(layer.group(1))] if layer else 0 if name.startswith("embedding.") else m.pp - 1
            if offsets is not None and ".experts.experts." in name:
                within = offsets[0] // per_expert_rank  # the expert's EP rank
            else:
                within = self.turn.get(stage, 0)
                self.turn[stage] = (within + 1) % m.ep
            rank = stage * m.ep + within
            file = f"__{rank}_0.distcp"
            start = self.ends.get(file, 0)
            if offsets is None:  # an object (extra state, a few hundred bytes): written, as readers open them
                blob = _saved(value)
                with open(os.path.join(iter_dir, file), "ab") as fh:
                    fh.truncate(start)
                    fh.write(blob)
                length = len(blob)
            else:  # (the size the real writer's blob has: nothing made)
                length = blob_size(value.dtype, tuple(value.shape))
            self.ends[file] = start + length
            self.bytes_written += length
            return Item(fqn, offsets, start, length, file)

        def close(self) -> None:
            super().close()
            for file, end in self.ends.items():
                with open(os.path.join(iter_dir, file), "ab") as fh:
                    fh.truncate(end)

    return HollowChunks()

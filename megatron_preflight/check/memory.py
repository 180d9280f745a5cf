"""Will the run's layout fit the device? Per-rank bytes at job start, before anything is allocated.

* **Parameters, gradients, optimizer state: exact** (up to the DDP buckets' alignment padding), from the resharder's
  plan of every rank of the run's layout (which tensors, which shapes: TP/ETP splits, uneven pipeline stages, the
  tied head on the last stage, the experts of each EP rank) and the run's dtypes: parameters in the run's dtype;
  gradients in fp32 when ``--accumulate-allreduce-grads-in-fp32`` (Megatron's default for bf16) or fp32 params, else
  in the params' dtype; Adam's ``exp_avg`` and ``exp_avg_sq`` in fp32 plus an fp32 master for a half-precision
  parameter, divided over the data-parallel group with ``--use-distributed-optimizer`` (the expert-data-parallel group
  for expert parameters; with context parallelism, DP x CP): the group's total is exact, each rank's share is that total / the group size rounded up
  (which rank holds a bucket's alignment padding moves a few elements between ranks).
* **Activations: an estimate** for the first pipeline stage (the one that holds the most microbatches in flight),
  Korthikanti et al. 2022 (the formula of Megatron's own theoretical-memory report): per layer and microbatch
  ``s·b·h·(18 + 4·ffn/h)`` bytes, the MLP term with ``topk × moe_ffn`` for MoE layers (tokens go to ``topk`` experts:
  assumes balanced routing, no capacity factor); plus ``5·a·s²·b`` for an unfused attention (the local spec without
  recompute); with ``--recompute-granularity full`` only ``2·s·b·h`` per layer plus one layer's worth; times the
  microbatches in flight (``pp``, capped by the microbatch count; the interleaved schedule's penalty with VPP); divided
  by TP (sequence parallelism assumed; without it the layer norms' and dropouts' part is not divided — under-estimated);
  context parallelism divides ``s``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from megatron_preflight import parallel, reshard  # reshard: its modules load on first use (a lazy package)
from megatron_preflight.check.findings import Finding, Severity
from megatron_preflight.check.runtime_args import RuntimeArgs
from megatron_preflight.errors import PreflightError
from megatron_preflight.layout import naming, optimizer_kinds
from megatron_preflight.layout.model import Format
from megatron_preflight.units import human_bytes

FATAL, INFO = Severity.FATAL, Severity.INFO
GIB = 1 << 30


@dataclass
class RankMemory:
    """One rank's predicted bytes."""

    shard: str
    params: int
    grads: int
    optimizer: int  # per rank (the distributed optimizer: the group's bytes / its size, rounded up)
    activations: int
    optimizer_group: int = 0  # the distributed optimizer: the state of this dir's parameters, held once over the
    # ranks that share them (its data-parallel group), exact

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations

    def to_json(self) -> dict[str, Any]:
        return {"shard": self.shard, "params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "optimizer_group": self.optimizer_group, "activations_estimate": self.activations, "total": self.total}


def element_bytes(rt: RuntimeArgs) -> tuple[int, int, int]:
    """(param, grad, optimizer bytes per element) of the run."""
    half = rt.bf16 or rt.fp16
    param = 2 if half else 4
    grad_fp32 = rt.accumulate_allreduce_grads_in_fp32 or rt.bf16  # Megatron turns it on for bf16
    grad = 4 if (not half or grad_fp32) else 2
    optim = optimizer_kinds.KINDS["adam"].state_bytes + (optimizer_kinds.MASTER_BYTES if half else 0)
    return param, grad, optim


def run_kinds(rt: RuntimeArgs) -> tuple[optimizer_kinds.Kind, optimizer_kinds.Kind]:
    """The run's optimizer and the scalar one it hands non-matrix tensors to (layout/optimizer_kinds.py); Adam for a
    kind the table does not know (the check names it)."""

    def kind(name: str) -> optimizer_kinds.Kind:
        try:
            return optimizer_kinds.kind_named(name)
        except PreflightError:
            return optimizer_kinds.KINDS["adam"]

    primary = kind(rt.optimizer)
    return primary, kind(rt.muon_scalar_optimizer if primary.honours_use_muon else "adam")


def state_bytes(kinds: tuple[optimizer_kinds.Kind, optimizer_kinds.Kind], key: str, shape: tuple[int, ...],
                adam_bytes: int) -> int:
    """The optimizer state bytes of one parameter shard under the run's ``kinds`` (:func:`run_kinds`): its kind's fp32
    fields per element (an emerging optimizer hands the non-matrix tensors to its scalar one), the fp32 master of a
    half-precision run, and SOAP's per-shard preconditioners (L, R and their eigenbases: two m x m and two n x n fp32
    matrices). ``adam_bytes``: Adam's per element (:func:`element_bytes`)."""
    primary, scalar = kinds
    kind = scalar if optimizer_kinds.goes_to_scalar(key, shape, primary) else primary
    n = math.prod(shape)
    master = adam_bytes - optimizer_kinds.KINDS["adam"].state_bytes  # 4 in a bf16/fp16 run, else 0
    local = 8 * (shape[0] ** 2 + shape[1] ** 2) if kind.has_local and len(shape) == 2 else 0
    return n * (kind.state_bytes + master) + local


def activation_estimate(rt: RuntimeArgs, layers_on_stage: int, moe_layers: int, num_microbatches: int | None,
                        layout: parallel.ParallelLayout | None = None, padded_vocab: int | None = None) -> int:
    """Bytes of activations on the first pipeline stage (see the module doc for the formula and its assumptions), at
    the run's layout or at ``layout`` (its TP, PP, VPP and CP, with ``padded_vocab`` rows)."""
    tp, pp, vpp, cp = (rt.tp, rt.pp, rt.vpp, rt.cp) if layout is None else (layout.tp, layout.pp, layout.vpp, layout.cp)
    s = (rt.seq_length or 0) // max(cp, 1)
    b = rt.micro_batch_size or 1
    h = rt.hidden_size or 0
    if not (s and h):
        return 0
    ffn = rt.ffn_hidden_size or 4 * h
    moe_ffn = (rt.moe_ffn_hidden_size or ffn) * (rt.moe_router_topk or 1)
    dense_layer = s * b * h * (18 + 4 * ffn / h)
    moe_layer = s * b * h * (18 + 4 * moe_ffn / h)
    if rt.transformer_impl == "local" and rt.recompute_granularity != "selective":
        extra = 5 * (rt.num_attention_heads or 1) * s * s * b  # unfused softmax / dropout of attention scores
        dense_layer += extra
        moe_layer += extra
    per_mb = dense_layer * (layers_on_stage - moe_layers) + moe_layer * moe_layers
    if rt.recompute_granularity == "full":
        per_mb = 2 * s * b * h * layers_on_stage + max(dense_layer, moe_layer if moe_layers else 0)
    per_mb += s * b * h + 8 * s * b  # embedding output (dropout) and input ids
    in_flight = pp if num_microbatches is None else max(1, min(pp, num_microbatches))
    if vpp:
        in_flight = math.ceil((1 + (pp - 1) / (pp * vpp)) * pp)
    total = per_mb * in_flight
    if pp == 1:
        vocab = rt.padded_vocab_size if padded_vocab is None else padded_vocab
        total += s * b * h * 4 * (1 + (vocab or 0) / h)  # output layer and the loss
    return int(total / tp)


def predict(index: reshard.CheckpointIndex, rt: RuntimeArgs) -> list[RankMemory]:
    """Every distinct rank of the run's layout (one per shard dir: dp ranks hold the same), predicted; above
    ``reshard.SAMPLE_ABOVE`` dirs, the representative ones (``reshard.representative_ranks``: the largest is among
    them)."""
    # the run's layout, every size the run's (a size not given is Megatron's default, not the checkpoint's); the
    # tensors as the checkpoint names them (a spec change renames, it does not resize)
    target = dataclasses.replace(reshard.TargetLayout.from_args(rt), transformer_impl=None, moe_grouped_gemm=None,
                                 optimizer_family=None, ckpt_format=None)
    r = reshard.open_resharder(index, target, keep_optimizer=False)
    p_bytes, g_bytes, o_bytes = element_bytes(rt)
    kinds = run_kinds(rt)
    tgt = r.tgt
    world = rt.world_size or tgt.min_world()
    dp = max(1, world // (tgt.tp * tgt.pp * rt.cp))  # (the target's CP is 1: CP does not shard weights)
    dp_cp = max(1, world // (tgt.tp * tgt.pp))  # the distributed optimizer's domain: DP x CP
    edp = max(1, world // (tgt.etp_eff * tgt.ep * tgt.pp))
    gbs, mbs = rt.global_batch_size, rt.micro_batch_size or 1
    microbatches = gbs // (mbs * dp) if gbs else None
    out = []
    writers = naming.shard_writers(tgt)
    if len(writers) > reshard.SAMPLE_ABOVE:  # (the ranks whose memory stands for all: every stage's first and last TP
        keep = set(reshard.representative_ranks(tgt))  # rank; those between hold as much; 1,024 dirs planned: 20 s)
        writers = {n: c for n, c in writers.items() if n in keep}
    for name, coords in writers.items():
        plan = r.plan_for_coords(coords, name)
        dense = expert = dense_state = expert_state = 0
        for tp in plan.tensors:
            if tp.shape is None or tp.key.endswith("_extra_state") or tp.key.endswith("expert_bias"):
                continue
            n = math.prod(tp.shape)
            state = state_bytes(kinds, tp.key, tp.shape, o_bytes)
            if tp.gkey is not None and tp.gkey.expert is not None:
                expert, expert_state = expert + n, expert_state + state
            else:
                dense, dense_state = dense + n, dense_state + state
        numel = dense + expert
        optimizer = dense_state + expert_state if not rt.use_distributed_optimizer else \
            math.ceil(dense_state / dp_cp) + math.ceil(expert_state / edp)
        layers = {tp.gkey.layer for tp in plan.tensors if tp.gkey is not None and tp.gkey.layer is not None}
        moe_layers = {tp.gkey.layer for tp in plan.tensors if tp.gkey is not None and tp.gkey.expert is not None
                      and tp.gkey.layer is not None}  # (decoder layers: an MTP layer is not counted in either)
        acts = activation_estimate(rt, len(layers), len(moe_layers), microbatches) if coords["pp"] == 0 else 0
        group = dense_state + expert_state if rt.use_distributed_optimizer else 0  # once over the ranks sharing it
        out.append(RankMemory(name, numel * p_bytes, numel * g_bytes, optimizer, acts, group))
    return out


def memory_findings(index: reshard.CheckpointIndex, rt: RuntimeArgs) -> tuple[list[Finding], list[RankMemory]]:
    """The largest rank's bytes against the device (``--preflight-device-memory`` GiB, or the hook's device): fatal
    above it, a warning above 90 %; the breakdown always."""
    asked = "preflight_device_memory" in rt.given
    # (a legacy checkpoint's and an HF model's tensors are known from the headers already read; plan predicts alike)
    if index.layout.format not in (Format.TORCH, Format.HF) and "tensors" not in vars(index) and not asked:
        # a torch_dist verdict needs no tensor index: building one only for this would add to every job start
        fmt = index.layout.format.value if index.layout.format else "distributed"
        return [Finding("memory", None, None, INFO, f"memory not predicted for this {fmt} checkpoint",
                        "pass --preflight-device-memory GIB to have it predicted and checked (it indexes the "
                        "checkpoint's metadata)")], []
    if index.layout.sampled:
        return [Finding("memory", None, None, INFO, "memory not predicted: the shards were sampled (a large "
                        "checkpoint); --all-shards predicts it", "")], []
    try:
        ranks = predict(index, rt)
    except Exception as exc:  # noqa: BLE001 - a prediction is advice: it never blocks a verdict by itself
        return [Finding("memory", None, None, INFO, f"memory not predicted ({exc})", "")], []
    if not ranks:
        return [], []
    worst = max(ranks, key=lambda m: m.total)
    cap = rt.preflight_device_memory
    text = (f"the largest rank ({worst.shard}): parameters {human_bytes(worst.params)}, gradients {human_bytes(worst.grads)}, "
            f"optimizer state {human_bytes(worst.optimizer)} (exact), activations {human_bytes(worst.activations)} (an estimate: "
            f"see check/memory.py), total {human_bytes(worst.total)}")
    if cap is None:
        return [Finding("memory", None, human_bytes(worst.total), INFO, text,
                        "pass --preflight-device-memory GIB to have it checked against the device")], ranks
    capacity = cap * GIB
    if worst.total > capacity:
        return [Finding("memory", f"{cap:g} GiB device", human_bytes(worst.total), FATAL,
                        f"the run's layout does not fit the device: {text}; Megatron would fail with an out-of-memory "
                        "error after the model, the optimizer and the checkpoint are loaded",
                        "more model parallelism (TP/PP/EP), --use-distributed-optimizer, --recompute-granularity "
                        "full or a smaller --micro-batch-size")], ranks
    if worst.total > 0.9 * capacity:
        return [Finding("memory", f"{cap:g} GiB device", human_bytes(worst.total), INFO,
                        f"warning: within 10 % of the device: {text}", "")], ranks
    return [Finding("memory", f"{cap:g} GiB device", human_bytes(worst.total), INFO, text, "")], ranks

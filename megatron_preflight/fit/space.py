"""Every parallel layout Megatron accepts for a model on N ranks.

A layout here is TP, CP, PP (with its stage split), VPP, EP and ETP; DP is what is left. Megatron's rules, each
applied as ``validate_args`` / ``initialize_model_parallel`` / the model's constructors apply it:

* the dense grid TP·CP·PP and the expert grid ETP·EP·PP each divide the world size (the rest is DP / expert DP);
* TP divides the attention heads, the query groups, the ffn size and every tensor split over TP (the profile's
  split lengths: Mamba and gated-delta-net sections, MLA heads, vocab padding follows TP); TP at most the GPUs of a node
  (tensor parallelism stays inside a node: its all-reduces run every layer);
* CP: the sequence length is a multiple of 2·CP (Megatron's load balancing splits it in 2·CP chunks), and CP1 with
  ``--transformer-impl local`` (its attention asserts "Context parallelism is only supported by
  TEDotProductAttention");
* PP at most the layer count: an even split when PP divides the layers (counting the embedding / loss as layers when
  the run accounts them), else the most balanced uneven split (``--decoder-first/last-pipeline-num-layers``, the
  middle stages even: the smallest largest stage, then the smallest spread, then the smallest last stage, which holds
  the loss); a HybridModel only evenly;
* VPP only when the run asks for it (its layers per virtual stage must divide each stage);
* EP divides the experts; ETP is 1 or TP (what Megatron's recipes use), divides the expert ffn size and every
  expert tensor split over it, and is 1 when the experts have biases;
* the global batch is a multiple of micro-batch × DP;
* a Megatron-FSDP run (``--use-megatron-fsdp``): PP1 only (Megatron-LM main cannot wrap a pipelined model in it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from megatron_preflight.check.runtime_args import RuntimeArgs
from megatron_preflight.errors import PreflightError
from megatron_preflight.fit.profile import ModelProfile
from megatron_preflight.parallel import ParallelLayout, fit_problems, repipe


@dataclass(frozen=True)
class Split:
    """How the decoder layers sit over PP stages: even (with the embedding / loss accounted when the run does), or
    uneven first / last stages."""

    first: int | None = None
    last: int | None = None
    embedding_in_split: bool = False
    loss_in_split: bool = False


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (trial division up to its square root: a world of 10^9 ranks is 31,623
    steps, not 10^9)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def stage_split(layers: int, pp: int, rt: RuntimeArgs, *, hybrid: bool) -> Split | None:
    """The stage split of ``layers`` decoder layers over ``pp`` stages (see the module doc), or None."""
    if pp == 1:
        return Split()
    if pp > layers:
        return None
    emb, loss = rt.account_for_embedding_in_pipeline_split, rt.account_for_loss_in_pipeline_split
    if (layers + emb + loss) % pp == 0:
        return Split(embedding_in_split=emb, loss_in_split=loss)
    if hybrid:
        return None
    best: tuple[tuple[int, int, int], Split] | None = None
    for first in range(1, layers + 1):
        for last in range(0, layers + 1 - first):
            middle = pp - 1 - (last > 0)
            rest = layers - first - last
            if middle <= 0 or rest <= 0 or rest % middle:
                continue
            counts = [first, *[rest // middle] * middle, *([last] if last else [])]
            # the smallest largest stage, then the most even, then the smallest last stage (it holds the loss)
            score = (max(counts), max(counts) - min(counts), counts[-1])
            if best is None or score < best[0]:
                best = (score, Split(first, last or None))
    return best[1] if best else None


def sequence_ok(rt: RuntimeArgs, cp: int) -> bool:
    return cp == 1 or not rt.seq_length or rt.seq_length % (2 * cp) == 0


def layouts(profile: ModelProfile, rt: RuntimeArgs, world: int, gpus_per_node: int) -> Iterator[ParallelLayout]:
    """Every layout of ``world`` ranks Megatron accepts for the model (see the module doc), as ParallelLayouts with
    the model's layer and expert counts."""
    src = profile.source
    layers, experts = profile.num_layers, src.num_experts or 0
    tp_gcd, etp_gcd = profile.tp_gcd(), profile.etp_gcd()
    bias = rt.add_bias_linear
    hybrid = src.hybrid_pattern is not None
    of_world = divisors(world)  # every size below divides the world: its divisors, found once

    def sizes(n: int) -> list[int]:
        return [d for d in of_world if d <= n and n % d == 0]

    splits = {pp: stage_split(layers, pp, rt, hybrid=hybrid) for pp in of_world if pp <= max(layers, 1)}
    per_virtual = rt.num_layers_per_virtual_pipeline_stage
    for tp in divisors(min(world, gpus_per_node)):
        if world % tp or (tp_gcd and tp_gcd % tp):
            continue
        # heads, query groups, ffn, sections (TP alone: the expert rules are asked of each EP / ETP below)
        if fit_problems(ParallelLayout(tp=tp, etp=1), rt, training=False):
            continue
        for cp in sizes(world // tp):
            if not sequence_ok(rt, cp) or (cp > 1 and rt.transformer_impl == "local"):
                continue  # (the local spec's attention asserts CP1: "only supported by TEDotProductAttention")
            for pp in sizes(world // (tp * cp)):
                if pp > 1 and rt.use_megatron_fsdp:  # (Megatron-FSDP does not build with PP: check/fsdp.py)
                    continue
                split = splits.get(pp)
                if split is None:
                    continue
                vpps: list[int | None] = [None]
                if per_virtual and pp > 1 and split.first is None:
                    per_stage = (layers + split.embedding_in_split + split.loss_in_split) // pp
                    if per_stage % per_virtual == 0 and per_stage // per_virtual > 1:
                        vpps = [per_stage // per_virtual]
                for vpp in vpps:
                    pattern = _pattern(src, pp, vpp)
                    if hybrid and pattern is None:
                        continue
                    base = ParallelLayout(tp=tp, pp=pp, cp=cp, vpp=vpp, num_layers=layers,
                                          num_experts=experts or None, first_stage_layers=split.first,
                                          last_stage_layers=split.last, embedding_in_split=split.embedding_in_split,
                                          loss_in_split=split.loss_in_split, hybrid_pattern=pattern)
                    if not experts:
                        yield base
                        continue
                    for ep in divisors(experts):
                        for etp in sorted({1, tp}):
                            if (world // pp) % (etp * ep) or (etp > 1 and bias) or (etp_gcd and etp_gcd % etp):
                                continue
                            cand = dataclasses.replace(base, ep=ep, etp=etp)
                            if fit_problems(cand, rt):
                                continue
                            yield cand


def _pattern(src: ParallelLayout, pp: int, vpp: int | None) -> str | None:
    """A HybridModel's layer pattern cut into ``pp`` × ``vpp`` pipeline segments (None: not a HybridModel, or it
    does not cut evenly)."""
    if src.hybrid_pattern is None:
        return None
    try:
        return repipe(src.hybrid_pattern, None, pp, vpp, keep=False)
    except PreflightError:
        return None


def batch_ok(rt: RuntimeArgs, layout: ParallelLayout, world: int) -> bool:
    """The global batch divides into micro-batches over the layout's data-parallel ranks."""
    dp = world // (layout.tp * layout.pp * layout.cp)
    gbs, mbs = rt.global_batch_size, rt.micro_batch_size or 1
    return not gbs or gbs % (mbs * dp) == 0

"""One rank's bytes at any layout from the model profile: ``check``'s memory prediction
(:mod:`megatron_preflight.check.memory`: the same dtypes, optimizer sharding and activation estimate), without
planning a rank."""

from __future__ import annotations

import math
from typing import Any

from megatron_preflight import reshard  # its modules load on first use (a lazy package)
from megatron_preflight.check.memory import RankMemory, activation_estimate, element_bytes
from megatron_preflight.check.runtime_args import RuntimeArgs
from megatron_preflight.errors import PreflightError
from megatron_preflight.fit.profile import ModelProfile
from megatron_preflight.layout import naming
from megatron_preflight.parallel import VOCAB_DIVISOR, ParallelLayout, pad_vocab


def vocab_rows(profile: ModelProfile, view: Any, tgt: ParallelLayout, rt: RuntimeArgs) -> tuple[int, bool]:
    """(the padded vocabulary rows at ``tgt``, whether exact): Megatron's padding of the true vocab size at ``tgt``'s
    TP (a run's padded size is derived from it, never given); when the
    checkpoint does not record it and ``tgt``'s TP does not keep the saved padding, the saved rows padded again (an
    upper bound: the run's --vocab-size makes it exact)."""
    if not profile.padded_vocab:
        return 0, True
    try:
        plan = reshard.target_vocab(view, tgt, None, rt.vocab_size, rt.make_vocab_size_divisible_by, profile.padded_vocab)
        return plan.target_padded, True
    except PreflightError:
        return pad_vocab(profile.padded_vocab, rt.make_vocab_size_divisible_by or VOCAB_DIVISOR, tgt.tp), False


def stage_memory(profile: ModelProfile, tgt: ParallelLayout, rt: RuntimeArgs, world: int, rows: int
                 ) -> list[RankMemory]:
    """One rank of each pipeline stage of ``tgt`` on ``world`` ranks: parameters, gradients, optimizer state (exact)
    and, on the first stage, the activation estimate."""
    p_bytes, g_bytes, o_bytes = element_bytes(rt)
    dp = max(1, world // (tgt.tp * tgt.pp * tgt.cp))
    dp_cp = max(1, world // (tgt.tp * tgt.pp))  # the distributed optimizer shards over DP x CP
    edp = max(1, world // (tgt.etp_eff * tgt.ep * tgt.pp))
    gbs, mbs = rt.global_batch_size, rt.micro_batch_size or 1
    microbatches = gbs // (mbs * dp) if gbs else None
    out = []
    for stage, (dense, expert) in enumerate(profile.stage_numel(tgt, rows)):
        numel = dense + expert
        if rt.use_distributed_optimizer:
            optimizer = math.ceil(dense * o_bytes / dp_cp) + math.ceil(expert * o_bytes / edp)
        else:
            optimizer = numel * o_bytes
        acts = 0
        if stage == 0:
            layers, moe = profile.layers_on_first_stage(tgt)
            acts = activation_estimate(rt, layers, moe, microbatches, tgt, rows or None)
        name = naming.shard_dir_name(0, stage, 0, pp_size=tgt.pp, ep_size=tgt.ep)
        group = numel * o_bytes if rt.use_distributed_optimizer else 0
        out.append(RankMemory(name, numel * p_bytes, numel * g_bytes, optimizer, acts, group))
    return out

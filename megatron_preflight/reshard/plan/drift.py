"""Replicas Megatron lets drift: parameters kept whole on every TP rank whose gradient Megatron does not reduce over
the TP group, so their copies differ after the first step in every such run — by Megatron's design, not damage.

The one table of them (:data:`DRIFTS`), read from megatron-core's modules and ``finalize_model_grads`` (0.13 to main):
it reduces over TP only the grads of sequence-parallel parameters, q/k layernorms and parameters marked
``average_gradients_across_tp_domain``. Everything else kept whole on each TP rank either gets identical grads on every
rank (its input and output gradient are the full, reduced tensors) or is listed here. For a listed tensor the resharder
takes TP rank 0's copy, the one Megatron's own torch_dist save keeps (replica id 0), and says so with the drift it
measured; every other replicated tensor whose copies disagree stays an error naming the files.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_preflight import parallel
from megatron_preflight.reshard.plan.types import TensorPlan


@dataclass(frozen=True)
class Drift:
    """Tensors (by their name after the layer prefix) whose TP copies Megatron lets differ, when ``applies`` to the
    checkpoint's saved args; ``why``: Megatron's reason, in a user's words."""

    suffix: re.Pattern[str]
    applies: Callable[[Any], bool]
    why: str


def _tp(args: Any) -> int:
    value = getattr(args, "tensor_model_parallel_size", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) else 1  # a bad value: the layout's problem


def _gdn(args: Any) -> bool:
    """With --sequence-parallel the norms' gradients are reduced over TP (measured: a TP2 GDN checkpoint trained with
    it has equal copies, one trained without differs by 3e-4 after two steps)."""
    pattern = parallel.hybrid_pattern(args)
    return _tp(args) > 1 and pattern is not None and "G" in pattern and \
        not getattr(args, "sequence_parallel", False)


def _mla_without_sp(args: Any) -> bool:
    return bool(getattr(args, "multi_latent_attention", False)) and _tp(args) > 1 and \
        not getattr(args, "sequence_parallel", False)


DRIFTS: tuple[Drift, ...] = (
    Drift(re.compile(r"(^|\.)self_attention\.out_norm\.weight$"), _gdn,
          "a gated delta net's out_norm normalises each TP rank's own heads and, without --sequence-parallel, Megatron "
          "does not reduce its gradient over TP (finalize_model_grads reduces only sequence-parallel, q/k-layernorm "
          "and average_gradients_across_tp_domain parameters)"),
    Drift(re.compile(r".*"), _mla_without_sp,
          "a multi-latent-attention model trained at TP > 1 without --sequence-parallel: Megatron does not reduce the "
          "gradients of MLA's duplicated down projections over TP, so every parameter kept whole on each TP rank "
          "drifts apart as it trains"),
)


def drift_cause(suffix: str, saved_args: Any) -> str | None:
    """Why Megatron lets the TP copies of the tensor named ``suffix`` differ in this checkpoint, or None."""
    if saved_args is None:
        return None
    for d in DRIFTS:
        if d.suffix.search(suffix) and d.applies(saved_args):
            return d.why
    return None


def causes(saved_args: Any) -> list[str]:
    """Every reason in :data:`DRIFTS` that applies to this checkpoint (for ``check``: metadata only)."""
    return [d.why for d in DRIFTS if saved_args is not None and d.applies(saved_args)]


def key_of(tp: TensorPlan) -> str:
    """The name :data:`DRIFTS` matches for a planned tensor (an optimizer state: its parameter's)."""
    gkey = tp.gkey or (tp.param.gkey if tp.param is not None else None)
    return gkey.suffix if gkey is not None else tp.key

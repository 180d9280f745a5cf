"""Rank 0 decides, every rank acts on the same decision (one reader, no rank left waiting)."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def _dist():
    try:
        import torch.distributed as dist  # deferred: torch only in a distributed run
    except ImportError:  # pragma: no cover
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    d = _dist()
    return d.get_rank() if d else 0


def world_size() -> int:
    d = _dist()
    return d.get_world_size() if d else 1


def decide_on_rank0(compute: Callable[[], Any], on_error: Callable[[BaseException], Any]) -> Any:
    """Run ``compute`` on rank 0 only and broadcast its result to every rank.

    Any exception on rank 0 is turned into a result by ``on_error`` *before* the broadcast, so the other ranks always
    receive a decision and never block on a collective that rank 0 will not enter.
    """
    d = _dist()
    result: Any = None
    if d is None or d.get_rank() == 0:
        try:
            result = compute()
        except BaseException as exc:  # noqa: BLE001 - every failure must become a decision
            log.debug("preflight decision failed on rank 0:\n%s", traceback.format_exc())
            result = on_error(exc)
    if d is None:
        return result
    box = [result]
    device = None
    try:
        import torch  # deferred: torch only where tensors are made (metadata paths run without it)

        if d.get_backend() == "nccl" and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
    except Exception:  # pragma: no cover - backend query is best effort
        device = None
    d.broadcast_object_list(box, src=0, device=device)
    return box[0]


def gather_to_rank0(obj: Any) -> list[Any] | None:
    """Every rank's ``obj``, on rank 0 (None on the others). Collective."""
    d = _dist()
    if d is None:
        return [obj]
    out = [None] * d.get_world_size() if d.get_rank() == 0 else None
    d.gather_object(obj, out, dst=0)
    return out


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, on every rank. Collective."""
    d = _dist()
    if d is None:
        return [obj]
    out: list[Any] = [None] * d.get_world_size()
    d.all_gather_object(out, obj)
    return out

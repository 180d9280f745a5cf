"""The one place that knows Megatron's checkpoint naming: trackers, iteration dirs, per-rank shard dirs, and which
(tp, pp, ep) shard dirs a legacy save writes.

Facts (Megatron-LM ``checkpointing.get_checkpoint_name`` / ``parallel_state.RankGenerator``):

* tracker ``latest_checkpointed_iteration.txt`` holds an integer or ``release``; iteration dirs are ``iter_%07d`` or
  ``release``;
* a rank dir is ``mp_rank_{tp:02d}``, then ``_{pp:03d}`` if PP > 1, then ``_{ep:03d}`` if EP > 1 — so a two-index
  name is (tp, pp) or (tp, ep) and only the saved args (or the keys) say which;
* ranks are laid out by an order string (``tp-cp-ep-dp-pp`` by default, ``tp-cp-ep-pp-dp`` with
  ``--use-tp-pp-dp-mapping``) over two grids: dense TP×CP×DP×PP and expert ETP×EP×EDP×PP. A rank writes its
  shard when its dense DP rank or its expert-DP rank is 0, so with ETP·EP ≤ TP only some (tp, ep) pairs have a dir.
"""

from __future__ import annotations

import functools
import re

from megatron_preflight.parallel import ParallelLayout

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
MODEL_FILENAME = "model_optim_rng.pt"
DISTRIB_OPTIM_FILENAME = "distrib_optim.pt"
RELEASE = "release"

_ITER_RE = re.compile(r"^iter_(\d{7,})$")
_SHARD_RE = re.compile(r"^mp_rank_(\d{2,})(?:_(\d{3,}))?(?:_(\d{3,}))?$")


def iteration_dir_name(iteration: int | str) -> str:
    """``iter_0000007`` or ``release``."""
    return RELEASE if iteration == RELEASE else f"iter_{int(iteration):07d}"


def parse_iteration_dir(name: str) -> int | str | None:
    """The iteration an ``iter_%07d`` / ``release`` dir name stands for, else None."""
    if name == RELEASE:
        return RELEASE
    m = _ITER_RE.match(name)
    return int(m.group(1)) if m else None


def parse_tracker(text: str) -> int | str | None:
    """The tracker's iteration (int or ``release``), or None if the text is neither."""
    text = text.strip()
    if text == RELEASE:
        return RELEASE
    try:
        return int(text)
    except ValueError:
        return None


def shard_dir_name(tp: int, pp: int, ep: int, *, pp_size: int, ep_size: int) -> str:
    """The per-rank dir name Megatron writes for (tp, pp, ep) under PP and EP sizes."""
    name = f"mp_rank_{tp:02d}"
    if pp_size > 1:
        name += f"_{pp:03d}"
    if ep_size > 1:
        name += f"_{ep:03d}"
    return name


def parse_shard_dir_name(name: str) -> tuple[int, ...] | None:
    """The integer indices in an ``mp_rank_*`` name (1, 2 or 3 of them), or None if it is not one."""
    m = _SHARD_RE.match(name)
    if not m:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


def assign_shard_indices(indices: tuple[int, ...], *, pp_size: int, ep_size: int) -> tuple[int, int, int] | None:
    """(tp, pp, ep) for the indices of a dir name, given which of PP / EP is > 1; None if the count disagrees."""
    expected = 1 + (pp_size > 1) + (ep_size > 1)
    if len(indices) != expected:
        return None
    tp = indices[0]
    rest = list(indices[1:])
    pp = rest.pop(0) if pp_size > 1 else 0
    ep = rest.pop(0) if ep_size > 1 else 0
    return tp, pp, ep


def name_pattern(*, pp_size: int, ep_size: int) -> str:
    """The shard-name pattern for a layout, e.g. ``mp_rank_{tp:02d}_{ep:03d}``."""
    pattern = "mp_rank_{tp:02d}"
    if pp_size > 1:
        pattern += "_{pp:03d}"
    if ep_size > 1:
        pattern += "_{ep:03d}"
    return pattern


def dims_class(*, pp_size: int, ep_size: int) -> str:
    """1D (TP only), 2D (TP×PP) or 3D (any EP > 1: EP decides, even with PP = 1)."""
    if ep_size > 1:
        return "3D"
    if pp_size > 1:
        return "2D"
    return "1D"


def _decompose(rank: int, order: list[str], sizes: dict[str, int]) -> dict[str, int]:
    coords = {}
    stride = 1
    for dim in order:
        size = sizes[dim]
        coords[dim] = (rank // stride) % size
        stride *= size
    return coords


def rank_coordinates(rank: int, world: int, sizes: ParallelLayout) -> dict[str, int]:
    """Dense and expert coordinates of ``rank`` (Megatron's RankGenerator, both grids, same order string)."""
    order = [d for d in sizes.order.split("-") if d]
    dp = world // (sizes.tp * sizes.cp * sizes.pp)
    edp = world // (sizes.etp_eff * sizes.ep * sizes.pp)
    dense = _decompose(rank, order, {"tp": sizes.tp, "cp": sizes.cp, "ep": 1, "dp": dp, "pp": sizes.pp})
    expert = _decompose(rank, order, {"tp": sizes.etp_eff, "cp": 1, "ep": sizes.ep, "dp": edp, "pp": sizes.pp})
    return {
        "tp": dense["tp"], "cp": dense["cp"], "dp": dense["dp"], "pp": dense["pp"],
        "etp": expert["tp"], "ep": expert["ep"], "edp": expert["dp"],
    }


def shard_writers(sizes: ParallelLayout, world: int | None = None) -> dict[str, dict[str, int]]:
    """Shard dir name -> the coordinates (tp, pp, ep, etp, ...) of the first rank that writes it, for every dir a
    legacy save at ``sizes`` writes (ranks with dp == 0 or edp == 0).

    The set does not depend on the data-parallel size, so ``world`` defaults to the smallest valid one. (Worked out
    once per layout: a fresh copy for each caller.)
    """
    return {name: dict(c) for name, c in _shard_writers(sizes, world or sizes.min_world())}


@functools.lru_cache(maxsize=64)
def _shard_writers(sizes: ParallelLayout, world: int) -> tuple[tuple[str, tuple[tuple[str, int], ...]], ...]:
    out: dict[str, dict[str, int]] = {}
    for rank in range(world):
        c = rank_coordinates(rank, world, sizes)
        if c["dp"] == 0 or c["edp"] == 0:
            out.setdefault(shard_dir_name(c["tp"], c["pp"], c["ep"], pp_size=sizes.pp, ep_size=sizes.ep), c)
    return tuple((name, tuple(c.items())) for name, c in sorted(out.items()))


def expected_shards(sizes: ParallelLayout, world: int | None = None) -> dict[str, tuple[int, int, int]]:
    """Shard dir name -> (tp, pp, ep) for every dir a legacy save at ``sizes`` writes."""
    return {name: (c["tp"], c["pp"], c["ep"]) for name, c in shard_writers(sizes, world).items()}


def shard_for_rank(rank: int, world: int, sizes: ParallelLayout) -> tuple[str, dict[str, int]]:
    """The shard dir a runtime rank reads (by Megatron's rule: its own tp, pp, ep ranks) and its coordinates."""
    c = rank_coordinates(rank, world, sizes)
    return shard_dir_name(c["tp"], c["pp"], c["ep"], pp_size=sizes.pp, ep_size=sizes.ep), c

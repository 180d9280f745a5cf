import pytest

from megatron_preflight.layout import naming
from megatron_preflight.layout.naming import expected_shards
from megatron_preflight.parallel import ParallelLayout


def test_names_follow_megatron_rule():
    assert naming.shard_dir_name(1, 0, 0, pp_size=1, ep_size=1) == "mp_rank_01"
    assert naming.shard_dir_name(1, 1, 0, pp_size=2, ep_size=1) == "mp_rank_01_001"
    assert naming.shard_dir_name(1, 0, 1, pp_size=1, ep_size=2) == "mp_rank_01_001"  # same name, EP meaning
    assert naming.shard_dir_name(0, 1, 1, pp_size=2, ep_size=2) == "mp_rank_00_001_001"


def test_parse_and_assign():
    assert naming.parse_shard_dir_name("mp_rank_03_001") == (3, 1)
    assert naming.parse_shard_dir_name("mp_rank_3") is None
    assert naming.parse_shard_dir_name("mp_rank_00_model_states.pt") is None
    assert naming.assign_shard_indices((3, 1), pp_size=1, ep_size=4) == (3, 0, 1)
    assert naming.assign_shard_indices((3, 1), pp_size=2, ep_size=1) == (3, 1, 0)
    assert naming.assign_shard_indices((3, 1), pp_size=1, ep_size=1) is None


def test_tracker_and_iteration_dirs():
    assert naming.parse_tracker("2") == 2
    assert naming.parse_tracker("release\n") == "release"
    assert naming.parse_tracker("two") is None
    assert naming.iteration_dir_name(7) == "iter_0000007"
    assert naming.parse_iteration_dir("iter_0000007") == 7
    assert naming.parse_iteration_dir("iter_7") is None


def test_dims_ep_decides_3d():
    assert naming.dims_class(pp_size=1, ep_size=1) == "1D"
    assert naming.dims_class(pp_size=2, ep_size=1) == "2D"
    assert naming.dims_class(pp_size=1, ep_size=2) == "3D"
    assert naming.name_pattern(pp_size=1, ep_size=2) == "mp_rank_{tp:02d}_{ep:03d}"


@pytest.mark.parametrize(
    "sizes, names",
    [
        # Rank tables from Megatron's RankGenerator (shared notes §1.3), with the fixed writer rule (dp==0 or edp==0).
        (ParallelLayout(tp=2, ep=2, etp=2), ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]),
        (ParallelLayout(tp=2, ep=2, etp=1), ["mp_rank_00_000", "mp_rank_01_001"]),
        (ParallelLayout(tp=2, etp=1), ["mp_rank_00", "mp_rank_01"]),
        (ParallelLayout(tp=4, ep=2, etp=1), ["mp_rank_00_000", "mp_rank_01_001", "mp_rank_02_000", "mp_rank_03_001"]),
        (ParallelLayout(tp=4, ep=2, etp=2), ["mp_rank_00_000", "mp_rank_01_000", "mp_rank_02_001", "mp_rank_03_001"]),
        (ParallelLayout(tp=2, pp=2, ep=2, etp=1),
         ["mp_rank_00_000_000", "mp_rank_00_001_000", "mp_rank_01_000_001", "mp_rank_01_001_001"]),
        (ParallelLayout(tp=2, pp=2, ep=2, etp=2), sorted(
            f"mp_rank_{t:02d}_{p:03d}_{e:03d}" for t in range(2) for p in range(2) for e in range(2))),
        (ParallelLayout(tp=1, ep=4), ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_00_002", "mp_rank_00_003"]),
    ],
)
def test_expected_shards_follow_rank_grid(sizes, names):
    assert sorted(expected_shards(sizes)) == names


def test_expected_shards_do_not_depend_on_dp():
    sizes = ParallelLayout(tp=4, pp=2, ep=2, etp=1)
    base = expected_shards(sizes)
    for world in (16, 32, 64):
        assert expected_shards(sizes, world) == base


def test_planning_huge_layout_is_fast():
    import time

    t = time.perf_counter()
    shards = expected_shards(ParallelLayout(tp=8, pp=16, ep=64, etp=1))
    assert len(shards) == 64 * 16  # every EP rank has an expert-DP-rank-0 writer; tp = ep % 8 (EP folded into TP x DP)
    assert time.perf_counter() - t < 5


def test_shard_writers_gives_each_caller_its_own_copy():
    sizes = ParallelLayout(tp=2, pp=2, ep=2, etp=1)
    first = naming.shard_writers(sizes)
    kept = {name: dict(c) for name, c in first.items()}
    next(iter(first.values()))["tp"] = 99
    first.clear()
    assert naming.shard_writers(sizes) == kept and len(kept) == 4  # (ETP1: EP2 spans the TP2 ranks)

"""reshard/plan/types.py: a global tensor's replicas, listed once for every rank's plan and kept current."""

from megatron_preflight.reshard.plan.rules import parse_key, rule_for
from megatron_preflight.reshard.plan.types import GlobalEntry, GlobalKey, SourcePiece
from megatron_preflight.torch_file import StorageRef, TensorRef


def _ref(shard: str) -> TensorRef:
    return TensorRef(shard, StorageRef("0", "float32", 4), 0, (4,), (1,))


def test_replicas_are_the_copies_after_the_main_piece_and_follow_new_pieces():
    info = parse_key("decoder.layers.0.input_layernorm.weight")
    entry = GlobalEntry(GlobalKey(0, None, info.style, info.global_suffix), info, rule_for(info, swiglu=False))
    for shard in ("mp_rank_00_000_002", "mp_rank_00_000_000"):
        entry.add(SourcePiece(shard, _ref(shard), 0, 1))
    assert entry.main(0).shard == "mp_rank_00_000_000"
    first = entry.replicas(0)
    assert [s for s, _ in first] == ["mp_rank_00_000_002"] and entry.replicas(0) is first  # made once
    entry.add(SourcePiece("mp_rank_00_000_001", _ref("mp_rank_00_000_001"), 0, 1))
    entry.add(SourcePiece("mp_rank_00_000_003", "not a tensor", 0, 1))
    assert [s for s, _ in entry.replicas(0)] == ["mp_rank_00_000_001", "mp_rank_00_000_002"]

"""Plans prove their own coverage before any byte moves: exact tiling, padding only after the real vocab, every
replica kept and compared."""

import pathlib
import shutil
import zipfile

import pytest
import torch

from megatron_preflight.errors import PreflightError
from megatron_preflight.reshard import write_resharded
from megatron_preflight.reshard.execute.replicas import ReplicaMismatch
from megatron_preflight.reshard.plan import planner
from megatron_preflight.reshard.plan.types import CopyOp, PlanError, TensorPlan
from megatron_preflight.reshard.plan.validate import validate_tensor_plan
from megatron_preflight.reshard.resharder import open_resharder
from megatron_preflight.reshard.target import TargetLayout
from megatron_preflight.torch_file import StorageRef, TensorRef
from tests.conftest import fixture_path


def ref(rows: int, cols: int = 4) -> TensorRef:
    return TensorRef("f", StorageRef("0", torch.float32, rows * cols), 0, (rows, cols), (cols, 1))


def plan(shape, ops, zero_fill=(), pad_from=None) -> TensorPlan:
    return TensorPlan("model", "t", shape, torch.float32, ops, zero_fill=zero_fill, pad_from=pad_from)


def op(shard, src_rows, start, length, dst_start):
    return CopyOp(shard, ref(src_rows), (0, start, length), (0, dst_start, length))


def test_exact_tiling_passes():
    validate_tensor_plan(plan((8, 4), [op("a", 4, 0, 4, 0), op("b", 4, 0, 4, 4)]), "t")
    validate_tensor_plan(plan((8, 4), [op("a", 4, 0, 4, 0)], zero_fill=((4, 4),), pad_from=4), "t")
    validate_tensor_plan(plan((4, 4), [CopyOp("a", ref(4), None, None)]), "t")


@pytest.mark.parametrize("ops,zero,pad,msg", [
    ([op("a", 4, 0, 4, 0), op("b", 4, 0, 3, 4)], (), None, "covers 7 of its 8 rows"),
    ([op("a", 4, 0, 4, 0), op("b", 4, 0, 3, 5)], (), None, "rows 4:5 along dim 0 uncovered"),
    ([op("a", 4, 0, 4, 0), op("b", 4, 0, 4, 3)], (), None, "twice"),
    ([op("a", 4, 0, 4, 0)], ((4, 4),), None, "without a source"),  # zeros outside vocab padding
    ([op("a", 4, 0, 4, 0)], ((4, 4),), 6, "without a source"),  # zeros before the real vocab ends
    ([op("a", 4, 2, 4, 0), op("b", 4, 0, 4, 4)], (), None, "reads rows 2:6 of a source with 4"),
    ([CopyOp("a", ref(4), None, None)], (), None, r"copies a \(4, 4\) source into a \(8, 4\) target"),
    ([], (), None, "has no source"),
])
def test_gaps_overlaps_and_stray_zeros_are_refused(ops, zero, pad, msg):
    with pytest.raises(PlanError, match=msg) as exc:
        validate_tensor_plan(plan((8, 4), ops, zero, pad), "model.decoder.layers.0.mlp.linear_fc1.weight")
    assert "model.decoder.layers.0.mlp.linear_fc1.weight" in str(exc.value)


def test_planner_gap_is_caught_before_anything_is_written(monkeypatch, tmp_path):
    real = planner.segments

    def short(rule, global_len, group_size, rank):  # a planning bug: each source piece one row short
        return [(g, n - 1, loc) for g, n, loc in real(rule, global_len, group_size, rank)] if group_size == 2 else \
            real(rule, global_len, group_size, rank)

    monkeypatch.setattr(planner, "segments", short)
    with pytest.raises(PlanError, match=r"the plan for model\.decoder\.layers\.0\.\S+ leaves rows \d+:\d+"):
        write_resharded(fixture_path("tp2_torch"), str(tmp_path / "out"), TargetLayout(tp=1))
    assert not (tmp_path / "out").exists()


def test_every_plan_of_every_fixture_validates():
    for name, target in [("tp2_torch", TargetLayout(tp=4)), ("moe_ep2_torch", TargetLayout(ep=4, etp=1)),
                         ("vpp_qkln_pp2_torch", TargetLayout(pp=1)), ("bf16_gqa_tp2_torch", TargetLayout(tp=1, pp=2)),
                         ("acct_emb_pp2_torch", TargetLayout(pp=1))]:
        r = open_resharder(fixture_path(name), target)
        plans = r.shard_plans()  # each validated by plan_for_coords
        assert plans and all(p.tensors for p in plans.values())


def test_only_padding_rows_are_zero_filled():
    r = open_resharder(fixture_path("tp1_torch"), TargetLayout(tp=4))  # 100 real rows; 128 -> 512 padded rows
    assert r.vocab.real == 100 and r.vocab.target_padded == 512
    for p in r.shard_plans().values():
        for tp in p.tensors:
            if tp.key != "embedding.word_embeddings.weight":
                assert not tp.zero_fill, tp.key
            else:
                assert all(start >= tp.pad_from for start, _ in tp.zero_fill)


def test_padded_vocab_below_the_real_vocab_is_refused(tmp_path):
    with pytest.raises(PreflightError, match="would cut real vocabulary rows"):
        open_resharder(fixture_path("tp2_torch"), TargetLayout(tp=1, padded_vocab_size=64))


def test_replicas_are_kept_main_first_by_shard_name():
    r = open_resharder(fixture_path("tp2_torch"), TargetLayout(tp=1))
    entry = next(e for k, e in r.index.items() if k.suffix == "input_layernorm.weight")
    shards = [p.shard for p in entry.pieces[0]]
    assert shards == ["mp_rank_00", "mp_rank_01"]
    tp = next(t for t in r.shard_plans()["mp_rank_00"].tensors if t.key.endswith("0.input_layernorm.weight"))
    assert tp.ops[0].shard == "mp_rank_00" and [s for s, _ in tp.ops[0].replicas] == ["mp_rank_01"]


def _poke(path: str, key_suffix: str, element: int) -> None:
    """Change one float of a tensor in a copied shard file, saved again (a valid torch zip, its CRCs right: replicas
    that diverged in the run, not bytes damaged afterwards, which the readers' CRC check catches first)."""
    from tests.helpers import ckpt_edit

    state = ckpt_edit.load(path)
    key = next(k for k in state["model"] if k.endswith(key_suffix))
    state["model"][key].view(-1)[element] += 1.0
    ckpt_edit.save(state, path)
    zipfile.ZipFile(path).testzip()  # every record's CRC right


def test_diverged_replica_is_reported_with_both_shards(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(fixture_path("tp2_torch"), src)
    _poke(str(src / "iter_0000002" / "mp_rank_01" / "model_optim_rng.pt"), "layers.1.input_layernorm.weight", 0)
    with pytest.raises(ReplicaMismatch) as exc:
        write_resharded(str(src), str(tmp_path / "out"), TargetLayout(tp=1))
    msg = str(exc.value)
    assert "decoder.layers.1.input_layernorm.weight" in msg and "mp_rank_00" in msg and "mp_rank_01" in msg
    assert not (tmp_path / "out").exists()


def _tensor(root, shard: str, key: str):
    from tests.helpers import ckpt_edit

    return ckpt_edit.load(str(root / "iter_0000002" / shard / "model_optim_rng.pt"))["model"][key]


def test_replicas_megatron_lets_drift_take_tp_rank_0s_copy_with_the_drift_said(tmp_path):
    """A real MLA checkpoint (TE spec through the CPU stand-in, not TE) trained at TP2 without --sequence-parallel:
    Megatron lets its TP replicas drift apart. The reshard takes TP rank 0's copies (what Megatron's torch_dist save
    keeps) and says so with the drift measured; an extra edit of one copy of a tensor of the same checkpoint is still
    found when it is not one Megatron lets drift (the MLA rule covers every TP-replicated tensor: so in a GDN model)."""
    from tests.helpers import ckpt_edit

    summary = write_resharded(fixture_path("mla_nosp_te_tp2_torch"), str(tmp_path / "out"), TargetLayout(tp=1))
    text = summary.render()
    assert "Megatron lets drift" in text and "without --sequence-parallel" in text and "TP rank 0's copy" in text
    key = "decoder.layers.0.self_attention.linear_kv_down_proj.weight"
    src = pathlib.Path(fixture_path("mla_nosp_te_tp2_torch"))
    rank0, rank1 = _tensor(src, "mp_rank_00", key), _tensor(src, "mp_rank_01", key)
    assert not torch.equal(rank0, rank1)  # the copies differ in the saved checkpoint
    written = ckpt_edit.load(str(tmp_path / "out" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"))
    assert torch.equal(written["model"][key], rank0)
    write_resharded(fixture_path("mla_te_tp2_torch"), str(tmp_path / "sp"), TargetLayout(tp=1), verify=True)


def test_a_gated_delta_nets_out_norm_may_drift_but_no_other_copy(tmp_path):
    """A real HybridModel checkpoint with gated delta net layers at TP2 without --sequence-parallel (the CPU stand-ins
    for TE / mamba_ssm / fla), whose GDN out_norm copies differ as Megatron's training leaves them (it does not reduce
    that gradient over TP): the reshard to TP1 takes TP rank 0's copy and reports the drift, with --verify too. A
    change to an input layernorm of the same checkpoint (a gradient Megatron reduces), and to an out_norm copy of a
    model trained with sequence parallelism (which reduces it), are still refused, naming both files."""
    from tests.helpers import ckpt_edit

    src = pathlib.Path(fixture_path("gdn_tp2_torch"))
    key = "decoder.layers.1.self_attention.out_norm.weight"
    assert not torch.equal(_tensor(src, "mp_rank_00", key), _tensor(src, "mp_rank_01", key))
    for verify in (False, True):
        out = tmp_path / f"out{verify}"
        text = write_resharded(str(src), str(out), TargetLayout(tp=1), verify=verify).render()
        assert "tensor(s) whose TP copies Megatron lets drift differ" in text and "out_norm" in text, text
        assert "gated delta net" in text and "TP rank 0's copy is used" in text, text
        written = ckpt_edit.load(str(out / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"))
        assert torch.equal(written["model"][key], _tensor(src, "mp_rank_00", key))
    for name, suffix in (("gdn_tp2_torch", "layers.1.self_attention.in_proj.layer_norm_weight"),
                         ("hyb_tp2_torch", "layers.1.self_attention.out_norm.weight")):
        bad = tmp_path / f"bad_{name}"
        shutil.copytree(fixture_path(name), bad)
        _poke(str(bad / "iter_0000002" / "mp_rank_01" / "model_optim_rng.pt"), suffix, 3)
        with pytest.raises(ReplicaMismatch) as exc:
            write_resharded(str(bad), str(tmp_path / f"refused_{name}"), TargetLayout(tp=1))
        msg = str(exc.value)
        assert suffix in msg and "mp_rank_00" in msg and "mp_rank_01" in msg and "diverged" in msg
        assert not (tmp_path / f"refused_{name}").exists()


def test_replica_diverged_between_samples_is_found_by_verify(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(fixture_path("tp2_torch"), src)
    # the position embedding (replicated over TP) is 64 x 32 floats: element 700 lies outside the three samples
    _poke(str(src / "iter_0000002" / "mp_rank_01" / "model_optim_rng.pt"), "position_embeddings.weight", 700)
    write_resharded(str(src), str(tmp_path / "sampled"), TargetLayout(tp=1))  # the sampled check misses it
    with pytest.raises(ReplicaMismatch, match="embedding.position_embeddings.weight"):
        write_resharded(str(src), str(tmp_path / "verified"), TargetLayout(tp=1), verify=True)


def test_a_damaged_replica_is_named_as_damage_not_divergence(tmp_path):
    """The sampled check reads a few elements without taking the records' CRC-32s (a replica's bytes are not used; the
    main copy's CRC is taken as it is read); when the samples differ, both records' CRCs are taken first, so bit rot
    in a copy is reported as a damaged file, not as ranks that diverged."""
    from megatron_preflight.torch_file import read_torch_file
    from tests.test_torch_file import _flip_a_bit_of

    src = tmp_path / "src"
    shutil.copytree(fixture_path("tp2_torch"), src)
    path = str(src / "iter_0000002" / "mp_rank_01" / "model_optim_rng.pt")
    ref = read_torch_file(path)["model"]["decoder.layers.1.input_layernorm.weight"]
    _flip_a_bit_of(path, f"data/{ref.storage.key}")  # its middle byte: inside the middle sample
    with pytest.raises(PreflightError, match="CRC-32") as exc:
        write_resharded(str(src), str(tmp_path / "out"), TargetLayout(tp=1))
    assert not isinstance(exc.value, ReplicaMismatch) and exc.value.path == path
    assert not (tmp_path / "out").exists()

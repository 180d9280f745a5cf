"""The distributed optimizer's state (legacy distrib_optim.pt) follows a layout change offline: the buffer layout
model, its validation on real Megatron-LM checkpoints (DP 2: dense, bf16, MoE chained, VPP), bit-exact round trips."""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_preflight.layout.discover import discover
from megatron_preflight.reshard import write_resharded
from megatron_preflight.reshard.optimizer import distributed as dist_optimizer
from megatron_preflight.reshard.optimizer.distributed import Slot, check_masters, world_offsets
from megatron_preflight.reshard.optimizer.plain import OptimizerNotReshardable
from megatron_preflight.reshard.resharder import open_resharder
from megatron_preflight.reshard.sources.files import SourceFiles
from megatron_preflight.reshard.target import TargetLayout
from megatron_preflight.torch_file import TensorRef, TorchFile
from tests.conftest import fixture_path

SOURCES = ["distopt_tp2dp2_torch", "distopt_bf16_tp2dp2_torch", "distopt_moe_ep2dp2_torch",
           "distopt_vpp_pp2dp2_torch", "distopt_buckets_tp2dp2_torch", "tp2_distopt_torch"]


def test_world_offsets_align_each_param_and_drop_bucket_end_padding():
    # model.parameters() order a, b, c: the buffer holds c, b, a; each start a multiple of 64
    offsets, buckets = world_offsets([Slot("a", 10), Slot("b", 100), Slot("c", 3)], None)
    assert offsets == {"c": 0, "b": 64, "a": 192} and buckets == [202]
    # a bucket closes after the parameter whose end reaches the bucket size; the next one starts unaligned in the
    # world tensors (the bucket-end padding is not saved)
    offsets, buckets = world_offsets([Slot("a", 10), Slot("b", 100), Slot("c", 3)], 100)
    assert buckets == [164, 10] and offsets == {"c": 0, "b": 64, "a": 164}


def test_shared_embedding_sits_in_a_bucket_of_its_own():
    offsets, buckets = world_offsets([Slot("emb", 50, shared_embedding=True), Slot("w", 70), Slot("b", 5)], None)
    # b, w, then the embedding: the bucket before it closes at w's aligned end (padding included)
    assert offsets == {"b": 0, "w": 64, "emb": 192} and buckets == [192, 50]


@pytest.mark.parametrize("name", SOURCES)
def test_real_distrib_optim_matches_the_model_exactly(name):
    lay = discover(fixture_path(name))
    r = open_resharder(lay, TargetLayout())
    assert r.dist_index is not None and r.optimizer_problem is None
    files = SourceFiles(lay.iter_dir)
    try:
        assert r.check_masters(files) == len(r.dist_index.checked) > 0  # every master equals its weight (sampled)
    finally:
        files.close()


def test_moe_chained_parts_and_none_entries():
    lay = discover(fixture_path("distopt_moe_ep2dp2_torch"))
    r = open_resharder(lay, TargetLayout())
    assert r.dist_index.expert_groups  # the expert part's groups (is_expert_parallel)
    expert = [k for k in r.dist_index.fields if k.expert is not None]
    assert len({k.expert for k in expert}) == 4  # all 4 experts, from both EP dirs


def _world(path):
    with TorchFile(path) as f:
        meta = f.load_metadata()
        parts = meta if isinstance(meta, list) else [meta]
        out = []
        for part_no, part in enumerate(parts):
            if part is None:  # Megatron: saved by another rank (that part's DP rank 0)
                continue
            for gbuf in sorted(k for k in part if isinstance(k, int)):
                (key, world), = part[gbuf].items()
                out.append(((part_no, gbuf), key, world["numel_unpadded"],
                            {n: f.tensor(world[n]).clone() for n in ("param", "exp_avg", "exp_avg_sq")}))
        return out


def _parts(path):
    """Which optimizer parts a distrib_optim.pt holds: a dict (one part), or per part held / None."""
    with TorchFile(path) as f:
        meta = f.load_metadata()
    return "one" if isinstance(meta, dict) else [part is not None for part in meta]


def test_moe_parts_are_written_by_each_parts_dp_rank_0_only(tmp_path):
    """EP2·DP2 -> EP4: the dense part only in the dense DP rank 0's file (mp_rank_00_000), the expert part in every
    expert rank's file, as Megatron's ChainedOptimizer saves them (not four copies of the dense state)."""
    out = tmp_path / "ep4"
    write_resharded(fixture_path("distopt_moe_ep2dp2_torch"), str(out), TargetLayout(ep=4), verify=True)
    it = out / "iter_0000002"
    assert {d: _parts(str(it / d / "distrib_optim.pt")) for d in sorted(os.listdir(it))} == {
        "mp_rank_00_000": [True, True], "mp_rank_00_001": [False, True], "mp_rank_00_002": [False, True],
        "mp_rank_00_003": [False, True]}
    back = tmp_path / "back"
    write_resharded(str(out), str(back), TargetLayout(ep=2), verify=True)  # read back: the None parts are skipped
    for d in ("mp_rank_00_000", "mp_rank_00_001"):
        assert [w[:3] for w in _world(str(back / "iter_0000002" / d / "distrib_optim.pt"))] == \
            [w[:3] for w in _world(os.path.join(fixture_path("distopt_moe_ep2dp2_torch"), "iter_0000002", d, "distrib_optim.pt"))]


def _groups(path):
    with TorchFile(path) as f:
        return f.load_metadata()["optimizer"]


@pytest.mark.parametrize("name", SOURCES)
def test_same_layout_rewrites_distrib_optim_byte_for_byte(tmp_path, name):
    out = tmp_path / "same"
    src = discover(fixture_path(name))
    write_resharded(fixture_path(name), str(out), TargetLayout(vpp=src.vpp), verify=True)
    for s in src.shards:
        a, b = os.path.join(s.path, "distrib_optim.pt"), str(out / "iter_0000002" / s.name / "distrib_optim.pt")
        wa, wb = _world(a), _world(b)
        assert _parts(b) == _parts(a)  # each part where Megatron writes it: None in the files of other DP ranks
        assert [w[:3] for w in wb] == [w[:3] for w in wa]
        for gbuf, key, numel, tensors in wa:
            match = [w for w in wb if w[0] == gbuf and w[1] == key and w[2] == numel]
            assert match and all(torch.equal(tensors[n], match[0][3][n]) for n in tensors)
        assert _groups(os.path.join(s.path, "model_optim_rng.pt")) == _groups(str(out / "iter_0000002" / s.name /
                                                                                    "model_optim_rng.pt"))


# A TP2 source pads the vocab to 256 rows; at TP1 Megatron pads to 128 and the padding rows 128-255 (and their Adam
# state) are not kept: those intermediates keep 256 rows so the way back can be compared bit for bit.
@pytest.mark.parametrize("name,there", [
    ("distopt_tp2dp2_torch", TargetLayout(tp=1, padded_vocab_size=256)),
    ("distopt_tp2dp2_torch", TargetLayout(tp=1, pp=2, padded_vocab_size=256)),
    ("distopt_tp2dp2_torch", TargetLayout(tp=4, pp=2, vpp=2)),
    ("distopt_bf16_tp2dp2_torch", TargetLayout(tp=1, pp=4, padded_vocab_size=256)),
    ("distopt_moe_ep2dp2_torch", TargetLayout(ep=4)),
    ("distopt_moe_ep2dp2_torch", TargetLayout(ep=1)),  # the experts join the dense buffers and groups
    ("distopt_moe_ep2dp2_torch", TargetLayout(tp=2, ep=2, etp=1)),
    ("distopt_vpp_pp2dp2_torch", TargetLayout(pp=1)),
])
def test_round_trip_is_bit_exact_on_every_optimizer_tensor(tmp_path, name, there):
    src = discover(fixture_path(name))
    back = TargetLayout(tp=src.tp, pp=src.pp, ep=src.ep, etp=src.etp, vpp=src.vpp, embedding_in_split=False)
    write_resharded(fixture_path(name), str(tmp_path / "b"), there, verify=True)
    write_resharded(str(tmp_path / "b"), str(tmp_path / "a"), back, verify=True)
    for s in src.shards:
        got = _world(str(tmp_path / "a" / "iter_0000002" / s.name / "distrib_optim.pt"))
        for gbuf, key, numel, tensors in _world(os.path.join(s.path, "distrib_optim.pt")):
            match = [w for w in got if w[0] == gbuf and w[1] == key and w[2] == numel]
            assert match and all(torch.equal(tensors[n], match[0][3][n]) for n in tensors), (s.name, gbuf)


def test_misplaced_masters_are_caught(monkeypatch):
    """A buffer model that places every parameter one slot off (same total size) is caught by the master check."""
    lay = discover(fixture_path("distopt_tp2dp2_torch"))
    real = dist_optimizer.world_offsets

    def shifted(slots, size):
        offsets, buckets = real(slots, size)
        names = list(offsets)
        return {n: offsets[names[(i + 1) % len(names)]] for i, n in enumerate(names)}, buckets

    monkeypatch.setattr(dist_optimizer, "world_offsets", shifted)
    r = open_resharder(lay, TargetLayout(tp=1))
    files = SourceFiles(lay.iter_dir)
    try:
        with pytest.raises(OptimizerNotReshardable, match="do not line up with the model's weights"):
            check_masters(r.dist_index, files)
    finally:
        files.close()


def test_other_bucket_settings_are_refused_not_guessed(monkeypatch):
    # every parameter a bucket of its own: no alignment padding between them, so the total no longer matches
    monkeypatch.setattr(dist_optimizer, "bucket_size", lambda args, dp=None: 1)
    r = open_resharder(discover(fixture_path("distopt_tp2dp2_torch")), TargetLayout(tp=1))
    assert r.dist_index is None and isinstance(r.optimizer_problem, OptimizerNotReshardable)
    assert "buckets of 1 elements" in r.optimizer_problem.message and "records 23680" in r.optimizer_problem.message


def test_world_tensor_views_point_into_the_flat_buffers():
    lay = discover(fixture_path("distopt_tp2dp2_torch"))
    r = open_resharder(lay, TargetLayout())
    entry = next(iter(r.dist_index.fields.values()))["exp_avg"]
    piece = entry.first()
    assert isinstance(piece.ref, TensorRef) and piece.ref.file.endswith("distrib_optim.pt")


drawn = st.fixed_dictionaries({"tp": st.sampled_from([1, 2, 4]), "pp": st.sampled_from([1, 2, 4]),
                               "ep": st.sampled_from([1, 2, 4]), "vpp": st.sampled_from([None, 2])})


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lay=drawn, name=st.sampled_from(["distopt_tp2dp2_torch", "distopt_moe_ep2dp2_torch",
                                        "distopt_vpp_pp2dp2_torch"]))
def test_drawn_layouts_round_trip_bit_exact(tmp_path_factory, lay, name):
    """Any TP/PP/EP/VPP and back (the files do not depend on the DP size: every DP rank's shard is in them)."""
    if "moe" not in name:
        lay["ep"] = 1
    if lay["vpp"] and 4 // lay["pp"] < 2:
        lay["vpp"] = None
    src = discover(fixture_path(name))
    tmp = tmp_path_factory.mktemp("rt")
    padded = 128 * max(lay["tp"], src.tp)  # keep every padding row on the way (see above)
    write_resharded(fixture_path(name), str(tmp / "b"), TargetLayout(**lay, padded_vocab_size=padded))
    back = TargetLayout(tp=src.tp, pp=src.pp, ep=src.ep, vpp=src.vpp, embedding_in_split=False,
                        padded_vocab_size=128 * src.tp)
    write_resharded(str(tmp / "b"), str(tmp / "a"), back, verify=True)
    for s in src.shards:
        got = _world(str(tmp / "a" / "iter_0000002" / s.name / "distrib_optim.pt"))
        for gbuf, key, numel, tensors in _world(os.path.join(s.path, "distrib_optim.pt")):
            match = [w for w in got if w[0] == gbuf and w[1] == key and w[2] == numel]
            assert match and all(torch.equal(tensors[n], match[0][3][n]) for n in tensors), (s.name, gbuf, lay)


@pytest.mark.parametrize("name,there,back", [
    # distributed -> plain (at TP1, keeping every vocab row) -> distributed at the source's layout
    ("distopt_tp2dp2_torch", TargetLayout(tp=1, padded_vocab_size=256, distributed_optimizer=False),
     TargetLayout(tp=2, distributed_optimizer=True)),
    ("distopt_bf16_tp2dp2_torch", TargetLayout(tp=1, pp=2, padded_vocab_size=256, distributed_optimizer=False),
     TargetLayout(tp=2, pp=1, embedding_in_split=False, distributed_optimizer=True)),
    ("distopt_moe_ep2dp2_torch", TargetLayout(ep=4, distributed_optimizer=False),
     TargetLayout(ep=2, distributed_optimizer=True)),
])
def test_distributed_to_plain_and_back_is_bit_exact(tmp_path, name, there, back):
    s = write_resharded(fixture_path(name), str(tmp_path / "plain"), there, verify=True)
    assert "from the distributed to the plain optimizer" in s.converted
    plain = discover(str(tmp_path / "plain"))
    assert not plain.distributed_optimizer and not any("distrib_optim.pt" in sh.files for sh in plain.shards)
    write_resharded(str(tmp_path / "plain"), str(tmp_path / "dist"), back, verify=True)
    for sh in discover(fixture_path(name)).shards:
        got = _world(str(tmp_path / "dist" / "iter_0000002" / sh.name / "distrib_optim.pt"))
        for gbuf, key, numel, tensors in _world(os.path.join(sh.path, "distrib_optim.pt")):
            match = [w for w in got if w[0] == gbuf and w[1] == key and w[2] == numel]
            assert match and all(torch.equal(tensors[n], match[0][3][n]) for n in tensors), (sh.name, gbuf)


@pytest.mark.parametrize("name", ["tp2_torch", "bf16_gqa_tp2_torch", "moe_ep2_torch"])
def test_plain_to_distributed_and_back_is_bit_exact(tmp_path, name):
    from tests.reshard.test_roundtrip_real import optimizer_entries

    src = discover(fixture_path(name))
    s = write_resharded(fixture_path(name), str(tmp_path / "dist"),
                        TargetLayout(tp=1, padded_vocab_size=128 * src.tp, distributed_optimizer=True), verify=True)
    assert "from the plain to the distributed optimizer" in s.converted
    assert discover(str(tmp_path / "dist")).distributed_optimizer
    write_resharded(str(tmp_path / "dist"), str(tmp_path / "plain"),
                    TargetLayout(tp=src.tp, ep=src.ep, etp=src.etp, distributed_optimizer=False), verify=True)
    a, b = optimizer_entries(fixture_path(name)), optimizer_entries(str(tmp_path / "plain"))
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k][0], b[k][0]
        assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), k


def test_converted_state_in_memory_gives_each_parameter_its_own_step():
    """torch's Adam increments each parameter's step tensor in place: a shared one would count every parameter."""
    r = open_resharder(fixture_path("distopt_tp2dp2_torch"), TargetLayout(tp=1, distributed_optimizer=False))
    state = r.build(r.plan_for_rank(0, 1))["optimizer"]["state"]
    steps = [v["step"] for v in state.values()]
    assert len(steps) > 10 and len({id(s) for s in steps}) == len(steps) and all(float(s) == 2.0 for s in steps)

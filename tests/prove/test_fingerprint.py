"""Fingerprints: the same global tensor cut any way gives the same digest; any single-bit change changes it; a
checkpoint, its reshards and its torch_dist twin have the same fingerprints."""

import random
import shutil

import pytest
import torch

from megatron_preflight.cli.main import main
from megatron_preflight.prove import fingerprint as fp
from megatron_preflight.prove.stored import DIR
from megatron_preflight.reshard import TargetLayout, open_resharder, write_resharded
from tests.conftest import fixture_path


def random_boxes(shape, rng, depth=0):
    """A random partition of a box (offsets, sizes) into boxes: split along a random dim at random points, then
    split the parts again (TP inside EP inside a stage, uneven pieces, 1-element slivers)."""
    offsets = (0,) * len(shape)
    todo, out = [(offsets, tuple(shape), 0)], []
    while todo:
        off, size, level = todo.pop()
        dims = [d for d, s in enumerate(size) if s > 1]
        if level >= 3 or not dims or rng.random() < 0.25:
            out.append((off, size))
            continue
        d = rng.choice(dims)
        cuts = sorted(rng.sample(range(1, size[d]), min(size[d] - 1, rng.randint(1, 3))))
        for a, b in zip([0, *cuts], [*cuts, size[d]], strict=True):
            o, s = list(off), list(size)
            o[d], s[d] = off[d] + a, b - a
            todo.append((tuple(o), tuple(s), level + 1))
    return out


def piece(t, off, size):
    return t[tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64])
@pytest.mark.parametrize("seed", range(6))
def test_any_slicing_gives_the_same_digest(dtype, seed):
    rng = random.Random(seed)
    shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3)))
    t = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 100).to(dtype)
    whole = fp.digest(t)
    boxes = random_boxes(shape, rng)
    assert fp.combine([fp.digest_box(piece(t, o, s).clone(), shape, o) for o, s in boxes]) == whole
    # a distributed optimizer's flat buffer: the flattened tensor cut at arbitrary element offsets
    flat = t.reshape(-1)
    cuts = sorted(rng.sample(range(1, flat.numel()), min(3, flat.numel() - 1))) if flat.numel() > 1 else []
    parts = [(a, b) for a, b in zip([0, *cuts], [*cuts, flat.numel()], strict=True)]
    assert fp.combine([fp.digest_box(flat[a:b], (flat.numel(),), (a,)) for a, b in parts]) == whole


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool])
@pytest.mark.parametrize("seed", range(4))
def test_the_device_digest_equals_the_host_one(dtype, seed, monkeypatch):
    """The torch-op digest a GPU tensor is hashed with (at save and in verify: no copy to the host) gives exactly the
    numpy digest. Run here on CPU tensors (no GPU in CI): the same torch ops, the same int64 arithmetic; with a small
    pass size, so boxes span several passes and rows longer than one pass are cut."""
    monkeypatch.setattr(fp, "_DEVICE_CHUNK", 7)
    rng = random.Random(seed)
    shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(0, 3)))
    t = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 1e4).to(dtype)
    for o, s in random_boxes(shape, rng) if shape else [((), ())]:
        box = piece(t, o, s) if shape else t
        assert fp.digest_box_on_device(box, shape, o) == fp.digest_box(box, shape, o), (o, s)
    flat = t.reshape(-1)
    index = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(seed)) * 3
    index[::4] = -1  # not hashed
    assert fp.digest_indexed(flat, index) == (
        sum(fp._device_sum(fp._int_view(flat[i:i + 1]), index[i:i + 1]) for i in range(flat.numel())
            if index[i] >= 0) % (1 << 64), int((index >= 0).sum()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_every_single_bit_change_changes_the_digest(dtype):
    t = torch.randn(4, 6, generator=torch.Generator().manual_seed(3)).to(dtype)
    whole = fp.digest(t)
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    for i in range(t.numel()):
        for bit in range(t.element_size() * 8):
            flipped = t.clone().reshape(-1)
            flipped.view(ints)[i] ^= torch.tensor(1, dtype=ints) << bit
            assert fp.digest(flipped.reshape(t.shape)) != whole, (i, bit)


def test_swapped_rows_and_a_moved_tensor_change_the_digest():
    t = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    swapped = t.clone()
    swapped[[2, 5]] = swapped[[5, 2]]
    assert fp.digest(swapped) != fp.digest(t)
    assert fp.digest_box(t[:4], (8, 4), (4, 0)) != fp.digest_box(t[:4], (8, 4), (0, 0))  # same values, other place


def test_a_checkpoint_its_reshard_and_its_twin_have_the_same_fingerprints(tmp_path):
    a = fp.fingerprint_checkpoint(fixture_path("tp2_torch"))
    out = str(tmp_path / "tp1pp2")
    write_resharded(fixture_path("tp2_torch"), out, TargetLayout(tp=1, pp=2))
    b = fp.fingerprint_checkpoint(out)
    twin = fp.fingerprint_checkpoint(fixture_path("tp2_torch_dist"))
    assert a["tensors"] and a["tensors"] == b["tensors"] == twin["tensors"]
    assert any(k.endswith("#exp_avg_sq") for k in a["tensors"])


def test_the_command_stores_them_beside_the_checkpoint(tmp_path):
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(fixture_path("moe_ep2_torch"), root)
    assert main(["fingerprint", str(root)]) == 0
    doc = fp.load(str(root), 2)
    assert doc is not None and doc["tensors"]["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert not (root / "iter_0000002" / DIR).exists()  # never inside the iteration dir Megatron reads


def test_reshard_can_store_the_outputs_fingerprints(tmp_path):
    out = str(tmp_path / "tp1")
    assert main(["reshard", fixture_path("tp2_torch"), out, "--tp", "1", "--fingerprint", "--no-progress"]) == 0
    assert fp.load(out, 2)["tensors"] == fp.fingerprint_checkpoint(fixture_path("tp2_torch"))["tensors"]


STREAMED = [  # (fixture, the reshard's flags): every writer, optimizer form and split kind the taps must place
    ("tp2_torch", ["--tp", "4"]),
    ("vpp_qkln_pp2_torch", ["--pp", "1"]),
    ("moe_shared_tp2pp2ep2_torch", ["--tp", "1", "--pp", "1", "--ep", "1"]),
    ("distopt_bf16_tp2dp2_torch", ["--tp", "1"]),  # a world tensor's flattened parts, fp32 masters of bf16
    ("distopt_moe_ep2dp2_torch", ["--ep", "1", "--workers", "2"]),  # expert parts; partials back from workers
    ("fp16_qkln_tp2_torch", ["--tp", "1"]),  # the plain optimizer's fp32_from_fp16 masters
    ("distopt_bf16_tp2dp2_torch", ["--tp", "1", "--ckpt-format", "torch_dist"]),  # the torch_dist writer
    ("te_tp2_torch", ["--tp", "1"]),
]


@pytest.mark.parametrize("fixture,flags", STREAMED, ids=[f"{f}{''.join(a)}" for f, a in STREAMED])
def test_fingerprints_hashed_as_written_equal_the_outputs_read_back(tmp_path, capsys, fixture, flags):
    """``reshard --fingerprint`` hashes each tensor as the writer streams it (no tensor read back) and stores exactly
    what fingerprinting the finished output gives — and what the source gives (the reshard moved, never changed)."""
    out = str(tmp_path / "out")
    assert main(["reshard", fixture_path(fixture), out, *flags, "--fingerprint", "--no-progress"]) == 0
    stored = fp.load(out, 2) or fp.load(out, 1)
    assert stored is not None and stored["source"] == out
    again = fp.fingerprint_checkpoint(out, trust=True)
    assert stored["tensors"] == again["tensors"]
    assert again["tensors"] == fp.fingerprint_checkpoint(fixture_path(fixture))["tensors"]
    assert f"{len(again['tensors'])} tensor(s) hashed as written, 0 read back" in capsys.readouterr().out
    assert any("#exp_avg" in k for k in again["tensors"])  # the optimizer state too


def test_a_tensor_the_streamed_partials_do_not_cover_is_read_back(tmp_path):
    """Partials that disagree (replicas written differently) or miss a box are not trusted: that tensor is hashed
    from the output, the others are taken as streamed."""
    out = str(tmp_path / "out")
    assert main(["reshard", fixture_path("tp2_torch"), out, "--tp", "1", "--no-progress"]) == 0
    whole = fp.fingerprint_checkpoint(out)["tensors"]
    names = sorted(whole)
    partials = {n: {("whole",): (int(whole[n]["digest"], 16), _numel(whole[n]["shape"]))} for n in names}
    partials[names[0]] = {("half",): (123, 1)}  # covers one element
    stats: dict = {}
    doc = fp.fingerprint_checkpoint(out, streamed=partials, stats=stats)
    assert doc["tensors"] == whole and stats == {"streamed": len(names) - 1, "read": 1}
    partials[names[0]] = {("whole",): (1, _numel(whole[names[0]]["shape"]))}  # a wrong digest is used as given:
    doc = fp.fingerprint_checkpoint(out, streamed=partials)  # the taps are trusted for what they cover
    assert doc["tensors"][names[0]]["digest"] == f"{1:016x}"
    tapping = fp.Fingerprinting()
    disagree = [{names[1]: {("a",): (5, 1)}}, {names[1]: {("a",): (6, 1)}}]  # two replicas of one box
    tmp = str(tmp_path / "tmp")
    shutil.copytree(out, tmp)
    tapping.finish(open_resharder(out, TargetLayout(tp=1)), disagree, tmp, out)
    assert tapping.stats == {"streamed": 0, "read": len(names)}  # only names[1] was streamed, and it was dropped
    assert fp.load(tmp, 2)["tensors"] == whole


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def test_a_flat_shard_of_a_split_tensor_hashes_into_the_same_digest():
    """A distributed optimizer keeps a flat range of each (TP-split) local tensor: hashed at its global indices, the
    ranges of every rank and every TP piece combine to the global digest (row-parallel: non-contiguous globally)."""
    from megatron_preflight.prove.placement import global_indices

    t = torch.randn(6, 8, generator=torch.Generator().manual_seed(5))
    whole = fp.digest(t)
    partials = []
    for tp_rank in range(2):  # row-parallel split: columns 4*r .. 4*r+3
        local = t[:, 4 * tp_rank:4 * tp_rank + 4].contiguous()
        box = [((slice(0, 6), slice(0, 4)), (6, 8), (0, 4 * tp_rank))]
        for start, end in ((0, 7), (7, 19), (19, 24)):  # three DP ranks' ranges of the flattened local tensor
            d, n = fp.digest_indexed(local.reshape(-1)[start:end], global_indices((6, 4), box, start, end))
            partials.append(d)
    assert fp.combine(partials) == whole

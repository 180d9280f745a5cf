"""Fingerprints: the same global tensor cut any way gives the same digest; any single-bit change changes it; a
checkpoint, its reshards and its torch_dist twin have the same fingerprints."""

import random

import pytest
import torch

from megatron_preflight.cli.main import main
from megatron_preflight.prove import fingerprint as fp
from megatron_preflight.prove.stored import DIR
from megatron_preflight.reshard import TargetLayout, write_resharded
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

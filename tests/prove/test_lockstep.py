"""Lockstep comparison: planned tensors shown equal (or not) from plain reads of row blocks of both sides' bytes.

Real checkpoints (Megatron-LM fixtures and their torch_dist twins) check that every byte extent the readers give is
the piece's bytes and that the lockstep answer is the assembled tensors' bit-for-bit equality; small hand-made
legacy files (torch.save) cut one global tensor many ways (row, column, joined and strided pieces, blocks of a few
rows) for the cases a fixture does not reach."""

import os
import random

import pytest
import torch

from megatron_preflight import dtypes
from megatron_preflight.prove import lockstep
from megatron_preflight.prove.global_view import global_plan, global_resharder, named_tensors, value_of
from megatron_preflight.reshard.checkpoint_index import open_index
from megatron_preflight.reshard.plan.types import CopyOp, TensorPlan
from megatron_preflight.reshard.sources.files import SourceFiles
from megatron_preflight.torch_file import read_torch_file
from tests.conftest import fixture_path


def _plans(path, like=None):
    index = open_index(path)
    r = global_resharder(index, True, like)
    return index, r, named_tensors(global_plan(r), r.writes_optimizer)


def _bits_equal(x, y):
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    return torch.equal(x.contiguous().view(dtypes.int_view(x.dtype)), y.contiguous().view(dtypes.int_view(y.dtype)))


@pytest.mark.parametrize("name", ["tp2_torch", "tp2_torch_dist", "moe_shared_tp2pp2ep2_torch_dist",
                                  "distopt_tp2dp2_torch", "distopt_tp2dp2_torch_dist", "bf16_gqa_tp2_torch_dist"])
def test_every_extent_holds_the_pieces_bytes(name):
    """Where a reader says a piece lies (offset, row pitch), the file's bytes are the piece the reader builds."""
    _, r, plans = _plans(fixture_path(name))
    files = SourceFiles(r.layout.iter_dir)
    found = 0
    try:
        for tp in plans.values():
            for op in getattr(tp, "ops", ()):
                where = files.extent(op.shard, op.ref)
                if where is None:
                    continue
                path, offset, pitch = where
                piece = files.tensor(op.shard, op.ref)
                dtype = piece.dtype
                row = piece[0].numel() * dtype.itemsize if piece.dim() else dtype.itemsize
                with open(path, "rb") as fh:
                    raw = bytearray()
                    for i in range(piece.shape[0]):
                        fh.seek(offset + i * pitch)
                        raw += fh.read(row)
                got = torch.frombuffer(raw, dtype=dtype).view(piece.shape)
                assert _bits_equal(got, piece), (tp.key, op.shard)
                found += 1
    finally:
        files.close()
    assert found > len(plans) // 2  # most pieces of a checkpoint lie so (not a path that is never taken)


@pytest.mark.parametrize("a, b", [("tp2_torch", "tp2_torch_dist"), ("distopt_tp2dp2_torch", "distopt_tp2dp2_torch_dist"),
                                  ("moe_shared_tp2pp2ep2_torch", "moe_shared_tp2pp2ep2_torch_dist"),
                                  ("distopt_tp2dp2_torch", "distopt_dpr_tp2dp2_torch_dist")])
def test_the_lockstep_answer_is_the_assembled_tensors_equality(a, b):
    """For every tensor pair of a diff, the lockstep answer (where it gives one) is the bitwise equality of the two
    tensors built in full; the last pair was saved by another run (some tensors differ in their last bits)."""
    ia, ga, na = _plans(fixture_path(a))
    _, gb, nb = _plans(fixture_path(b), ia)
    fa, fb, reader = SourceFiles(ga.layout.iter_dir), SourceFiles(gb.layout.iter_dir), lockstep.LockstepReader()
    answered, differ = 0, 0
    try:
        for key in set(na) & set(nb):
            said = reader.equal(na[key], nb[key], fa, fb, None)
            if said is None:
                continue
            answered += 1
            truth = _bits_equal(value_of(na[key], fa), value_of(nb[key], fb))
            assert said == truth, key
            differ += not truth
    finally:
        reader.close()
        fa.close()
        fb.close()
    assert answered > len(set(na) & set(nb)) // 2
    assert differ > 0 if "dpr" in b else differ == 0


GLOBAL = (6, 10)


def _save(root, shard, tensors):
    os.makedirs(os.path.join(root, shard), exist_ok=True)
    path = os.path.join(root, shard, "model_optim_rng.pt")
    torch.save(tensors, path)
    return read_torch_file(path)


def _plan(key, dtype, ops):
    return TensorPlan("model", key, GLOBAL, dtype, ops)


def _cut(root, g, how, tag):
    """Global tensor ``g`` saved as pieces (legacy files under ``root``) and the plan that tiles it from them."""
    rows, cols = g.shape
    if how == "whole":
        refs = _save(root, f"{tag}_whole", {"w": g.clone()})
        return _plan(tag, g.dtype, [CopyOp(f"{tag}_whole", refs["w"], None, None)])
    if how in ("rows", "cols"):
        dim = 0 if how == "rows" else 1
        n = g.shape[dim]
        cuts = sorted(random.sample(range(1, n), random.randint(1, 3)))
        ops = []
        for i, (s, e) in enumerate(zip([0, *cuts], [*cuts, n], strict=True)):
            shard = f"{tag}_{how}{i}"
            refs = _save(root, shard, {"w": g.narrow(dim, s, e - s).clone()})
            ops.append(CopyOp(shard, refs["w"], None, (dim, s, e - s)))
        return _plan(tag, g.dtype, ops)
    if how == "joined":  # column blocks of one saved matrix (a whole-tensor chunk read as TP pieces)
        half = cols // 2
        refs = _save(root, f"{tag}_joined", {"a": g.clone()})
        full = refs["a"]
        left = type(full)(full.file, full.storage, full.offset, (rows, half), full.stride)
        right = type(full)(full.file, full.storage, full.offset + half, (rows, cols - half), full.stride)
        return _plan(tag, g.dtype, [CopyOp(f"{tag}_joined", left, None, (1, 0, half)),
                                    CopyOp(f"{tag}_joined", right, None, (1, half, cols - half))])
    if how == "shifted":  # rows taken from the middle of a bigger saved tensor (a source narrowed along its rows)
        refs = _save(root, f"{tag}_shifted", {"w": torch.cat([torch.full((2, cols), 9.0, dtype=g.dtype), g])})
        return _plan(tag, g.dtype, [CopyOp(f"{tag}_shifted", refs["w"], (0, 2, rows), (0, 0, rows))])
    assert how == "strided"  # the pieces are column slices of wider saved tensors (rows a pitch apart)
    wide = torch.cat([g, torch.zeros(rows, 3, dtype=g.dtype)], dim=1)
    refs = _save(root, f"{tag}_strided", {"w": wide})
    w = refs["w"]
    view = type(w)(w.file, w.storage, w.offset, (rows, cols), w.stride)
    return _plan(tag, g.dtype, [CopyOp(f"{tag}_strided", view, (1, 0, cols), (1, 0, cols))])


WAYS = ["whole", "rows", "cols", "joined", "strided", "shifted"]


ROW_WAYS = {"whole", "rows", "shifted"}  # whole rows back to back: compared mapped


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read"])
@pytest.mark.parametrize("x", WAYS)
@pytest.mark.parametrize("y", WAYS)
def test_any_cut_of_a_tensor_against_any_other(tmp_path, monkeypatch, x, y, mapped):
    """One global tensor cut two ways (whole, row pieces, column pieces, joined column blocks, strided slices, rows
    from the middle of a bigger tensor) and read in blocks of 1..4 rows, at most two buffers a preadv, and reads that
    come back short (every other call fills at most 7 bytes, as a signal may cut one) — or, where both sides are whole
    rows, compared mapped in windows of a few bytes (not page-aligned; without mapping: read): equal; one changed bit
    anywhere (the sign of a zero, a NaN's payload, a low mantissa bit) is found."""
    random.seed(f"{x}-{y}-{mapped}")
    monkeypatch.setattr(lockstep, "_IOV_MAX", 2)
    monkeypatch.setattr(lockstep, "MAP_WINDOW", random.randint(1, 3) * 4 * GLOBAL[1] + random.randint(1, 7))
    real, calls = os.preadv, [0]

    def short(fd, buffers, offset):
        calls[0] += 1
        return real(fd, [buffers[0][:7]] if calls[0] % 2 else buffers, offset)

    monkeypatch.setattr(os, "preadv", short)
    g = torch.randn(GLOBAL)
    g[1, 2] = 0.0
    g[3, 4] = float("nan")
    root = str(tmp_path)
    pa = _cut(root, g, x, "a")
    reader = lockstep.LockstepReader(block_bytes=random.randint(1, 4) * GLOBAL[1] * 4)
    if not mapped:
        reader._maps = None  # as where there is no libc to map with
    files = SourceFiles(root)
    try:
        pb = _cut(root, g, y, "b")
        assert reader.equal(pa, pb, files, files, None) is True, (x, y)
        same_blocks = x == y == "joined" or (x == y == "cols" and [o.dst for o in pa.ops] == [o.dst for o in pb.ops])
        # the mapped way where both are rows or the same column blocks, else read
        assert (calls[0] == 0) == (mapped and ({x, y} <= ROW_WAYS or same_blocks))
        for r, c in ((1, 2), (5, random.randrange(GLOBAL[1])), (3, 4)):
            h = g.clone()
            if r == 1:
                h[r, c] = -0.0  # numerically equal, another sign bit
            elif r == 5:
                h.view(torch.int32)[r, c] ^= 1  # the lowest mantissa bit
            else:
                h.view(torch.int32)[r, c] = 0x7FC00001  # a NaN with another payload
            pc = _cut(root, h, y, f"c{r}")
            assert reader.equal(pa, pc, files, files, None) is False, (x, y, r, c)
    finally:
        reader.close()
        files.close()


def test_what_cannot_be_read_in_lockstep_is_left_to_the_caller(tmp_path):
    """No answer (None), never a wrong one: a piece of another dtype than the plan's, a transposed (column-major)
    piece, a gap between pieces or rows no piece covers, a file cut short or removed after it was opened."""
    g = torch.randn(GLOBAL)
    root = str(tmp_path)
    whole = _cut(root, g, "whole", "w")
    files, reader = SourceFiles(root), lockstep.LockstepReader()
    try:
        half = _save(root, "half", {"w": g.half()})["w"]
        assert reader.equal(whole, _plan("h", torch.float32, [CopyOp("half", half, None, None)]), files, files,
                            None) is None
        t = _save(root, "t", {"w": g.t().contiguous()})["w"]
        transposed = type(t)(t.file, t.storage, t.offset, GLOBAL, (1, GLOBAL[0]))
        assert reader.equal(whole, _plan("t", torch.float32, [CopyOp("t", transposed, None, None)]), files, files,
                            None) is None
        top = _save(root, "top", {"w": g[:2].clone()})["w"]
        bottom = _save(root, "bottom", {"w": g[3:].clone()})["w"]
        gap = _plan("g", torch.float32, [CopyOp("top", top, None, (0, 0, 2)), CopyOp("bottom", bottom, None, (0, 3, 3))])
        assert reader.equal(whole, gap, files, files, None) is None
        short = _plan("s", torch.float32, [CopyOp("top", top, None, (0, 0, 2))])  # the last rows from nowhere
        assert reader.equal(whole, short, files, files, None) is None
        cut = _cut(root, g, "whole", "cut")
        path = os.path.join(root, "cut_whole", "model_optim_rng.pt")
        files.extent("cut_whole", cut.ops[0].ref)  # opened (its metadata read) before the file shrinks
        with open(path, "r+b") as fh:
            fh.truncate(64)
        assert reader.equal(whole, cut, files, files, None) is None
        gone = _cut(root, g, "whole", "gone")
        files.extent("gone_whole", gone.ops[0].ref)
        os.remove(os.path.join(root, "gone_whole", "model_optim_rng.pt"))  # removed after its metadata was read
        assert reader.equal(whole, gone, files, files, None) is None
    finally:
        reader.close()
        files.close()


def test_the_same_column_blocks_on_both_sides_are_compared_block_against_block(tmp_path, monkeypatch):
    """A row-parallel weight at the same TP on both sides (three column blocks, each its own file): compared mapped,
    block against block, nothing read; a changed element in any block is found; blocks cut elsewhere are read."""
    monkeypatch.setattr(lockstep, "MAP_WINDOW", 4 * 5)
    reads = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda *a: reads.append(1) or real(*a))
    g = torch.randn(GLOBAL)
    root = str(tmp_path)

    def cols(t, tag, cuts):
        ops = []
        for i, (s, e) in enumerate(zip([0, *cuts], [*cuts, GLOBAL[1]], strict=True)):
            ref = _save(root, f"{tag}{i}", {"w": t[:, s:e].clone()})["w"]
            ops.append(CopyOp(f"{tag}{i}", ref, None, (1, s, e - s)))
        return _plan(tag, t.dtype, ops)

    files, reader = SourceFiles(root), lockstep.LockstepReader()
    try:
        a = cols(g, "a", [3, 7])
        assert reader.equal(a, cols(g, "b", [3, 7]), files, files, None) is True and not reads
        for r, c in ((0, 0), (5, 9), (2, 4)):
            h = g.clone()
            h.view(torch.int32)[r, c] ^= 1
            assert reader.equal(a, cols(h, f"c{r}_", [3, 7]), files, files, None) is False, (r, c)
        assert not reads
        assert reader.equal(a, cols(g, "d", [3, 6]), files, files, None) is True and reads  # other blocks: read
    finally:
        reader.close()
        files.close()


def test_a_mapped_file_that_shrinks_is_left_to_the_caller(tmp_path):
    """A file compared mapped once and cut short afterwards is not touched past its new end (that would be SIGBUS):
    no answer, and the caller's path names the file."""
    g = torch.randn(GLOBAL)
    root = str(tmp_path)
    a, b = _cut(root, g, "whole", "a"), _cut(root, g, "rows", "b")
    files, reader = SourceFiles(root), lockstep.LockstepReader()
    try:
        assert reader.equal(a, b, files, files, None) is True
        assert reader._maps  # mapped
        path, offset, _ = files.extent("a_whole", a.ops[0].ref)
        with open(path, "r+b") as fh:
            fh.truncate(offset + 4)  # inside the tensor's first row
        assert reader.equal(a, b, files, files, None) is None
    finally:
        reader.close()
        files.close()


def test_vocab_rows_beyond_the_real_vocab_are_not_compared(tmp_path):
    g = torch.randn(GLOBAL)
    h = g.clone()
    h[4:] = 7.0  # padding rows that differ
    root = str(tmp_path)
    files, reader = SourceFiles(root), lockstep.LockstepReader()
    try:
        a, b = _cut(root, g, "rows", "a"), _cut(root, h, "rows", "b")
        assert reader.equal(a, b, files, files, 4) is True
        assert reader.equal(a, b, files, files, 5) is False
    finally:
        reader.close()
        files.close()


def test_a_tensor_split_along_its_last_dim_of_three_reads_each_rows_parts_into_place(tmp_path):
    """A 3-D tensor split along dim 2 (each row of a piece lands as one part per index of dim 1) against it whole:
    equal; one changed element is found."""
    g = torch.randn(5, 3, 8)
    root = str(tmp_path)
    whole = _save(root, "whole3", {"w": g.clone()})["w"]
    ops = []
    for i, (s, e) in enumerate(((0, 3), (3, 8))):
        ref = _save(root, f"part3_{i}", {"w": g[:, :, s:e].clone()})["w"]
        ops.append(CopyOp(f"part3_{i}", ref, None, (2, s, e - s)))
    h = g.clone()
    h[4, 2, 6] += 1.0
    changed = _save(root, "changed3", {"w": h})["w"]
    files, reader = SourceFiles(root), lockstep.LockstepReader(block_bytes=2 * 3 * 8 * 4)
    try:
        split = TensorPlan("model", "s", (5, 3, 8), torch.float32, ops)
        assert reader.equal(TensorPlan("model", "w", (5, 3, 8), torch.float32, [CopyOp("whole3", whole, None, None)]),
                            split, files, files, None) is True
        assert reader.equal(TensorPlan("model", "c", (5, 3, 8), torch.float32, [CopyOp("changed3", changed, None, None)]),
                            split, files, files, None) is False
    finally:
        reader.close()
        files.close()

"""The byte ranges a rank's plan reads (Resharder.byte_ranges) are all it reads: a copy of the checkpoint with every
other tensor byte zeroed (what a staged remote mirror holds: the metadata, and the holes never fetched) builds the same
state dict, model and optimizer, as the original — torch_dist with a dp_reshardable distributed optimizer, an MoE
model, and an HF model in FP8 (rows and scale rows only)."""

from __future__ import annotations

import os
import shutil

import pytest

torch = pytest.importorskip("torch")

from megatron_preflight.layout.dist import object_index, read_dcp_metadata  # noqa: E402
from megatron_preflight.remote.mirror import _is_tensor_file  # noqa: E402
from megatron_preflight.reshard import SourceFiles, TargetLayout, build_tree, open_resharder  # noqa: E402
from megatron_preflight.reshard.sources.byte_ranges import total  # noqa: E402
from tests.conftest import fixture_path  # noqa: E402


def _keep_metadata(root: str, keep: dict) -> None:
    """What a verdict's staging fetches: non-tensor files whole, torch_dist items, safetensors headers."""
    for dirpath, _d, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            if f.endswith(".safetensors"):
                with open(p, "rb") as fh:
                    keep.setdefault(p, []).append((0, 8 + int.from_bytes(fh.read(8), "little")))
            elif f == ".metadata":
                for info in object_index(read_dcp_metadata(dirpath)).values():
                    keep.setdefault(os.path.join(dirpath, info.relative_path), []).append((info.offset, info.length))
    for dirpath, _d, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            if not _is_tensor_file(os.path.relpath(p, root)):
                continue
            with open(p, "rb") as fh:
                data = fh.read()
            out = bytearray(len(data))
            for o, n in keep.get(p, []):
                out[o:o + n] = data[o:o + n]
            with open(p, "wb") as fh:
                fh.write(out)


def _state(r, plan) -> dict:
    state = r.build(plan)
    if plan.dist_optimizer is not None:
        files = SourceFiles(r.layout.iter_dir or "", trust=False)
        try:
            r.check_masters(files, shards=set(plan.sources))
            state["dist"] = build_tree(plan.dist_optimizer, files)
        finally:
            files.close()
    return state


def _equal(a, b, where="") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _equal(x, y, f"{where}[{i}]")


def _holed(src: str, dst: str, target: TargetLayout, coords: dict, name: str):
    shutil.copytree(src, dst)
    r = open_resharder(dst, target)
    plan = r.plan_for_coords(coords, name)
    ranges = r.byte_ranges(plan)
    _keep_metadata(dst, {k: list(v) for k, v in ranges.items()})
    return r, plan, ranges


@pytest.mark.parametrize("fixture, target, coords, name", [
    ("distopt_dpr_tp2dp2_torch_dist", TargetLayout(tp=1, pp=2, distributed_optimizer=True),
     {"tp": 0, "pp": 1, "ep": 0, "etp": 0}, "mp_rank_00_001"),
    ("moe_shared_tp2pp2ep2_torch_dist", TargetLayout(tp=1, pp=1, ep=4, etp=1),
     {"tp": 0, "pp": 0, "ep": 3, "etp": 0}, "mp_rank_00_003"),
], ids=["dp_reshardable distopt -> pp2 stage 1", "moe tp2pp2ep2 -> ep4 rank 3"])
def test_a_plan_reads_nothing_outside_its_byte_ranges(tmp_path, fixture, target, coords, name):
    r, plan, ranges = _holed(fixture_path(fixture), str(tmp_path / "holed"), target, coords, name)
    assert total(ranges) < sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(fixture_path(fixture))
                               for f in fs)
    want = _state(open_resharder(fixture_path(fixture), target), plan_for(fixture, target, coords, name))
    _equal(_state(r, plan), want)


def plan_for(fixture, target, coords, name):
    return open_resharder(fixture_path(fixture), target).plan_for_coords(coords, name)


def test_an_fp8_model_is_read_by_its_rows_and_their_scale_rows(tmp_path):
    from tests.helpers import hf_models

    fp8, _ = hf_models.write_fp8(hf_models.write("qwen3", str(tmp_path / "bf16")), str(tmp_path / "fp8"))
    target = TargetLayout(tp=2)
    coords = {"tp": 1, "pp": 0, "ep": 0, "etp": 0}
    want = _state(open_resharder(fp8, target), open_resharder(fp8, target).plan_for_coords(coords, "mp_rank_01"))
    r, plan, ranges = _holed(fp8, str(tmp_path / "holed"), target, coords, "mp_rank_01")
    weights = sum(os.path.getsize(os.path.join(fp8, f)) for f in os.listdir(fp8) if f.endswith(".safetensors"))
    assert total(ranges) < 0.75 * weights  # half the split rows (TP2), and the replicated ones whole
    _equal(_state(r, plan), want)


@pytest.mark.parametrize("form", ["int4", "channel"])
def test_a_compressed_model_is_read_by_its_rows_their_scales_and_shapes(tmp_path, form):
    """llm-compressor's forms (packed INT4 per group, FP8 per channel): the bytes a rank's plan names are all it
    reads — a packed weight's stored weight_shape among them (checked as its rows are read: a hole there would read
    as zeros and be refused)."""
    from tests.helpers import hf_models

    src = hf_models.write("qwen3", str(tmp_path / "bf16"))
    model, _ = hf_models.write_compressed_int(src, str(tmp_path / "m"), 4, 16) if form == "int4" else \
        hf_models.write_compressed_fp8(src, str(tmp_path / "m"), "channel")
    target = TargetLayout(tp=2)
    coords = {"tp": 1, "pp": 0, "ep": 0, "etp": 0}
    want = _state(open_resharder(model, target), open_resharder(model, target).plan_for_coords(coords, "mp_rank_01"))
    r, plan, ranges = _holed(model, str(tmp_path / "holed"), target, coords, "mp_rank_01")
    weights = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model) if f.endswith(".safetensors"))
    assert total(ranges) < 0.75 * weights
    _equal(_state(r, plan), want)

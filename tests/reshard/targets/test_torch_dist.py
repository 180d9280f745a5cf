"""torch_dist as a target: `reshard --ckpt-format torch_dist` writes Megatron's default format from any source.

Read back through the torch_dist reader (dist_source), the written checkpoint must hold exactly the source's tensors:
legacy -> torch_dist -> (read as legacy shards) equals the legacy source bit for bit, key for key, in order.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_preflight.errors import PreflightError
from megatron_preflight.layout.discover import discover
from megatron_preflight.layout.model import Format
from megatron_preflight.reshard import write_resharded
from megatron_preflight.reshard.sources.torch_dist import virtual_layout
from megatron_preflight.reshard.sources.torch_dist_reader import dist_reader
from megatron_preflight.reshard.target import TargetLayout
from megatron_preflight.torch_file import TensorRef, TorchFile
from tests.conftest import fixture_path


def same_layout(name: str) -> TargetLayout:
    """The source's own layout, as a run with its saved args would ask for it."""
    import dataclasses

    return dataclasses.replace(TargetLayout.from_args(discover(fixture_path(name)).saved_args), ckpt_format="torch_dist")


@pytest.mark.parametrize("name", ["tp2_torch", "moe_ep2_torch", "bf16_gqa_tp2_torch", "moe_shared_tp2pp2ep2_torch",
                                  "vpp_qkln_pp2_torch", "acct_emb_pp2_torch", "fp16_qkln_tp2_torch",
                                  "distopt_moe_ep2dp2_torch", "tp2_torch_dist", "hyb_tp2_torch",
                                  "hyb_distopt_pp2ep2_torch"])
def test_round_trip_through_torch_dist_is_bit_exact(tmp_path, name):
    out = str(tmp_path / "dist")
    s = write_resharded(fixture_path(name), out, same_layout(name), drop_optimizer=True)
    assert s.bytes_written > 0
    written = discover(out)
    assert written.format == Format.TORCH_DIST and written.ok, written.problems
    assert written.saved_args.ckpt_format == "torch_dist" and written.saved_args.no_save_optim
    with open(os.path.join(out, "iter_0000002", "metadata.json")) as fh:
        assert json.load(fh)["sharded_backend"] == "torch_dist"
    back, _ = virtual_layout(written)
    source = discover(fixture_path(name))
    if source.format == Format.TORCH_DIST:
        source, _ = virtual_layout(source)
    reader = dist_reader(back.iter_dir)
    src_reader = dist_reader(source.iter_dir) if name.endswith("_torch_dist") else None
    try:
        assert sorted(s.name for s in back.shards) == sorted(s.name for s in source.shards)
        for shard in source.shards:
            mine = next(s for s in back.shards if s.name == shard.name)
            chunks = [k for k in shard.meta if k == "model" or (k.startswith("model") and k[5:].isdigit())]
            with TorchFile(os.path.join(shard.path, "model_optim_rng.pt")) if src_reader is None else _Null() as f:
                for ck in chunks:
                    want, got = shard.meta[ck], mine.meta[ck]
                    assert list(got) == list(want), (shard.name, ck)
                    for key, value in want.items():
                        if isinstance(value, TensorRef):
                            expected = f.tensor(value) if src_reader is None else src_reader.tensor("", value)
                            back_value = got[key] if isinstance(got[key], torch.Tensor) else reader.tensor("", got[key])
                            assert torch.equal(back_value, expected), (shard.name, key)  # (an extra state: a value)
                        else:
                            assert got[key] == value, (shard.name, key)
    finally:
        reader.close()
        if src_reader is not None:
            src_reader.close()


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("name", ["tp2_torch", "bf16_gqa_tp2_torch", "fp16_qkln_tp2_torch", "moe_ep2_torch",
                                  "distopt_tp2dp2_torch", "distopt_moe_ep2dp2_torch", "distopt_bf16_tp2dp2_torch"])
def test_round_trip_with_the_optimizer_state_is_bit_exact(tmp_path, name):
    """legacy -> torch_dist (weights and optimizer state in model space) -> legacy: every value of every written file
    (weights, moments, masters, steps, param groups, grad scaler, distrib_optim.pt) equals the legacy source's own
    reshard at that layout."""
    import dataclasses

    from tests.reshard.sources.test_torch_dist import saved_state

    same = TargetLayout.from_args(discover(fixture_path(name)).saved_args)
    td, back, ref = str(tmp_path / "td"), str(tmp_path / "back"), str(tmp_path / "ref")
    s = write_resharded(fixture_path(name), td, dataclasses.replace(same, ckpt_format="torch_dist"), verify=True)
    assert s.verified_tensors > 0
    written = discover(td)
    assert written.ok and not written.saved_args.no_save_optim
    distributed = bool(discover(fixture_path(name)).distributed_optimizer)
    assert written.dist_optimizer_sharding == ("fully_reshardable" if distributed else None)
    write_resharded(td, back, dataclasses.replace(same, ckpt_format="torch"))
    write_resharded(fixture_path(name), ref, same)
    got, want = saved_state(back), saved_state(ref)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert isinstance(got[key], torch.Tensor) and got[key].dtype == value.dtype, key
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def test_the_run_flags_choose_the_output_format(tmp_path, capsys):
    from megatron_preflight.cli.main import main

    flags = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--vocab-size", "100", "--tensor-model-parallel-size", "1"]
    assert main(["reshard", fixture_path("tp2_torch"), str(tmp_path / "a"), "--drop-optimizer", "--no-progress",
                 "--", *flags, "--ckpt-format", "torch_dist"]) == 0
    assert discover(str(tmp_path / "a")).format == Format.TORCH_DIST
    assert main(["reshard", fixture_path("tp2_torch"), str(tmp_path / "b"), "--drop-optimizer", "--no-progress",
                 "--", *flags]) == 0  # no --ckpt-format among the flags: legacy, as before
    assert discover(str(tmp_path / "b")).format == Format.TORCH


def test_verify_catches_a_damaged_chunk(tmp_path, monkeypatch):
    """--verify re-reads every written chunk: one byte flipped in the data file after it was written is caught."""
    from megatron_preflight.reshard.targets import torch_dist as dist_target

    original = dist_target.ChunkWriter.close

    def close_and_flip(self):
        original(self)
        with open(self.fh.name, "r+b") as fh:
            item = next(it for it in self.items if it.offsets is not None and it.length > 2000)
            fh.seek(item.start + item.length // 2)  # the tensor bytes are the bulk of its record
            byte = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([byte[0] ^ 0xFF]))

    monkeypatch.setattr(dist_target.ChunkWriter, "close", close_and_flip)
    with pytest.raises(PreflightError, match="verify"):
        write_resharded(fixture_path("tp2_torch"), str(tmp_path / "td"), TargetLayout(ckpt_format="torch_dist"),
                        verify=True)
    assert not (tmp_path / "td").exists()


def test_the_vocab_is_padded_for_the_target_tp(tmp_path):
    """A torch_dist output for a TP4 run holds the embedding padded as a TP4 run builds it (100 -> 512 rows), and it
    reads back as TP4 legacy shards equal to a direct legacy reshard to TP4."""
    out, ref = str(tmp_path / "td"), str(tmp_path / "ref")
    write_resharded(fixture_path("tp2_torch"), out, TargetLayout(tp=4, ckpt_format="torch_dist"), drop_optimizer=True,
                    verify=True)
    written = discover(out)
    assert written.dist_tensors["embedding.word_embeddings.weight"][0] == (512, 32)
    assert written.saved_args.padded_vocab_size == 512 and written.tp == 4
    write_resharded(fixture_path("tp2_torch"), ref, TargetLayout(tp=4), drop_optimizer=True)
    back, _ = virtual_layout(written)
    reader = dist_reader(back.iter_dir)
    try:
        for shard in discover(ref).shards:
            mine = next(s for s in back.shards if s.name == shard.name)
            with TorchFile(os.path.join(shard.path, "model_optim_rng.pt")) as f:
                for key, value in shard.meta["model"].items():
                    if isinstance(value, TensorRef):
                        assert torch.equal(reader.tensor("", mine.meta["model"][key]), f.tensor(value)), key
    finally:
        reader.close()


# Every legacy fixture with a torch_dist twin saved by Megatron with the same flags (LOCAL_FIXTURES.md). The twins of
# the distributed-optimizer fixtures were saved --dist-ckpt-optim-fully-reshardable: the form written here.
TWINS = ["tp2_torch", "bf16_gqa_tp2_torch", "fp16_qkln_tp2_torch", "vpp_qkln_pp2_torch", "acct_emb_pp2_torch",
         "declr_tp2_torch", "moe_ep2_torch", "moe_shared_tp2pp2ep2_torch", "distopt_tp2dp2_torch",
         "distopt_bf16_tp2dp2_torch", "distopt_moe_ep2dp2_torch", "distopt_vpp_pp2dp2_torch",
         "distopt_buckets_tp2dp2_torch", "v14_tp2_torch",
         # Transformer Engine spec through the CPU stand-in (te_cpu; not Transformer Engine): extra states as
         # sharded objects, MLA, MTP (its inner layer named `transformer_layer`), TE-grouped experts of an MTP layer
         "te_tp2_torch", "mla_te_tp2_torch", "mtp_te_tp2pp2_torch", "mtp_te_distopt_pp2dp2_torch",
         "mtp_moe_te_ep2_torch",
         # HybridModel (te_cpu and mamba_cpu stand-ins): per-layer keys, each section of a Mamba / gated delta net
         # projection a global tensor of its own, the MTP stack as `mtp_model_layer.layers.{j}`, the head's extra state
         "hyb_tp2_torch", "hyb_vpp_pp2_torch", "hyb_distopt_pp2ep2_torch"]
# not carried (RNG: --no-load-rng), or kept where every release reads it (common_state: Megatron-LM main keeps the
# common state in the .distcp files; common.pt, written here, is read by main and by every older release)
_NOT_WRITTEN = ("rng_state/", "rerun_state_machine_state/", "common_state")


@pytest.mark.parametrize("name", TWINS)
def test_written_torch_dist_names_what_megatrons_own_twin_names(tmp_path, name):
    """The torch_dist written from a legacy checkpoint holds the global tensors and sharded objects Megatron's own
    torch_dist save of the same run holds: the same keys (Megatron's loader asks for every one: a missing extra state
    fails its load with 'Missing key in checkpoint state_dict'), global shapes and dtypes, and the same objects."""
    from megatron_preflight.layout.dist import object_index, read_dcp_metadata, read_object

    out = str(tmp_path / "dist")
    write_resharded(fixture_path(name), out, same_layout(name))
    twin = discover(fixture_path(name + "_dist"))
    mine_dir = discover(out).iter_dir
    theirs, mine = read_dcp_metadata(twin.iter_dir), read_dcp_metadata(mine_dir)
    want = {k: v for k, v in theirs.state_dict_metadata.items() if not k.startswith(_NOT_WRITTEN)}
    got = mine.state_dict_metadata
    assert sorted(set(want) - set(got)) == [] and sorted(set(got) - set(want)) == []
    for key, meta in want.items():
        assert type(got[key]).__name__ == type(meta).__name__, key
        if hasattr(meta, "size"):
            assert (tuple(got[key].size), got[key].properties.dtype) == (tuple(meta.size), meta.properties.dtype), key
    their_objects, my_objects = object_index(theirs), object_index(mine)
    for key in want:
        if key in their_objects:
            a = read_object(twin.iter_dir, key, their_objects[key], tensors=True)
            b = read_object(mine_dir, key, my_objects[key], tensors=True)
            assert type(a) is type(b) and (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), key
    # the optimizer's common state: param groups (their settings, order and where the Adam step is kept) and the
    # parts of a chained optimizer, as Megatron saved them
    ours, megatrons = _shape_of(discover(out).common_state["optimizer"]), _shape_of(twin.common_state["optimizer"])
    steps = {g["step"] for g in _groups(ours) if "step" in g}
    for mine, their in zip(_groups(ours), _groups(megatrons), strict=True):
        if "step" in mine and "step" not in their:  # Megatron's: a group its saving rank never stepped (no
            # parameter there: a pipeline stage without experts) is saved without its step, and its own load restarts
            # Adam's bias correction for it; ours keeps the checkpoint's step (the same as every other group's)
            assert mine.pop("step") in steps and len(steps) == 1
    assert ours == megatrons


def _groups(value):
    """Every param group in a common state's optimizer entry, in order."""
    if isinstance(value, dict):
        return [g for k, v in value.items() for g in (v if k == "param_groups" else _groups(v))]
    return []


def _shape_of(value):
    """A common-state value with its tensors as (shape, dtype) and lists of groups as lists (comparable)."""
    if isinstance(value, dict):  # (an empty param_state: the saving rank held no parameter of that part)
        return {k: _shape_of(v) for k, v in value.items() if not (k == "param_state" and v == {})}
    if isinstance(value, (list, tuple)) and not (value and isinstance(value[0], float)):
        return [_shape_of(v) for v in value]
    if isinstance(value, (TensorRef, torch.Tensor)):
        return ("tensor", tuple(value.shape), str(value.dtype))
    return value


def test_an_objects_blob_is_reused_only_for_an_equal_value(tmp_path):
    """A sharded object's blob is saved once per distinct value (TE's extra states: thousands, a few distinct) and
    every copy loads back as its own value; an object the key does not cover is saved each time."""
    import io

    import torch

    from megatron_preflight.reshard.targets.torch_dist import ChunkWriter, _object_key

    w = ChunkWriter(str(tmp_path))
    values = [io.BytesIO(b"a"), io.BytesIO(b"a"), io.BytesIO(b"b"), None, torch.tensor([1, 2], dtype=torch.uint8),
              torch.tensor([1, 3], dtype=torch.uint8), {"other": 1}]
    for i, v in enumerate(values):
        w.obj(f"x{i}/shard_0_1", v)
    w.close()
    assert len(w._objects) == 5 and _object_key([{"other": 1}]) is None
    raw = (tmp_path / w.items[0].file).read_bytes()
    for item, v in zip(w.items, values, strict=True):
        got = torch.load(io.BytesIO(raw[item.start:item.start + item.length]), weights_only=False)[0]
        if isinstance(v, io.BytesIO):
            assert got.getvalue() == v.getvalue()
        elif isinstance(v, torch.Tensor):
            assert torch.equal(got, v)
        else:
            assert got == v

"""Transformer-Engine-spec key names and TE ``_extra_state`` values.

FAKE, named as such: Transformer Engine cannot run on this CPU machine, so a real local-spec Megatron-LM checkpoint
(tp2_torch) is renamed to the TE spec's fused-layernorm names (``self_attention.linear_qkv.layer_norm_*``,
``mlp.linear_fc1.layer_norm_*``) and given ``io.BytesIO`` extra states, the form TE saves its FP8 metadata in. It must
be read safely and reshard TP2 -> TP1 -> TP2 bit-exact, optimizer state included.
"""

import io
import os
from collections import OrderedDict

import torch

from megatron_preflight import pickling
from megatron_preflight.layout import naming
from megatron_preflight.layout.discover import discover
from megatron_preflight.reshard import write_resharded
from megatron_preflight.reshard.resharder import open_resharder
from megatron_preflight.reshard.target import TargetLayout
from tests.conftest import fixture_path
from tests.reshard.test_roundtrip_real import assert_same_optimizer, model_tensors, optimizer_entries

TE_NAMES = {".input_layernorm.": ".self_attention.linear_qkv.layer_norm_",
            ".pre_mlp_layernorm.": ".mlp.linear_fc1.layer_norm_"}


def _te_name(key):
    for a, b in TE_NAMES.items():
        if a in key:
            head, tail = key.split(a)
            return f"{head}{b}{tail}"
    return key


def make_te_checkpoint(root):
    r = open_resharder(fixture_path("tp2_torch"), TargetLayout())
    iter_dir = os.path.join(root, "iter_0000002")
    for name, coords in naming.shard_writers(r.tgt).items():
        sd = r.build(r.plan_for_coords(coords, name))
        sd["model"] = OrderedDict(
            (_te_name(k), io.BytesIO(f"fp8-meta:{name}:{k}".encode()) if k.endswith("_extra_state") else v)
            for k, v in sd["model"].items())
        os.makedirs(os.path.join(iter_dir, name))
        torch.save(sd, os.path.join(iter_dir, name, "model_optim_rng.pt"), pickle_module=pickling)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("2")


def _plain(entries):
    return {k: ((v.getvalue(), r) if isinstance(v, io.BytesIO) else (v, r)) for k, (v, r) in entries.items()}


def test_te_spec_names_and_bytesio_extra_state_roundtrip(tmp_path):
    src, mid, back = str(tmp_path / "te"), str(tmp_path / "tp1"), str(tmp_path / "back")
    make_te_checkpoint(src)
    layout = discover(src)
    assert layout.ok, layout.problems  # BytesIO is read as an inert buffer, no --trust-checkpoint needed
    write_resharded(src, mid, TargetLayout(tp=1), verify=True)
    keys = list(discover(mid).shards[0].meta["model"])
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in keys
    assert not any("input_layernorm" in k for k in keys)
    write_resharded(mid, back, TargetLayout(tp=2), verify=True)
    a, b = _plain(model_tensors(src)), _plain(model_tensors(back))
    assert list(a) == list(b)
    for k in a:
        (x, tp_rank), (y, _) = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if x.shape[0] == 128:  # vocab rows: the real ones exact (padding is re-made at TP1)
                real = max(0, min(128, 100 - tp_rank * 128))
                assert torch.equal(x[:real], y[:real]), k
            else:
                assert torch.equal(x, y), k
        elif k[2].endswith("_extra_state"):
            assert y.startswith(b"fp8-meta:mp_rank_00:"), k  # carried from TP rank 0, as Megatron's converter does
        else:
            assert x == y, k
    assert_same_optimizer(optimizer_entries(src), optimizer_entries(back))

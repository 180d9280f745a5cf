"""Where a run rank's tensors sit in the checkpoint's global tensors, and under which name (what --preflight verify
hashes). A run whose layer spec differs from the checkpoint's (a TE-spec checkpoint resumed by a local-spec run, and
back) holds renamed tensors: verify must look them up under the checkpoint's own names, or it reports every renamed
tensor as "in the checkpoint, but no rank holds it" (found by the real-Megatron resume tests)."""

import pytest

from megatron_preflight.layout import naming
from megatron_preflight.prove import fingerprint, placement
from megatron_preflight.reshard import TargetLayout
from megatron_preflight.reshard.resharder import open_resharder
from megatron_preflight.reshard.sources.files import SourceFiles
from tests.conftest import fixture_path


@pytest.mark.parametrize("source, target", [
    ("te_tp2_torch", TargetLayout(tp=2, transformer_impl="local")),  # TE -> local spec: fused norms renamed
    ("tp2_torch", TargetLayout(tp=1, transformer_impl="transformer_engine")),  # local -> TE
    ("te_tp2_torch", TargetLayout(tp=1)),  # the checkpoint's own spec: no rename
])
def test_every_rank_slice_digests_to_the_checkpoints_fingerprint_under_its_checkpoint_name(source, target):
    root = fixture_path(source)
    stored = fingerprint.fingerprint_checkpoint(root, weights_only=True)["tensors"]
    r = open_resharder(root, target, keep_optimizer=False)
    parts: dict[str, dict[tuple, int]] = {}  # name -> {offsets: digest}: a replica is one box, counted once
    renamed = 0
    files = SourceFiles(r.layout.iter_dir or "")
    try:
        for name, coords in naming.shard_writers(r.tgt).items():
            for tp in r.plan_for_coords(coords, name).tensors:
                if tp.gkey is None or tp.shape is None or tp.key.endswith("_extra_state"):
                    continue
                value = placement.expected(tp, files)  # what the run holds after a correct load
                key = placement.checkpoint_name(r, tp)
                renamed += key != placement.global_name(r, tp)
                for local, gshape, offsets in placement.boxes(r, tp, coords):
                    parts.setdefault(key, {})[tuple(offsets)] = fingerprint.digest_box(value[local], gshape, offsets)
    finally:
        files.close()
    assert set(parts) == {n for n in stored if not n.endswith("_extra_state")}
    for key, digests in parts.items():
        assert f"{fingerprint.combine(list(digests.values())):016x}" == stored[key]["digest"], key
    assert (renamed > 0) == (target.transformer_impl is not None)

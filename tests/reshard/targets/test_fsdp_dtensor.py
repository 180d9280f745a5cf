"""The fsdp_dtensor writer: every real Megatron-FSDP checkpoint (written by Megatron-LM's pretrain_gpt.py with the
Transformer Engine CPU stand-in, tests/fixtures/megatron-lm/LOCAL_FIXTURES.md), taken to torch_dist and written back
as fsdp_dtensor, has the original's keys, shapes and dtypes, its common state and group settings, and tensor for
tensor its content; a 3D-parallel twin written as fsdp_dtensor equals the Megatron-FSDP save of the same state. That
Megatron-FSDP resumes what it writes is tested against real Megatron-LM in tests/hook/test_megatron_fsdp.py."""

from __future__ import annotations

import pytest

from megatron_preflight.layout.discover import discover
from megatron_preflight.layout.dist import ObjectReader, object_index, read_dcp_metadata
from megatron_preflight.prove.diff import diff_checkpoints
from megatron_preflight.reshard import TargetLayout, write_resharded
from megatron_preflight.reshard.sources.fsdp_dtensor import aliases
from tests.conftest import fixture_path

FSDP = ["fsdp_dp2", "fsdp_tp2dp2", "fsdp_moe_ep2", "fsdp_dp2_bf16_swiglu", "fsdp_grouped_tp2ep2_bf16",
        "fsdp_gqa_untied_rope", "fsdp_mtp", "fsdp_shared_ep4dp4", "fsdp_v019_bf16_swiglu"]
NOT_WRITTEN = ("rng_state.",)  # a 3D layout's RNG does not map onto Megatron-FSDP's ranks (--no-load-rng)


def _entries(root: str) -> tuple[dict, dict]:
    """(tensor fqn -> (shape, dtype), bytes item fqn -> value) of an fsdp_dtensor iteration dir."""
    it = discover(root).iter_dir
    md = read_dcp_metadata(it)
    tensors = {k: (tuple(v.size), str(v.properties.dtype)) for k, v in md.state_dict_metadata.items()
               if hasattr(v, "size")}
    reader = ObjectReader(it)
    try:
        objects = {k: reader.read(k, info) for k, info in object_index(md).items() if k != "args"}
    finally:
        reader.close()
    return tensors, objects


def _split_aliases(got: dict, want: dict) -> tuple[dict, dict]:
    """(``got``'s entries that ``want`` names, the rest); each of the rest an alias of a named one, alike."""
    named = {k: v for k, v in got.items() if k in want}
    rest = {k: v for k, v in got.items() if k not in want}
    for k, v in rest.items():
        twins = [a for a in aliases(k) if a in named]
        assert twins and all(repr(named[a]) == repr(v) for a in twins), k
    return named, rest


@pytest.mark.parametrize("name", FSDP)
def test_written_back_it_has_the_originals_keys_settings_and_content(tmp_path, name):
    dist, back = str(tmp_path / "dist"), str(tmp_path / "back")
    write_resharded(fixture_path(name), dist, TargetLayout(ckpt_format="torch_dist"), verify=True)
    write_resharded(dist, back, TargetLayout(ckpt_format="fsdp_dtensor"), verify=True)
    want_t, want_o = _entries(fixture_path(name))
    got_t, got_o = _entries(back)
    # every entry under the original's name; an MTP layer's also under the other releases' name (its alias)
    got_t, extra_t = _split_aliases(got_t, want_t)
    got_o, extra_o = _split_aliases(got_o, want_o)
    assert got_t == {k: v for k, v in want_t.items() if not k.startswith(NOT_WRITTEN)}
    want_o = {k: v for k, v in want_o.items() if not k.startswith(NOT_WRITTEN)}
    assert set(got_o) == set(want_o)
    assert ("mtp" in name) == bool(extra_t) == bool(extra_o)
    differ = {k: (want_o[k], got_o[k]) for k in want_o if k != "num_floating_point_operations_so_far"
              and repr(want_o[k]) != repr(got_o[k])}
    assert not differ, list(differ.items())[:5]
    args = discover(back).saved_args
    assert (args.use_megatron_fsdp, args.ckpt_format) == (True, "fsdp_dtensor")
    report = diff_checkpoints(fixture_path(name), back)
    assert report.equal, report.render()


def test_a_changed_tensor_is_told_apart(tmp_path):
    """diff of the written checkpoint against the original of another state: different."""
    back = str(tmp_path / "back")
    write_resharded(fixture_path("fsdp_dp2_twin_torch_dist"), back, TargetLayout(ckpt_format="fsdp_dtensor"))
    assert diff_checkpoints(fixture_path("fsdp_dp2"), back).equal
    assert not diff_checkpoints(fixture_path("fsdp_tp2dp2"), back).equal


def test_a_legacy_source_is_written_as_the_same_fsdp_dtensor(tmp_path):
    """The 3D twin taken to legacy (TP2: one file per rank), then to fsdp_dtensor: equal to Megatron-FSDP's own save."""
    legacy, back = str(tmp_path / "legacy"), str(tmp_path / "back")
    write_resharded(fixture_path("fsdp_dp2_twin_torch_dist"), legacy, TargetLayout(tp=2, ckpt_format="torch"))
    write_resharded(legacy, back, TargetLayout(tp=1, ckpt_format="fsdp_dtensor"), verify=True)  # (TP1: its padding)
    assert _entries(back)[0] == {k: v for k, v in _entries(fixture_path("fsdp_dp2"))[0].items()
                                 if not k.startswith(NOT_WRITTEN)}
    report = diff_checkpoints(fixture_path("fsdp_dp2"), back)
    assert report.equal, report.render()

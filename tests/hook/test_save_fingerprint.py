"""Fingerprints at save, split among a replica group (issue 33's cost): the ranks that hold the same slices (data- and
context-parallel replicas) each hash a share of them; the shares together are exactly the whole, none hashed twice,
and on a legacy save the group's first rank (the one writing the files) hashes none, so the hashing runs beside its
write. Later saves of a run hash in a background thread while Megatron writes (:class:`DuringSave`).

The "model" here is a stand-in for a Megatron model chunk: a module whose state dict holds the real tensors a rank
holds after a correct load (read from a real Megatron-LM checkpoint); the saves themselves run in real Megatron-LM in
tests/hook/test_megatron_save.py.
"""

from __future__ import annotations

import pytest

from megatron_preflight.errors import PreflightError
from megatron_preflight.hook import save_fingerprint, verify
from megatron_preflight.layout import naming
from megatron_preflight.prove import placement
from megatron_preflight.reshard import TargetLayout
from megatron_preflight.reshard.resharder import open_resharder
from megatron_preflight.reshard.sources.files import SourceFiles
from tests.conftest import fixture_path


class _Chunk:
    """Stand-in for a model chunk: ``state_dict`` gives the tensors (no ``.module``: nothing to unwrap)."""

    def __init__(self, tensors: dict) -> None:
        self.tensors = tensors

    def state_dict(self, keep_vars: bool = False) -> dict:
        return self.tensors


def test_each_item_belongs_to_exactly_one_member_and_a_legacy_writer_gets_none():
    for size in range(1, 6):
        for spare in (False, True):
            counts = [0] * size
            for k in range(60):
                owners = [m for m in range(size) if verify.Share(m, size, spare).mine(k)]
                assert len(owners) == 1, (size, spare, k, owners)
                counts[owners[0]] += 1
            if spare and size > 1:
                assert counts[0] == 0 and min(counts[1:]) > 0
            else:
                assert min(counts) > 0


def _ranks(source: str):
    """(resharder, [(shard name, coords, stand-in model)]) for every rank that writes a shard of ``source``."""
    root = fixture_path(source)
    par = open_resharder(root, TargetLayout(), keep_optimizer=False).layout.parallel
    r = open_resharder(root, TargetLayout(tp=par.tp, pp=par.pp, ep=par.ep), keep_optimizer=False)
    files = SourceFiles(r.layout.iter_dir or "")
    out = []
    try:
        for name, coords in naming.shard_writers(r.tgt).items():
            held = {tp.key: placement.expected(tp, files) for tp in r.plan_for_coords(coords, name).tensors
                    if tp.gkey is not None and tp.shape is not None and not tp.key.endswith("_extra_state")}
            out.append((name, coords, _Chunk(held)))
    finally:
        files.close()
    return r, out


@pytest.mark.parametrize("source", ["tp2_torch", "moe_shared_tp2pp2ep2_torch"])
def test_the_shares_of_a_replica_group_hash_every_box_exactly_once(source):
    r, ranks = _ranks(source)
    for name, coords, model in ranks:
        whole = verify.local_partials(r, model, coords, name)["parts"]
        assert whole
        boxes = sorted((n, tuple(o), d) for n, parts in whole.items() for o, d, _ in parts)
        for size in (2, 3):
            for spare in (False, True):
                shares = [verify.local_partials(r, model, coords, name, verify.Share(m, size, spare))["parts"]
                          for m in range(size)]
                split = sorted((n, tuple(o), d) for share in shares for n, parts in share.items() for o, d, _ in parts)
                assert split == boxes, (name, size, spare)  # every box once, with the same digest
                if spare:
                    assert shares[0] == {}, "the writing rank of a legacy save hashes nothing"


def test_hashing_beside_the_save_gives_what_hashing_after_it_gives():
    r, ranks = _ranks("tp2_torch")
    name, coords, model = ranks[0]
    placed = save_fingerprint._Placed(r, coords, name, verify.Share(0, 1))
    during = save_fingerprint.DuringSave(placed, model, None, False)
    assert during.join() == save_fingerprint._hash(placed, model, None, False)
    assert during.thread.name == "preflight-fingerprint" and not during.thread.is_alive()


def test_a_failure_in_the_background_hashing_is_a_preflight_error_not_a_traceback():
    r, ranks = _ranks("tp2_torch")
    name, coords, _model = ranks[0]
    placed = save_fingerprint._Placed(r, coords, name, verify.Share(0, 1))

    class Broken:
        def state_dict(self, keep_vars=False):
            raise RuntimeError("the model went away")

    with pytest.raises(PreflightError, match="hashing failed .*the model went away"):
        save_fingerprint.DuringSave(placed, Broken(), None, False).join()


def test_the_saved_metadata_is_indexed_for_the_next_job_start(tmp_path, monkeypatch, real_fixture):
    # the index read at save (trusted: the job's own files) first reads a torch_dist .metadata as the next job start
    # will (through the allow-list), so that start takes its facts from the index (layout/dcp_cache.py)
    from megatron_preflight.layout import dcp_cache, dist

    monkeypatch.setenv(dcp_cache.ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(dcp_cache, "MIN_BYTES", 0)
    dist._FACTS_CACHE.clear()
    dist._METADATA_CACHE.clear()
    save = real_fixture("bf16_gqa_tp2_torch_dist")
    iteration = int(open(f"{save}/latest_checkpointed_iteration.txt").read())
    try:
        index = save_fingerprint._saved_index(save, iteration)
        assert index.trust and index.layout.format.value == "torch_dist"
        (entry,) = (tmp_path / "cache" / "dcp-index").iterdir()
        assert entry.name.startswith(f"v{dcp_cache.VERSION}-safe-")
        # a .metadata the allow-list refuses is read trusted, as before, and not indexed
        iter_dir = f"{save}/{naming.iteration_dir_name(iteration)}"
        dist._FACTS_CACHE.clear()
        dist._METADATA_CACHE.clear()
        entry.unlink()
        with open(f"{iter_dir}/.metadata", "wb") as fh:
            fh.write(b"cos\nsystem\n(S'echo pwned'\ntR.")
        save_fingerprint._facts_for_the_next_start(save, iteration)  # (no error: best effort)
        assert not list((tmp_path / "cache" / "dcp-index").iterdir())
    finally:
        dist._FACTS_CACHE.clear()
        dist._METADATA_CACHE.clear()

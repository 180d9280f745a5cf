"""The hook with ``--load msc://...`` against a real S3-compatible server (SeaweedFS, tests/helpers/s3_server.py): rank 0
stages the metadata and decides, every rank gets the decision, the report names the URL; an empty prefix fails
unless starting from scratch is allowed; a run with MSC off is stopped; a layout only the resharder loads (a
dp_reshardable optimizer at another layout, an HF model) loads from the store as from disk, each rank fetching its
own bytes, the staging released after; a save to the store names the command that fingerprints it. (Real Megatron-LM
main saving to and loading from the store: tests/hook/test_megatron_lm.py, docs/object-storage.md.)"""

from __future__ import annotations

import argparse
import json
import os

import pytest

from megatron_preflight.hook import runtime
from tests.conftest import fixture_path
from tests.helpers.tiny import ARGS
from tests.hook.test_runtime import run_world, stderrs


@pytest.fixture
def store(s3):
    s3.upload_dir(fixture_path("tp2_torch_dist"), "hook/tp2")
    s3.upload_dir(fixture_path("distopt_dpr_tp2dp2_torch_dist"), "hook/dpr")
    return s3


def test_every_rank_gets_rank_0s_decision_on_an_msc_checkpoint(store, tmp_path):
    """TP2 saved, TP1 run: Megatron's dist loader reads it from the store itself (--enable-msc)."""
    spec = dict(ARGS, preflight="check", load="msc://store/hook/tp2", ckpt_format="torch_dist", world_size=2)
    results = run_world(tmp_path, spec, world=2)
    assert [rc for rc, _, _ in results] == [0, 0], stderrs(results)
    decisions = [json.loads(so.strip().splitlines()[-1]) for _, so, _ in results]
    assert {(d["verdict"], d["loader"]) for d in decisions} == {("load", "dist")}
    out = results[0][1] + results[0][2]
    assert "msc://store/hook/tp2" in out and "preflight-msc-" not in out


def test_an_empty_prefix_fails_unless_starting_from_scratch_is_allowed(store, capsys):
    args = argparse.Namespace(**ARGS, preflight="check", load="msc://store/hook/nothing")
    with pytest.raises(SystemExit) as exc:
        runtime.preflight(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "no objects under this prefix" in err and "--preflight-allow-missing-checkpoint" in err
    args.preflight_allow_missing_checkpoint = True
    assert runtime.preflight(args).verdict == "skip"


def test_a_run_with_msc_off_is_refused_before_megatron_trains_from_scratch(store, capsys):
    """Megatron-LM main with --load msc://... and no --enable-msc warns 'could not find the metadata file', trains
    from scratch and exits 0 (seen on the CPU runner): the plugin stops it with the flag to add."""
    args = argparse.Namespace(**ARGS, preflight="check", load="msc://store/hook/tp2", enable_msc=False,
                              disable_msc_deprecated=False)
    with pytest.raises(SystemExit) as exc:
        runtime.preflight(args)
    assert exc.value.code == 2
    assert "MSC off" in capsys.readouterr().err and "add --enable-msc" in runtime.current().report
    older = argparse.Namespace(**ARGS, preflight="check", load="msc://store/hook/tp2", enable_msc=False)
    with pytest.raises(SystemExit):
        runtime.preflight(older)  # Megatron-LM <= 0.17: MSC on unless --disable-msc
    assert "remove --disable-msc" in runtime.current().report


def _loads_alike(monkeypatch, run: dict, local: str, url: str):
    """Rank 0 of a 2-rank ``run`` (one process plays it: the world size it reports is set to 2) loads ``local`` then
    ``url`` through the hook's loader (a FAKE megatron.training: tests/hook/test_install.py), both through the
    resharder, into the same model state, tensor for tensor; the URL's report says what each rank fetches. Returns the
    mirror the URL's load staged."""
    import torch

    from megatron_preflight.hook import consensus
    from megatron_preflight.remote import mirror as mirror_module
    from tests.hook.test_install import install_mod, make_fake_megatron_training

    monkeypatch.setattr(consensus, "world_size", lambda: 2)
    made = []

    class Recorded(mirror_module.Mirror):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(mirror_module, "Mirror", Recorded)
    loaded = []
    for where in (local, url):
        mods, state = make_fake_megatron_training(monkeypatch)
        install_mod.install()
        state["args"] = argparse.Namespace(**dict(run, load=where))
        mods["megatron.training.training"].setup_model_and_optimizer()
        assert runtime.current().loader == "reshard", runtime.current().report
        loaded.append(state["loaded"][0]["model"])
    assert "each rank fetches its own bytes" in runtime.current().report  # said before the load fetches them
    assert sorted(loaded[0]) == sorted(loaded[1]) and loaded[0]
    for key, value in loaded[0].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, loaded[1][key]), key
    return made[-1]


def test_the_resharder_loads_from_the_store_what_it_loads_from_disk_reading_only_the_ranks_bytes(store, monkeypatch):
    """A dp_reshardable distributed optimizer saved at TP2 (Megatron cannot load it at another layout), a TP1 PP2 run:
    through the hook's loader (a FAKE megatron.training: tests/hook/test_install.py) rank 0's state dict from the store
    equals the one from the local copy, tensor for tensor, and the store sent only its stage's bytes."""
    run = dict(ARGS, padded_vocab_size=128, ckpt_format="torch_dist", use_distributed_optimizer=True,
               pipeline_model_parallel_size=2, world_size=2, preflight="auto")
    mirror = _loads_alike(monkeypatch, run, fixture_path("distopt_dpr_tp2dp2_torch_dist"), "msc://store/hook/dpr")
    assert mirror.store.counters.fetched < 0.75 * mirror.size  # one pipeline stage's chunks and the metadata
    # released after the load: the node's staging dir gone (what was built from it compared whole above)
    assert not os.path.exists(mirror.root)


def test_a_hugging_face_model_on_the_store_starts_a_job_as_from_disk(store, monkeypatch, tmp_path):
    """A Llama model dir on the store (wide enough, 9 MB, that its headers are a small part), a TP2 run (its args: the
    ones the model dir reads as), rank 0 through the hook's loader (a FAKE megatron.training:
    tests/hook/test_install.py): the same state dict as from the local dir, and the store sent the metadata and rank
    0's rows (TP2: half of each split tensor) only."""
    from megatron_preflight.layout.discover import discover
    from tests.helpers import hf_models

    hf = hf_models.write("llama", str(tmp_path / "llama"), hidden_size=256, intermediate_size=512,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    store.upload_dir(hf, "hook/llama")
    run = dict(vars(discover(hf).saved_args), tensor_model_parallel_size=2, world_size=2, preflight="auto")
    mirror = _loads_alike(monkeypatch, run, hf, "msc://store/hook/llama")
    assert mirror.store.counters.fetched < 0.75 * mirror.size
    assert not os.path.exists(mirror.root)


def test_a_save_to_the_store_is_fingerprinted_by_the_command_the_job_names(store, capsys):
    """The hook does not write fingerprints beside an msc:// save (the store is not a path); the command it names,
    run as printed, stores them there, and the content check on the store passes against them."""
    import re

    from megatron_preflight.cli.main import main
    from megatron_preflight.hook import save_fingerprint

    store.upload_dir(fixture_path("tp2_torch_dist"), "hook/saved")
    why = save_fingerprint.skipped(argparse.Namespace(preflight="auto", save="msc://store/hook/saved"), {})
    command = re.search(r"`megatron-preflight (fingerprint [^`]+)`", why).group(1).split()
    assert main(command) == 0
    assert main(["inspect", "msc://store/hook/saved", "--verify-content"]) == 0
    assert "equal" in capsys.readouterr().out.lower()

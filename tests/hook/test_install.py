"""install() wires the hook into Megatron-LM's seams. megatron.training is not on PyPI, so these tests use a FAKE
megatron.training (named as such): small modules with the same seams (module globals looked up at call time).
The real Megatron-LM is exercised by tests/hook/test_megatron_lm.py when MEGATRON_LM_ROOT is set."""

import argparse
import enum
import sys
import types

import pytest

from megatron_preflight.errors import PreflightError
from megatron_preflight.hook import install as install_mod
from megatron_preflight.hook import runtime
from megatron_preflight.hook import state as state_mod
from tests.conftest import fixture_path
from tests.helpers.tiny import ARGS


def make_fake_megatron_training(monkeypatch, drop=None):
    """FAKE megatron.training with Megatron-LM's seams."""
    pkg = types.ModuleType("megatron.training")
    pkg.__path__ = []
    arguments = types.ModuleType("megatron.training.arguments")
    training = types.ModuleType("megatron.training.training")
    checkpointing = types.ModuleType("megatron.training.checkpointing")
    global_vars = types.ModuleType("megatron.training.global_vars")
    state = {"args": None, "base_calls": []}

    def add_megatron_arguments(parser):
        parser.add_argument("--load")
        parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
        return parser

    def parse_args(extra_args_provider=None):
        parser = argparse.ArgumentParser(allow_abbrev=False)
        parser = arguments.add_megatron_arguments(parser)
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return parser

    class CheckpointType(enum.Enum):
        LEGACY = 1

    def _load_base_checkpoint(load_dir, args, rank0=False, sharded_state_dict=None, **kw):
        state["base_calls"].append("megatron")
        return None, "", False, None

    def ckpt_load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg="load", strict=True, **kw):
        sd, name, release, kind = checkpointing._load_base_checkpoint(state["args"].load, state["args"], rank0=False)
        state["loaded"] = (sd, kind)
        return (sd or {}).get("iteration", 0), 0

    def setup_model_and_optimizer(*a, **k):
        state["setup_called"] = True
        return training.load_checkpoint(None, None, None)

    arguments.add_megatron_arguments = add_megatron_arguments
    arguments.parse_args = parse_args
    checkpointing.CheckpointType = CheckpointType
    checkpointing._load_base_checkpoint = _load_base_checkpoint
    checkpointing.load_checkpoint = ckpt_load_checkpoint
    training.load_checkpoint = ckpt_load_checkpoint
    training.setup_model_and_optimizer = setup_model_and_optimizer
    global_vars.get_args = lambda: state["args"]
    mods = {"megatron.training": pkg, "megatron.training.arguments": arguments, "megatron.training.training": training,
            "megatron.training.checkpointing": checkpointing, "megatron.training.global_vars": global_vars}
    if drop:
        delattr(mods[drop[0]], drop[1])
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(install_mod, "_INSTALLED", False)
    runtime.reset()
    return mods, state


TINY = dict(ARGS, padded_vocab_size=128, ckpt_format="torch")


def test_flag_added_and_extra_args_provider_kept(monkeypatch):
    mods, _ = make_fake_megatron_training(monkeypatch)
    install_mod.install()

    def extra(parser):
        parser.add_argument("--my-script-flag", default="x")
        return parser

    ns = mods["megatron.training.arguments"].parse_args(extra).parse_args(["--preflight", "auto", "--my-script-flag",
                                                                            "y"])
    assert ns.preflight == "auto" and ns.my_script_flag == "y" and ns.preflight_report is None
    default = mods["megatron.training.arguments"].parse_args().parse_args([])
    assert default.preflight == "off"


def test_reshard_load_goes_through_the_resharder(monkeypatch):
    mods, state = make_fake_megatron_training(monkeypatch)
    install_mod.install()
    state["args"] = argparse.Namespace(**TINY, load=fixture_path("tp2_torch"), preflight="auto", no_load_optim=True)
    mods["megatron.training.training"].setup_model_and_optimizer()
    sd, kind = state["loaded"]
    assert kind.name == "LEGACY" and state["base_calls"] == []
    assert sd["args"].tensor_model_parallel_size == 1 and sd["iteration"] == 2
    assert sd["model"]["embedding.word_embeddings.weight"].shape == (128, 32)
    assert state["args"].no_load_rng is True
    # Megatron's own base loader is back in place afterwards.
    assert mods["megatron.training.checkpointing"]._load_base_checkpoint.__name__ == "_load_base_checkpoint"


def test_matching_layout_uses_megatrons_loader(monkeypatch):
    mods, state = make_fake_megatron_training(monkeypatch)
    install_mod.install()
    state["args"] = argparse.Namespace(**dict(TINY, tensor_model_parallel_size=2, world_size=2), load=fixture_path("tp2_torch"),
                                       preflight="auto")
    mods["megatron.training.training"].setup_model_and_optimizer()
    assert state["base_calls"] == ["megatron"] and runtime.current().loader == "non-ep"


def test_fatal_mismatch_stops_before_setup(monkeypatch):
    mods, state = make_fake_megatron_training(monkeypatch)
    install_mod.install()
    state["args"] = argparse.Namespace(**dict(TINY, hidden_size=64), load=fixture_path("tp1_torch"), preflight="check")
    with pytest.raises(SystemExit) as exc:
        mods["megatron.training.training"].setup_model_and_optimizer()
    assert exc.value.code == 1 and "setup_called" not in state


def test_off_is_a_pass_through(monkeypatch):
    mods, state = make_fake_megatron_training(monkeypatch)
    install_mod.install()
    state["args"] = argparse.Namespace(**TINY, load=fixture_path("pp2_torch"), preflight="off")
    mods["megatron.training.training"].setup_model_and_optimizer()
    assert state["base_calls"] == ["megatron"] and runtime.current() is None


@pytest.mark.parametrize("missing", [("megatron.training.checkpointing", "_load_base_checkpoint"),
                                     ("megatron.training.training", "setup_model_and_optimizer")])
def test_missing_seam_is_a_clear_error(monkeypatch, missing):
    make_fake_megatron_training(monkeypatch, drop=missing)
    with pytest.raises(PreflightError) as exc:
        install_mod.install()
    assert missing[1] in str(exc.value) and "d98e8a64" in str(exc.value)


def test_older_megatron_without_add_megatron_arguments(monkeypatch):
    """Megatron-LM before 2025-03 (core <= 0.11) builds its parser inside parse_args; the flags come in through a
    wrapped parse_args, also where megatron.training.initialize imported it (FAKE modules, as above)."""
    make_fake_megatron_training(monkeypatch, drop=("megatron.training.arguments", "add_megatron_arguments"))
    arguments = sys.modules["megatron.training.arguments"]

    def old_parse_args(extra_args_provider=None, ignore_unknown_args=False):
        parser = argparse.ArgumentParser(allow_abbrev=False)
        parser.add_argument("--load")
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return parser

    arguments.parse_args = old_parse_args
    initialize = types.ModuleType("megatron.training.initialize")
    initialize.parse_args = old_parse_args  # `from megatron.training.arguments import parse_args`
    monkeypatch.setitem(sys.modules, "megatron.training.initialize", initialize)
    monkeypatch.setattr(install_mod, "_INSTALLED", False)
    install_mod.install()

    def script_flags(parser):
        parser.add_argument("--my-script-flag")
        return parser

    for parse in (arguments.parse_args, initialize.parse_args):
        ns = parse(script_flags).parse_args(["--preflight", "auto", "--my-script-flag", "x", "--load", "/ckpt"])
        assert (ns.preflight, ns.my_script_flag, ns.load) == ("auto", "x", "/ckpt")
    assert initialize.parse_args(None).parse_args([]).preflight == "off"


def test_reshard_load_carries_the_optimizer_state(monkeypatch):
    mods, state = make_fake_megatron_training(monkeypatch)
    install_mod.install()
    state["args"] = argparse.Namespace(**TINY, load=fixture_path("tp2_torch"), preflight="auto")
    mods["megatron.training.training"].setup_model_and_optimizer()
    sd, _ = state["loaded"]
    assert [len(g["params"]) for g in sd["optimizer"]["param_groups"]] == [18, 34]
    assert not getattr(state["args"], "no_load_optim", False)


def test_reshard_failure_is_one_message_and_exit_1(monkeypatch, capsys):
    from megatron_preflight.errors import PreflightError
    from megatron_preflight.hook import legacy_load

    mods, state = make_fake_megatron_training(monkeypatch)
    install_mod.install()

    def broken(*a, **k):
        raise PreflightError("a source slice is unreadable", path="/ckpt/iter_0000002/mp_rank_01/model_optim_rng.pt",
                             fix="restore the file", code="corrupt_file")

    monkeypatch.setattr(legacy_load, "resharded_state_dict", broken)
    state["args"] = argparse.Namespace(**TINY, load=fixture_path("tp2_torch"), preflight="auto")
    with pytest.raises(SystemExit) as exc:
        mods["megatron.training.training"].setup_model_and_optimizer()
    err = capsys.readouterr().err
    assert exc.value.code == 1
    assert "loading through the resharder failed" in err and "mp_rank_01/model_optim_rng.pt" in err
    assert "restore the file" in err and "Traceback" not in err
    assert mods["megatron.training.checkpointing"]._load_base_checkpoint.__name__ == "_load_base_checkpoint"


def test_resharder_reuses_the_index_the_check_built(monkeypatch):
    """Rank 0 reads the checkpoint's metadata once and indexes it once: the check's CheckpointIndex feeds the
    resharder (the check's cost line and the loader reuse it)."""
    from megatron_preflight.reshard import checkpoint_index

    real = checkpoint_index.discover
    reads = []

    def counted(*a, **k):
        reads.append(a[0])
        return real(*a, **k)

    mods, state = make_fake_megatron_training(monkeypatch)
    install_mod.install()
    state_mod.reset()  # no resharder cached by an earlier test
    monkeypatch.setattr(checkpoint_index, "discover", counted)
    before = checkpoint_index.index_builds()
    state["args"] = argparse.Namespace(**TINY, load=fixture_path("tp2_torch"), preflight="auto")
    mods["megatron.training.training"].setup_model_and_optimizer()
    sd, _ = state["loaded"]
    assert sd["args"].tensor_model_parallel_size == 1
    assert reads == [fixture_path("tp2_torch")]  # the check's read, and no other
    assert checkpoint_index.index_builds() - before == 1  # consistency, the cost line and the loader: one index
    assert state_mod.STATE.resharders  # the resharder was built in this test, from the check's index

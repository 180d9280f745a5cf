"""Every error names its first real cause in the user's terms, and the fix it suggests works on the same case."""

import os

import pytest

from megatron_preflight.cli.main import main
from megatron_preflight.errors import PreflightError
from megatron_preflight.layout.discover import discover
from megatron_preflight.reshard.resharder import open_resharder
from megatron_preflight.reshard.target import TargetLayout
from tests.conftest import fixture_path


def test_tp_that_does_not_divide_the_heads(tmp_path, capsys):
    assert main(["reshard", fixture_path("tp2_torch"), str(tmp_path / "a"), "--tp", "3", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "4 attention heads are not divisible by TP3" in err and "1, 2, 4" in err and "Traceback" not in err
    assert main(["reshard", fixture_path("tp2_torch"), str(tmp_path / "b"), "--tp", "4", "--no-progress"]) == 0


def test_ep_that_does_not_divide_the_experts(tmp_path, capsys):
    assert main(["reshard", fixture_path("moe_ep2_torch"), str(tmp_path / "a"), "--ep", "3", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "4 experts are not divisible by EP3" in err and "1, 2, 4" in err and "moe_ep2_torch" in err
    assert main(["reshard", fixture_path("moe_ep2_torch"), str(tmp_path / "b"), "--ep", "4", "--no-progress"]) == 0


def test_query_groups_that_do_not_split(tmp_path, capsys):
    assert main(["reshard", fixture_path("bf16_gqa_tp2_torch"), str(tmp_path / "a"), "--tp", "4",
                 "--no-progress"]) == 2
    assert "2 query groups are not divisible by TP4" in capsys.readouterr().err


def test_a_hugging_face_dir_is_not_called_torch_dist(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    assert main(["reshard", str(hf), str(tmp_path / "out"), "--tp", "1"]) == 1
    err = capsys.readouterr().err
    # read as a Hugging Face model (docs/hf.md): this one names no architecture, so the supported ones are listed
    assert "names no architecture" in err and "LlamaForCausalLM" in err and "torch_dist" not in err


def test_a_bad_iteration_is_a_usage_error_not_a_foreign_dir(capsys):
    assert main(["inspect", fixture_path("tp2_torch"), "--iteration", "abc"]) == 2
    err = capsys.readouterr().err
    assert "--iteration 'abc' is neither a number nor 'release'" in err and "not a Megatron checkpoint" not in err
    assert main(["inspect", fixture_path("tp2_torch"), "--iteration", "2"]) == 0


@pytest.mark.parametrize("cmd", [["check", fixture_path("tp2_torch")],
                                 ["reshard", fixture_path("tp2_torch"), "/nonexistent/out"]])
def test_a_flag_missing_its_value_after_dashes_is_one_line(cmd, capsys):
    assert main([*cmd, "--", "--tensor-model-parallel-size"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--tensor-model-parallel-size" in err and "expected one argument" in err
    assert "alias" not in err and "usage:" not in err


@pytest.mark.parametrize("name,field,value,says", [
    ("tp2_torch", "hidden_size", 64, "holds embedding.word_embeddings.weight with global shape (256, 32), but its "
                                     "saved args"),
    ("tp2_torch", "num_layers", 6, "the saved args say 6 layers, but the shards hold 4"),
    ("tp2_torch", "ffn_hidden_size", 128, "mlp.linear_fc1.weight with global shape (64, 32)"),
    # multi-latent attention sizes its projections by its own args (the real fixture: TE spec via the stand-in)
    ("mla_te_tp2_torch", "v_head_dim", 8, "linear_proj.weight with global shape (32, 24)"),
    ("mla_te_tp2_torch", "q_lora_rank", 8, "linear_q_down_proj.weight with global shape (16, 32)"),
    ("mla_te_tp2_torch", "qk_pos_emb_head_dim", 2, "linear_q_up_proj.weight with global shape (48, 16)"),
    ("mla_te_tp2_torch", "kv_lora_rank", 16, "linear_kv_down_proj.weight with global shape (12, 32)"),
])
def test_shards_that_contradict_their_args_are_named_not_blamed_on_the_optimizer(name, field, value, says):
    lay = discover(fixture_path(name))
    setattr(lay.saved_args, field, value)
    with pytest.raises(PreflightError, match="saved args") as exc:
        open_resharder(lay, TargetLayout(tp=1))
    assert says in exc.value.message and exc.value.code == "inconsistent_shards"
    assert "--drop-optimizer" not in str(exc.value) and "restore the iteration dir" in exc.value.fix


def test_a_destination_under_a_file_is_named_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # the destination's parent is a file
    rc = main(["reshard", fixture_path("tp2_torch"), str(blocker / "deeper" / "out"), "--tp", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and f"goes through {blocker}, which is a file, not a directory" in err and "bug" not in err
    assert os.path.isfile(blocker)
    assert main(["reshard", fixture_path("tp2_torch"), str(tmp_path / "out"), "--tp", "1", "--no-progress"]) == 0


def _tiny_checkpoint(root, args):
    import torch

    d = root / "iter_0000002" / "mp_rank_00"
    d.mkdir(parents=True)
    torch.save({"args": args, "iteration": 2, "checkpoint_version": 3.0,
                "model": {"embedding.word_embeddings.weight": torch.zeros(4, 2)}}, d / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("2")
    return str(root)


def test_args_that_are_not_a_namespace_are_named_as_such(tmp_path, capsys):
    root = _tiny_checkpoint(tmp_path / "c", {"tensor_model_parallel_size": 1, "num_layers": 2})
    assert main(["inspect", root]) == 1
    out = capsys.readouterr().out
    assert "[bad_args]" in out and "are a dict, not Megatron's argparse Namespace" in out
    assert "stray" not in out and "missing" not in out


def test_a_negative_saved_tp_is_an_impossible_layout_not_a_missing_shard(tmp_path, capsys):
    import argparse

    root = _tiny_checkpoint(tmp_path / "c", argparse.Namespace(tensor_model_parallel_size=-1,
                                                               pipeline_model_parallel_size=1, num_layers=2))
    assert main(["inspect", root]) == 1
    out = capsys.readouterr().out
    assert "the TP size must be a positive integer, got -1" in out and "mp_rank_-1" not in out


@pytest.mark.parametrize("errno_name,says,fix", [
    ("ENOSPC", "No space left on device [ENOSPC]", "free space"),
    ("EROFS", "Read-only file system [EROFS]", "read-only"),
    ("EACCES", "Permission denied [EACCES]", "permissions"),
    ("EFBIG", "File too large [EFBIG]", "ulimit -f"),
])
def test_disk_full_read_only_and_permission_say_what_the_system_did(tmp_path, monkeypatch, capsys, errno_name, says,
                                                                     fix):
    """FAULT INJECTED: the zip writer's record write fails as the filesystem would (no real full disk here)."""
    import errno

    from megatron_preflight.reshard.targets import zip_writer

    code = getattr(errno, errno_name)

    def failing_open(self, name, size, **_given):
        raise OSError(code, os.strerror(code), str(tmp_path / "out"))

    monkeypatch.setattr(zip_writer.TorchZipWriter, "begin", failing_open)
    rc = main(["reshard", fixture_path("tp2_torch"), str(tmp_path / "out"), "--tp", "1", "--no-progress",
               "--workers", "1"])
    err = capsys.readouterr().err
    assert rc == 1 and says in err and fix in err and "bug" not in err
    assert not (tmp_path / "out").exists() and [n for n in os.listdir(tmp_path) if ".tmp-" in n] == []


def test_following_the_fixes_works(tmp_path):
    # the args restored (the fixture as saved): the resharder opens; the flag given its value: the check runs
    assert open_resharder(discover(fixture_path("tp2_torch")), TargetLayout(tp=1)).tgt.tp == 1
    assert main(["check", fixture_path("tp2_torch"), "--", "--tensor-model-parallel-size", "2", "--num-layers", "4",
                 "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64", "--seq-length", "32",
                 "--max-position-embeddings", "32", "--transformer-impl", "local"]) == 0


def test_torch_dist_optimizer_across_an_ep_change_fix_converts_offline(tmp_path, capsys):
    """Megatron cannot carry a torch_dist optimizer state across an EP change; the check names that, picks the
    in-memory resharder, and its offline fix (convert to legacy at the run's layout) is followed here: the run's check
    then loads the state as is."""
    flags = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
             "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "100", "--num-experts", "4",
             "--moe-router-topk", "2", "--expert-model-parallel-size", "4", "--transformer-impl", "local",
             "--ckpt-format", "torch_dist"]
    src = fixture_path("moe_ep2_torch_dist")
    assert main(["check", src, "--", *flags]) == 0  # a reshard, not a failure: the resharder reads this form
    out = capsys.readouterr().out
    assert "Could not find parameter group" in out and "--preflight auto" in out and "megatron-preflight reshard" in out
    assert "loader      reshard" in out
    dst = str(tmp_path / "legacy")
    assert "--ckpt-format torch --" in out  # the run's own --ckpt-format torch_dist would ask for torch_dist
    assert main(["reshard", src, dst, "--no-progress", "--ckpt-format", "torch", "--", *flags]) == 0
    capsys.readouterr()
    legacy_flags = [f if f != "torch_dist" else "torch" for f in flags]
    assert main(["check", dst, "--", *legacy_flags]) == 0, capsys.readouterr().out


SIZES = ["--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--expert-model-parallel-size",
         "--expert-tensor-parallel-size", "--context-parallel-size", "--num-layers-per-virtual-pipeline-stage"]


@pytest.mark.parametrize("value", ["0", "-2"])
@pytest.mark.parametrize("flag", SIZES)
def test_a_non_positive_size_is_a_usage_error_in_every_entry_point(flag, value, tmp_path, capsys):
    """check and reshard, with the run's flags after --, reshard's own size flags, and a YAML config: exit 2 with one
    line naming the flag (once, check ended in 'internal error (ZeroDivisionError)')."""
    src = fixture_path("tp2_torch")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"{flag[2:].replace('-', '_')}: {value}\n")
    runs = [["check", src, "--", flag, value], ["check", src, "--config", str(cfg)],
            ["reshard", src, str(tmp_path / "out"), "--no-progress", "--", flag, value]]
    if flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--expert-model-parallel-size",
                "--expert-tensor-parallel-size", "--num-layers-per-virtual-pipeline-stage"):
        runs.append(["reshard", src, str(tmp_path / "out"), "--no-progress", flag, value])
    for argv in runs:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and flag in err and "positive integer" in err, (argv, err)
        assert "internal error" not in err and "Traceback" not in err
    assert not os.path.exists(tmp_path / "out")


def test_following_the_checks_offline_fix_gives_a_checkpoint_that_loads(tmp_path, capsys):
    """The fix printed for a layout change names the run's layout flags literally (tests/check/test_advice.py runs
    every such command of every fixture); reshard with the run's own flags after -- gives the same output."""
    from tests.helpers.tiny import FLAGS

    run = [*FLAGS, "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2", "--ckpt-format", "torch"]
    assert main(["check", fixture_path("tp2_torch"), "--", *run]) == 0
    out = capsys.readouterr().out
    assert ("NEW_DIR -- --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --vocab-size 100 "
            "--transformer-impl local --ckpt-format torch, then --load NEW_DIR") in out
    new = str(tmp_path / "new")
    assert main(["reshard", fixture_path("tp2_torch"), new, "--no-progress", "--", *run]) == 0
    capsys.readouterr()
    assert main(["check", new, "--", *run]) == 0
    assert "LOAD: the job may start; the checkpoint loads as is" in capsys.readouterr().out

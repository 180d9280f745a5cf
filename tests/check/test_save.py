"""The first save, checked at job start: --save writable, with room for the next checkpoint."""

import os

from megatron_preflight.check import save
from megatron_preflight.check.plan import Verdict, make_plan
from megatron_preflight.check.runtime_args import from_cli
from tests.conftest import fixture_path
from tests.helpers.tiny import FLAGS


def plan(*flags):
    return make_plan(fixture_path("tp2_torch"), from_cli(FLAGS + ["--tensor-model-parallel-size", "2", *flags]))


def test_a_creatable_save_dir_with_room_passes(tmp_path):
    p = plan("--save", str(tmp_path / "new" / "dir"))
    assert p.verdict == Verdict.LOAD and "save" not in [f.field for f in p.findings]


def test_a_file_as_save_dir_is_fatal(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    f, = [f for f in plan("--save", str(target)).fatal if f.field == "save"]
    assert "is a file" in f.message


def test_a_save_dir_without_room_is_fatal(tmp_path, monkeypatch):
    """FAKE, named as such: the free-space query is replaced at the one function that asks (this machine cannot
    mount a small filesystem); the checkpoint's size is real (its iteration dir on disk)."""
    need = save.checkpoint_bytes(make_plan(fixture_path("tp2_torch"), from_cli(FLAGS)).layout)
    assert need > 500_000
    monkeypatch.setattr(save, "free_bytes", lambda path: need // 2)
    p = plan("--save", str(tmp_path))
    f, = [f for f in p.fatal if f.field == "save"]
    assert p.verdict == Verdict.FAIL and "free" in f.message
    monkeypatch.setattr(save, "free_bytes", lambda path: need + 1)
    warn, = [f for f in plan("--save", str(tmp_path)).findings if f.field == "save"]
    assert warn.severity.value == "info" and "not two" in warn.message


def test_a_read_only_save_dir_is_fatal(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o555)
    try:
        if os.access(ro, os.W_OK):  # root writes anyway: so would Megatron, nothing to report
            return
        f, = [f for f in plan("--save", str(ro / "ckpt")).fatal if f.field == "save"]
        assert "not writable" in f.message
    finally:
        os.chmod(ro, 0o755)


def test_async_save_of_a_legacy_checkpoint_is_fatal(tmp_path):
    f, = [f for f in plan("--save", str(tmp_path), "--async-save", "--ckpt-format", "torch").fatal
          if f.field == "async_save"]
    assert "legacy checkpoints" in f.message and "torch_dist" in f.fix
    assert not [f for f in plan("--save", str(tmp_path), "--async-save", "--ckpt-format", "torch_dist",
                                "--use-persistent-ckpt-worker").findings if f.field == "async_save"]


def test_non_persistent_saves_need_a_type_and_a_writable_dir(tmp_path):
    f, = [f for f in plan("--save", str(tmp_path), "--non-persistent-save-interval", "5").fatal
          if f.field == "non_persistent_ckpt_type"]
    assert "--non-persistent-ckpt-type" in f.fix
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    p = plan("--save", str(tmp_path), "--non-persistent-save-interval", "5", "--non-persistent-ckpt-type", "global",
             "--non-persistent-global-ckpt-dir", str(blocker / "np"))
    f, = [f for f in p.fatal if f.field == "save"]
    assert "--non-persistent-global-ckpt-dir" in f.message
    ok = plan("--save", str(tmp_path), "--non-persistent-save-interval", "5", "--non-persistent-ckpt-type", "global")
    assert not ok.fatal

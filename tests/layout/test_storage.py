"""An object-storage URL is never taken for a relative path (no local ``msc:`` dir read or created): an ``msc://`` one
is read through its profile by every command (a missing profile one clear error), another scheme's is answered as a
URL, and a job loading from one is not stopped (Megatron does not read it either)."""

from __future__ import annotations

import argparse
import os

import pytest

from megatron_preflight.cli.main import main
from megatron_preflight.hook import runtime
from tests.conftest import fixture_path

URL = "msc://nostore/ckpt"


@pytest.mark.parametrize("argv", [
    ["inspect", URL], ["check", URL, "--", "--tensor-model-parallel-size", "2"], ["plan", URL, "--world-size", "8"],
    ["flags", URL], ["diff", URL, fixture_path("tp2_torch")], ["fingerprint", URL],
    ["reshard", URL, "out", "--tp", "1"], ["reshard", fixture_path("tp2_torch"), "msc://nostore/out", "--tp", "1"],
])
def test_every_command_reads_an_msc_url_through_its_profile(argv, capsys, tmp_path, monkeypatch):
    pytest.importorskip("multistorageclient")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "msc.yaml").write_text("profiles: {}\n")
    monkeypatch.setenv("MSC_CONFIG", str(tmp_path / "msc.yaml"))
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "profile 'nostore' is not defined" in err and "Fix:" in err and "no such file" not in err, err
    assert os.listdir(tmp_path) == ["msc.yaml"]  # (no msc: dir made)


@pytest.mark.parametrize("argv", [["inspect", "s3://bucket/ckpt"], ["reshard", "gs://b/ckpt", "out", "--tp", "1"]])
def test_another_scheme_is_answered_as_a_url(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "is a URL" in err and "msc://PROFILE/path" in err and "no such file" not in err, err
    assert os.listdir(tmp_path) == []


def test_a_job_loading_from_a_url_no_msc_profile_reads_is_not_stopped(capsys):
    """Megatron reads msc:// only (tests/hook/test_remote_load.py); another scheme is left to it, said so."""
    from tests.helpers.tiny import ARGS

    args = argparse.Namespace(**ARGS, preflight="check", load="s3://bucket/ckpt")
    decision = runtime.preflight(args)
    assert decision.verdict == "skip" and "not checked" in decision.report
    assert "[megatron-preflight]" in capsys.readouterr().out

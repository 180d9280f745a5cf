"""An object-storage URL is answered as one, by every command and by the hook: never taken for a relative path (no
local ``msc:`` dir read or created), and a job loading from one is not stopped (Megatron reads it itself)."""

from __future__ import annotations

import argparse
import os

import pytest

from megatron_preflight.cli.main import main
from megatron_preflight.hook import runtime
from tests.conftest import fixture_path

URL = "msc://default/ckpt"


@pytest.mark.parametrize("argv", [
    ["inspect", URL], ["check", URL, "--", "--tensor-model-parallel-size", "2"], ["plan", URL, "--world-size", "8"],
    ["flags", URL], ["diff", URL, fixture_path("tp2_torch")], ["fingerprint", URL],
    ["reshard", URL, "out", "--tp", "1"], ["reshard", fixture_path("tp2_torch"), "msc://p/out", "--tp", "1"],
])
def test_every_command_answers_a_url_as_one(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "object-storage URL" in err and "Fix:" in err and "no such file" not in err, err
    assert os.listdir(tmp_path) == []  # (no msc: dir made)


def test_a_job_loading_from_object_storage_is_not_stopped(capsys):
    from tests.helpers.tiny import ARGS

    args = argparse.Namespace(**ARGS, preflight="check", load="msc://default/ckpt")
    decision = runtime.preflight(args)
    assert decision.verdict == "skip" and "not checked" in decision.report
    assert "[megatron-preflight]" in capsys.readouterr().out

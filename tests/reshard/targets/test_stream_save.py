"""A legacy -> legacy reshard runs without torch: each piece is a numpy array of its elements' bytes, the pickle
names torch's globals by name (dtypes read without torch are written back as ``torch.bfloat16`` & co.), carried
tensors and a converted optimizer's ``step`` are held as bytes, replicas and masters are compared as numpy values.
Its files are byte for byte what the torch path writes, and it says the same, on every legacy checkpoint Megatron-LM
wrote for the fixtures."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from megatron_preflight.cli.main import main
from megatron_preflight.reshard.execute import replicas
from megatron_preflight.reshard.optimizer import distributed
from megatron_preflight.reshard.targets import legacy, stream_save
from tests.conftest import FIXTURES

LEGACY = sorted(d for d in os.listdir(FIXTURES) if d.endswith("_torch"))
ALL_ONES = ["--tp", "1", "--pp", "1", "--ep", "1"]
# a fresh interpreter (torch not loaded unless the run needs it): the command's exit and whether torch was loaded
_PROBE = """
import json, sys
from megatron_preflight.cli.main import main
rc = main(sys.argv[1:])
sys.stdout.flush()
print(json.dumps({"rc": rc, "torch": "torch" in sys.modules}), file=sys.stderr)
"""


def _fresh(args: list[str]) -> tuple[int, bool, str]:
    p = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    seen = json.loads(p.stderr.strip().splitlines()[-1])
    return seen["rc"], seen["torch"], p.stdout


def _torch_path(args: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    """The same command in this process (torch loaded), every storage built and every replica and master compared as
    torch tensors: (its exit, what it printed)."""
    import torch  # noqa: F401 - the mode the hook and the resharder ran in before

    out = io.StringIO()
    with monkeypatch.context() as m:
        m.setattr(stream_save, "bytes_only", lambda source: False)
        m.setattr(legacy, "bytes_only", lambda source: False)
        m.setattr(replicas, "_compare_bytes", replicas._compare_tensors)
        m.setattr(distributed, "_master_matches_bytes", distributed._master_matches_tensors)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            return main(list(args)), out.getvalue()


def _said(stdout: str) -> list[str]:
    """What a run printed but its timing."""
    return [line for line in stdout.splitlines() if not line.startswith("read ")]


def _files(root: str) -> dict[str, bytes]:
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            path = os.path.join(d, n)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, root)] = fh.read()
    return out


@pytest.mark.parametrize("name", LEGACY)
def test_written_without_torch_byte_for_byte_as_with_it(name, tmp_path, monkeypatch):
    """Also the distributed optimizer's masters sampled against the weights (cast as torch casts), the replicas
    Megatron lets drift (their largest difference measured in fp32) and ``--verify`` (every written tensor against
    its source slices, every replica whole): the same verdicts, the same numbers printed."""
    src = os.path.join(FIXTURES, name)
    flags = [*ALL_ONES, "--no-progress", "--verify"]
    rc, loaded, stdout = _fresh(["reshard", src, str(tmp_path / "bytes"), *flags])
    want, said = _torch_path(["reshard", src, str(tmp_path / "torch"), *flags], monkeypatch)
    assert rc == want, stdout
    assert not loaded, stdout
    if rc != 0:
        return
    assert _said(stdout) == _said(said.replace(str(tmp_path / "torch"), str(tmp_path / "bytes")))
    written, expected = _files(str(tmp_path / "bytes")), _files(str(tmp_path / "torch"))
    assert sorted(written) == sorted(expected)
    for path, data in expected.items():
        assert written[path] == data, path


@pytest.mark.parametrize("name, family", [("tp2_torch", "fused"), ("te_tp2_torch", "torch")])
def test_a_converted_optimizer_step_is_written_as_the_tensor_torch_makes(name, family, tmp_path, monkeypatch):
    """Adam's state converted between families (torch's per-parameter ``step`` tensor, FusedAdam's per-group
    ``step``) in both directions: made without torch, the same bytes."""
    src = os.path.join(FIXTURES, name)
    flags = [*ALL_ONES, "--optimizer-family", family, "--no-progress"]
    rc, loaded, stdout = _fresh(["reshard", src, str(tmp_path / "bytes"), *flags])
    assert rc == 0 and not loaded, stdout
    assert _torch_path(["reshard", src, str(tmp_path / "torch"), *flags], monkeypatch)[0] == 0
    assert _files(str(tmp_path / "bytes")) == _files(str(tmp_path / "torch"))

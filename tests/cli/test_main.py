"""The CLI entry point's exits."""

import subprocess
import sys

import pytest

from megatron_preflight.cli import main as main_module
from tests.conftest import fixture_path


def test_a_reader_that_stops_reading_ends_the_command_quietly():
    """`megatron-preflight inspect ... | head -0`: stdout closed before anything is written. The command ends as a Unix
    tool killed by SIGPIPE (141), with no error message about the pipe and no traceback."""
    p = subprocess.Popen([sys.executable, "-m", "megatron_preflight", "inspect", fixture_path("moe_ep2_torch")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader is gone before the first write
    err = p.stderr.read().decode()
    p.stderr.close()
    assert p.wait(timeout=120) == 141, err
    assert err == "", err


def _without_torch(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """The CLI with torch hidden from the interpreter (a broken install)."""
    blocker = tmp_path / "sitecustomize.py"  # a meta path finder that refuses torch, for this subprocess only
    blocker.write_text("import sys\n"
                       "class _NoTorch:\n"
                       "    def find_spec(self, name, path=None, target=None):\n"
                       "        if name == 'torch' or name.startswith('torch.'):\n"
                       "            raise ModuleNotFoundError(\"No module named 'torch'\", name=name)\n"
                       "sys.meta_path.insert(0, _NoTorch())\n")
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd()])}
    return subprocess.run([sys.executable, "-m", "megatron_preflight", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_a_missing_dependency_is_named_with_its_fix_not_called_a_bug(tmp_path):
    """torch hidden: a reshard that makes tensors (a torch_dist output) names the package and the fix, exit 1."""
    p = _without_torch(tmp_path, "reshard", fixture_path("tp2_torch"), str(tmp_path / "out"), "--no-progress",
                       "--ckpt-format", "torch_dist", "--", "--tensor-model-parallel-size", "1")
    assert p.returncode == 1, p.stderr
    assert "needs the Python package 'torch'" in p.stderr and "internal error" not in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_a_legacy_reshard_runs_without_torch(tmp_path):
    """torch hidden: a legacy -> legacy reshard moves bytes only, and needs none of it."""
    p = _without_torch(tmp_path, "reshard", fixture_path("tp2_torch"), str(tmp_path / "out"), "--no-progress",
                       "--", "--tensor-model-parallel-size", "1")
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "out" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt").is_file(), p.stdout


@pytest.mark.parametrize("argv", [
    ["inspect", "CKPT", "--json"],
    ["--debug", "check", "CKPT", "--iteration", "3", "--all-shards"],
    ["plan", "CKPT", "--world-size", "64"],
    ["reshard", "SRC", "DST", "--tp", "2"],
    ["diff", "A", "B", "--json"],
    ["fingerprint", "CKPT", "--weights-only"],
    ["flags", "HF", "--json"],
])
def test_the_parser_built_for_one_subcommand_parses_as_the_full_one(argv: list[str]) -> None:
    """main() builds only the named subcommand's arguments; what it parses, and the subcommands the top-level help
    lists, are those of the parser with every subcommand's arguments."""
    command = main_module._command_in(argv)
    assert command == next(a for a in argv if not a.startswith("-"))
    one, full = main_module.build_parser(command), main_module.build_parser()
    assert vars(one.parse_args(argv)) == vars(full.parse_args(argv))
    assert one.format_help() == full.format_help()
    assert main_module._command_in(["chek", "CKPT"]) is None  # a typo: the full parser names the choices

import json
import os
import shutil
import subprocess
import sys

import pytest

from megatron_preflight.cli.main import main
from tests.conftest import fixture_path


def test_inspect_ok_human(capsys):
    assert main(["inspect", fixture_path("moe_ep2_torch")]) == 0
    out = capsys.readouterr().out
    assert "3D" in out and "mp_rank_{tp:02d}_{ep:03d}" in out and "EP=2" in out and "OK" in out


def test_inspect_json(capsys):
    assert main(["inspect", fixture_path("pp2_torch"), "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert (j["format"], j["tp"], j["pp"], j["ep"], j["dims"]) == ("torch", 1, 2, 1, "2D")


def test_inspect_problems_exit_1(tmp_path, capsys):
    root = tmp_path / "c"
    shutil.copytree(fixture_path("tp2_torch"), root)
    shutil.rmtree(root / "iter_0000002" / "mp_rank_01")
    assert main(["inspect", str(root)]) == 1
    out = capsys.readouterr().out
    assert "missing_shard" in out and "mp_rank_01" in out


def test_usage_errors_exit_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["inspect"])
    assert exc.value.code == 2


def test_console_script_no_traceback(tmp_path):
    bad = tmp_path / "c" / "iter_0000001" / "mp_rank_00"
    bad.mkdir(parents=True)
    (tmp_path / "c" / "latest_checkpointed_iteration.txt").write_text("1")
    (bad / "model_optim_rng.pt").write_bytes(b"\x80\x04garbage")
    exe = os.path.join(os.path.dirname(sys.executable), "megatron-preflight")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "megatron_preflight"]
    r = subprocess.run(cmd + ["inspect", str(tmp_path / "c")], capture_output=True, text=True)
    assert r.returncode == 1
    assert "Traceback" not in r.stdout + r.stderr and "corrupt_file" in r.stdout


@pytest.mark.parametrize("name, want", [
    ("tp2_torch", "plain, adam (step, exp_avg, exp_avg_sq); fp32, 1 part(s), param groups in the same order on every "
                  "rank; reshardable"),
    ("moe_ep2_torch", "fp32, 2 part(s)"),
    ("bf16_gqa_tp2_torch", "fp32 masters (bf16/fp16 run)"),
    ("v14_tp2pp2_torch", "param groups ordered per rank"),
    ("tp2_distopt_torch", "distributed, fp32, 1 part(s)"),
    ("distopt_moe_ep2dp2_torch", "distributed, fp32, 2 part(s), 64 parameters placed"),
    ("distopt_bf16_tp2dp2_torch", "distributed, fp32 masters (bf16/fp16 run)"),
])
def test_inspect_says_what_the_optimizer_state_is(capsys, name, want):
    assert main(["inspect", fixture_path(name)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("optimizer"))
    assert want in line

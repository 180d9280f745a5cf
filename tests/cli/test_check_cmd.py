import json

from megatron_preflight.cli.main import main
from tests.conftest import fixture_path
from tests.helpers.tiny import FLAGS as TINY


def test_check_load_exit_0(capsys):
    assert main(["check", fixture_path("tp2_torch"), "--", *TINY, "--tensor-model-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "non-ep" in out and "LOAD" in out


def test_check_fail_exit_1_lists_every_field(capsys):
    rc = main(["check", fixture_path("tp2_torch"), "--json", "--", *TINY, "--hidden-size", "64",
               "--num-layers", "8", "--tensor-model-parallel-size", "2"])
    assert rc == 1
    j = json.loads(capsys.readouterr().out)
    assert j["verdict"] == "fail" and j["loader"] == "non-ep"
    fatal = [f["field"] for f in j["findings"] if f["severity"] == "fatal"]
    assert "hidden_size" in fatal and "num_layers" in fatal
    assert j["layout"]["format"] == "torch"


def test_check_yaml_config(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("num_layers: 4\nhidden_size: 32\nffn_hidden_size: 64\nnum_attention_heads: 4\n"
                   "max_position_embeddings: 32\nvocab_size: 100\ntransformer_impl: local\n")
    assert main(["check", fixture_path("pp2_torch"), "--config", str(cfg), "--json", "--",
                 "--pipeline-model-parallel-size", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "load"


def test_check_bad_yaml_is_usage_error(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("- just\n- a list\n")
    assert main(["check", fixture_path("pp2_torch"), "--config", str(cfg)]) == 2
    assert "mapping" in capsys.readouterr().err

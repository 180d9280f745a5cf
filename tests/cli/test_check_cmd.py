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


def test_check_judges_for_the_release_that_will_load_it(capsys):
    """megatron-core 0.13.1's default distributed-optimizer form (a real checkpoint it wrote): a release up to 0.15
    loads it as is; from 0.16 Megatron's loader refuses it (the resharder loads it: a reshard verdict naming the
    conversion). The release is --megatron-version, else the megatron-core installed here (0.16.1 in CI)."""
    from tests.check.test_plan import FLAGS as PLAN_FLAGS
    from tests.check.test_plan import FSMS, FSMS_FLAGS

    def verdict(*version):
        assert main(["check", FSMS, "--json", *version, "--", *PLAN_FLAGS, *FSMS_FLAGS]) == 0
        j = json.loads(capsys.readouterr().out)
        said = next(f for f in j["findings"] if f["field"] == "megatron_version")
        return j["verdict"], [f["severity"] for f in j["findings"] if f["checkpoint"] == "fully_sharded_model_space"], \
            said["runtime"]

    assert verdict("--megatron-version", "0.14") == ("load", [], "0.14 (--megatron-version)")
    v, severities, said = verdict("--megatron-version", "core_r0.16.0")
    assert (v, severities, said) == ("reshard", ["reshard"], "0.16 (--megatron-version)")
    v, severities, said = verdict()
    assert (v, severities) == ("reshard", ["reshard"]) and "installed here" in said
    assert main(["check", FSMS, "--megatron-version", "x", "--", *PLAN_FLAGS, *FSMS_FLAGS]) == 2
    assert "--megatron-version MAJOR.MINOR" in capsys.readouterr().err


def test_the_release_table_holds_what_each_release_answered():
    """The offline table against the facts the hook's own questions got from each release's megatron.core
    (core_r0.13.0 ... core_r0.19.0, main; measured with the runner) — and, here, from the installed megatron-core."""
    from megatron_preflight.check import releases

    assert releases.facts((0, 14)).loads_flattened_range and not releases.facts((0, 16)).loads_flattened_range
    assert [releases.facts((0, m)).mtp_layer_name for m in (13, 16, 17, 20)] == \
        ["transformer_layer", "transformer_layer", "mtp_model_layer", "mtp_model_layer"]
    assert releases.facts((0, 18)).param_group_keys == releases.STRUCTURE_KEYS
    assert "max_lr" in releases.facts((0, 19)).param_group_keys
    assert releases.facts((0, 16)).local_grouped_mlp and not releases.facts((0, 17)).local_grouped_mlp
    from megatron_preflight.hook import runtime

    installed = releases.facts(releases.installed_version())
    assert runtime.loads_flattened_range() == installed.loads_flattened_range
    assert tuple(runtime.param_group_keys()) == installed.param_group_keys

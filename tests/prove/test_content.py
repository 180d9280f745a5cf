"""A checkpoint's content against its stored fingerprints (prove/content.py): an untouched copy passes; a spliced shard,
an edited tensor, a diverged copy of a replicated tensor and a flipped bit are each found, with the tensor, the shard
file that holds the differing slice and the likely cause; `inspect --verify-content` and `reshard --verify` stop on
them (exit 1, nothing written); a fingerprint file that is damaged, foreign or huge is one clear error."""

import json
import os
import shutil

import pytest
import torch

from megatron_preflight.cli.main import main
from megatron_preflight.errors import PreflightError
from megatron_preflight.prove import fingerprint as fp
from megatron_preflight.prove.content import check_content
from megatron_preflight.prove.stored import path_for
from tests.conftest import fixture_path
from tests.helpers import ckpt_edit


def fingerprinted(tmp_path, name="tp2_torch"):
    root = tmp_path / name
    shutil.copytree(fixture_path(name), root)
    assert main(["fingerprint", str(root)]) == 0
    return root


def edit(path, change, which=("model",)):
    """Load a shard file, change tensors with ``change(key, tensor)`` (in place), save it again (its CRCs right)."""
    state = ckpt_edit.load(str(path))

    def walk(tree, prefix=""):
        for k, v in list(tree.items()) if isinstance(tree, dict) else []:
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel():
                change(prefix + str(k), v)
            elif isinstance(v, dict):
                walk(v, f"{prefix}{k}.")

    for part in which:
        walk(state[part])
    ckpt_edit.save(state, str(path))


def test_an_untouched_copy_equals_its_fingerprints(tmp_path):
    root = fingerprinted(tmp_path)
    report = check_content(str(root))
    assert report.ok and report.checked == len(fp.load(str(root), 2)["tensors"])
    assert "OK: all" in report.render()


def test_a_checkpoint_without_fingerprints_says_it_is_not_verified_and_the_command_it_names_fixes_that(tmp_path):
    import shlex
    import shutil

    from megatron_preflight.cli.main import main

    root = tmp_path / "ckpt"
    shutil.copytree(fixture_path("tp2_torch"), root)
    report = check_content(str(root))
    text = report.render()
    assert report.ok and report.fingerprints is None and "not verified" in text
    command = text.split("`")[1]  # the command quoted in the message, for the iteration it names
    assert command == f"megatron-preflight fingerprint {root} --iteration 2"
    assert main(shlex.split(command)[1:]) == 0
    again = check_content(str(root))
    assert again.ok and again.fingerprints is not None and again.checked > 0


def test_a_shard_spliced_in_from_another_run_is_named_as_such(tmp_path):
    root = fingerprinted(tmp_path)
    edit(root / "iter_0000002" / "mp_rank_01" / "model_optim_rng.pt", lambda k, t: t.add_(1e-3),
         which=("model", "optimizer"))
    report = check_content(str(root))
    assert not report.ok and len(report.findings) > 50
    assert {s for f in report.findings for s in f.shards} == {os.path.join("mp_rank_01", "model_optim_rng.pt")}
    assert all(f.located for f in report.findings)
    assert "spliced in from another run" in report.cause
    split = next(f for f in report.findings if f.tensor == "decoder.layers.0.mlp.linear_fc1.weight")
    assert split.problem == "1 of its 2 saved slices differ"  # the stored slices name the rank's file


def test_one_edited_element_is_named_with_its_file_and_the_cause(tmp_path):
    root = fingerprinted(tmp_path)

    def poke(key, t):
        if key == "decoder.layers.1.self_attention.linear_qkv.weight":
            t.view(-1)[5] += 1.0

    edit(root / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt", poke)
    report = check_content(str(root))
    (finding,) = report.findings
    assert finding.tensor == "decoder.layers.1.self_attention.linear_qkv.weight"
    assert finding.shards == (os.path.join("mp_rank_00", "model_optim_rng.pt"),) and finding.located
    assert "an edit" in report.cause


def test_a_diverged_copy_of_a_replicated_tensor_is_named(tmp_path):
    root = fingerprinted(tmp_path)

    def poke(key, t):
        if key == "decoder.layers.2.input_layernorm.weight":
            t.view(-1)[0] += 0.5

    edit(root / "iter_0000002" / "mp_rank_01" / "model_optim_rng.pt", poke)  # rank 0's copy is the one read
    (finding,) = check_content(str(root)).findings
    assert finding.tensor == "decoder.layers.2.input_layernorm.weight"
    assert finding.shards == (os.path.join("mp_rank_01", "model_optim_rng.pt"),)


def test_an_expert_edited_in_one_expert_rank_is_named(tmp_path):
    root = fingerprinted(tmp_path, "moe_ep2_torch")
    shard = next(d for d in sorted(os.listdir(root / "iter_0000002")) if d.endswith("_001"))

    def poke(key, t):
        if key.startswith("decoder.layers.0.mlp.experts.") and key.endswith("linear_fc2.weight"):
            t.view(-1)[3] -= 1.0

    edit(root / "iter_0000002" / shard / "model_optim_rng.pt", poke)
    report = check_content(str(root))
    assert report.findings and all(f.shards == (os.path.join(shard, "model_optim_rng.pt"),) for f in report.findings)
    assert all(".mlp.experts." in f.tensor for f in report.findings)


def flip_bit(path, at):
    with open(path, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0x10]))


def _tensor_offset(path, suffix):
    from megatron_preflight.torch_file import TorchFile

    with TorchFile(str(path)) as f:
        ref = next(v for k, v in f.load_metadata()["model"].items() if k.endswith(suffix))
        start, _ = f._record_offset(ref.storage.key)
    return start + ref.offset * 4 + 2


def test_a_flipped_bit_stops_inspect_and_reshard_naming_the_file(tmp_path, capsys):
    root = fingerprinted(tmp_path)
    shard = root / "iter_0000002" / "mp_rank_01" / "model_optim_rng.pt"
    flip_bit(shard, _tensor_offset(shard, "layers.3.mlp.linear_fc2.weight"))
    report = check_content(str(root))
    (finding,) = report.findings
    assert "CRC-32" in finding.problem and finding.shards == (str(shard),)
    assert "bit rot" in report.cause
    capsys.readouterr()
    assert main(["inspect", str(root), "--verify-content"]) == 1
    out = capsys.readouterr().out
    assert "CONTENT" in out and "layers.3.mlp.linear_fc2.weight" in out
    dst = tmp_path / "out"
    assert main(["reshard", str(root), str(dst), "--tp", "1", "--verify", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "not what its fingerprints say" in err and "Traceback" not in err
    assert not dst.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".out")]


def test_reshard_verify_passes_an_untouched_source_and_says_so(tmp_path, capsys):
    root = fingerprinted(tmp_path)
    assert main(["reshard", str(root), str(tmp_path / "out"), "--tp", "1", "--verify", "--no-progress"]) == 0
    assert "source content: equal to its fingerprints" in capsys.readouterr().err


def test_a_torch_dist_blob_with_a_flipped_bit_is_named(tmp_path):
    root = fingerprinted(tmp_path, "tp2_torch_dist")
    blob = root / "iter_0000002" / "__1_0.distcp"
    flip_bit(blob, int(os.path.getsize(blob) * 0.3))
    (finding,) = check_content(str(root)).findings
    assert "CRC-32" in finding.problem and finding.shards == (str(blob),)


def test_fingerprints_of_another_model_are_said_to_be(tmp_path):
    root = fingerprinted(tmp_path)
    other = fp.fingerprint_checkpoint(fixture_path("moe_ep2_torch"))
    other["iteration"] = 2
    fp.store(str(root), 2, other)
    report = check_content(str(root))
    assert not report.ok and "another model" in report.cause


def _write(path, data: bytes):
    with open(path, "wb") as fh:
        fh.write(data)


@pytest.mark.parametrize("damage, said", [
    (lambda p: _write(p, open(p, "rb").read()[:100]), "not valid JSON"),
    (lambda p: _write(p, b"[1, 2"), "not valid JSON"),
    (lambda p: _write(p, b"[" * 100000 + b"]" * 100000), "not valid JSON"),
    (lambda p: _write(p, json.dumps({"format": 1, "iteration": 2, "tensors": {"a": {"digest": "zz"}}}).encode()),
     "is not a digest"),
    (lambda p: _write(p, json.dumps({"format": 7, "iteration": 2, "tensors": {}}).encode()), "format 7"),
    (lambda p: os.truncate(p, fp.MAX_FILE_BYTES + 1), "more than any checkpoint's fingerprints take"),
    (lambda p: (os.remove(p), os.mkfifo(p)), "not a regular file"),
], ids=["truncated", "malformed", "deeply nested", "edited entry", "other format", "huge", "fifo"])
def test_a_bad_fingerprint_file_is_one_clear_error(tmp_path, capsys, damage, said):
    root = fingerprinted(tmp_path)
    damage(path_for(str(root), 2))
    with pytest.raises(PreflightError) as err:
        check_content(str(root))
    assert said in str(err.value) and err.value.code in ("fingerprint", "not_regular")
    capsys.readouterr()
    assert main(["inspect", str(root), "--verify-content"]) == 1
    out = capsys.readouterr()
    assert said in out.err and "Traceback" not in out.err + out.out


def test_fingerprints_of_another_iteration_under_this_ones_name_are_refused(tmp_path):
    root = fingerprinted(tmp_path)
    doc = fp.load(str(root), 2)
    doc["iteration"] = 7
    fp.store(str(root), 2, doc)
    with pytest.raises(PreflightError, match="fingerprints of iteration 7"):
        fp.load(str(root), 2)


@pytest.mark.parametrize("change, field", [
    (lambda sd: sd["opt_param_scheduler"].update(num_steps=40), "opt_param_scheduler"),
    (lambda sd: [g.update(lr=3e-4) for g in sd["optimizer"]["param_groups"]], "param_groups"),
])
def test_a_common_state_changed_after_the_fingerprints_is_found(tmp_path, change, field):
    """The fingerprints store the common state a resume reads (the LR scheduler's, the param groups' settings): an
    edit of it on every shard after they were taken is a finding naming it; the tensors still equal theirs."""
    root = fingerprinted(tmp_path)
    assert "common" in fp.load(str(root), 2)
    for shard in ("mp_rank_00", "mp_rank_01"):
        path = str(root / "iter_0000002" / shard / "model_optim_rng.pt")
        state = ckpt_edit.load(path)
        change(state)
        ckpt_edit.save(state, path)
    report = check_content(str(root))
    assert [f.tensor for f in report.findings] == [field], report.render()
    assert "differs from its fingerprints" in report.findings[0].problem


def test_the_common_state_of_gdn_with_drifted_copies_is_no_finding(tmp_path):
    """gdn_tp2_torch's out_norm copies differ by Megatron's design (reshard/plan/drift.py): its content check passes."""
    root = fingerprinted(tmp_path, "gdn_tp2_torch")
    report = check_content(str(root))
    assert report.ok, report.render()

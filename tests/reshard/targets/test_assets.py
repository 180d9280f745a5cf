"""The tokenizer assets and Megatron's integrity manifest in every written iteration dir."""

from __future__ import annotations

import json
import os
import shutil

from megatron_preflight.cli.main import main
from megatron_preflight.reshard import TargetLayout, write_resharded
from megatron_preflight.reshard.targets import assets
from tests.conftest import fixture_path


def test_a_torch_dist_output_carries_the_tokenizer_dir_and_a_manifest_megatron_can_check(tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(fixture_path("muon_tp2_torch_dist"), src)
    # A NullTokenizer run's assets dir is empty, as Megatron leaves it; git keeps no empty dir, so it is made here.
    (src / "iter_0000002" / "tokenizer").mkdir(exist_ok=True)
    out = tmp_path / "out"
    write_resharded(str(src), str(out), TargetLayout(tp=1, ckpt_format="torch_dist"))
    it = out / "iter_0000002"
    assert (it / "tokenizer").is_dir() and os.listdir(it / "tokenizer") == []
    manifest = json.loads((it / "integrity.json").read_text())
    listed = set(manifest["files"])
    assert manifest["algorithm"] == "sha256" and listed == {e.name for e in os.scandir(it)
                                                            if e.is_file() and e.name != "integrity.json"}
    assert ".metadata" in listed and assets.integrity_problems(str(it)) == []
    assert main(["inspect", str(out), "--verify-content"]) == 0
    assert "integrity   OK" in capsys.readouterr().out
    with open(it / "common.pt", "ab") as fh:
        fh.write(b"x")
    assert assets.integrity_problems(str(it)) == ["common.pt: its SHA-256 no longer matches integrity.json"]
    assert main(["inspect", str(out), "--verify-content"]) == 1
    assert "common.pt: its SHA-256 no longer matches" in capsys.readouterr().out


def test_the_manifest_is_said_written_only_where_it_is(tmp_path, capsys):
    """reshard says "integrity.json: ..." for a torch_dist output, which has one, and not for a legacy one, which has
    none (Megatron checks it for torch_dist only)."""
    for fmt in ("torch_dist", "torch"):
        out = tmp_path / fmt
        assert main(["reshard", fixture_path("muon_tp2_torch_dist"), str(out), "--no-progress", "--tp", "1",
                     "--ckpt-format", fmt]) == 0
        said = "integrity.json: SHA-256" in capsys.readouterr().out
        written = (out / "iter_0000002" / "integrity.json").exists()
        assert said == written == (fmt == "torch_dist"), (fmt, said, written)


def test_a_hugging_face_models_tokenizer_goes_into_the_iteration_dir(tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(fixture_path("../hf/llama"), hf)
    (hf / "tokenizer.json").write_text('{"model": {}}')
    (hf / "tokenizer_config.json").write_text("{}")
    out = tmp_path / "out"
    write_resharded(str(hf), str(out), TargetLayout(tp=1))
    copied = sorted(os.listdir(out / "release" / "tokenizer"))
    assert copied == ["tokenizer.json", "tokenizer_config.json"]
    assert (out / "release" / "tokenizer" / "tokenizer.json").read_text() == '{"model": {}}'
    assert not (out / "release" / "integrity.json").exists()  # (legacy: Megatron checks no manifest)


def test_a_file_hashed_as_it_is_written_has_the_digest_of_its_bytes_and_leaves_nothing_behind(tmp_path):
    """Large writes are hashed on a helper thread beside the write call; a buffer reused after write returns must not
    change the digest. integrity.json takes the digest, the sidecar goes; a target without a manifest (fsdp_dtensor)
    removes it too."""
    path = str(tmp_path / "data.bin")
    f = assets.HashedFile(path)
    buf = bytearray(os.urandom(3 << 20))
    f.write(buf)
    buf[:] = os.urandom(len(buf))  # the caller reuses its buffer
    f.write(buf)
    f.write(b"tail")
    f.close()
    side = tmp_path / (assets.DIGEST_PREFIX + "data.bin")
    assert json.loads(side.read_text())["sha256"] == assets.file_digest(path)
    assets.write_integrity(str(tmp_path))
    assert not side.exists()
    assert json.loads((tmp_path / "integrity.json").read_text())["files"]["data.bin"] == assets.file_digest(path)
    out = tmp_path / "fsdp"
    write_resharded(fixture_path("tp2_torch_dist"), str(out), TargetLayout(ckpt_format="fsdp_dtensor"))
    left = [n for _d, _s, fs in os.walk(out) for n in fs if n.startswith(assets.DIGEST_PREFIX)]
    assert left == []

"""Hostile and damaged Hugging Face model dirs: every path an index names stays inside the model dir, only regular
files are opened (without blocking), headers and configs are bounded and typed. Each input is refused by the CLI with
exit 1 and one message naming the file and the field, in bounded time and memory, reading nothing outside the dir."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct

import pytest

from megatron_preflight.cli.main import main
from megatron_preflight.errors import CorruptFileError
from megatron_preflight.layout.hf import files

hf_models = pytest.importorskip("tests.helpers.hf_models")
pytest.importorskip("transformers")

SAFE = "model.safetensors"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return hf_models.write("qwen3", str(tmp_path_factory.mktemp("hf") / "qwen3"))


@pytest.fixture
def model(base, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(base, d)
    return d


def _header(path) -> tuple[dict, bytes]:
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _rewrite(path, raw_header: bytes, body: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw_header)) + raw_header + body)


def _config(model, **fields) -> None:
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(fields)
    (model / "config.json").write_text(json.dumps(cfg))


def _refused(capsys, path, *words, out=None) -> str:
    """``inspect path`` (``reshard path out`` when ``out`` is given), with an alarm: nothing may block; exit 1, one
    message holding ``words``."""
    signal.alarm(60)
    try:
        rc = main(["inspect", str(path)] if out is None else ["reshard", str(path), str(out), "--no-progress"])
    finally:
        signal.alarm(0)
    out = capsys.readouterr()
    text = out.out + out.err
    assert rc == 1, text
    assert "Traceback" not in text and "internal error" not in text, text
    for w in words:
        assert w in text, (w, text)
    return text


def _outside(model, tmp_path) -> str:
    """The model's weights moved out of its dir, to ``tmp_path/other``."""
    other = tmp_path / "other"
    other.mkdir()
    shutil.move(str(model / SAFE), str(other / SAFE))
    return str(other / SAFE)


@pytest.mark.parametrize("how", ["relative", "absolute"])
def test_an_index_naming_a_file_outside_the_dir_is_refused_and_nothing_is_read(model, tmp_path, capsys, how):
    target = _outside(model, tmp_path)
    header, _ = _header(target)
    name = "../other/model.safetensors" if how == "relative" else target
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: name for k in header if k != "__metadata__"}}))
    _refused(capsys, model, "model.safetensors.index.json", name, "outside the model dir")
    out = tmp_path / "out"
    _refused(capsys, model, "outside the model dir", out=out)
    assert not out.exists()


def test_a_symlink_leaving_the_dir_is_refused(model, tmp_path, capsys):
    os.symlink(_outside(model, tmp_path), model / SAFE)
    _refused(capsys, model, "is a symlink to", "outside the model dir", "Fix: copy")


def test_a_hub_cache_snapshot_reads_its_blobs(base, tmp_path, capsys):
    """transformers' cache: snapshots/REV/NAME -> ../../blobs/HASH: the one symlink out of a dir that is followed."""
    repo = tmp_path / "models--org--tiny"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, name in enumerate(sorted(os.listdir(base))):
        shutil.copy(os.path.join(base, name), repo / "blobs" / f"h{i}")
        os.symlink(f"../../blobs/h{i}", snap / name)
    assert main(["inspect", str(snap)]) == 0
    assert "complete and consistent" in capsys.readouterr().out
    # ... and only there: a link to another repo's blobs is refused
    other = tmp_path / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    shutil.copy(snap / SAFE, other / "x")
    os.remove(snap / SAFE)
    os.symlink(other / "x", snap / SAFE)
    _refused(capsys, snap, "outside the model dir")


def test_a_fifo_shard_is_refused_without_blocking(model, capsys):
    os.remove(model / SAFE)
    os.mkfifo(model / SAFE)
    _refused(capsys, model, SAFE, "FIFO", "not a regular file")


def test_a_fifo_tokenizer_file_is_refused_not_read(model, capsys):
    os.mkfifo(model / "tokenizer.json")
    _refused(capsys, model, "tokenizer.json", "FIFO")


def test_a_tokenizer_file_linking_out_is_never_copied(model, tmp_path, capsys):
    secret = tmp_path / "secret.txt"
    secret.write_text("not the model's")
    os.symlink(secret, model / "tokenizer_config.json")
    out = tmp_path / "out"
    _refused(capsys, model, "tokenizer_config.json", "outside the model dir",
             out=out)
    assert not out.exists()


def test_overlapping_byte_ranges_are_refused(model, capsys):
    header, body = _header(model / SAFE)
    a, b = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"
    header[b]["data_offsets"] = header[a]["data_offsets"]
    _rewrite(model / SAFE, json.dumps(header).encode(), body)
    _refused(capsys, model, SAFE, "share bytes", a, b)


def test_a_tensor_defined_twice_in_a_header_is_refused(model, capsys):
    header, body = _header(model / SAFE)
    name = "model.norm.weight"
    raw = json.dumps(header)[:-1] + ", " + json.dumps({name: header[name]})[1:]
    _rewrite(model / SAFE, raw.encode(), body)
    _refused(capsys, model, SAFE, f"defines '{name}' twice")


def test_a_duplicate_inside_one_entry_is_found_too():
    """The C-speed count of ``dtype``/``shape``/``data_offsets`` misses nothing: an entry with two dtypes differs."""
    raw = b'{"a": {"dtype": "F32", "dtype": "F16", "shape": [1], "data_offsets": [0, 4]}}'
    with pytest.raises(CorruptFileError, match="defines 'dtype' twice"):
        files.parse_json(raw, "x", "fix", counted=("dtype", "shape", "data_offsets"))
    ok = b'{"__metadata__": {"format": "pt"}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    assert files.parse_json(ok, "x", "fix", counted=("dtype", "shape", "data_offsets"))["a"]["shape"] == [1]


def test_a_tensor_in_two_files_is_refused(model, capsys):
    header, body = _header(model / SAFE)
    keep = {"__metadata__": header.get("__metadata__", {}), "model.norm.weight": header["model.norm.weight"]}
    _rewrite(model / "model-2.safetensors", json.dumps(keep).encode(), body)
    _refused(capsys, model, "model.norm.weight", "is defined in this file and in")


def test_a_deeply_nested_header_is_refused_in_bounded_time(model, capsys):
    _rewrite(model / SAFE, b"[" * 200_000, b"")
    _refused(capsys, model, SAFE, "nests deeper")


def test_a_truncated_file_is_one_finding_listing_its_tensors(model, capsys):
    size = os.path.getsize(model / SAFE)
    with open(model / SAFE, "r+b") as fh:
        fh.truncate(size - 40_000)
    text = _refused(capsys, model, "truncated_file", "tensor(s) cut")
    assert text.count("[truncated_file]") == 1, text


@pytest.mark.parametrize("field,value,words", [
    ("num_attention_heads", 0, ["num_attention_heads is 0", "an integer in [1"]),
    ("hidden_size", "32x", ["hidden_size is '32x'", "an integer"]),
    ("tie_word_embeddings", "false", ["tie_word_embeddings is 'false'", "true or false"]),
    ("vocab_size", 10**12, ["vocab_size is 1000000000000"]),
    ("num_hidden_layers", 10**12, ["num_hidden_layers is 1000000000000"]),
    ("rms_norm_eps", -1e-6, ["rms_norm_eps is -1e-06"]),
    ("rope_parameters", {"rope_theta": -5, "rope_type": "default"}, ["rope_theta is -5"]),
    ("rope_parameters", {"rope_theta": 1e4, "rope_type": "linear", "factor": "8"}, ["factor is '8'"]),
    ("head_dim", 2**21, ["head_dim is 2097152"]),
])
def test_a_config_number_of_the_wrong_type_or_range_is_refused(model, capsys, field, value, words):
    _config(model, **{field: value})
    _refused(capsys, model, "config.json", *words, "Fix: set")


def test_nan_anywhere_in_the_config_is_refused(model, capsys):
    text = (model / "config.json").read_text().rstrip()
    (model / "config.json").write_text(text[:-1] + ', "rope_theta": NaN}')
    _refused(capsys, model, "config.json", "NaN")


def test_a_config_key_twice_is_refused(model, capsys):
    text = (model / "config.json").read_text().rstrip()
    (model / "config.json").write_text(text[:-1] + ', "hidden_size": 64}')
    _refused(capsys, model, "config.json", "defines 'hidden_size' twice")


def test_a_float8_weight_without_its_scales_is_refused(model, tmp_path, capsys):
    header, body = _header(model / SAFE)
    name = "model.layers.0.self_attn.o_proj.weight"
    lo, hi = header[name]["data_offsets"]
    header[name].update(dtype="F8_E4M3", data_offsets=[lo, lo + (hi - lo) // 4])
    _rewrite(model / SAFE, json.dumps(header).encode(), body)
    _refused(capsys, model, name, "float8_e4m3fn", "no FP8 quantization_config")
    out = tmp_path / "out"
    _refused(capsys, model, "float8_e4m3fn", out=out)
    assert not out.exists()


def test_the_reader_refuses_a_name_outside_the_dir_on_its_own(model, tmp_path):
    """Defence in depth: the reader of tensor bytes asks the same gate, whatever built the refs."""
    from megatron_preflight.reshard.sources.hf import HfReader

    _outside(model, tmp_path)
    with pytest.raises(CorruptFileError, match="outside the model dir"):
        HfReader(str(model))._fd("../other/model.safetensors")


def test_the_tokenizer_code_is_named_and_its_module_is_a_plain_name_inside_the_dir(tmp_path):
    """tokenizer_config.json's auto_map names the model's own tokenizer class; its module is a file of the model dir
    by a plain name (a path in a hostile auto_map is no module), and a config linked from outside the dir is not read."""
    import json

    from megatron_preflight.layout.hf.files import tokenizer_code, tokenizer_module

    model = tmp_path / "model"
    model.mkdir()
    assert tokenizer_code(str(model)) is None
    (model / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}))
    assert tokenizer_code(str(model)) == "tokenization_kimi.TikTokenTokenizer"
    assert tokenizer_module("tokenization_kimi.TikTokenTokenizer") == "tokenization_kimi.py"
    assert tokenizer_module("moonshotai/Kimi-K2--tokenization_kimi.TikTokenTokenizer") == "tokenization_kimi.py"
    assert tokenizer_module("../../etc/passwd.X") is None and tokenizer_module("a/b.X") is None
    outside = tmp_path / "elsewhere.json"
    outside.write_text((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").unlink()
    (model / "tokenizer_config.json").symlink_to(outside)
    assert tokenizer_code(str(model)) is None

"""FP8 weights with block scales, as the hub publishes them (DeepSeek-V3, Kimi K2, Qwen3-FP8; llm-compressor's and
ModelOpt's FP8, llm-compressor's packed INT4 / INT8), read as the model's weights: each rank dequantizes its own rows
with the scales that cover them. The oracle is the same model dequantized
by the test itself (fp8 x scale, in the model's dtype; tests/helpers/hf_models.write_fp8) — its tensors, and
``transformers``' own logits of it."""

from __future__ import annotations

import json
import os
import struct

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from tests.helpers import hf_models  # noqa: E402
from tests.helpers.cli_inproc import run as run_cli  # noqa: E402
from tests.helpers.safetensors_edit import edit_header  # noqa: E402

BLOCK = (24, 20)  # (the tiny models' 32 / 64 / 96-wide weights: partial edge blocks in both dims)


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for name in ("llama", "qwen3_moe", "deepseek_v3"):
        src = hf_models.write(name, str(root / name))
        out[name] = hf_models.write_fp8(src, str(root / f"{name}_fp8"), BLOCK)
    src = hf_models.write("llama", str(root / "llama_bf16_src"))
    out["llama_bf16"] = hf_models.write_fp8(src, str(root / "llama_bf16"), BLOCK, dtype=torch.bfloat16)
    return out


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "deepseek_v3", "llama_bf16"])
def test_converted_offline_it_is_the_dequantized_model_tensor_for_tensor(fp8_models, name, tmp_path):
    fp8, deq = fp8_models[name]
    rc, text = run_cli("inspect", fp8)
    assert rc == 0 and "block scales (weight_scale_inv): dequantized to" in text, text
    hf, legacy = str(tmp_path / "hf"), str(tmp_path / "legacy")
    flags = ["--ep", "2"] if name == "qwen3_moe" else ["--tp", "2"]
    assert run_cli("reshard", fp8, legacy, "--no-progress", *flags)[0] == 0
    assert run_cli("reshard", legacy, hf, "--ckpt-format", "hf", "--no-progress")[0] == 0
    for a, b in ((deq, legacy), (deq, hf)):
        rc, text = run_cli("diff", a, b)
        assert rc == 0 and "EQUAL" in text, text


@pytest.mark.parametrize("name, layout", [("llama", dict(tp=2)), ("qwen3_moe", dict(ep=2))])
def test_in_memory_logits_equal_transformers_on_the_dequantized_model(mcore_pool, fp8_models, name, layout):
    pytest.importorskip("megatron.core")
    fp8, deq = fp8_models[name]
    ref = hf_models.hf_logits(deq)
    out = mcore_pool.run("tests.helpers.hf_models:load_and_forward", hf_dir=fp8, **layout)
    torch.testing.assert_close(out[0], ref, atol=1e-5, rtol=1e-5)


def _second_half_reads(model: str) -> tuple:
    """(the first run of linear_fc2's ref, the (start, bytes) reads of rows 16..31 — TP2 rank 1 of that row-split
    [32, 64] weight — read alone, after checking them equal to those rows of the whole tensor)."""
    from megatron_preflight import reshard
    from megatron_preflight.reshard.sources.hf import HfReader

    ref = reshard.open_index(model).layout.shards[0].meta["model"]["decoder.layers.0.mlp.linear_fc2.weight"]
    assert ref.quant and ref.shape == (32, 64)
    reader, seen = HfReader(model), []
    real = reader._pread
    reader._pread = lambda name, start, out: (seen.append((start, len(out))), real(name, start, out))[1]
    whole = reader.tensor("", ref)
    reader._last = None
    seen.clear()
    torch.testing.assert_close(reader.rows("", ref, 16, 16), whole[16:], atol=0, rtol=0)
    return ref.quant[0], seen


def test_a_rank_reads_only_its_rows_and_the_scales_that_cover_them(fp8_models):
    q, seen = _second_half_reads(fp8_models["llama"][0])
    assert (q.start + 16 * 64, 16 * 64) in seen  # its rows' FP8 bytes only
    assert (q.scale_start + 0, 2 * 4 * 4) in seen  # scale rows 0..1 (rows 16..31 lie in blocks 0 and 1 of 24), 4 cols
    assert sum(n for _, n in seen) == 16 * 64 + 2 * 4 * 4


SCALE = "model.layers.0.mlp.down_proj.weight_scale_inv"


@pytest.mark.parametrize("damage, words", [
    ("missing", ["has no 'model.layers.0.mlp.down_proj.weight_scale_inv'"]),
    ("shape", [SCALE, "needs float32 / bfloat16 / float16 of shape [2, 4] (24x20 block)"]),
])
def test_a_malformed_scale_is_refused_naming_the_tensor(fp8_models, tmp_path, damage, words):
    import shutil

    fp8 = str(tmp_path / "m")
    shutil.copytree(fp8_models["llama"][0], fp8)

    def fn(header, body):
        if damage == "missing":
            header.pop(SCALE)
        else:
            header[SCALE]["shape"] = [4, 2]

    edit_header(os.path.join(fp8, "model.safetensors"), fn)
    rc, text = run_cli("inspect", fp8)
    assert rc == 1 and all(w in text for w in words), text


def test_a_non_finite_scale_stops_the_read_naming_the_tensor(fp8_models, tmp_path):
    import shutil

    fp8 = str(tmp_path / "m")
    shutil.copytree(fp8_models["llama"][0], fp8)

    def fn(header, body):
        lo = header[SCALE]["data_offsets"][0]
        body[lo:lo + 4] = struct.pack("<f", float("inf"))

    edit_header(os.path.join(fp8, "model.safetensors"), fn)
    rc, text = run_cli("reshard", fp8, str(tmp_path / "out"), "--no-progress")
    assert rc == 1 and SCALE in text and "non-finite" in text, text
    assert not os.path.exists(tmp_path / "out")


def test_another_quantization_is_refused_naming_it(fp8_models, tmp_path):
    import shutil

    fp8 = str(tmp_path / "m")
    shutil.copytree(fp8_models["llama"][0], fp8)
    cfg = json.load(open(os.path.join(fp8, "config.json")))
    cfg["quantization_config"] = {"quant_method": "gptq"}
    json.dump(cfg, open(os.path.join(fp8, "config.json"), "w"))
    rc, text = run_cli("inspect", fp8)
    assert rc == 1 and "'gptq'" in text and "does not dequantize" in text, text


# FP8 as llm-compressor publishes it (compressed-tensors float-quantized: weight_scale per tensor / channel / group /
# block, in the model's dtype) and as NVIDIA ModelOpt does (quant_algo FP8: a float32 weight_scale per tensor beside a
# static input_scale): name -> (model, strategy, size, dtype)
COMPRESSED = {"llama_channel": ("llama", "channel", None, torch.bfloat16), "llama_group": ("llama", "group", 16, None),
              "llama_tensor": ("llama", "tensor", None, torch.bfloat16),
              "llama_block": ("llama", "block", [24, 20], torch.bfloat16),
              "qwen3_moe_block": ("qwen3_moe", "block", [24, 20], None),
              "deepseek_v3_channel": ("deepseek_v3", "channel", None, torch.bfloat16)}
# and its INT4 / INT8 weight-only form (compressed-tensors pack-quantized, as Kimi K2 Thinking's experts):
# name -> (model, bits, group size (None: per channel), dtype)
PACKED = {"llama_int4": ("llama", 4, 16, torch.bfloat16), "llama_int8": ("llama", 8, None, None),
          "qwen3_moe_int4": ("qwen3_moe", 4, 16, None), "deepseek_v3_int4": ("deepseek_v3", 4, 8, torch.bfloat16)}


@pytest.fixture(scope="module")
def compressed_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("compressed")
    srcs = {name: hf_models.write(name, str(root / name)) for name in ("llama", "qwen3_moe", "deepseek_v3")}
    out = {key: hf_models.write_compressed_fp8(srcs[name], str(root / key), strategy, size, dtype)
           for key, (name, strategy, size, dtype) in COMPRESSED.items()}
    out["llama_modelopt"] = hf_models.write_modelopt_fp8(srcs["llama"], str(root / "llama_modelopt"))
    for key, (name, bits, group, dtype) in PACKED.items():
        out[key] = hf_models.write_compressed_int(srcs[name], str(root / key), bits, group, dtype)
    return out


@pytest.mark.parametrize("key", [*COMPRESSED, "llama_modelopt", *PACKED])
def test_compressed_tensors_and_modelopt_forms_convert_to_the_dequantized_model(compressed_models, key, tmp_path):
    fp8, deq = compressed_models[key]
    rc, text = run_cli("inspect", fp8)
    form = "per-tensor" if key.endswith(("tensor", "modelopt")) else \
        {"channel": "per-channel", "group": "per-group (16)", "block": "24x20 block",
         "int4": f"per-group ({PACKED.get(key, (0, 0, 0))[2]})", "int8": "per-channel"}[key.rsplit("_", 1)[1]]
    values = {"int4": "int4 (packed)", "int8": "int8 (packed)"}.get(key.rsplit("_", 1)[1], "float8_e4m3fn")
    assert rc == 0 and f"{values} with {form} scales (weight_scale; " in text, text
    assert ("activation / KV-cache scale(s) of the modelopt FP8" in text) == (key == "llama_modelopt"), text
    hf, legacy = str(tmp_path / "hf"), str(tmp_path / "legacy")
    flags = ["--ep", "2"] if "moe" in key else ["--tp", "2"]
    assert run_cli("reshard", fp8, legacy, "--no-progress", *flags)[0] == 0
    assert run_cli("reshard", legacy, hf, "--ckpt-format", "hf", "--no-progress")[0] == 0
    for a, b in ((deq, legacy), (deq, hf)):
        rc, text = run_cli("diff", a, b)
        assert rc == 0 and "EQUAL" in text, text


@pytest.mark.parametrize("key, layout", [("llama_channel", dict(tp=2)), ("qwen3_moe_block", dict(ep=2)),
                                         ("qwen3_moe_int4", dict(ep=2))])
def test_compressed_fp8_in_memory_logits_equal_transformers_on_the_dequantized_model(mcore_pool, compressed_models,
                                                                                    key, layout):
    pytest.importorskip("megatron.core")
    fp8, deq = compressed_models[key]
    ref = hf_models.hf_logits(deq)
    out = mcore_pool.run("tests.helpers.hf_models:load_and_forward", hf_dir=fp8, **layout)
    torch.testing.assert_close(out[0], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("key", ["llama_channel", "llama_group", "llama_tensor", "llama_block", "llama_int4",
                                 "llama_int8"])
def test_compressed_forms_read_as_the_publishers_own_library_decompresses_them(compressed_models, key, tmp_path):
    """The oracle is compressed-tensors itself (llm-compressor's library, through transformers'
    CompressedTensorsConfig(dequantize=True)): the weights it decompresses are our export's, bit for bit. Not in
    requirements-test.txt (it pins its own torch): skipped where it is not installed."""
    pytest.importorskip("compressed_tensors")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    fp8, _ = compressed_models[key]
    hf = str(tmp_path / "hf")
    assert run_cli("reshard", fp8, hf, "--ckpt-format", "hf", "--no-progress")[0] == 0
    ours = {}
    for f in os.listdir(hf):
        if f.endswith(".safetensors"):
            ours.update(load_file(os.path.join(hf, f)))
    theirs = AutoModelForCausalLM.from_pretrained(fp8, quantization_config=CompressedTensorsConfig(dequantize=True),
                                                  dtype={**COMPRESSED, **PACKED}[key][3] or torch.float32).state_dict()
    assert set(ours) == set(theirs)
    for name, t in ours.items():
        assert theirs[name].dtype == t.dtype and torch.equal(theirs[name], t), name


def test_a_rank_reads_only_its_rows_per_channel_scales(compressed_models):
    q, seen = _second_half_reads(compressed_models["llama_channel"][0])
    assert q.block == (1, 64) and q.scale_cols == 1 and q.scale_name.endswith("down_proj.weight_scale")
    assert seen == [(q.start + 16 * 64, 16 * 64), (q.scale_start + 16 * 2, 16 * 2)]  # its rows, their bf16 scales


def test_a_stray_zero_point_is_named_not_dropped(compressed_models, tmp_path):
    import shutil

    fp8 = str(tmp_path / "m")
    shutil.copytree(compressed_models["llama_channel"][0], fp8)
    name = "model.layers.0.mlp.down_proj.weight_zero_point"

    def fn(header, body):
        header[name] = {"dtype": "BF16", "shape": [32, 1], "data_offsets": [len(body), len(body) + 64]}
        body.extend(bytes(64))

    edit_header(os.path.join(fp8, "model.safetensors"), fn)
    rc, text = run_cli("inspect", fp8)
    assert rc == 1 and "unmapped_tensor" in text and name in text, text


def test_a_rank_reads_only_its_rows_of_packed_int4_and_their_scales(compressed_models):
    q, seen = _second_half_reads(compressed_models["llama_int4"][0])
    assert q.values == "int4 (packed)" and q.block == (1, 16) and q.scale_cols == 4 and q.row_bytes == 32
    # its rows (two values a byte), their bf16 scales (4 a row); the stored shape was checked by the first read
    assert seen == [(q.start + 16 * 32, 16 * 32), (q.scale_start + 16 * 4 * 2, 16 * 4 * 2)]


def test_a_packed_weight_whose_stored_shape_differs_is_refused_when_read(compressed_models, tmp_path):
    import shutil

    packed = str(tmp_path / "m")
    shutil.copytree(compressed_models["llama_int4"][0], packed)
    name = "model.layers.0.mlp.down_proj.weight_shape"

    def fn(header, body):
        lo = header[name]["data_offsets"][0]
        body[lo + 8:lo + 16] = struct.pack("<q", 60)  # (a padded [32, 60] weight: read as [32, 64] it is not)

    edit_header(os.path.join(packed, "model.safetensors"), fn)
    rc, text = run_cli("reshard", packed, str(tmp_path / "out"), "--no-progress")
    assert rc == 1 and name in text and "[32, 60]" in text and "[32, 64]" in text, text
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("algo", ["FP8", "NVFP4"])
def test_modelopts_own_hf_quant_config_is_read_where_config_json_names_none(compressed_models, tmp_path, algo):
    """A ModelOpt export may record its quantization only in hf_quant_config.json: read from there (FP8), or refused
    naming that file and its quant_algo (NVFP4)."""
    import shutil

    path = str(tmp_path / "m")
    shutil.copytree(compressed_models["llama_modelopt"][0], path)
    with open(os.path.join(path, "config.json")) as fh:
        cfg = json.load(fh)
    del cfg["quantization_config"]
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    with open(os.path.join(path, "hf_quant_config.json"), "w") as fh:
        json.dump({"producer": {"name": "modelopt", "version": "0.37.0"},
                   "quantization": {"quant_algo": algo, "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}},
                  fh)
    rc, text = run_cli("inspect", path)
    if algo == "NVFP4":
        assert rc == 1 and "hf_quant_config.json (modelopt) holds quant_algo 'NVFP4'" in text, text
        return
    assert rc == 0 and "per-tensor scales (weight_scale; modelopt FP8)" in text, text
    rc, text = run_cli("diff", path, compressed_models["llama_modelopt"][1])
    assert rc == 0 and "EQUAL" in text, text


@pytest.mark.parametrize("form", ["fp8_block", "llama_channel", "llama_group", "llama_int4", "llama_int8"])
def test_rows_dequantized_in_chunks_equal_them_dequantized_at_once(fp8_models, compressed_models, form, monkeypatch):
    """A rank's rows are dequantized a chunk of rows at a time (bounded float32 temporaries): chunks of 5 rows, which
    cut the 24-row scale blocks anywhere, give the same values bit for bit."""
    from megatron_preflight import reshard
    from megatron_preflight.reshard.sources import hf

    model = fp8_models["llama"][0] if form == "fp8_block" else compressed_models[form][0]
    refs = reshard.open_index(model).layout.shards[0].meta["model"]
    names = [k for k, r in refs.items() if getattr(r, "quant", ())]
    assert names
    whole = {k: hf.HfReader(model).tensor("", refs[k]) for k in names}
    monkeypatch.setattr(hf, "_CHUNK", 5 * 64)  # (5 rows of the 64-wide weights; 2 or 3 of the wider ones)
    for k in names:
        reader = hf.HfReader(model)
        torch.testing.assert_close(reader.tensor("", refs[k]), whole[k], atol=0, rtol=0)
        torch.testing.assert_close(reader.rows("", refs[k], 7, 11), whole[k][7:18], atol=0, rtol=0)

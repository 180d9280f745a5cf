"""A multimodal model as the hub publishes it whose language model a family reads (Qwen3.5 and Qwen3.6:
``Qwen3_5MoeForConditionalGeneration``, ``Qwen3_5ForConditionalGeneration``; spec.Wrapper): read as the text model
``transformers`` itself extracts from the same dir (its ``Qwen3_5*ForCausalLM.from_pretrained``, the oracle), tensor
for tensor, at the saved layout and resharded; the vision encoder named in a note, never silently dropped; an export
writes that text model; a config whose two levels disagree is refused naming both."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
T = pytest.importorskip("transformers")

from megatron_preflight.layout.discover import discover  # noqa: E402
from tests.helpers import hf_models  # noqa: E402
from tests.helpers.cli_inproc import run as cli  # noqa: E402

TEXT = {"qwen3_5_moe": "Qwen3_5MoeForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM"}


@pytest.fixture(scope="module", params=sorted(TEXT))
def pair(request, tmp_path_factory):
    """(name, the VLM dir, the text model transformers reads from it, saved as its own dir)."""
    root = tmp_path_factory.mktemp(request.param)
    vlm = hf_models.write_vlm(request.param, str(root / "vlm"))
    text = getattr(T, TEXT[request.param]).from_pretrained(vlm, dtype=torch.float32)
    text.save_pretrained(str(root / "text"))
    return request.param, vlm, str(root / "text"), text


def test_the_language_model_reads_as_the_text_model_transformers_extracts(pair):
    name, vlm, text_dir, _ = pair
    # (transformers 5 saves the text model it read from the multimodal files under their prefix, as they were)
    assert any(n.startswith("model.language_model.") for n in hf_models_names(text_dir))
    assert any("stored under 'model.language_model.'" in n for n in discover(text_dir).notes)
    lay = discover(vlm)
    assert lay.problems == [], lay.problems
    note = next(n for n in lay.notes if "multimodal" in n)
    assert "vision encoder (33 tensors under 'model.visual.'" in note and "M-RoPE" in note
    assert f"writes the language model as {TEXT[name]}" in note
    ours, theirs = lay.saved_args, discover(text_dir).saved_args
    assert {k: v for k, v in vars(ours).items() if k != "tokenizer_model"} == \
        {k: v for k, v in vars(theirs).items() if k != "tokenizer_model"}
    rc, said = cli("diff", vlm, text_dir)  # every Megatron tensor, bit for bit
    assert rc == 0, said
    assert cli("flags", vlm)[1].split("\n", 1)[1] == cli("flags", text_dir)[1].split("\n", 1)[1]


def hf_models_names(path: str) -> list[str]:
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as fh:
        return list(fh.keys())


def test_on_text_the_multimodal_model_computes_its_text_models_logits(pair):
    """What a Megatron run trains (the language model on text) is what the published model computes on text."""
    name, vlm, _, text = pair
    full = getattr(T, f"{TEXT[name].replace('ForCausalLM', 'ForConditionalGeneration')}").from_pretrained(
        vlm, dtype=torch.float32)
    ids = hf_models.tokens()
    with torch.no_grad():
        torch.testing.assert_close(full.eval()(ids).logits, text.eval()(ids).logits, atol=0, rtol=0)


def test_resharded_and_exported_it_is_the_text_model(pair, tmp_path):
    name, vlm, text_dir, _ = pair
    layout = ["--tensor-model-parallel-size", "2"] + (["--expert-model-parallel-size", "2"] if "moe" in name else [])
    mid, back = str(tmp_path / "megatron"), str(tmp_path / "back")
    assert cli("reshard", vlm, mid, "--no-progress", "--ckpt-format", "torch_dist", "--", *layout)[0] == 0
    rc, said = cli("diff", mid, text_dir, "--weights-only")
    assert rc == 0, said
    rc, said = cli("reshard", mid, back, "--no-progress", "--ckpt-format", "hf")
    assert rc == 0, said
    with open(os.path.join(back, "config.json")) as fh:
        assert json.load(fh)["architectures"] == [TEXT[name]]
    assert cli("diff", back, text_dir)[0] == 0
    torch.testing.assert_close(hf_models.hf_logits(back), hf_models.hf_logits(text_dir), atol=0, rtol=0)


def test_a_tied_head_the_two_levels_disagree_on_is_refused_naming_both(tmp_path):
    vlm = hf_models.write_vlm("qwen3_5", str(tmp_path / "vlm"))
    path = os.path.join(vlm, "config.json")
    with open(path) as fh:
        raw = json.load(fh)
    raw["tie_word_embeddings"] = True  # (the text_config says false)
    with open(path, "w") as fh:
        json.dump(raw, fh)
    rc, text = cli("inspect", vlm)
    assert rc == 1 and "Traceback" not in text
    assert "tie_word_embeddings is True and its text_config.tie_word_embeddings is False" in text
    assert "Qwen3_5ForConditionalGeneration reads the first" in text


def test_a_multimodal_config_without_its_text_config_is_named(tmp_path):
    vlm = hf_models.write_vlm("qwen3_5", str(tmp_path / "vlm"))
    path = os.path.join(vlm, "config.json")
    with open(path) as fh:
        raw = json.load(fh)
    del raw["text_config"]
    with open(path, "w") as fh:
        json.dump(raw, fh)
    rc, text = cli("inspect", vlm)
    assert rc == 1 and "holds no text_config object" in text


def _fuse_experts(src: str, dst: str) -> None:
    """``src``'s files with each MoE layer's experts stacked as the hub's Qwen3.5-MoE files may hold them:
    ``mlp.experts.gate_up_proj`` [E, 2I, H] (each expert's gate rows, then its up rows) and ``mlp.experts.down_proj``
    [E, H, I] — transformers' own parameter layout (test-only)."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    flat = load_file(os.path.join(src, "model.safetensors"))
    out, experts = {}, {}
    for name, t in flat.items():
        m = re.match(r"(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
        else:
            out[name] = t
    for layer, by in experts.items():
        n = len(by)
        out[layer + "gate_up_proj"] = torch.stack([torch.cat([by[j]["gate_proj"], by[j]["up_proj"]]) for j in range(n)])
        out[layer + "down_proj"] = torch.stack([by[j]["down_proj"] for j in range(n)])
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


def test_experts_stacked_as_the_hub_holds_them_read_alike(pair, tmp_path):
    """The same Qwen3.5-MoE with its experts stacked per layer: transformers reads it to the same logits (the oracle
    of the layout), and so does megatron-preflight (bit for bit the same Megatron tensors); an export writes them one
    by one, as transformers saves them."""
    name, vlm, text_dir, _ = pair
    if name != "qwen3_5_moe":
        pytest.skip("the dense model has no experts")
    fused = str(tmp_path / "fused")
    _fuse_experts(vlm, fused)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in hf_models_names(fused))
    torch.testing.assert_close(hf_models.hf_logits(fused), hf_models.hf_logits(vlm), atol=0, rtol=0)
    assert discover(fused).problems == []
    rc, said = cli("diff", fused, text_dir)
    assert rc == 0, said
    back = str(tmp_path / "back")
    assert cli("reshard", fused, back, "--no-progress", "--ckpt-format", "hf")[0] == 0
    assert any(".mlp.experts.0.gate_proj.weight" in n for n in hf_models_names(back))
    torch.testing.assert_close(hf_models.hf_logits(back), hf_models.hf_logits(vlm), atol=0, rtol=0)


# Kimi K2.5 / K2.6 as Moonshot publishes them: Kimi K2's DeepseekV3ForCausalLM under language_model. beside a vision
# tower, its routed experts INT4 (compressed-tensors pack-quantized). transformers ships no KimiK25 class (the hub's
# is custom code), so the dir is test-built from a DeepSeek-V3 (tests/helpers/hf_models.write_kimi_k25) and the oracle
# is that DeepSeek-V3 dir, tensor for tensor.
@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi_k25")
    text = hf_models.write("deepseek_v3", str(root / "text"))
    int4, deq = hf_models.write_compressed_int(text, str(root / "int4"), 4, 8, dtype=torch.bfloat16)
    return {"text": text, "k25": hf_models.write_kimi_k25(text, str(root / "k25")), "deq": deq,
            "k25_int4": hf_models.write_kimi_k25(int4, str(root / "k25_int4")),
            "k25_int4_text_quant": hf_models.write_kimi_k25(int4, str(root / "k25_int4_t"), quant_in_text=True)}


def test_kimi_k25_reads_as_the_kimi_k2_language_model_it_holds(kimi):
    lay, ref = discover(kimi["k25"]), discover(kimi["text"])
    assert lay.problems == [], lay.problems
    note = next(n for n in lay.notes if "multimodal" in n)
    assert "vision encoder (5 tensors under 'vision_tower.', 'mm_projector.'" in note
    assert "writes the language model as DeepseekV3ForCausalLM (transformers' own" in note
    assert {k: v for k, v in vars(lay.saved_args).items() if k != "tokenizer_model"} == \
        {k: v for k, v in vars(ref.saved_args).items() if k != "tokenizer_model"}
    rc, said = cli("diff", kimi["k25"], kimi["text"])  # every Megatron tensor, bit for bit
    assert rc == 0 and "EQUAL" in said, said
    assert cli("flags", kimi["k25"])[1].split("\n", 1)[1] == cli("flags", kimi["text"])[1].split("\n", 1)[1]


@pytest.mark.parametrize("key", ["k25_int4", "k25_int4_text_quant"])
def test_kimi_k25_int4_reads_as_its_dequantized_language_model(kimi, key, tmp_path):
    """Its INT4 experts (quantization_config at the top level, as Moonshot's; or in text_config alone) dequantized as
    they are read: equal to the test's own dequantization, offline at EP2 and back as a DeepseekV3ForCausalLM."""
    rc, said = cli("inspect", kimi[key])
    assert rc == 0 and "int4 (packed) with per-group (8) scales" in said, said
    rc, said = cli("diff", kimi[key], kimi["deq"])
    assert rc == 0 and "EQUAL" in said, said
    legacy, back = str(tmp_path / "legacy"), str(tmp_path / "back")
    assert cli("reshard", kimi[key], legacy, "--no-progress", "--ep", "2")[0] == 0
    assert cli("reshard", legacy, back, "--no-progress", "--ckpt-format", "hf")[0] == 0
    with open(os.path.join(back, "config.json")) as fh:
        assert json.load(fh)["architectures"] == ["DeepseekV3ForCausalLM"]
    for other in (legacy, back):
        rc, said = cli("diff", kimi["deq"], other)
        assert rc == 0 and "EQUAL" in said, said


def test_a_kimi_k25_tensor_under_language_model_that_fits_nothing_is_named(kimi, tmp_path):
    import shutil

    from tests.helpers.safetensors_edit import edit_header

    path = str(tmp_path / "k")
    shutil.copytree(kimi["k25"], path)
    name = "language_model.model.layers.0.self_attn.extra.weight"

    def fn(header, body):
        header[name] = {"dtype": "F32", "shape": [2], "data_offsets": [len(body), len(body) + 8]}
        body.extend(bytes(8))

    edit_header(os.path.join(path, "model.safetensors"), fn)
    rc, said = cli("inspect", path)
    assert rc == 1 and "unmapped_tensor" in said and name in said, said

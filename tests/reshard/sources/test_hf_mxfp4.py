"""MXFP4 experts as the hub publishes GPT-OSS (``*_blocks``: two e2m1 values a byte, ``*_scales``: an e8m0 exponent per
32 values, each expert ``[out, in]``), read as the model's weights: each rank dequantizes its own experts' rows with
their scales. The oracle is the same model dequantized by ``transformers``' own ``convert_moe_packed_tensors``
(tests/helpers/hf_models.write_mxfp4) — its tensors, and ``transformers``' own logits of it."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from tests.helpers import hf_models  # noqa: E402
from tests.helpers.cli_inproc import run as run_cli  # noqa: E402
from tests.helpers.safetensors_edit import edit_header  # noqa: E402

BLOCKS = "model.layers.0.mlp.experts.gate_up_proj_blocks"
SCALES = "model.layers.0.mlp.experts.gate_up_proj_scales"


@pytest.fixture(scope="module")
def mx_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4")
    src = hf_models.write("gpt_oss", str(root / "gpt_oss"))
    return hf_models.write_mxfp4(src, str(root / "gpt_oss_mxfp4"))


def test_read_it_is_transformers_dequantized_model_tensor_for_tensor(mx_model, tmp_path):
    mx, deq = mx_model
    rc, text = run_cli("inspect", mx)
    assert rc == 0 and "4 stacked expert weights are MXFP4" in text and "dequantized to float32" in text, text
    rc, text = run_cli("diff", deq, mx)  # (the HF dirs themselves, tensor for tensor)
    assert rc == 0 and "EQUAL" in text, text
    legacy, dist, hf = str(tmp_path / "legacy"), str(tmp_path / "dist"), str(tmp_path / "hf")
    assert run_cli("reshard", mx, legacy, "--no-progress", "--ep", "2", "--tp", "2", "--etp", "1")[0] == 0
    assert run_cli("reshard", mx, dist, "--no-progress", "--ckpt-format", "torch_dist")[0] == 0
    assert run_cli("reshard", legacy, hf, "--ckpt-format", "hf", "--no-progress")[0] == 0
    for a, b in ((deq, legacy), (deq, dist), (deq, hf)):
        rc, text = run_cli("diff", a, b)
        assert rc == 0 and "EQUAL" in text, text
    with open(os.path.join(hf, "config.json")) as fh:
        assert "quantization_config" not in json.load(fh)  # (written dequantized: said in the inspect note)


def test_a_bf16_model_dequantizes_to_transformers_bf16_values(tmp_path):
    """The hub's form (bf16 beside the MXFP4 experts): each rank's rows computed in bf16, bit for bit the values
    transformers' own dequantizer gives in bf16 (code 0, a subnormal scale, included)."""
    src = hf_models.write("gpt_oss", str(tmp_path / "src"))
    mx, deq = hf_models.write_mxfp4(src, str(tmp_path / "bf16"), dtype=torch.bfloat16)
    rc, text = run_cli("inspect", mx)
    assert rc == 0 and "dequantized to bfloat16" in text, text
    rc, text = run_cli("diff", deq, mx)
    assert rc == 0 and "EQUAL" in text, text


def test_the_scale_of_code_zero_is_two_to_the_minus_127():
    from megatron_preflight.reshard.sources.hf import _pow2

    codes = torch.tensor([0, 1, 127, 254], dtype=torch.uint8)
    for dtype in (torch.bfloat16, torch.float32):
        want = torch.ldexp(torch.ones(4, dtype=torch.float64), codes.to(torch.int64) - 127).to(dtype)
        assert torch.equal(_pow2(codes, dtype), want), dtype


@pytest.mark.parametrize("layout", [dict(tp=1), dict(ep=2)])
def test_in_memory_logits_equal_transformers_on_the_dequantized_model(mcore_pool, mx_model, layout):
    pytest.importorskip("megatron.core")
    mx, deq = mx_model
    ref = hf_models.hf_logits(deq)
    out = mcore_pool.run("tests.helpers.hf_models:load_and_forward", hf_dir=mx, **layout)
    torch.testing.assert_close(out[0], ref, atol=1e-5, rtol=1e-5)


def test_a_rank_reads_only_its_experts_blocks(mx_model):
    """At EP2 each rank's byte ranges of the blocks and scales cover its two experts only."""
    from megatron_preflight.layout.hf.safetensors import tensor_table
    from megatron_preflight.reshard.resharder import open_resharder
    from megatron_preflight.reshard.target import TargetLayout

    mx, _ = mx_model
    table = tensor_table(mx).tensors
    r = open_resharder(mx, TargetLayout(ep=2))
    for rank, coords, experts in ((0, {"ep": 0}, (0, 1)), (1, {"ep": 1}, (2, 3))):
        plan = r.plan_for_coords({"tp": 0, "pp": 0, "etp": 0, **coords}, f"mp_rank_00_{rank:03d}")
        ranges = r.byte_ranges(plan)[os.path.join(mx, table[BLOCKS].file)]
        for t in (table[BLOCKS], table[SCALES]):
            per = t.nbytes // 4
            inside = [(s, n) for s, n in ranges if t.start <= s < t.end]
            assert inside, (rank, t.name)
            for s, n in inside:
                assert {(s - t.start) // per, (s + n - 1 - t.start) // per} <= set(experts), (rank, t.name, s, n)


def test_malformed_scales_are_named(mx_model, tmp_path):
    import shutil

    mx, _ = mx_model
    bad = str(tmp_path / "shape")
    shutil.copytree(mx, bad)
    edit_header(os.path.join(bad, "model.safetensors"),
                 lambda h, b: h[SCALES].update(shape=[4, 64, 2]))  # (as many bytes, another shape)
    rc, text = run_cli("inspect", bad)
    assert rc == 1 and SCALES in text and "need uint8 of shape [4, 128, 1]" in text, text
    nan = str(tmp_path / "nan")
    shutil.copytree(mx, nan)

    def fn(header, body):
        lo = header[SCALES]["data_offsets"][0]
        body[lo] = 255  # (e8m0's NaN)

    edit_header(os.path.join(nan, "model.safetensors"), fn)
    rc, text = run_cli("reshard", nan, str(tmp_path / "out"), "--no-progress")
    assert rc == 1 and SCALES in text and "experts.0.gate_proj.weight" in text and "non-finite" in text, text
    assert not os.path.exists(tmp_path / "out")

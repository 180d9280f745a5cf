"""Reading a Hugging Face DeepSeek-V3 (671B) dir at job start: its real tensor table (61 layers, MLA, 256 experts +
1 shared, 3 dense layers, the MTP layer 61; bf16 shapes), hollow (163 safetensors files, each a header and a sparse
body: no bytes on disk), then ``inspect``, ``flags``, ``check -- <the printed flags>`` and ``plan --world-size 1024``
in fresh processes (Python's bytecode cached, filled by an untimed first run): wall seconds and peak RSS, median of N. Metadata only: nothing reads a tensor byte. Then the same
dir as the hub publishes it (FP8: every decoder linear weight float8_e4m3fn beside its float32 weight_scale_inv per
128x128 block, the rest bf16; quantization_config in config.json).

Usage: python benchmarks/bench_hf_inspect.py [--work DIR] [--repeat 3]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from hf_dirs import timed as run_timed  # noqa: E402
from hf_dirs import write_shards  # noqa: E402

FILES = 163

CONFIG = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
          "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
          "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
          "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
          "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
          "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid",
          "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
          "tie_word_embeddings": False, "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16"}


def table() -> list[tuple[str, tuple[int, ...]]]:
    c = CONFIG
    h, heads = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for i in range(c["num_hidden_layers"] + c["num_nextn_predict_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                (a + "q_a_proj.weight", (c["q_lora_rank"], h)), (a + "q_a_layernorm.weight", (c["q_lora_rank"],)),
                (a + "q_b_proj.weight", (heads * qk, c["q_lora_rank"])),
                (a + "kv_a_proj_with_mqa.weight", (c["kv_lora_rank"] + c["qk_rope_head_dim"], h)),
                (a + "kv_a_layernorm.weight", (c["kv_lora_rank"],)),
                (a + "kv_b_proj.weight", (heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])),
                (a + "o_proj.weight", (h, heads * c["v_head_dim"]))]
        if i < c["first_k_dense_replace"]:
            f = c["intermediate_size"]
            out += [(p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                    (p + "mlp.down_proj.weight", (h, f))]
        else:
            f = c["moe_intermediate_size"]
            out += [(p + "mlp.gate.weight", (c["n_routed_experts"], h)),
                    (p + "mlp.gate.e_score_correction_bias", (c["n_routed_experts"],))]
            for j in range(c["n_routed_experts"]):
                e = f"{p}mlp.experts.{j}."
                out += [(e + "gate_proj.weight", (f, h)), (e + "up_proj.weight", (f, h)), (e + "down_proj.weight", (h, f))]
            s = p + "mlp.shared_experts."
            out += [(s + "gate_proj.weight", (f, h)), (s + "up_proj.weight", (f, h)), (s + "down_proj.weight", (h, f))]
        if i >= c["num_hidden_layers"]:
            out += [(p + "enorm.weight", (h,)), (p + "hnorm.weight", (h,)), (p + "eh_proj.weight", (h, 2 * h)),
                    (p + "shared_head.norm.weight", (h,)), (p + "embed_tokens.weight", (c["vocab_size"], h)),
                    (p + "shared_head.head.weight", (c["vocab_size"], h))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab_size"], h))]


def fp8_table() -> list[tuple]:
    """The hub's FP8 form of :func:`table`: each decoder linear weight F8_E4M3 with its F32 block scales."""
    out: list[tuple] = []
    for name, shape in table():
        if ".layers." in name and name.endswith("proj.weight") or ".experts." in name and name.endswith(".weight"):
            out += [(name, shape, "F8_E4M3"), (name + "_scale_inv", (-(-shape[0] // 128), -(-shape[1] // 128)), "F32")]
        else:
            out.append((name, shape))
    return out


def write(path: str, fp8: bool = False) -> tuple[int, int]:
    """The hollow dir: (tensors, bytes the files claim)."""
    tensors = fp8_table() if fp8 else table()
    per = -(-len(tensors) // FILES)
    total = write_shards(path, [tensors[k * per:(k + 1) * per] for k in range(FILES)], hollow=True)
    config = dict(CONFIG, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                               "weight_block_size": [128, 128]}) if fp8 else CONFIG
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh)
    return len(tensors), total


PYCACHE = tempfile.mkdtemp(prefix="bench_hf_inspect_pyc_")  # bytecode cached, as in an installed package
atexit.register(shutil.rmtree, PYCACHE, True)


def timed(argv: list[str]) -> tuple[float, float, int]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    wall, rss, rc, _ = run_timed([sys.executable, "-m", "megatron_preflight", *argv],
                                 env=dict(env, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONPYCACHEPREFIX=PYCACHE))
    return wall, rss, rc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work")
    ap.add_argument("--repeat", type=int, default=3)
    ns = ap.parse_args()
    work = ns.work or tempfile.mkdtemp(prefix="bench_hf_inspect_")
    for fp8 in (False, True):
        path = os.path.join(work, "dsv3_hf_fp8" if fp8 else "dsv3_hf")
        count, total = write(path, fp8)
        flags = subprocess.run([sys.executable, "-m", "megatron_preflight", "flags", path, "--json"],
                               capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT)).stdout
        run_flags = [w.strip("'") for f in json.loads(flags)["flags"] for w in f.split(" ", 1)]
        # (a layout of 1,024 GPUs the model can have: 61 layers over 16 stages as 3 + 14 x 4 + 2, ETP1)
        layout = ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
                  "--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers", "2",
                  "--expert-model-parallel-size", "64", "--expert-tensor-parallel-size", "1",
                  "--sequence-parallel", "--world-size", "1024",
                  "--tokenizer-type", "NullTokenizer", "--vocab-size", "129279", "--seq-length", "4096",
                  "--micro-batch-size", "1", "--global-batch-size", "15360", "--bf16"]
        cases = [("inspect", ["inspect", path]), ("flags", ["flags", path]),
                 ("check (TP8 PP16 EP64, 1,024 GPUs)", ["check", path, "--", *run_flags, *layout]),
                 ("plan --world-size 1024", ["plan", path, "--world-size", "1024", "--top", "3", "--device-memory",
                                             "80"])]
        print(f"DeepSeek-V3 HF dir{' in FP8 as published' if fp8 else ' (bf16)'}, hollow: {FILES} safetensors "
              f"files, {count:,} tensors, {total / 2**30:,.0f} GiB claimed; fresh process, median of {ns.repeat}")
        print(f"{'command':<38} {'wall s':>7} {'peak RSS MiB':>13} {'exit':>5}")
        for label, argv in cases:
            timed(argv)  # (untimed: fills the bytecode cache)
            runs = [timed(argv) for _ in range(ns.repeat)]
            print(f"{label:<38} {statistics.median(r[0] for r in runs):>7.2f} {max(r[1] for r in runs):>13.0f} "
                  f"{runs[0][2]:>5}")
    if not ns.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

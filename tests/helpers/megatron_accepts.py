"""Does Megatron accept a layout? Asked of megatron-core itself, in a fresh process: ``initialize_model_parallel``
builds every process group of the layout over a world of N ranks (torch's in-process "fake" backend stands in for
NCCL: the groups are real ``torch.distributed`` groups, no communication happens), then the model's
``TransformerConfig`` validates the layer split (uneven first / last stages, virtual pipeline) and the expert sizes.

Usage (what :func:`accepts` runs): ``python -m tests.helpers.megatron_accepts JSON`` with a list of cases
``{"world": N, "model": {...TransformerConfig fields...}, "layout": {tp, pp, cp, ep, etp, vpp, first, last}}``;
prints one JSON list: per case ``{"ok": bool, "error": str, "dp": int, "edp": int}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def _one(case: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig
    from torch.testing._internal.distributed.fake_pg import FakeStore

    lay, world = case["layout"], case["world"]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=lay["tp"], pipeline_model_parallel_size=lay["pp"],
            virtual_pipeline_model_parallel_size=lay.get("vpp"), context_parallel_size=lay["cp"],
            expert_model_parallel_size=lay["ep"], expert_tensor_parallel_size=lay["etp"],
            create_gloo_process_groups=False)
        out = {"dp": ps.get_data_parallel_world_size(), "edp": ps.get_expert_data_parallel_world_size()}
        model = dict(case["model"])
        experts = model.pop("num_moe_experts", None)
        TransformerConfig(
            **model, tensor_model_parallel_size=lay["tp"], pipeline_model_parallel_size=lay["pp"],
            virtual_pipeline_model_parallel_size=lay.get("vpp"), context_parallel_size=lay["cp"],
            num_layers_in_first_pipeline_stage=lay.get("first"), num_layers_in_last_pipeline_stage=lay.get("last"),
            account_for_embedding_in_pipeline_split=bool(lay.get("embedding_in_split")),
            account_for_loss_in_pipeline_split=bool(lay.get("loss_in_split")),
            num_moe_experts=experts, expert_model_parallel_size=lay["ep"] if experts else 1,
            expert_tensor_parallel_size=lay["etp"] if experts else None,
            sequence_parallel=lay["tp"] > 1 and bool(experts), pipeline_dtype=None if lay["pp"] == 1 else _fp32())
        return {"ok": True, "error": "", **out}
    except Exception as exc:  # noqa: BLE001 - the refusal is the answer
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "dp": 0, "edp": 0}
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _fp32() -> Any:
    import torch

    return torch.float32


def accepts(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Megatron's answer for each case (see the module doc), from one fresh process."""
    root = os.path.dirname(os.path.dirname(HERE))
    env = dict(os.environ, PYTHONPATH=root, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "tests.helpers.megatron_accepts", json.dumps(cases)], env=env,
                       capture_output=True, text=True, timeout=600, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    print(json.dumps([_one(c) for c in json.loads(sys.argv[1])]), flush=True)

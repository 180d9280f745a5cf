"""Megatron-LM main's 2026 checkpoint forms in REAL Megatron-LM (skipped unless MEGATRON_LM_ROOT and, for the TE
spec, MEGATRON_LM_TE_CPU — the CPU stand-in for Transformer Engine, not TE — are set)."""

from __future__ import annotations

import pytest

from tests.conftest import fixture_path
from tests.hook.test_megatron_lm import ROOT, TE_CPU, loss, run

pytestmark = [pytest.mark.skipif(not ROOT, reason="MEGATRON_LM_ROOT is not set: no real Megatron-LM checkout here"),
              pytest.mark.skipif(not TE_CPU, reason="MEGATRON_LM_TE_CPU is not set")]


def test_a_source_saved_without_redundant_extra_state_resumes_at_another_tp_like_megatrons_own_load(tmp_path):
    """--ckpt-drop-redundant-extra-state (no TE _extra_state saved): our legacy output at TP1, resumed by plain
    Megatron, trains like Megatron's own load of the source at TP1 (weights and Adam state: iterations 3 and 4)."""
    from megatron_preflight.reshard import TargetLayout, write_resharded

    out = tmp_path / "ours"
    write_resharded(fixture_path("te_dropxs_tp2_torch_dist"), str(out), TargetLayout(tp=1), verify=True)
    flags = ["--train-iters", "4", "--no-load-rng"]
    rc, log = run(tmp_path, str(out), 1, "--ckpt-format", "torch", *flags, plugin=False, te=True, verify=False,
                  port=29880)
    assert rc == 0, log[-3000:]
    rc, oracle = run(tmp_path, fixture_path("te_dropxs_tp2_torch_dist"), 1, "--ckpt-format", "torch_dist",
                     "--ckpt-drop-redundant-extra-state", *flags, plugin=False, te=True, verify=False, port=29881)
    assert rc == 0, oracle[-3000:]
    assert loss(log, 4, 4) is not None and (loss(log, 3, 4), loss(log, 4, 4)) == (loss(oracle, 3, 4),
                                                                                   loss(oracle, 4, 4))

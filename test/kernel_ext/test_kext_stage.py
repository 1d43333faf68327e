"""benchmark/gpu/stage_kernels.py in its CPU mode: the references at tiny shapes, called both as
``run(results, device, quick)`` and through check_backend.py's stage context."""

from __future__ import annotations

import sys
from pathlib import Path

GPU = Path(__file__).resolve().parents[2] / "benchmark" / "gpu"
if str(GPU) not in sys.path:
    sys.path.insert(0, str(GPU))

import stage_kernels  # noqa: E402
from common import Ctx  # noqa: E402


def test_stage_runs_the_references_on_the_cpu():
    res = stage_kernels.run({}, "cpu", True, split_pass_us=2000.0)
    assert res["checks"] and all(c["ok"] for c in res["checks"].values()), res["checks"]
    assert res["kv"]["page1"]["reference_gather_gbs"] > 0
    assert res["state_taps"]["split_pass_us"] == 2000.0
    assert 0 in res["conv_taps"]["positions"] and 256 in res["conv_taps"]["positions"]


def test_stage_through_check_backends_context(tmp_path):
    ctx = Ctx(device="cpu", quick=True, tmp=tmp_path)
    stage_kernels.run(ctx)
    assert all(c["ok"] for c in ctx.result["checks"].values())
    assert "extension" in ctx.result
    stage_kernels.dry(ctx)
    assert "gather_state_taps" in ctx.result["api"]

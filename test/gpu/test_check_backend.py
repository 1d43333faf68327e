"""Keeps the GPU check (``benchmark/gpu/check_backend.py``) runnable on machines without a GPU.

The check itself needs an H200 (``docs/gpu.md``); here its dry run (every stage's imports and
CUDA-free code paths) and its CPU smoke mode (every stage's logic on the CPU at tiny shapes,
SGLang's Triton GDN kernel replaced by a torch stand-in with its signature) run as they would
before a device run. When ``.gpu-carry/`` is built (``make gpu-carry``) both also run against
it with the H200's package set simulated; without it, against this venv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "benchmark" / "gpu" / "check_backend.py"
sys.path.insert(0, str(ROOT / "benchmark" / "gpu"))


def _run(args: list[str], out: Path, timeout: int, stdout: list[str] | None = None) -> dict:
    # As on the device: a fresh environment, not what earlier tests of this process exported
    # (installing the CPU worker sets SGLANG_MAMBA_CONV_DTYPE=float32 process-wide).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "SGLANG_HYBRID"))}
    proc = subprocess.run(
        [sys.executable, str(CHECK), *args, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    if stdout is not None:
        stdout.append(proc.stdout)
    report = json.loads(out.read_text())
    failed = report["summary"]["failed_checks"]
    errors = {k: v.get("error") for k, v in report["stages"].items() if v.get("error")}
    assert proc.returncode == 0, f"failed: {failed}; errors: {errors}\n{proc.stdout[-3000:]}"
    return report


def test_dry_run_checks_every_stage_without_cuda(tmp_path: Path) -> None:
    printed: list[str] = []
    report = _run(["--dry-run"], tmp_path / "dry.json", timeout=900, stdout=printed)
    assert report["mode"] == "dry-run"
    stages = report["stages"]
    from check_backend import BUDGET_S, STAGES, device_limits

    # One line with the device limits' sum, within the budget; each limit from the smoke time.
    lines = [ln for ln in printed[0].splitlines() if ln.startswith("stage limits: ")]
    limits = device_limits()
    assert lines == [f"stage limits: {sum(limits.values())} s of {BUDGET_S:g} s"], lines
    assert sum(limits.values()) <= BUDGET_S
    assert report["device_limits_s"] == limits and set(limits) == set(STAGES)

    for stage in STAGES:
        assert stages[f"{stage}.venv"]["status"] == "pass", stage
        if report["carry"] is not None:  # the H200's imports: CUDA faked, its packages only
            assert stages[f"{stage}.device-imports"]["status"] == "pass", stage
    imports = stages["P.venv"]["imports"]
    assert imports["sglang.kernels.ops.attention.fla.chunk"]["ok"]
    assert stages["P.venv"]["checks"]["the plugin's hooks apply to SGLang"]["ok"]


@pytest.mark.gpu_smoke
def test_cpu_smoke_runs_every_stage(tmp_path: Path) -> None:
    report = _run(["--device", "cpu", "--quick"], tmp_path / "smoke.json", timeout=2400)
    assert report["mode"] == "cpu-smoke"
    from check_backend import STAGES

    assert {k: v["status"] for k, v in report["stages"].items()} == {s: "pass" for s in STAGES}
    b = report["stages"]["B"]["configs"]
    assert all(c["tokens_checked"] > 0 and c["kv_rows_checked"] > 0 for c in b.values())


def test_stub_placeholders_work_at_import_and_refuse_calls_after() -> None:
    import gpu_env

    name = "sglang_hybrid_gpu_check_fake_kernel"
    finder = gpu_env._StubFinder([name])
    sys.meta_path.append(finder)
    try:
        mod = __import__(f"{name}.ops", fromlist=["fused"])
        fused = mod.fused
        decorated = fused(lambda x: x)  # a decorator at import time works
        assert repr(decorated).startswith("<stub")
        gpu_env.imports_done()
        with pytest.raises(gpu_env.StubCalled, match="fused"):
            fused(1)
        assert f"{name}.ops" in gpu_env.report()["stubbed"]
    finally:
        sys.meta_path.remove(finder)
        gpu_env._STATE["importing"] = True
        for key in [k for k in sys.modules if k.startswith(name)]:
            del sys.modules[key]


def test_fingerprints_are_exact_and_tell_bytes_apart() -> None:
    import torch
    from stage_scheduler import Fingerprint, _is_prefix, token_hashes

    fp = Fingerprint()
    x = torch.randn(5, 3, 4).to(torch.bfloat16)
    rows = fp.rows(x)
    assert rows == fp.rows(x.clone()) and len(set(rows)) == 5
    y = x.clone()
    y[2, 1, 3] = y[2, 1, 3].item() + 0.5
    assert fp.rows(y)[2] != rows[2] and fp.rows(y)[:2] == rows[:2]
    assert fp.whole([x, torch.zeros(3)]) != fp.whole([y, torch.zeros(3)])
    assert token_hashes([1, 2, 3])[:3] == token_hashes([1, 2, 4])[:3]
    assert _is_prefix((64, 128), (64, 128, 130)) and not _is_prefix((64, 129), (64, 128, 130))

"""In-pass taps with SGLang's own Triton GDN prefill, on the CPU under ``TRITON_INTERPRET=1``.

The GPU check's stage I (``benchmark/gpu/stage_inpass.py``) runs here with SGLang's FLA
``chunk_gated_delta_rule`` interpreted (``cpu/triton_interpret.py``'s shims): three requests of
different lengths packed in one extend (``cu_seqlens``), bf16 inputs as on a GPU, the cache's
track fields through SGLang's own track plan, conv indices and state copy, ``gdn_taps`` for the
request's other taps (the off-grid one recomputed with the same kernel), each captured state
against the state of a pass of the same kernel ending at the tap. What the interpreter cannot
say (speed, a GPU's accumulation order, streams, CUDA graphs) stays with stage I on a GPU.

The interpreter must be on before Triton's first import, so the check runs in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys, tempfile
from pathlib import Path
from sglang_hybrid.cpu.triton_interpret import enable_interpreter, interpreted
enable_interpreter()
sys.path.insert(0, sys.argv[1])
import common, stage_inpass
with interpreted():
    from sglang.kernels.ops.attention.fla.chunk import chunk_gated_delta_rule
    stage_inpass._pin_chunk_size()
    ctx = common.Ctx(device="cpu", quick=True, tmp=Path(tempfile.mkdtemp()))
    kernel = stage_inpass.FlaKernel(chunk_gated_delta_rule)
    out = stage_inpass.one_kernel(
        ctx, "triton", kernel, packed=True, dims=(1, 2, 16), bf16=sys.argv[2] == "bf16"
    )
print("RESULT " + json.dumps({"checks": ctx.result["checks"], "out": out}))
"""


def _run(dtype: str) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ROOT / "benchmark" / "gpu"), dtype],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_sglangs_triton_prefill_captures_every_tap_of_a_packed_pass() -> None:
    res = _run("bf16")
    (check,) = res["checks"].values()
    assert check["ok"], check
    assert check["taps"] == 7
    # h is in the inputs' dtype (bf16; SGLang's kernel refuses float32): the tracked states
    # are the bf16 rounding of the exact ones, not the exact ones (hence auto never picks them).
    assert 0 < res["out"]["worst_rel"] <= 1e-2
    assert not res["out"]["bitwise"]

"""A launch the cache cannot serve is refused as the arguments are parsed (issue #38): SGLang's
real ``python -m sglang.launch_server``, one line naming the flag and the fix, exit status 2, no
traceback, before any hook is applied or any model is loaded.

Timing is noisy on a shared machine, so the test measures two things: how long a refusal takes
against how long SGLang's own import takes in the same run (it cannot be faster than that, and
was about twice it plus the model's start before), and, exactly, what the refusing process never
imported: the scheduler, the HTTP server and the cache (``-X importtime``), which the hooks and
the model load import.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sglang_hybrid.cpu.server import ServerConfig

NEVER_IMPORTED = (
    "sglang.srt.managers.scheduler",
    "sglang.srt.entrypoints.http_server",
    "sglang_hybrid.sglang.cache",
)
CASES = [
    (["--enable-hierarchical-cache"], "--enable-hierarchical-cache: SGLang's HiCache"),
    (["--disable-radix-cache"], "--disable-radix-cache turns off the prefix cache"),
    (["--hybrid-host-cache-mb", "64"], "did you mean --hybrid-host-cache-mib?"),
    (["--hybrid-taps-per-request", "-3"], "--hybrid-taps-per-request must be non-negative"),
]


def _run(argv: list[str]) -> tuple[int, str, float]:
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-X", "importtime", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    return p.returncode, p.stderr, time.monotonic() - t0


@pytest.fixture(scope="module")
def import_seconds() -> float:
    """SGLang's own import, the floor of any refusal made after ``python -m sglang...`` starts."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import sglang.srt.server_args"], check=True)
    return time.monotonic() - t0


def _argv(model: Path, *extra: str, cpu_worker: bool = True) -> list[str]:
    cfg = ServerConfig(model, extra=list(extra))
    argv = cfg.argv()[1:]  # without the interpreter: -m sglang.launch_server ...
    if not cpu_worker:
        i = argv.index("--hybrid-cpu-worker")
        del argv[i : i + 2]
    return argv


@pytest.mark.parametrize(("extra", "message"), CASES, ids=[c[0][0] for c in CASES])
def test_a_refusal_is_one_line_in_seconds(
    tiny_models: dict[str, Path], import_seconds: float, extra: list[str], message: str
) -> None:
    rc, err, seconds = _run(_argv(tiny_models["qwen3_next"], *extra))
    lines = [ln for ln in err.splitlines() if not ln.startswith("import time:")]
    print(f"refused in {seconds:.1f} s (SGLang's import alone: {import_seconds:.1f} s)")
    assert rc == 2, err[-3000:]
    assert lines and message in lines[-1] and lines[-1].startswith("sglang serve: error:"), lines
    assert "Traceback" not in err, err[-3000:]
    imported = {ln.rsplit("|", 1)[-1].strip() for ln in err.splitlines() if "import time:" in ln}
    assert not imported & set(NEVER_IMPORTED), imported & set(NEVER_IMPORTED)
    assert seconds < 2 * import_seconds + 10, (seconds, import_seconds)


def test_a_cpu_launch_without_the_worker_names_it(
    tiny_models: dict[str, Path], import_seconds: float
) -> None:
    rc, err, seconds = _run(_argv(tiny_models["qwen3_next"], cpu_worker=False))
    last = [ln for ln in err.splitlines() if not ln.startswith("import time:")][-1]
    assert rc == 2 and "--device cpu" in last and "add --hybrid-cpu-worker model" in last, last
    assert "NVIDIA" not in err and seconds < 2 * import_seconds + 10

"""Shared pieces of the GPU check's stages: the run context, checks, timing, JSON-safe values."""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Ctx:
    """How a stage runs: ``device`` "cuda" (the check) or "cpu" (the smoke mode), ``quick``
    (tiny shapes and fewer cases), a scratch folder, and the stage's result being built."""

    device: str
    quick: bool
    tmp: Path
    carry: Path | None = None
    result: dict[str, Any] = field(default_factory=dict)
    t0: float = field(default_factory=time.perf_counter)
    on_flush: Callable[[dict[str, Any]], None] | None = None

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def check(self, name: str, ok: bool, **detail: Any) -> bool:
        """Record a named check (pass/fail plus what was measured) in the stage result."""
        self.result.setdefault("checks", {})[name] = {"ok": bool(ok), **jsonable(detail)}
        mark = "ok  " if ok else "FAIL"
        extra = ", ".join(f"{k}={_short(v)}" for k, v in detail.items())
        log(f"  [{mark}] {name}" + (f" ({extra})" if extra else ""))
        return bool(ok)

    def note(self, key: str, value: Any) -> None:
        self.result[key] = jsonable(value)

    def flush(self) -> None:
        """Write the result so far (a stage stopped at its time limit keeps what it finished)."""
        if self.on_flush is not None:
            self.on_flush(self.result)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def log(msg: str) -> None:
    print(msg, flush=True)


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    s = str(v)
    return s if len(s) <= 80 else s[:77] + "..."


def jsonable(v: Any) -> Any:
    """Plain JSON values: tensors and numpy scalars become numbers or lists, NaN becomes None."""
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set)):
        return [jsonable(x) for x in v]
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, (str, int, bool)) or v is None:
        return v
    if hasattr(v, "tolist"):
        return jsonable(v.tolist())
    if hasattr(v, "item"):
        return jsonable(v.item())
    return str(v)


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def timed_ms(
    fn: Callable[[], Any], device: str, repeat: int = 5, warmup: int = 1, events: bool = False
) -> float:
    """Median time of ``fn`` in ms: wall time with the device synchronized around each call, or
    (``events``, on CUDA) CUDA events around it, for kernels of microseconds."""
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    for _ in range(repeat):
        if events and device == "cuda":
            import torch

            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
            continue
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def add_paths() -> None:
    """This repository's package and the test helpers the stages reuse."""
    for p in (ROOT / "test" / "exactness", ROOT / "test" / "sglang", ROOT / "python"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))


def tiny_model(tmp: Path, arch: str = "qwen3_next") -> Path:
    """The tiny hybrid model directory (written locally, nothing downloaded)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sglang_hybrid.cpu.tiny_model import write_tiny_model

    return write_tiny_model(tmp / f"tiny-{arch}", arch, seed=0)

"""The ``build`` wrapper that runs a suite's schedulers under the CPU stream model (issue #35):
hybrid-cache schedulers only (SGLang's own caches are not ours to check), each with a fresh
``StreamModel`` whose budgets fail on a host sync."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang_hybrid.cpu.stream_model import StreamModel


def under_the_model(build: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(backend: str = "hybrid", **kw: Any) -> Any:
        if backend == "hybrid":
            kw["stream_model"] = StreamModel()
        return build(backend, **kw)

    return wrapped

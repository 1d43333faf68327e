"""The error the CPU workers raise for a ``TpModelWorker`` feature they do not provide."""

from __future__ import annotations

from typing import NoReturn


class CpuWorkerUnsupported(NotImplementedError, AttributeError):
    """A TpModelWorker feature the CPU worker does not provide.

    It is an ``AttributeError`` too, so ``hasattr`` / ``getattr(obj, name, default)`` probes by
    SGLang keep answering "absent" instead of failing.
    """


def unsupported(feature: str) -> NoReturn:
    raise CpuWorkerUnsupported(f"the sglang_hybrid CPU worker does not support {feature}")

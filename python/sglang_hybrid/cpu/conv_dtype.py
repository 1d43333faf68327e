"""SGLang's mamba conv-state dtype (``SGLANG_MAMBA_CONV_DTYPE``), as the model worker needs it.

``install_cpu_worker("model")`` and ``ModelWorker`` both call these before the Scheduler builds
its pools; it sits apart from both so neither imports the other for it.
"""

from __future__ import annotations

import os

CONV_DTYPE_ENV = "SGLANG_MAMBA_CONV_DTYPE"


def require_float32_conv_state() -> None:
    """Make SGLang's mamba conv-state dtype float32, or refuse a different explicit setting.

    SGLang reads the variable each time it sizes a mamba pool, so this must run before the
    Scheduler builds its pools (``install_cpu_worker("model")`` and ``ModelWorker`` both call it).
    """
    require_conv_state_dtype("float32")


def require_conv_state_dtype(dtype: str) -> None:
    """Make SGLang's mamba conv-state dtype ``dtype`` (the model worker's compute dtype), or
    refuse a different explicit setting (see ``require_float32_conv_state``)."""
    value = os.environ.get(CONV_DTYPE_ENV)
    if value is None:
        os.environ[CONV_DTYPE_ENV] = dtype
    elif value != dtype:
        if dtype == "float32":
            raise RuntimeError(
                f"{CONV_DTYPE_ENV}={value!r}: the CPU model worker needs float32 conv states "
                "(a bf16 conv state shifts logits by ~1e-4 and breaks cached-vs-uncached "
                "exactness)"
            )
        raise RuntimeError(
            f"{CONV_DTYPE_ENV}={value!r}: the model worker computes in {dtype} and needs "
            f"{dtype} conv states"
        )

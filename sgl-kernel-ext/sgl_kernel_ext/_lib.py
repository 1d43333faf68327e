"""Loading the CUDA library (``_kernels*.so``) with ctypes; its absence is a state, not an error.

The library links only the CUDA runtime (``libcudart.so.13``), which importing torch has already
loaded, so it loads on a machine without a GPU too (its kernels then cannot run). Where it is
looked for: ``$SGL_KERNEL_EXT_LIB`` (a path to the ``.so``), else next to this file.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path
from typing import Any

import torch  # noqa: F401  (loads libcudart.so.<major> into the process first)

ABI_VERSION = 1
HERE = Path(__file__).resolve().parent
STATUS_FILE = HERE / "_build_status.json"

_i = ctypes.c_int
_i64 = ctypes.c_int64
_p = ctypes.c_void_p
_pi64 = ctypes.POINTER(ctypes.c_int64)

_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "sgl_kext_abi_version": (_i, []),
    "sgl_kext_max_layers": (_i, []),
    "sgl_kext_max_buffers": (_i, []),
    "sgl_kext_error_string": (ctypes.c_char_p, [_i]),
    "sgl_kext_kv_copy": (
        _i,
        [_i, _i, _pi64, _pi64, _pi64, _pi64, _p, _i64, _i, _i64, _i64, _i, _i, _p],
    ),
    "sgl_kext_state_taps": (_i, [_i, _pi64, _pi64, _i, _i, _p, _i64, _i64, _i, _i, _p]),
    "sgl_kext_conv_taps": (
        _i,
        [_i, _pi64, _pi64, _pi64, _p, _i64, _i64, _i64, _pi64, _i, _i, _i, _i, _p],
    ),
}


class _State:
    lib: ctypes.CDLL | None = None
    path: str | None = None
    reason: str | None = None
    max_layers: int = 64
    max_buffers: int = 64


STATE = _State()


def candidates() -> list[Path]:
    env = os.environ.get("SGL_KERNEL_EXT_LIB")
    if env:
        return [Path(env)]
    return sorted(HERE.glob("_kernels*.so"))


def load() -> None:
    found = candidates()
    if not found:
        STATE.reason = "the CUDA library was not built (" + build_reason() + ")"
        return
    path = found[0]
    try:
        lib = ctypes.CDLL(str(path))
        for name, (res, args) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype = res
            fn.argtypes = args
        version = lib.sgl_kext_abi_version()
    except (OSError, AttributeError) as e:
        STATE.reason = f"{path.name} did not load: {e}"
        return
    if version != ABI_VERSION:
        STATE.reason = f"{path.name} has ABI {version}, this package needs {ABI_VERSION}: rebuild"
        return
    STATE.lib, STATE.path = lib, str(path)
    STATE.max_layers = lib.sgl_kext_max_layers()
    STATE.max_buffers = lib.sgl_kext_max_buffers()


def build_status() -> dict[str, Any] | None:
    """What the last ``build.py`` run recorded (None if it never ran here)."""
    try:
        return json.loads(STATUS_FILE.read_text())
    except (OSError, ValueError):
        return None


def build_reason() -> str:
    st = build_status()
    if st is None:
        return "no build recorded: run `make kernel-ext`"
    return st.get("reason") or ("built" if st.get("built") else "skipped")


def int64_array(values: list[int]) -> ctypes.Array[ctypes.c_int64]:
    return (ctypes.c_int64 * max(1, len(values)))(*values)


def check(rc: int, what: str) -> None:
    if rc != 0:
        assert STATE.lib is not None
        msg = STATE.lib.sgl_kext_error_string(rc).decode()
        raise RuntimeError(f"sgl_kernel_ext.{what}: launch failed: {msg} (code {rc})")


load()

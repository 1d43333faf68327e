"""SGLang 0.5.23's own Triton kernels on CPU tensors, under Triton's interpreter.

``TRITON_INTERPRET=1`` makes ``@triton.jit`` build an ``InterpretedFunction`` that runs a
kernel's body with numpy, program by program, on CPU tensors. SGLang's FLA kernels
(``sglang.kernels.ops.attention.fla``: ``chunk_gated_delta_rule``, the kernel SGLang's GDN
backend runs for extend, and the ``h`` that ``sglang/gdn_taps.py`` gathers from) then need four
shims to run there; nothing in their arithmetic is replaced:

1. ``device_ctx``: fla's ``input_guard`` enters ``utils.custom_device_ctx(index)``, which is
   ``torch.<backend>.device(index)``. Without a GPU driver fla resolves its backend to ``"cpu"``
   and ``torch.cpu`` has no ``device`` context manager: AttributeError. Shim: a null context (a
   CPU tensor has no device to select).
2. ``autotune``: ``triton.autotune`` with several configs times each one with the driver's
   benchmarker; the interpreter has no driver ("0 active drivers"). Shim: the autotuner keeps
   only the first config that survives its own pruning (the path it already takes for a single
   config), so the kernel runs once, with no timing and no restore of in-place outputs.
3. ``tl_aliases``: fla's ``op.py`` binds ``exp = tl.exp`` (and ``exp2``, ``log``, ``log2``) at
   import, and kernel modules import those names. The interpreter swaps ``triton.language``'s
   builtins for numpy-backed ones only while a kernel runs (``interpreter._patch_lang``); an alias
   taken at import still holds the compiler's builtin, which refuses a call without
   ``_semantic`` ("Did you forget to add @triton.jit ?"). Shim: every module global of the kernel
   packages that is a ``triton.language`` / ``triton.language.math`` builtin is rebound to a
   function that looks the builtin up on ``triton.language`` when called.
4. ``bf16_math``: Triton 3.8's interpreter stores bfloat16 as raw ``uint16`` bits (numpy has no
   bf16) and its ``create_dot`` converts only fp8 operands, so ``tl.dot`` of two bf16 blocks
   multiplies bit patterns (values ~1e9 out of a unit-scale GDN: this, with shim 3's error, is
   why docs/gpu.md once recorded that the interpreter "did not compute the kernel correctly").
   Elementwise bf16 ops (``binary_op``, ``unary_op``, ``create_fma``) share the fault. Shim:
   those builder methods widen bf16 operands to float32 exactly (a shift of the bits), compute,
   and round a float result back to bf16 (round to nearest even) when the op's type is bf16;
   ``tl.dot`` accumulates in its float32 accumulator as a GPU's tensor cores do.

``enable_interpreter()`` must run before Triton's first import in the process (``triton.jit``
decides compiled vs interpreted when a decorator runs, and ``triton.language``'s own jit helpers
are decorated at its import); it refuses afterwards, so the tests run in a subprocess.
``interpreted()`` applies the shims for a block and undoes them on exit; modules imported inside
the block are covered (the FLA package is imported on entry), kernel modules first imported after
entry keep their aliases until the next entry. Nothing happens at import of this module.

What this checks: the kernels' indexing, masking, chunking, ``cu_seqlens`` handling and outputs
(``o``, ``h``, in-place final states) at the shapes a test picks. What it cannot: speed, shared
memory and register limits, the config a GPU's autotuner would pick (a different block size runs
the same math in another order: equal up to rounding), the order of a GPU's fp32 accumulation, and
anything about streams or CUDA graphs. About 1 s for T = 128, H = 2, K = V = 16 on one CPU core.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

INTERPRET_ENV = "TRITON_INTERPRET"
# The SGLang packages whose Triton kernels lie on our path (GDN prefill/decode, Mamba conv and
# state update, the GDN gating); the alias shim walks their loaded modules.
KERNEL_PACKAGES = (
    "sglang.kernels.ops.attention.fla",
    "sglang.kernels.ops.attention.linear",
    "sglang.kernels.ops.mamba",
)
_FLA_UTILS = "sglang.kernels.ops.attention.fla.utils"


@dataclass(frozen=True, slots=True)
class Shim:
    """One change ``interpreted()`` makes, and why the interpreter needs it."""

    name: str
    reason: str


SHIMS = (
    Shim("device_ctx", "fla's custom_device_ctx is torch.cpu.device(...), which does not exist"),
    Shim("autotune", "no driver to time configs on: the autotuner takes its first config"),
    Shim("tl_aliases", "import-time aliases of tl builtins miss the interpreter's run-time patch"),
    Shim("bf16_math", "the interpreter keeps bf16 as uint16 bits and computes on the bits"),
)


def interpreter_on() -> bool:
    """Whether Triton builds interpreted kernels in this process (reads the env var, so it
    imports nothing; Triton reads it at each decoration)."""
    return os.environ.get(INTERPRET_ENV, "").strip().lower() in ("1", "true", "on", "yes")


def enable_interpreter() -> None:
    """Turn Triton's interpreter on for this process, before Triton is first imported.

    ``triton.jit`` picks compiled or interpreted when a decorator runs, and Triton's own
    ``triton.language`` helpers (``tl.cumsum``, ...) are decorated when ``triton`` is imported,
    which importing SGLang (``sglang.srt.server_args``) already does. So this raises RuntimeError
    when Triton was imported with the interpreter off: run the work in a fresh process (a
    subprocess with ``TRITON_INTERPRET=1`` in its environment, or this call before any import of
    triton or SGLang)."""
    if "triton" in sys.modules and not interpreter_on():
        raise RuntimeError(
            "Triton's interpreter must be on before triton is imported (importing SGLang "
            "imports it): set TRITON_INTERPRET=1 in a fresh process"
        )
    os.environ[INTERPRET_ENV] = "1"


def is_interpreted(kernel: Any) -> bool:
    """Whether a (possibly autotuned / heuristics-wrapped) Triton kernel runs interpreted."""
    from triton.runtime.interpreter import InterpretedFunction

    fn = kernel
    while not isinstance(fn, InterpretedFunction) and hasattr(fn, "fn"):
        fn = fn.fn
    return isinstance(fn, InterpretedFunction)


@contextlib.contextmanager
def interpreted() -> Iterator[None]:
    """Within the block, SGLang's Triton kernels run on CPU tensors (the module docstring's three
    shims); everything is restored on exit. Imports the FLA package (so its aliases exist to
    rebind); needs ``enable_interpreter()`` (or ``TRITON_INTERPRET=1``) first."""
    if not interpreter_on():
        raise RuntimeError(f"{INTERPRET_ENV}=1 or enable_interpreter() must come first")
    import importlib

    importlib.import_module("sglang.kernels.ops.attention.fla.chunk")
    undo: list[Callable[[], None]] = []
    try:
        undo.append(_shim_device_ctx())
        undo.append(_shim_autotune())
        undo.append(_shim_tl_aliases())
        undo.append(_shim_bf16_math())
        yield
    finally:
        for restore in reversed(undo):
            restore()


def _loaded_kernel_modules() -> list[str]:
    return [
        name
        for name in list(sys.modules)
        if any(name == p or name.startswith(p + ".") for p in KERNEL_PACKAGES)
    ]


def _setattr_undo(owner: Any, name: str, value: Any) -> Callable[[], None]:
    old = getattr(owner, name)
    setattr(owner, name, value)
    return lambda: setattr(owner, name, old)


def _shim_device_ctx() -> Callable[[], None]:
    utils = sys.modules[_FLA_UTILS]
    # input_guard looks the name up in utils' globals at call time, so rebinding it suffices.
    return _setattr_undo(utils, "custom_device_ctx", lambda _index: contextlib.nullcontext())


def _shim_autotune() -> Callable[[], None]:
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs

    def first_config(self: Any, kwargs: dict[str, Any]) -> list[Any]:
        return list(prune(self, kwargs))[:1]

    return _setattr_undo(Autotuner, "prune_configs", first_config)


def _shim_tl_aliases() -> Callable[[], None]:
    import triton.language as tl

    owners = (tl, tl.math)
    undo: list[Callable[[], None]] = []
    for mod_name in _loaded_kernel_modules():
        module = sys.modules.get(mod_name)
        if module is None:
            continue
        for name, value in list(vars(module).items()):
            if not tl.core.is_builtin(value):
                continue
            where = _builtin_home(value, owners)
            if where is not None:
                undo.append(_setattr_undo(module, name, _late_bound(*where)))

    def restore() -> None:
        for step in reversed(undo):
            step()

    return restore


def _builtin_home(value: Any, owners: tuple[Any, ...]) -> tuple[Any, str] | None:
    """The (module, attribute) of ``triton.language`` that holds this builtin, if any."""
    for owner in owners:
        for attr, member in vars(owner).items():
            if member is value:
                return owner, attr
    return None


def _late_bound(owner: Any, attr: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(owner, attr)(*args, **kwargs)

    call.__name__ = attr
    return call


def _shim_bf16_math() -> Callable[[], None]:
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    bf16 = tl.bfloat16

    def widen(h: Any) -> Any:
        if h.dtype.scalar != bf16:
            return h.data
        return (h.data.astype(np.uint32) << 16).view(np.float32)

    def narrow(data: Any) -> Any:
        # float32 -> bf16 bits, round to nearest even (NaN kept quiet).
        bits = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return np.where(np.isnan(data), 0x7FC0, rounded).astype(np.uint16)

    def settle(out: Any, dtype: Any) -> Any:
        return narrow(out) if dtype == bf16 and out.dtype.kind == "f" else out

    binary_op = InterpreterBuilder.binary_op
    unary_op = InterpreterBuilder.unary_op
    fma = InterpreterBuilder.create_fma
    dot = InterpreterBuilder.create_dot

    def binary(self: Any, lhs: Any, rhs: Any, op: Any) -> Any:
        if bf16 not in (lhs.dtype.scalar, rhs.dtype.scalar):
            return binary_op(self, lhs, rhs, op)
        out = op(widen(lhs), widen(rhs))
        return TensorHandle(settle(out, lhs.dtype.scalar), lhs.dtype.scalar)

    def unary(self: Any, arg: Any, op: Any) -> Any:
        if arg.dtype.scalar != bf16:
            return unary_op(self, arg, op)
        return TensorHandle(settle(op(widen(arg)), bf16), bf16)

    def fused(self: Any, x: Any, y: Any, z: Any) -> Any:
        if bf16 not in (x.dtype.scalar, y.dtype.scalar, z.dtype.scalar):
            return fma(self, x, y, z)
        out = widen(x) * widen(y) + widen(z)
        return TensorHandle(settle(out, z.dtype.scalar), z.dtype.scalar)

    def dot_f32(self: Any, a: Any, b: Any, d: Any, *rest: Any) -> Any:
        if bf16 in (a.dtype.scalar, b.dtype.scalar):
            a = TensorHandle(widen(a), tl.float32)
            b = TensorHandle(widen(b), tl.float32)
        if d.dtype.scalar == bf16:
            acc = TensorHandle(widen(d), tl.float32)
            out = dot(self, a, b, acc, *rest)
            return TensorHandle(narrow(out.data), bf16)
        return dot(self, a, b, d, *rest)

    undo = [
        _setattr_undo(InterpreterBuilder, "binary_op", binary),
        _setattr_undo(InterpreterBuilder, "unary_op", unary),
        _setattr_undo(InterpreterBuilder, "create_fma", fused),
        _setattr_undo(InterpreterBuilder, "create_dot", dot_f32),
    ]

    def restore() -> None:
        for step in reversed(undo):
            step()

    return restore

"""Install a CPU worker in place of SGLang's ``TpModelWorker``, and the ServerArgs it needs.

Contract:
- ``install_cpu_worker(kind)`` registers, through SGLang's ``HookRegistry``, a class REPLACE of
  ``sglang.srt.managers.tp_worker.TpModelWorker`` by ``CpuTpWorker`` and applies the hooks, then
  selects which subclass a ``TpModelWorker(...)`` call builds: ``"model"`` (``ModelWorker``, a
  tiny transformers model, exact) or ``"tokens"`` (``TokenWorker``, no model, work counts).
  The REPLACE is registered once per process (HookRegistry applies a target once); later calls
  only change the selection, so in-process tests can switch kinds between Scheduler builds.
  Nothing is installed at import time. Calling it after another REPLACE of ``TpModelWorker``
  was applied raises ``RuntimeError``.
- ``install_cpu_worker("model")`` also makes SGLang build the mamba conv state in float32
  (``SGLANG_MAMBA_CONV_DTYPE``, bf16 by default; ``conv_dtype.py``): it sets the variable when
  unset and refuses a different explicit value, because a bf16 conv state makes cached and
  uncached runs differ.
  The CUDA build of the model worker computes in the model dtype (bf16 as served) and passes
  ``conv_dtype="bfloat16"``: the conv state then matches the model dtype instead.
- ``cpu_server_args(**overrides)`` returns the ServerArgs keyword arguments the CPU workers need
  (device, float32, torch-native attention, pytorch sampling, no overlap / CUDA graphs, no
  tokenizer in the scheduler, dummy weight loading, explicit pool sizes, a fixed seed), with
  ``overrides`` applied last. A server takes the CPU launch line of ``docs/server.md`` ("The CPU
  launch line", built by ``cpu.server.ServerConfig``), where overlap scheduling stays on.
"""

from __future__ import annotations

from typing import Any, Literal

from .conv_dtype import require_conv_state_dtype

WorkerKind = Literal["model", "tokens"]

TP_WORKER_TARGET = "sglang.srt.managers.tp_worker.TpModelWorker"


def install_cpu_worker(kind: WorkerKind, *, conv_dtype: str = "float32") -> None:
    """Replace ``TpModelWorker`` by the CPU worker of ``kind`` (see the module contract).

    ``conv_dtype`` is the conv-state dtype the model worker needs: float32 on the CPU (the
    default), the model dtype in the CUDA build (``"bfloat16"``).
    """
    import sglang.srt.managers.tp_worker as tp_worker
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_hybrid.cpu.worker import CpuTpWorker

    if kind == "model":
        from sglang_hybrid.cpu.model_worker import ModelWorker

        require_conv_state_dtype(conv_dtype)
        selected: type[CpuTpWorker] = ModelWorker
    elif kind == "tokens":
        from sglang_hybrid.cpu.token_worker import TokenWorker

        selected = TokenWorker
    else:
        raise ValueError(f"unknown CPU worker kind {kind!r}; expected 'model' or 'tokens'")

    from sglang_hybrid.cpu.spec_register import register_algorithm

    register_algorithm()  # --speculative-algorithm CPU_MTP, idempotent
    HookRegistry.apply_hooks()
    if tp_worker.TpModelWorker is not CpuTpWorker:
        HookRegistry.register(TP_WORKER_TARGET, CpuTpWorker, HookType.REPLACE)
        HookRegistry.apply_hooks()
        if tp_worker.TpModelWorker is not CpuTpWorker:
            raise RuntimeError(
                f"{TP_WORKER_TARGET} was already replaced by "
                f"{tp_worker.TpModelWorker!r}; the CPU worker cannot be installed"
            )
    CpuTpWorker.select(selected)


def cpu_server_args(**overrides: Any) -> dict[str, Any]:
    """ServerArgs keyword arguments for the CPU workers, ``overrides`` applied last."""
    args: dict[str, Any] = {
        "device": "cpu",
        # config.json says float32, but "auto" serves float32 checkpoints in float16.
        "dtype": "float32",
        "attention_backend": "torch_native",
        "sampling_backend": "pytorch",
        "disable_overlap_schedule": True,
        "disable_cuda_graph": True,
        "skip_tokenizer_init": True,
        # The CPU workers load (or ignore) weights themselves; SGLang must not try to.
        "load_format": "dummy",
        "random_seed": 0,
        # SGLang's built-in hybrid cache; no_buffer is its only strategy on non-GPU platforms
        # and it needs page size 1.
        "mamba_radix_cache_strategy": "no_buffer",
        "page_size": 1,
        "chunked_prefill_size": 64,
        "max_prefill_tokens": 1024,
        # No memory profiling on the CPU: every pool is sized here.
        "max_total_tokens": 4096,
        "max_running_requests": 8,
        "max_mamba_cache_size": 32,
    }
    args.update(overrides)
    return args

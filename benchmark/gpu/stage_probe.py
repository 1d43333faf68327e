"""Stage P: what imports on this machine, what was stubbed, what the device is.

Imports every module the other stages import, one at a time and timed, and records failures
instead of stopping; then (on CUDA) compiles and runs a trivial Triton kernel, so a broken
Triton or driver shows here before the stages that need them.
"""

from __future__ import annotations

import importlib
import time
from typing import Any

from common import Ctx, add_paths, log

# In the order the stages need them; SGLang first (its import is the slow one).
IMPORTS = (
    "sglang",
    "sglang.srt.server_args",
    "sglang.srt.configs.mamba_utils",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.allocator",
    "sglang.srt.mem_cache.allocation",
    "sglang.srt.mem_cache.common",
    "sglang.srt.mem_cache.unified_radix_cache",
    "sglang.srt.managers.schedule_batch",
    "sglang.srt.managers.scheduler",
    "sglang.srt.plugins.hook_registry",
    # What the plugin hooks (every target must resolve, or --radix-cache hybrid refuses to start).
    "sglang.srt.managers.schedule_policy",
    "sglang.srt.managers.io_struct",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.scheduler_components.output_streamer",
    "sglang.srt.arg_groups.mamba_hook",
    "sglang.srt.entrypoints.openai.serving_chat",
    "sglang.kernels.ops.attention.fla.chunk",
    "sglang.kernels.ops.attention.fla.chunk_delta_h",
    "sglang.kernels.ops.attention.fla.chunk_fwd",
    "sglang.kernels.ops.attention.fla.cumsum",
    "sglang.kernels.ops.attention.fla.l2norm",
    "transformers.models.qwen3_next.modeling_qwen3_next",
    "sglang_hybrid.sglang.plugin",
    "sglang_hybrid.sglang.cache",
    "sglang_hybrid.sglang.host_tier",
    "sglang_hybrid.store.transfer",
    "sglang_hybrid.store.cuda_copy",
    "sglang_hybrid.cpu.install",
    "sglang_hybrid.cpu.loop",
    "sglang_hybrid.cpu.model_worker",
    "sglang_hybrid.cpu.gdn_kernels",
    "sglang_hybrid.cpu.tiny_model",
    "direct",
    "checking_worker",
    "programs",
    "torch_gdn",
    "stage_pools",
    "stage_shapes",
    "stage_scheduler",
    "stage_chunk",
)


def probe_imports(ctx: Ctx) -> dict[str, Any]:
    add_paths()
    import gpu_env

    rows: dict[str, Any] = {}
    with gpu_env.importing():
        for name in IMPORTS:
            t0 = time.perf_counter()
            try:
                mod = importlib.import_module(name)
                rows[name] = {"ok": True, "s": round(time.perf_counter() - t0, 3)}
                if name == "sglang":
                    rows[name]["version"] = getattr(mod, "__version__", None)
                    rows[name]["file"] = getattr(mod, "__file__", None)
            except BaseException as e:  # every failure is the finding
                rows[name] = {"ok": False, "error": repr(e)[:500]}
                log(f"  import {name} failed: {e!r}")
    failed = [k for k, v in rows.items() if not v["ok"]]
    ctx.note("imports", rows)
    try:  # the backend registers its hooks with SGLang; each target must resolve here
        from sglang.srt.plugins.hook_registry import HookRegistry

        from sglang_hybrid.sglang import plugin

        with gpu_env.importing():
            plugin.register()
            HookRegistry.apply_hooks()
        hooks_error = None
    except Exception as e:
        hooks_error = repr(e)[:800]
    ctx.check("the plugin's hooks apply to SGLang", hooks_error is None, error=hooks_error)
    ctx.check(
        "every module the stages use imports",
        not failed,
        failed=failed,
        seconds=round(sum(v.get("s", 0) for v in rows.values()), 1),
    )
    return rows


def run(ctx: Ctx) -> None:
    import torch

    probe_imports(ctx)
    import gpu_env

    stubs = gpu_env.report()["stubbed"]
    ctx.note("stubbed_modules", stubs)
    log(f"  stubbed: {', '.join(sorted(stubs)) or 'nothing'}")
    from sglang_hybrid.cpu import gdn_kernels

    fn, note = gdn_kernels.sglang_chunk_kernel()
    ctx.note("gdn_kernel", note)
    if ctx.cuda:
        ctx.check("SGLang's Triton GDN kernel imports on CUDA", fn is not None, source=note)
        ctx.check(
            "a trivial Triton kernel compiles and runs", _triton_smoke(), torch=torch.__version__
        )
        free, _ = torch.cuda.mem_get_info()
        ctx.note("gpu_memory_free_gib", free / 2**30)


def _triton_smoke() -> bool:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)

    x = torch.zeros(1000, device="cuda")
    add_one[(triton.cdiv(1000, 256),)](x, 1000, BLOCK=256)
    torch.cuda.synchronize()
    return bool((x == 1).all())


def dry(ctx: Ctx) -> None:
    probe_imports(ctx)
    import gpu_env

    ctx.note("stubbed_modules", gpu_env.report()["stubbed"])

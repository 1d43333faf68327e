"""Stage H: the host tier off the scheduler thread (issue #13), on CUDA pools.

SGLang's real Scheduler (token worker) with ``--radix-cache hybrid`` and a host tier, run with
``--hybrid-host-copy inline`` and ``async`` on the same pools (``benchmark/sglang/
bench_host_copies.py``): a 32k-token conversation written through at release, pushed off the
device and restored for its next turn while another request decodes. Checks: the next turn
resumes at the same position both ways; issuing the 32k-token write-through takes under 1 ms of
scheduler time (the issue's target); the decode stall with async copies is below the inline one.
"""

from __future__ import annotations

import sys
from typing import Any

from common import ROOT, Ctx, add_paths, log, tiny_model


def _bench() -> Any:
    path = str(ROOT / "benchmark" / "sglang")
    if path not in sys.path:
        sys.path.insert(0, path)
    import bench_host_copies

    return bench_host_copies


def run(ctx: Ctx) -> None:
    add_paths()
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_hybrid.sglang import plugin

    plugin.register()
    HookRegistry.apply_hooks()
    bench = _bench()
    tokens = 4096 if ctx.quick else 32768
    model = tiny_model(ctx.tmp)
    runs = {}
    for mode in ("inline", "async"):
        log(f"  {mode}: {tokens}-token conversation")
        runs[mode] = bench.run(mode, tokens, model, device=ctx.device)
        ctx.note("runs", runs)
        ctx.flush()
    report = bench.summarize(runs)
    ctx.note("summary", report)
    a, i = runs["async"], runs["inline"]
    ctx.check(
        "next turn resumes at the same position with async and inline copies",
        a["turn2_cached_tokens"] == i["turn2_cached_tokens"] > 0 and a["restored_bytes"] > 0,
        async_cached=a["turn2_cached_tokens"],
        inline_cached=i["turn2_cached_tokens"],
        restored_mib=a["restored_bytes"] / 2**20,
    )
    issue = a["max_call_ms"].get("HostTier.release_lane", float("inf"))
    ctx.check(
        f"issuing a {tokens}-token write-through takes < 1 ms of scheduler time",
        issue < 1.0,
        issue_ms=issue,
        inline_ms=i["max_call_ms"].get("HostTier.release_lane"),
        restore_issue_ms=a["max_call_ms"].get("HostTier.restore"),
    )
    ctx.check(
        "decode stall with async copies below inline (write-through and restore)",
        a["decode_stall_ms_write-through"] < i["decode_stall_ms_write-through"]
        and a["decode_stall_ms_restore"] < i["decode_stall_ms_restore"],
        **{k: v for k, v in report["ratios_async_over_inline"].items()},
    )
    ctx.flush()


def dry(ctx: Ctx) -> None:
    add_paths()
    from sglang_hybrid.cpu.loop import InProcessScheduler  # noqa: F401
    from sglang_hybrid.store.copy_queue import StreamQueue  # noqa: F401

    bench = _bench()
    ctx.note("plan", {"tokens": 32768, "modes": ["inline", "async"], "bench": bench.__file__})

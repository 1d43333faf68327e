"""Stage O: SGLang's overlap loop with a forward made long (issue #35).

With overlap scheduling (SGLang's default) the next batch is built on the schedule stream while
the forward runs on the forward stream; the cache's copies (tail copies, pass-end state
captures), its host copies and every index tensor it hands SGLang must be ordered on the stream
that reads them, and kept alive until then. Forwards of microseconds (stage A1's tests) never
open a race window. Here every forward first runs a busy kernel (``torch.cuda._sleep``, about
``BUSY_MS`` on the forward stream), so the forward stream lags the schedule stream by that much on
every pass: a copy enqueued on the wrong stream, an index freed to the caching allocator while the
forward still reads it, or a host read that does not wait, lands on memory that has moved on.

The exactness suite's request programs run through SGLang's Scheduler (overlap on) with the
checking worker (``test/sglang/checking_worker.py``: every pass proves each resumed state and
prefix KV row is the one an uncached run holds), with the hybrid cache and a host tier, and
again with no cache; every request's output must equal the uncached run's.

On the CPU (the smoke mode) there is no kernel to sleep: the same programs run under the CPU
stream model instead (``sglang_hybrid.cpu.stream_model``: completion deferred, every order
checked, a host sync in a per-pass entry point of the cache fails).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from common import Ctx, add_paths, log, tiny_model

BUSY_MS = 20.0
PROGRAMS = [
    "multi_turn",
    "host_only_restore",
    "cancel_mid_prefill",
    "new_prefix_together",
    "shared_preamble",
    "resume_equivalence",
]
QUICK = ["multi_turn", "cancel_mid_prefill"]


def _busy(worker: Any, ms: float) -> dict[str, int]:
    """Every forward of ``worker`` starts with ~``ms`` of busy kernel on its stream."""
    cycles = int(ms * 1e3 * torch.cuda.get_device_properties(0).clock_rate)  # kHz -> per ms
    seen = {"forwards": 0}
    forward = worker.forward_batch_generation

    def slow(*args: Any, **kwargs: Any) -> Any:
        seen["forwards"] += 1
        torch.cuda._sleep(cycles)  # on the current stream: the forward stream under overlap
        return forward(*args, **kwargs)

    worker.forward_batch_generation = slow
    return seen


def _scheduler(ctx: Ctx, model: Any, backend: str, overlap: bool) -> Any:
    from checking_worker import CheckingWorker
    from sched_args import scheduler_args

    from sglang_hybrid.cpu.loop import InProcessScheduler

    args = scheduler_args(
        backend,
        page=1,
        chunk=128,
        opts={"host_cache_mib": 16} if backend == "hybrid" else None,
        total=4096,
        disable_overlap_schedule=not overlap,
    )
    if ctx.cuda:
        args["device"] = "cuda"
    elif backend == "hybrid":
        from sglang_hybrid.cpu.stream_model import StreamModel

        args["stream_model"] = StreamModel()
    return InProcessScheduler(model, worker="tokens", worker_class=CheckingWorker, **args)


def run(ctx: Ctx) -> None:
    add_paths()
    from program_driver import drive
    from programs import PROGRAMS as ALL
    from programs import Chat
    from sglang.srt.plugins.hook_registry import HookRegistry
    from transformers import AutoTokenizer

    from sglang_hybrid.sglang import plugin

    plugin.register()
    HookRegistry.apply_hooks()
    model = tiny_model(ctx.tmp)
    chat = Chat(AutoTokenizer.from_pretrained(model))
    names = QUICK if ctx.quick else PROGRAMS
    ctx.note("programs", names)
    ctx.note("busy_ms", BUSY_MS if ctx.cuda else None)
    outputs: dict[str, dict[str, list[int]]] = {}
    for backend in ("none", "hybrid"):
        t0 = time.perf_counter()
        sched = _scheduler(ctx, model, backend, overlap=True)
        try:
            assert sched.overlap, "SGLang's overlap loop must run"
            busy = _busy(sched.scheduler.model_worker, BUSY_MS) if ctx.cuda else None
            _, _, results = drive(sched, names, ALL, chat)
            outputs[backend] = {rid: list(r.output_ids) for rid, r in results.items()}
            info: dict[str, Any] = {
                "requests": len(results),
                "seconds": time.perf_counter() - t0,
                "cached": {rid: r.cached_tokens for rid, r in sorted(results.items())},
                "checked_states": sched.worker.checked_states,
                "checked_tokens": sched.worker.checked_tokens,
            }
            if busy is not None:
                info["busy_forwards"] = busy["forwards"]
            if backend == "hybrid":
                tc = sched.tree_cache
                info["pools_stream_is_forward"] = tc.pools.stream is sched.scheduler.forward_stream
                info["host_restored_bytes"] = tc.host_tier.restored_bytes if tc.host_tier else 0
                sm = getattr(sched, "stream_model", None)
                if sm is not None:
                    syncs = sm.budget_syncs().items()
                    info["budget_syncs"] = {f"{where}: {what}": n for (where, what), n in syncs}
            ctx.result[backend] = info
            log(f"  {backend}: {len(results)} requests in {info['seconds']:.1f} s")
        finally:
            sched.close()
        ctx.flush()
    hyb, ref = outputs["hybrid"], outputs["none"]
    differ = sorted(rid for rid in ref if hyb.get(rid) != ref[rid])
    ctx.check(
        "every output under the overlap loop with the cache equals the uncached run's"
        + (f" (forwards {BUSY_MS:g} ms longer)" if ctx.cuda else " (CPU stream model)"),
        not differ and set(hyb) == set(ref) and bool(ref),
        requests=len(ref),
        differ=differ[:10],
    )
    h = ctx.result["hybrid"]
    ctx.check(
        "the checking worker proved resumed states and prefix KV, the cache resumed requests",
        h["checked_states"] > 0 and any(v for v in h["cached"].values()),
        checked_states=h["checked_states"],
        reused=sum(1 for v in h["cached"].values() if v),
    )
    ctx.check(
        "the cache's copies ran on SGLang's forward stream",
        bool(h["pools_stream_is_forward"]),
    )
    if ctx.cuda:
        ctx.check(
            "every forward ran its busy kernel",
            h.get("busy_forwards", 0) > 0,
            busy_forwards=h.get("busy_forwards"),
        )
    else:
        ctx.check("no host sync in a per-pass entry point of the cache", not h["budget_syncs"])


def dry(ctx: Ctx) -> None:
    """Imports, and the busy kernel exists in this torch."""
    add_paths()
    import checking_worker  # noqa: F401
    import program_driver  # noqa: F401
    import programs  # noqa: F401
    import sched_args  # noqa: F401

    import sglang_hybrid.cpu.stream_model  # noqa: F401

    ctx.check("torch.cuda._sleep exists (the busy kernel)", hasattr(torch.cuda, "_sleep"))

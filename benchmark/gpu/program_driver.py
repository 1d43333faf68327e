"""Runs the exactness suite's request programs (``test/exactness/programs.py``) through an
``InProcessScheduler`` (stages B and O): waves submitted together and run to idle, cancels after
a number of chunks, device evictions; each program after a flush. Returns what was asked, the
``Req`` objects and the finished results by request id."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any


def drive(
    sched: Any,
    names: list[str],
    programs: dict[str, Callable[..., Any]],
    chat: Any,
    *,
    before_program: Callable[[str], None] | None = None,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    from programs import Cancel, EvictDevice, Wave
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    results: dict[str, Any] = {}
    reqs: dict[str, Any] = {}
    asked: dict[str, Any] = {}
    for pname in names:
        sched.scheduler.flush_cache()
        if before_program is not None:
            before_program(pname)
        gen = programs[pname](chat, random.Random(pname))
        step = next(gen)
        while True:
            if isinstance(step, Wave):
                for r in step.reqs:
                    reqs[r.rid] = sched.submit(r.rid, r.ids, r.max_new, **r.submit_attrs())
                    asked[r.rid] = r
                sched.run_until_idle()
            elif isinstance(step, Cancel):
                r = step.req
                reqs[r.rid] = sched.submit(r.rid, r.ids, r.max_new)
                asked[r.rid] = r
                for _ in range(step.after_chunks):
                    sched.step()
                sched.abort(r.rid)
                sched.run_until_idle()
            elif isinstance(step, EvictDevice):
                tc = sched.tree_cache
                if getattr(tc, "host_tier", None) is not None:
                    tc.evict(EvictParams(num_tokens=1 << 30))
                    for s in list(tc.index.snapshots.values()):
                        if s.image_on_host and s.image_on_device and not s.restore_pins:
                            tc.index.drop_image_device(s)
            for rid, res in sched.results().items():
                if res.finished:
                    results[rid] = res
            try:
                step = gen.send(results)
            except StopIteration:
                break
    return asked, reqs, results

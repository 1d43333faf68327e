"""Wire a built SGLang ``Scheduler`` (on the CPU, built inside the model) to a ``StreamModel``.

After ``attach`` the scheduler runs as its CUDA branch does: a schedule stream (the calling
thread's current stream from then on, as the loop thread's is on CUDA), a forward stream and a
copy stream of the model, its device module the model's ``torch.cuda`` API (``copy_done``
events, ``StreamContext``), and the WAR barrier on (``_war_barrier_enabled``, which SGLang
enables on CUDA only). The worker's forward (``forward_batch_generation``) is a device region.
Each entry point of the cache that runs per pass on the scheduler's thread (``BUDGETS``) is a
budget: a host sync there fails.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .model import StreamModel

# The cache's entry points SGLang calls per pass (match, lock, checkpoint: commit and publish,
# eviction, restore issue, the per-iteration poll, the overlap pass-end capture).
BUDGETS = (
    "match_prefix",
    "inc_lock_ref",
    "dec_lock_ref",
    "lock",
    "unlock",
    "prefix_device_indices",
    "path_device_indices",
    "reserve_inpass",
    "capture_pass_ends",
    "checkpoint",
    "before_chunked_abort",
    "on_release",
    "evict",
    "init_load_back",
    "on_admitted",
    "held_for_restores",
    "prefetch_head",
    "poll",
)


def _budgeted(model: StreamModel, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with model.budget(name):
            return fn(*args, **kwargs)

    return call


def _device_code(model: StreamModel, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with model.device_region():
            return fn(*args, **kwargs)

    return call


def attach(model: StreamModel, scheduler: Any, *, budgets: bool = True) -> None:
    s = scheduler
    cuda = model.cuda
    # SGLang's startup (pools, warmups) ends in device synchronizes on a GPU: its work is done.
    model.observe(model.all_streams())
    schedule = model.new_stream("the schedule stream")
    forward = model.new_stream("the forward stream")
    copy = model.new_stream("the copy stream")
    s.device_module = cuda
    s.schedule_stream = schedule
    s.forward_stream = forward
    s.forward_stream_ctx = cuda.StreamContext(forward)
    s.copy_stream = copy
    s.copy_stream_ctx = cuda.StreamContext(copy)
    s._war_barrier_enabled = True
    s.stream_model = model
    # SGLang's loop thread runs inside its schedule stream (``run_event_loop``); in process the
    # caller's thread is that thread, between steps too (a test calling the cache directly).
    model.clocks.set_current(schedule)
    runner = getattr(s.tp_worker, "model_runner", None)
    if runner is not None:
        runner.forward_stream = forward
    workers = {id(w): w for w in (s.tp_worker, getattr(s, "model_worker", None)) if w is not None}
    for w in workers.values():
        w.forward_batch_generation = _device_code(model, w.forward_batch_generation)
    cache = s.tree_cache
    if budgets:
        for name in BUDGETS:
            fn = getattr(cache, name, None)
            if fn is not None:
                setattr(cache, name, _budgeted(model, name, fn))

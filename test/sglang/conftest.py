"""Fixtures for the backend tests: SGLang's real Scheduler with ``--radix-cache hybrid``.

Every scheduler here runs SGLang's own checks: the busy pool identity after every step
(``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY``), the idle identity and leak check when it
drains, and, through ``sanity_check``, the index's full invariant checker at idle
(``SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK``). The worker is ``CheckingWorker``: every pass proves
its prefix KV and resumed state are the ones an uncached run would have.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY"] = "1"
os.environ["SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK"] = "1"


@pytest.fixture(scope="session", autouse=True)
def _plugin(sglang_plugin: None) -> None:
    pass


class Harness:
    """One scheduler plus the bookkeeping the scenarios assert on."""

    def __init__(self, sched: Any) -> None:
        self.s = sched
        self.n = 0

    @property
    def cache(self) -> Any:
        return self.s.tree_cache

    def run(self, ids: list[int], max_new: int = 4, rid: str | None = None, **attrs: Any) -> Any:
        rid = rid or f"r{self.n}"
        self.n += 1
        self.s.submit(rid, ids, max_new, **attrs)
        self.s.run_until_idle()
        return self.s.results()[rid]

    def run_to_stop(self, rid: str, ids: list[int], k: int) -> list[int]:
        """Serve ``ids`` until the checking worker's token at ``len(ids) + k`` (a stop token,
        not a length limit); returns the output, the stop token last."""
        from sglang_hybrid.cpu.token_worker import deterministic_token

        worker = self.s.worker
        stop = deterministic_token(rid, len(ids) + k, worker.vocab_size, worker.eos_ids)
        self.s.submit(rid, ids, 300, sampling_overrides={"stop_token_ids": [stop]})
        self.s.run_until_idle()
        out = list(self.s.results()[rid].output_ids)
        assert out[-1] == stop and len(out) == k + 1, out
        return out

    def step_all(self) -> None:
        while self.s.has_work():
            self.s.step()
            self.check_mamba()
        self.s.on_idle()

    def check_mamba(self) -> None:
        """Mamba pool identity while busy (SGLang checks it only at idle)."""
        s = self.s.scheduler
        pool = s.req_to_token_pool
        reqs = {id(r): r for r in [*s.running_batch.reqs, *s.waiting_queue]}
        for r in [s.chunked_req, *(s.last_batch.reqs if s.last_batch else ())]:
            if r is not None:
                reqs[id(r)] = r  # a prefill batch joins the running batch at the next pass
        held = sum(1 for r in reqs.values() if r.kv.holds_mamba)
        tc = s.tree_cache
        cache = tc.mamba_evictable_size() + tc.mamba_protected_size()  # snapshot + staging slots
        total = pool.mamba_allocator.available_size() + cache + held
        assert total == pool.mamba_pool.size, (total, pool.mamba_pool.size)


@pytest.fixture
def build(make_scheduler: Callable[..., Any], qwen3_next_dir: Path) -> Iterator[Callable[..., Any]]:
    """``build(backend="hybrid"|"builtin"|"none", page=1, chunk=2048, **kw)`` -> Harness
    (``sched_args.scheduler_args``)."""
    from checking_worker import CheckingWorker
    from sched_args import scheduler_args

    def _build(
        backend: str = "hybrid",
        *,
        page: int = 1,
        chunk: int = 2048,
        opts: dict | None = None,
        model: Path | None = None,
        **kw: Any,
    ) -> Harness:
        args = scheduler_args(backend, page=page, chunk=chunk, opts=opts, **kw)
        sched = make_scheduler(
            model or qwen3_next_dir, worker="tokens", worker_class=CheckingWorker, **args
        )
        return Harness(sched)

    yield _build

"""Fault injectors for the reliability suite: failing host copies, exhausted pools, one hash.

Each is a context manager over ``pytest.MonkeyPatch`` that patches one seam and counts what it
did, so a test can say both "the fault happened" and "the system coped".
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest


class Stuck(RuntimeError):
    """The scheduler kept working without draining (requests waiting for good)."""


class CopyFault(IOError):
    """The injected copy error."""


class FailingCopies:
    """Host copies that raise: ``direction`` "restore" (host -> device), "write" (device ->
    host) or "both"; ``fail`` decides per copy call (its index among those counted, from 0).

    ``level="batch"`` raises from ``HostTier._run`` before anything moved; ``level="copy"``
    raises from one ``SlabCopier.blocks`` / ``SlabCopier.image`` call inside a batch, after the
    batch's earlier layers were copied (a copy failing mid-batch).
    """

    def __init__(self, direction: str, fail: Callable[[int], bool], *, level: str = "copy") -> None:
        assert direction in ("restore", "write", "both") and level in ("batch", "copy")
        self.direction = direction
        self.fail = fail
        self.level = level
        self.calls = 0
        self.failed = 0
        self.active = True

    def _maybe_fail(self, to_host: bool) -> None:
        if not self.active:
            return
        if self.direction != "both" and to_host != (self.direction == "write"):
            return
        i = self.calls
        self.calls += 1
        if self.fail(i):
            self.failed += 1
            raise CopyFault(f"injected {'write' if to_host else 'restore'} copy failure #{i}")

    @contextlib.contextmanager
    def installed(self, mp: pytest.MonkeyPatch) -> Iterator[FailingCopies]:
        from sglang_hybrid.sglang.host_tier import HostTier
        from sglang_hybrid.store.transfer import SlabCopier

        if self.level == "batch":
            run = HostTier._run

            def failing_run(tier: Any, blocks: Any, *, to_host: bool, **kw: Any) -> int:
                self._maybe_fail(to_host)
                return run(tier, blocks, to_host=to_host, **kw)

            mp.setattr(HostTier, "_run", failing_run)
        else:
            blocks, image = SlabCopier.blocks, SlabCopier.image

            def failing_blocks(copier: Any, items: Any, to_host: bool, *a: Any, **kw: Any) -> int:
                if items:
                    self._maybe_fail(to_host)
                return blocks(copier, items, to_host, *a, **kw)

            def failing_image(
                copier: Any, slot: int, slabs: Any, to_host: bool, *a: Any, **kw: Any
            ) -> int:
                self._maybe_fail(to_host)
                return image(copier, slot, slabs, to_host, *a, **kw)

            # Whole blocks may go through one staging buffer instead (the copy worker's path).
            stage_out, stage_in = SlabCopier.stage_out, SlabCopier.stage_in

            def failing_stage_out(copier: Any, items: Any, *a: Any, **kw: Any) -> int:
                self._maybe_fail(True)
                return stage_out(copier, items, *a, **kw)

            def failing_stage_in(copier: Any, items: Any, *a: Any, **kw: Any) -> Any:
                self._maybe_fail(False)
                return stage_in(copier, items, *a, **kw)

            mp.setattr(SlabCopier, "blocks", failing_blocks)
            mp.setattr(SlabCopier, "image", failing_image)
            mp.setattr(SlabCopier, "stage_out", failing_stage_out)
            mp.setattr(SlabCopier, "stage_in", failing_stage_in)
        try:
            yield self
        finally:
            self.active = False


# The allocation sites of the backend (function names in sglang_hybrid.sglang); SGLang's own
# calls pass through untouched.
KV_SITES = ("_copy_tail", "_copy_request_tail", "_alloc")
MAMBA_SITES = ("_reserve_slots", "_prepare_state_slot", "init_load_back", "restored_match")
# Backend helpers that allocate on behalf of their caller (sglang/pages.py).
SHARED_HELPERS = ("alloc_evicting",)


def caller_site() -> str | None:
    """The backend function that called the allocator, or None (SGLang's own call). Calls made
    through the shared ``pages.alloc_evicting`` count for the function that called it."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_name in SHARED_HELPERS:
        f = f.f_back
    if f is None:
        return None
    code = f.f_code
    if "/sglang_hybrid/sglang/" in code.co_filename.replace("\\", "/"):
        return code.co_name
    return None


class ExhaustedPool:
    """An allocator whose ``alloc`` returns None for chosen calls from the backend's sites.

    ``pool``: "kv" (SGLang's token-to-KV allocator) or "mamba" (the MambaPool allocator).
    ``fail(site, i)``: whether the i-th call (from 0) from ``site`` returns None.
    """

    def __init__(self, pool: str, fail: Callable[[str, int], bool]) -> None:
        self.pool = pool
        self.fail = fail
        self.calls: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.active = True

    @contextlib.contextmanager
    def installed(self, mp: pytest.MonkeyPatch, scheduler: Any) -> Iterator[ExhaustedPool]:
        if self.pool == "kv":
            alloc_obj = scheduler.token_to_kv_pool_allocator
        else:
            alloc_obj = scheduler.req_to_token_pool.mamba_allocator
        orig = alloc_obj.alloc

        def alloc(*a: Any, **kw: Any) -> Any:
            site = caller_site() if self.active else None
            if site is not None:
                i = self.calls[site]
                self.calls[site] += 1
                if self.fail(site, i):
                    self.failed[site] += 1
                    return None
            return orig(*a, **kw)

        mp.setattr(alloc_obj, "alloc", alloc)
        try:
            yield self
        finally:
            self.active = False


def constant_hash(monkeypatch: pytest.MonkeyPatch, value: int = 0x5EED) -> None:
    """Every block's lookup hash is ``value``: every block collides with every other."""
    from sglang_hybrid.index import keys

    def same(data: bytes, seed: int) -> int:
        return value

    monkeypatch.setattr(keys, "xxh3_chain", same)  # PromptKey's default, read per key


def format_exc(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-8:])

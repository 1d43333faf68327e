"""The coalescer's shortcuts decide what a full walk decides, pass by pass.

``Coalescer.select`` reuses work between admission passes: an unchanged window with unchanged
resume points keeps the last decision, a window whose chunked request or resume points moved only
decides its sibling requests again (``_redecide``), and a window of only prompts the last walk
found disjoint holds nothing (``_disjoint``). Here one coalescer runs with them and one walks every
pass, over a seeded stream of arrivals sharing documents to various depths, aborts, admissions,
chunk passes, publications that move resume points, and priority reorders; both must hold the
same requests for the same targets in every pass. A hash-seed-free world: only rids and tokens.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

from sglang_hybrid.index import BLOCK_TOKENS, CostModel
from sglang_hybrid.sglang.coalesce import Coalescer


class _Index:
    """What the coalescer reads of the index: ``resume_epoch`` and ``match(key).best``. The
    servable frontier is the deepest published prefix of the prompt (block multiples)."""

    def __init__(self) -> None:
        self.resume_epoch = 0
        self.published: set[bytes] = set()

    def publish(self, data: bytes) -> None:
        self.published.add(data)
        self.resume_epoch += 1

    def match(self, key: Any) -> SimpleNamespace:
        best = 0
        for b in range(key.full_blocks, 0, -1):
            if key.data[: b * BLOCK_TOKENS * 4] in self.published:
                best = b * BLOCK_TOKENS
                break
        return SimpleNamespace(best=SimpleNamespace(frontier=best) if best else None)


class _Req:
    """A waiting request as the coalescer reads it (hashable by identity, as SGLang's ``Req``)."""

    def __init__(self, rid: str, ids: list[int]) -> None:
        self.rid, self.origin_input_ids, self.prefix_len = rid, ids, 0


class _Walker(Coalescer):
    """The reference: forgets what ``select`` reuses, so every pass is a full walk (the hold
    counts, the cuts and the in-flight index are kept, as they are state, not shortcuts)."""

    def select(self, scheduler: Any, exclude: frozenset[str] = frozenset()) -> list[Any]:
        self._window_seen = ()
        self._siblings = []
        self._disjoint = frozenset()
        return super().select(scheduler, exclude)


def _world(seed: int) -> None:
    rng = random.Random(seed)
    docs = [
        [rng.randrange(10, 50_000) for _ in range(rng.choice([256, 700, 1500, 3000]))]
        for _ in range(6)
    ]
    index = _Index()
    cache = SimpleNamespace(index=index, cost=CostModel())
    fast, walker = Coalescer(cache), _Walker(cache)
    sched = SimpleNamespace(
        waiting_queue=[],
        chunked_req=None,
        max_running_requests=3,
        max_prefill_tokens=1024,
        chunked_prefill_size=512,
    )
    made = held_passes = walks = shortcut_passes = 0
    real_walk = Coalescer._walk

    def counting_walk(self: Coalescer, *a: Any) -> list[Any]:
        nonlocal walks
        walks += self is fast
        return real_walk(self, *a)

    Coalescer._walk = counting_walk  # type: ignore[method-assign]  # restored below
    try:
        for _ in range(1500):
            # Arrivals: now and then a fan-out burst on one document (what coalescing is for),
            # else zero or one request sharing a random depth of one.
            burst = rng.random() < 0.12
            doc = rng.choice(docs)
            arrivals = rng.randrange(2, 5) if burst else rng.choice([0, 0, 1])
            for i in range(arrivals if len(sched.waiting_queue) < 10 else 0):  # closed loop
                if not burst:
                    doc = rng.choice(docs)
                # A burst's first request may share less of the document than the rest: the
                # rest then wait for it, and for each other's deeper prefix once it is computed.
                cut = len(doc) if burst and i else rng.choice([0, 64, 130, 512, len(doc)])
                ids = doc[:cut] + [rng.randrange(10, 50_000) for _ in range(rng.randrange(1, 300))]
                sched.waiting_queue.append(_Req(f"r{made}", ids))
                made += 1
            if sched.waiting_queue and rng.random() < 0.03:  # an abort anywhere
                sched.waiting_queue.pop(rng.randrange(len(sched.waiting_queue)))
            if rng.random() < 0.01:  # a priority policy reorders the queue
                sched.waiting_queue.sort(key=lambda r: len(r.origin_input_ids))
            if rng.random() < 0.05:  # a publication elsewhere moves the resume points
                doc = rng.choice(docs)
                index.publish(_bytes(doc[: BLOCK_TOKENS * rng.randrange(1, len(doc) // 64 + 1)]))

            before = walks
            got = [r.rid for r in fast.select(sched)]
            want = [r.rid for r in walker.select(sched)]
            assert got == want, f"pass differs: {got} vs {want}"
            assert fast.holds == walker.holds
            assert fast.cuts == walker.cuts
            held_passes += bool(got)
            shortcut_passes += walks == before

            # The pass: the chunked request advances a chunk (publishing at the cuts asked of
            # it and at its end), or the first request not held starts.
            held = set(got)
            chunked = sched.chunked_req
            if chunked is not None:
                n = len(chunked.origin_input_ids)
                end = min(n, chunked.prefix_len + 512)
                for target in sorted(fast.cuts.get(chunked.rid, {})):
                    if chunked.prefix_len < target <= end:
                        end = target  # an exact tap ends the pass there (chunking.py)
                        break
                chunked.prefix_len = end
                if end % BLOCK_TOKENS == 0 or end == n:
                    index.publish(_bytes(chunked.origin_input_ids[: end - end % BLOCK_TOKENS]))
                if end == n:
                    sched.chunked_req = None
                    fast.forget(chunked.rid)
                    walker.forget(chunked.rid)
            elif sched.waiting_queue:
                for i, req in enumerate(sched.waiting_queue):
                    if req.rid not in held:
                        sched.chunked_req = req
                        sched.waiting_queue = sched.waiting_queue[:i] + sched.waiting_queue[i + 1 :]
                        break
    finally:
        Coalescer._walk = real_walk  # type: ignore[method-assign]  # the restore
    # The stream exercised what it checks: holds, and passes decided without a walk.
    assert held_passes > 20, held_passes
    assert shortcut_passes > 100, shortcut_passes


def _bytes(ids: list[int]) -> bytes:
    from array import array

    return array("i", ids).tobytes()


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_select_shortcuts_decide_as_a_full_walk(seed: int) -> None:
    _world(seed)


def test_a_reset_forgets_what_the_old_index_decided() -> None:
    """After a cache reset the new index counts ``resume_epoch`` from 0 again: a frontier or a
    decision kept for an epoch of the old index must not be read as the new one's (here the old
    index served the shared document, so nothing waited; the new one holds nothing of it)."""
    doc = list(range(10, 10 + 1024))
    sibling, waiter = _Req("a", doc + [1] * 10), _Req("b", doc + [2] * 10)
    sched = SimpleNamespace(
        waiting_queue=[sibling, waiter],
        chunked_req=None,
        max_running_requests=3,
        max_prefill_tokens=4096,
        chunked_prefill_size=512,
    )
    cache = SimpleNamespace(index=_Index(), cost=CostModel())
    co = Coalescer(cache)
    cache.index.publish(_bytes(doc))  # epoch 1: the waiter resumes from the document's end
    assert co.select(sched) == []
    cache.index = _Index()  # the reset's new index, at the same epoch, with nothing published
    cache.index.resume_epoch = 1
    co.on_reset()
    assert [r.rid for r in co.select(sched)] == ["b"]  # it now waits for its sibling

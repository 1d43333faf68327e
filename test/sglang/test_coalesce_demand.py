"""The coalescer's waiting-queue demand stays equal to the queue SGLang keeps (``_sync_demand``).

Requests arrive at the queue's end, the head is admitted (planned, then removed, as SGLang's
admission does), some abort from anywhere, and now and then a priority policy sorts the queue.
The O(changes) sync must give the same demand as recounting the queue whenever its count check
can see the change, and always after a full reconcile.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

from sglang_hybrid.index import CostModel
from sglang_hybrid.sglang.coalesce import FULL_SYNC_EVERY, Coalescer, admits_nothing
from sglang_hybrid.sglang.request import waiting_key


def test_demand_follows_the_waiting_queue() -> None:
    rng = random.Random(5)
    doc = [rng.randrange(10, 5000) for _ in range(1500)]
    co = Coalescer(SimpleNamespace(cost=CostModel()))
    reconciles = [0]
    full_reconcile = co._reconcile

    def counted(queue: list[SimpleNamespace]) -> None:
        reconciles[0] += 1
        full_reconcile(queue)

    co._reconcile = counted  # type: ignore[method-assign]
    queue: list[SimpleNamespace] = []
    made = 0
    sorted_since_full = False
    checked_exact = checked_full = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.45:  # an arrival (some in a namespace: they never coalesce)
            ids = doc[: rng.randrange(0, 1500)] + [rng.randrange(10, 5000) for _ in range(70)]
            salt = "tenant" if rng.random() < 0.1 else None
            queue.append(SimpleNamespace(rid=f"r{made}", origin_input_ids=ids, cache_salt=salt))
            made += 1
        elif op < 0.5 and queue:  # an abort anywhere
            queue.pop(rng.randrange(len(queue)))
        elif op < 0.505:  # a priority policy reorders the queue
            queue.sort(key=lambda r: len(r.origin_input_ids))
            sorted_since_full = True
        co._note_queue(queue)
        if op >= 0.505 and queue:  # an admission pass: the head is planned, then leaves
            req = queue[0]
            key = waiting_key(req)
            if key is not None:
                co.cuts_for(req.rid, key, 0)
                expect = {r.rid for r in queue if waiting_key(r) is not None}
                full = co._syncs % FULL_SYNC_EVERY == 0
                if full:
                    sorted_since_full = False
                if full or not sorted_since_full:
                    assert set(co.demand.owner_set()) == expect
                    checked_exact += 1
                    checked_full += full
            queue = queue[1:]  # SGLang builds a new list without the admitted requests
    assert checked_exact > 300 and checked_full > 3
    # The O(queue) reconcile runs only for what the count flags (aborts, sorts) and the periodic
    # full sync, not at every change.
    assert reconciles[0] < co._syncs / 3, (reconciles[0], co._syncs)


def test_admits_nothing_mirrors_sglangs_early_return() -> None:
    """The admission hook skips a pass only where SGLang 0.5.23's ``_get_new_batch_prefill_raw``
    returns before reading the queue; anything else (a chunked request, a batch that is not full,
    the resets SGLang makes first, attributes it does not recognise) is a pass that admits."""

    class Batch:
        def __init__(self, full: bool, empty: bool = False) -> None:
            self.batch_is_full, self._empty = full, empty

        def is_empty(self) -> bool:
            return self._empty

    def sched(**kw: object) -> SimpleNamespace:
        base = {
            "waiting_queue": [object()],
            "chunked_req": None,
            "enable_priority_preemption": False,
            "is_hybrid_swa": False,
        }
        return SimpleNamespace(**{**base, **kw})

    full = Batch(full=True)
    assert admits_nothing(sched(), full)
    assert admits_nothing(sched(waiting_queue=[]), Batch(full=False))  # nothing to admit
    assert not admits_nothing(sched(), Batch(full=False))
    assert not admits_nothing(sched(chunked_req=object()), full)  # its next chunk runs
    assert not admits_nothing(sched(enable_priority_preemption=True), full)  # flag reset first
    assert not admits_nothing(sched(is_hybrid_swa=True), full)
    assert not admits_nothing(sched(), Batch(full=True, empty=True))  # so is an empty batch's
    unknown = SimpleNamespace(waiting_queue=[object()], chunked_req=None)
    assert not admits_nothing(unknown, full)  # unrecognised: decided as usual

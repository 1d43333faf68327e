"""The copy queues' contract (``store/copy_queue.py``): FIFO completion, ``finished`` counts done
operations from the head only, errors come back at retire, ``wait`` blocks."""

from __future__ import annotations

import threading

import pytest
import torch

from sglang_hybrid.store.copy_queue import (
    DeferredQueue,
    InlineQueue,
    ThreadQueue,
    make_queue,
)


def test_inline_runs_at_issue_and_reports_errors_at_retire() -> None:
    q = InlineQueue()
    q.issue(lambda: 5)
    q.issue(lambda: 1 // 0)
    assert q.synchronous and q.finished() == 2
    done = q.retire(2)
    assert done[0] == 5 and isinstance(done[1], ZeroDivisionError)
    assert len(q) == 0


def test_thread_queue_counts_only_a_done_prefix() -> None:
    q = ThreadQueue()
    gate = threading.Event()
    q.issue(lambda: (gate.wait(5), 1)[1])  # the head blocks
    q.issue(lambda: 2)  # done only after the head (one worker, FIFO)
    assert q.finished() == 0 and len(q) == 2
    gate.set()
    q.wait(2)
    assert q.finished() == 2
    assert q.retire(2) == [1, 2]
    q.issue(lambda: [][1])
    q.wait(1)
    (err,) = q.retire(1)
    assert isinstance(err, IndexError)
    q.close()


def test_deferred_queue_keeps_an_operation_in_flight_for_one_poll() -> None:
    q = DeferredQueue()
    ran: list[int] = []
    q.issue(lambda: ran.append(1) or 10)
    assert q.finished() == 0 and ran == []  # seen by this poll, runs at the next
    q.issue(lambda: ran.append(2) or 20)
    assert q.finished() == 1 and ran == [1]  # the second was issued since the last poll
    assert q.retire(1) == [10]
    assert q.finished() == 1 and ran == [1, 2]
    q.issue(lambda: 1 // 0)
    q.wait(2)  # runs everything up to the second operation now
    assert q.finished() == 2
    res = q.retire(2)
    assert res[0] == 20 and isinstance(res[1], ZeroDivisionError)


@pytest.mark.parametrize("mode", ["inline", "deferred", "async"])
def test_make_queue_on_the_cpu(mode: str) -> None:
    q = make_queue(mode, torch.device("cpu"))  # type: ignore[arg-type]  # a CopyMode string
    q.issue(lambda: 3)
    q.wait(1)
    for _ in range(3):
        if q.finished():
            break
    assert q.finished() == 1 and q.retire(1) == [3]
    q.close()

"""L3 jobs on their worker thread (``store/l3/jobs.py``): a deadline runs from the job's start.

A job queued behind a long write queue waits its turn without expiring (counted from submission
it expired though the store answered every call, and turned L3 off on a busy server); a job
that cannot start because an expired one still holds the worker expires at once.
"""

from __future__ import annotations

import threading
import time

from sglang_hybrid.store.l3.jobs import Job, JobQueue


def _until(cond, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_a_job_queued_behind_slow_work_does_not_expire_while_it_waits() -> None:
    q = JobQueue("test-l3-jobs")
    first_gate, second_gate = threading.Event(), threading.Event()
    try:
        first = q.submit(Job(lambda job: first_gate.wait(10), 5.0))
        second = q.submit(Job(lambda job: second_gate.wait(10), 1.0))
        time.sleep(1.2)  # longer than the second job's whole budget, spent in the queue
        first_gate.set()
        _until(lambda: second.started is not None)
        assert first.future is not None and first.future.done()
        assert q.finished(now=second.started + 0.5) == 1  # the first done, the second in time
        assert not second.expired
        assert q.finished(now=second.started + 1.5) == 2  # its own budget is spent: expired
        assert second.expired
    finally:
        first_gate.set()
        second_gate.set()
        q.close()


def test_a_job_behind_an_expired_one_still_running_expires_at_once() -> None:
    q = JobQueue("test-l3-jobs")
    gate = threading.Event()
    try:
        hung = q.submit(Job(lambda job: gate.wait(10), 0.05))
        queued = q.submit(Job(lambda job: "ran", 60.0))
        _until(lambda: hung.started is not None)
        assert q.finished(now=hung.started + 1.0) == 1 and hung.expired
        assert q.retire(1) == [hung] and q.stuck
        assert queued.started is None
        assert q.finished() == 1 and queued.expired  # it would wait on the hung call
        assert isinstance(q.retire(1)[0].result(), TimeoutError)
    finally:
        gate.set()
        q.close()

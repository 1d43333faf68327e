"""L3 work off the scheduler thread: a FIFO of jobs on one worker thread, with deadlines.

As the host tier's copy queue (``store/copy_queue.py``) the scheduler thread only *submits* and
*polls*: ``finished`` counts the jobs at the head that are done, or whose deadline passed (a
store that stopped answering must not hold a request forever), and ``retire`` pops them with
their results. A deadline runs from when the job *starts* on the worker, not from when it was
queued: a queue that is long because the writer has much to write (a busy machine, a burst of
turns) is not a store that stopped answering. Counted from submission, a job could expire in
the queue though the store answered every call: on the loaded 2-core machine the scale-out
benchmark's ``round_robin`` + L3 run on four servers turned L3 off on one server for 2 s
(``docs/scale-out.md``), its lookups skipped and its writes dropped until the trial. A job
that cannot start because an expired one still holds the worker expires at once (the store did
not answer the job ahead of it).

A job past its deadline reads as failed: :attr:`Job.expired`; it may still be
running on the worker, so before the scheduler hands back what the job writes into (host slabs)
it cancels the job (:meth:`Job.cancel`), which waits for a write in progress and stops any later
one (:meth:`Job.writing`). While such a job still runs the queue is ``stuck``: the caller submits
nothing more until it ends.

:class:`ClockedJobQueue` is the same contract in modelled time (the replay, ``replay/l3_model.py``):
a job runs at once on the caller's thread (as the host tier's ``inline`` copies do), and counts as
finished once a clock the caller supplies reaches the time its transfer would take on a modelled
link (priced by :attr:`Job.cost`); one job at a time per queue, as one worker thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, NamedTuple


class JobCost(NamedTuple):
    """What a job moves, for a clock that prices it (``ClockedJobQueue``): round trips to the
    store, and objects (64-token block bundles, including a snapshot's partial tail; images)."""

    round_trips: int = 1
    blocks: int = 0
    images: int = 0


ONE_ROUND_TRIP = JobCost()


class Cancelled(Exception):
    """The job was cancelled before it wrote its results."""


class Job:
    """One unit of L3 work; ``run(job)`` executes on the worker thread."""

    def __init__(
        self,
        run: Callable[[Job], Any],
        deadline_s: float,
        tag: Any = None,
        cost: JobCost = ONE_ROUND_TRIP,
    ) -> None:
        self.run = run
        self.budget = deadline_s  # from when it starts on the worker (``started``)
        self.started: float | None = None  # set by the worker thread as it begins
        self.tag = tag  # the caller's record of what the job is for
        self.cost = cost
        self.ready_at = 0.0  # ClockedJobQueue: the modelled time it is done
        self.future: Future[Any] | None = None
        self.expired = False
        self._lock = threading.Lock()
        self._cancelled = False

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Around the job's writes into memory its caller owns: raises :class:`Cancelled` once
        the caller cancelled, and ``cancel`` waits for a write under way."""
        with self._lock:
            if self._cancelled:
                raise Cancelled()
            yield

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True

    def begin(self) -> Any:
        """On the worker: the job starts now, and so does its deadline."""
        self.started = time.monotonic()
        return self.run(self)

    @property
    def running(self) -> bool:
        return self.future is not None and not self.future.done()

    def result(self) -> Any:
        """The job's return value, or the exception it raised (an expired job: TimeoutError)."""
        if self.expired:
            return TimeoutError("past its deadline")
        assert self.future is not None and self.future.done()
        exc = self.future.exception()
        return exc if exc is not None else self.future.result()


class JobQueue:
    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.jobs: deque[Job] = deque()
        self._abandoned: list[Job] = []  # expired and retired, still running

    def submit(self, job: Job) -> Job:
        job.future = self._pool.submit(job.begin)
        self.jobs.append(job)
        return job

    def __len__(self) -> int:
        return len(self.jobs)

    def finished(self, now: float | None = None) -> int:
        """Jobs at the head that are done or past their deadline (counted from their start; a
        job still queued behind an expired one that holds the worker is past it at once)."""
        now = time.monotonic() if now is None else now
        k = 0
        for job in self.jobs:
            assert job.future is not None
            if not job.future.done():
                started = job.started
                if started is None:
                    if not self.stuck:  # waiting its turn behind live work
                        time.sleep(0)
                        break
                elif now < started + job.budget:
                    time.sleep(0)  # hand the GIL to the worker (as ``ThreadQueue``)
                    break
                job.expired = True
            k += 1
        return k

    def retire(self, k: int) -> list[Job]:
        out = [self.jobs.popleft() for _ in range(k)]
        self._abandoned += [j for j in out if j.expired and j.running]
        return out

    @property
    def stuck(self) -> bool:
        """An expired job still runs on the worker: anything submitted now would wait for it."""
        self._abandoned = [j for j in self._abandoned if j.running]
        return bool(self._abandoned)

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait for every submitted job (shutdown, tests)."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        for job in list(self.jobs):
            assert job.future is not None
            left = None if end is None else max(0.0, end - time.monotonic())
            try:
                job.future.exception(timeout=left)
            except TimeoutError:
                return

    def close(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=not wait)


class ClockedJobQueue(JobQueue):
    """A :class:`JobQueue` whose jobs run at submission and finish in modelled time (see the
    module docstring): ``now()`` reads the clock, ``seconds(job)`` prices a job. Deterministic:
    what finishes when depends on the clock and the jobs, never on threads."""

    def __init__(self, now: Callable[[], float], seconds: Callable[[Job], float]) -> None:
        self.jobs = deque()
        self._abandoned = []
        self.now = now
        self.seconds = seconds
        self.busy_until = 0.0  # the modelled end of the last job submitted

    def submit(self, job: Job) -> Job:
        f: Future[Any] = Future()
        try:
            f.set_result(job.run(job))
        except Exception as e:  # as a worker thread's future: the caller reads it
            f.set_exception(e)
        job.future = f
        job.ready_at = self.busy_until = max(self.now(), self.busy_until) + self.seconds(job)
        self.jobs.append(job)
        return job

    def finished(self, now: float | None = None) -> int:
        t = self.now() if now is None else now
        k = 0
        for job in self.jobs:
            if job.ready_at > t:
                break
            k += 1
        return k

    def next_ready(self) -> float | None:
        """When the job at the head finishes (None: no job)."""
        return self.jobs[0].ready_at if self.jobs else None

    def wait(self, timeout_s: float | None = None) -> None:
        return None

    def close(self, wait: bool = True) -> None:
        return None

"""One FIFO of host copies off the scheduler thread (spec §6.5, §11.1).

The scheduler thread only *issues* a copy (``issue``: a callable that enqueues the bytes and
returns how many) and *polls* (``finished``: how many operations at the head are done). Operations
complete in issue order, which is what makes the host tier's bookkeeping simple: retiring the
first k operations is always correct once k are done, and a slab released by one operation and
reused by a later one is written in that order.

Three engines keep that contract:

- ``StreamQueue`` (CUDA): the scheduler thread enqueues every operation on one dedicated copy
  stream (launches only), which first waits (on the GPU, never the host) for the work queued on
  the compute stream; an event recorded after it says when it is done. One stream rather than
  one per direction: restores then wait behind at most the write-through bytes in flight, which
  the host tier bounds, and FIFO holds across directions.
- ``ThreadQueue`` (CPU): one worker thread runs the copies in order (torch releases the GIL while
  it copies); a future per operation. Preparing an operation's copy list happens there too.
- ``InlineQueue``: the copy runs inside ``issue`` on the caller's thread and has landed when
  ``issue`` returns. The reference behaviour, and the replay harness's, whose results must not
  depend on the timing of a thread. On CUDA it issues like ``StreamQueue`` and then waits for
  that operation's event (a host sync per operation, by definition of inline): a copy enqueued
  with ``non_blocking`` is not done when it is launched, so a synchronous queue that did not
  wait would report device-to-host copies retired (and a save would read the pinned slabs)
  before they landed (issue #35).
- ``DeferredQueue``: the copy runs on the caller's thread one poll later (tests: deterministic
  and asynchronous; not a command-line choice).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import torch

CopyMode = Literal["async", "inline", "deferred"]
Issue = Callable[[], int]  # enqueues one operation's copies; returns the bytes it moves


class CopyQueue(ABC):
    """A FIFO of copy operations. Contract: ``finished()`` never decreases until ``retire`` and
    counts done operations from the head; ``retire(k)`` pops the first k (all done) and returns
    for each the bytes moved or the exception it raised."""

    synchronous = False

    @abstractmethod
    def issue(self, op: Issue) -> None: ...

    @abstractmethod
    def finished(self) -> int: ...

    @abstractmethod
    def retire(self, k: int) -> list[int | BaseException]: ...

    @abstractmethod
    def wait(self, k: int) -> None:
        """Block until the first ``k`` operations are done (drain, abort, shutdown only)."""

    @abstractmethod
    def __len__(self) -> int: ...

    def order_after(self, stream: Any) -> None:
        """Operations issued from now on also wait (on the device) for the work queued on
        ``stream`` when they are issued; only the CUDA queue has device work to order."""
        return None

    def close(self) -> None:
        return None


class InlineQueue(CopyQueue):
    synchronous = True

    def __init__(self, device: torch.device | None = None) -> None:
        self._done: deque[int | BaseException] = deque()
        # CUDA: issue on a copy stream (ordered as StreamQueue orders), then wait for it.
        self._stream: StreamQueue | None = None
        if device is not None and device.type == "cuda":
            self._stream = StreamQueue(device)

    def order_after(self, stream: Any) -> None:
        if self._stream is not None:
            self._stream.order_after(stream)

    def issue(self, op: Issue) -> None:
        if self._stream is not None:
            self._stream.issue(op)
            self._stream.wait(1)
            self._done.extend(self._stream.retire(1))
            return
        try:
            self._done.append(op())
        except Exception as exc:  # reported at retire, like the asynchronous engines
            self._done.append(exc)

    def finished(self) -> int:
        return len(self._done)

    def retire(self, k: int) -> list[int | BaseException]:
        return [self._done.popleft() for _ in range(k)]

    def wait(self, k: int) -> None:
        return None

    def __len__(self) -> int:
        return len(self._done)


class ThreadQueue(CopyQueue):
    """One worker thread runs the operations in order; the scheduler thread only submits.

    The worker needs the GIL back after every torch call it makes; a scheduler thread that never
    blocks (an idle loop) would make it wait a switch interval each time, so ``finished`` yields
    the GIL once while the head operation is still running.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybrid-host-copy")
        self._ops: deque[Future[int]] = deque()

    def issue(self, op: Issue) -> None:
        self._ops.append(self._pool.submit(op))

    def finished(self) -> int:
        k = 0
        for f in self._ops:
            if not f.done():
                time.sleep(0)  # hand the GIL to the worker (see the class docstring)
                break
            k += 1
        return k

    def retire(self, k: int) -> list[int | BaseException]:
        out: list[int | BaseException] = []
        for _ in range(k):
            f = self._ops.popleft()
            exc = f.exception()
            out.append(exc if exc is not None else f.result())
        return out

    def wait(self, k: int) -> None:
        for i, f in enumerate(self._ops):
            if i >= k:
                break
            f.exception()  # blocks until done; the error is read at retire

    def __len__(self) -> int:
        return len(self._ops)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class StreamQueue(CopyQueue):
    """Each operation is enqueued on one copy stream from the scheduler thread (launches only:
    the host never waits); an event recorded after it says when it is done.

    The copy stream first waits (on the GPU) for the work queued on the compute stream when the
    operation was issued: sources may still be written by it (a pass's last KV, a tap's state).
    Issuing here rather than from a worker thread: a Python worker needs the GIL back after each
    launch, and a busy scheduler thread makes each of those waits up to a switch interval.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._ops: deque[tuple[Any, int | BaseException]] = deque()
        self._after: list[Any] = []  # more compute streams (overlap: SGLang's forward stream)

    def order_after(self, stream: Any) -> None:
        if stream not in self._after:
            self._after.append(stream)

    def issue(self, op: Issue) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for s in self._after:
            self.stream.wait_stream(s)
        result: int | BaseException
        with torch.cuda.stream(self.stream):
            try:
                result = op()
            except Exception as exc:  # reported at retire, like a copy that failed later
                result = exc
            event = torch.cuda.Event()
            event.record(self.stream)
        self._ops.append((event, result))

    def finished(self) -> int:
        k = 0
        for event, _ in self._ops:
            if not event.query():
                break
            k += 1
        return k

    def retire(self, k: int) -> list[int | BaseException]:
        return [self._ops.popleft()[1] for _ in range(k)]

    def wait(self, k: int) -> None:
        if 0 < k <= len(self._ops):
            self._ops[k - 1][0].synchronize()

    def __len__(self) -> int:
        return len(self._ops)


class DeferredQueue(CopyQueue):
    """The reliability suite's engine: an operation runs on the scheduler thread at the first
    ``finished`` after the one that saw it issued, so it is in flight for one whole scheduler
    iteration. Deterministic (no thread timing), yet every asynchronous state is reached."""

    def __init__(self) -> None:
        self._ops: deque[tuple[Issue, int | BaseException | None, bool]] = deque()

    def issue(self, op: Issue) -> None:
        self._ops.append((op, None, False))

    def finished(self) -> int:
        k = 0
        for i, (op, result, seen) in enumerate(self._ops):
            if result is None:
                if not seen:  # this one and every later one were issued since the last poll
                    for j in range(i, len(self._ops)):
                        self._ops[j] = (self._ops[j][0], None, True)
                    break
                try:
                    result = op()
                except Exception as exc:
                    result = exc
                self._ops[i] = (op, result, True)
            k += 1
        return k

    def retire(self, k: int) -> list[int | BaseException]:
        out: list[int | BaseException] = []
        for _ in range(k):
            _, result, _ = self._ops.popleft()
            assert result is not None
            out.append(result)
        return out

    def wait(self, k: int) -> None:
        for i in range(min(k, len(self._ops))):
            op, result, _ = self._ops[i]
            if result is None:
                try:
                    self._ops[i] = (op, op(), True)
                except Exception as exc:
                    self._ops[i] = (op, exc, True)

    def __len__(self) -> int:
        return len(self._ops)


def make_queue(mode: CopyMode, device: torch.device) -> CopyQueue:
    if mode == "inline":
        return InlineQueue(device)
    if mode == "deferred":
        return DeferredQueue()
    if device.type == "cuda":
        return StreamQueue(device)
    return ThreadQueue()

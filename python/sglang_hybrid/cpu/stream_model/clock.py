"""Happens-before for emulated CUDA streams: vector clocks, ``EmuStream`` and ``EmuEvent``.

Every stream keeps a vector clock (executor id -> the last op of that executor it is ordered
after); the host thread is executor ``HOST`` and its clock says which device work the host has
*observed complete* (a synchronize, a query that answered done, a blocking copy). The rules are
CUDA's:

- an op enqueued on stream S gets the next tick of S and is ordered after everything the host
  observed or did before enqueuing it (S's clock takes the host's);
- ``S.wait_stream(T)`` orders S's later work after all work enqueued on T so far;
- ``event.record(S)`` captures S's clock; ``S.wait_event(e)`` orders after it;
  ``e.synchronize()`` / ``S.synchronize()`` / a blocking copy on S make the host observe it;
- ``e.query()`` answers "done" when the host already observed what the event covers; otherwise
  "not done" the first ``pending_queries`` times it is asked (work runs later than it is
  launched), then "done", which the host observes like a synchronize.

Nothing executes late: tensors are computed when the op is called, so results stay exact. What
is deferred is *completion*: an access is ordered after another only through the rules above,
so every missing order is reported where it happens, whatever the timing would have been.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .model import StreamModel

HOST = 0  # the host thread's executor id
Clock = dict[int, int]


def merge(into: Clock, other: Clock) -> None:
    """``into`` becomes the pointwise max of both (``into`` is ordered after ``other``)."""
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


def covers(clock: Clock, executor: int, tick: int) -> bool:
    """The op ``tick`` of ``executor`` is ordered before whatever holds ``clock``."""
    return clock.get(executor, 0) >= tick


class EmuStream:
    """A stream of the model, with ``torch.cuda.Stream``'s methods. ``cuda_stream`` is its id
    (SGLang compares two streams' handles to tell them apart)."""

    def __init__(self, model: StreamModel, name: str = "", priority: int = 0) -> None:
        self.model = model
        self.id = model.clocks.new_executor()
        self.name = name or f"stream{self.id}"
        self.priority = priority
        self.clock: Clock = {self.id: 0}

    @property
    def cuda_stream(self) -> int:
        return self.id

    @property
    def device(self) -> Any:
        import torch

        return torch.device("cuda", 0)

    def wait_stream(self, other: EmuStream) -> None:
        merge(self.clock, other.clock)

    def wait_event(self, event: EmuEvent) -> None:
        if event.clock is not None:
            merge(self.clock, event.clock)

    def record_event(self, event: EmuEvent | None = None) -> EmuEvent:
        event = event if event is not None else EmuEvent(self.model)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.model.host_sync(f"{self.name}.synchronize()", self.clock)

    def query(self) -> bool:
        self.model.observe(self.clock)
        return True

    def __enter__(self) -> EmuStream:
        self.model.clocks.push(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.model.clocks.pop()

    def __repr__(self) -> str:
        return f"<EmuStream {self.name}>"


class EmuEvent:
    """``torch.cuda.Event``: records a stream's clock; synchronize / query make the host
    observe it (query only once its pending answers are used up)."""

    def __init__(self, model: StreamModel, **_flags: object) -> None:
        self.model = model
        self.clock: Clock | None = None
        self._pending = 0

    def record(self, stream: EmuStream | None = None) -> None:
        stream = stream if stream is not None else self.model.clocks.current()
        self.clock = dict(stream.clock)
        self._pending = self.model.pending_queries

    def wait(self, stream: EmuStream | None = None) -> None:
        (stream if stream is not None else self.model.clocks.current()).wait_event(self)

    def query(self) -> bool:
        if self.clock is None or all(
            covers(self.model.clocks.host, k, v) for k, v in self.clock.items()
        ):
            return True  # the host already knows it is done
        if self._pending > 0:
            self._pending -= 1
            return False
        self.model.observe(self.clock)
        return True

    def synchronize(self) -> None:
        if self.clock is not None:
            self.model.host_sync("Event.synchronize()", self.clock)

    def elapsed_time(self, other: EmuEvent) -> float:
        return 0.0


class Clocks:
    """Executor ids, the host's clock and each thread's current stream."""

    def __init__(self) -> None:
        self._next = HOST + 1
        self.host: Clock = {HOST: 0}
        self.streams: list[EmuStream] = []
        self._local = threading.local()
        self.default: EmuStream | None = None  # set by the model (needs ``self`` first)

    def new_executor(self) -> int:
        n = self._next
        self._next += 1
        return n

    def _stack(self) -> list[EmuStream]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            assert self.default is not None
            stack = self._local.stack = [self.default]
        return stack

    def current(self) -> EmuStream:
        return self._stack()[-1]

    def push(self, stream: EmuStream) -> None:
        self._stack().append(stream)

    def pop(self) -> None:
        self._stack().pop()

    def set_current(self, stream: EmuStream) -> None:
        self._stack()[-1] = stream

    @contextmanager
    def using(self, stream: EmuStream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        self.push(stream)
        try:
            yield
        finally:
            self.pop()

    def enqueue(self, stream: EmuStream) -> int:
        """The next op on ``stream``: its tick (ordered after what the host did and saw)."""
        merge(stream.clock, self.host)
        tick = stream.clock[stream.id] + 1
        stream.clock[stream.id] = tick
        return tick

    def host_tick(self) -> int:
        tick = self.host[HOST] + 1
        self.host[HOST] = tick
        return tick

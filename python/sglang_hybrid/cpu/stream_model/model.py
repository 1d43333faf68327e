"""``StreamModel``: the CUDA stream semantics a test runs the CPU under (package docstring).

Entering the model (``with StreamModel() as m:``) pushes its two torch modes, puts its stream and
event types in place of ``torch.cuda``'s (``Stream``, ``Event``, ``stream``, ``StreamContext``,
``current_stream``, ``default_stream``, ``set_stream``, ``synchronize``) and of
``Tensor.record_stream``, and presents SGLang's CPU pools to the cache as ``cuda:0``
(``store.device.register_pool_device``). Leaving restores all of it. One model at a time.

Budgets: ``with m.budget("match"):`` marks a region where a host sync is a defect; with
``fail_on_sync`` (default) the first one raises ``StreamViolation("host_sync")``, else it is
counted in ``syncs``. ``with m.device_region():`` marks code that stands in for device kernels
(the CPU worker's forward): its ops run on the current stream and its host reads are not syncs.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch

from .clock import HOST, Clock, Clocks, EmuEvent, EmuStream, merge
from .modes import CUDA, DispatchMode, FunctionMode
from .storage import Record, Storages, StreamViolation, site


class StreamModel:
    def __init__(self, *, fail_on_sync: bool = True, pending_queries: int = 1) -> None:
        self.fail_on_sync = fail_on_sync
        self.pending_queries = pending_queries
        self.clocks = Clocks()
        self.names: dict[int, str] = {HOST: "the host"}
        self.storages = Storages(self.names)
        self.clocks.default = self.new_stream("the default stream")
        self.device_depth = 0
        self.suspended = 0
        self.budgets: list[str] = []
        self.syncs: Counter[tuple[str, str]] = Counter()  # (budget or "", what) -> count
        self.sync_sites: dict[tuple[str, str], str] = {}
        self._ops = 0
        self._undo: list[Callable[[], None]] = []
        self._modes: list[Any] = []
        self.cuda = self._cuda_namespace()

    # ================================================================ streams
    def new_stream(self, name: str = "", priority: int = 0) -> EmuStream:
        s = EmuStream(self, name, priority)
        self.names[s.id] = s.name
        self.clocks.streams.append(s)
        return s

    def current_stream(self, device: Any = None) -> EmuStream:
        return self.clocks.current()

    @contextlib.contextmanager
    def stream(self, stream: EmuStream | None) -> Iterator[EmuStream | None]:
        with self.clocks.using(stream):
            yield stream

    def all_streams(self) -> Clock:
        clock: Clock = {}
        for s in self.clocks.streams:
            merge(clock, s.clock)
        return clock

    def synchronize(self, device: Any = None) -> None:
        self.host_sync("torch.cuda.synchronize()", self.all_streams())

    def _cuda_namespace(self) -> SimpleNamespace:
        """What replaces ``torch.cuda``'s stream API (and serves as SGLang's device module)."""
        model = self

        class Stream(EmuStream):
            def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
                super().__init__(model, "", priority)
                model.names[self.id] = self.name
                model.clocks.streams.append(self)

        class Event(EmuEvent):
            def __init__(self, **flags: Any) -> None:
                super().__init__(model, **flags)

        class StreamContext:
            def __init__(self, stream: EmuStream | None) -> None:
                self.stream = stream

            def __enter__(self) -> EmuStream | None:
                if self.stream is not None:
                    model.clocks.push(self.stream)
                return self.stream

            def __exit__(self, *exc: object) -> None:
                if self.stream is not None:
                    model.clocks.pop()

        return SimpleNamespace(
            Stream=Stream,
            Event=Event,
            StreamContext=StreamContext,
            stream=StreamContext,
            current_stream=self.current_stream,
            default_stream=lambda device=None: self.clocks.default,
            set_stream=self.clocks.set_current,
            synchronize=self.synchronize,
            is_current_stream_capturing=lambda: False,
        )

    # ================================================================ host knowledge
    def observe(self, clock: Clock) -> None:
        """The host learned that everything ``clock`` covers is complete (no wait)."""
        merge(self.clocks.host, clock)

    def host_sync(self, what: str, clock: Clock | None) -> None:
        """The host waits for the work ``clock`` covers (None: the current stream's)."""
        if clock is None:
            clock = self.clocks.current().clock
        budget = self.budgets[-1] if self.budgets else ""
        key = (budget, what)
        self.syncs[key] += 1
        if key not in self.sync_sites:
            self.sync_sites[key] = site()
        if budget and self.fail_on_sync:
            raise StreamViolation(
                "host_sync",
                f"{what} inside {budget!r}, where the host must not wait for the device "
                f"(at {site()})",
            )
        merge(self.clocks.host, clock)

    def host_operand(self, what: str, t: torch.Tensor) -> None:
        """A device op given host memory (on a GPU: an implicit pageable copy, or an error)."""
        if self.budgets:
            self.host_sync(f"a host tensor as an operand of {what} (an implicit copy)", None)

    def pinned(self, t: torch.Tensor) -> bool:
        rec = self.storages.get(t)
        return rec is not None and not rec.device and rec.pinned

    def check_frees(self) -> None:
        self._ops += 1
        if self.storages.watch:
            clocks = {s.id: s.clock for s in self.clocks.streams}
            weed = self._ops % 256 == 0
            self.storages.check_frees(clocks, self.clocks.host, weed=weed)
        if self._ops % 4096 == 0:
            self.storages.weed()

    def on_device_alloc(self, executor: int, what: str) -> None:
        """A device allocation on ``executor``: storages freed since are checked now (the
        caching allocator would reuse their memory here), with the clocks as they are now: a
        wait made between the free and this allocation orders the reuse."""
        self.check_frees()
        if self.storages.quarantine:
            clocks = {s.id: s.clock for s in self.clocks.streams}
            self.storages.check_reuse(executor, clocks, self.clocks.host, what)

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        rec = self.storages.get(t)
        if rec is not None and rec.device and isinstance(stream, EmuStream):
            if rec.recorded is None:
                rec.recorded = set()
            rec.recorded.add(stream.id)

    def residency(self, t: torch.Tensor) -> str:
        """ "device", "pinned" or "host" (tests)."""
        rec: Record | None = self.storages.get(t)
        if rec is None:
            return "host"
        return "device" if rec.device else ("pinned" if rec.pinned else "host")

    def adopt_device(self, *tensors: torch.Tensor) -> None:
        """Declare existing tensors device memory, written before any stream ran."""
        for t in tensors:
            self.storages.adopt(t, device=True, alloc=self.clocks.default.id)  # type: ignore[union-attr]

    # ================================================================ regions
    @contextlib.contextmanager
    def budget(self, name: str) -> Iterator[None]:
        self.budgets.append(name)
        try:
            yield
        finally:
            self.budgets.pop()

    @contextlib.contextmanager
    def device_region(self) -> Iterator[None]:
        self.device_depth += 1
        try:
            yield
        finally:
            self.device_depth -= 1

    @contextlib.contextmanager
    def suspend(self) -> Iterator[None]:
        self.suspended += 1
        try:
            yield
        finally:
            self.suspended -= 1

    def budget_syncs(self) -> dict[tuple[str, str], int]:
        """Host syncs counted inside budgets (with ``fail_on_sync=False``)."""
        return {k: v for k, v in self.syncs.items() if k[0]}

    # ================================================================ install
    def __enter__(self) -> StreamModel:
        from sglang_hybrid.store import device as store_device

        cuda = torch.cuda
        for name in (
            "Stream",
            "Event",
            "StreamContext",
            "stream",
            "current_stream",
            "default_stream",
            "set_stream",
            "synchronize",
            "is_current_stream_capturing",
        ):
            self._patch(cuda, name, getattr(self.cuda, name))
        model = self

        def record_stream(t: torch.Tensor, stream: Any) -> None:  # a method of Tensor
            model.record_stream(t, stream)

        self._patch(torch.Tensor, "record_stream", record_stream)
        previous = store_device.register_pool_device(
            lambda d: CUDA if torch.device(d).type == "cpu" else torch.device(d)
        )
        self._undo.append(lambda: self._unregister(previous))
        self._kernels_are_device_code()
        dispatch, function = DispatchMode(self), FunctionMode(self)
        dispatch.__enter__()
        function.__enter__()
        self._modes = [dispatch, function]
        return self

    def _kernels_are_device_code(self) -> None:
        """``sgl_kernel_ext``'s ops stand for CUDA kernels: on the CPU they run their torch
        references, whose host-side steps (a blocking move of an index) a GPU's kernel launch
        does not have. They run as device regions (on the current stream, no host sync)."""
        try:
            import sgl_kernel_ext as kx
        except ImportError:
            return
        model = self
        names = ("kv_blocks_to_staging", "staging_to_kv_blocks", "gather_conv_taps")
        for name in (*names, "gather_state_taps"):
            fn = getattr(kx, name, None)
            if fn is None:
                continue

            def region(*args: Any, _fn: Any = fn, **kwargs: Any) -> Any:
                with model.device_region():
                    return _fn(*args, **kwargs)

            self._patch(kx, name, region)

    @staticmethod
    def _unregister(previous: Callable[[Any], torch.device] | None) -> None:
        from sglang_hybrid.store import device as store_device

        store_device.register_pool_device(previous)

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        old = getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, old))

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(None, None, None)
        self._modes = []
        while self._undo:
            self._undo.pop()()


__all__ = ["StreamModel", "StreamViolation"]

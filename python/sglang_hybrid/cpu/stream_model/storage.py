"""Per-storage access records and the three ordering checks (see the package docstring).

A record is kept for every device storage (its residency decided at birth by ``modes.py``) and
for every host storage a stream has touched (a device-to-host copy's destination, a pinned
buffer an async copy reads). It holds the executor that allocated it, its last write and the
latest read of each executor since, and the streams ``record_stream`` named. Storages are keyed
by their ``StorageImpl`` address with a weak reference, so a freed storage is noticed (and a new
one at the same address is a new record).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .clock import HOST, Clock, covers


class StreamViolation(AssertionError):
    """A use of device memory or of the host that CUDA would not order (``kind``: ``race``,
    ``free``, ``host_sync``, ``numpy``)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"[{kind}] {message}")
        self.kind = kind


MAX_CELLS = 1 << 22


class Cells:
    """Per-cell last writes and reads of one large storage (a cell: a row of its innermost
    dimension), so two streams touching different slots of SGLang's pool buffers are not a race
    while the same slot is."""

    __slots__ = ("nbytes", "rsite", "rtick", "size", "wexec", "wsite", "wtick")

    def __init__(self, nbytes: int, size: int) -> None:
        self.size = size  # bytes per cell
        self.nbytes = nbytes
        n = -(-nbytes // size)
        self.wexec = np.full(n, -1, dtype=np.int32)
        self.wtick = np.zeros(n, dtype=np.int64)
        self.wsite: dict[int, str] = {}
        self.rtick: dict[int, np.ndarray] = {}
        self.rsite: dict[int, str] = {}

    def stale_write(self, where: np.ndarray | slice, executor: int, clock: Clock) -> int | None:
        """A writer other than ``executor`` of these cells not ordered before ``clock``."""
        we, wt = self.wexec[where], self.wtick[where]
        for w in np.unique(we):
            w = int(w)
            if w < 0 or w == executor:
                continue
            if bool((wt[we == w] > clock.get(w, 0)).any()):
                return w
        return None

    def pending_read(self, where: np.ndarray | slice, executor: int, clock: Clock) -> int | None:
        for r, ticks in self.rtick.items():
            if r != executor and bool((ticks[where] > clock.get(r, 0)).any()):
                return r
        return None

    def read(self, where: np.ndarray | slice, executor: int, tick: int, what: str) -> None:
        ticks = self.rtick.get(executor)
        if ticks is None:
            ticks = self.rtick[executor] = np.zeros(self.wexec.shape[0], dtype=np.int64)
        ticks[where] = tick
        self.rsite[executor] = what

    def write(self, where: np.ndarray | slice, executor: int, tick: int, what: str) -> None:
        self.wexec[where] = executor
        self.wtick[where] = tick
        self.wsite[executor] = what
        for ticks in self.rtick.values():
            ticks[where] = 0


@dataclass(slots=True, eq=False)
class Record:
    weak: StorageWeakRef
    device: bool  # device memory (else host memory a stream touched)
    pinned: bool
    alloc: int  # executor that allocated it (device memory: the caching allocator's stream)
    nbytes: int
    cells: Cells | None = None  # large storages: tracked per cell
    write: tuple[int, int] | None = None  # whole-storage tracking: the last write
    write_site: str = ""
    # whole-storage tracking: executor -> (tick, site) of its latest read since the last write
    reads: dict[int, tuple[int, str]] | None = None
    uses: dict[int, tuple[int, str]] = field(default_factory=dict)  # latest access (frees)
    recorded: set[int] | None = None  # streams named by record_stream


def cell_size(t: torch.Tensor, nbytes: int) -> int:
    """Bytes per cell for a storage first seen as ``t`` (0: track it whole). Small storages
    are one cell; a large one's cell is its finest row: the smallest stride (in bytes) of a
    dimension other than the last, so each slot of a pool buffer is its own cell(s)."""
    if nbytes < 16384:
        return 0
    es = t.element_size()
    rows = [st * es for sz, st in zip(t.shape[:-1], t.stride()[:-1]) if sz > 1 and st > 0]
    size = min(rows) if rows else 64
    size = max(size, es)
    while -(-nbytes // size) > MAX_CELLS:
        size *= 2
    return size


def site(skip: int = 3, depth: int = 4) -> str:
    """A short description of the Python frames outside torch and this package (for reports)."""
    frames = traceback.extract_stack()[: -skip or None]
    keep = [
        f for f in frames if "/torch/" not in f.filename and "/stream_model/" not in f.filename
    ][-depth:]
    return " <- ".join(
        f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in reversed(keep)
    )


def storage_key(t: torch.Tensor) -> tuple[int, torch.UntypedStorage]:
    s = t.untyped_storage()
    return s._cdata, s


class Storages:
    """The records and the checks. ``names(executor)`` is for messages only."""

    def __init__(self, names: dict[int, str]) -> None:
        self.records: dict[int, Record] = {}
        self.names = names
        # Device records with accesses by an executor other than their allocator's, which a
        # free must be checked against (weeded as they expire or become ordered).
        self.watch: dict[int, Record] = {}
        # Freed device records with uses still pending, by allocating executor: the next
        # allocation there fails (``check_reuse``) unless the uses became ordered.
        self.quarantine: dict[int, list[Record]] = {}

    def name(self, executor: int) -> str:
        return self.names.get(executor, f"executor {executor}")

    # ------------------------------------------------------------------ records
    def get(self, t: torch.Tensor) -> Record | None:
        key, _ = storage_key(t)
        rec = self.records.get(key)
        if rec is not None and rec.weak.expired():
            return None  # freed; ``check_frees`` reports it (a new storage may sit there now)
        return rec

    def adopt(self, t: torch.Tensor, *, device: bool, alloc: int, pinned: bool = False) -> Record:
        """The record of ``t``'s storage, made with this residency if it has none yet."""
        key, s = storage_key(t)
        rec = self.records.get(key)
        if rec is None or rec.weak.expired():
            if rec is not None:
                self.retire(key, rec)
            nbytes = s.nbytes()
            size = cell_size(t, nbytes)
            cells = Cells(nbytes, size) if size else None
            rec = Record(StorageWeakRef(s), device, pinned, alloc, nbytes, cells)
            self.records[key] = rec
        return rec

    def retire(self, key: int, rec: Record) -> None:
        if self.records.get(key) is rec:
            del self.records[key]
        self.watch.pop(key, None)

    # ------------------------------------------------------------------ accesses
    def read(
        self,
        rec: Record,
        executor: int,
        tick: int,
        clock: Clock,
        what: str,
        where: np.ndarray | slice | None = None,
    ) -> None:
        """``executor`` reads ``rec`` (``where``: the cells, for a tracked-per-cell storage)."""
        c = rec.cells
        at = slice(None) if where is None else where
        self._check_raw(rec, executor, clock, what, at)
        if c is not None:
            c.read(at, executor, tick, what)
        else:
            if rec.reads is None:
                rec.reads = {}
            rec.reads[executor] = (tick, what)
        self._use(rec, executor, tick, what)

    def _check_raw(
        self, rec: Record, executor: int, clock: Clock, what: str, at: np.ndarray | slice
    ) -> None:
        """Read-after-write: the last write to the accessed cells (or the storage) on another
        executor must be ordered before this access."""
        c = rec.cells
        if c is not None:
            w = c.stale_write(at, executor, clock)
            if w is not None:
                self._race_raw(executor, w, c.wsite.get(w, "?"), what)
        elif rec.write is not None:
            w, t = rec.write
            if w != executor and not covers(clock, w, t):
                self._race_raw(executor, w, rec.write_site, what)

    def write(
        self,
        rec: Record,
        executor: int,
        tick: int,
        clock: Clock,
        what: str,
        where: np.ndarray | slice | None = None,
    ) -> None:
        c = rec.cells
        at = slice(None) if where is None else where
        self._check_raw(rec, executor, clock, what, at)
        if c is not None:
            r = c.pending_read(at, executor, clock)
            if r is not None:
                self._race_war(executor, r, c.rsite.get(r, "?"), what)
            c.write(at, executor, tick, what)
        else:
            for r, (t, where_read) in (rec.reads or {}).items():
                if r != executor and not covers(clock, r, t):
                    self._race_war(executor, r, where_read, what)
            rec.write = (executor, tick)
            rec.write_site = what
            rec.reads = None
        self._use(rec, executor, tick, what)

    def _race_raw(self, executor: int, writer: int, write_site: str, what: str) -> None:
        raise StreamViolation(
            "race",
            f"{what} on {self.name(executor)} uses memory written on {self.name(writer)} "
            f"({write_site}) with nothing ordering that write first (no wait_stream, "
            "wait_event or host synchronize)",
        )

    def _race_war(self, executor: int, reader: int, read_site: str, what: str) -> None:
        raise StreamViolation(
            "race",
            f"{what} writes on {self.name(executor)} memory that {self.name(reader)} may "
            f"still be reading ({read_site}); no wait orders the write after the read",
        )

    def _use(self, rec: Record, executor: int, tick: int, what: str) -> None:
        rec.uses[executor] = (tick, what)
        if rec.device and executor != rec.alloc and executor != HOST:
            self.watch[rec.weak.cdata] = rec

    # ------------------------------------------------------------------ frees
    def _pending(
        self, rec: Record, clocks: dict[int, Clock], host: Clock
    ) -> list[tuple[int, int, str]]:
        """Uses of ``rec`` by streams other than its allocator's that neither its allocating
        stream nor the host is ordered after, and that ``record_stream`` did not name."""
        alloc_clock = clocks.get(rec.alloc, host)
        return [
            (e, t, where_used)
            for e, (t, where_used) in rec.uses.items()
            if e != rec.alloc
            and e != HOST
            and (rec.recorded is None or e not in rec.recorded)
            and not covers(alloc_clock, e, t)
            and not covers(host, e, t)
        ]

    def check_frees(self, clocks: dict[int, Clock], host: Clock, *, weed: bool = False) -> None:
        """Freed device storages that another stream may still use go to quarantine on their
        allocating stream (the caching allocator would hand the memory to that stream's next
        allocation); with ``weed``, live records that became safe leave the watch."""
        for key, rec in list(self.watch.items()):
            if not rec.weak.expired():
                if weed and not self._pending(rec, clocks, host):
                    del self.watch[key]
                continue
            self.retire(key, rec)
            if self._pending(rec, clocks, host):
                self.quarantine.setdefault(rec.alloc, []).append(rec)

    def check_reuse(self, executor: int, clocks: dict[int, Clock], host: Clock, what: str) -> None:
        """A new device allocation on ``executor``: it may reuse quarantined memory."""
        held = self.quarantine.get(executor)
        if not held:
            return
        still = [(rec, p) for rec in held if (p := self._pending(rec, clocks, host))]
        if not still:
            del self.quarantine[executor]
            return
        rec, pending = still[0]
        e, _, where = pending[0]
        del self.quarantine[executor]
        raise StreamViolation(
            "free",
            f"a {rec.nbytes}-byte device tensor allocated on {self.name(rec.alloc)} was freed "
            f"while {self.name(e)} may still use it ({where}), and {what} on "
            f"{self.name(rec.alloc)} may now reuse its memory; record_stream({self.name(e)}) "
            "or keeping it alive until that use is ordered is missing",
        )

    def weed(self) -> None:
        """Forget the records of freed storages (bounded memory over a long run)."""
        for key, rec in list(self.records.items()):
            if rec.weak.expired() and key not in self.watch:
                del self.records[key]

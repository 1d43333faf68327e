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

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .clock import HOST, Clock, covers


class StreamViolation(AssertionError):
    """A use of device memory or of the host that CUDA would not order (``kind``: ``race``,
    ``free``, ``host_sync``, ``numpy``)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"[{kind}] {message}")
        self.kind = kind


@dataclass(slots=True, eq=False)
class Record:
    weak: StorageWeakRef
    device: bool  # device memory (else host memory a stream touched)
    pinned: bool
    alloc: int  # executor that allocated it (device memory: the caching allocator's stream)
    nbytes: int
    write: tuple[int, int] | None = None  # (executor, tick) of the last write
    write_site: str = ""
    reads: dict[int, int] = field(default_factory=dict)  # executor -> tick of its latest read
    read_sites: dict[int, str] = field(default_factory=dict)
    recorded: set[int] = field(default_factory=set)  # record_stream


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
            rec = Record(StorageWeakRef(s), device, pinned, alloc, s.nbytes())
            self.records[key] = rec
        return rec

    def retire(self, key: int, rec: Record) -> None:
        if self.records.get(key) is rec:
            del self.records[key]
        self.watch.pop(key, None)

    # ------------------------------------------------------------------ accesses
    def read(self, rec: Record, executor: int, tick: int, clock: Clock, what: str) -> None:
        self._raw(rec, executor, clock, what)
        if rec.reads.get(executor, 0) < tick:
            rec.reads[executor] = tick
            rec.read_sites[executor] = what
        self._maybe_watch(rec, executor)

    def write(self, rec: Record, executor: int, tick: int, clock: Clock, what: str) -> None:
        self._raw(rec, executor, clock, what)
        for r, t in rec.reads.items():
            if r != executor and not covers(clock, r, t):
                raise StreamViolation(
                    "race",
                    f"{what} writes on {self.name(executor)} memory that "
                    f"{self.name(r)} may still be reading ({rec.read_sites.get(r, '?')}); "
                    "no wait orders the write after the read",
                )
        rec.write = (executor, tick)
        rec.write_site = what
        rec.reads = {}
        rec.read_sites = {}
        self._maybe_watch(rec, executor)

    def _raw(self, rec: Record, executor: int, clock: Clock, what: str) -> None:
        if rec.write is None:
            return
        w, t = rec.write
        if w != executor and not covers(clock, w, t):
            raise StreamViolation(
                "race",
                f"{what} on {self.name(executor)} uses memory written on {self.name(w)} "
                f"({rec.write_site}) with nothing ordering that write first (no wait_stream, "
                "wait_event or host synchronize)",
            )

    def _maybe_watch(self, rec: Record, executor: int) -> None:
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
            (e, t, rec.read_sites.get(e, rec.write_site))
            for e, t in self._uses(rec)
            if e != rec.alloc
            and e != HOST
            and e not in rec.recorded
            and not covers(alloc_clock, e, t)
            and not covers(host, e, t)
        ]

    def check_frees(self, clocks: dict[int, Clock], host: Clock) -> None:
        """Freed device storages that another stream may still use go to quarantine on their
        allocating stream (the caching allocator would hand the memory to that stream's next
        allocation); live records that became safe leave the watch."""
        for key, rec in list(self.watch.items()):
            pending = self._pending(rec, clocks, host)
            if not rec.weak.expired():
                if not pending:
                    del self.watch[key]
                continue
            self.retire(key, rec)
            if pending:
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

    @staticmethod
    def _uses(rec: Record) -> list[tuple[int, int]]:
        uses = list(rec.reads.items())
        if rec.write is not None:
            uses.append(rec.write)
        return uses

    def weed(self) -> None:
        """Forget the records of freed storages (bounded memory over a long run)."""
        for key, rec in list(self.records.items()):
            if rec.weak.expired() and key not in self.watch:
                del self.records[key]

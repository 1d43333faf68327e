"""Every TP rank decides the same: a per-pass record of the cache's decisions and its digest.

Each TP rank runs its own scheduler and its own cache over its shard of the pools; SGLang keeps
them in step by construction (rank 0 broadcasts the requests, every rank schedules them the same
way) and all-reduces the few facts that depend on timing. So no cache decision may depend on
``id()``, addresses, the wall clock, the iteration order of sets of non-ints or per-process hash
seeds: one rank holding a request another admits would hang the collectives or mix batches.

``PassRecord`` is what a pass decided, read after ``Scheduler.get_next_batch_to_run``: the batch
(request ids with their cached prefix and extend lengths), the requests coalescing held out, and
the cache's cumulative decision counters (taps, endpoints, slot and tail skips, evictions by
kind, host sweeps) with its device occupancy. ``RankCheck`` chains the records into a 63-bit
xxh3 digest; with ``--hybrid-check-ranks`` it MIN- and MAX-all-reduces the digest over the TP
group's CPU (gloo) group every pass and raises :class:`RankDivergence`, which stops the
scheduler and the server, on the first pass where ranks differ.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch
import xxhash

logger = logging.getLogger(__name__)
MASK63 = (1 << 63) - 1


class RankDivergence(RuntimeError):
    pass


def dp_rank() -> int | None:
    """This scheduler's rank under plain data parallelism (``--dp-size``); None without it."""
    from sglang.srt.runtime_context import get_parallel

    rank = get_parallel().dp_rank
    return int(rank) if rank is not None else None


class PassRecord(NamedTuple):
    mode: str  # the batch's forward mode ("" when nothing ran)
    batch: tuple[tuple[str, int, int], ...]  # (rid, prefix_len, extend_len)
    held: tuple[str, ...]  # held out of the pass by coalescing
    counters: tuple[int, ...]  # the cache's cumulative decisions and occupancy


def pass_record(scheduler: Any, batch: Any) -> PassRecord:
    cache = scheduler.tree_cache
    reqs = tuple(getattr(batch, "reqs", None) or ()) if batch is not None else ()
    mode = str(getattr(getattr(batch, "forward_mode", None), "name", "")) if reqs else ""
    rows = tuple(
        (r.rid, int(r.prefix_len or 0), int(getattr(r, "extend_input_len", 0) or 0)) for r in reqs
    )
    coalescer = getattr(cache, "coalescer", None)
    held = coalescer.take_held() if coalescer is not None else ()
    return PassRecord(mode, rows, held, cache.decision_counters())


def chain(prev: int, record: PassRecord) -> int:
    """The digest after ``record`` (``repr`` of ints and strs is stable across processes)."""
    return xxhash.xxh3_64_intdigest(repr(record).encode(), seed=prev) & MASK63


class RankCheck:
    """Per-pass digest of the cache's decisions; compared across the TP group when asked."""

    def __init__(self, group: Any = None, *, keep: bool = False) -> None:
        self.group = group
        self.world = 1
        if group is not None:
            import torch.distributed as dist

            self.world = dist.get_world_size(group)
        self.keep = keep
        self.digest = 0
        self.passes = 0
        self.records: list[PassRecord] = []

    def after_pass(self, scheduler: Any, batch: Any) -> None:
        record = pass_record(scheduler, batch)
        self.digest = chain(self.digest, record)
        self.passes += 1
        if self.keep:
            self.records.append(record)
        if self.group is not None and self.world > 1:
            lo, hi = all_reduce_range(self.digest, self.group)
            if lo != hi:
                raise RankDivergence(
                    f"--hybrid-check-ranks: TP ranks took different cache decisions at "
                    f"scheduler pass {self.passes} (digests {lo:#x} .. {hi:#x}); this rank "
                    f"decided {record}. Stopping: the ranks' batches no longer match."
                )


def all_reduce_range(value: int, group: Any) -> tuple[int, int]:
    """(min, max) of ``value`` over ``group``: one all-reduce of [v, -v] with MIN."""
    import torch.distributed as dist

    t = torch.tensor([value, -value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t[0]), -int(t[1])

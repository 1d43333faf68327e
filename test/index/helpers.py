"""Small drivers for index tests: fake device handles and one-call request lifecycles."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sglang_hybrid.index import (
    CacheConfig,
    CostModel,
    PrefixIndex,
    PromptKey,
    Snapshot,
    SnapshotKind,
)

# Costs in "token seconds": C(s) is the number of tokens a snapshot saves from its ancestor.
UNIT_COST = CostModel(
    token_s=1.0, pair_s=0.0, chunk_s=0.0, chunk_tokens=1 << 30, h2d_bytes_per_s=1e30, batch_s=0.0
)


def make_index(
    *,
    host_slabs: int = 0,
    slots: int = 4,
    image_bytes: int = 1000,
    slab_bytes: int = 100,
    taps: int = 8,
    ladder: int = 4096,
    min_gap: int = 1024,
    cost: CostModel = UNIT_COST,
    host_order: str = "duel",
    host_exclusive: bool = False,
    chunk: int = 256,
    concurrency: int = 4,
) -> PrefixIndex:
    cfg = CacheConfig(
        host_cache_bytes=host_slabs * slab_bytes,
        device_snapshot_slots=slots,
        taps_per_request=taps,
        tap_ladder_tokens=ladder,
        tap_min_gap_tokens=min_gap,
        chunk_tokens=chunk,
        concurrency=concurrency,
        host_order=host_order,
        host_exclusive=host_exclusive,
    )
    return PrefixIndex(cfg, image_bytes=image_bytes, slab_bytes=slab_bytes, cost=cost)


class Device:
    """Hands out fake device handles and checks the index frees each exactly once."""

    def __init__(self) -> None:
        self.next = 0
        self.live: set[int] = set()

    def new(self) -> int:
        self.next += 1
        self.live.add(self.next)
        return self.next

    def collect(self, index: PrefixIndex) -> int:
        freed = 0
        for handle, tokens in index.drain_freed_device():
            assert handle in self.live, f"handle {handle} freed twice or never given"
            self.live.remove(handle)
            freed += tokens
        return freed


def key(ids: Iterable[int], **kw: object) -> PromptKey:
    return PromptKey.from_ids(list(ids), **kw)


def run(
    index: PrefixIndex,
    dev: Device,
    ids: Sequence[int],
    *,
    taps: Iterable[int] = (),
    endpoint: bool = True,
    write: bool = True,
    source: str = "best",
    kind: SnapshotKind = SnapshotKind.TAP,
    page: int = 1,
    origin: int = 0,
) -> list[Snapshot]:
    """One request: match, resume from s*, commit all, publish taps and the endpoint, release.

    Returns the snapshots it published (duplicates and skipped ones omitted). A tail occupies
    whole pages of ``page`` tokens on the device.
    """
    k = key(ids)
    m = index.match(k)
    src = m.best if source == "best" else m.best_device if source == "device" else None
    lane = index.open_lane(m, src)
    index.unpin_sources(lane)
    index.commit(lane, k, len(ids), lambda b: dev.new())
    out: list[Snapshot] = []
    for p in sorted(taps):
        slot = index.reserve_slot(lane, p, kind)
        if slot is None:
            continue
        tail = dev.new() if p % 64 else None  # an exact tap inside a block carries its tail
        s = index.publish(
            lane,
            k,
            p,
            slot,
            kind,
            origin=origin,
            tail_device=tail,
            tail_device_tokens=-(-(p % 64) // page) * page,
        )
        if s is not None:
            out.append(s)
        elif tail is not None:
            dev.live.discard(tail)
    f = len(ids)
    if endpoint and (slot := index.reserve_slot(lane, f, SnapshotKind.ENDPOINT)) is not None:
        tail = dev.new() if f % 64 else None
        s = index.publish(
            lane,
            k,
            f,
            slot,
            SnapshotKind.ENDPOINT,
            tail_device=tail,
            tail_device_tokens=-(-(f % 64) // page) * page,
        )
        if s is not None:
            out.append(s)
        elif tail is not None:
            dev.live.discard(tail)  # a duplicate leaves the tail with the caller
    if write and index.host is not None:
        w = index.transfers.plan_writes(lane)
        index.transfers.complete_writes(w)
        for s in out:
            if s.id in index.snapshots and index.transfers.plan_image_write(s) is not None:
                index.transfers.complete_image_write(s)
    index.release(lane)
    dev.collect(index)
    index.check_integrity()
    return out

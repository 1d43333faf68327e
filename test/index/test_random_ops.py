"""Seeded random operations on the index with the invariant checker after every step (§10).

Requests extend, repeat, retry and diverge from earlier prompts; lanes run concurrently and commit
in uneven chunks; taps, endpoints, cancels and disabled requests mix with device pressure, host
pressure, restores and lost last copies. ``--index-ops N`` sets the length (20,000 by default).
"""

from __future__ import annotations

import random

import pytest
from helpers import Device, make_index

from sglang_hybrid.index import (
    BlockNode,
    PromptKey,
    Residency,
    SnapshotKind,
    check_integrity,
    quote,
)
from sglang_hybrid.index.host_eviction import make_room


class World:
    def __init__(self, seed: int, *, exclusive: bool = False) -> None:
        self.rng = random.Random(seed)
        self.idx = make_index(
            host_slabs=90, slots=4, image_bytes=700, slab_bytes=100, host_exclusive=exclusive
        )
        self.dev = Device()
        self.prompts: list[list[int]] = []
        self.lanes: list[dict] = []  # {lane, key, done, n, fills}
        self.demotions: list[list[tuple[BlockNode, int]]] = []  # copies in flight, oldest first

    # ------------------------------------------------------------ prompts
    def prompt(self) -> list[int]:
        r = self.rng
        if not self.prompts or r.random() < 0.15:
            p = [r.randrange(1, 50) for _ in range(r.randrange(1, 600))]
        else:
            old = r.choice(self.prompts)
            mode = r.random()
            if mode < 0.4:  # next turn: extend
                p = old + [r.randrange(1, 50) for _ in range(r.randrange(1, 200))]
            elif mode < 0.7:  # diverge somewhere
                cut = r.randrange(0, len(old) + 1)
                p = old[:cut] + [r.randrange(50, 99) for _ in range(r.randrange(1, 150))]
            else:  # retry
                p = old[:]
        p = p[:800]
        self.prompts.append(p)
        if len(self.prompts) > 40:
            self.prompts.pop(0)
        return p

    # ------------------------------------------------------------ operations
    def start(self) -> None:
        if len(self.lanes) >= 3:
            return
        ids = self.prompt()
        key = PromptKey.from_ids(ids)
        idx, r = self.idx, self.rng
        m = idx.match(key)
        idx.touch(m)
        src = r.choice([m.best, m.best_device, None, m.best])
        q = quote(idx, m, request_tokens=len(ids) + 32, free_tokens=1 << 20, pool_tokens=1 << 21)
        assert q.candidates[-1].snapshot is None
        enabled = r.random() > 0.1
        lane = idx.open_lane(m, src, enabled=enabled)
        fills = []
        if src is not None:
            for node in lane.path:
                if node.device_state is Residency.ABSENT:
                    idx.transfers.begin_node_fill(node, self.dev.new())
                    fills.append(node)
            if src.tail and src.tail_device_state is Residency.ABSENT:
                idx.transfers.begin_tail_fill(src, self.dev.new(), len(src.tail) // 4)
                fills.append(src)
        done = src.frontier if src is not None else 0
        taps = [t.position for t in idx.plan_taps(key, m, src)] if enabled else []
        self.lanes.append(dict(lane=lane, key=key, done=done, n=len(ids), fills=fills, taps=taps))

    def advance(self) -> None:
        if not self.lanes:
            return
        st = self.rng.choice(self.lanes)
        idx, lane, key = self.idx, st["lane"], st["key"]
        for f in st["fills"]:
            if isinstance(f, BlockNode):
                idx.transfers.finish_node_fill(f)
            else:
                idx.transfers.finish_tail_fill(f)
        st["fills"] = []
        idx.unpin_sources(lane)
        new = min(st["n"], st["done"] + self.rng.randrange(1, 300))
        idx.commit(lane, key, new, lambda b: self.dev.new())
        st["done"] = new
        # A commit stops before a block another lane's restore is still filling; a snapshot
        # needs every block below it committed, so the binding skips those (publish._committed).
        committed = 64 * len(lane.path) + 63
        for p in [t for t in st["taps"] if t <= new]:
            st["taps"].remove(p)
            if p > committed:
                continue
            kind = self.rng.choice([SnapshotKind.TAP, SnapshotKind.BOUNDARY])
            slot = idx.reserve_slot(lane, p, kind)
            if slot is not None:
                tail = self.dev.new() if p % 64 else None  # an exact tap inside a block
                s = idx.publish(
                    lane, key, p, slot, kind, tail_device=tail, tail_device_tokens=p % 64
                )
                if s is None and tail is not None:
                    self.dev.live.discard(tail)  # a duplicate leaves the tail with the caller
                wants_host = s is not None and self.rng.random() < 0.7
                if wants_host and idx.transfers.plan_image_write(s) is not None:
                    idx.transfers.complete_image_write(s)
        if new == st["n"] or self.rng.random() < 0.05:
            self.finish(st, cancelled=new < st["n"])

    def finish(self, st: dict, *, cancelled: bool) -> None:
        idx, lane, key, f = self.idx, st["lane"], st["key"], st["done"]
        if lane.enabled and f >= 64 and f // 64 <= len(lane.path) and self.rng.random() < 0.9:
            slot = idx.reserve_slot(lane, f, SnapshotKind.ENDPOINT)
            if slot is not None:
                tail = self.dev.new() if f % 64 else None
                s = idx.publish(
                    lane,
                    key,
                    f,
                    slot,
                    SnapshotKind.ENDPOINT,
                    tail_device=tail,
                    tail_device_tokens=f % 64,
                )
                if s is None and tail is not None:
                    self.dev.live.discard(tail)  # a duplicate leaves the tail with the caller
                if s is not None and idx.transfers.plan_image_write(s) is not None:
                    idx.transfers.complete_image_write(s)
        if self.rng.random() < 0.8:
            idx.transfers.complete_writes(idx.transfers.plan_writes(lane))
        for fl in st["fills"]:
            if isinstance(fl, BlockNode):
                idx.transfers.finish_node_fill(fl)
            else:
                idx.transfers.finish_tail_fill(fl)
        idx.release(lane)
        self.lanes.remove(st)

    def device_pressure(self) -> None:
        self.idx.evict_device(self.rng.randrange(1, 600))

    def host_pressure(self) -> None:
        if self.idx.host is not None:
            make_room(self.idx, self.rng.randrange(1, 40))

    def demote(self) -> None:
        """An exclusive host's demotions: issued, then landed or failed some steps later (the
        blocks meanwhile exposed to every other operation, deletion of their subtree included)."""
        r = self.rng.random()
        if r < 0.5 or not self.demotions:
            tick = self.idx.tick
            planned = self.idx.transfers.plan_demotions()
            if planned:
                self.demotions.append((planned, tick))
        elif r < 0.95:
            self.idx.transfers.complete_demotions(*self.demotions.pop(0))
        else:
            self.idx.transfers.abort_demotions(*self.demotions.pop(0))

    def lose_copy(self) -> None:
        """Drop the host copy of a random unpinned node (its subtree goes when it was the last)."""
        idx = self.idx
        cands = [
            n for n in list(idx.dead) + [e for e in idx.lru.backed if isinstance(e, BlockNode)]
        ]
        if cands:
            n = self.rng.choice(cands)
            if n.parent is not None and n.host_state is Residency.RESIDENT:
                idx.drop_node_host(n)

    def step(self) -> None:
        r = self.rng.random()
        if r < 0.25:
            self.start()
        elif r < 0.80:
            self.advance()
        elif r < 0.90:
            self.device_pressure()
        elif r < 0.95:
            self.host_pressure()
        elif r < 0.97:
            self.demote()
        else:
            self.lose_copy()
        self.dev.collect(self.idx)
        check_integrity(self.idx)


@pytest.mark.parametrize("seed,exclusive", [(0, False), (1, False), (2, True)])
def test_random_operations_keep_every_invariant(seed: int, exclusive: bool, request) -> None:
    ops = request.config.getoption("--index-ops") // 2
    w = World(seed, exclusive=exclusive)
    for _ in range(ops):
        w.step()
    while w.lanes:
        w.finish(w.lanes[0], cancelled=True)
    while w.demotions:
        w.idx.transfers.complete_demotions(*w.demotions.pop(0))
    w.dev.collect(w.idx)
    check_integrity(w.idx)
    idx = w.idx
    assert not idx.lanes and all(
        n.active_refs == 0 for n in idx.tree.subtree_postorder(idx.tree.root)
    )
    assert idx.protected_tokens == 0  # nothing pinned once every lane is gone
    # Everything the index still holds on the device is evictable, and evicting it all frees
    # exactly the handles it was given.
    idx.evict_device(1 << 30)
    w.dev.collect(idx)
    assert idx.device_tokens == 0 and not w.dev.live
    stats = idx.stats
    assert stats.taps_published and stats.endpoints_published and stats.host_gdsf_evicted
    assert stats.device_evicted_unbacked and stats.subtree_deletions and stats.host_dead_swept
    # Without an exclusive host nothing demotes and no duplicate is given up.
    assert bool(stats.blocks_demoted) == exclusive
    assert bool(stats.host_duplicates_dropped) == exclusive

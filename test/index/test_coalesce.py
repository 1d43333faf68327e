"""In-flight prefix coalescing decisions (spec §12.2) and the waiting queue's prefix demand."""

from __future__ import annotations

import random

from helpers import Device, make_index, run

from sglang_hybrid.index import CostModel, PromptKey
from sglang_hybrid.index.coalesce import InflightPrefixes, PrefixDemand, coalesce_target
from sglang_hybrid.index.valuation import Valuer

rng = random.Random(3)


def toks(n: int) -> list[int]:
    return [rng.randrange(10, 5000) for _ in range(n)]


def key(ids: list[int], **kw: object) -> PromptKey:
    return PromptKey.from_ids(ids, **kw)


def test_the_earliest_deepest_sibling_is_found() -> None:
    base = toks(640)
    a, b = key(base[:300] + toks(100)), key(base + toks(10))
    inflight: InflightPrefixes[str] = InflightPrefixes()
    inflight.add("a", "a", a)
    inflight.add("b", "b", b)
    sib = inflight.sibling(key(base[:600] + toks(90)))
    assert sib is not None and sib.owner == "b" and sib.shared == 576  # 9 full blocks
    sib = inflight.sibling(key(base[:250] + toks(90)))
    assert sib is not None and sib.owner == "a" and sib.shared == 192  # a came first
    assert inflight.sibling(key(toks(500))) is None
    assert inflight.sibling(key(base[:63])) is None  # no full block


def test_sibling_is_the_earliest_deepest_sharer_by_brute_force() -> None:
    """``add`` enters only the blocks no earlier prompt holds; every lookup still finds the
    earliest prompt sharing the most full blocks, as comparing tokens one by one does."""
    r = random.Random(11)
    trunks = [[r.randrange(10, 5000) for _ in range(64 * 12)] for _ in range(3)]

    def prompt() -> list[int]:
        t = r.choice(trunks)
        return t[: r.randrange(0, len(t))] + [
            r.randrange(10, 5000) for _ in range(r.randrange(200))
        ]

    def full_shared(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n - n % 64

    inflight: InflightPrefixes[int] = InflightPrefixes()
    earlier: list[list[int]] = []
    for i in range(150):
        ids = prompt()
        sib = inflight.sibling(key(ids))
        best = max((full_shared(ids, e), -j) for j, e in enumerate(earlier)) if earlier else (0, 0)
        if best[0] == 0:
            assert sib is None
        else:
            assert sib is not None and (sib.shared, sib.owner) == (best[0], -best[1])
        inflight.add(i, i, key(ids))
        earlier.append(ids)


def test_a_reused_index_answers_as_a_fresh_one() -> None:
    """Walks over changing windows (owners kept, dropped, inserted, reordered) on one index give
    the same siblings as an index built fresh for each walk."""
    wrng = random.Random(11)
    base = toks(2000)
    prompts = [
        key(base[: wrng.randrange(0, 2000)] + toks(wrng.randrange(1, 300))) for _ in range(40)
    ]
    reused: InflightPrefixes[int] = InflightPrefixes()
    window = list(range(6))
    for _ in range(300):
        op = wrng.random()
        if op < 0.3 and window:
            window.pop(wrng.randrange(len(window)))
        elif op < 0.6:
            window.insert(wrng.randrange(len(window) + 1), wrng.randrange(len(prompts)))
        elif op < 0.7 and len(window) > 1:
            i = wrng.randrange(len(window) - 1)
            window[i], window[i + 1] = window[i + 1], window[i]
        fresh: InflightPrefixes[int] = InflightPrefixes()
        reused.begin()
        for pos, p in enumerate(window):
            a, b = fresh.sibling(prompts[p]), reused.sibling(prompts[p])
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                assert (a.owner, a.shared) == (b.owner, b.shared)
            if wrng.random() < 0.8:  # some are held, so not entered
                fresh.add((pos, p), p, prompts[p])
                reused.add((pos, p), p, prompts[p])


def test_an_index_whose_window_head_leaves_answers_as_a_fresh_one() -> None:
    """Walks keyed by request ids over a queue like SGLang's (heads admitted, arrivals at the end,
    now and then one leaving from the middle or one put in front): the reused index, which keeps
    the entries behind a departed head, gives the same siblings as one built fresh per walk."""
    wrng = random.Random(5)
    trunks = [toks(1500) for _ in range(3)]
    prompts: dict[int, PromptKey] = {}

    def arrive() -> int:
        rid = len(prompts)
        t = wrng.choice(trunks)
        prompts[rid] = key(t[: wrng.randrange(0, 1500)] + toks(wrng.randrange(1, 200)))
        return rid

    reused: InflightPrefixes[int] = InflightPrefixes()
    queue = [arrive() for _ in range(8)]
    left = 0
    for _ in range(400):
        op = wrng.random()
        if op < 0.45 and queue:
            del queue[: wrng.randrange(1, 4)]  # the head (and maybe more) admitted
            left += 1
        elif op < 0.55 and len(queue) > 2:
            queue.pop(wrng.randrange(1, len(queue)))  # an abort
        elif op < 0.6:
            queue.insert(0, arrive())  # a retracted request back in front
        for _ in range(wrng.randrange(0, 3)):
            queue.append(arrive())
        fresh: InflightPrefixes[int] = InflightPrefixes()
        reused.begin()
        for rid in queue[:12]:  # the admission window
            a, b = fresh.sibling(prompts[rid]), reused.sibling(prompts[rid])
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                assert (a.owner, a.shared) == (b.owner, b.shared)
            if wrng.random() < 0.85:  # some are held, so not entered
                fresh.add(rid, rid, prompts[rid])
                reused.add(rid, rid, prompts[rid])
    assert left > 100


def test_a_hash_collision_is_never_trusted() -> None:
    def constant(data: bytes, prev: int) -> int:  # every block collides
        return 42

    inflight: InflightPrefixes[str] = InflightPrefixes()
    inflight.add("a", "a", key(toks(256), hash_fn=constant))
    assert inflight.sibling(key(toks(256), hash_fn=constant)) is None
    same = toks(256)
    inflight.add("b", "b", key(same, hash_fn=constant))
    # "a" holds every hash first, and its bytes differ: a collision, so no sibling at all.
    assert inflight.sibling(key(same, hash_fn=constant)) is None


def test_demand_counts_other_waiting_prompts() -> None:
    base = toks(1000)
    demand: PrefixDemand[str] = PrefixDemand()
    keys = {f"r{i}": key(base[: 400 + 200 * i] + toks(30)) for i in range(3)}
    for rid, k in keys.items():
        demand.add(rid, k)
    # r0 shares 384 tokens (6 full blocks of its 400) with r1 and r2.
    assert demand.shared(keys["r0"], self_counted=True) == (384, 2)
    # r2 shares 576 with r1 only (r1 holds 600 of the base: 9 full blocks).
    assert demand.shared(keys["r2"], self_counted=True) == (576, 1)
    demand.discard("r1")
    assert demand.shared(keys["r2"], self_counted=True) == (384, 1)
    assert demand.shared(key(base[:500]), self_counted=False) == (448, 1)  # r2 holds 7 blocks
    demand.discard("r0")
    demand.discard("r2")
    demand.discard("r2")  # idempotent
    assert len(demand) == 0 and demand.shared(keys["r2"], self_counted=False) == (0, 0)
    assert not demand._added and not demand._removed  # the drained queue holds no counts


def test_demand_counts_equal_a_plain_multiset_through_folds() -> None:
    """Many arrivals and departures (folds of the removed counts included) keep every count
    equal to a recount of the prompts still waiting, and zero counts never pile up."""
    rng = random.Random(7)
    base = toks(4000)
    prompts = {  # a shared document, then a private part of up to ~10 blocks
        f"r{i}": key(base[: rng.randrange(0, 4000)] + toks(rng.randrange(1, 640)))
        for i in range(300)
    }
    demand: PrefixDemand[str] = PrefixDemand(fold_slack=0)  # fold as often as the rule allows
    waiting: set[str] = set()
    order = sorted(prompts)
    for step in range(2000):
        rid = rng.choice(order) if len(waiting) < 8 else rng.choice(sorted(waiting))
        if rid in waiting:
            demand.discard(rid)
            waiting.discard(rid)
        else:
            demand.add(rid, prompts[rid])
            waiting.add(rid)
        if step % 97 == 0:
            recount: dict[int, int] = {}
            for r in waiting:
                k = prompts[r]
                for h in k.hashes[: k.full_blocks]:
                    recount[h] = recount.get(h, 0) + 1
            every = {h for k in prompts.values() for h in k.ensure_hashes(k.full_blocks)}
            assert all(demand.count(h) == recount.get(h, 0) for h in every)
            live_blocks = sum(prompts[r].full_blocks for r in waiting)
            zero = sum(1 for h in demand._added if demand.count(h) == 0)
            assert zero <= live_blocks  # folds bound what is kept for prompts that left


def test_the_target_rules() -> None:
    cost = CostModel()
    args = dict(n=1100, sibling_n=2000, sibling_done=0, servable=0, cost=cost)
    assert coalesce_target(1000, **args) == 960  # floored to the block grid
    assert coalesce_target(1000, **{**args, "n": 900}) == 896  # at most n - 1
    assert coalesce_target(1000, **{**args, "sibling_n": 961}) == 960
    assert coalesce_target(1000, **{**args, "sibling_n": 960}) == 896  # the sibling's n - 1
    assert coalesce_target(1000, **{**args, "servable": 960}) is None  # nothing to gain
    assert coalesce_target(1000, **{**args, "sibling_done": 1024}) is None  # sibling passed it
    assert coalesce_target(1000, **{**args, "sibling_done": 512}) == 960
    # Saving one block is not worth a split when a pass costs more than prefilling 64 tokens.
    dear = CostModel(chunk_s=64 * CostModel().token_s * 1.5)
    assert coalesce_target(128, **{**args, "servable": 64, "cost": dear}) is None
    assert coalesce_target(128, **{**args, "servable": 64}) == 128


def test_demand_is_valued_as_hits_until_they_come() -> None:
    v = Valuer(CostModel(), image_bytes=1 << 20, slab_bytes=1 << 16)
    plain = v.estimate(0.0, 0, 1024, False)
    assert v.estimate(0.0, 0, 1024, False, demand=3) == 4 * plain


def test_a_demanded_tap_wins_a_slot_and_its_demand_turns_into_hits() -> None:
    from helpers import Device, key, make_index, run

    from sglang_hybrid.index import SnapshotKind

    idx, dev = make_index(slots=1), Device()
    (e1,) = run(idx, dev, toks(1024))  # an endpoint worth 1024 / (1000 + 16 * 100)

    def tap(ids: list[int], demand: int) -> object:
        k = key(ids)
        lane = idx.open_lane(idx.match(k), None)
        idx.unpin_sources(lane)
        idx.commit(lane, k, len(ids), lambda b: dev.new())
        slot = idx.reserve_slot(lane, 448, SnapshotKind.BOUNDARY, demand)
        s = None
        if slot is not None:
            s = idx.publish(lane, k, 448, slot, SnapshotKind.BOUNDARY, demand=demand)
        idx.release(lane)
        dev.collect(idx)
        idx.check_integrity()
        return s

    assert tap(toks(512), 0) is None  # 448 / 1700 < 1024 / 1000: GDSF keeps the endpoint
    shared = toks(512)
    s = tap(shared, 3)  # three requests wait for it: worth four times as much, it takes the slot
    assert s is not None and s.demand == 3 and e1.id not in idx.snapshots
    m = idx.match(key(shared[:448] + toks(30)))
    assert m.best is s
    lane = idx.open_lane(m, s)  # the waiting request comes: its demand becomes a hit
    assert (s.demand, s.hits) == (2, 1)
    idx.unpin_sources(lane)
    idx.release(lane)
    idx.check_integrity()


def test_resume_epoch_ignores_device_pressure_but_not_new_resume_points() -> None:
    """The coalescer reuses its decision while ``resume_epoch`` stands: dropping host-backed
    device copies must leave every match's best snapshot as it was, and publishing or deleting
    a snapshot must move it."""
    idx, dev = make_index(host_slabs=60, slots=4), Device()
    ids = list(range(1, 400))
    (s,) = run(idx, dev, ids, taps=[256], endpoint=False)
    before, epoch = idx.resume_epoch, idx.epoch
    assert idx.evict_device(10_000, backed_only=True) > 0  # every block is host-backed
    assert idx.epoch != epoch and idx.resume_epoch == before
    assert idx.match(key(ids + [7])).best is s
    run(idx, dev, ids[:200] + [9] * 100, taps=[128], endpoint=False)
    assert idx.resume_epoch != before
    moved = idx.resume_epoch
    idx.delete_snapshot(s)
    assert idx.resume_epoch != moved
    idx.check_integrity()


def test_commit_moves_no_resume_point() -> None:
    """A prefill chunk's commit adds blocks that hold no snapshot and ends no fill: every match's
    best snapshot stays, and so does ``resume_epoch`` (the coalescer keeps its matches across a
    sibling's chunk passes)."""
    idx, dev = make_index(host_slabs=60, slots=4), Device()
    ids = list(range(1, 400))
    (s,) = run(idx, dev, ids, taps=[256], endpoint=False)
    before, epoch = idx.resume_epoch, idx.epoch
    longer = ids + list(range(1000, 1400))  # 799 tokens: 12 full blocks
    k = key(longer)
    m = idx.match(k)
    assert m.best is s
    lane = idx.open_lane(m, s)
    idx.unpin_sources(lane)
    dups = idx.commit(lane, k, 640, lambda b: dev.new())  # a chunk: blocks 6-9 are new
    assert [b for b, _ in dups] == [4, 5] and len(lane.path) == 10
    assert idx.epoch != epoch and idx.resume_epoch == before
    assert idx.match(key(longer + [7])).best is s
    assert idx.commit(lane, k, len(longer), lambda b: dev.new()) == []  # the next chunk
    assert len(lane.path) == 12
    assert idx.resume_epoch == before
    idx.release(lane)
    idx.check_integrity()

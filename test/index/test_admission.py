"""Admission arithmetic (spec §6.2-6.3, §13.1): choice, fallback, classification, staleness."""

from __future__ import annotations

from helpers import Device, key, make_index, run

from sglang_hybrid.index import Readiness, Residency, quote
from sglang_hybrid.index.admission import is_current

X = list(range(1, 1000))


def _setup():
    idx, dev = make_index(host_slabs=400, slots=4), Device()
    tap, end = run(idx, dev, X[:400], taps=[128], page=64)  # the tail takes a whole page
    # Drop device copies of everything but blocks 0-1: the endpoint becomes host-only on its path.
    for node in idx.match(key(X[:400])).path[2:]:
        idx.residency.drop_node_device(node)
    idx.residency.drop_tail_device(end)
    idx.drop_image_device(end)
    dev.collect(idx)
    idx.check_integrity()
    m = idx.match(key(X[:500]))
    assert m.best is end and m.best_device is tap and m.device_blocks == 2
    return idx, m, tap, end


def test_cheapest_source_wins_when_it_fits() -> None:
    idx, m, _, end = _setup()
    q = quote(idx, m, request_tokens=600, free_tokens=10_000, pool_tokens=20_000)
    assert q.readiness is Readiness.READY and q.choice.snapshot is end
    c = q.choice
    assert c.host_blocks == 4 and c.restore_bytes == 4 * 100 + 1000 + 100
    assert c.need_tokens == 4 * 64 + 64 + (600 - 400)


def test_fallback_to_the_device_resident_source_then_blocked_then_infeasible() -> None:
    idx, m, tap, _ = _setup()
    need_end = 4 * 64 + 64 + 200  # restored blocks, the tail's private page, the rest
    need_tap = 600 - 128
    assert need_tap < need_end
    evictable = idx.evictable_tokens - 2 * 64  # both would pin blocks 0-1 themselves
    q = quote(idx, m, request_tokens=600, free_tokens=need_tap - evictable, pool_tokens=20_000)
    assert q.readiness is Readiness.READY and q.choice.snapshot is tap
    q = quote(idx, m, request_tokens=600, free_tokens=0, pool_tokens=20_000)
    assert q.readiness is Readiness.TEMPORARILY_BLOCKED and q.choice.snapshot is None
    q = quote(idx, m, request_tokens=600, free_tokens=0, pool_tokens=599)
    assert q.readiness is Readiness.PERMANENTLY_INFEASIBLE


def test_quote_goes_stale_when_the_cache_changes() -> None:
    idx, m, _, _ = _setup()
    q = quote(idx, m, request_tokens=600, free_tokens=10_000, pool_tokens=20_000)
    assert is_current(idx, q)
    idx.evict_device(64)
    assert not is_current(idx, q)


def test_filling_blocks_are_skipped_as_candidates() -> None:
    idx, m, tap, end = _setup()
    node = m.path[3]
    idx.transfers.begin_node_fill(node, "dst")
    m2 = idx.match(key(X[:500]))
    assert m2.settled_blocks == 3 and m2.best is tap  # end's path crosses a filling block
    idx.transfers.finish_node_fill(node)
    assert node.device_state is Residency.RESIDENT
    assert idx.match(key(X[:500])).best is end
    idx.check_integrity()


def test_a_commit_stops_before_a_block_still_filling() -> None:
    """A lane that computed blocks the tree holds, one of them with its device copy still landing
    (a prefetch or restore in flight): the lane cannot swap its own copy for that one yet, so the
    commit stops before it (found by the reliability suite: a chunked request deduplicated onto
    prefetched pages whose copy had not run, and read them at its next pass)."""
    idx, m, _, _ = _setup()
    node = m.path[3]
    idx.transfers.begin_node_fill(node, "dst")
    k = key(X[:400])
    lane = idx.open_lane(idx.match(k), None)
    dev = Device()
    given: list[object] = []

    def device_of(i: int) -> object:
        given.append(dev.new())
        return given[-1]

    dups = idx.commit(lane, k, 6 * 64, device_of)
    # blocks 0 and 1 are on the device: duplicates; block 2 is host-only: it adopts the page
    assert [(b, n) for b, n in dups] == [(0, m.path[0]), (1, m.path[1])]
    assert len(lane.path) == 3 and len(given) == 1
    assert lane.path[2] is m.path[2] and m.path[2].device == given[0]
    assert m.path[2].device_state is Residency.RESIDENT
    idx.transfers.finish_node_fill(node)
    dups = idx.commit(lane, k, 6 * 64, device_of)  # the next pass resumes there
    assert [b for b, _ in dups] == [3]
    assert len(lane.path) == 6 and len(given) == 3
    assert [n.device for n in lane.path[4:]] == given[1:]
    idx.release(lane)
    idx.check_integrity()

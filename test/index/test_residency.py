"""ResidencyTracker (spec §9.1, §9.3): the per-request fast paths agree with ``node_changed``, and
``check_integrity`` catches a list that diverged from the fields."""

from __future__ import annotations

import pytest
from helpers import Device, key, make_index, run

from sglang_hybrid.index import IntegrityError, PromptKey


def _lists(idx) -> tuple[list[object], list[object], list[object]]:
    lru = idx.residency.lru
    return list(lru.backed), list(lru.unbacked), list(idx.residency.dead)


def test_fast_paths_match_node_changed() -> None:
    """Re-deriving every node after the fast paths ran changes no list, nor its order."""
    idx, dev = make_index(host_slabs=64), Device()
    ids = list(range(1, 400))
    run(idx, dev, ids)  # an endpoint keeps its path live
    run(idx, dev, list(range(1000, 1300)), endpoint=False)  # written through, no snapshot: dead
    run(idx, dev, list(range(2000, 2300)), endpoint=False, write=False)  # unbacked
    m = idx.match(PromptKey.from_ids([*ids, 7]))  # a next turn: resumes at the endpoint
    lane = idx.open_lane(m, m.best)  # pins the path via ``ref``
    assert lane.path
    idx.release(lane)  # unpins it via ``release_path``
    before = _lists(idx)
    assert all(before), "every list should hold entries"
    for n in idx.tree.subtree_postorder(idx.tree.root):
        if n.parent is not None:
            idx.residency.node_changed(n)
    assert _lists(idx) == before
    idx.check_integrity()


def test_check_integrity_catches_a_diverged_list() -> None:
    idx, dev = make_index(), Device()
    run(idx, dev, list(range(1, 200)), endpoint=False)
    node = idx.match(key(list(range(1, 200)))).path[0]
    lru = idx.residency.lru
    lru.remove(node)  # as a fast path that forgot a freed node would leave it
    with pytest.raises(IntegrityError, match="LRU membership"):
        idx.check_integrity()
    lru.add(node, 32, backed=False)  # in the list with another footprint than its copy's
    with pytest.raises(IntegrityError, match="in the LRU with 32 tokens"):
        idx.check_integrity()
    lru.remove(node)
    lru.add(node, 64, backed=False)
    idx.check_integrity()

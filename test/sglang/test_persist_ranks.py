"""TP ranks loading their cache files (``--hybrid-cache-file``, ``PATH.tp<rank>``) agree on what
they loaded or all load nothing: each rank's decisions from then on must match the others'.

The ranks compare a content digest (``persistence.load_digest``), not counts: two files of equal
size from saves of unequal age, or the same entries with another learned host order, would pass a
count and leave the ranks deciding differently from the first request on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gloo_pair import run_two_ranks

from sglang_hybrid.index.persist import AdoptPlan, HostExport, NodeRecord, SnapshotRecord
from sglang_hybrid.sglang.persistence import LoadReport, Persistence, load_digest

LEARNED = {"version": 1, "events": 7, "ages": [[0, 3], [1, 4]]}


def _records(hits: int = 2, slab0: int = 0) -> HostExport:
    nodes = [
        NodeRecord(-1, 11, 0, bytes(range(64)) * 4, slab0),
        NodeRecord(0, 12, 0, bytes(range(1, 65)) * 4, slab0 + 1),
    ]
    snaps = [SnapshotRecord(1, 128, b"", 1, hits, (slab0 + 2, slab0 + 3), -1)]
    return HostExport(nodes, snaps)


def _digest(records: HostExport, learned: Any = LEARNED, events: int = 7) -> int:
    plan = AdoptPlan(snapshots=[0], nodes=[0, 1], slabs=4)
    return load_digest(records, plan, learned, events)


def test_the_digest_names_what_was_loaded_not_where_it_lies() -> None:
    d = _digest(_records())
    assert d == _digest(_records()) and 0 <= d < 1 << 62
    assert d == _digest(_records(slab0=40))  # each rank's slab numbers are its own
    assert d != _digest(_records(hits=3))  # an older save: the same entries, other counts
    assert d != _digest(_records(), learned={**LEARNED, "ages": [[0, 3], [1, 5]]})
    assert d != _digest(_records(), events=0)  # one rank left the learned order out
    half = load_digest(_records(), AdoptPlan(snapshots=[], nodes=[0], slabs=1), LEARNED, 7)
    assert d != half  # a smaller tier kept less


class _Cache:
    """What ``Persistence._agree`` touches of the cache: a refusal empties the index."""

    def __init__(self) -> None:
        self.emptied = 0

    def empty_index(self) -> None:
        self.emptied += 1


def _rank(rank: int, rendezvous: str, digests: list[int], q: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    group = dist.new_group([0, 1], backend="gloo")
    p = Persistence(Path(f"/nonexistent/host.bin.tp{rank}"), {"tp_size": 2}, None, group)  # type: ignore[arg-type]
    cache = _Cache()
    d = digests[rank]
    report = LoadReport(True, "", 1, 2, 0, 0, 7, d) if d >= 0 else LoadReport(False, "no file")
    out = p._agree(cache, report)
    q.put((rank, (out.loaded, out.reason, cache.emptied)))
    dist.destroy_process_group()


@pytest.mark.parametrize("case", ["same", "older_save", "other_learned_order", "one_file_missing"])
def test_tp_ranks_load_the_same_or_nothing(case: str, tmp_path: Path) -> None:
    same = _digest(_records())
    other = {
        "same": same,
        "older_save": _digest(_records(hits=3)),
        "other_learned_order": _digest(_records(), learned={**LEARNED, "events": 6}),
        "one_file_missing": -1,
    }[case]
    got = run_two_ranks(_rank, ([same, other],), tmp_path)
    for rank in (0, 1):
        loaded, reason, emptied = got[rank]
        if case == "same":
            assert loaded and reason == "" and emptied == 0
        else:
            assert not loaded and emptied == 1
            assert "TP ranks' files disagree" in reason

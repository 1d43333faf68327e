"""The in-process L3 store (``memory://``) and L3 jobs in modelled time (``ClockedJobQueue``):
the two pieces the replay's L3 (``replay/l3_model.py``) runs the real L3 path on."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_hybrid.store.l3.backend import FAILED, MISSING, L3ConfigError, parse_url
from sglang_hybrid.store.l3.connect import open_backend
from sglang_hybrid.store.l3.jobs import ClockedJobQueue, Job, JobCost
from sglang_hybrid.store.l3.memory import drop

MiB = 1 << 20


def _backend(name: str, mib: int = 1):  # type: ignore[no-untyped-def]
    return open_backend(parse_url(f"memory://{name}?capacity_mib={mib}"), tp_rank=0, tp_size=1)


def test_objects_come_back_exactly_and_a_missing_key_reads_missing() -> None:
    b = _backend("t-exact")
    try:
        rng = np.random.default_rng(0)
        data = rng.integers(0, 256, 4096, dtype=np.uint8)
        assert b.put(["k"], [data]) == [True]
        assert b.exists(["k", "other"]) == [True, False]
        out = np.zeros(8192, dtype=np.uint8)
        assert b.get(["k", "other"], [out[:4096], out[4096:]]) == [4096, MISSING]
        assert np.array_equal(out[:4096], data)
        assert b.get(["k"], [out[:100]]) == [FAILED]  # larger than the buffer: not read
    finally:
        drop("t-exact")


def test_past_its_capacity_the_least_recently_used_objects_go() -> None:
    b = _backend("t-lru", mib=1)  # four objects of 256 KiB
    try:
        obj = np.zeros(256 << 10, dtype=np.uint8)
        b.put(["a", "b", "c", "d"], [obj] * 4)
        b.get(["a"], [np.zeros_like(obj)])  # a is now the most recent
        b.put(["e"], [obj])
        assert b.exists(["a", "b", "c", "d", "e"]) == [True, False, True, True, True]
        assert b.store.c.evicted == 1 and b.store.nbytes == 4 * obj.nbytes
        # two servers of one process naming the same store share it
        assert _backend("t-lru").exists(["e"]) == [True]
    finally:
        drop("t-lru")


def test_a_memory_url_names_its_store_and_size() -> None:
    u = parse_url("memory://fleet?capacity_mib=64&prefix=x")
    assert (u.scheme, u.target, u.prefix) == ("memory", "fleet", "x")
    for bad in ("memory://fleet", "memory://?capacity_mib=1", "memory://f?capacity_mib=1&y=2"):
        with pytest.raises(L3ConfigError):
            parse_url(bad)


def test_clocked_jobs_run_at_once_and_finish_in_modelled_time_one_after_another() -> None:
    now = [0.0]
    priced: list[JobCost] = []

    def seconds(job: Job) -> float:
        priced.append(job.cost)
        return 1.0 * job.cost.round_trips + 10.0 * job.cost.blocks

    q = ClockedJobQueue(lambda: now[0], seconds)
    ran: list[str] = []
    a = q.submit(Job(lambda job: ran.append("a") or 1, 0.0, "a", JobCost(1, 1)))  # 11 s
    b = q.submit(Job(lambda job: ran.append("b") or 2, 0.0, "b", JobCost(2)))  # then 2 s
    assert ran == ["a", "b"] and priced == [JobCost(1, 1), JobCost(2)]
    assert (a.ready_at, b.ready_at, q.next_ready()) == (11.0, 13.0, 11.0)
    assert q.finished() == 0
    now[0] = 12.0
    assert q.finished() == 1 and [j.result() for j in q.retire(1)] == [1]
    now[0] = 20.0
    c = q.submit(Job(lambda job: 1 / 0, 0.0, "c"))  # starts when submitted: the link is idle
    assert c.ready_at == 21.0 and q.finished() == 1
    now[0] = 21.0
    done = q.retire(q.finished())
    assert done[0].result() == 2 and isinstance(done[1].result(), ZeroDivisionError)
    assert not q.stuck and q.next_ready() is None

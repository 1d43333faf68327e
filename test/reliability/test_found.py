"""Bugs the reliability suite found, each reduced to a minimal reproduction.

A test here states what must hold. While its bug is open it is marked ``xfail(strict=True)``, so
the suite stays green and turns red (XPASS) the day the fix lands: then the mark goes and the
test stays as the regression test.
"""

from __future__ import annotations

import random


def test_a_burst_of_requests_right_after_a_flush(build) -> None:
    """Found by ``test_random_operations[one-running]`` with ``--reliability-seed 1`` at
    operation 5141: a flush, then six requests arriving together. The snapshot slots used to be
    re-reserved lazily at the next ``match_prefix``, after SGLang's admission pass had already
    pre-allocated a MambaPool slot per waiting request (``alloc_group_begin``), so the
    reservation found too few free slots and raised out of the scheduler loop. Fixed: the cache
    takes its slots back in an AFTER hook on ``Scheduler.flush_cache``."""
    h = build(running=1, mamba=6, opts={"device_snapshot_slots": 2})
    rng = random.Random(3)
    h.run([rng.randrange(10, 2000) for _ in range(100)], max_new=2)
    assert h.s.scheduler.flush_cache()
    for i in range(6):
        h.s.submit(f"burst-{i}", [rng.randrange(10, 2000) for _ in range(80)], 2)
    h.step_all()
    assert all(r.finish_type == "length" for r in h.s.results().values())

"""Every TP rank takes the same cache decisions (issue #10).

Each TP rank runs its own scheduler and cache; SGLang keeps them in step by construction, so a
decision keyed by ``id()``, an address, the wall clock or a per-process hash seed would let one
rank hold a request another admits. These tests run the same request stream as two separate
processes with different hash seeds and allocation histories and compare every pass's decisions;
and they run the digest comparison ``--hybrid-check-ranks`` does over a real two-process gloo
group.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from gloo_pair import run_two_ranks

HERE = Path(__file__).resolve().parent


def _start_rank(
    model: Path, out: Path, seed: str, noise: int, group: list[str], exclusive: bool = False
) -> Any:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    cmd = [
        sys.executable,
        str(HERE / "rank_stream.py"),
        str(model),
        str(out),
        "--noise",
        str(noise),
        "--group",
        *group,
        *(["--exclusive"] if exclusive else []),
    ]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: Any, out: Path) -> tuple[list, dict]:
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.read_text()), json.loads(Path(f"{out}.stats").read_text())


@pytest.mark.parametrize("exclusive", [False, True])
def test_rank_determinism_two_schedulers_decide_the_same(
    qwen3_next_dir, tmp_path, exclusive: bool
) -> None:
    """Two ranks with different hash seeds, allocation histories and copy speeds (rank B's host
    copies take 3 ms longer each): the host tier's poll agrees on the MIN of finished copies
    over a real gloo group, so every pass decides the same although rank A finishes first.
    With an exclusive host the demotions each rank issues follow that count too."""
    store = str(tmp_path / "rendezvous")
    a_proc = _start_rank(qwen3_next_dir, tmp_path / "a.json", "1", 0, [store, "0", "0"], exclusive)
    b_proc = _start_rank(
        qwen3_next_dir, tmp_path / "b.json", "977", 300, [store, "1", "0.003"], exclusive
    )
    a, a_stats = _finish(a_proc, tmp_path / "a.json")
    b, _ = _finish(b_proc, tmp_path / "b.json")
    held = sum(len(r[2]) for r in a)
    print(f"\n{len(a)} passes, {held} coalescing holds, last counters {a[-1][3]}, {a_stats}")
    assert len(a) > 50 and held > 0  # the stream exercised coalescing
    # The agreement mattered: rank A had finished copies rank B had not, and waited for them.
    assert a_stats["held_back"] > 0
    assert (a_stats["blocks_demoted"] > 0) is exclusive
    for i, (x, y) in enumerate(zip(a, b)):
        assert x == y, f"pass {i}: rank A decided {x}, rank B {y}"
    assert len(a) == len(b)


def test_rank_determinism_digest_chains_every_field() -> None:
    from sglang_hybrid.sglang.ranks import PassRecord, chain

    base = PassRecord("EXTEND", (("r1", 64, 100),), ("r2",), (1, 2, 3))
    d = chain(0, base)
    assert d == chain(0, PassRecord("EXTEND", (("r1", 64, 100),), ("r2",), (1, 2, 3)))
    for other in (
        base._replace(mode="DECODE"),
        base._replace(batch=(("r1", 0, 164),)),
        base._replace(held=()),
        base._replace(counters=(1, 2, 4)),
    ):
        assert chain(0, other) != d
    assert chain(d, base) != d  # a chain, not a set


def _gloo_rank(rank: int, rendezvous: str, diverge_at: int | None, q: mp.Queue) -> None:
    import torch.distributed as dist

    from sglang_hybrid.sglang.ranks import RankCheck, RankDivergence

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    group = dist.new_group([0, 1], backend="gloo")

    class Coalescer:
        def take_held(self) -> tuple:
            return ()

    class Cache:
        coalescer = Coalescer()
        n = 0

        def decision_counters(self) -> tuple:
            return (self.n,)

    class Scheduler:
        tree_cache = Cache()

    check = RankCheck(group)
    sched = Scheduler()
    result = None
    try:
        for p in range(6):
            sched.tree_cache.n = p + (
                1 if rank == 1 and diverge_at is not None and p >= diverge_at else 0
            )
            check.after_pass(sched, None)
    except RankDivergence as e:
        result = (check.passes, str(e))
    q.put((rank, result))
    dist.destroy_process_group()


@pytest.mark.parametrize("diverge_at", [None, 3])
def test_rank_determinism_check_ranks_over_a_gloo_group(diverge_at, tmp_path) -> None:
    """Two processes, one gloo group: equal decisions pass; the first differing pass stops both
    ranks with the message naming the pass."""
    got = run_two_ranks(_gloo_rank, (diverge_at,), tmp_path)
    if diverge_at is None:
        assert got == {0: None, 1: None}
    else:
        for rank in (0, 1):
            passes, msg = got[rank]
            assert passes == diverge_at + 1, msg
            assert "--hybrid-check-ranks" in msg and f"pass {diverge_at + 1}" in msg


def test_rank_determinism_flag_wires_the_check(build) -> None:
    h = build(opts={"check_ranks": True})
    check = h.cache.rank_check
    assert check is not None and check.world == 1
    assert h.cache.coalescer._held_now is not None  # held requests are recorded for the digest
    h.run(list(range(10, 300)), max_new=4)
    assert check.passes > 0 and check.digest != 0


def test_held_requests_are_not_recorded_without_the_rank_check(build) -> None:
    """Nothing drains the held-rid record but the rank check: without it, nothing may accumulate
    over a server's life."""
    h = build()
    shared = list(range(10, 700))
    for i in range(4):
        h.s.submit(f"c{i}", shared + [3000 + i] * 20, 4)
    h.step_all()
    assert h.cache.coalescer._held_now is None
    assert h.cache.coalescer.take_held() == ()

"""Two spawned processes joined in one gloo group: what the rank-agreement tests run on."""

from __future__ import annotations

import multiprocessing as mp
import queue
from collections.abc import Callable
from pathlib import Path
from typing import Any


def run_two_ranks(target: Callable[..., None], args: tuple[Any, ...], tmp_path: Path) -> dict:
    """Run ``target(rank, rendezvous, *args, q)`` in ranks 0 and 1; each puts one ``(rank,
    result)`` on ``q``. Returns {rank: result}; both must exit 0 within the timeouts."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    rendezvous = f"file://{tmp_path / 'rendezvous'}"  # a file: no port to race for
    procs = [ctx.Process(target=target, args=(r, rendezvous, *args, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = dict(q.get(timeout=180) for _ in procs)
    except queue.Empty:
        codes = [p.exitcode for p in procs]
        raise AssertionError(f"a rank reported nothing in 180 s (exit codes {codes})") from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    assert [p.exitcode for p in procs] == [0, 0]
    return got

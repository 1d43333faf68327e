"""Taps captured inside a pass (``--hybrid-tap-mode zero-split``) against taps that end a pass
(``split``), in SGLang's real Scheduler: at least the same reuse, in fewer prefill passes.

``CheckingWorker`` writes the state after each in-pass tap position into the reserved slot, as
the model worker does, and proves every later resume from it.
"""

from __future__ import annotations

import random

import pytest

rng = random.Random(41)


def toks(n: int) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(n)]


def _workload(h) -> tuple[list[int], int]:
    """Repeats (prompt-tail taps), a preamble shared by sessions diverging on the block grid
    (branch taps), a long prompt (ladder taps) and its edits; returns (reuse, prefill passes)."""
    passes = [0]
    worker = h.s.worker
    orig = worker._next_tokens

    def count(batch, spans):
        if batch.forward_mode.is_extend():
            passes[0] += 1
        return orig(batch, spans)

    worker._next_tokens = count
    reuse = []
    for n in (300, 577, 1025):
        p = toks(n)
        reuse += [h.run(p, max_new=2).cached_tokens, h.run(p, max_new=2).cached_tokens]
    pre = toks(1024)
    for _ in range(3):
        reuse.append(h.run(pre + toks(100), max_new=4).cached_tokens)
    long = toks(8000)
    reuse.append(h.run(long, max_new=2).cached_tokens)
    for cut in (7500, 5000):
        reuse.append(h.run(long[:cut] + toks(50), max_new=2).cached_tokens)
    return reuse, passes[0]


@pytest.mark.parametrize("page", [1, 64])
def test_zero_split_taps_give_the_same_reuse_in_fewer_passes(build, page: int) -> None:
    kw = dict(page=page, total=24000, running=2, mamba=16, chunk=2048)
    split = build(**kw, opts={"tap_mode": "split", "tap_ladder": 2048, "tap_min_gap": 1024})
    reuse_split, passes_split = _workload(split)
    zero = build(**kw, opts={"tap_mode": "zero-split", "tap_ladder": 2048, "tap_min_gap": 1024})
    assert zero.cache.capture_grid == 1  # any position: exact taps stay in the pass too
    reuse_zero, passes_zero = _workload(zero)
    taps = zero.s.worker.checked_taps
    print(
        f"\npage {page}: split {passes_split} passes, reuse {reuse_split}\n"
        f"  zero-split {passes_zero} passes ({taps} in-pass taps), reuse {reuse_zero}"
    )
    assert taps > 0
    # Flexible taps a split pass would lose (no chunk end on the grid after them before the
    # prompt's end) are captured too, so zero-split reuses at least as much, in fewer passes.
    assert all(z >= s for z, s in zip(reuse_zero, reuse_split)), (reuse_zero, reuse_split)
    assert passes_zero < passes_split
    idx = zero.cache.index
    idx.check_integrity()
    assert idx.slots.free + sum(1 for o in idx.slots.owner if o is not None) == idx.slots.n
    assert not any(o is not None and not hasattr(o, "frontier") for o in idx.slots.owner)


def test_auto_picks_zero_split_on_a_worker_that_captures(build) -> None:
    assert build().cache.capture_grid == 1  # the CPU workers capture anywhere in a pass
    assert build(opts={"tap_mode": "split"}).cache.capture_grid == 0


def test_zero_split_refused_on_a_worker_without_in_pass_taps() -> None:
    from types import SimpleNamespace

    from sglang_hybrid.index import ConfigError
    from sglang_hybrid.sglang.flags import HybridOptions
    from sglang_hybrid.sglang.plugin import _resolve_tap_mode

    gpu_worker = SimpleNamespace()  # SGLang's TpModelWorker has no state_taps
    with pytest.raises(ConfigError, match="--hybrid-tap-mode zero-split"):
        _resolve_tap_mode(HybridOptions(tap_mode="zero-split"), gpu_worker)
    opts, grid = _resolve_tap_mode(HybridOptions(tap_mode="auto"), gpu_worker)
    assert (opts.tap_mode, grid) == ("split", 0)


def test_the_capture_grid_comes_from_the_worker() -> None:
    from sglang_hybrid.cpu.token_worker import TokenWorker
    from sglang_hybrid.replay.worker import ChunkGridReplayWorker
    from sglang_hybrid.sglang.flags import HybridOptions
    from sglang_hybrid.sglang.plugin import _resolve_tap_mode

    zero = HybridOptions(tap_mode="zero-split")
    # Class attributes decide; no worker needs to run.
    assert _resolve_tap_mode(zero, object.__new__(TokenWorker))[1] == 1  # anywhere
    assert _resolve_tap_mode(zero, object.__new__(ChunkGridReplayWorker))[1] == 64  # chunks
    assert _resolve_tap_mode(HybridOptions(tap_mode="split"), object.__new__(TokenWorker))[1] == 0

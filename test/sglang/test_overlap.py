"""Overlap scheduling with ``--radix-cache hybrid`` (issue #14), in SGLang's real Scheduler.

``InProcessScheduler`` runs the body of SGLang's ``event_loop_overlap`` when overlap is on: batch
N+1 is scheduled and run before batch N's results are processed, so the checkpoint at a prompt's
end and the release at finish come after the next batch (the request's first or extra decode) has
advanced its live state. ``CheckingWorker`` proves, at every pass, that a resumed state is the state
after exactly the tokens its frontier names; a snapshot of an advanced live state fails there.
On the CPU the forward runs to completion at launch: what these tests reproduce is SGLang's order
of cache calls, not the GPU's concurrency (docs/sglang-backend.md, "Overlap scheduling").
"""

from __future__ import annotations

import random

import pytest

from sglang_hybrid.index import SnapshotKind


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 1500) for _ in range(n)]


def _frontiers(h, kind: SnapshotKind | None = None) -> set[int]:
    return {s.frontier for s in h.cache.index.snapshots.values() if kind is None or s.kind is kind}


@pytest.mark.parametrize("page", [1, 64])
def test_a_tap_at_the_prompt_end_holds_the_state_it_names(build, page: int) -> None:
    """A 256-token prompt in one pass, its tail tap flexible: the tap is realised at the pass's
    end (256). The checkpoint there comes after the request's first decode ran; the snapshot must
    still be the state after 256 tokens (captured as the pass ran), which the next request
    resumes from."""
    opts = {"tap_mode": "split", "tail_tap": "flexible"}
    h = build(page=page, opts=opts, disable_overlap_schedule=False)
    a = _prompt(1, 256)
    h.run(a, max_new=8)
    assert h.s.overlap and h.cache.overlap  # bound at the scheduler's first pass
    assert 256 in _frontiers(h, SnapshotKind.TAP)
    r = h.run(a + _prompt(2, 40), max_new=4)  # CheckingWorker checks the resumed state
    assert r.cached_tokens == 256


@pytest.mark.parametrize("tap_mode", ["split", "zero-split"])
def test_chunked_prefill_taps_under_overlap(build, tap_mode: str) -> None:
    """Chunk ends (the chunked request's next chunk is scheduled before this one's results) and,
    with zero-split, taps captured inside passes: every resume point is exact."""
    h = build(chunk=128, opts={"tap_mode": tap_mode}, disable_overlap_schedule=False)
    a = _prompt(3, 700)
    # An answer longer than END_TOKENS: its endpoint is a resume point beside the prompt's tail
    # (issue #37: an endpoint within END_TOKENS of the prompt-tail tap is not published).
    seq = a + list(h.run(a, max_new=30).output_ids)
    frontiers = sorted(_frontiers(h))
    assert len(frontiers) >= 2, frontiers
    for f in frontiers:  # each resume point, by a request diverging right after it
        r = h.run(seq[:f] + _prompt(f, 30), max_new=2)
        assert r.cached_tokens == f


@pytest.mark.parametrize("overlap", [False, True])
def test_an_endpoint_after_a_stop_token(build, overlap: bool) -> None:
    """A request stopped by a token (not by length) is in the next batch already under overlap
    scheduling: SGLang runs its extra decode, and the KV it keeps covers the stop token. The
    endpoint then sits one token later than without overlap, and is exact either way."""
    h = build(opts={"tap_mode": "split"}, disable_overlap_schedule=not overlap)
    n, k = 200, 70
    a = _prompt(4, n)
    out = h.run_to_stop("a", a, k)
    end = n + k + (1 if overlap else 0)
    assert end in _frontiers(h, SnapshotKind.ENDPOINT)
    r = h.run(a + out + _prompt(5, 20), max_new=3)  # the next turn resumes there, exactly
    assert r.cached_tokens == end

"""Retraction and rejected admission probes (issue #10), in SGLang's real Scheduler.

Retraction (``ScheduleBatch.retract_decode`` when decode runs out of KV pages) releases a running
request's row and re-queues it; it is later matched and admitted again. Admission probes
(``PrefillAdder`` pins a candidate's match while it decides) must cost nothing for a candidate
that is then refused: the host restore happens only once SGLang's budget, which counts the
restore's pages, has accepted the request (``init_load_back``).
"""

from __future__ import annotations

import random

import pytest

rng = random.Random(31)


def toks(n: int) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(n)]


def _count(monkeypatch, cls, name: str) -> list[int]:
    calls = [0]
    orig = getattr(cls, name)

    def spy(*a, **kw):
        calls[0] += 1
        return orig(*a, **kw)

    monkeypatch.setattr(cls, name, spy)
    return calls


def _serve_all(h, prompts, max_new: int) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        h.s.submit(f"q{i}", p, max_new)
    h.step_all()
    res = h.s.results()
    return {f"q{i}": list(res[f"q{i}"].output_ids) for i in range(len(prompts))}


@pytest.mark.parametrize("tap_mode", ["split", "zero-split"])
@pytest.mark.parametrize("host_mib", [0, 16])
def test_retracted_requests_resume_exactly_and_leak_nothing(
    build, monkeypatch, host_mib, tap_mode
) -> None:
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    shared = toks(400)
    prompts = [shared + toks(60) for _ in range(6)]
    opts = {"host_cache_mib": host_mib, "device_snapshot_slots": 4, "tap_mode": tap_mode}
    ref = _serve_all(build(total=20000, running=6, mamba=20, opts=opts), prompts, 300)
    retracts = _count(monkeypatch, ScheduleBatch, "retract_decode")
    # SGLang's output estimate decays within 30 steps instead of 600: it admits optimistically.
    monkeypatch.setenv("SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS", "30")
    # An optimistic output estimate admits more than decode can grow into: retraction follows.
    h = build(total=1800, running=6, mamba=20, chunk=256, opts=opts, schedule_conservativeness=0.05)
    written_before = []
    if host_mib:
        orig = h.cache.host_tier.write_lane

        def spy(lane):
            written_before.append(lane.id)
            return orig(lane)

        monkeypatch.setattr(h.cache.host_tier, "write_lane", spy)
    got = _serve_all(h, prompts, 300)
    print(f"\nretractions {retracts[0]}, host {host_mib} MiB, skipped {h.cache.skips.as_dict()}")
    assert retracts[0] > 0, "the pool should have forced a retraction"
    assert got == ref  # readmitted requests produce what an uncached, unretracted run does
    idx = h.cache.index
    idx.check_integrity()
    assert not idx.lanes and idx.protected_tokens == 0
    assert all(s.restore_pins == 0 for s in idx.snapshots.values())
    if host_mib:  # every released lane (retracted ones included) was written through
        assert len(written_before) >= len(prompts) + retracts[0]
        assert h.cache.host_tier.written_bytes > 0


def test_a_blocked_head_with_a_host_source_restores_only_when_admitted(build, monkeypatch) -> None:
    """A conversation whose state went to the host comes back while a long request holds most of
    the pool: SGLang's budget refuses it pass after pass (the restore's pages count), and no
    restore is issued until the budget accepts it; then it waits out of admission for its copies
    (asynchronous host tier) and resumes from the host exactly."""
    from sglang_hybrid.index import PromptKey
    from sglang_hybrid.sglang.cache import HybridRadixCache
    from sglang_hybrid.sglang.request import token_bytes

    h = build(
        total=2048,
        running=2,
        mamba=10,
        chunk=256,
        opts={"host_cache_mib": 16, "device_snapshot_slots": 2},
    )
    conv = toks(900)
    first = h.run(conv, max_new=40)
    for _ in range(4):  # push it off the device
        h.run(toks(700), max_new=20)
    back_prompt = conv + list(first.output_ids) + toks(40)
    m = h.cache.index.match(PromptKey(token_bytes(back_prompt)))
    assert m.best is not None and m.best is not m.best_device  # its best state is on the host
    loads = _count(monkeypatch, HybridRadixCache, "init_load_back")
    h.s.submit("long", toks(1000), 400)  # holds most of the pool while it decodes
    for _ in range(6):
        h.s.step()
    h.s.submit("back", back_prompt, 4)
    restored, blocked_passes, copy_passes = h.cache.host_tier.restored_blocks, 0, 0
    while "back" not in h.s.results() and h.s.has_work():
        waiting = any(r.rid == "back" for r in h.s.scheduler.waiting_queue)
        issued = loads[0]
        h.s.step()
        h.check_mamba()
        if waiting and any(r.rid == "back" for r in h.s.scheduler.waiting_queue):
            if issued == 0 and loads[0] == 0:
                blocked_passes += 1  # refused by the budget: nothing restored
                assert h.cache.host_tier.restored_blocks == restored
            else:
                copy_passes += 1  # issued: held while its copies land
    h.step_all()
    back = h.s.results()["back"]
    print(
        f"\nblocked {blocked_passes} passes, waited {copy_passes} for copies, then cached "
        f"{back.cached_tokens}, loads {loads[0]}"
    )
    assert blocked_passes > 0, "the long request should have kept the head waiting"
    assert loads[0] == 1
    assert back.cached_tokens == m.best.frontier

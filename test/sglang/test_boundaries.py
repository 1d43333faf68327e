"""The boundary query and the checkpoint pin in SGLang's real Scheduler (issue #16).

Control requests go in through the Scheduler's own dispatcher (``process_input_requests``), as
the tokenizer manager sends them, and the reply comes out of its control output, as it would go
back over ZMQ: the same path ``POST /hybrid/boundaries`` takes in a server (test/server covers
the HTTP side). ``CheckingWorker`` proves that a request resuming at a reported point gets the
exact state there.
"""

from __future__ import annotations

import random
from typing import Any

from sglang_hybrid.sglang.boundaries import BOUNDARIES, PIN, SLOTS, UNPIN
from sglang_hybrid.sglang.hints import checkpoint_envelope


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 1500) for _ in range(n)]


def ask(h: Any, method: str, body: dict[str, Any]) -> Any:
    from sglang.srt.managers.io_struct import DumperControlReqInput, DumperControlReqOutput

    sink = h.s.sink
    before = len(sink.other)
    h.s.scheduler.process_input_requests([DumperControlReqInput(method=method, body=body)])
    replies = [o for o in sink.other[before:] if isinstance(o, DumperControlReqOutput)]
    assert len(replies) == 1, sink.other[before:]
    return replies[0]


def _cache_state(cache: Any) -> Any:
    index = cache.index
    lru = [e.id for e in (*index.lru.backed, *index.lru.unbacked)]
    snaps = sorted((s.id, s.hits, s.demand, s.h) for s in index.snapshots.values())
    return index.tick, lru, snaps, cache.stats()


def test_boundaries_list_the_resume_points_and_place_a_cut(build) -> None:
    h = build(chunk=256)
    a = _prompt(1, 700)
    out = list(h.run(a, max_new=40).output_ids)
    seq = a + out
    before = _cache_state(h.cache)
    reply = ask(h, BOUNDARIES, {"input_ids": seq + _prompt(2, 30), "cut": 700})
    assert reply.success, reply.error
    got = reply.response[0]
    points = {c["position"]: c for c in got["checkpoints"]}
    assert points, got
    end = len(seq) - 1  # the endpoint: every token but the last sampled one was fed
    assert points[end]["kind"] == "endpoint" and points[end]["tier"] == "device"
    assert all(c["full_state"] for c in got["checkpoints"])
    assert got["reusable_now"] == {"tokens": end, "tier": "device", "device_tokens": end}
    below = max(p for p in points if p <= 700)  # the prompt-tail tap, at floor64(699) = 640
    cut = got["cut"]
    assert (cut["verdict"], cut["retained_prefix_tokens"], cut["delta"]) == (
        "snapped",
        below,
        700 - below,
    )
    assert f"snapped {700 - below} tokens back" in cut["reason"]
    assert _cache_state(h.cache) == before  # read-only: no recency, hit or value changed
    # The next request that shares the prompt up to a reported point resumes exactly there.
    r = h.run(seq[:below] + _prompt(3, 20), max_new=2)
    assert r.cached_tokens == below


def test_bad_queries_are_answered_with_the_reason(build) -> None:
    h = build()
    cases = [
        ({}, "input_ids must be"),
        ({"input_ids": []}, "input_ids must be"),
        ({"input_ids": [1, "x"]}, "token ids"),
        ({"input_ids": [1, 2], "cut": 5}, "cut must be a token position in [0, 2]"),
        ({"input_ids": [1, 2], "snap_tolerance": -1}, "snap_tolerance"),
    ]
    for body, message in cases:
        reply = ask(h, BOUNDARIES, body)
        assert not reply.success and message in reply.error, (body, reply.error)
    reply = ask(h, "hybrid.nothing", {})
    assert not reply.success and "unknown method" in reply.error
    h.run(_prompt(4, 100), max_new=2)  # the scheduler keeps serving


def test_a_checkpoint_request_pins_the_prefix_end(build) -> None:
    """A prefix ending 20 tokens past a snapshot gets no endpoint as an ordinary request (the
    64-token spacing of §7.7); with the checkpoint action it does, exactly at its end."""
    h = build(chunk=256)
    a = _prompt(5, 320)
    h.run(a, max_new=2)
    prefix = a[:319] + _prompt(6, 20)  # the request above left its prompt-tail tap at 319
    plain = ask(h, BOUNDARIES, {"input_ids": prefix}).response[0]
    assert [(c["position"], c["kind"]) for c in plain["checkpoints"]][-1] == (319, "tail")
    h.run(prefix, max_new=1, kv_hints=checkpoint_envelope())
    pinned = ask(h, BOUNDARIES, {"input_ids": prefix}).response[0]
    assert pinned["checkpoints"][-1]["position"] == len(prefix)
    r = h.run(prefix + _prompt(7, 10), max_new=2)
    assert r.cached_tokens == len(prefix)


def test_slots_are_the_sequences_finished_last(build) -> None:
    h = build()
    seqs = []
    for i in range(3):
        p = _prompt(10 + i, 200 + 50 * i)
        seqs.append((f"s{i}", p + list(h.run(p, max_new=3, rid=f"s{i}").output_ids)))
    got = ask(h, SLOTS, {"limit": 2}).response[0]["slots"]
    assert [s["rid"] for s in got] == ["s2", "s1"]  # newest first, at most ``limit``
    assert got[0]["n_past"] == len(seqs[2][1]) - 1
    assert got[0]["checkpoints"] and got[0]["checkpoint_state"] == "full"
    one = ask(h, SLOTS, {"rid": "s0"}).response[0]["slots"]
    assert [s["rid"] for s in one] == ["s0"]
    missing = ask(h, SLOTS, {"rid": "nope"})
    assert not missing.success and "no recent sequence" in missing.error


def test_a_durable_checkpoint_survives_host_pressure(build) -> None:
    """Pinned durable, the checkpoint outlives a host tier under constant eviction (GDSF and
    superseded-first skip it) and a device flush; released, it is ordinary again."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    h = build(chunk=256, total=4096, running=2, mamba=10, opts={"host_cache_mib": 4})
    a = _prompt(20, 300)
    h.run(a, max_new=1, kv_hints=checkpoint_envelope())  # its host copies land before idle
    pinned = ask(h, PIN, {"input_ids": a})
    assert pinned.success, pinned.error
    assert pinned.response[0]["position"] == 300 and pinned.response[0]["durable"]
    convs = [_prompt(30 + i, 250) for i in range(5)]
    for _ in range(3):
        for i, c in enumerate(convs):
            convs[i] = c + list(h.run(c, max_new=60).output_ids) + _prompt(40 + i, 20)
    stats = h.cache.index.stats
    assert stats.host_gdsf_evicted + stats.host_superseded_evicted > 0, stats
    h.cache.evict(EvictParams(num_tokens=1 << 30))  # nothing left on the device but pins
    got = ask(h, BOUNDARIES, {"input_ids": a}).response[0]["checkpoints"]
    assert got[-1]["position"] == 300 and got[-1]["durable"], got
    r = h.run(a + _prompt(50, 20), max_new=2)  # restored from the host, exactly
    assert r.cached_tokens == 300
    released = ask(h, UNPIN, {"input_ids": a})
    assert released.success and not released.response[0]["durable"]


def test_durable_needs_the_host_tier_and_a_checkpoint(build) -> None:
    h = build()
    a = _prompt(60, 200)
    missing = ask(h, PIN, {"input_ids": a})
    assert not missing.success and "no checkpoint at 200" in missing.error
    h.run(a, max_new=1, kv_hints=checkpoint_envelope())
    off = ask(h, PIN, {"input_ids": a})
    assert not off.success and "host tier, which is off" in off.error

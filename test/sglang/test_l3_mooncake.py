"""``--hybrid-l3 mooncake://...`` on SGLang's real Scheduler against a real Mooncake Store on
loopback (issue #39): ``mooncake_master`` with its embedded HTTP metadata server and one
``mooncake_client`` storage process, started by the fixture and stopped after the module.

One scheduler writes a conversation; a fresh one (another server, or the same one restarted
without a cache file) resumes it from the store, exactly (the checking worker proves every pass).
A planted corrupt object is refused and recomputed. The master killed mid-run: requests keep
being served from device and host, L3 goes off (logged once, counted), and comes back with
backoff once a master answers again.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sglang_hybrid.index.keys import BLOCK_TOKENS
from sglang_hybrid.index.l3_keys import chain_digests, snapshot_digest
from sglang_hybrid.sglang.request import token_bytes
from sglang_hybrid.store.l3.local_store import LocalMooncake, mooncake_usable
from sglang_hybrid.store.l3.objects import HEADER_BYTES

pytestmark = pytest.mark.skipif(mooncake_usable() is not None, reason=str(mooncake_usable()))


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 1500) for _ in range(n)]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMooncake]:
    with LocalMooncake(tmp_path_factory.mktemp("mooncake"), segment_mib=128) as s:
        yield s


def _build(build: Any, store: LocalMooncake, prefix: str) -> Any:
    url = f"{store.url}&prefix={prefix}"
    h = build(total=4096, running=2, mamba=8, chunk=256, opts={"host_cache_mib": 16, "l3": url})
    l3 = h.cache.l3
    end = time.monotonic() + 30
    while not l3.breaker.up and time.monotonic() < end:  # the connect runs on the write thread
        l3.poll()
        time.sleep(0.02)
    assert l3.breaker.up, l3.breaker.reason
    return h


def _turn1(build: Any, store: LocalMooncake, prefix: str, seed: int) -> tuple[list[int], int]:
    a = _build(build, store, prefix)
    prompt = toks(seed, 300)
    out = a.run(prompt, max_new=40)
    a.cache.l3.writer.wait(timeout_s=30)
    a.cache.l3.poll()
    st = a.cache.l3.local_stats()
    assert st["l3_put_objects"] > 0 and st["l3_put_failed"] == 0, st
    return prompt + list(out.output_ids) + toks(seed + 1, 30), len(prompt) + len(out.output_ids) - 1


def test_a_conversation_continues_from_the_store_on_a_fresh_scheduler(build, store) -> None:
    turn2, end = _turn1(build, store, "cont-", 1)
    b = _build(build, store, "cont-")
    r = b.run(turn2, max_new=4)
    st = b.cache.stats()
    assert st["l3_fetches_landed"] == 1 and st["l3_fetched_snapshots"] == 1, st
    assert r.cached_tokens == end
    b.cache.index.check_integrity()


def test_a_planted_corrupt_object_is_refused_and_recomputed(build, store) -> None:
    turn2, end = _turn1(build, store, "bad-", 5)
    b = _build(build, store, "bad-")
    l3 = b.cache.l3
    data = token_bytes(turn2)
    anchor = end // BLOCK_TOKENS - 1
    d = chain_digests(data, 0, anchor + 1, None)
    key = l3.space.snapshot(
        snapshot_digest(d[anchor], end, data[4 * BLOCK_TOKENS * (anchor + 1) : 4 * end])
    )
    backend = l3.client.backend
    size = backend.store.get_size(key)
    assert size > HEADER_BYTES, (key, size)
    buf = np.zeros(size, dtype=np.uint8)
    backend.register(buf)
    assert backend.get([key], [buf]) == [size]
    buf[HEADER_BYTES + 7] ^= 0xFF
    assert backend.store.upsert(key, buf.tobytes()) == 0
    r = b.run(turn2, max_new=4)
    st, local = b.cache.stats(), l3.local_stats()
    assert st["l3_fetch_failed"] == 1 and st["l3_fetches_landed"] == 0, st
    assert local["l3_refused_corrupt"] == 1, local
    assert r.cached_tokens == 0
    assert b.cache.index.host.reserved == set()


def test_a_turn_still_decoding_is_resumed_from_the_store(build, store) -> None:
    """Server B resumes a prompt server A still decodes: A's blocks reached the store with the
    snapshot its prefill published, not at A's release (the blocks at release only: a miss)."""
    a = _build(build, store, "live-")
    prompt = toks(40, 300)
    req = a.s.submit("a", prompt, 200)
    while not req.output_ids:
        a.s.step()
    for _ in range(12):  # host copies retire, their L3 writes are issued
        a.s.step()
    a.cache.l3.writer.wait(timeout_s=30)
    a.cache.l3.poll()
    assert not req.finished()
    b = _build(build, store, "live-")
    r = b.run(prompt + toks(41, 60), max_new=4)
    st = b.cache.stats()
    assert st["l3_fetches_landed"] == 1 and st["l3_fetched_snapshots"] == 1, st
    assert r.cached_tokens == len(prompt) - 1
    a.s.run_until_idle()
    b.cache.index.check_integrity()


def test_the_master_killed_mid_run_costs_l3_only(build, store, caplog) -> None:
    h = _build(build, store, "kill-")
    l3 = h.cache.l3
    caplog.set_level(logging.INFO, logger="sglang_hybrid.store.l3.health")
    h.run(toks(20, 300), max_new=8)
    store.kill_master()
    served = []
    for i in range(4):  # long enough for a lookup each; none may hang
        t0 = time.monotonic()
        r = h.run(toks(30 + i, 300), max_new=8)
        served.append((len(r.output_ids), round(time.monotonic() - t0, 1)))
    st, local = h.cache.stats(), l3.local_stats()
    print("\nserved with the master dead:", served, {k: v for k, v in local.items() if "l3_" in k})
    assert all(n == 8 for n, _ in served)
    assert local["l3_on"] == 0 and local["l3_offs"] == 1, local
    assert st["l3_skipped_off"] >= 1, st
    offs = [r for r in caplog.records if "is off" in r.getMessage()]
    assert len(offs) == 1, [r.getMessage() for r in caplog.records]
    # A master again (empty: its metadata died with it): the backoff lets a trial through.
    store.start_master()
    end = time.monotonic() + 60
    while not l3.breaker.up and time.monotonic() < end:
        h.run(toks(50, 70), max_new=2)
        time.sleep(0.5)
    assert l3.breaker.up, l3.breaker.reason
    assert any("in use again" in r.getMessage() for r in caplog.records)
    store.stop()  # the module's last test: the storage process re-registers with no master


def test_the_fixture_stops_what_it_started(tmp_path: Path) -> None:
    with LocalMooncake(tmp_path) as s:
        master, storage = s.master, s.storage
        assert master is not None and storage is not None
    assert master.poll() is not None and storage.poll() is not None

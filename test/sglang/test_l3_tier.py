"""``--hybrid-l3 file://DIR`` on SGLang's real Scheduler (issue #39): one scheduler writes, a
fresh one (another server, or the same restarted without a cache file) resumes from L3.

The checking worker proves every pass's prefix KV and resumed state equal an uncached run's, so
a resume from fetched bytes is exact or the pass fails. Planted objects (corrupt, truncated,
foreign, misplaced) are refused, counted and recomputed.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import pytest
import xxhash

from sglang_hybrid.index.keys import BLOCK_TOKENS
from sglang_hybrid.index.l3_keys import chain_digests, snapshot_digest
from sglang_hybrid.store.l3.objects import HEAD, HEADER_BYTES, SUM
from sglang_hybrid.store.l3.objects import Kind as ObjKind

OPTS = {"host_cache_mib": 16}


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 1500) for _ in range(n)]


def _build(build: Any, url: str) -> Any:
    """A scheduler with L3 at ``url``, its store connected (made on the write thread; a request
    arriving before waits for it at most ``FIRST_CONNECT_WAIT_S``, which a loaded machine could
    pass: the tests below that are about the connection build without this)."""
    h = build(total=4096, running=2, mamba=8, chunk=256, opts={**OPTS, "l3": url})
    _written(h)
    assert h.cache.l3.breaker.up
    return h


def _written(h: Any) -> None:
    """Every L3 write of ``h`` done (the write thread)."""
    l3 = h.cache.l3
    l3.writer.wait(timeout_s=30)
    l3.poll()


def _first_turn(build: Any, url: str) -> tuple[list[int], int]:
    """Turn 1 on one scheduler; returns turn 2's prompt and turn 1's endpoint frontier."""
    h = _build(build, url)
    assert h.cache.l3 is not None
    prompt = toks(1, 300)
    out = h.run(prompt, max_new=40)
    _written(h)
    st = h.cache.l3.local_stats()
    assert st["l3_put_objects"] > 0 and st["l3_put_failed"] == 0, st
    end = len(prompt) + len(out.output_ids) - 1
    return prompt + list(out.output_ids) + toks(2, 30), end


def _plant(dirpath: Path, mutate: Any) -> list[Path]:
    """Apply ``mutate(path, data) -> bytes | None`` to every snapshot object in ``dirpath``."""
    done = []
    for p in sorted(dirpath.glob("*-s-*.bin")):
        new = mutate(p, p.read_bytes())
        if new is not None:
            p.write_bytes(new)
            done.append(p)
    assert done, list(dirpath.iterdir())
    return done


def test_a_conversation_continues_from_l3_on_a_fresh_scheduler(build, tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'l3'}"
    turn2, end = _first_turn(build, url)
    b = _build(build, url)  # another server, or this one restarted without a cache file
    r = b.run(turn2, max_new=4)
    st = b.cache.stats()
    print(
        "\nturn 2 on the fresh scheduler:",
        r.cached_tokens,
        {k: v for k, v in st.items() if k.startswith("l3_")},
    )
    assert st["l3_lookups"] == 1 and st["l3_fetches_landed"] == 1, st
    assert st["l3_fetched_snapshots"] == 1 and st["l3_fetched_blocks"] == end // BLOCK_TOKENS
    assert r.cached_tokens == end  # resumed at turn 1's endpoint, from L3 via the host tier
    assert st["host_restored_bytes"] > 0
    b.cache.index.check_integrity()


@pytest.mark.parametrize(
    "damage",
    ["corrupt", "truncated", "foreign", "misplaced"],
)
def test_a_bad_object_is_refused_counted_and_recomputed(build, tmp_path: Path, damage: str) -> None:
    d = tmp_path / "l3"
    url = f"file://{d}"
    turn2, _ = _first_turn(build, url)

    def mutate(p: Path, data: bytes) -> bytes:
        if damage == "corrupt":  # one flipped byte of the state image
            i = HEADER_BYTES + 100
            return data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]
        if damage == "truncated":
            return data[: len(data) // 2]
        # A well-formed object (header checksum right) of another fingerprint, or of another key.
        head = bytearray(data[:HEADER_BYTES])
        field = 16 if damage == "foreign" else 32  # fingerprint, digest (HEAD's layout)
        head[field] ^= 0xFF
        end = HEAD.size + 256
        SUM.pack_into(head, end, xxhash.xxh3_64_intdigest(bytes(head[:end])))
        return bytes(head) + data[HEADER_BYTES:]

    _plant(d, mutate)
    b = _build(build, url)
    r = b.run(turn2, max_new=4)
    st, local = b.cache.stats(), b.cache.l3.local_stats()
    assert st["l3_lookup_hits"] == 1 and st["l3_fetch_failed"] == 1, st
    assert st["l3_fetches_landed"] == 0
    assert local.get(f"l3_refused_{damage}") == 1, local
    assert r.cached_tokens == 0  # recomputed (the checking worker proved every pass)
    assert b.cache.index.host.reserved == set()
    b.cache.index.check_integrity()


@pytest.mark.parametrize("phase", ["probe", "fetch"])
def test_a_hit_on_one_tp_rank_only_is_a_miss_on_all(
    build, tmp_path: Path, monkeypatch, phase
) -> None:
    """Another rank whose objects are missing (its probe found nothing) or whose fetch failed:
    the agreed result (MIN over the group) is a miss, nothing is adopted, slabs go back."""
    from sglang_hybrid.sglang.l3_tier import L3Tier

    url = f"file://{tmp_path / 'l3'}"
    turn2, _ = _first_turn(build, url)
    b = _build(build, url)
    real = L3Tier._agree_results

    def other_rank_missed(self: L3Tier, values: list[int]) -> tuple[list[int], list[int]]:
        lo, hi = real(self, values)
        fetching = any(lk.fetched is not None for lk in self.lookups.values())
        if (phase == "fetch") == fetching:
            lo = [0] * len(lo)  # the other rank: no snapshot found / its fetch failed
        return lo, hi

    monkeypatch.setattr(L3Tier, "_agree_results", other_rank_missed)
    r = b.run(turn2, max_new=4)
    st = b.cache.stats()
    assert st["l3_fetches_landed"] == 0 and r.cached_tokens == 0, st
    assert st["l3_lookup_hits"] == (1 if phase == "fetch" else 0), st
    assert st["l3_fetch_failed"] == (1 if phase == "fetch" else 0), st
    assert b.cache.index.host.reserved == set()
    assert not any(
        n.restore_pins for n in b.cache.index.tree.subtree_postorder(b.cache.index.tree.root)
    )
    b.cache.index.check_integrity()


def test_keys_are_what_a_reader_derives_from_the_prompt(tmp_path: Path) -> None:
    """The snapshot key a server writes is the one ``l3_keys`` derives from the prompt alone."""
    data = bytes(range(256)) * 3
    d = chain_digests(data, 0, 3, None)
    assert d == chain_digests(data, 0, 2, None) + chain_digests(data, 2, 3, None, d[1])
    assert chain_digests(data, 0, 1, [7])[0] != d[0]  # the namespace joins the key
    s1 = snapshot_digest(d[1], 2 * 64 + 3, data[512 : 512 + 12])
    assert s1 != snapshot_digest(d[1], 2 * 64 + 3, data[512 : 512 + 8] + b"\0" * 4)
    assert int(ObjKind.SNAPSHOT) == 2


def test_an_idle_scheduler_does_not_sleep_while_l3_work_is_in_flight(build, tmp_path: Path) -> None:
    """``--sleep-on-idle``: SGLang's idle loop waits up to a second for a request, and L3 writes
    (like host copies) retire only when the loop turns; a finished turn's blocks and endpoint
    then reached the store up to a second late, after a fleet's next turn on another server had
    looked and missed. While L3 work is in flight the loop must not sleep."""
    import threading

    from sglang_hybrid.sglang.l3_tier import WriteTag, wait_idle
    from sglang_hybrid.store.l3.jobs import Job

    h = _build(build, f"file://{tmp_path / 'l3'}")
    h.run(toks(3, 200), max_new=8)
    l3 = h.cache.l3
    wait_idle(l3)
    scheduler = h.s.scheduler

    class Sleeper:  # SGLang's IdleSleeper polls its sockets for up to 1 s
        calls = 0

        def maybe_sleep(self) -> None:
            Sleeper.calls += 1

    scheduler.idle_sleeper = Sleeper()
    gate = threading.Event()
    # a write the store has not answered yet
    l3.writer.submit(Job(lambda job: gate.wait(30), 60.0, WriteTag(0)))
    assert h.cache.copies_in_flight()
    scheduler.maybe_sleep_on_idle()
    assert Sleeper.calls == 0  # it turned again instead
    gate.set()
    wait_idle(l3)
    scheduler.maybe_sleep_on_idle()
    assert Sleeper.calls == 1  # nothing in flight: SGLang's sleep as before


def _decode_until_written(h: Any, req: Any, passes: int = 12) -> None:
    """Step ``h`` until ``req`` is decoding, then ``passes`` more (host copies retire, their L3
    writes are issued), then let the store take them. ``req`` must still be running after."""
    s = h.s
    while not req.output_ids:
        s.step()
    for _ in range(passes):
        s.step()
    _written(h)
    assert not req.finished(), "the first turn finished before the check: give it more tokens"


def test_a_turn_still_decoding_on_one_server_is_resumed_by_another(build, tmp_path: Path) -> None:
    """A fleet's next turn, or a fan-out sibling, can arrive on another server while the first
    request still decodes. Its prompt's state (the n - 1 tail tap) is published and written at
    the end of its prefill, but with the blocks written only at release (§7.6) the store held
    a snapshot nothing could reach until the last token: the second server recomputed it all.
    The blocks now go with each published snapshot."""
    url = f"file://{tmp_path / 'l3'}"
    a = _build(build, url)
    prompt = toks(7, 300)
    req = a.s.submit("a", prompt, 200)
    _decode_until_written(a, req)
    b = _build(build, url)
    r = b.run(prompt + toks(8, 60), max_new=4)
    st = b.cache.stats()
    assert st["l3_fetches_landed"] == 1 and st["l3_fetched_snapshots"] == 1, st
    assert r.cached_tokens == len(prompt) - 1  # the tail tap at n - 1, from A's lane, mid-decode
    b.cache.index.check_integrity()
    a.s.run_until_idle()  # A finishes; its release writes only what was not written yet
    _written(a)
    local = a.cache.l3.local_stats()
    assert local["l3_put_failed"] == 0 and local["l3_put_changed"] == 0, local
    a.cache.index.check_integrity()


def _gated_first_connect(monkeypatch: Any) -> threading.Event:
    """The store answers its first call only once the returned event is set (a remote master
    slow to accept), so a test decides when the connection comes up, whatever the load."""
    from sglang_hybrid.store.l3.client import L3Client

    gate = threading.Event()
    real = L3Client.connect

    def gated(self: L3Client, job: Any = None) -> str:
        if self.backend is None:
            gate.wait(timeout=60)
        return real(self, job)

    monkeypatch.setattr(L3Client, "connect", gated)
    return gate


def test_a_request_arriving_while_l3_first_connects_waits_for_it(
    build, tmp_path: Path, monkeypatch
) -> None:
    """A restarted server's first requests are the ones L3 is for: one admitted while the first
    connection is still being made waits for it (not ``skipped_off``) and resumes from L3."""
    url = f"file://{tmp_path / 'l3'}"
    turn2, end = _first_turn(build, url)
    gate = _gated_first_connect(monkeypatch)
    b = build(total=4096, running=2, mamba=8, chunk=256, opts={**OPTS, "l3": url})
    b.s.submit("t2", turn2, 4)
    for _ in range(3):  # the store has not answered: the request is held, not admitted
        b.s.step()
    assert not b.cache.l3.breaker.up and "t2" not in b.s.results()
    gate.set()
    b.s.run_until_idle()
    r = b.s.results()["t2"]
    st = b.cache.stats()
    assert st["l3_waited_connect"] == 1 and st["l3_skipped_off"] == 0, st
    assert st["l3_lookups"] == 1 and st["l3_fetches_landed"] == 1, st
    assert r.cached_tokens == end
    b.cache.index.check_integrity()


def test_the_wait_for_a_first_connection_is_bounded(build, tmp_path: Path, monkeypatch) -> None:
    """A store that has not answered within ``FIRST_CONNECT_WAIT_S`` costs that wait once: the
    request is served from device and host (recomputed here) and L3 is not looked up."""
    from sglang_hybrid.sglang import l3_tier

    url = f"file://{tmp_path / 'l3'}"
    turn2, _ = _first_turn(build, url)
    monkeypatch.setattr(l3_tier, "FIRST_CONNECT_WAIT_S", 0.3)
    gate = _gated_first_connect(monkeypatch)
    b = build(total=4096, running=2, mamba=8, chunk=256, opts={**OPTS, "l3": url})
    b.s.submit("late", turn2, 4)
    while not (r := b.s.results().get("late")) or not r.finished:
        b.s.step()
    assert not b.cache.l3.breaker.up  # served before the store answered
    st = b.cache.stats()
    assert st["l3_waited_connect"] == 1 and st["l3_skipped_off"] == 1, st
    assert st["l3_lookups"] == 0 and r.cached_tokens == 0, st
    gate.set()
    _written(b)
    assert b.cache.l3.breaker.up
    b.cache.index.check_integrity()

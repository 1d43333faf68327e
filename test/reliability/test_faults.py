"""Fault injection in SGLang's real Scheduler with ``--radix-cache hybrid`` (issue #11).

Each test injects one kind of fault (``faults.py``) and checks that the cache copes: the request
still computes what an uncached run computes (``CheckingWorker`` proves the resumed state and
every prefix KV slot before each pass; outputs are compared with the token worker's), nothing
leaks (the pool identities and the index's ``check_integrity`` after every pass, SGLang's idle
leak check and no lane / pin / protected token at idle), the skip is counted, and the scheduler
keeps serving later requests with reuse.
"""

from __future__ import annotations

import gc
import random
from typing import Any

import pytest
from faults import (
    KV_SITES,
    MAMBA_SITES,
    SHARED_HELPERS,
    ExhaustedPool,
    FailingCopies,
    constant_hash,
    format_exc,
)
from reliability_driver import Config, RandomOps

from sglang_hybrid.cpu.token_worker import deterministic_token
from sglang_hybrid.index import PromptKey
from sglang_hybrid.sglang.hints import make_envelope


def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(n)]


def expected(h: Any, rid: str, n_prompt: int, max_new: int) -> list[int]:
    mc = h.s.scheduler.model_config
    vocab, eos = int(mc.vocab_size), frozenset(mc.hf_eos_token_id or ())
    return [deterministic_token(rid, n_prompt + i, vocab, eos) for i in range(max_new)]


def run_exact(h: Any, ids: list[int], max_new: int, rid: str, **attrs: Any) -> Any:
    """Run one request to idle (every pass checked) and check its output."""
    r = h.run(ids, max_new=max_new, rid=rid, **attrs)
    assert r.finish_type == "length", (rid, r.finish_reason)
    assert list(r.output_ids) == expected(h, rid, len(ids), max_new)
    return r


# ==================================================================== (a) host memory at startup
def test_host_memory_failing_at_startup_refuses_cleanly(build, monkeypatch) -> None:
    """The host slab allocation fails: the scheduler build fails with the flag named, nothing of
    it stays alive (process groups destroyed, no cache or host memory object left), and a second
    scheduler builds and serves with its host tier afterwards."""
    import torch
    from sglang.srt.distributed import parallel_state

    from sglang_hybrid.index import ConfigError
    from sglang_hybrid.sglang.cache import HybridRadixCache
    from sglang_hybrid.store import host_memory

    tried: list[tuple] = []

    class NoHostMemory:
        """``torch`` as host_memory.py sees it, except that allocating fails."""

        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

        @staticmethod
        def empty(*a: Any, **kw: Any) -> Any:
            tried.append(a)
            raise RuntimeError("simulated: cannot allocate 16 MiB of host memory")

    def alive() -> list[Any]:
        gc.collect()
        kinds = HybridRadixCache | host_memory.HostMemory
        return [o for o in gc.get_objects() if isinstance(o, kinds)]

    earlier = {id(o) for o in alive()}  # an earlier test's scheduler may not be collected yet
    with monkeypatch.context() as mp:
        mp.setattr(host_memory, "torch", NoHostMemory())
        with pytest.raises(ConfigError, match="--hybrid-host-cache-mib") as info:
            build(opts={"host_cache_mib": 16})
    assert tried, "the host allocation was never attempted"
    assert "lower the budget" in str(info.value)
    del info
    assert not parallel_state.model_parallel_is_initialized()
    left = [o for o in alive() if id(o) not in earlier]
    assert not left, f"half-built objects still alive: {left}"

    h = build(opts={"host_cache_mib": 16})
    assert h.cache.host_tier is not None and h.cache.host_tier.memory.nbytes >= 16 << 20
    rng = random.Random(1)
    p = toks(rng, 300)
    run_exact(h, p, 4, "a-0")
    assert run_exact(h, p, 4, "a-1").cached_tokens == 299  # the prompt-tail tap at n - 1


# ==================================================================== (b) failing host copies
def host_build(build, page: int) -> Any:
    return build(
        page=page,
        total=2048,
        running=2,
        mamba=8,
        chunk=256,
        opts={"host_cache_mib": 64, "device_snapshot_slots": 2},
    )


def evicted_conversations(h: Any, rng: random.Random, n: int, tag: str) -> list[tuple]:
    """``n`` first turns (300-token prompts, 80 tokens out), then other traffic until their
    endpoints are off the device (pages and snapshot slots): (prompt, output, endpoint)."""
    convs = []
    for i in range(n):
        p = toks(rng, 300)
        r = run_exact(h, p, 80, f"{tag}-first-{i}")
        convs.append((p, list(r.output_ids), len(p) + 79))
    for i in range(6):
        run_exact(h, toks(rng, 500), 70, f"{tag}-other-{i}")
    index = h.cache.index
    for p, out, end in convs:
        best = index.match(PromptKey.from_ids(p + out)).best
        assert best is not None and best.frontier == end, f"setup: endpoint lost ({best})"
        assert not best.image_on_device and best.image_on_host, f"setup: not host-only ({best})"
    return convs


@pytest.mark.parametrize(
    "page,level,k,source",
    [
        (1, "batch", 0, "device"),
        (1, "copy", 0, "device"),
        (1, "copy", 1, "device"),
        (1, "copy", 2, "device"),
        (1, "copy", 7, "device"),
        (64, "batch", 0, "device"),
        (64, "copy", 2, "device"),
        (1, "batch", 0, "none"),
        (64, "copy", 2, "none"),
    ],
    ids=lambda v: str(v),
)
def test_a_restore_copy_failing_recomputes(build, monkeypatch, page, level, k, source):
    """The k-th host->device copy of a restore fails (``copy``: inside the batch, after earlier
    layers landed; ``batch``: before anything moved). The request resumes from the snapshot the
    device holds on its path (``source="device"``) or from the start (``"none"``), exactly; the
    failure is counted; the next conversation restores from host.

    Found by this test (``"none"``, with ``Harness.poison_free``): the slot ``init_load_back``
    took for the image was left uncleared after a failed copy, so the request prefilled from
    position 0 on top of a stale or half-restored state; fixed in ``init_load_back``."""
    h = host_build(build, page)
    rng = random.Random(100 + k)
    (p, out, _), (p2, out2, end2) = evicted_conversations(h, rng, 2, "rf")
    if source == "device":  # p's first 129 tokens leave their prompt-tail tap (n - 1 = 128)
        run_exact(h, p[:129], 4, "rf-share")  # on the device, on p's path
    skips = h.cache.skips.counts
    before = skips["restore_abandoned"]
    fault = FailingCopies("restore", lambda i: i == k, level=level)
    with fault.installed(monkeypatch):
        r = run_exact(h, p + out + toks(rng, 30), 4, "rf-turn2")
    assert fault.failed == 1, f"the fault was not hit ({fault.calls} restore copies)"
    assert skips["restore_abandoned"] == before + 1
    assert r.cached_tokens == (128 if source == "device" else 0), r.cached_tokens
    restored = h.cache.host_tier.restored_bytes
    r2 = run_exact(h, p2 + out2 + toks(rng, 30), 4, "rf-turn2b")
    assert r2.cached_tokens == end2 and h.cache.host_tier.restored_bytes > restored
    again = run_exact(h, p + out + toks(rng, 30), 4, "rf-turn2c")
    assert again.cached_tokens > 0


@pytest.mark.parametrize(
    "page,level,k",
    [
        (1, "batch", 0),
        (1, "copy", 0),
        (1, "copy", 1),
        (1, "copy", 3),
        (1, "copy", 6),
        (1, "copy", "all"),
        (64, "batch", 0),
        (64, "copy", 3),
        (64, "copy", "all"),
    ],
    ids=lambda v: str(v),
)
def test_a_write_through_copy_failing_keeps_serving(build, monkeypatch, page, level, k):
    """Device->host copies fail while a conversation is written through (its blocks at release,
    its snapshots' images when published): they stay device-only, the failure is counted, the
    conversation continues exactly, and once copies work again a later one goes through the
    host tier."""
    h = host_build(build, page)
    rng = random.Random(200)
    skips = h.cache.skips.counts
    p = toks(rng, 300)
    fault = FailingCopies(
        "write", (lambda i: True) if k == "all" else (lambda i: i == k), level=level
    )
    with fault.installed(monkeypatch):
        first = run_exact(h, p, 80, "wf-first")
        turn2 = p + list(first.output_ids) + toks(rng, 30)
        run_exact(h, turn2, 4, "wf-turn2")
    assert fault.failed >= 1 and skips["write_through_failed"] >= 1
    assert skips["write_through_failed"] <= fault.failed
    for i in range(6):  # evict everything from the device
        run_exact(h, toks(rng, 500), 70, f"wf-other-{i}")
    run_exact(h, turn2 + toks(rng, 20), 4, "wf-turn3")
    # Copies work again: a new conversation spills to host and comes back from there.
    ((q, out, end),) = evicted_conversations(h, rng, 1, "wf-after")
    restored = h.cache.host_tier.restored_bytes
    assert run_exact(h, q + out + toks(rng, 30), 4, "wf-after-turn2").cached_tokens == end
    assert h.cache.host_tier.restored_bytes > restored


@pytest.mark.parametrize(
    "name,restore_rate",
    [
        ("host-p1", 0.0),
        ("host-p64", 0.0),
        ("host-p1", 0.3),
    ],
)
def test_random_operations_with_failing_copies(build, retractions, request, name, restore_rate):
    """The random operations of ``test_scheduler_random_ops.py`` with 3 % of the host writes
    failing, and 30 % of the restore copies (in the last case)."""
    config = Config(name, page=64 if name.endswith("64") else 1, host_mib=4)
    n_ops = max(1000, request.config.getoption("--reliability-ops") // 40)
    seed = 7 + request.config.getoption("--reliability-seed") * 1_000_003
    h = build(**config.build_kwargs())
    frng = random.Random(seed)
    writes = FailingCopies("write", lambda i: frng.random() < 0.03)
    restores = FailingCopies("restore", lambda i: frng.random() < restore_rate)
    with pytest.MonkeyPatch.context() as mp, writes.installed(mp), restores.installed(mp):
        tally = RandomOps(h, config, seed, label=f"{name}-copyfail").run(n_ops)
    skips = h.cache.skips.counts
    print(
        f"\n{name} with failing copies: {tally.total} ops; {writes.failed} of {writes.calls} "
        f"write copies and {restores.failed} of {restores.calls} restore copies failed; "
        f"skips {dict(skips)}"
    )
    assert writes.failed > 0 and skips["write_through_failed"] > 0
    if restore_rate:
        assert restores.failed > 0 and skips["restore_abandoned"] > 0


# ==================================================================== (c) exhausted pools
def exhaustion_workload(h: Any, rng: random.Random, tag: str) -> list[Any]:
    """Requests that reach every allocation site of the backend: exact taps inside a block
    (a tail copy: ``_copy_request_tail``), resumes from them (the tail copied for the request:
    ``_copy_tail``; the state slot: ``_prepare_state_slot``), conversations pushed to host and
    restored (``HostTier._alloc``, ``init_load_back``), a flush (``_reserve_slots`` again)."""
    out = []
    a = toks(rng, 300)
    hint = make_envelope([200, 270], ["opener", "structural"])
    out.append(h.run(a, max_new=60, rid=f"{tag}-a", kv_hints=hint))
    out.append(h.run(a[:250] + toks(rng, 40), max_new=4, rid=f"{tag}-a-fork"))
    out.append(h.run(a[:270] + toks(rng, 40), max_new=4, rid=f"{tag}-a-fork2"))
    for i in range(4):
        out.append(h.run(toks(rng, 500), max_new=60, rid=f"{tag}-fill-{i}"))
    turn2 = a + list(out[0].output_ids) + toks(rng, 30)
    for i in range(2):  # two together: the second waits while the first restores
        h.s.submit(f"{tag}-turn2-{i}", turn2 + toks(rng, 5), 4)
    h.step_all()
    out += [h.s.results()[f"{tag}-turn2-{i}"] for i in range(2)]
    assert h.s.scheduler.flush_cache()
    out.append(h.run(a, max_new=4, rid=f"{tag}-after-flush"))
    out.append(h.run(a, max_new=4, rid=f"{tag}-repeat"))
    return out


def exhaustion_build(build) -> Any:
    return build(
        page=1,
        total=1600,
        running=2,
        mamba=8,
        chunk=128,
        opts={"host_cache_mib": 16, "device_snapshot_slots": 2},
    )


def sweep(build, monkeypatch, pool: str, site: str, modes: list[tuple[str, Any]]) -> list[str]:
    """Run the workload once per mode with ``site``'s calls failing as the mode says; return
    the crashes (mode and traceback).

    A request may wait while the pool refuses (a restore that finds no room is retried in a
    later pass, by design); if the workload stops draining, the fault is lifted and whatever
    waited must then finish. A scheduler that crashed is replaced by a fresh one; otherwise the
    next mode starts on the same scheduler, flushed."""
    from faults import Stuck

    crashes = []
    h = None
    for label, fail in modes:
        if h is None:
            h = exhaustion_build(build)
            h.max_passes = 3000
        else:
            assert h.s.scheduler.flush_cache()
        rng = random.Random(5)
        fault = ExhaustedPool(pool, lambda s, i, fail=fail: s == site and fail(i))
        try:
            with monkeypatch.context() as mp, fault.installed(mp, h.s.scheduler):
                try:
                    exhaustion_workload(h, rng, f"x{label}")
                except Stuck:
                    fault.active = False  # the pool is back: what waited goes on
                    h.step_all()
        except Exception as exc:
            crashes.append(f"{site} {label}: {format_exc(exc)}")
            h = None
            continue
        assert fault.failed[site] > 0, (site, label, dict(fault.calls))
        for r in h.s.results().values():
            if r.finish_type == "length":
                assert list(r.output_ids) == expected(h, r.rid, r.prompt_tokens, len(r.output_ids))
        # The scheduler keeps serving with reuse.
        p = toks(rng, 200)
        h.run(p, max_new=2, rid=f"x{label}-after-0")
        assert h.run(p, max_new=2, rid=f"x{label}-after-1").cached_tokens == 199  # n - 1
    return crashes


def modes_for(calls: int) -> list[tuple[str, Any]]:
    """Fail the i-th call alone (each i), two in a row (a retry after evicting fails too),
    and every call."""
    out: list[tuple[str, Any]] = [(f"once{i}", lambda j, i=i: j == i) for i in range(calls)]
    out += [(f"twice{i}", lambda j, i=i: j in (i, i + 1)) for i in range(0, calls, 2)]
    out.append(("always", lambda j: True))
    return out


def site_calls(build, monkeypatch) -> dict[str, int]:
    counts: dict[str, int] = {}
    for pool in ("kv", "mamba"):
        h = exhaustion_build(build)
        fault = ExhaustedPool(pool, lambda s, i: False)
        with monkeypatch.context() as mp, fault.installed(mp, h.s.scheduler):
            exhaustion_workload(h, random.Random(5), "count")
        counts.update(fault.calls)
    return counts


_CALLS: dict[str, int] = {}  # calls per site in one clean run of the workload


def test_the_sweep_covers_every_backend_allocation_site() -> None:
    """Every ``.alloc(...)`` call in the backend, and every call of a shared helper that
    allocates for its caller (``faults.SHARED_HELPERS``), is one of the sites swept below (a new
    site must be added to ``faults.KV_SITES`` / ``MAMBA_SITES``)."""
    import ast
    from pathlib import Path

    import sglang_hybrid.sglang as backend

    found = set()
    for path in Path(backend.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                if fn.name in SHARED_HELPERS:
                    continue
                for node in ast.walk(fn):
                    if not isinstance(node, ast.Call):
                        continue
                    f = node.func
                    if (isinstance(f, ast.Attribute) and f.attr == "alloc") or (
                        isinstance(f, ast.Name) and f.id in SHARED_HELPERS
                    ):
                        found.add(fn.name)
    assert found == set(KV_SITES) | set(MAMBA_SITES), found


class SiteCrashed(AssertionError):
    """The scheduler crashed, leaked or diverged at a swept allocation site (the known bug's
    xfail expects exactly this, not any failed setup assertion)."""


COPY_TAIL_CRASH = (
    "bug: HybridRadixCache._copy_tail (reached from prefix_device_indices inside SGLang's "
    "alloc_for_extend, after admission) raises RuntimeError when the KV allocator still returns "
    "None after evicting: the exception leaves the scheduler loop instead of deferring the "
    "request. Admission now counts the tail's pages (chunking.tail_pages), so only an allocator "
    "failing against its own free count reaches it"
)


@pytest.mark.parametrize(
    "pool,site",
    [
        pytest.param(
            "kv",
            "_copy_tail",
            marks=pytest.mark.xfail(strict=True, raises=SiteCrashed, reason=COPY_TAIL_CRASH),
        ),
        ("kv", "_copy_request_tail"),
        ("kv", "_alloc"),
        # Fixed: after a flush the slots are re-reserved when the pool can give them (no snapshot
        # is taken meanwhile); a request finding no state slot to resume into prefills from the
        # root and SGLang's admission waits for a slot as for any request.
        ("mamba", "_reserve_slots"),
        ("mamba", "_prepare_state_slot"),
        ("mamba", "init_load_back"),
        # An asynchronous restore retired but no state slot to resume into: the restore is
        # given up (its pages stay cached) and the request matches afresh.
        ("mamba", "restored_match"),
    ],
)
def test_pool_exhausted_at_a_backend_allocation_site(build, monkeypatch, pool, site):
    """The allocator returns None at the backend's own allocation sites (the k-th call for each
    k the workload makes, two in a row, every call): the scheduler keeps serving or refuses the
    request cleanly, outputs stay exact, nothing leaks."""
    if not _CALLS:
        _CALLS.update(site_calls(build, monkeypatch))
    n = _CALLS.get(site, 0)
    print(f"\nbackend allocation calls in one clean workload: {_CALLS}")
    assert n > 0, f"the workload never reached {site}: {_CALLS}"
    crashes = sweep(build, monkeypatch, pool, site, modes_for(min(n, 6)))
    if crashes:
        raise SiteCrashed("\n\n".join(crashes))


# ==================================================================== (d) hash collisions
def collision_requests(rng: random.Random) -> list[list[tuple[str, list[int], int]]]:
    """Waves of (rid, prompt, max_new): shared preambles, forks, repeats, deep edits, groups."""
    pre = toks(rng, 700)
    a = pre + toks(rng, 100)
    waves = [[("c-a", a, 20)]]
    waves.append([("c-a-again", list(a), 4), ("c-fork", pre[:450] + toks(rng, 60), 6)])
    edit = list(a)
    edit[130] = 4321
    waves.append([("c-edit", edit, 5)])
    waves.append([(f"c-grp-{i}", pre + [7, 7, 7] + toks(rng, 40), 3) for i in range(4)])
    waves.append(
        [("c-tail", pre[:333] + toks(rng, 20), 4), ("c-tail2", pre[:333] + toks(rng, 9), 4)]
    )
    return waves


def run_waves(h: Any, waves: list[list[tuple[str, list[int], int]]]) -> dict[str, Any]:
    """Each wave submitted together and run to idle (every pass checked)."""
    for wave in waves:
        for rid, prompt, max_new in wave:
            h.s.submit(rid, prompt, max_new)
        h.step_all()
    return dict(h.s.results())


def test_constant_lookup_hash_gives_no_false_hit(build, monkeypatch) -> None:
    """Every block's lookup hash is the same constant. Hits compare tokens, so reuse is the
    same as with real hashes for requests run one at a time, every resumed prefix is verified
    by ``CheckingWorker``, and outputs equal an uncached run of the same requests."""
    waves = collision_requests(random.Random(9))
    ref = run_waves(build("none"), waves)
    normal = run_waves(build(), waves)
    constant_hash(monkeypatch)
    from sglang_hybrid.index.keys import PromptKey

    assert PromptKey.from_ids([1] * 128).ensure_hashes(2) == [0x5EED, 0x5EED]
    h = build()
    collide = run_waves(h, waves)
    for rid in ref:
        assert collide[rid].output_ids == ref[rid].output_ids == normal[rid].output_ids, rid
        assert collide[rid].finish_type == "length"
    sequential = [rid for wave in waves if len(wave) == 1 for rid, _, _ in wave]
    reuse = {rid: (normal[rid].cached_tokens, collide[rid].cached_tokens) for rid in ref}
    print(f"\nreuse (real hash, constant hash): {reuse}")
    assert all(reuse[r][0] == reuse[r][1] for r in sequential), reuse
    assert sum(c for _, c in reuse.values()) > 0
    # Every block sits in one collision chain per parent, found by exact tokens.
    index = h.cache.index
    assert index.tree.n_nodes > 10
    index.check_integrity()


def test_random_operations_with_constant_hash(build, retractions, monkeypatch, request) -> None:
    """The random operations with every block colliding: CheckingWorker verifies every hit."""
    constant_hash(monkeypatch)
    config = Config("collide-p1", host_mib=4)
    n_ops = max(1000, request.config.getoption("--reliability-ops") // 40)
    seed = 11 + request.config.getoption("--reliability-seed") * 1_000_003
    h = build(**config.build_kwargs())
    tally = RandomOps(h, config, seed).run(n_ops)
    print(
        f"\nconstant hash: {tally.total} ops, reuse {tally.cached_tokens / tally.prompt_tokens:.1%}"
    )
    assert tally.cached_tokens > 0

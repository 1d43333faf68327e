"""Past one server: SGLang's router in front of two CPU servers, and ``--dp-size 2`` (alone and
behind the router's ``--dp-aware``).

Everything here is SGLang's real server (``launch_server --radix-cache hybrid``, the tiny model)
and SGLang's real router (``sglang-router``, unmodified), on loopback. Outputs are compared with
a server whose radix cache is disabled; cached tokens with what each server's ``/metrics`` counts.
The test that crashes a worker runs last: it leaves the fleet with one server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from server_helpers import generate, toks

from sglang_hybrid.cpu.server import CpuServer, ServerConfig
from sglang_hybrid.replay.live import LiveRequest, flush_cache, replay
from sglang_hybrid.scaleout.fleet import Fleet, WorkerCounters, read_counters, read_rank_counters
from sglang_hybrid.scaleout.router import ROUTING_KEY_HEADER, RouterConfig, RouterProcess

SESSIONS, TURNS, NEW = 3, 3, 8


def _config(model: Path, cache: str, **kw: object) -> ServerConfig:
    return ServerConfig(model, cache=cache, chunked_prefill_size=128, host_cache_mib=64, **kw)


@pytest.fixture(scope="module")
def uncached(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CpuServer]:
    log = tmp_path_factory.mktemp("scaleout") / "uncached.log"
    with CpuServer(_config(tiny_models["qwen3_next"], "off"), log, on_progress=print) as s:
        yield s


@pytest.fixture(scope="module")
def fleet(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    model = tiny_models["qwen3_next"]
    out = tmp_path_factory.mktemp("fleet")
    # Health checks every second, so a crashed worker leaves the router's list quickly.
    router = RouterConfig(worker_urls=[], health_check_interval_s=1)
    with Fleet(
        [_config(model, "hybrid")] * 2, "cache_aware", out, router=router, on_progress=print
    ) as f:
        yield f


def _prompt(session: int, turn: int, history: list[int]) -> list[int]:
    # A shared 192-token preamble, then the session's own text, then each turn's question.
    return (
        history + toks(1000 + 10 * session + turn, 150)
        if history
        else toks(7, 192) + toks(100 + session, 130)
    )


def _conversations(
    send: Callable[[int, list[int]], dict],
) -> dict[tuple[int, int], tuple[list[int], dict]]:
    """Each session's turns, each prompt built on the replies before it: {(s, t): (ids, reply)}."""
    out = {}
    history = {s: [] for s in range(SESSIONS)}
    for t in range(TURNS):
        for s in range(SESSIONS):
            ids = _prompt(s, t, history[s])
            reply = send(s, ids)
            out[(s, t)] = (ids, reply)
            history[s] = ids + reply["output_ids"]
    return out


@pytest.fixture(scope="module")
def expected(uncached: CpuServer) -> dict[tuple[int, int], tuple[list[int], dict]]:
    return _conversations(lambda s, ids: generate(uncached, ids, NEW))


def _via_router(fleet: Fleet, keyed: bool) -> dict[tuple[int, int], tuple[list[int], dict]]:
    assert fleet.router is not None
    router = fleet.router

    def send(s: int, ids: list[int]) -> dict:
        headers = {ROUTING_KEY_HEADER: f"session-{s}"} if keyed else None
        return generate(router, ids, NEW, headers=headers)

    return _conversations(send)


def _sum(counters: list[WorkerCounters | None]) -> WorkerCounters:
    live = [c for c in counters if c is not None]
    return WorkerCounters(sum(c.prompt_tokens for c in live), sum(c.cached_tokens for c in live))


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin", "consistent_hashing"])
def test_outputs_through_the_router_equal_the_uncached_server_and_cached_tokens_add_up(
    fleet: Fleet, expected: dict, policy: str
) -> None:
    fleet.use_policy(policy)
    fleet.flush()
    before = fleet.counters()
    got = _via_router(fleet, keyed=policy == "consistent_hashing")
    after = fleet.counters()
    for key, (ids, reply) in expected.items():
        assert got[key][0] == ids, f"{policy}: session/turn {key} prompt differs"
        assert got[key][1]["output_ids"] == reply["output_ids"], f"{policy}: {key} output differs"
    deltas = [a - b for a, b in zip(after, before, strict=True) if a is not None and b is not None]
    client_cached = sum(r["meta_info"]["cached_tokens"] for _, r in got.values())
    client_prompt = sum(r["meta_info"]["prompt_tokens"] for _, r in got.values())
    # Each server counts what it served; the sums are what the client saw, token for token.
    assert sum(d.cached_tokens for d in deltas) == client_cached
    assert sum(d.prompt_tokens for d in deltas) == client_prompt
    served = [d.prompt_tokens > 0 for d in deltas]
    if policy == "round_robin":
        assert all(served), f"round robin left a worker idle: {deltas}"
    if policy != "round_robin":
        # Session affinity (by key, or by the router's prefix tree): every later turn resumes.
        later = [r["meta_info"]["cached_tokens"] for (s, t), (_, r) in got.items() if t > 0]
        assert min(later) >= 192, f"{policy}: a follow-up lost its session's prefix: {later}"


def _killer_requests(n: int) -> list[LiveRequest]:
    return [
        LiveRequest(
            f"k{i}",
            "generate",
            {
                "input_ids": toks(5000 + i, 300),
                "sampling_params": {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True},
            },
            arrival_s=0.05 * i,
        )
        for i in range(n)
    ]


def test_a_worker_crashing_mid_run_loses_no_request_and_the_other_serves_on(fleet: Fleet) -> None:
    fleet.use_policy("round_robin")
    reqs = _killer_requests(12)

    async def run() -> list:
        task = asyncio.create_task(replay(fleet.url, reqs, concurrency=8, timeout_s=180))
        await asyncio.sleep(1.0)
        fleet.kill_worker(1)  # SIGKILL: in-flight requests on it see their connection drop
        return await task

    t0 = time.monotonic()
    results = asyncio.run(run())
    assert time.monotonic() - t0 < 180, "a request hung"
    for r in results:
        # Either an error the client sees, or a complete reply: never silence, never a short reply.
        assert r.error is not None or r.completion_tokens == 64, r
    assert any(r.error is None for r in results)
    # Afterwards every request completes on the survivor.
    after = asyncio.run(replay(fleet.url, _killer_requests(4), concurrency=4, timeout_s=180))
    assert [r.error for r in after] == [None] * 4
    assert all(r.completion_tokens == 64 for r in after)
    assert read_counters(fleet.servers[0].url).prompt_tokens > 0


@pytest.fixture(scope="module")
def dp_server(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CpuServer]:
    cfg = _config(tiny_models["qwen3_next"], "hybrid", dp_size=2)
    cfg.extra.append("--enable-metrics")
    log = tmp_path_factory.mktemp("dp") / "dp.log"
    with CpuServer(cfg, log, on_progress=print) as s:
        yield s


def test_dp_size_2_outputs_equal_the_uncached_server_and_each_rank_answers(
    dp_server: CpuServer, expected: dict
) -> None:
    info = dp_server.get_json("/get_server_info")
    assert info["dp_size"] == 2 and info["radix_cache_backend"] == "hybrid"
    before = read_counters(dp_server.url)
    ranks_before = read_rank_counters(dp_server.url, 2)
    got = _conversations(lambda s, ids: generate(dp_server, ids, NEW))
    delta = read_counters(dp_server.url) - before
    # The cache's own series are labelled by DP rank (SGLang labels both ranks' caches 0):
    # round robin gives each rank prompts of its own, and the ranks add up to the server.
    ranks = [a - b for a, b in zip(read_rank_counters(dp_server.url, 2), ranks_before, strict=True)]
    assert all(r.prompt_tokens > 0 for r in ranks), ranks
    assert sum(r.prompt_tokens for r in ranks) == delta.prompt_tokens
    assert sum(r.cached_tokens for r in ranks) == delta.cached_tokens
    for key, (_ids, reply) in expected.items():
        assert got[key][1]["output_ids"] == reply["output_ids"], f"dp: {key} output differs"
    assert delta.cached_tokens == sum(r["meta_info"]["cached_tokens"] for _, r in got.values())
    # SGLang's DP controller (round robin by default) spreads a session over both ranks, each with
    # its own cache; the later rounds find their prefix on both.
    assert (
        sum(r["meta_info"]["cached_tokens"] for (s, t), (_, r) in got.items() if t == TURNS - 1) > 0
    )
    status, answer = dp_server.post_json("/hybrid/boundaries", {"input_ids": got[(0, 1)][0]})
    assert status == 200, answer
    assert sorted(a["dp_rank"] for a in answer["dp_ranks"]) == [0, 1]


def test_the_dp_aware_router_keeps_each_session_on_one_rank_and_outputs_equal_the_uncached(
    dp_server: CpuServer, expected: dict, tmp_path: Path
) -> None:
    # The router addresses each DP rank itself (url@rank; data_parallel_rank in the body), so
    # cache_aware's prefix tree sends a session's later turns to the rank that holds its prefix,
    # where SGLang's DP controller alone alternates them.
    cfg = RouterConfig(worker_urls=[dp_server.url], policy="cache_aware", dp_aware=True)
    with RouterProcess(cfg, tmp_path / "router.log", on_progress=print) as router:
        targets = sorted(w["url"] for w in router.workers())
        assert targets == [f"{dp_server.url}@0", f"{dp_server.url}@1"]
        flush_cache(dp_server.url)
        before = read_rank_counters(dp_server.url, 2)
        got = _conversations(lambda s, ids: generate(router, ids, NEW))
        after = read_rank_counters(dp_server.url, 2)
    for key, (_ids, reply) in expected.items():
        assert got[key][1]["output_ids"] == reply["output_ids"], f"dp-aware: {key} output differs"
    deltas = [a - b for a, b in zip(after, before, strict=True)]
    # Each rank's own counters add up to what the client saw, token for token.
    assert sum(d.cached_tokens for d in deltas) == sum(
        r["meta_info"]["cached_tokens"] for _, r in got.values()
    )
    assert sum(d.prompt_tokens for d in deltas) == sum(
        r["meta_info"]["prompt_tokens"] for _, r in got.values()
    )
    # Every later turn resumes at least from the last whole block of its previous turn's prompt
    # (SGLang's DP controller alone alternates ranks, and such a turn finds only the preamble).
    for (s, t), (_, r) in got.items():
        if t > 0:
            previous = len(got[(s, t - 1)][0]) // 64 * 64
            assert r["meta_info"]["cached_tokens"] >= previous, f"{(s, t)} lost its session"

"""The scale-out pieces that need no server: launcher arguments, keys, bindings, the report."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from sglang_hybrid.cpu.server import ServerConfig, omp_binding
from sglang_hybrid.replay.live import LiveRequest
from sglang_hybrid.scaleout import bench
from sglang_hybrid.scaleout.launch_router import split_policy
from sglang_hybrid.scaleout.placement import (
    TARGET_WORKER_HEADER,
    ResumeAwarePlacement,
    affinity_key,
    keyed,
)
from sglang_hybrid.scaleout.router import ROUTING_KEY_HEADER, RouterConfig


def test_extra_policies_reach_the_router_core_and_others_pass_through() -> None:
    assert split_policy(["--policy", "consistent_hashing", "--port", "1"]) == (
        ["--policy", "round_robin", "--port", "1"],
        "consistent_hashing",
    )
    assert split_policy(["--policy=prefix_hash"]) == (["--policy=round_robin"], "prefix_hash")
    assert split_policy(["--policy", "cache_aware"]) == (["--policy", "cache_aware"], None)


def test_the_router_config_refuses_what_the_router_would_not_serve() -> None:
    with pytest.raises(ValueError, match="policy 'sticky'"):
        RouterConfig(["http://a"], policy="sticky").argv(1)
    with pytest.raises(ValueError, match="at least one worker"):
        RouterConfig([]).argv(1)
    argv = RouterConfig(["http://a", "http://b"], policy="consistent_hashing", dp_aware=True).argv(
        9
    )
    i = argv.index("--worker-urls")
    assert argv[i + 1 : i + 3] == ["http://a", "http://b"]
    assert "--dp-aware" in argv and argv[argv.index("--prometheus-port") + 1] == "9"


def test_omp_binding_splits_cores_and_shares_them_when_short() -> None:
    assert omp_binding(2, [0, 1]) == "0|1"
    assert omp_binding(2, list(range(8))) == "0-3|4-7"
    assert omp_binding(2, [0, 2, 4, 6]) == "0,2|4,6"
    assert omp_binding(3, [0, 1]) == "0|1|0"
    with pytest.raises(ValueError):
        omp_binding(0, [0])


def test_a_dp_server_gets_its_flag_and_a_binding_unless_the_caller_chose_one(tmp_path: Any) -> None:
    cfg = ServerConfig(tmp_path, dp_size=2)
    assert cfg.argv()[-2:] == ["--dp-size", "2"]
    assert "SGLANG_CPU_OMP_THREADS_BIND" in cfg.env({})
    assert cfg.env({"SGLANG_CPU_OMP_THREADS_BIND": "0|0"})["SGLANG_CPU_OMP_THREADS_BIND"] == "0|0"
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in ServerConfig(tmp_path).env({})
    with pytest.raises(ValueError, match="dp_size 0"):
        ServerConfig(tmp_path, dp_size=0).argv()


def _req(rid: str, ids: list[int], session: str | None = None) -> LiveRequest:
    return LiveRequest(rid, "generate", {"input_ids": ids}, arrival_s=0.0, session=session)


def test_affinity_keys_follow_sessions_else_the_first_512_tokens() -> None:
    a = _req("a", list(range(600)))
    b = _req("b", [*range(512), 9, 9, 9])  # same first 512 tokens, different tail
    c = _req("c", [1, *range(1, 600)])
    assert affinity_key(a) == affinity_key(b) != affinity_key(c)
    assert affinity_key(_req("d", [1], session="s7")) == "s7"
    # Stable across processes: blake2b, not Python's seeded hash().
    assert affinity_key(_req("e", [1, 2, 3])) == affinity_key(_req("f", [1, 2, 3]))
    assert keyed([a])[0].headers[ROUTING_KEY_HEADER] == affinity_key(a)


class _Resp:
    def __init__(self, status: int, body: dict) -> None:
        self.status, self.body = status, body

    async def __aenter__(self) -> _Resp:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def json(self) -> dict:
        return self.body


class _Client:
    """Answers /hybrid/boundaries per worker URL; a missing URL refuses the connection."""

    def __init__(self, depths: dict[str, int]) -> None:
        self.depths = depths

    def post(self, url: str, json: dict) -> _Resp:
        base = url.removesuffix("/hybrid/boundaries")
        if base not in self.depths:
            raise ConnectionRefusedError(base)
        return _Resp(200, {"reusable_now": {"tokens": self.depths[base]}})


def test_resume_aware_placement_sends_to_the_deepest_resume_point() -> None:
    urls = ["http://w0", "http://w1", "http://w2"]
    order = ["http://w2", "http://w0", "http://w1"]  # the router's /workers order
    place = ResumeAwarePlacement(urls, order)
    req = _req("r", list(range(300)), session="s")
    headers = asyncio.run(place(_Client({"http://w0": 64, "http://w1": 256, "http://w2": 0}), req))
    assert headers[TARGET_WORKER_HEADER] == "2"  # w1 is third in the router's list
    assert headers[ROUTING_KEY_HEADER] == "s"
    # Nothing anywhere (one worker down): the key decides, the same way every time.
    a = asyncio.run(place(_Client({"http://w0": 0, "http://w1": 0}), req))
    b = asyncio.run(place(_Client({"http://w0": 0, "http://w1": 0}), req))
    assert a == b and place.placed_by_resume == 1
    with pytest.raises(ValueError, match="does not list"):
        ResumeAwarePlacement(urls, order[:2])


class _DpClient:
    """One --dp-size worker: /hybrid/boundaries answers with every rank's view, ranks shuffled."""

    def __init__(self, per_rank: dict[int, int]) -> None:
        self.per_rank = per_rank

    def post(self, url: str, json: dict) -> _Resp:
        ranks = [
            {"dp_rank": r, "reusable_now": {"tokens": t}}
            for r, t in sorted(self.per_rank.items(), reverse=True)
        ]
        best = max(ranks, key=lambda a: a["reusable_now"]["tokens"])
        return _Resp(200, {**best, "dp_ranks": ranks})


def test_resume_aware_placement_targets_the_deepest_dp_rank_of_a_dp_aware_worker() -> None:
    # The router's --dp-aware list names each rank url@rank; the reply order is not the rank order.
    order = ["http://w0@0", "http://w0@1", "http://w0@2"]
    place = ResumeAwarePlacement(["http://w0"], order)
    assert place.targets == order
    req = _req("r", list(range(300)), session="s")
    headers = asyncio.run(place(_DpClient({0: 64, 1: 0, 2: 192}), req))
    assert headers[TARGET_WORKER_HEADER] == "2" and place.placed_by_resume == 1
    # No rank holds anything: the key picks one of the three ranks, the same one every time.
    a = asyncio.run(place(_DpClient({0: 0, 1: 0, 2: 0}), req))
    assert a == asyncio.run(place(_DpClient({0: 0, 1: 0, 2: 0}), req))
    assert a[TARGET_WORKER_HEADER] in {"0", "1", "2"}


def _result(
    workload: str, workers: int, policy: str, cached: int, topology: str = "servers"
) -> bench.RunResult:
    summary = {
        "cached_tokens": cached,
        "prompt_tokens": 1000,
        "reuse": cached / 1000,
        "ttft_p50_s": 0.05,
        "failed": 0,
    }
    per = [{"prompt_tokens": 1000 // workers, "cached_tokens": cached // workers}] * workers
    return bench.RunResult(workload, workers, policy, summary, 0.1, 1.0, per, topology=topology)


def test_the_report_states_each_run_against_one_server(tmp_path: Any) -> None:
    rs = [
        _result("agent", 1, "single", 800),
        _result("agent", 2, "cache_aware", 760),
        _result("agent", 2, "round_robin", 400),
        _result("agent", 2, "cache_aware", 720, topology="dp"),
    ]
    md = bench.table(rs)
    assert "| agent | 2 | cache_aware | 760 | 76.0% | 95.0% | 50% |" in md
    assert "| agent | 2 | round_robin | 400 | 40.0% | 50.0% |" in md
    assert "| agent | dp 2 | cache_aware | 720 | 72.0% | 90.0% | 50% |" in md
    bench.plot(rs, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_l3_rows_are_read_against_one_server_without_l3(tmp_path: Any) -> None:
    with_l3 = _result("agent", 1, "single", 820)
    with_l3.l3 = "mooncake"
    rr = _result("agent", 2, "round_robin", 720)
    rr.l3, rr.store = "mooncake", {"objects": 12, "nbytes": 3 << 20, "evicted": 0}
    rr.summary["l3_tokens"] = 300
    md = bench.table([_result("agent", 1, "single", 800), with_l3, rr])
    assert "| agent | 1 | single + L3 | 820 | 82.0% | 102.5% |" in md
    assert "| agent | 2 | round_robin + L3 | 720 | 72.0% | 90.0% | 50% |" in md
    assert md.rstrip().endswith("| 300 | 12 (3 MiB) |")
    bench.plot([_result("agent", 1, "single", 800), rr], tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_each_server_gets_its_share_of_every_budget() -> None:
    cfg = bench.server_config(Path("m"), 4, 4 * 1000, 64, host_mib=256)
    assert (cfg.max_total_tokens, cfg.max_mamba_cache_size, cfg.host_cache_mib) == (1000, 16, 64)
    assert "--hybrid-l3" not in cfg.extra
    cfg = bench.server_config(Path("m"), 4, 4000, 64, host_mib=256, l3="mooncake://h:1")
    assert cfg.extra[-2:] == ["--hybrid-l3", "mooncake://h:1"]


def test_the_benchmark_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, msg in [
        (["--policies", "cache_aware,sticky"], "unknown policies"),
        (["--workloads", "chat"], "unknown workloads"),
        (["--workers", "2,4"], "must include 1"),
        (["--workers", "1,3"], "must divide"),
        (["--workers", "1,4", "--total-host-mib", "6"], "must divide"),
        (["--total-host-mib", "-4"], "must be 0 or more"),
        (["--topologies", "ring"], "--topologies"),
        (["--l3", "off,redis"], "--l3"),
        (["--l3", "mooncake"], "give --total-host-mib"),
    ]:
        with pytest.raises(SystemExit):
            bench.parse(argv)
        assert msg in capsys.readouterr().err


class _Flaky(_Client):
    """The first lookup of each worker finds its pooled connection closed by the server."""

    def __init__(self, depths: dict[str, int]) -> None:
        super().__init__(depths)
        self.seen: set[str] = set()

    def post(self, url: str, json: dict) -> _Resp:
        import aiohttp

        if url not in self.seen:
            self.seen.add(url)
            raise aiohttp.ServerDisconnectedError()
        return super().post(url, json)


def test_a_lookup_on_a_closed_keep_alive_connection_is_tried_again() -> None:
    place = ResumeAwarePlacement(["http://w0", "http://w1"], ["http://w0", "http://w1"])
    req = _req("r", list(range(300)), session="s")
    headers = asyncio.run(place(_Flaky({"http://w0": 0, "http://w1": 128}), req))
    assert headers[TARGET_WORKER_HEADER] == "1" and place.placed_by_resume == 1

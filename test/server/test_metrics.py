"""The cache's metrics on SGLang's ``/metrics`` (``--enable-metrics``; issues #16, #38): every
known series exported from the start at 0 with a HELP that says what it counts, the reused and
computed prompt tokens equal to what the replies' ``cached_tokens`` say, why requests resumed
short of their KV match, SGLang's own pool gauges telling load (not cache) idle and loaded, and
every series the Grafana dashboard queries present.

The server has a small cache on purpose (3 device snapshot slots, a 2 MiB host tier), so states
are evicted while their KV blocks stay: the ``evicted`` reason is reached by real traffic.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import generate, serve_hybrid, toks

from sglang_hybrid.cpu.server import CpuServer
from sglang_hybrid.sglang.metrics import PREFIX, SERIES

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^(?P<name>[\w:]+)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$")
SLOTS = 3


@pytest.fixture(scope="module")
def metrics_server(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CpuServer]:
    yield from serve_hybrid(
        tiny_models,
        tmp_path_factory,
        "metrics",
        "--enable-metrics",
        "--hybrid-device-snapshot-slots",
        str(SLOTS),
        host_cache_mib=2,
    )


def scrape_text(server: CpuServer) -> str:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=60) as r:
        return r.read().decode()


def scrape(server: CpuServer) -> dict[tuple[str, frozenset], float]:
    out: dict[tuple[str, frozenset], float] = {}
    for line in scrape_text(server).splitlines():
        m = LINE.match(line)
        if m is None or line.startswith("#"):
            continue
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m["labels"] or ""))
        out[(m["name"], labels)] = float(m["value"])
    return out


def total(metrics: dict, name: str, **want: str) -> float:
    return sum(
        v
        for (n, labels), v in metrics.items()
        if n == name and all((k, w) in labels for k, w in want.items())
    )


def value(metrics: dict, name: str) -> float:
    (v,) = [v for (n, _), v in metrics.items() if n == name]
    return v


@pytest.fixture(scope="module")
def first_scrape(metrics_server: CpuServer) -> str:
    """Before any request of these tests (the server's own warm-up request has run)."""
    return scrape_text(metrics_server)


def test_every_series_is_there_from_the_start(first_scrape: str) -> None:
    samples = {}
    for line in first_scrape.splitlines():
        m = LINE.match(line)
        if m is not None and not line.startswith("#"):
            samples.setdefault(m["name"], []).append(
                dict(re.findall(r'(\w+)="([^"]*)"', m["labels"] or ""))
            )
    for s in SERIES:
        name = PREFIX + s.name
        assert name in samples, name
        have = {tuple(lab[k] for k in s.labels) for lab in samples[name]}
        assert have == set(s.values), (name, have)
        assert all(lab.get("model_name") for lab in samples[name]), name
        help_line = next(ln for ln in first_scrape.splitlines() if ln.startswith(f"# HELP {name} "))
        assert s.help in help_line, help_line
    # Nothing has resumed short yet, and nothing failed: zeros, not absent series.
    assert first_scrape.count(PREFIX + "short_resumes_total{") == 6


def test_prompt_tokens_add_up_to_the_replies(metrics_server: CpuServer, first_scrape: str) -> None:
    a, b = toks(201, 300), toks(202, 500)
    session = [a, a + toks(203, 40), b, b[:400] + toks(204, 30), a + toks(205, 90)]
    name = PREFIX + "prompt_tokens_total"
    before = scrape(metrics_server)
    was = {s: total(before, name, source=s) for s in ("reused_device", "reused_host", "computed")}
    cached = computed = 0
    for prompt in session:
        meta = generate(metrics_server, prompt, max_new=6)["meta_info"]
        cached += meta["cached_tokens"]
        computed += meta["prompt_tokens"] - meta["cached_tokens"]
    assert cached > 0
    m = scrape(metrics_server)
    now = {s: total(m, name, source=s) for s in was}
    reused = now["reused_device"] + now["reused_host"] - was["reused_device"] - was["reused_host"]
    assert reused == cached
    assert now["computed"] - was["computed"] == computed
    assert total(m, PREFIX + "host_tier_written_bytes_total") > 0
    assert total(m, PREFIX + "snapshots") > 0
    assert total(m, PREFIX + "host_tier_capacity_bytes") == 2 << 20
    assert total(m, PREFIX + "device_snapshot_slots_capacity") == SLOTS


def test_why_requests_resumed_short(metrics_server: CpuServer) -> None:
    """A prompt leaving an earlier one mid-way finds its KV but no state there (no_state); a
    prompt whose states other traffic evicted finds its KV only (evicted)."""
    tokens = PREFIX + "short_resume_tokens_total"
    before = scrape(metrics_server)
    a = toks(301, 400)
    generate(metrics_server, a, max_new=4)
    branch = generate(metrics_server, a[:200] + toks(302, 50), max_new=4)["meta_info"]
    after_branch = scrape(metrics_server)
    # a's first 3 blocks matched; no state lies at or below 192 on its path
    grew = total(after_branch, tokens, reason="no_state") - total(before, tokens, reason="no_state")
    assert grew == 192 - branch["cached_tokens"] > 0, branch
    for seed in range(6):  # other traffic takes the 3 device slots and the small host tier
        generate(metrics_server, toks(310 + seed, 300), max_new=4)
    again = generate(metrics_server, a, max_new=4)["meta_info"]
    m = scrape(metrics_server)
    evicted = total(m, tokens, reason="evicted") - total(after_branch, tokens, reason="evicted")
    assert again["cached_tokens"] < 384 and evicted == 384 - again["cached_tokens"], again
    assert total(m, PREFIX + "short_resumes_total", reason="evicted") >= 1


def _gauges(server: CpuServer) -> dict[str, float]:
    m = scrape(server)
    names = ("token_usage", "mamba_usage", "mamba_evictable_tokens", "num_running_reqs")
    return {n: value(m, "sglang:" + n) for n in names}


def test_sglang_pool_gauges_count_the_cache_as_cache(metrics_server: CpuServer) -> None:
    """Idle: 0 usage, every snapshot slot evictable (issue #38: 0.84 and 0 with the cache
    holding 27 of 32 slots). Loaded: the running request's slot, not the snapshot slots."""
    generate(metrics_server, toks(401, 300), max_new=4)
    deadline = time.monotonic() + 60  # SGLang republishes idle gauges within 30 s
    idle = _gauges(metrics_server)
    while (idle["num_running_reqs"] or idle["token_usage"]) and time.monotonic() < deadline:
        time.sleep(2)
        idle = _gauges(metrics_server)
    assert idle["token_usage"] == 0 and idle["mamba_usage"] == 0, idle
    assert idle["mamba_evictable_tokens"] == SLOTS, idle
    result: dict = {}
    body = {
        "input_ids": toks(402, 200),
        "sampling_params": {"max_new_tokens": 600, "temperature": 0, "ignore_eos": True},
    }
    worker = threading.Thread(
        target=lambda: result.update(metrics_server.post_json("/generate", body)[1])
    )
    worker.start()
    seen: list[dict[str, float]] = []
    try:
        while worker.is_alive():
            seen.append(_gauges(metrics_server))
            if seen[-1]["num_running_reqs"] >= 1 and seen[-1]["mamba_usage"] > 0:
                break
            time.sleep(0.2)
    finally:
        worker.join()
    assert result["meta_info"]["completion_tokens"] == 600, result["meta_info"]
    loaded = seen[-1] if seen else {}
    assert loaded.get("num_running_reqs", 0) >= 1, seen
    # One running request holds one of the pool's 32 state slots (ServerConfig's
    # --max-mamba-cache-size); the 3 snapshot slots are not load.
    assert 0 < loaded["mamba_usage"] <= 2 / 32 and 0 < loaded["token_usage"] < 0.5, loaded


def test_every_series_the_dashboard_queries_exists(metrics_server: CpuServer) -> None:
    dash = json.loads((ROOT / "dashboards" / "sglang-hybrid.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs.append(dash["templating"]["list"][1]["query"]["query"])
    names = {n for e in exprs for n in re.findall(r"\b(sglang(?:_hybrid)?:\w+)", e)}
    assert len(names) >= 15, names
    scraped = {n for n, _ in scrape(metrics_server)}
    assert names <= scraped, names - scraped
    # ... and what the docs list is what the server exports.
    doc = (ROOT / "docs" / "compaction.md").read_text()
    for s in SERIES:
        assert f"`{s.name}`" in doc, s.name

"""The cache's metrics on SGLang's ``/metrics`` (``--enable-metrics``; issue #16): after a scripted
session, the reused and computed prompt tokens are what the replies' ``cached_tokens`` say."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import generate, serve_hybrid, toks

from sglang_hybrid.cpu.server import CpuServer

LINE = re.compile(r"^(?P<name>[\w:]+)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$")


@pytest.fixture(scope="module")
def metrics_server(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CpuServer]:
    yield from serve_hybrid(tiny_models, tmp_path_factory, "metrics", "--enable-metrics")


def scrape(server: CpuServer) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=60) as r:
        text = r.read().decode()
    out: dict[tuple[str, frozenset], float] = {}
    for line in text.splitlines():
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


def test_prompt_tokens_add_up_to_the_replies(metrics_server: CpuServer) -> None:
    a, b = toks(201, 300), toks(202, 500)
    session = [a, a + toks(203, 40), b, b[:400] + toks(204, 30), a + toks(205, 90)]
    name = "sglang_hybrid:prompt_tokens_total"
    before = scrape(metrics_server)  # the server's warm-up request is counted too
    was = {s: total(before, name, source=s) for s in ("reused_device", "reused_host", "computed")}
    cached = computed = 0
    for prompt in session:
        meta = generate(metrics_server, prompt, max_new=6)["meta_info"]
        cached += meta["cached_tokens"]
        computed += meta["prompt_tokens"] - meta["cached_tokens"]
    assert cached > 0
    m = scrape(metrics_server)
    now = {s: total(m, name, source=s) for s in was}
    assert now["reused_device"] + now["reused_host"] - was["reused_device"] - was[
        "reused_host"
    ] == (cached)
    assert now["computed"] - was["computed"] == computed
    # The other series exist and say what the session did: the host tier was written through,
    # snapshots are held, SGLang's own cache collector is there.
    assert total(m, "sglang_hybrid:host_bytes_total", direction="written") > 0
    assert total(m, "sglang_hybrid:snapshots") > 0
    assert total(m, "sglang_hybrid:host_tier_bytes", state="capacity") == 64 << 20
    assert any(n.startswith("sglang:") for n, _ in m)

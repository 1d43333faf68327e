"""``examples/compaction.py`` against the CPU server: every verdict, and for each the next
request's ``cached_tokens`` equals the ``retained_prefix_tokens`` the server reported (#16)."""

from __future__ import annotations

import io

from sglang_hybrid.client import ClientError, HybridClient
from sglang_hybrid.cpu.server import CpuServer


def test_every_verdict_reuses_what_was_reported(hybrid_server: CpuServer, script) -> None:
    out = io.StringIO()
    records = script("examples/compaction.py").run(HybridClient(hybrid_server.url), seed=3, out=out)
    print("\n" + out.getvalue())
    verdicts = [r["verdict"] for r in records]
    assert verdicts == ["aligned", "snapped", "partial-reuse", "full-re-prefill"], out.getvalue()
    for r in records:
        assert r["cached_tokens"] == r["retained_prefix_tokens"], r
    assert records[0]["retained_prefix_tokens"] == records[0]["proposal"]  # aligned: Δ0
    assert records[-1]["retained_prefix_tokens"] == 0


def test_the_client_raises_the_servers_reason(hybrid_server: CpuServer) -> None:
    with HybridClient(hybrid_server.url) as c:
        try:
            c.boundaries(input_ids=[1, 2], cut=9)
            raise AssertionError("a cut past the prompt was accepted")
        except ClientError as e:
            assert (e.status, e.param, e.code) == (400, "cut", "out_of_range"), e
            assert "a cut is a token position in [0, 2]" in e.message and e.type
        assert c.props()["n_ctx"] > 0  # the same client goes on after an error

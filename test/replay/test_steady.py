"""Steady state: unrelated warm-up traffic, replays after it, the skip counters in the report."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import numpy as np
import pytest
from replay_fixtures import settings

from sglang_hybrid.replay import cli, steady
from sglang_hybrid.replay.driver import plan_for, replay
from sglang_hybrid.replay.errors import ReplayError
from sglang_hybrid.replay.report import SweepPoint, markdown, to_json
from sglang_hybrid.replay.warmup import (
    FILL_FACTOR,
    SLOT_FACTOR,
    check_disjoint,
    pool_warmup,
    unrelated_warmup,
    without_hints,
)
from sglang_hybrid.sglang.skips import KINDS

CACHES = ("hybrid", "no_buffer")


def test_warmup_is_seeded_disjoint_and_shaped_like_the_trace(small_agent_trace):
    a = unrelated_warmup(small_agent_trace, requests=20, seed=3)
    b = unrelated_warmup(small_agent_trace, requests=20, seed=3)
    assert [r.rid for r in a.requests] == [f"warmup.{k}" for k in range(20)]
    assert all(np.array_equal(x.input_ids, y.input_ids) for x, y in zip(a.requests, b.requests))
    other = unrelated_warmup(small_agent_trace, requests=20, seed=4)
    assert not np.array_equal(a.requests[0].input_ids, other.requests[0].input_ids)
    firsts = {int(r.input_ids[0]) for r in small_agent_trace.requests}
    shapes = {(r.n, r.output_len) for r in small_agent_trace.requests}
    for r in a.requests:
        assert int(r.input_ids[0]) not in firsts  # no prefix in common with any trace prompt
        assert (r.n, r.output_len) in shapes
        assert r.arrival_s == 0.0 and not r.after and not r.hint_positions
    # A warm-up that starts like a trace prompt is refused.
    a.requests[0].input_ids = small_agent_trace.requests[0].input_ids.copy()
    with pytest.raises(ReplayError, match="starts like a trace prompt"):
        check_disjoint(a, small_agent_trace)


def test_pool_warmup_covers_the_kv_pool_and_the_state_slots(small_agent_trace, qwen3_next_dir):
    plan = plan_for("no_buffer", settings(qwen3_next_dir))
    warm = pool_warmup(small_agent_trace, plan)
    kv = sum(r.n + r.output_len for r in warm.requests)
    assert kv >= FILL_FACTOR * plan.kv_tokens
    assert len(warm.requests) >= SLOT_FACTOR * plan.state_slots


def test_drop_hints(small_agent_trace):
    bare = without_hints(small_agent_trace)
    assert any(r.hint_positions for r in small_agent_trace.requests)
    assert not any(r.hint_positions or r.hint_kinds for r in bare.requests)
    assert all(
        np.array_equal(a.input_ids, b.input_ids)
        for a, b in zip(bare.requests, small_agent_trace.requests)
    )


@pytest.fixture(scope="module")
def prefilled(small_agent_trace, qwen3_next_dir):
    """Each cache's replay of the small trace after a warm-up that fills its pools."""
    cfg = settings(qwen3_next_dir)
    warm = pool_warmup(small_agent_trace, plan_for("no_buffer", cfg))
    return warm, {c: replay(small_agent_trace, c, cfg, warm) for c in CACHES}


def test_the_warmup_fills_the_pools_and_is_not_counted(prefilled, agent_replays):
    warm, runs = prefilled
    for cache, res in runs.items():
        w = res.warmup
        assert w["requests"] == len(warm.requests)
        # Everything the warm-up left is cache, nearly the whole KV pool, and evictable.
        assert w["kv_used"] >= 0.9 * w["kv_tokens"], (cache, w)
        assert w["kv_evictable"] >= 0.9 * w["kv_used"], (cache, w)
        if cache == "hybrid":
            assert w["snapshot_slots_used"] == w["snapshot_slots"] > 0
            assert w["cache_stats"]["endpoints_published"] >= w["snapshot_slots"]
        else:
            assert w["state_slots_used"] > 0
        # The measured part: the trace's requests only, all finished after the warm-up ended.
        flushed = agent_replays[cache]
        assert [r.rid for r in res.records] == [r.rid for r in flushed.records]
        assert all(r.release_s >= w["end_s"] for r in res.records)
        assert all(r.finish_type == "length" for r in res.records)
        assert res.summary().prompt_tokens == flushed.summary().prompt_tokens
        assert res.passes == res.extend_passes + res.decode_passes > 0
    # hybrid's counters cover the measured requests only (the warm-up's are subtracted): at most
    # one endpoint per measured request, though the warm-up published some too.
    hy = runs["hybrid"]
    assert 0 < hy.cache_stats["endpoints_published"] <= len(hy.records)


def test_the_report_carries_the_skip_counters_and_the_warmup(prefilled, agent_replays):
    _, runs = prefilled
    for point in (SweepPoint(4.0, 0.0, runs), SweepPoint(4.0, 0.0, dict(agent_replays))):
        data = to_json([point], {"title": "t"})
        by_cache = {r["cache"]: r for r in data["points"][0]["runs"]}
        skips = by_cache["hybrid"]["skips"]
        assert set(KINDS) <= set(skips) and "recomputed_tokens" in skips
        assert all(skips[k] == point.results["hybrid"].cache_stats[k] for k in skips)
        assert by_cache["no_buffer"]["skips"] == {}
        assert by_cache["hybrid"]["mean_in_flight"] >= 1.0
        text = markdown([point], {"title": "t"})
        assert "Skipped opportunities" in text
        header = next(x for x in text.splitlines() if x.startswith("| cache | tap_no_slot"))
        assert all(k in header for k in KINDS)
    assert "Unrelated warm-up" in markdown([SweepPoint(4.0, 0.0, runs)], {})
    assert "Unrelated warm-up" not in markdown([SweepPoint(4.0, 0.0, dict(agent_replays))], {})


def test_steady_state_comparison(prefilled, agent_replays, tmp_path):
    _, runs = prefilled
    flushed = to_json([SweepPoint(4.0, 0.0, {c: agent_replays[c] for c in CACHES})], {})
    pre = to_json([SweepPoint(4.0, 0.0, runs)], {})
    doc = steady.compare([("agent", flushed, pre)])
    rows = {r["cache"]: r for r in doc["rows"]}
    assert set(rows) == set(CACHES)
    for cache, r in rows.items():
        f, p = agent_replays[cache].summary(), runs[cache].summary()
        assert r["flushed"]["reused_tokens"] == f.reused_tokens
        assert r["prefilled"]["prefill_tokens"] == p.prefill_tokens
        assert r["reused_change"] == pytest.approx(
            (p.reused_tokens - f.reused_tokens) / f.reused_tokens
        )
        assert r["within_target"] == (r["reused_change"] >= -steady.TARGET)
    assert "tap_no_slot" in rows["hybrid"]["prefilled"]["counters"]
    md = steady.write(tmp_path, doc, "### header").read_text()
    assert md.startswith("### header")
    assert json.loads((tmp_path / "steady_state.json").read_text())["rows"]
    assert f"| agent | 4 GiB | hybrid | {rows['hybrid']['prompt_tokens']:,} |" in md
    with pytest.raises(ValueError, match="ran no warm-up"):
        steady.compare([("agent", flushed, flushed)])


def test_cli_refuses_two_warmup_sizes(capsys):
    with pytest.raises(SystemExit, match="prefill-pool"):
        cli.main(["run", "--trace", "agent", "--prefill-pool", "--warmup-unrelated", "3"])


# ------------------------------------------------------------ live, against a fake server
class _Fake(BaseHTTPRequestHandler):
    sent: ClassVar[list[str]] = []
    flushed: ClassVar[int] = 0

    def log_message(self, *args):  # quiet
        pass

    def _reply(self, status, body, ctype="application/json"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self._reply(200, {})
        elif self.path == "/flush_cache":
            type(self).flushed += 1
            self._reply(200, b"Cache flushed.\n", "text/plain")
        elif self.path == "/server_info":
            self._reply(200, {"max_total_tokens": 3000, "max_mamba_cache_size": 6})
        else:
            self._reply(404, {"error": "no"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).sent.append(body["rid"])
        n = len(body["input_ids"])
        meta = {"prompt_tokens": n, "cached_tokens": n // 2, "completion_tokens": 1}
        data = b"data: " + json.dumps({"text": "x", "meta_info": meta}).encode() + b"\n\n"
        data += b"data: [DONE]\n\n"
        self._reply(200, data, "text/event-stream")


def test_live_flushes_prefills_and_leaves_the_warmup_out(tmp_path, capsys, small_agent_trace):
    _Fake.sent, _Fake.flushed = [], 0  # class state: a rerun in the same process starts clean
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    out = tmp_path / "live.json"
    sessions = tmp_path / "t.jsonl"
    from sglang_hybrid.replay.traces.sessions import write_sessions

    write_sessions(small_agent_trace.requests[:6], sessions)
    try:
        argv = ["live", "--url", url, "--trace", f"sessions:{sessions}", "--flush"]
        argv += ["--prefill-pool", "--pace", "0", "--out", str(out)]
        assert cli.main(argv) == 0
    finally:
        server.shutdown()
    data = json.loads(out.read_text())
    assert _Fake.flushed == 1
    warm = [r for r in _Fake.sent if r.startswith("warmup.")]
    assert len(warm) >= SLOT_FACTOR * 6 and _Fake.sent[: len(warm)] == warm  # warm-up first
    assert data["warmup"]["requests"] == len(warm)
    assert data["summary"]["requests"] == 6
    assert [r["rid"] for r in data["requests"]] == [r.rid for r in small_agent_trace.requests[:6]]


class _Busy(BaseHTTPRequestHandler):
    """Refuses ``/flush_cache`` as SGLang does while requests run, ``busy`` times."""

    busy: ClassVar[int] = 0
    asked: ClassVar[int] = 0

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        cls = type(self)
        cls.asked += 1
        status, body = (400, b"Flush cache failed.\n") if cls.asked <= cls.busy else (200, b"ok")
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_a_flush_waits_for_the_requests_it_did_not_send():
    """A router that just started probes its workers with real generations: the flush asks again
    until the server is idle, and gives up with the server's answer when it never is."""
    from sglang_hybrid.replay.live import LiveError, flush_cache

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        _Busy.busy, _Busy.asked = 3, 0
        flush_cache(url)
        assert _Busy.asked == 4
        _Busy.busy, _Busy.asked = 10**6, 0
        with pytest.raises(LiveError, match="Flush cache failed"):
            flush_cache(url, wait_s=0.5)
        assert _Busy.asked >= 2
    finally:
        server.shutdown()

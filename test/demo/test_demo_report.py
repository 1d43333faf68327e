"""``make demo``'s verdicts: identical outputs, totals and ratios, from LiveResults."""

from __future__ import annotations

import json
from pathlib import Path

from sglang_hybrid.demo.report import CacheRun, mismatches, ratios, table, totals, write_json
from sglang_hybrid.replay.chat_session import agent_session
from sglang_hybrid.replay.live import LiveResult


def _run(name: str, cached: list[int], outputs: list[str], error: str | None = None) -> CacheRun:
    results = [
        LiveResult(
            f"r{i}",
            "what",
            None,
            i,
            prompt_tokens=1000,
            cached_tokens=c,
            completion_tokens=4,
            output=out,
            ttft_s=0.5,
            latency_s=1.0,
        )
        for i, (c, out) in enumerate(zip(cached, outputs, strict=True))
    ]
    results[-1].error = error
    return CacheRun(name, results, ["argv"], 1.0)


def test_outputs_that_differ_or_fail_are_named() -> None:
    a = _run("hybrid", [0, 900], ["x", "y"])
    assert mismatches([a, _run("built-in", [0, 0], ["x", "y"])]) == []
    assert mismatches([a, _run("built-in", [0, 0], ["x", "z"])]) == ["r1"]
    assert mismatches([a, _run("built-in", [0, 0], ["x", "y"], error="boom")]) == ["r1"]


def test_totals_ratios_and_json(tmp_path: Path) -> None:
    runs = [_run("hybrid", [0, 900], ["x", "y"]), _run("built-in", [0, 500], ["x", "y"])]
    tot = totals(runs)
    assert tot["hybrid"]["prefilled_tokens"] == 1100 and tot["built-in"]["prefilled_tokens"] == 1500
    assert abs(ratios(tot)["prefilled built-in / hybrid"] - 1500 / 1100) < 1e-9
    assert "r1" in table(runs).splitlines()[-1]
    write_json(tmp_path / "demo.json", runs, {"note": "test"})
    doc = json.loads((tmp_path / "demo.json").read_text())
    assert doc["identical_outputs"] and doc["runs"][1]["requests"][1]["cached_tokens"] == 500


def test_the_session_is_closed_loop_and_deterministic() -> None:
    a, b = agent_session(), agent_session()
    assert [r.body for r in a] == [r.body for r in b]
    assert a[0].after == () and all(r.after == (a[i].rid,) for i, r in enumerate(a[1:]))
    retry = {r.rid: r for r in a}
    assert retry["main-4-retry"].body["messages"] == retry["main-4"].body["messages"]
    # The edit changes one early message and keeps everything after it.
    edit, last = retry["main-edit"].body["messages"], retry["main-5"].body["messages"]
    assert len(edit) == len(last) and [i for i in range(len(edit)) if edit[i] != last[i]] == [3]

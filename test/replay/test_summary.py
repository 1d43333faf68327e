"""``benchmark/replay/summary.py``: the at-a-glance table read from recorded replay reports."""

from __future__ import annotations

import json
from pathlib import Path


def _report(path: Path, points: list[tuple[float, float, dict[str, int]]]) -> None:
    prompt = 1000
    path.mkdir(parents=True)
    doc = {
        "date": "2026-12-03",
        "points": [
            {
                "device_gib": dev,
                "host_gib": host,
                "runs": [
                    {
                        "cache": c,
                        "summary": {"prefill_tokens": n, "reuse_fraction": 1 - n / prompt},
                    }
                    for c, n in computed.items()
                ],
            }
            for dev, host, computed in points
        ],
    }
    (path / "report.json").write_text(json.dumps(doc))


def test_rows_compare_hybrid_with_the_better_sglang_placement(tmp_path: Path, script):
    summary = script("benchmark/replay/summary.py")
    four = {"hybrid": 600, "no_buffer": 800, "extra_buffer": 750, "oracle": 500}
    _report(tmp_path / "agent", [(16.0, 0.0, four), (32.0, 0.0, {**four, "hybrid": 900})])
    _report(tmp_path / "mooncake-host", [(32.0, 96.0, {"hybrid": 700, "no_buffer": 650})])
    records, missing = summary.collect(tmp_path)
    assert [r["run"] for r in records] == ["agent", "agent", "mooncake-host"]
    assert records[0]["hybrid_vs_best_sglang"] == 600 / 750  # extra_buffer is the better one
    assert records[1]["hybrid_vs_best_sglang"] == 900 / 750
    assert records[2]["budget"] == "32 + 96 host (SGLang: 128)"
    assert "agent-hintless" in missing and "agent" not in missing
    md = summary.markdown(records)
    assert "| **0.800** |" in md and "| 1.200 |" in md  # a win is bold, a loss is not
    assert "600 (40.0 %)" in md


def test_no_runs_is_an_error_not_an_empty_table(tmp_path: Path, capsys, monkeypatch, script):
    summary = script("benchmark/replay/summary.py")
    monkeypatch.setattr("sys.argv", ["summary.py", "--results", str(tmp_path)])
    assert summary.main() == 1
    assert "no runs found" in capsys.readouterr().err

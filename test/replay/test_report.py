import json

from sglang_hybrid.replay.report import SweepPoint, markdown, write_report

PNG = b"\x89PNG\r\n\x1a\n"


def test_report_files(tmp_path, agent_replays):
    sweep = [SweepPoint(4.0, 0.0, agent_replays), SweepPoint(8.0, 0.0, agent_replays)]
    meta = {"title": "t", "command": "sglang-hybrid replay run --trace agent", "date": "d"}
    files = write_report(sweep, tmp_path / "out", meta)
    data = json.loads(files.json.read_text())
    assert data["command"] == meta["command"]
    assert [p["device_gib"] for p in data["points"]] == [4.0, 8.0]
    runs = {r["cache"]: r for r in data["points"][0]["runs"]}
    assert set(runs) == set(agent_replays)
    for cache, res in agent_replays.items():
        s = res.summary()
        got = runs[cache]["summary"]
        assert got["prefill_tokens"] == s.prefill_tokens
        assert got["reused_tokens"] == s.reused_tokens
        assert got["host_bytes_restored"] == 0
        assert got["ttft_p95_s"] == s.ttft_p95_s
        assert runs[cache]["plan"]["kv_tokens"] == res.plan.kv_tokens
        assert sum(t["prompt_tokens"] for t in runs[cache]["by_tag"].values()) == s.prompt_tokens
    text = files.markdown.read_text()
    assert text == markdown(sweep, meta) + "\n"
    for cache, res in agent_replays.items():
        row = next(
            line
            for line in text.splitlines()
            if line.startswith(f"| {cache} | {res.summary().prompt_tokens:,}")
        )
        assert f"{res.summary().prefill_tokens:,}" in row
    for png in (files.reuse_plot, files.ttft_plot):
        assert png.read_bytes()[:8] == PNG and png.stat().st_size > 5000


def test_the_reuse_plot_reads_with_one_budget_or_several(agent_replays):
    """One budget: a bar per cache with its value (issue #38: each cache was a dot on an axis
    zoomed to 15.2-16.8); several: a line per cache. Every axis starts at 0."""
    from sglang_hybrid.replay.report import reuse_figure

    one = reuse_figure([SweepPoint(4.0, 0.0, agent_replays)])
    for ax in one.axes:
        assert len(ax.patches) == len(agent_replays)  # the bars
        assert len(ax.texts) == len(agent_replays)  # their values
        assert ax.get_ylim()[0] == 0
        assert [t.get_text() for t in ax.get_xticklabels()] == list(agent_replays)
    many = reuse_figure([SweepPoint(g, 0.0, agent_replays) for g in (4.0, 8.0)])
    for ax in many.axes:
        assert len(ax.lines) == len(agent_replays) and ax.get_ylim()[0] == 0

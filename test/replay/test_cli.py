import json

import numpy as np
import pytest

from sglang_hybrid import cli as top
from sglang_hybrid.replay import cli
from sglang_hybrid.replay.generators.workload import agent_workload
from sglang_hybrid.replay.traces.sessions import load_sessions


def test_plan_prints_each_cache(capsys):
    assert cli.main(["plan", "--budget-gib", "16", "--geometry", "qwen3-next-80b"]) == 0
    out = capsys.readouterr().out
    for cache in ("hybrid", "no_buffer", "extra_buffer", "oracle"):
        assert f"  {cache}: " in out
    assert "snapshot slots" in out


def test_plan_names_a_budget_too_small_for_a_cache(capsys):
    """A plan whose budget holds too little for one cache says so on that cache's line and still
    plans the others (it used to end in a traceback)."""
    assert cli.main(["plan", "--budget-gib", "0.5", "--geometry", "qwen3-next-80b"]) == 0
    out = capsys.readouterr().out
    assert "hybrid: a 0.50 GiB budget leaves" in out and "too small for hybrid" in out
    assert "no_buffer:" in out


def test_generate_writes_the_workload_it_replays(tmp_path, capsys):
    path = tmp_path / "agent.jsonl"
    argv = ["generate", "agent", "--out", str(path), "--sessions", "2", "--seed", "7"]
    assert cli.main(argv) == 0
    back = load_sessions(path)
    want = agent_workload(sessions=2, seed=7)
    assert [r.rid for r in back.requests] == [r.rid for r in want.requests]
    assert all(
        np.array_equal(a.input_ids, b.input_ids) for a, b in zip(back.requests, want.requests)
    )


def test_top_level_dispatch(capsys):
    assert top.main(["replay", "plan", "--budget-gib", "8"]) == 0
    assert "budget 8 GiB" in capsys.readouterr().out
    assert top.main(["bogus"]) == 2
    assert top.main([]) == 2
    assert top.main(["--help"]) == 0


def test_run_writes_a_report(tmp_path, capsys, qwen3_next_dir, small_agent_trace):
    from sglang_hybrid.replay.traces.sessions import write_sessions

    trace = write_sessions(small_agent_trace.requests[:12], tmp_path / "t.jsonl")
    out = tmp_path / "report"
    argv = [
        "run",
        "--trace",
        f"sessions:{trace}",
        "--caches",
        "oracle",
        "--budget-gib",
        "4",
        "--max-running",
        "8",
        "--chunk",
        "256",
        "--max-prefill-tokens",
        "512",
        "--model-dir",
        str(qwen3_next_dir),
        "--out",
        str(out),
        "--no-progress",
    ]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    prompt = sum(r.n for r in small_agent_trace.requests[:12])
    assert f"| oracle | {prompt:,} |" in text
    md = (out / "report.md").read_text()
    assert "sglang-hybrid replay run --trace sessions:" in md
    assert (out / "ttft_cdf.png").exists()
    # The report carries what the run measured: the sessions' follow-ups resume, so the oracle
    # (every prefix kept) reuses a real share of the prompt tokens, and the table says so.
    (point,) = json.loads((out / "report.json").read_text())["points"]
    (run,) = point["runs"]
    s = run["summary"]
    assert run["cache"] == "oracle" and s["prompt_tokens"] == prompt
    assert 0.3 < s["reused_tokens"] / prompt < 1.0, s
    assert f"| oracle | {prompt:,} | {s['reused_tokens']:,} " in md


def test_capture_grid_without_zero_split_is_refused(tmp_path):
    argv = ["run", "--trace", "agent", "--sessions", "1", "--budget-gib", "16"]
    argv += ["--capture-grid", "chunk", "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="add --tap-mode zero-split"):
        cli.main(argv)


def _hybrid_options(settings):  # type: ignore[no-untyped-def]
    """The ``HybridOptions`` the replay hands SGLang's scheduler for ``settings``' host order
    and exclusivity, passed as ``driver.py`` passes them."""
    from sglang_hybrid.replay.caches import scheduler_kwargs
    from sglang_hybrid.replay.driver import plan_for

    kw = scheduler_kwargs(
        plan_for("hybrid", settings),
        chunk=256,
        max_prefill_tokens=512,
        context_length=4096,
        host_order=settings.host_order,
        host_exclusive=settings.host_exclusive,
    )
    return kw["server_args_attrs"]["_hybrid_options"]


def test_the_host_order_reaches_the_cache_options() -> None:
    """``--host-order`` is the backend's ``--hybrid-host-order``: the same choices, passed on."""
    argv = ["run", "--trace", "agent", "--budget-gib", "16", "--host-gib", "8"]
    parser = cli.build_parser()
    for order in ("duel", "gdsf", "learned"):
        args = parser.parse_args([*argv, "--host-order", order] if order != "duel" else argv)
        settings = cli._settings(args, 16)
        assert settings.host_order == order
        assert _hybrid_options(settings).host_order == order
    with pytest.raises(SystemExit):
        parser.parse_args([*argv, "--host-order", "lru"])


def test_host_exclusive_reaches_the_cache_options() -> None:
    """``--host-exclusive`` is the backend's ``--hybrid-host-exclusive``; unset, the backend's
    default (None) is passed on."""
    argv = ["run", "--trace", "agent", "--budget-gib", "16", "--host-gib", "8"]
    parser = cli.build_parser()
    for flag, want in (([], None), (["--host-exclusive"], True), (["--no-host-exclusive"], False)):
        settings = cli._settings(parser.parse_args([*argv, *flag]), 16)
        assert settings.host_exclusive is want
        assert _hybrid_options(settings).host_exclusive is want


def test_tier_census_counts_the_tiers_of_a_replay(tmp_path, qwen3_next_dir, script):
    """``benchmark/replay/tier_census.py`` around a real ``hybrid`` replay with a host tier: its
    censuses are taken during the run and written with the replay's arguments."""
    mod = script("benchmark/replay/tier_census.py")
    out = tmp_path / "census.json"
    replay = ["--trace", "chat", "--limit", "40", "--caches", "hybrid", "--budget-gib", "1.5"]
    replay += ["--geometry", "qwen3-next-80b", "--host-gib", "1", "--chunk", "256"]
    replay += ["--max-prefill-tokens", "512", "--model-dir", str(qwen3_next_dir)]
    replay += ["--out", str(tmp_path / "report"), "--no-progress"]
    assert mod.main(["--every", "1", "--json", str(out), "--", *replay]) == 0
    doc = json.loads(out.read_text())
    assert doc["args"] == replay and doc["censuses"], doc
    last = doc["censuses"][-1]
    held = sum(last["blocks"].values())
    assert held > 0 and last["host_slabs"] > 0, last
    assert any(k.startswith(("host/", "dup/")) for c in doc["censuses"] for k in c["blocks"])
    with pytest.raises(SystemExit):  # argparse's error: a census every 0 calls means nothing
        mod.main(["--every", "0", "--", *replay])
